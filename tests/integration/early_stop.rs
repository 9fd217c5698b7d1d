//! The early stop end to end, with real parts: the daemon over real checkpoints arranged into a
//! U-shaped ICR curve, a real HTTP receiver (Python, checking signatures with its own HMAC), a
//! real Alertmanager, SIGKILL and restarts.

use crate::common::{diffmon, http_get, root, stdout, toy_run};
use crate::daemon::{Daemon, empty_run, free_port, journal};
use serde_json::Value;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub const SECRET: &str = "whsec_dGVzdC1zZWNyZXQtZm9yLWRpZmZtb24tb25seQ==";

/// A child process killed when dropped.
struct Guard(Child);

impl Drop for Guard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The Python webhook receiver of the alerts tests, answering `script` first, then 200.
pub struct Receiver {
    _child: Guard,
    pub port: u16,
    log: PathBuf,
}

impl Receiver {
    pub fn start(dir: &Path, port: u16, script: &str) -> Receiver {
        let log = dir.join(format!("receiver-{port}.jsonl"));
        let port_file = dir.join(format!("receiver-{port}.port"));
        let child = Command::new(root().join(".venv/bin/python"))
            .arg(root().join("src/alerts/test_receiver.py"))
            .args(["--port", &port.to_string(), "--log", log.to_str().unwrap()])
            .args([
                "--port-file",
                port_file.to_str().unwrap(),
                "--script",
                script,
            ])
            .env("RECEIVER_SECRET", SECRET)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .spawn()
            .unwrap();
        let start = Instant::now();
        while !port_file.exists() {
            assert!(
                start.elapsed() < Duration::from_secs(20),
                "the receiver did not start"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        Receiver {
            _child: Guard(child),
            port,
            log,
        }
    }

    /// Every request as logged by the receiver.
    pub fn requests(&self) -> Vec<Value> {
        fs::read_to_string(&self.log)
            .unwrap_or_default()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    }

    /// (event id, event kind) of the accepted (200) requests.
    pub fn accepted(&self) -> Vec<(String, String)> {
        self.requests()
            .iter()
            .filter(|r| r["status"] == 200)
            .map(|r| {
                assert_eq!(
                    r["valid"], true,
                    "a delivery with an invalid signature: {r}"
                );
                (
                    r["id"].as_str().unwrap().to_string(),
                    r["body"]["event"].as_str().unwrap().to_string(),
                )
            })
            .collect()
    }
}

/// ICR (as the daemon's config computes it) of the toy run's two checkpoints: (higher, lower).
pub fn checkpoints_by_icr(dir: &Path) -> (PathBuf, PathBuf, f64) {
    let config = dir.join("diffmon.yaml");
    let cks: Vec<PathBuf> = [30, 60]
        .iter()
        .map(|s| toy_run().join(format!("ckpt_{s:06}.pt")))
        .collect();
    let out = diffmon(&[
        "eval",
        "--config",
        config.to_str().unwrap(),
        cks[0].to_str().unwrap(),
        cks[1].to_str().unwrap(),
        "--json",
    ]);
    let icr: Vec<f64> = stdout(&out)
        .lines()
        .map(|l| {
            serde_json::from_str::<Value>(l).unwrap()["icr"]
                .as_f64()
                .unwrap()
        })
        .collect();
    assert_eq!(icr.len(), 2, "{}", String::from_utf8_lossy(&out.stderr));
    assert!(icr[0] != icr[1], "the two checkpoints have the same ICR");
    let (hi, lo) = if icr[0] > icr[1] { (0, 1) } else { (1, 0) };
    (cks[hi].clone(), cks[lo].clone(), icr[hi] / icr[lo] - 1.0)
}

/// Config text for a U-turn over five checkpoints: high, low, low, high, high by step.
/// With window 1, warmup 2, patience 2 and min_rise half the relative difference, the detector
/// fires at step 5 with the best at step 2. The noise rule is off: five values are too few to
/// know the noise (it needs eight), and their only scatter is the turn itself.
pub fn detector_config(rise: f64) -> String {
    format!(
        "early_stop: {{window: 1, warmup: 2, patience: 2, min_rise: {}, noise_multiple: 0, confirm: none}}\n",
        rise / 2.0
    )
}

/// Daemon config text for the U-turn tests: quick completion checks, the detector of
/// [`detector_config`], and a signed JSON webhook to `webhook_port`; `more_alerts` adds lines
/// under `alerts:` (indented by two spaces). Sets the signing secret in this process's
/// environment, the only way it reaches the daemon.
pub fn u_turn_config(rise: f64, webhook_port: u16, more_alerts: &str) -> String {
    // SAFETY of the tests: every test that sets it sets the same value.
    unsafe { std::env::set_var("DIFFMON_TEST_SECRET", SECRET) };
    format!(
        "checkpoints: {{pattern: \"ckpt_*.pt\", settle_secs: 0.2, poll_secs: 0.5}}\n{}\
         alerts:\n  webhooks:\n    - url: http://127.0.0.1:{webhook_port}/hook\n      \
         format: json\n      secret_env: DIFFMON_TEST_SECRET\n{more_alerts}",
        detector_config(rise)
    )
}

pub fn place(dir: &Path, src: &Path, step: i64) {
    let tmp = dir.join(format!("ckpt_{step}.pt.tmp"));
    fs::copy(src, &tmp).unwrap();
    fs::rename(&tmp, dir.join(format!("ckpt_{step}.pt"))).unwrap();
}

pub fn write_base_config(dir: &Path, extra: &str) {
    // Only for computing the checkpoints' ICR with the same ICR settings as the daemon.
    fs::write(
        dir.join("diffmon.yaml"),
        format!("run: {{dir: .}}\nmodel: {{architecture: model.ts}}\ndevice: cpu\ndata: {{path: train.h5, heldout_path: heldout.h5}}\nicr: {{samples: 256, batch_size: 256}}\n{extra}"),
    )
    .unwrap();
}

#[test]
fn kill_during_evaluation_then_restart_loses_nothing_and_fires_once() {
    let run = empty_run();
    let dir = run.path();
    write_base_config(dir, "");
    let (hi, lo, rise) = checkpoints_by_icr(dir);
    let receiver = Receiver::start(dir, free_port(), "500,500,429");
    let mut d = Daemon::start(dir, &u_turn_config(rise, receiver.port, ""));
    for (step, src) in [(1, &hi), (2, &lo), (3, &lo)] {
        place(dir, src, step);
    }
    d.wait_for(Duration::from_secs(180), "three evaluations", |d| {
        d.evaluated() >= 3.0
    });

    // SIGKILL while step 4 is being evaluated.
    place(dir, &hi, 4);
    d.wait_for_evaluation_of("ckpt_4.pt");
    d.child.kill().unwrap();
    d.child.wait().unwrap();
    place(dir, &hi, 5);
    d.restart();
    d.wait_for(
        Duration::from_secs(240),
        "steps 4 and 5 after the restart",
        |_| journal(dir).0.len() >= 5,
    );
    d.wait_for(Duration::from_secs(180), "the event to be accepted", |_| {
        !receiver.accepted().is_empty()
    });

    let (steps, failures) = journal(dir);
    assert_eq!(
        steps,
        vec![1, 2, 3, 4, 5],
        "each checkpoint exactly once, the killed one again"
    );
    assert!(failures.is_empty(), "{failures:?}");
    let status: Value = serde_json::from_str(&d.get("/v1/early-stop").unwrap()).unwrap();
    assert_eq!(status["fired"], true, "{status}");
    assert_eq!(status["best_step"], 2, "{status}");
    assert_eq!(status["event"]["current_step"], 5, "{status}");
    let stop: Value =
        serde_json::from_str(&fs::read_to_string(dir.join("EARLY_STOP")).unwrap()).unwrap();
    assert_eq!(stop["event"], "early_stop");
    assert_eq!(stop["best_step"], 2);
    assert_eq!(stop["id"], status["event"]["id"]);
    // The receiver failed the first three deliveries (500, 500, 429) and then accepted one.
    assert!(receiver.requests().len() >= 4, "{:?}", receiver.requests());

    // Another restart replays the history: same state, no second event.
    d.terminate();
    d.restart();
    d.wait_for(Duration::from_secs(120), "the restored status", |d| {
        d.get("/v1/early-stop")
            .is_some_and(|s| s.contains("\"fired\":true"))
    });
    let again: Value = serde_json::from_str(&d.get("/v1/early-stop").unwrap()).unwrap();
    assert_eq!(again, status);
    std::thread::sleep(Duration::from_secs(2));
    let accepted = receiver.accepted();
    assert_eq!(
        accepted.len(),
        1,
        "exactly one accepted delivery: {accepted:?}"
    );
    assert_eq!(accepted[0].0, stop["id"].as_str().unwrap());
    assert_eq!(journal(dir).0.len(), 5);
}

/// Alertmanager with a minimal configuration on a free port, killed when dropped.
pub struct Alertmanager {
    _child: Guard,
    pub url: String,
}

impl Alertmanager {
    fn start(dir: &Path) -> Alertmanager {
        Alertmanager::start_on(dir, free_port())
    }

    pub fn start_on(dir: &Path, port: u16) -> Alertmanager {
        let config = dir.join("alertmanager.yml");
        fs::write(
            &config,
            "route:\n  receiver: \"null\"\nreceivers:\n  - name: \"null\"\n",
        )
        .unwrap();
        let child = Command::new("prometheus-alertmanager")
            .arg(format!("--config.file={}", config.display()))
            .arg(format!("--storage.path={}", dir.join("am-data").display()))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .arg("--cluster.listen-address=")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("prometheus-alertmanager (Debian package, installed by make setup)");
        let am = Alertmanager {
            _child: Guard(child),
            url: format!("http://127.0.0.1:{port}"),
        };
        let start = Instant::now();
        while http_get(&format!("{}/-/ready", am.url)).is_none() {
            assert!(
                start.elapsed() < Duration::from_secs(120),
                "Alertmanager did not become ready"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        am
    }

    pub fn active_alerts(&self) -> Vec<Value> {
        let body = http_get(&format!("{}/api/v2/alerts?active=true", self.url)).unwrap_or_default();
        serde_json::from_str::<Vec<Value>>(&body).unwrap_or_default()
    }
}

#[test]
fn receiver_down_across_a_restart_still_gets_the_event_and_alertmanager_shows_it() {
    let run = empty_run();
    let dir = run.path();
    write_base_config(dir, "");
    let (hi, lo, rise) = checkpoints_by_icr(dir);
    let am = Alertmanager::start(dir);
    let receiver_port = free_port(); // nothing listens there yet
    let alertmanager = format!("  alertmanager:\n    url: {}\n", am.url);
    let mut d = Daemon::start(dir, &u_turn_config(rise, receiver_port, &alertmanager));
    for (step, src) in [(1, &hi), (2, &lo), (3, &lo), (4, &hi), (5, &hi)] {
        place(dir, src, step);
    }
    d.wait_for(Duration::from_secs(240), "the early stop", |d| {
        d.metric("diffmon_early_stop_triggered{run=\"test\",metric=\"icr\"}") == Some(1.0)
    });
    // Alertmanager shows the alert.
    let start = Instant::now();
    let alert = loop {
        let found = am.active_alerts().into_iter().find(|a| {
            a["labels"]["alertname"] == "DiffusionEarlyStop" && a["labels"]["run"] == "test"
        });
        if let Some(a) = found {
            break a;
        }
        assert!(
            start.elapsed() < Duration::from_secs(120),
            "no DiffusionEarlyStop alert in Alertmanager"
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    assert_eq!(alert["status"]["state"], "active", "{alert}");

    // The webhook could not be delivered; the daemon stops with it pending, then the receiver
    // comes up and a new daemon delivers it from the outbox.
    std::thread::sleep(Duration::from_secs(1));
    d.terminate();
    let receiver = Receiver::start(dir, receiver_port, "");
    d.restart();
    d.wait_for(
        Duration::from_secs(180),
        "the delivery after the restart",
        |_| !receiver.accepted().is_empty(),
    );
    std::thread::sleep(Duration::from_secs(2));
    let accepted = receiver.accepted();
    assert_eq!(accepted.len(), 1, "{accepted:?}");
    assert_eq!(accepted[0].1, "early_stop");
    assert_eq!(journal(dir).0, vec![1, 2, 3, 4, 5]);
}
