//! `trackers.tensorboard` end to end (docs/design.md §21): the daemon's event files read back
//! by TensorBoard's own event accumulator and file loader (`tensorboard_reader.py`), over a
//! U-shaped ICR curve that fires, a SIGKILL and restart, and a `diffmon resume`.

use crate::common::{diffmon, run_python, stderr};
use crate::daemon::{Daemon, empty_run, journal_entries};
use crate::early_stop::{checkpoints_by_icr, detector_config, place, write_base_config};
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

/// What TensorBoard reads in `folder` (see `tensorboard_reader.py`).
fn tensorboard(folder: &Path) -> Value {
    let out = run_python(&[
        "tests/integration/tensorboard_reader.py",
        folder.to_str().unwrap(),
    ]);
    serde_json::from_slice(&out.stdout).unwrap()
}

/// The steps of `tag` in the reader's `section`.
fn steps(tb: &Value, section: &str, tag: &str) -> Vec<i64> {
    let rows = tb[section][tag].as_array().cloned().unwrap_or_default();
    rows.iter()
        .map(|r| r.as_i64().unwrap_or_else(|| r[0].as_i64().unwrap()))
        .collect()
}

/// Every numeric field of the journal's evaluations of the current lineage, by step:
/// `{step: {field: value}}` (a later entry for the same step replaces the earlier).
fn journal_values(dir: &Path) -> BTreeMap<i64, BTreeMap<String, f64>> {
    let mut out = BTreeMap::new();
    for entry in journal_entries(dir) {
        if entry["kind"] == "resume" {
            let step = entry["step"].as_i64().unwrap();
            out.retain(|s, _| *s <= step);
        }
        if entry["kind"] != "evaluation" {
            continue;
        }
        let record = entry["record"].as_object().unwrap();
        let fields = record
            .iter()
            .filter(|(k, _)| !["step", "seconds", "stages"].contains(&k.as_str()))
            .filter_map(|(k, v)| Some((k.clone(), v.as_f64()?)))
            .collect();
        out.insert(record["step"].as_i64().unwrap(), fields);
    }
    out
}

/// The reader's scalars agree with the journal: each field of each evaluation at its step, as
/// the float32 TensorBoard keeps (relative 1e-6: float32's 24-bit mantissa rounds at 6e-8, and
/// the sums that formed the values are the daemon's, not redone here).
fn assert_scalars_match_the_journal(tb: &Value, dir: &Path) {
    let journal = journal_values(dir);
    let steps_of: Vec<i64> = journal.keys().copied().collect();
    assert_eq!(steps(tb, "scalars", "diffmon/icr"), steps_of, "{tb}");
    assert_eq!(steps(tb, "scalars", "diffmon/evaluation_seconds"), steps_of);
    assert_eq!(steps(tb, "scalars", "diffmon/icr_smoothed"), steps_of);
    for (step, fields) in &journal {
        assert!(
            fields.len() >= 8,
            "few fields in the record of {step}: {fields:?}"
        );
        for (field, want) in fields {
            let rows = tb["scalars"][format!("diffmon/{field}")].as_array();
            let row = rows
                .and_then(|rows| rows.iter().find(|r| r[0] == *step))
                .unwrap_or_else(|| panic!("no diffmon/{field} at step {step}: {tb}"));
            let got = row[1].as_f64().unwrap();
            assert!(
                (got - want).abs() <= 1e-6 * want.abs().max(1e-30),
                "diffmon/{field} at {step}: {got} vs the journal's {want}"
            );
        }
    }
}

