//! Sweeps (#19): one `diffmon watch` on three toy runs (two data-limited, one data-rich, each
//! with its own training data) records, for each run, the history and the early-stop decision
//! that a daemon of its own records (a data-limited run's early stop fires); every run's series
//! are on the one `/metrics` under its `run` label, the live page lists the runs, each console
//! line names its run, and `report` and `replay` work on one run (`--run`) or, for `report`, on
//! each run and their index. With `runs_glob`, run folders join the running daemon as they
//! appear, up to `max_runs`.

use crate::common::{diffmon, root, stderr, stdout};
use crate::daemon::{Daemon, free_port};
use serde_json::Value;
use std::fs;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

/// (name, training images, seed): two data-limited runs and a data-rich one.
const RUNS: [(&str, usize, u64); 3] = [("small-a", 64, 1), ("small-b", 64, 2), ("rich", 1500, 0)];
/// Checkpoints per run (every sixth of the run's steps).
const CHECKPOINTS: f64 = 6.0;

/// Shared by the sweep and the separate daemons: one thread, a quick ICR, an early stop that
/// decides within a few checkpoints.
const SHARED: &str = "model: {architecture: small-a/model.ts}\ndevice: cpu\ncpu_threads: 1\n\
    checkpoints: {pattern: 'ckpt_*.pt', settle_secs: 0.2, poll_secs: 0.5}\n\
    icr: {samples: 256, batch_size: 256}\n\
    early_stop: {window: 1, warmup: 1, patience: 1, noise_multiple: 0, confirm: none}\n";

