//! Checkpoint folders (issue #16) with the real binary: a folder in `run.dir` is one checkpoint,
//! named by the folder, its step from the folder's name; one deleted during its evaluation (as
//! accelerate's `checkpoints_total_limit` rotation does) is evaluated from its pin and recorded
//! under its name; a run folder where nothing matches gets a warning naming what it saw; `eval` takes
//! folders and refuses a path without a step.

use crate::common::{diffmon, stderr, stdout, toy_run};
use crate::daemon::{Daemon, empty_run, journal, journal_entries};
use serde_json::Value;
use std::fs;
use std::path::Path;
use std::time::Duration;

/// An accelerate-style checkpoint folder: the toy checkpoint as `pytorch_model.bin`, beside
/// optimizer state; written under a hidden name and renamed into place.
fn write_folder(run: &Path, name: &str) {
    let tmp = run.join(format!(".{name}.tmp"));
    fs::create_dir(&tmp).unwrap();
    fs::copy(
        toy_run().join("ckpt_000030.pt"),
        tmp.join("pytorch_model.bin"),
    )
    .unwrap();
    fs::write(tmp.join("optimizer.bin"), b"optimizer state").unwrap();
    fs::rename(&tmp, run.join(name)).unwrap();
}

#[test]
fn a_folder_deleted_during_its_evaluation_is_evaluated_from_its_pin_and_the_next_folder_too() {
    let run = empty_run();
    let dir = run.path();
    // The default pattern (it matches `model.ts`, the architecture the config names, which is
    // never taken for a checkpoint). Many ICR samples: an evaluation takes long enough to delete
    // its folder meanwhile.
    let d = Daemon::start(
        dir,
        "checkpoints: {settle_secs: 0.5, poll_secs: 0.5}\nicr: {samples: 8192, batch_size: 512}\n",
    );
    write_folder(dir, "checkpoint-100");
    d.wait_for_evaluation_of("checkpoint-100");
    fs::remove_dir_all(dir.join("checkpoint-100")).unwrap();
    d.wait_for(
        Duration::from_secs(180),
        "the deleted folder's record",
        |d| d.evaluated() >= 1.0,
    );
    write_folder(dir, "checkpoint-200");
    d.wait_for(Duration::from_secs(180), "the next folder", |d| {
        d.evaluated() >= 2.0
    });
    let (evals, failures) = journal(dir);
    assert_eq!(evals, vec![100, 200], "{}", d.log());
    assert!(failures.is_empty(), "{failures:?}");
    let named: Vec<String> = journal_entries(dir)
        .into_iter()
        .filter(|e| e["kind"] == "evaluation")
        .map(|e| e["record"]["checkpoint"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(
        named,
        [100, 200].map(|s| dir.join(format!("checkpoint-{s}")).display().to_string())
    );
    let status: Value = serde_json::from_str(&d.get("/v1/early-stop").unwrap()).unwrap();
    assert_eq!(status["last_step"], 200, "{status}");
    // The architecture is never taken for a checkpoint (not even warned about).
    assert!(
        !d.log()
            .lines()
            .any(|l| l.contains("checkpoint=") && l.contains("model.ts")),
        "{}",
        d.log()
    );
}

#[test]
fn a_run_folder_where_nothing_matches_gets_a_warning_naming_what_it_saw() {
    let run = empty_run();
    let dir = run.path();
    // Folders named without `checkpoint-` (no match for the default pattern) and a weights
    // file with no step in its name.
    for name in ["step_a", "step_b"] {
        write_folder(dir, name);
    }
    fs::copy(toy_run().join("ckpt_000030.pt"), dir.join("weights.pt")).unwrap();
    let d = Daemon::start(dir, "checkpoints: {settle_secs: 0.5, poll_secs: 0.5}\n");
    d.wait_for(Duration::from_secs(60), "the warning", |d| {
        d.log().contains("look like checkpoints")
    });
    let log = d.log();
    let line = log
        .lines()
        .find(|l| l.contains("look like checkpoints"))
        .unwrap();
    for what in [
        "step_a/ does not match checkpoints.pattern",
        "step_b/",
        "weights.pt has no step",
        "checkpoints.weights_files",
    ] {
        assert!(line.contains(what), "{what}: {line}");
    }
    assert_eq!(
        d.metric("diffmon_checkpoints_ignored{run=\"test\"}"),
        Some(3.0)
    );
    assert_eq!(d.evaluated(), 0.0);
}

#[test]
fn eval_takes_a_folder_and_steps_from_the_path_and_refuses_a_path_without_one() {
    let run = empty_run();
    let dir = run.path();
    write_folder(dir, "checkpoint-400");
    let config = dir.join("eval.yaml");
    fs::write(
        &config,
        "run: {dir: ., name: test}\nmodel: {architecture: model.ts}\ndevice: cpu\n\
         data: {path: train.h5}\nicr: {samples: 256, batch_size: 256}\n",
    )
    .unwrap();
    let eval = |what: &Path| -> Value {
        let out = diffmon(&[
            "eval",
            "--config",
            config.to_str().unwrap(),
            what.to_str().unwrap(),
            "--json",
        ]);
        assert!(out.status.success(), "{}", stderr(&out));
        serde_json::from_str(stdout(&out).trim()).unwrap()
    };
    let folder = eval(&dir.join("checkpoint-400"));
    assert_eq!(folder["step"], 400);
    assert_eq!(
        folder["checkpoint"].as_str().unwrap(),
        dir.join("checkpoint-400").display().to_string()
    );
    let inside = eval(&dir.join("checkpoint-400/pytorch_model.bin"));
    assert_eq!(inside["step"], 400);
    let flat = eval(&toy_run().join("ckpt_000030.pt"));
    let icr = |v: &Value| v["icr"].as_f64().unwrap();
    for v in [&folder, &inside] {
        assert!((icr(v) - icr(&flat)).abs() <= 1e-12 * icr(&flat).abs());
    }
    // No step anywhere in the path: a usage error naming it, not a made-up step.
    fs::copy(toy_run().join("ckpt_000030.pt"), dir.join("weights.pt")).unwrap();
    let out = diffmon(&[
        "eval",
        "--config",
        config.to_str().unwrap(),
        dir.join("weights.pt").to_str().unwrap(),
    ]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("weights.pt: no training step"),
        "{}",
        stderr(&out)
    );
}

#[test]
fn init_run_dir_writes_a_config_for_what_the_run_folder_holds() {
    let run = empty_run();
    let dir = run.path();
    for s in [100, 200] {
        write_folder(dir, &format!("checkpoint-{s}"));
    }
    let out = diffmon(&["init", "--run-dir", dir.to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    assert!(
        stderr(&out).contains("2 checkpoint folders (steps 100 to 200)"),
        "{}",
        stderr(&out)
    );
    for line in [
        "  pattern: \"checkpoint-*\"".to_string(),
        format!("  architecture: {}", dir.join("model.ts").display()),
        format!("  path: {}", dir.join("train.h5").display()),
        format!("  heldout_path: {}", dir.join("heldout.h5").display()),
    ] {
        assert!(text.lines().any(|l| l.starts_with(&line)), "{line}\n{text}");
    }
    let config = dir.join("init.yaml");
    fs::write(&config, &text).unwrap();
    let check = diffmon(&["check-config", config.to_str().unwrap()]);
    assert!(check.status.success(), "{}", stderr(&check));
    // Without held-out images the key is left commented out, so the config still checks.
    fs::remove_file(dir.join("heldout.h5")).unwrap();
    let text = stdout(&diffmon(&["init", "--run-dir", dir.to_str().unwrap()]));
    fs::write(&config, &text).unwrap();
    let check = diffmon(&["check-config", config.to_str().unwrap()]);
    assert!(check.status.success(), "{}", stderr(&check));
}
