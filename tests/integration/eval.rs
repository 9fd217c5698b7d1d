//! `diffmon eval` on a real toy training run.

use crate::common::{diffmon, run_python, stderr, stdout, toy_run};
use serde_json::Value;
use std::fs;
use std::path::Path;

fn config(dir: &Path, extra: &str) -> std::path::PathBuf {
    let path = dir.join(format!("diffmon-{}.yaml", extra.len()));
    fs::write(
        &path,
        format!(
            "run: {{dir: .}}\nmodel: {{architecture: model.ts}}\ndevice: cpu\n\
             data: {{path: train.h5, heldout_path: heldout.h5}}\nicr: {{samples: 256, batch_size: 128, seed: 5}}\n{extra}"
        ),
    )
    .unwrap();
    path
}

/// `diffmon eval --json` of one checkpoint, which must succeed.
fn eval_json(cfg: &Path, ckpt: &Path) -> Value {
    let out = diffmon(&[
        "eval",
        "--config",
        cfg.to_str().unwrap(),
        ckpt.to_str().unwrap(),
        "--json",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    records(&out).remove(0)
}

fn records(out: &std::process::Output) -> Vec<Value> {
    stdout(out)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

#[test]
fn eval_json_has_the_record_fields_and_is_deterministic() {
    let dir = toy_run();
    let cfg = config(dir, "");
    let ckpt = dir.join("ckpt_000060.pt");
    let args = [
        "eval",
        "--config",
        cfg.to_str().unwrap(),
        ckpt.to_str().unwrap(),
        "--json",
    ];
    let first = diffmon(&args);
    assert!(first.status.success(), "{}", stderr(&first));
    let r = &records(&first)[0];
    assert_eq!(r["step"], 60);
    for key in [
        "icr",
        "icr_invariant_trace",
        "icr_residual_trace",
        "loss_train",
        "loss_heldout",
        "generalization_gap",
        "generalization_gap_stderr",
        "icr_stderr",
        "icr_samples",
        "seconds",
    ] {
        assert!(r[key].is_number(), "{key} missing in {r}");
    }
    // icr.samples pairs were used (64 training images, repeated), and the jackknife over them
    // gives a standard error well below the value itself.
    assert_eq!(r["icr_samples"], 256);
    let se = r["icr_stderr"].as_f64().unwrap();
    assert!(se > 0.0 && se < 0.1 * r["icr"].as_f64().unwrap(), "{se}");
    for absent in [
        "pfd_generalization",
        "pfd_memorization",
        "memorization_ratio",
        "tail_rmsqe",
        "tail_loader",
        // On the CPU: no GPU time, no GPU memory (docs/design.md §13).
        "gpu_seconds",
        "gpu_memory_peak_bytes",
    ] {
        assert!(r.get(absent).is_none(), "metric {absent} present");
    }
    let icr = r["icr"].as_f64().unwrap();
    assert!(icr > 0.0 && icr < 1.5, "{icr}");
    let gap = r["generalization_gap"].as_f64().unwrap();
    let (lt, lh) = (
        r["loss_train"].as_f64().unwrap(),
        r["loss_heldout"].as_f64().unwrap(),
    );
    assert!((gap - (lh - lt)).abs() < 1e-12);
    // Same seed, same views and noise: the very same numbers.
    let second = records(&diffmon(&args));
    assert_eq!(second[0]["icr"], r["icr"]);
    assert_eq!(second[0]["loss_train"], r["loss_train"]);
}

/// The denoising loss of docs/design.md §8 recomputed in PyTorch: same subset (seeded randperm),
/// same noise (libtorch's CPU generator, same seed and call order), same checkpoint; and the
/// gap's standard error, sqrt(var_train/n + var_heldout/n) of the per-image losses.
#[test]
fn denoising_losses_match_a_pytorch_reference() {
    let dir = toy_run();
    let cfg = config(dir, "");
    let ckpt = dir.join("ckpt_000030.pt");
    let r = &eval_json(&cfg, &ckpt);
    let script = format!(
        r#"
import torch, h5py, json
torch.set_num_threads(2)
run = {dir:?}
model = torch.jit.load(run + "/model.ts")
sd = torch.load(run + "/ckpt_000030.pt", weights_only=True)
with torch.no_grad():
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        t.copy_(sd[name])
def loss(path, n, seed, sigma=0.29, sd_=0.5):
    x = torch.from_numpy(h5py.File(path)["images"][:]).float()
    torch.manual_seed(seed)
    idx = torch.randperm(x.shape[0])[:n].sort().values
    x0 = x[idx]
    noise = torch.randn(x0.shape)
    with torch.no_grad():
        d, _ = model(x0 + sigma * noise, torch.full((x0.shape[0],), sigma))
    w = (sigma**2 + sd_**2) / (sigma * sd_)**2
    per_image = w * ((d.double() - x0.double())**2).flatten(1).mean(1)
    return per_image.mean().item(), (per_image.var() / per_image.numel()).item()
n = 64  # min(icr.samples, training images, held-out images)
(lt, vt), (lh, vh) = loss(run + "/train.h5", n, 5), loss(run + "/heldout.h5", n, 6)
print(json.dumps({{"train": lt, "heldout": lh, "gap_stderr": (vt + vh) ** 0.5}}))
"#,
        dir = dir.display().to_string()
    );
    let reference: Value = serde_json::from_str(&stdout(&run_python(&["-c", &script]))).unwrap();
    for (ours, theirs) in [
        ("loss_train", "train"),
        ("loss_heldout", "heldout"),
        ("generalization_gap_stderr", "gap_stderr"),
    ] {
        let a = r[ours].as_f64().unwrap();
        let b = reference[theirs].as_f64().unwrap();
        // float32 forward in both, float64 reduction: agreement to float32 rounding of the sum.
        assert!(
            (a - b).abs() <= 1e-5 * b.abs(),
            "{ours}: diffmon {a}, PyTorch {b}"
        );
    }
}

#[test]
fn a_bad_checkpoint_is_reported_and_the_others_still_evaluated() {
    let dir = toy_run();
    let cfg = config(dir, "");
    let tmp = tempfile::tempdir().unwrap();
    let bad = tmp.path().join("ckpt_000045.pt");
    fs::write(&bad, b"PK\x03\x04 not really a zip").unwrap();
    let good = dir.join("ckpt_000030.pt");
    let out = diffmon(&[
        "eval",
        "--config",
        cfg.to_str().unwrap(),
        bad.to_str().unwrap(),
        good.to_str().unwrap(),
        "--json",
    ]);
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr(&out).contains("ckpt_000045.pt"), "{}", stderr(&out));
    assert_eq!(records(&out).len(), 1);
}

#[test]
fn noise_level_sweep_reports_each_sigma_and_marks_the_lowest() {
    let dir = toy_run();
    let tmp = tempfile::tempdir().unwrap();
    let cfg = tmp.path().join("sweep.yaml");
    fs::write(
        &cfg,
        format!(
            "run: {{dir: {d}}}\nmodel: {{architecture: {d}/model.ts}}\ndevice: cpu\ndata: {{path: {d}/train.h5}}\n\
             icr: {{samples: 256, sigmas: [0.29, 1.5]}}\n",
            d = dir.display()
        ),
    )
    .unwrap();
    let ckpt = dir.join("ckpt_000060.pt");
    let r = &eval_json(&cfg, &ckpt);
    let sweep = r["icr_sweep"].as_array().unwrap();
    assert_eq!(sweep.len(), 2);
    // Same seed, same views: the sweep's point at icr.sigma is the headline ICR exactly.
    assert_eq!(sweep[0]["sigma"], 0.29);
    assert_eq!(sweep[0]["icr"], r["icr"]);
    assert_eq!(sweep[0]["stderr"], r["icr_stderr"]);
    assert!(sweep[1]["stderr"].as_f64().unwrap() > 0.0);
    assert_ne!(sweep[1]["icr"], r["icr"]);
    let table = diffmon(&[
        "eval",
        "--config",
        cfg.to_str().unwrap(),
        ckpt.to_str().unwrap(),
    ]);
    let text = stdout(&table);
    assert_eq!(text.matches("<- lowest").count(), 1, "{text}");
    assert!(text.contains("std.err") && text.contains(" ± "), "{text}");
}

/// `icr.bias_correction: jackknife` (docs/design.md §2): at 256 pairs of the toy's 64-dimensional
/// features the plain ICR is biased low by several standard errors (the table of
/// docs/guide/formulas.md, "ICR and the number of view pairs"), so the corrected value must be
/// higher by more than one; the spectrum and the standard error are the plain estimate's, and the
/// sweep's point at icr.sigma carries the corrected value too.
#[test]
fn jackknife_bias_correction_raises_icr_and_keeps_the_spectrum() {
    let dir = toy_run();
    let tmp = tempfile::tempdir().unwrap();
    let write = |name: &str, extra: &str| {
        let cfg = tmp.path().join(name);
        fs::write(
            &cfg,
            format!(
                "run: {{dir: {d}}}\nmodel: {{architecture: {d}/model.ts}}\ndevice: cpu\n\
                 data: {{path: {d}/train.h5}}\nicr: {{samples: 256, sigmas: [0.29]{extra}}}\n",
                d = dir.display()
            ),
        )
        .unwrap();
        cfg
    };
    let ckpt = dir.join("ckpt_000060.pt");
    let plain = eval_json(&write("plain.yaml", ""), &ckpt);
    let corrected = eval_json(
        &write("corrected.yaml", ", bias_correction: jackknife"),
        &ckpt,
    );
    let (p, c) = (
        plain["icr"].as_f64().unwrap(),
        corrected["icr"].as_f64().unwrap(),
    );
    let se = plain["icr_stderr"].as_f64().unwrap();
    assert!(c - p > se, "corrected {c}, plain {p} ± {se}");
    assert_eq!(corrected["icr_eigenvalues"], plain["icr_eigenvalues"]);
    assert_eq!(corrected["icr_stderr"], plain["icr_stderr"]);
    assert_eq!(corrected["icr_sweep"][0]["icr"], corrected["icr"]);
}

/// `evaluation.precision` (docs/design.md §11, "Precision") on the CPU, for one toy checkpoint
/// and the same draws: `tf32` is `fp32` there (TF32 is a CUDA mode), to the last bit; `bf16`
/// runs the network under bfloat16 autocast, so the numbers move (the setting took effect), but
/// by less than the documented bar for a precision (a quarter of ICR's standard error; measured
/// 0.02 of it here), and the denoising loss by under 1% (measured 0.07%).
#[test]
fn precision_bf16_moves_the_numbers_a_little_and_tf32_is_fp32_on_the_cpu() {
    let dir = toy_run();
    let ckpt = dir.join("ckpt_000060.pt");
    let tmp = tempfile::tempdir().unwrap();
    let rec = |precision: &str| {
        let cfg = tmp.path().join(format!("{precision}.yaml"));
        fs::write(
            &cfg,
            format!(
                "run: {{dir: {dir:?}}}\nmodel: {{architecture: {arch:?}}}\ndevice: cpu\n\
                 data: {{path: {train:?}, heldout_path: {heldout:?}}}\nicr: {{samples: 256, batch_size: 128, seed: 5}}\n\
                 evaluation: {{precision: {precision}}}\n",
                arch = dir.join("model.ts"),
                train = dir.join("train.h5"),
                heldout = dir.join("heldout.h5"),
            ),
        )
        .unwrap();
        eval_json(&cfg, &ckpt)
    };
    let (fp32, tf32, bf16) = (rec("fp32"), rec("tf32"), rec("bf16"));
    for key in ["icr", "loss_train", "icr_invariant_trace"] {
        assert_eq!(fp32[key], tf32[key], "{key}: tf32 is fp32 on the CPU");
    }
    let f = |r: &Value, k: &str| r[k].as_f64().unwrap();
    assert_ne!(
        f(&bf16, "icr"),
        f(&fp32, "icr"),
        "bf16 did not change the forward"
    );
    let rel = |k: &str| (f(&bf16, k) - f(&fp32, k)).abs() / f(&fp32, k).abs();
    let moved = (f(&bf16, "icr") - f(&fp32, "icr")).abs();
    assert!(
        moved < 0.25 * f(&fp32, "icr_stderr"),
        "ICR {} vs {} (stderr {})",
        f(&bf16, "icr"),
        f(&fp32, "icr"),
        f(&fp32, "icr_stderr")
    );
    assert!(
        rel("loss_train") < 0.01,
        "loss {} vs {}",
        f(&bf16, "loss_train"),
        f(&fp32, "loss_train")
    );
    eprintln!(
        "precision: icr fp32 {} bf16 {} (stderr {}), loss_train fp32 {} bf16 {}",
        f(&fp32, "icr"),
        f(&bf16, "icr"),
        f(&fp32, "icr_stderr"),
        f(&fp32, "loss_train"),
        f(&bf16, "loss_train")
    );
}