/// Trains the three runs (in parallel) into `at/<name>`, for `steps[i]` steps run `i`.
fn train(at: &Path, steps: [usize; 3]) {
    let children: Vec<_> = RUNS
        .iter()
        .zip(steps)
        .map(|((name, size, seed), steps)| {
            Command::new(root().join(".venv/bin/python"))
                .arg(root().join("python/train_toy.py"))
                .args(["--run-dir", at.join(name).to_str().unwrap()])
                .args(["--train-size", &size.to_string(), "--heldout-size", "256"])
                .args(["--width", "16", "--steps", &steps.to_string()])
                .args(["--ckpt-every", &(steps / 6).to_string()])
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

/// `/v1/early-stop` without the time of firing and the event id, and with the kept best
/// checkpoint by its name (the copy sits in the run's state folder, which differs between the
/// sweep and the daemons, and the id hashes the state folder too).
fn decision(status: &Value) -> Value {
    let mut s = status.clone();
    if s["event"].is_object() {
        s["event"]["fired_at"] = Value::Null;
        s["event"]["id"] = Value::Null;
        if let Some(kept) = s["event"]["best_checkpoint_kept"].as_str() {
            let name = Path::new(kept)
                .file_name()
                .unwrap()
                .to_str()
                .unwrap()
                .to_string();
            s["event"]["best_checkpoint_kept"] = Value::String(name);
        }
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
    // small-a long enough for its ICR to turn (on 64 images it does by step 750); the others
    // short, as the test's time goes.
    train(at, [900, 90, 90]);

    // The sweep: each run its own data (so no top-level `data`) and state folder.
    let port = free_port();
    let mut text = format!("http: {{listen: \"127.0.0.1:{port}\"}}\n{SHARED}");
    text.push_str("runs:\n");
    for (name, _, _) in RUNS {
        text.push_str(&format!(
            "  - {{name: {name}, dir: {name}, state_dir: {name}/.sweep, \
             data: {{path: {name}/train.h5, heldout_path: {name}/heldout.h5}}}}\n"
        ));
    }
    let config = at.join("sweep.yaml");
    fs::write(&config, text).unwrap();
    let mut sweep = Daemon::spawn(config.clone(), port);
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
    // On the console, where the runs' lines interleave, each line names its run.
    let log = sweep.log();
    for (name, _, _) in RUNS {
        let line = format!("[{name}] step ");
        assert!(
            log.lines().any(|l| l.starts_with(&line)),
            "no {line:?}:\n{log}"
        );
    }
    assert!(!log.lines().any(|l| l.starts_with("step ")), "{log}");
    assert!(
        log.lines()
            .any(|l| l.starts_with("[small-a] EARLY STOP: ")
                || l.starts_with("[small-b] EARLY STOP: ")),
        "{log}"
    );
    sweep_report_and_replay(at, &config, &statuses);

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
    // The decisions compared above include a fired one.
    assert!(fired[0] || fired[1], "no data-limited run fired: {fired:?}");
}

/// `report` and `replay` of the sweep `config` (whose runs have their histories): without `--run`,
/// a page per run and the index linking them (HTML), and a replay refused (exit 2) naming the
/// runs; with `--run`, that run's page and its replay, which fires as the sweep's run did.
fn sweep_report_and_replay(at: &Path, config: &Path, statuses: &Value) {
    let config = config.to_str().unwrap();
    let out = at.join("report.html");
    let all = diffmon(&["report", "--config", config, "--out", out.to_str().unwrap()]);
    assert!(all.status.success(), "{}", stderr(&all));
    assert_eq!(
        stdout(&all).lines().count(),
        RUNS.len() + 1,
        "{}",
        stdout(&all)
    );
    let index = fs::read_to_string(&out).unwrap();
    assert!(index.contains(r#"name="viewport""#), "{index}");
    for (name, _, _) in RUNS {
        assert!(
            index.contains(&format!("href=\"report-{name}.html\"")),
            "{index}"
        );
        let page = fs::read_to_string(at.join(format!("report-{name}.html"))).unwrap();
        assert!(
            page.contains(&format!("<h1>diffmon: {name}</h1>")),
            "{name}"
        );
    }

    let one = at.join("one.svg");
    let args = ["report", "--config", config, "--run", "small-b", "--out"];
    let report = diffmon(&[&args[..], &[one.to_str().unwrap()]].concat());
    assert!(report.status.success(), "{}", stderr(&report));
    assert!(
        fs::read_to_string(&one)
            .unwrap()
            .contains("diffmon: small-b")
    );
    let unknown = diffmon(&[
        "report", "--config", config, "--run", "nope", "--out", "x.svg",
    ]);
    assert_eq!(unknown.status.code(), Some(2), "{}", stderr(&unknown));

    let replay = diffmon(&["replay", "--config", config, "--run", "small-a", "--json"]);
    assert!(replay.status.success(), "{}", stderr(&replay));
    let summary: Value = serde_json::from_str(stdout(&replay).lines().last().unwrap()).unwrap();
    assert_eq!(summary["kind"], "summary");
    assert_eq!(summary["evaluations"], CHECKPOINTS as u64);
    assert_eq!(summary["fired"], statuses["small-a"]["fired"], "{summary}");
    let refused = diffmon(&["replay", "--config", config]);
    assert_eq!(refused.status.code(), Some(2), "{}", stderr(&refused));
    assert!(
        stderr(&refused).contains("`small-a`, `small-b`, `rich`"),
        "{}",
        stderr(&refused)
    );
}

/// `runs_glob`: a daemon started on a folder with no run yet adds each run folder as it
/// appears (moved in whole, as a sweep launcher creating folders would), evaluates all of its
/// checkpoints once, and lists it on `/v1/early-stop`, `/metrics` and the front page; hidden
/// folders, symbolic links and names that are not run names are not runs. A restart finds
/// both runs at once and evaluates nothing again.
#[test]
fn runs_glob_picks_up_run_folders_as_they_appear() {
    let dir = tempfile::tempdir().unwrap();
    let at = dir.path();
    let stage = at.join("stage");
    fs::create_dir(&stage).unwrap();
    train(&stage, [90; 3]);
    let sweep_dir = at.join("sweep");
    fs::create_dir(&sweep_dir).unwrap();
    fs::create_dir(sweep_dir.join(".hidden")).unwrap();
    fs::create_dir(sweep_dir.join("not a run name")).unwrap();
    std::os::unix::fs::symlink(stage.join("rich"), sweep_dir.join("lr-link")).unwrap();

    let port = free_port();
    let config = at.join("sweep.yaml");
    fs::write(
        &config,
        format!(
            "http: {{listen: \"127.0.0.1:{port}\"}}\n{SHARED}\
             data: {{path: small-a/train.h5, heldout_path: small-a/heldout.h5}}\n\
             runs_glob: sweep/lr-*\n"
        ),
    )
    .unwrap();
    // The shared files sit outside the runs' folders.
    fs::rename(stage.join("small-a/model.ts"), at.join("model.ts")).unwrap();
    fs::create_dir(at.join("small-a")).unwrap();
    for f in ["train.h5", "heldout.h5"] {
        fs::copy(stage.join("small-a").join(f), at.join("small-a").join(f)).unwrap();
    }
    let text = fs::read_to_string(&config)
        .unwrap()
        .replace("small-a/model.ts", "model.ts");
    fs::write(&config, text).unwrap();

    let mut d = Daemon::spawn(config, port);
    let runs =
        |d: &Daemon| -> Value { serde_json::from_str(&d.get("/v1/early-stop").unwrap()).unwrap() };
    assert_eq!(runs(&d), serde_json::json!({}), "no run yet");
    for (k, (name, run)) in [("small-a", "lr-a"), ("small-b", "lr-b")]
        .into_iter()
        .enumerate()
    {
        fs::rename(stage.join(name), sweep_dir.join(run)).unwrap();
        d.wait_for(
            Duration::from_secs(180),
            &format!("every checkpoint of {run}"),
            |d| evaluated(d, run) >= CHECKPOINTS,
        );
        let listed = runs(&d);
        let names: Vec<&String> = listed.as_object().unwrap().keys().collect();
        assert_eq!(names.len(), k + 1, "{listed}");
    }
    let page = d.get("/").unwrap();
    for run in ["lr-a", "lr-b"] {
        assert!(page.contains(&format!("href=\"runs/{run}\"")), "{page}");
        assert_eq!(evaluated(&d, run), CHECKPOINTS, "{run} evaluated once each");
        assert_eq!(
            history(&sweep_dir.join(run).join(".diffmon")).len(),
            CHECKPOINTS as usize,
            "{run}"
        );
    }
    let metrics = d.get("/metrics").unwrap();
    assert!(
        !metrics.contains("lr-link") && !metrics.contains("hidden"),
        "{metrics}"
    );
    assert!(
        !sweep_dir.join("lr-link/.diffmon").exists(),
        "a linked folder is not a run"
    );
    assert!(d.log().contains("a new run joins the sweep"), "{}", d.log());
    let a = history(&sweep_dir.join("lr-a/.diffmon"));
    let b = history(&sweep_dir.join("lr-b/.diffmon"));
    assert_ne!(a, b, "each run's own checkpoints");

    // Restarted: both runs at once, nothing evaluated again.
    d.restart();
    d.wait_for(Duration::from_secs(60), "both runs listed", |d| {
        runs(d).as_object().is_some_and(|o| o.len() == 2)
    });
    std::thread::sleep(Duration::from_secs(3));
    for run in ["lr-a", "lr-b"] {
        assert_eq!(
            history(&sweep_dir.join(run).join(".diffmon")).len(),
            CHECKPOINTS as usize,
            "{run}"
        );
    }
    d.terminate();
}

/// `max_runs`: of the folders `runs_glob` matches, the first by name are the runs; the others
/// are left out with a WARN naming them and counted in `diffmon_runs_ignored` (before: dropped
/// silently), and a folder that appears later is not added beyond the cap (before: a new `lr-0`
/// made one run more than the cap).
#[test]
fn runs_glob_stops_at_max_runs_and_says_so() {
    let dir = crate::daemon::empty_run();
    let at = dir.path();
    let sweep_dir = at.join("sweep");
    for run in ["lr-1", "lr-2", "lr-3"] {
        fs::create_dir_all(sweep_dir.join(run)).unwrap();
    }
    let port = free_port();
    let config = at.join("sweep.yaml");
    fs::write(
        &config,
        format!(
            "http: {{listen: \"127.0.0.1:{port}\"}}\nmodel: {{architecture: model.ts}}\n\
             device: cpu\ncpu_threads: 1\ndata: {{path: train.h5}}\n\
             checkpoints: {{poll_secs: 0.3}}\nicr: {{samples: 256, batch_size: 256}}\n\
             runs_glob: sweep/lr-*\nmax_runs: 2\n"
        ),
    )
    .unwrap();
    let mut d = Daemon::spawn(config, port);
    let runs = |d: &Daemon| -> Vec<String> {
        let v: Value = serde_json::from_str(&d.get("/v1/early-stop").unwrap()).unwrap();
        v.as_object().unwrap().keys().cloned().collect()
    };
    assert_eq!(runs(&d), ["lr-1", "lr-2"]);
    // The runs name one architecture file: it is loaded once, the second run shares it.
    let log = d.log();
    assert_eq!(log.matches("model loaded").count(), 1, "{log}");
    assert_eq!(
        log.matches("model shared with an earlier run").count(),
        1,
        "{log}"
    );
    d.wait_for(Duration::from_secs(30), "the count of left-out runs", |d| {
        d.metric("diffmon_runs_ignored") == Some(1.0)
    });
    let log = d.log();
    assert!(
        log.lines().any(|l| l.contains("WARN")
            && l.contains("max_runs (2 runs): 1 run folder is left out")
            && l.contains("lr-3")),
        "{log}"
    );
    // A folder that sorts first appears: still two runs, two left out.
    fs::create_dir(sweep_dir.join("lr-0")).unwrap();
    d.wait_for(Duration::from_secs(30), "two left-out runs", |d| {
        d.metric("diffmon_runs_ignored") == Some(2.0)
    });
    std::thread::sleep(Duration::from_secs(1));
    assert_eq!(
        runs(&d),
        ["lr-1", "lr-2"],
        "a run beyond max_runs was added"
    );
    assert!(!sweep_dir.join("lr-0/.diffmon").exists());
    assert!(
        !d.log().contains("a new run joins the sweep"),
        "{}",
        d.log()
    );
    d.terminate();
}
