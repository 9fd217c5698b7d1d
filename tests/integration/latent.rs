//! Latent and conditional models (docs/design.md §20), with real diffusers classes: networks
//! exported with their condition held fixed, and a latent run (a VAE and a DiT) watched end to
//! end. Every ICR is compared with `tests/integration/latent_reference.py`, an independent
//! PyTorch/scipy transcription of the protocol that calls the *eager* diffusers modules.

use crate::common::{diffmon, run_python, stderr, stdout};
use serde_json::Value;
use std::path::Path;

/// ICR's settings in both diffmon's configs and the references.
const ICR: &str = "icr: {samples: 128, seed: 3, sigma: 0.29, batch_size: 32}";

/// The float32 forward passes are the same operations in the same order on one thread, in the
/// exported file and in the eager module, so the features agree to the last bit or nearly; ICR
/// then differs only by float64 rounding of the moments and the eigensolvers (measured: 1e-15
/// relative; calling the network with class 3 instead of the null class moves ICR by 1.5e-2).
/// 1e-6 is the issue's bound.
const RELATIVE: f64 = 1e-6;

fn records(out: &std::process::Output) -> Vec<Value> {
    stdout(out)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

fn eval(config: &Path, checkpoint: &Path) -> Value {
    let out = diffmon(&[
        "eval",
        "--config",
        config.to_str().unwrap(),
        checkpoint.to_str().unwrap(),
        "--json",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    records(&out).remove(0)
}

fn close(what: &str, ours: f64, theirs: f64) {
    assert!(
        (ours - theirs).abs() <= RELATIVE * theirs.abs(),
        "{what}: diffmon {ours}, reference {theirs} (relative {:.2e})",
        (ours - theirs).abs() / theirs.abs()
    );
}

/// A class-conditional `UNet2DModel` (11 class embeddings, the last one the null class) and a
/// class-conditional `DiTTransformer2DModel` (10 classes and label dropout: the null class is
/// the extra row, 10) exported with the exporter's default, the null class; and a text-
/// conditional `UNet2DConditionModel` held at an embedding read from a file. `diffmon eval` of a
/// checkpoint of each equals the reference's ICR with the eager network called with that
/// condition (`class_labels` = 10, `encoder_hidden_states` = the embedding) on the same views
/// and noise.
#[test]
fn conditional_networks_held_at_their_condition_evaluate_as_the_reference() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let script = format!(
        r#"
import json, sys
from pathlib import Path
import torch
from safetensors.torch import save_file
sys.path.insert(0, "tests/integration")
import latent_reference as ref
from diffusers import DiTTransformer2DModel, UNet2DConditionModel, UNet2DModel
from diffmon.export import Embedding, export

torch.set_num_threads(1)
out = Path({d:?})
icr = dict(samples=128, seed=3, sigma=0.29, batch_size=32)
null = lambda n: torch.full((n,), 10, dtype=torch.long)
result = {{}}

def case(name, net, layer, shape, seed, **condition):
    # The checkpoint's weights go into the eager network too: both evaluate the same weights.
    state = ref.perturbed_state(net, seed)
    save_file(state, str(out / f"{{name}}_000010.safetensors"))
    net.load_state_dict(state)
    images = ref.smooth_images(64, shape[0], shape[1], seed + 1)
    ref.write_images(out / f"{{name}}.h5", images)
    result[name] = ref.icr_of(net.eval(), layer, images, **icr, **condition)

torch.manual_seed(0)
unet = UNet2DModel(sample_size=8, in_channels=3, out_channels=3, block_out_channels=(16, 32),
                   down_block_types=("DownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "UpBlock2D"),
                   layers_per_block=1, norm_num_groups=8, num_class_embeds=11)
export(unet, "mid_block", out / "unet.ts", "eps", (3, 8, 8))  # default: the null class, 10
case("unet", unet, "mid_block", (3, 8, 8), 1, class_labels=null)

torch.manual_seed(1)
dit = DiTTransformer2DModel(in_channels=4, sample_size=8, patch_size=2, num_layers=4,
                            num_attention_heads=2, attention_head_dim=8, num_embeds_ada_norm=10)
export(dit, "transformer_blocks.1", out / "dit.ts", "eps", (4, 8, 8))  # the null class, 10
case("dit", dit, "transformer_blocks.1", (4, 8, 8), 2, class_labels=null)

torch.manual_seed(2)
text = UNet2DConditionModel(sample_size=8, in_channels=4, out_channels=4, block_out_channels=(16, 32),
                            down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                            up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), layers_per_block=1,
                            norm_num_groups=8, cross_attention_dim=16, attention_head_dim=4)
embedding = torch.randn(1, 5, 16, generator=torch.Generator().manual_seed(7))
torch.save(embedding, out / "empty_prompt.pt")
export(text, "mid_block", out / "text.ts", "eps", (4, 8, 8),
       condition=Embedding.from_file(out / "empty_prompt.pt"))
case("text", text, "mid_block", (4, 8, 8), 3,
     encoder_hidden_states=lambda n: embedding.expand(n, -1, -1))
print(json.dumps(result))
"#
    );
    let reference: Value = serde_json::from_str(
        stdout(&run_python(&["-c", &script]))
            .trim()
            .lines()
            .last()
            .unwrap(),
    )
    .unwrap();
    for (name, described) in [
        ("unet", "held at the null class 10 (`class_labels`)"),
        ("dit", "held at the null class 10 (`class_labels`)"),
        (
            "text",
            "held at the embedding of empty_prompt.pt [1,5,16] (`encoder_hidden_states`)",
        ),
    ] {
        let config = d.join(format!("{name}.yaml"));
        std::fs::write(
            &config,
            format!(
                "run: {{dir: {d}}}\nmodel: {{architecture: {d}/{name}.ts}}\ndevice: cpu\n\
                 cpu_threads: 1\ndata: {{path: {d}/{name}.h5}}\n{ICR}\n",
                d = d.display()
            ),
        )
        .unwrap();
        let check = diffmon(&["check-config", config.to_str().unwrap()]);
        assert!(check.status.success(), "{}", stderr(&check));
        assert!(stdout(&check).contains(described), "{}", stdout(&check));
        let r = eval(&config, &d.join(format!("{name}_000010.safetensors")));
        close(
            name,
            r["icr"].as_f64().unwrap(),
            reference[name].as_f64().unwrap(),
        );
    }
}

/// A latent run as a user has it: `python/train_latent_toy.py` trains a diffusers
/// `AutoencoderKL` and a class-conditional `DiTTransformer2DModel` on the digits and saves
/// `checkpoint-N/transformer/` folders with `save_pretrained`; `diffmon-export` exports the VAE
/// (`--vae`) and the DiT (the null class by default); `diffmon watch` evaluates the run with ICR,
/// the gap and PFD with the memorization ratio. Each checkpoint is evaluated once; ICR of one
/// equals the reference's (pixel augmentation, the eager VAE's scaled posterior mean, latent
/// noise, the eager DiT at the null class); the training latents PFD ran against are the cached
/// encodings of the training images.
#[test]
fn a_latent_run_is_watched_end_to_end_and_matches_the_reference() {
    use crate::daemon::{Daemon, free_port};
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let run = d.join("run");
    let run_s = run.to_str().unwrap();
    run_python(&[
        "python/train_latent_toy.py",
        "--run-dir",
        run_s,
        "--vae-steps",
        "150",
        "--steps",
        "200",
        "--ckpt-every",
        "50",
    ]);
    let factory = |folder: &str| {
        format!(
            "{{\"pretrained_model_name_or_path\": {:?}}}",
            run.join(folder).display().to_string()
        )
    };
    let (vae, model) = (d.join("vae.ts"), d.join("model.ts"));
    #[rustfmt::skip]
    run_python(&[
        "-m", "diffmon.export", "--vae", "--factory", "diffusers:AutoencoderKL.from_pretrained",
        "--factory-kwargs", &factory("vae"), "--shape", "3", "16", "16",
        "--out", vae.to_str().unwrap(),
    ]);
    #[rustfmt::skip]
    run_python(&[
        "-m", "diffmon.export", "--factory", "diffusers:DiTTransformer2DModel.from_pretrained",
        "--factory-kwargs", &factory("checkpoint-50/transformer"),
        "--feature-layer", "transformer_blocks.1", "--shape", "4", "8", "8",
        "--parameterization", "eps", "--schedule", "linear", "--T", "1000",
        "--out", model.to_str().unwrap(),
    ]);
    let port = free_port();
    let config = d.join("latent.yaml");
    std::fs::write(
        &config,
        format!(
            "run: {{dir: {run:?}, name: latent}}\nstate_dir: {state:?}\n\
             model: {{architecture: {model:?}, vae: {vae:?}}}\ndevice: cpu\ncpu_threads: 1\n\
             data: {{path: {run_s}/train.h5, heldout_path: {run_s}/heldout.h5}}\n\
             http: {{listen: \"127.0.0.1:{port}\"}}\n\
             checkpoints: {{settle_secs: 0.5, poll_secs: 0.5}}\n{ICR}\n\
             pfd: {{enabled: true, samples: 32, batch_size: 32}}\nmemorization: {{enabled: true}}\n\
             tail: {{enabled: true, reference: training}}\n",
            state = d.join("state"),
        ),
    )
    .unwrap();
    let check = diffmon(&["check-config", config.to_str().unwrap()]);
    assert!(check.status.success(), "{}", stderr(&check));
    let said = stdout(&check);
    assert!(
        said.contains("held at the null class 10 (`class_labels`)")
            && said.contains("latent, autoencoder")
            && said.contains("latents [4,8,8] of images [3,16,16]"),
        "{said}"
    );

    let daemon = Daemon::spawn(config.clone(), port);
    let journal = d.join("state/history.jsonl");
    let evaluations = || -> Vec<Value> {
        let text = std::fs::read_to_string(&journal).unwrap_or_default();
        let complete = &text[..text.rfind('\n').map_or(0, |i| i + 1)];
        complete
            .lines()
            .map(|l| serde_json::from_str::<Value>(l).unwrap())
            .filter(|e| e["kind"] == "evaluation")
            .map(|e| e["record"].clone())
            .collect()
    };
    daemon.wait_for(std::time::Duration::from_secs(240), "4 evaluations", |_| {
        evaluations().len() >= 4
    });
    std::thread::sleep(std::time::Duration::from_millis(1500)); // rescans: nothing comes twice
    let records = evaluations();
    drop(daemon);
    let steps: Vec<i64> = records
        .iter()
        .map(|r| r["step"].as_i64().unwrap())
        .collect();
    assert_eq!(
        steps,
        [50, 100, 150, 200],
        "each checkpoint once: {records:?}"
    );
    for r in &records {
        for key in [
            "icr",
            "loss_train",
            "loss_heldout",
            "pfd_memorization",
            "tail_rmsqe",
            "tail_loader",
        ] {
            assert!(r[key].as_f64().is_some_and(f64::is_finite), "{key}: {r}");
        }
        let ratio = r["memorization_ratio"].as_f64().unwrap();
        assert!((0.0..=1.0).contains(&ratio), "{r}");
    }

    let cached: Vec<_> = std::fs::read_dir(d.join("state/cache"))
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            let name = p.file_name().unwrap().to_string_lossy();
            name.starts_with("latents-train-") && name.ends_with(".h5")
        })
        .collect();
    assert_eq!(cached.len(), 1, "one cache of the training latents");
    let script = format!(
        r#"
import json, sys
import h5py, torch
sys.path.insert(0, "tests/integration")
import latent_reference as ref
from diffusers import AutoencoderKL, DiTTransformer2DModel

torch.set_num_threads(1)
run = {run_s:?}
vae = AutoencoderKL.from_pretrained(run + "/vae").eval()
scale, shift = vae.config.scaling_factor, vae.config.shift_factor or 0.0
def encode(x):
    with torch.no_grad():
        return (vae.encode(x).latent_dist.mean - shift) * scale
dit = DiTTransformer2DModel.from_pretrained(run + "/checkpoint-100/transformer").eval()
images = torch.from_numpy(h5py.File(run + "/train.h5")["images"][:])
icr = ref.icr_of(dit, "transformer_blocks.1", images, samples=128, seed=3, sigma=0.29,
                 batch_size=32, encode=encode,
                 class_labels=lambda n: torch.full((n,), 10, dtype=torch.long))
cached = torch.from_numpy(h5py.File({cache:?})["latents"][:])
print(json.dumps({{"icr": icr, "cache_error": (cached - encode(images)).abs().max().item(),
                  "latent_scale": encode(images).abs().max().item()}}))
"#,
        cache = cached[0].display().to_string()
    );
    let reference: Value = serde_json::from_str(
        stdout(&run_python(&["-c", &script]))
            .trim()
            .lines()
            .last()
            .unwrap(),
    )
    .unwrap();
    close(
        "checkpoint-100",
        records[1]["icr"].as_f64().unwrap(),
        reference["icr"].as_f64().unwrap(),
    );
    // The cache holds the VAE's float32 encodings, made in other batches than the reference's:
    // equal to float32 rounding of values of order `latent_scale`.
    let error = reference["cache_error"].as_f64().unwrap();
    let scale = reference["latent_scale"].as_f64().unwrap();
    assert!(
        error <= 1e-5 * scale,
        "cache differs by {error} (scale {scale})"
    );

    // The same training latents from a file (`data.latents_path`), without the autoencoder (so
    // without ICR and the held-out gap): PFD gives the watched numbers; latents twice as large
    // (values far beyond [-1, 1], which latents need not respect) give others.
    let copy = format!(
        r#"
import h5py
z = h5py.File({cache:?})["latents"][:]
for name, factor in (("latents.h5", 1.0), ("doubled.h5", 2.0)):
    with h5py.File({d:?} + "/" + name, "w") as f:
        f.create_dataset("latents", data=z * factor)
with h5py.File({d:?} + "/small.h5", "w") as f:  # 4x4 latents: the DiT's grid is 8x8
    f.create_dataset("latents", data=z[:, :, :4, :4])
"#,
        cache = cached[0].display().to_string(),
        d = d.display().to_string()
    );
    run_python(&["-c", &copy]);
    let pfd_config = |file: &str| {
        let config = d.join(format!("{file}.yaml"));
        std::fs::write(
            &config,
            format!(
                "run: {{dir: {run:?}}}\nstate_dir: {state:?}\nmodel: {{architecture: {model:?}}}\n\
                 device: cpu\ncpu_threads: 1\n\
                 data: {{path: {run_s}/train.h5, latents_path: {d}/{file}}}\n\
                 icr: {{enabled: false}}\npfd: {{enabled: true, samples: 32, batch_size: 32, teacher: {model:?}}}\n\
                 memorization: {{enabled: true}}\nearly_stop: {{metric: pfd_generalization}}\n",
                state = d.join(format!("{file}.state")),
                d = d.display(),
            ),
        )
        .unwrap();
        config
    };
    let pfd_only = |file: &str| eval(&pfd_config(file), &run.join("checkpoint-100"));
    let same = pfd_only("latents.h5");
    let watched = &records[1];
    for key in ["pfd_memorization", "memorization_ratio"] {
        let (a, b) = (same[key].as_f64().unwrap(), watched[key].as_f64().unwrap());
        assert!(
            (a - b).abs() <= 1e-9 * b.abs().max(1e-12),
            "{key}: {a} against {b}"
        );
    }
    assert!(
        same.get("icr").is_none() && same.get("loss_train").is_none(),
        "{same}"
    );
    let doubled = pfd_only("doubled.h5");
    assert_ne!(doubled["pfd_memorization"], same["pfd_memorization"]);

    // Latents of a shape the network cannot take: a message naming the file, the shapes and
    // the reason, not TorchScript's traceback.
    let small = pfd_config("small.h5");
    let ckpt = run.join("checkpoint-100");
    let out = diffmon(&[
        "eval",
        "--json",
        "--config",
        small.to_str().unwrap(),
        ckpt.to_str().unwrap(),
    ]);
    let stderr = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    for part in [
        "small.h5: dataset `latents` holds latents of shape [4, 4, 4]",
        "model.ts fails",
        "it was exported for inputs of shape [4, 8, 8]",
    ] {
        assert!(stderr.contains(part), "{part:?} not in {stderr}");
    }
    assert!(!stderr.contains("Traceback"), "{stderr}");
}
