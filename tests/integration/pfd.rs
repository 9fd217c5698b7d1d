//! The PF-ODE engine (docs/design.md §3–§6) against a straightforward PyTorch reference written
//! here: NVlabs/edm's `edm_sampler` with `S_churn = 0`, the empirical denoiser by direct
//! distances and softmax, and E_gen, E_mem and the memorization ratio from their definitions.
//! Also: PFD's metric properties on toy models, the bias–variance identity, the flow cache.

use crate::common::{diffmon, run_python, stderr, stdout, toy_run};
use diffmon::config::Config;
use diffmon::engine::eval::Evaluator;
use serde_json::Value;
use std::fs;
use std::path::{Path, PathBuf};

/// The reference, in plain PyTorch float64 (the network itself in float32, as EDM calls it).
const REFERENCE: &str = r#"
import json, sys, h5py, numpy as np, torch

def schedule(steps=18, sigma_min=0.002, sigma_max=80.0, rho=7.0):
    i = torch.arange(steps, dtype=torch.float64)
    t = (sigma_max ** (1 / rho) + i / (steps - 1) * (sigma_min ** (1 / rho) - sigma_max ** (1 / rho))) ** rho
    return torch.cat([t, torch.zeros_like(t[:1])])

def edm_sampler(net, latents, steps=18):
    # edm_sampler of NVlabs/edm with S_churn = 0: gamma = 0, so t_hat = t_cur and x_hat = x_cur.
    t_steps = schedule(steps)
    x_next = latents.to(torch.float64) * t_steps[0]
    for i, (t_cur, t_next) in enumerate(zip(t_steps[:-1], t_steps[1:])):
        x_cur = x_next
        denoised = net(x_cur, t_cur).to(torch.float64)
        d_cur = (x_cur - denoised) / t_cur
        x_next = x_cur + (t_next - t_cur) * d_cur
        if i < steps - 1:
            denoised = net(x_next, t_next).to(torch.float64)
            d_prime = (x_next - denoised) / t_next
            x_next = x_cur + (t_next - t_cur) * (0.5 * d_cur + 0.5 * d_prime)
    return x_next

def network(ts_path, state_dict=None):
    m = torch.jit.load(ts_path)
    if state_dict is not None:
        m.load_state_dict(torch.load(state_dict))
    m.eval()
    def net(x, t):
        with torch.no_grad():
            sigma = torch.full([x.shape[0]], float(t), dtype=torch.float32)
            return m(x.to(torch.float32), sigma)[0]
    return net

def empirical(images):
    y = torch.as_tensor(images, dtype=torch.float64).reshape(len(images), -1)
    def net(x, t):
        d2 = ((x.reshape(x.shape[0], 1, -1) - y[None]) ** 2).sum(-1)
        w = torch.softmax(-d2 / (2 * float(t) ** 2), dim=1)
        return (w @ y).reshape(x.shape)
    return net

def read(path, name):
    with h5py.File(path, "r") as f:
        return torch.from_numpy(np.asarray(f[name]))

def write(path, name, t):
    with h5py.File(path, "w") as f:
        f[name] = t.numpy()

def pfd(a, b):
    return float(((a - b) ** 2).reshape(len(a), -1).sum(1).mean().sqrt())
"#;