#[test]
fn tensorboard_shows_every_metric_and_the_early_stop_once_across_a_kill_and_a_resume() {
    let run = empty_run();
    let dir = run.path();
    write_base_config(dir, "");
    let (hi, lo, rise) = checkpoints_by_icr(dir);
    let config = format!(
        "checkpoints: {{pattern: \"ckpt_*.pt\", settle_secs: 0.2, poll_secs: 0.5}}\n{}\
         trackers: {{tensorboard: {{dir: logs}}}}\n",
        detector_config(rise)
    );
    let mut d = Daemon::start(dir, &config);
    let check = diffmon(&["check-config", d.config.to_str().unwrap()]);
    assert!(
        String::from_utf8_lossy(&check.stdout).contains(&format!(
            "tracker tensorboard: {}",
            dir.join("logs/diffmon/test").display()
        )),
        "{}",
        String::from_utf8_lossy(&check.stdout)
    );
    // High, low, low, high, high: fires at 5 with the best at 2.
    for (step, src) in [(1, &hi), (2, &lo), (3, &lo), (4, &hi), (5, &hi)] {
        place(dir, src, step);
    }
    let fired = |d: &Daemon| {
        let status: Value =
            serde_json::from_str(&d.get("/v1/early-stop").unwrap_or_default()).unwrap_or_default();
        status["fired"] == true
    };
    d.wait_for(Duration::from_secs(240), "the early stop", fired);

    // SIGKILL, whatever the writer was doing, and a restart: the points written are not
    // written again, those not written yet are, and the run goes on.
    d.restart();
    place(dir, &hi, 6);
    d.wait_for(Duration::from_secs(120), "step 6", |d| d.evaluated() >= 1.0);
    d.terminate();
    let folder = dir.join("logs/diffmon/test");
    let tb = tensorboard(&folder);
    assert_eq!(
        tb["files"].as_array().unwrap().len(),
        2,
        "one file per start: {tb}"
    );
    assert_eq!(steps(&tb, "raw", "diffmon/icr"), [1, 2, 3, 4, 5, 6], "{tb}");
    assert_eq!(steps(&tb, "raw", "diffmon/early_stop"), [5], "{tb}");
    assert_scalars_match_the_journal(&tb, dir);
    // Wall time: when the checkpoint was written.
    let written = std::fs::metadata(dir.join("ckpt_1.pt"))
        .unwrap()
        .modified()
        .unwrap()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64();
    let wall = tb["scalars"]["diffmon/icr"][0][2].as_f64().unwrap();
    assert!(
        (wall - written).abs() < 1e-5,
        "{wall} vs the file's {written}"
    );
    let texts = &tb["texts"]["diffmon/early_stop_summary"];
    assert_eq!(texts[0][0], 5, "{tb}");
    let text = texts[0][1].as_str().unwrap();
    assert!(
        text.contains("early stop for run test") && text.contains("ckpt_2.pt"),
        "{text}"
    );
    assert_eq!(tb["scalars"]["diffmon/early_stop"][0][1], 1.0);

    // `diffmon resume` goes back to step 2; the new segment's 3 and 4 follow.
    let out = diffmon(&["resume", "--config", d.config.to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr(&out));
    let mut d = Daemon::spawn(d.config.clone(), d.port);
    for step in [3, 4] {
        place(dir, &lo, step);
    }
    d.wait_for(Duration::from_secs(120), "the new segment", |d| {
        d.evaluated() >= 2.0
    });
    d.terminate();
    let tb = tensorboard(&folder);
    // A START at 3 drops the abandoned branch (3 to 6) from TensorBoard's view; every file
    // still holds each point once.
    let starts: Vec<i64> = tb["starts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s.as_i64().unwrap())
        .collect();
    let (opening, resumes): (Vec<i64>, Vec<i64>) = starts.iter().partition(|&&s| s == i64::MAX);
    assert_eq!(
        opening.len(),
        3,
        "each file opens with a START that drops nothing: {starts:?}"
    );
    assert_eq!(resumes, [3], "{starts:?}");
    assert_eq!(steps(&tb, "raw", "diffmon/icr"), [1, 2, 3, 4, 5, 6, 3, 4]);
    assert_scalars_match_the_journal(&tb, dir);
    // The resolution, decided at the resume (step 2), is shown; the early stop at 5 was on the
    // abandoned branch.
    assert_eq!(steps(&tb, "scalars", "diffmon/early_stop"), [2], "{tb}");
    assert_eq!(tb["scalars"]["diffmon/early_stop"][0][1], 0.0);
    let text = tb["texts"]["diffmon/early_stop_summary"][0][1]
        .as_str()
        .unwrap();
    assert!(text.contains("early stop resolved for run test"), "{text}");
}

/// A log folder that is a symbolic link is refused with a WARN naming the key and the folder;
/// the evaluations go on and nothing is written through the link.
#[test]
fn a_symlinked_tensorboard_folder_is_refused_and_the_evaluations_go_on() {
    let run = empty_run();
    let dir = run.path();
    let elsewhere = tempfile::tempdir().unwrap();
    std::os::unix::fs::symlink(elsewhere.path(), dir.join("logs")).unwrap();
    let (_, lo, _) = {
        write_base_config(dir, "");
        checkpoints_by_icr(dir)
    };
    let d = Daemon::start(
        dir,
        "checkpoints: {pattern: \"ckpt_*.pt\", settle_secs: 0.2, poll_secs: 0.5}\n\
         trackers: {tensorboard: {dir: logs}}\n",
    );
    place(dir, &lo, 1);
    d.wait_for(Duration::from_secs(120), "step 1", |d| d.evaluated() >= 1.0);
    let log = d.log();
    assert!(
        log.contains("trackers.tensorboard.dir: cannot write the TensorBoard events")
            && log.contains("symbolic link"),
        "{log}"
    );
    assert_eq!(
        std::fs::read_dir(elsewhere.path()).unwrap().count(),
        0,
        "written through the link"
    );
}

// --- MLflow -------------------------------------------------------------------------------------

unsafe extern "C" {
    fn kill(pid: i32, sig: i32) -> i32;
}

/// A real `mlflow server` on 127.0.0.1 (a SQLite store in `dir`), in a process group of its
/// own (it starts its web server as a child), killed with it.
struct MlflowServer {
    child: std::process::Child,
    port: u16,
    dir: std::path::PathBuf,
}

impl MlflowServer {
    fn start(dir: &Path, port: u16) -> MlflowServer {
        use std::os::unix::process::CommandExt;
        std::fs::create_dir_all(dir).unwrap();
        let child = std::process::Command::new(crate::common::root().join(".venv/bin/mlflow"))
            .args([
                "server",
                "--host",
                "127.0.0.1",
                "--port",
                &port.to_string(),
                "--workers",
                "1",
            ])
            .arg("--backend-store-uri")
            .arg(format!("sqlite:///{}", dir.join("mlflow.db").display()))
            .arg("--default-artifact-root")
            .arg(dir.join("artifacts"))
            .current_dir(dir)
            .stdin(std::process::Stdio::null())
            .stdout(std::fs::File::create(dir.join("server.log")).unwrap())
            .stderr(std::fs::File::create(dir.join("server.err")).unwrap())
            .process_group(0)
            .spawn()
            .expect("mlflow (python/requirements.txt, installed by make setup)");
        let server = MlflowServer {
            child,
            port,
            dir: dir.to_path_buf(),
        };
        let start = std::time::Instant::now();
        while crate::common::http_get(&format!("http://127.0.0.1:{port}/health")).is_none() {
            assert!(
                start.elapsed() < Duration::from_secs(180),
                "mlflow server did not answer: {}",
                std::fs::read_to_string(dir.join("server.err")).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(200));
        }
        server
    }

    fn stop(&mut self) {
        unsafe { kill(-(self.child.id() as i32), 9) };
        let _ = self.child.wait();
    }

    /// `method endpoint` of the REST API with a JSON body (or query, for GET); the answer.
    fn call(&self, method: &str, endpoint: &str, body: &str) -> Value {
        let script = "import json, sys, urllib.request, urllib.parse\n\
            method, url, body = sys.argv[1:4]\n\
            if method == 'GET':\n    url += '?' + urllib.parse.urlencode(json.loads(body)); data = None\n\
            else:\n    data = body.encode()\n\
            r = urllib.request.Request(url, data=data, method=method, headers={'Content-Type': 'application/json'})\n\
            print(urllib.request.urlopen(r).read().decode())\n";
        let url = format!("http://127.0.0.1:{}/api/2.0/mlflow/{endpoint}", self.port);
        let out = run_python(&["-c", script, method, &url, body]);
        serde_json::from_slice(&out.stdout).unwrap()
    }

    /// The steps and values of a metric's history in `run`, by step.
    fn history(&self, run: &str, key: &str) -> Vec<(i64, f64)> {
        let body = serde_json::json!({"run_id": run, "metric_key": key, "max_results": 25000});
        let v = self.call("GET", "metrics/get-history", &body.to_string());
        let mut rows: Vec<(i64, f64)> = v["metrics"]
            .as_array()
            .cloned()
            .unwrap_or_default()
            .iter()
            .map(|m| (m["step"].as_i64().unwrap(), m["value"].as_f64().unwrap()))
            .collect();
        rows.sort_by(|a, b| a.partial_cmp(b).unwrap());
        rows
    }
}

impl Drop for MlflowServer {
    fn drop(&mut self) {
        self.stop();
        let _ = &self.dir;
    }
}

/// The training job's run on a real `mlflow server` gets every metric of every evaluation and
/// the early stop's tags, exactly once, although the server was down for part of the run and
/// the daemon was killed meanwhile: the journal is the outbox.
#[test]
fn mlflow_gets_every_metric_once_into_the_training_run_across_an_outage_a_kill_and_a_slow_server() {
    let run = empty_run();
    let dir = run.path();
    write_base_config(dir, "");
    let (hi, lo, rise) = checkpoints_by_icr(dir);
    let port = crate::daemon::free_port();
    let mut server = MlflowServer::start(&dir.join("mlflow"), port);
    let experiment = server.call("POST", "experiments/create", r#"{"name": "training"}"#);
    let made = server.call(
        "POST",
        "runs/create",
        &serde_json::json!({"experiment_id": experiment["experiment_id"], "run_name": "job"})
            .to_string(),
    );
    let run_id = made["run"]["info"]["run_id"].as_str().unwrap().to_string();
    // The training job's environment, inherited by the daemon (a name of this test's own).
    unsafe { std::env::set_var("DIFFMON_TEST_MLFLOW_RUN_ID", &run_id) };
    let config = format!(
        "checkpoints: {{pattern: \"ckpt_*.pt\", settle_secs: 0.2, poll_secs: 0.5}}\n{}\
         trackers: {{mlflow: {{uri: 'http://127.0.0.1:{port}', run_id_env: DIFFMON_TEST_MLFLOW_RUN_ID}}}}\n",
        detector_config(rise)
    );
    let mut d = Daemon::start(dir, &config);
    let check = diffmon(&["check-config", d.config.to_str().unwrap()]);
    assert!(
        String::from_utf8_lossy(&check.stdout).contains(&format!(
            "tracker mlflow: http://127.0.0.1:{port}/ (run {run_id})"
        )),
        "{}",
        String::from_utf8_lossy(&check.stdout)
    );
    place(dir, &hi, 1);
    place(dir, &lo, 2);
    let wait_for = |what: &str, mut done: Box<dyn FnMut() -> bool + '_>| {
        let start = std::time::Instant::now();
        while !done() {
            assert!(
                start.elapsed() < Duration::from_secs(180),
                "timed out waiting for {what}"
            );
            std::thread::sleep(Duration::from_millis(300));
        }
    };
    wait_for(
        "steps 1 and 2 on the server",
        Box::new(|| server.history(&run_id, "diffmon/icr").len() == 2),
    );

    // The server goes away; the run goes on and fires; the daemon is killed and restarted
    // while the server is still down.
    server.stop();
    for (step, src) in [(3, &lo), (4, &hi), (5, &hi)] {
        place(dir, src, step);
    }
    let fired = |d: &Daemon| {
        let status: Value =
            serde_json::from_str(&d.get("/v1/early-stop").unwrap_or_default()).unwrap_or_default();
        status["fired"] == true
    };
    d.wait_for(Duration::from_secs(240), "the early stop", fired);
    assert!(
        d.log()
            .contains("trackers.mlflow: runs/log-batch: no answer from the server"),
        "{}",
        d.log()
    );
    d.restart();
    let server = MlflowServer::start(&dir.join("mlflow"), port);
    wait_for(
        "the early stop on the server",
        Box::new(|| !server.history(&run_id, "diffmon/early_stop").is_empty()),
    );
    d.terminate();

    let journal = journal_values(dir);
    for field in [
        "icr",
        "icr_stderr",
        "loss_train",
        "generalization_gap",
        "icr_samples",
    ] {
        let got = server.history(&run_id, &format!("diffmon/{field}"));
        let want: Vec<(i64, f64)> = journal.iter().map(|(s, f)| (*s, f[field])).collect();
        // Doubles all the way (JSON, SQLite REAL): the journal's values exactly, once each.
        assert_eq!(got, want, "diffmon/{field}");
    }
    assert_eq!(server.history(&run_id, "diffmon/icr_smoothed").len(), 5);
    assert_eq!(server.history(&run_id, "diffmon/early_stop"), [(5, 1.0)]);
    let got = server.call(
        "GET",
        "runs/get",
        &serde_json::json!({"run_id": run_id}).to_string(),
    );
    let tags: BTreeMap<String, String> = got["run"]["data"]["tags"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| {
            (
                t["key"].as_str().unwrap().into(),
                t["value"].as_str().unwrap().into(),
            )
        })
        .collect();
    assert_eq!(tags["diffmon.early_stop"], "early_stop", "{tags:?}");
    assert_eq!(tags["diffmon.early_stop.best_step"], "2");
    assert_eq!(tags["diffmon.early_stop.step"], "5");
    assert!(tags["diffmon.early_stop.summary"].contains("early stop for run test"));
    assert!(tags["diffmon.early_stop.kept_copy"].ends_with(".diffmon/best/ckpt_2.pt"));
    // The cursor: five evaluations and the early stop accepted, into the training job's run
    // (the server's store would also keep a resent metric once; the cursor sends none twice).
    let cursor: Value =
        serde_json::from_slice(&std::fs::read(dir.join(".diffmon/trackers/mlflow.json")).unwrap())
            .unwrap();
    assert_eq!(cursor["delivered"], 6, "{cursor}");
    assert_eq!(cursor["run_id"], run_id.as_str());

    // A run id the server does not know: a WARN naming the key and the server's own words;
    // the evaluations go on, nothing is counted as accepted.
    let set_run = |config: &Path, port: u16, run: &str| {
        let text = std::fs::read_to_string(config).unwrap();
        let text: Vec<String> = text
            .lines()
            .map(|l| match l.starts_with("trackers:") {
                true => format!("trackers: {{mlflow: {{uri: 'http://127.0.0.1:{port}', {run}}}}}"),
                false => l.to_string(),
            })
            .collect();
        std::fs::write(config, text.join("\n") + "\n").unwrap();
    };
    set_run(&d.config, port, "run_id: f00d");
    let mut d = Daemon::spawn(d.config.clone(), d.port);
    d.wait_for(Duration::from_secs(60), "the refusal", |d| {
        d.log()
            .contains("trackers.mlflow.run_id: runs/log-batch answered 404")
    });
    assert!(d.log().contains("RESOURCE_DOES_NOT_EXIST"), "{}", d.log());
    d.terminate();
    // Experiment mode: a run of diffmon's own, made once in a new experiment, gets the whole
    // history (the target changed), and a restart goes on into the same run.
    set_run(&d.config, port, "experiment: diffmon-runs");
    let mut d = Daemon::spawn(d.config.clone(), d.port);
    let own = || -> Option<String> {
        let c: Value =
            serde_json::from_slice(&std::fs::read(dir.join(".diffmon/trackers/mlflow.json")).ok()?)
                .ok()?;
        // The cursor of the training run's phase says 6 delivered too, until the daemon writes
        // its own run's: wait for a run id that is not the training run's.
        let id = c["run_id"].as_str()?;
        (c["delivered"] == 6 && id != run_id).then(|| id.to_string())
    };
    wait_for("diffmon's own run", Box::new(|| own().is_some()));
    let own_id = own().unwrap();
    assert_ne!(own_id, run_id);
    assert_eq!(server.history(&own_id, "diffmon/icr").len(), 5);
    d.restart();
    place(dir, &hi, 6);
    wait_for(
        "step 6 in diffmon's run",
        Box::new(|| server.history(&own_id, "diffmon/icr").len() == 6),
    );
    let made = server.call(
        "GET",
        "experiments/get-by-name",
        r#"{"experiment_name": "diffmon-runs"}"#,
    );
    assert!(made["experiment"]["experiment_id"].is_string(), "{made}");

    // A server that takes its time (a proxy that holds every request until released): the
    // evaluations go on at their pace, the tracker says it falls behind, and once the server
    // answers, every point arrives once.
    d.terminate();
    let proxy = HoldingProxy::start(port);
    set_run(&d.config, proxy.port, "experiment: diffmon-runs");
    let mut d = Daemon::spawn(d.config.clone(), d.port);
    for step in 7..=16 {
        place(dir, &hi, step);
    }
    d.wait_for(Duration::from_secs(180), "ten more evaluations", |_| {
        journal_values(dir).len() == 16
    });
    d.wait_for(Duration::from_secs(30), "the WARN", |d| {
        d.log().contains("the tracker falls behind")
    });
    assert!(d.log().contains("waiting=10"), "{}", d.log());
    assert_eq!(
        server.history(&own_id, "diffmon/icr").len(),
        6,
        "through a held proxy"
    );
    proxy.release();
    wait_for(
        "steps 7 to 16 in diffmon's run",
        Box::new(|| server.history(&own_id, "diffmon/icr").len() == 16),
    );
    let steps: Vec<i64> = server
        .history(&own_id, "diffmon/icr")
        .iter()
        .map(|p| p.0)
        .collect();
    assert_eq!(steps, (1..=16).collect::<Vec<_>>(), "each step once");
    d.wait_for(Duration::from_secs(30), "the INFO", |d| {
        d.log().contains("trackers.mlflow: caught up")
    });
    d.terminate();
}

/// A TCP proxy to `127.0.0.1:<to>` that holds every connection it accepts (a server that does
/// not answer yet) until [`HoldingProxy::release`], then forwards them and those after.
struct HoldingProxy {
    port: u16,
    held: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl HoldingProxy {
    fn start(to: u16) -> HoldingProxy {
        use std::net::{Shutdown, TcpListener, TcpStream};
        use std::sync::atomic::Ordering;
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let held = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
        let flag = held.clone();
        std::thread::spawn(move || {
            for client in listener.incoming().flatten() {
                let flag = flag.clone();
                std::thread::spawn(move || {
                    while flag.load(Ordering::SeqCst) {
                        std::thread::sleep(Duration::from_millis(50));
                    }
                    let Ok(server) = TcpStream::connect(("127.0.0.1", to)) else {
                        return;
                    };
                    let (mut up_from, mut up_to) =
                        (client.try_clone().unwrap(), server.try_clone().unwrap());
                    std::thread::spawn(move || {
                        let _ = std::io::copy(&mut up_from, &mut up_to);
                        let _ = up_to.shutdown(Shutdown::Write);
                    });
                    let (mut down_to, mut down_from) = (client, server);
                    let _ = std::io::copy(&mut down_from, &mut down_to);
                    let _ = down_to.shutdown(Shutdown::Both);
                });
            }
        });
        HoldingProxy { port, held }
    }

    fn release(&self) {
        self.held.store(false, std::sync::atomic::Ordering::SeqCst);
    }
}
