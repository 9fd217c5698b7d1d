//! Devices on a CPU-only machine: TorchScript files that pin a device (traced without the
//! exporter's rewrite, or on another device) are reported with the fix, a missing device is a
//! usage error, and a forward that runs out of memory is retried in smaller batches with the
//! same numbers. The GPU side of these is `make test-gpu` (tests/gpu).

use crate::common::{diffmon, run_python, stderr, stdout};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// The files of `python/make_device_fixtures.py`, written once per test run.
fn fixtures() -> &'static Path {
    static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap();
        run_python(&[
            "python/make_device_fixtures.py",
            dir.path().to_str().unwrap(),
        ]);
        dir
    })
    .path()
}

/// A config in a fresh folder evaluating `architecture` (a fixture) on `device`.
fn config(dir: &Path, architecture: &str, device: &str, extra: &str) -> PathBuf {
    let path = dir.join("diffmon.yaml");
    std::fs::write(
        &path,
        format!(
            "run: {{dir: {run}}}\nmodel: {{architecture: {arch}}}\ndevice: {device}\n\
             data: {{path: {data}}}\nicr: {{samples: 64, batch_size: 32, seed: 3}}\n{extra}",
            run = dir.display(),
            arch = fixtures().join(architecture).display(),
            data = fixtures().join("data.h5").display(),
        ),
    )
    .unwrap();
    path
}

fn eval(cfg: &Path, ckpt: &Path) -> std::process::Output {
    diffmon(&[
        "eval",
        "--config",
        cfg.to_str().unwrap(),
        ckpt.to_str().unwrap(),
        "--json",
    ])
}

/// A checkpoint of the pinned files' architecture (their own weights, saved by name).
fn pinned_checkpoint(dir: &Path) -> PathBuf {
    let ckpt = dir.join("ckpt_000001.pt");
    run_python(&[
        "-c",
        "import sys, torch; m = torch.jit.load(sys.argv[1]); \
         torch.save({k: v for k, v in m.state_dict().items()}, sys.argv[2])",
        fixtures().join("pinned_cpu.ts").to_str().unwrap(),
        ckpt.to_str().unwrap(),
    ]);
    ckpt
}

#[test]
fn check_config_reports_a_file_that_pins_a_device_with_the_fix() {
    for (file, device) in [("pinned_cpu.ts", "cpu"), ("pinned_cuda.ts", "cuda:0")] {
        let dir = tempfile::tempdir().unwrap();
        let cfg = config(dir.path(), file, "cpu", "");
        let out = diffmon(&["check-config", cfg.to_str().unwrap()]);
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(2), "{file}: {err}");
        for want in [
            "model.architecture",
            &format!("pins device {device}"),
            "aten::ones in PinsDevice.forward",
            "Re-export it with this version's diffmon-export",
        ] {
            assert!(err.contains(want), "{file}: no {want:?} in: {err}");
        }
        assert!(!err.contains("Traceback"), "{err}");
    }
    // The same network through the exporter passes: its device constant became the input's.
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), "exported.ts", "cpu", "");
    let out = diffmon(&["check-config", cfg.to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr(&out));
}

#[test]
fn a_file_pinned_to_another_device_stops_the_start_with_exit_2() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = pinned_checkpoint(dir.path());
    let cfg = config(dir.path(), "pinned_cuda.ts", "cpu", "");
    let out = eval(&cfg, &ckpt);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(2), "{err}");
    for want in [
        "pinned_cuda.ts: the file pins device cuda:0",
        "this evaluation runs on cpu",
        "Re-export it",
    ] {
        assert!(err.contains(want), "no {want:?} in: {err}");
    }
    assert!(
        stdout(&out).is_empty(),
        "no record for a file that cannot run"
    );
}

#[test]
fn a_file_pinned_to_the_device_it_runs_on_is_evaluated_with_a_warning() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = pinned_checkpoint(dir.path());
    let cfg = config(dir.path(), "pinned_cpu.ts", "cpu", "");
    let out = eval(&cfg, &ckpt);
    let err = stderr(&out);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("the file pins the device it runs on"), "{err}");
    let record: Value = serde_json::from_str(stdout(&out).lines().next().unwrap()).unwrap();
    let icr = record["icr"].as_f64().unwrap();
    assert!(icr.is_finite() && icr > 0.0 && icr <= 1.0, "{record}");
}

#[test]
fn a_device_that_is_not_there_is_a_usage_error_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("ckpt_000001.pt");
    std::fs::copy(fixtures().join("oom_weights.pt"), &ckpt).unwrap();
    let cfg = config(dir.path(), "oom_never.ts", "cuda:7", "");
    let out = eval(&cfg, &ckpt);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("device cuda:7: not available"), "{err}");
    assert!(err.contains("set `device` to cpu or auto"), "{err}");
}

/// The same checkpoint through a network that fails above 4 images a forward and through one
/// that never fails: the first is retried in halves (32 → 16 → 8 → 4 images) and gives the same
/// record. The views are drawn for the configured batch before the split, so only how many
/// images go through the network at once differs: per-image float32 arithmetic, equal to
/// rounding (a matrix product's blocking may differ with the batch: 1e-9 on ICR is far above
/// that and far below any real change).
#[test]
fn out_of_memory_in_a_forward_is_retried_in_smaller_batches_with_the_same_numbers() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("ckpt_000001.pt");
    std::fs::copy(fixtures().join("oom_weights.pt"), &ckpt).unwrap();
    let heldout = format!(
        "data: {{path: {d}, heldout_path: {d}}}\n",
        d = fixtures().join("data.h5").display()
    );
    let run = |arch: &str| {
        let sub = dir.path().join(arch);
        std::fs::create_dir(&sub).unwrap();
        let cfg = config(&sub, arch, "cpu", "");
        let text = std::fs::read_to_string(&cfg).unwrap();
        let text = text
            .lines()
            .map(|l| {
                if l.starts_with("data:") {
                    heldout.trim_end()
                } else {
                    l
                }
            })
            .collect::<Vec<_>>()
            .join("\n");
        std::fs::write(&cfg, text).unwrap();
        let out = eval(&cfg, &ckpt);
        assert!(out.status.success(), "{arch}: {}", stderr(&out));
        let record: Value = serde_json::from_str(stdout(&out).lines().next().unwrap()).unwrap();
        (record, stderr(&out))
    };
    let (want, quiet) = run("oom_never.ts");
    let (got, log) = run("oom_at_4.ts");
    assert!(!quiet.contains("out of memory"), "{quiet}");
    for batch in [32, 16, 8] {
        assert!(
            log.contains(&format!("out of memory in a forward of {batch} images")),
            "no halving from {batch} in: {log}"
        );
    }
    assert!(!log.contains("a forward of 4 images"), "{log}");
    for key in ["icr", "loss_train", "loss_heldout", "generalization_gap"] {
        let (a, b) = (want[key].as_f64().unwrap(), got[key].as_f64().unwrap());
        assert!(
            (a - b).abs() <= 1e-9 * a.abs().max(1.0),
            "{key}: {a} without the split, {b} with it"
        );
    }
}
