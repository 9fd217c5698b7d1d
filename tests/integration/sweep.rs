//! Sweeps (#19): one `diffmon watch` on three toy runs (two data-limited, one data-rich, each
//! with its own training data) records, for each run, the history and the early-stop decision
//! that a daemon of its own records; every run's series are on the one `/metrics` under its
//! `run` label, and the live page lists the runs.

use crate::common::root;
use crate::daemon::{Daemon, free_port};
use serde_json::Value;
use std::fs;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

/// (name, training images, seed): two data-limited runs and a data-rich one.
const RUNS: [(&str, usize, u64); 3] = [("small-a", 64, 1), ("small-b", 64, 2), ("rich", 1500, 0)];
/// Checkpoints per run (every 15 of 90 steps).
const CHECKPOINTS: f64 = 6.0;

/// Shared by the sweep and the separate daemons: one thread, a quick ICR, an early stop that
/// decides within a few checkpoints.
const SHARED: &str = "model: {architecture: small-a/model.ts}\ndevice: cpu\ncpu_threads: 1\n\
    checkpoints: {pattern: 'ckpt_*.pt', settle_secs: 0.2, poll_secs: 0.5}\n\
    icr: {samples: 256, batch_size: 256}\n\
    early_stop: {window: 1, warmup: 1, patience: 1, noise_multiple: 0, confirm: none}\n";

/// Trains the three runs (in parallel) into `root/<name>`.
fn train(at: &Path) {
    let children: Vec<_> = RUNS
        .iter()
        .map(|(name, size, seed)| {
            Command::new(root().join(".venv/bin/python"))
                .arg(root().join("python/train_toy.py"))
                .args(["--run-dir", at.join(name).to_str().unwrap()])
                .args(["--train-size", &size.to_string(), "--heldout-size", "256"])
                .args(["--width", "16", "--steps", "90", "--ckpt-every", "15"])
                .args(["--threads", "1", "--seed", &seed.to_string()])
                .env("PYTHONPATH", root().join("python"))
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::inherit())
                .spawn()
                .unwrap()
        })
        .collect();
    for mut c in children {
        assert!(c.wait().unwrap().success(), "the toy trainer failed");
    }
}

/// The run's evaluations in its history, without the wall-clock time they took.
fn history(state: &Path) -> Vec<Value> {
    fs::read_to_string(state.join("history.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .filter(|v| v["kind"] == "evaluation")
        .map(|v| {
            let mut r = v["record"].clone();
            r.as_object_mut().unwrap().remove("seconds");
            r
        })
        .collect()
}

/// `/v1/early-stop` without the time of firing.
fn decision(status: &Value) -> Value {
    let mut s = status.clone();
    if s["event"].is_object() {
        s["event"]["fired_at"] = Value::Null;
    }
    s
}

fn evaluated(d: &Daemon, run: &str) -> f64 {
    d.metric(&format!(
        "diffmon_checkpoints_evaluated_total{{run=\"{run}\"}}"
    ))
    .unwrap_or(-1.0)
}

#[test]
fn one_daemon_on_three_runs_records_what_three_daemons_record() {
    let dir = tempfile::tempdir().unwrap();
    let at = dir.path();
    train(at);

    // The sweep: each run its own data and state folder.
    let port = free_port();
    let mut text = format!("http: {{listen: \"127.0.0.1:{port}\"}}\n{SHARED}");
    text.push_str("data: {path: small-a/train.h5}\nruns:\n");
    for (name, _, _) in RUNS {
        text.push_str(&format!(
            "  - {{name: {name}, dir: {name}, state_dir: {name}/.sweep, \
             data: {{path: {name}/train.h5, heldout_path: {name}/heldout.h5}}}}\n"
        ));
    }
    let config = at.join("sweep.yaml");
    fs::write(&config, text).unwrap();
    let mut sweep = Daemon::spawn(config, port);
    sweep.wait_for(
        Duration::from_secs(240),
        "every checkpoint of every run",
        |d| RUNS.iter().all(|(r, _, _)| evaluated(d, r) >= CHECKPOINTS),
    );
    let metrics = sweep.get("/metrics").unwrap();
    let statuses: Value = serde_json::from_str(&sweep.get("/v1/early-stop").unwrap()).unwrap();
    let page = sweep.get("/").unwrap();
    for (name, _, _) in RUNS {
        assert_eq!(evaluated(&sweep, name), CHECKPOINTS, "{name}");
        for series in ["diffmon_icr{", "diffmon_last_evaluated_step{"] {
            assert!(
                metrics
                    .lines()
                    .any(|l| l.starts_with(series) && l.contains(&format!("run=\"{name}\""))),
                "{series} of {name} missing from /metrics:\n{metrics}"
            );
        }
        assert!(page.contains(&format!("href=\"runs/{name}\"")), "{page}");
        assert!(
            sweep.get(&format!("/runs/{name}")).is_some(),
            "{name}'s live page"
        );
    }
    // Each family once, with every run's samples.
    assert_eq!(
        metrics
            .lines()
            .filter(|l| l.starts_with("# TYPE diffmon_checkpoints_evaluated"))
            .count(),
        1,
        "{metrics}"
    );
    sweep.terminate();

    // Each run by a daemon of its own.
    let mut fired = Vec::new();
    for (name, _, _) in RUNS {
        let port = free_port();
        let config = at.join(format!("{name}.yaml"));
        fs::write(
            &config,
            format!(
                "http: {{listen: \"127.0.0.1:{port}\"}}\n{SHARED}run: {{name: {name}, dir: {name}}}\n\
                 data: {{path: {name}/train.h5, heldout_path: {name}/heldout.h5}}\n"
            ),
        )
        .unwrap();
        let mut alone = Daemon::spawn(config, port);
        alone.wait_for(Duration::from_secs(120), "every checkpoint", |d| {
            evaluated(d, name) >= CHECKPOINTS
        });
        let status: Value = serde_json::from_str(&alone.get("/v1/early-stop").unwrap()).unwrap();
        alone.terminate();

        let (together, apart) = (
            history(&at.join(name).join(".sweep")),
            history(&at.join(name).join(".diffmon")),
        );
        assert_eq!(together.len(), CHECKPOINTS as usize, "{name}");
        assert_eq!(together, apart, "{name}: the sweep's history differs");
        assert_eq!(
            decision(&statuses[name]),
            decision(&status),
            "{name}: the sweep's decision differs"
        );
        fired.push(status["fired"].as_bool().unwrap());
    }
    eprintln!("fired (small-a, small-b, rich): {fired:?}");
}