fn python(script: &str) -> Value {
    let out = run_python(&["-c", &format!("{REFERENCE}\n{script}")]);
    let text = stdout(&out);
    serde_json::from_str(text.lines().last().unwrap_or("null")).unwrap()
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// `max |a − b|` of two `/samples` files.
fn max_abs_diff(a: &Path, b: &Path) -> f64 {
    let ta = crate::common::h5_tensor(a, "samples");
    let tb = crate::common::h5_tensor(b, "samples");
    assert_eq!(ta.size(), tb.size());
    (ta - tb).abs().max().double_value(&[])
}

#[test]
fn sample_matches_the_python_edm_sampler_for_a_network_and_the_empirical_flow() {
    let run = toy_run();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let (latents, ref_net, ref_emp) = (
        d.join("latents.h5"),
        d.join("ref_net.h5"),
        d.join("ref_emp.h5"),
    );
    python(&format!(
        r#"
torch.manual_seed(4)
z = torch.randn(24, 1, 16, 16)
write({latents:?}, "latents", z)
x = edm_sampler(network({model:?}, {ckpt:?}), z)
write({ref_net:?}, "samples", x.to(torch.float32))
x = edm_sampler(empirical(read({train:?}, "images")), z)
write({ref_emp:?}, "samples", x.to(torch.float32))
print("null")
"#,
        latents = s(&latents),
        model = s(&run.join("model.ts")),
        ckpt = s(&run.join("ckpt_000060.pt")),
        train = s(&run.join("train.h5")),
        ref_net = s(&ref_net),
        ref_emp = s(&ref_emp),
    ));
    let ours = d.join("ours.h5");
    for batch in ["64", "7"] {
        let out = diffmon(&[
            "sample",
            "--model",
            s(&run.join("model.ts")),
            "--checkpoint",
            s(&run.join("ckpt_000060.pt")),
            "--latents",
            s(&latents),
            "--out",
            s(&ours),
            "--device",
            "cpu",
            "--batch-size",
            batch,
        ]);
        assert!(out.status.success(), "{}", stderr(&out));
        // Same libtorch, same float32 network, float64 state on both sides: the only
        // differences are float32 rounding of the output and kernel-order effects (≪ 1e-5).
        let err = max_abs_diff(&ours, &ref_net);
        assert!(
            err <= 1e-5,
            "network flow, batch {batch}: max |diff| = {err}"
        );
    }
    let out = diffmon(&[
        "sample",
        "--model",
        "empirical",
        "--data",
        s(&run.join("train.h5")),
        "--latents",
        s(&latents),
        "--out",
        s(&ours),
        "--device",
        "cpu",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let err = max_abs_diff(&ours, &ref_emp);
    assert!(err <= 1e-5, "empirical flow: max |diff| = {err}");
    // The empirical flow ends on training images (it is the memorizing solution).
    let train = crate::common::h5_tensor(&run.join("train.h5"), "images").flatten(1, -1);
    let x = crate::common::h5_tensor(&ours, "samples").flatten(1, -1);
    let nearest = tch::Tensor::cdist(&x, &train, 2.0, None).amin(1, false);
    assert!(nearest.max().double_value(&[]) < 1e-3);

    // Bad input names the file.
    let out = diffmon(&[
        "sample",
        "--model",
        "empirical",
        "--latents",
        s(&latents),
        "--out",
        s(&ours),
    ]);
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr(&out).contains("--data"), "{}", stderr(&out));
}

/// A run folder with the toy run's files, the teacher (the step-60 checkpoint exported to
/// TorchScript) and perturbed copies of it.
struct Setup {
    _dir: tempfile::TempDir,
    dir: PathBuf,
}

impl Setup {
    fn new() -> Setup {
        let run = toy_run();
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path().to_path_buf();
        for f in [
            "model.ts",
            "train.h5",
            "ckpt_000030.pt",
            "ckpt_000060.pt",
            "heldout.h5",
        ] {
            fs::copy(run.join(f), d.join(f)).unwrap();
        }
        python(&format!(
            r#"
import os
os.chdir({d:?})
for step in (30, 60):
    m = torch.jit.load("model.ts")
    m.load_state_dict(torch.load(f"ckpt_{{step:06d}}.pt"))
    torch.jit.save(m, f"teacher_{{step}}.ts")
torch.jit.save(torch.jit.load("model.ts"), "teacher_0.ts")
sd = torch.load("ckpt_000060.pt")
g = torch.Generator().manual_seed(0)
noise = {{k: torch.randn(v.shape, generator=g) if v.is_floating_point() else None for k, v in sd.items()}}
for i, eps in enumerate([0.1, 0.03, 0.01, 0.003]):
    p = {{k: (v + eps * v.std().nan_to_num(0) * noise[k] if noise[k] is not None and v.numel() > 1 else v)
         for k, v in sd.items()}}
    torch.save(p, f"perturbed_{{i}}.pt")
print("null")
"#,
            d = s(&d)
        ));
        Setup { _dir: dir, dir: d }
    }

    fn config(&self, name: &str, extra: &str) -> PathBuf {
        let path = self.dir.join(name);
        fs::write(
            &path,
            format!(
                "run: {{dir: .}}\nstate_dir: state\nmodel: {{architecture: model.ts}}\n\
                 device: cpu\ndata: {{path: train.h5}}\nicr: {{enabled: false}}\n\
                 early_stop: {{metric: pfd_generalization}}\n{extra}"
            ),
        )
        .unwrap();
        path
    }

    fn eval(&self, config: &Path, checkpoints: &[&str]) -> Vec<Value> {
        let mut args = vec!["eval", "--config", s(config)];
        let paths: Vec<PathBuf> = checkpoints.iter().map(|c| self.dir.join(c)).collect();
        args.extend(paths.iter().map(|p| s(p)));
        args.push("--json");
        let out = diffmon(&args);
        assert!(out.status.success(), "{}", stderr(&out));
        stdout(&out)
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    }
}

/// The cache file of `<dir>/state/cache` whose name starts with `prefix`.
fn cached(dir: &Path, prefix: &str) -> PathBuf {
    fs::read_dir(dir.join("state/cache"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.file_name().unwrap().to_string_lossy().starts_with(prefix))
        .unwrap_or_else(|| panic!("no {prefix}* in the cache"))
}

fn f(v: &Value, key: &str) -> f64 {
    v[key].as_f64().unwrap_or_else(|| panic!("no {key} in {v}"))
}

#[test]
fn pfd_metrics_match_the_python_reference_and_behave_as_a_distance() {
    let setup = Setup::new();
    let d = &setup.dir;
    let cfg = setup.config(
        "pfd.yaml",
        "pfd: {enabled: true, teacher: teacher_60.ts, samples: 40, batch_size: 16, seed: 3}\n\
         memorization: {enabled: true, threshold: 0.9}\n",
    );
    let records = setup.eval(
        &cfg,
        &[
            "ckpt_000060.pt",
            "perturbed_0.pt",
            "perturbed_1.pt",
            "perturbed_2.pt",
            "perturbed_3.pt",
            "ckpt_000030.pt",
        ],
    );
    // The student that is the teacher: the same network on the same latents, E_gen = 0 exactly.
    assert_eq!(f(&records[0], "pfd_generalization"), 0.0);
    // Perturbations of decreasing size: E_gen decreases strictly.
    let e: Vec<f64> = records[1..5]
        .iter()
        .map(|r| f(r, "pfd_generalization"))
        .collect();
    assert!(e.windows(2).all(|w| w[0] > w[1]) && e[3] > 0.0, "{e:?}");

    // E_gen, E_mem and the memorization ratio of the step-30 checkpoint from their definitions,
    // on diffmon's cached latents.
    let latents = cached(d, "latents-");
    let reference = python(&format!(
        r#"
import os
os.chdir({d:?})
z = read({latents:?}, "latents")
student = edm_sampler(network("model.ts", "ckpt_000030.pt"), z)
teacher = edm_sampler(network("teacher_60.ts"), z)
train = read("train.h5", "images")
emp = edm_sampler(empirical(train), z)
dist = torch.cdist(student.reshape(len(z), -1), train.to(torch.float64).reshape(len(train), -1))
d12 = dist.sort(dim=1).values[:, :2]
ratio = float((d12[:, 0] < 0.9 * d12[:, 1]).double().mean())
print(json.dumps({{"e_gen": pfd(student, teacher), "e_mem": pfd(student, emp), "ratio": ratio,
                  "d_ratio": (d12[:, 0] / d12[:, 1]).tolist()}}))
"#,
        d = s(d),
        latents = s(&latents),
    ));
    let r = &records[5];
    for (ours, theirs) in [
        ("pfd_generalization", "e_gen"),
        ("pfd_memorization", "e_mem"),
    ] {
        let (a, b) = (f(r, ours), f(&reference, theirs));
        // float64 on both sides around the same float32 network: 1e-6 relative is generous.
        assert!((a - b).abs() <= 1e-6 * b, "{ours}: {a} vs reference {b}");
    }
    // The ratio counts samples; none sits within 1e-6 of the threshold, so it must match exactly.
    let borderline = reference["d_ratio"]
        .as_array()
        .unwrap()
        .iter()
        .any(|q| (q.as_f64().unwrap() - 0.9).abs() < 1e-6);
    assert!(!borderline);
    assert_eq!(f(r, "memorization_ratio"), f(&reference, "ratio"));

    // Symmetry and the triangle inequality on three toy models (initial, step 30, step 60), each
    // serving as teacher once; the students are the TorchScript exports of the same models.
    let models = ["teacher_0.ts", "teacher_30.ts", "teacher_60.ts"];
    let mut dist = [[0.0f64; 3]; 3];
    for (i, teacher) in models.iter().enumerate() {
        let cfg = setup.config(
            &format!("sym{i}.yaml"),
            &format!(
                "pfd: {{enabled: true, teacher: {teacher}, samples: 40, batch_size: 16, seed: 3}}\n"
            ),
        );
        for (j, r) in setup.eval(&cfg, &models).iter().enumerate() {
            dist[j][i] = f(r, "pfd_generalization");
        }
    }
    for i in 0..3 {
        assert_eq!(dist[i][i], 0.0);
        for j in 0..3 {
            let (a, b) = (dist[i][j], dist[j][i]);
            assert!(
                (a - b).abs() <= 1e-12 * a.max(b),
                "PFD({i},{j}) = {a}, PFD({j},{i}) = {b}"
            );
            for k in 0..3 {
                assert!(dist[i][k] <= dist[i][j] + dist[j][k] + 1e-12, "{dist:?}");
            }
        }
    }
    assert!(dist[0][2] > 0.0 && dist[1][2] > 0.0);

    // bias-variance: E_gen per student agrees with eval, and the identity holds.
    let out = diffmon(&[
        "bias-variance",
        "--config",
        s(&cfg),
        "--students",
        s(&d.join("ckpt_000030.pt")),
        s(&d.join("perturbed_0.pt")),
        s(&d.join("perturbed_1.pt")),
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let bv: Value = serde_json::from_str(&stdout(&out)).unwrap();
    let (bias, var, lhs) = (
        f(&bv, "e_bias"),
        f(&bv, "e_var"),
        f(&bv, "mean_e_gen_squared"),
    );
    let rhs = bias * bias + var;
    assert!((lhs - rhs).abs() <= 1e-9 * rhs, "{lhs} vs {rhs}");
    let students = bv["students"].as_array().unwrap();
    let e_gen_30 = f(&students[0], "e_gen");
    let expected = f(
        &setup.eval(&cfg, &["ckpt_000030.pt"])[0],
        "pfd_generalization",
    );
    assert!((e_gen_30 - expected).abs() <= 1e-12 * expected);
    let mean_sq: f64 = students.iter().map(|s| f(s, "e_gen").powi(2)).sum::<f64>() / 3.0;
    assert!((mean_sq - lhs).abs() <= 1e-12 * lhs);
}

#[test]
fn reference_flows_are_cached_across_checkpoints_and_runs_and_rebuilt_when_the_teacher_changes() {
    let setup = Setup::new();
    let cfg = setup.config(
        "cache.yaml",
        "pfd: {enabled: true, teacher: teacher_60.ts, samples: 20, batch_size: 8, seed: 1, every: 2}\n",
    );
    let config = Config::load(&cfg).unwrap();
    let checkpoint = |name: &str| setup.dir.join(name);
    // First run: the teacher flow is computed: 3 batches × 35 network evaluations.
    let mut first = Evaluator::new(&config).unwrap();
    let probe = first.pfd().unwrap();
    assert_eq!((probe.teacher_calls, probe.empirical_calls), (105, 105));
    let a = first.evaluate(&checkpoint("ckpt_000030.pt"), 30).unwrap();
    let b = first.evaluate(&checkpoint("ckpt_000060.pt"), 60).unwrap();
    let c = first.evaluate(&checkpoint("perturbed_0.pt"), 61).unwrap();
    // pfd.every = 2: PF-ODE metrics on the 1st and 3rd checkpoint only; ICR is off here.
    assert!(a.pfd_generalization.is_some() && c.pfd_generalization.is_some());
    assert!(b.pfd_generalization.is_none() && b.pfd_memorization.is_none());
    drop(first);

    // A new run (a restart): the teacher and the empirical flow come from the cache, and the
    // numbers are the same.
    let mut second = Evaluator::new(&config).unwrap();
    let probe = second.pfd().unwrap();
    assert_eq!((probe.teacher_calls, probe.empirical_calls), (0, 0));
    let again = second.evaluate(&checkpoint("ckpt_000030.pt"), 30).unwrap();
    assert_eq!(again.pfd_generalization, a.pfd_generalization);
    assert_eq!(again.pfd_memorization, a.pfd_memorization);
    drop(second);

    // A half-written cache file (torn by a crash) is not used: it is rebuilt.
    let teacher_cache = cached(&setup.dir, "teacher-");
    let len = fs::metadata(&teacher_cache).unwrap().len();
    fs::OpenOptions::new()
        .write(true)
        .open(&teacher_cache)
        .unwrap()
        .set_len(len / 3)
        .unwrap();
    let third = Evaluator::new(&config).unwrap();
    assert_eq!(third.pfd().unwrap().teacher_calls, 105);
    assert_eq!(third.pfd().unwrap().empirical_calls, 0);
    drop(third);

    // The teacher file changes (another model): its flow is rebuilt and E_gen changes.
    fs::copy(
        setup.dir.join("teacher_30.ts"),
        setup.dir.join("teacher_60.ts"),
    )
    .unwrap();
    let mut fourth = Evaluator::new(&config).unwrap();
    assert_eq!(fourth.pfd().unwrap().teacher_calls, 105);
    let now = fourth.evaluate(&checkpoint("ckpt_000030.pt"), 30).unwrap();
    assert_eq!(now.pfd_generalization, Some(0.0));
}

#[test]
fn descriptor_cosine_criterion_and_tail_metrics_inside_eval_match_the_reference() {
    let setup = Setup::new();
    let d = &setup.dir;
    python(&format!(
        r#"
import os
os.chdir({d:?})
class Pool(torch.nn.Module):
    def forward(self, x):
        return torch.nn.functional.avg_pool2d(x, 4).flatten(1) + 0.1 * x.flatten(1)[:, :16]
torch.jit.save(torch.jit.trace(Pool(), torch.zeros(2, 1, 16, 16)), "descriptor.ts")
print("null")
"#,
        d = s(d)
    ));
    let cfg = setup.config(
        "desc.yaml",
        "pfd: {enabled: true, teacher: teacher_60.ts, descriptor: descriptor.ts, samples: 30, batch_size: 16, seed: 8}\n\
         memorization: {enabled: true, criterion: cosine, threshold: 0.95}\n\
         tail: {enabled: true, reference: training, observable: 'quantile:0.9', scale: 2.0, offset: 1.0}\n",
    );
    let r = &setup.eval(&cfg, &["ckpt_000030.pt"])[0];
    let latents = cached(d, "latents-");
    let reference = python(&format!(
        r#"
import os
os.chdir({d:?})
psi = torch.jit.load("descriptor.ts")
z = read({latents:?}, "latents")
student = edm_sampler(network("model.ts", "ckpt_000030.pt"), z)
teacher = edm_sampler(network("teacher_60.ts"), z)
train = read("train.h5", "images")
emp = edm_sampler(empirical(train), z)
f = lambda x: psi(x.to(torch.float32)).to(torch.float64)
cos = torch.nn.functional.normalize(f(student), dim=1) @ torch.nn.functional.normalize(f(train), dim=1).T
best = cos.max(dim=1).values
write("student.h5", "samples", student.to(torch.float32))
print(json.dumps({{"e_gen": pfd(f(student), f(teacher)), "e_mem": pfd(f(student), f(emp)),
                  "ratio": float((best > 0.95).double().mean()),
                  "margin": float((best - 0.95).abs().min())}}))
"#,
        d = s(d),
        latents = s(&latents),
    ));
    for (ours, theirs) in [
        ("pfd_generalization", "e_gen"),
        ("pfd_memorization", "e_mem"),
    ] {
        let (a, b) = (f(r, ours), f(&reference, theirs));
        assert!((a - b).abs() <= 1e-6 * b, "{ours}: {a} vs reference {b}");
    }
    assert!(
        f(&reference, "margin") > 1e-6,
        "a sample sits on the threshold"
    );
    assert_eq!(f(r, "memorization_ratio"), f(&reference, "ratio"));
    // Tail metrics inside eval equal `diffmon tail` (tested against scipy) on the same samples.
    let out = diffmon(&[
        "tail",
        "--samples",
        s(&d.join("student.h5")),
        "--reference",
        s(&d.join("train.h5")),
        "--reference-dataset",
        "images",
        "--observable",
        "quantile:0.9",
        "--scale",
        "2",
        "--offset",
        "1",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let tail: Value = serde_json::from_str(&stdout(&out)).unwrap();
    for (ours, theirs) in [("tail_rmsqe", "rmsqe"), ("tail_loader", "loader")] {
        let (a, b) = (f(r, ours), f(&tail, theirs));
        // The reference samples went through float32; the metrics move by far less than 1e-4.
        assert!(
            (a - b).abs() <= 1e-4 * b.abs().max(1e-3),
            "{ours}: {a} vs {b}"
        );
    }
}
