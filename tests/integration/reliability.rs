//! Reliability with real processes: a daemon SIGKILLed at random moments across a run ends in
//! exactly the state of an uninterrupted run; a taken port stops it at start with a clear error;
//! the webhook secret never leaks into logs, metrics, history or state files.

use crate::common::stderr;
use crate::daemon::{Daemon, empty_run, free_port, journal_entries};
use crate::early_stop::{
    Alertmanager, Receiver, SECRET, checkpoints_by_icr, place, u_turn_config, write_base_config,
};
use serde_json::Value;
use std::fs;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

/// SIGKILLs of the crash-loop test.
const KILLS: usize = 20;

/// A small seeded generator (xorshift64*), so the kill moments are the same on every run.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) % n
    }
}

/// (step, ICR) of every evaluation in the journal, in order.
fn evaluations(dir: &Path) -> Vec<(i64, f64)> {
    journal_entries(dir)
        .into_iter()
        .filter(|v| v["kind"] == "evaluation")
        .map(|v| {
            (
                v["record"]["step"].as_i64().unwrap(),
                v["record"]["icr"].as_f64().unwrap(),
            )
        })
        .collect()
}

/// The `/v1/early-stop` status without what names the run folder or the time of firing.
fn comparable(status: &Value) -> Value {
    let mut s = status.clone();
    let name = |v: &Value| {
        Value::from(
            Path::new(v.as_str().unwrap_or_default())
                .file_name()
                .map(|n| n.to_string_lossy().to_string())
                .unwrap_or_default(),
        )
    };
    s["best_checkpoint"] = name(&s["best_checkpoint"]);
    if s["event"].is_object() {
        s["event"]["best_checkpoint"] = name(&s["event"]["best_checkpoint"]);
        s["event"]["fired_at"] = Value::Null;
        // The id hashes the run and state folders too (the two runs are in different folders).
        s["event"]["id"] = Value::Null;
        // The kept copy, `<run folder>/.diffmon/best/<name>`, from the state folder on.
        let kept: Vec<String> = Path::new(
            s["event"]["best_checkpoint_kept"]
                .as_str()
                .unwrap_or_default(),
        )
        .components()
        .rev()
        .take(3)
        .map(|c| c.as_os_str().to_string_lossy().to_string())
        .collect();
        s["event"]["best_checkpoint_kept"] = Value::from(kept);
    }
    s
}

fn files_under(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for e in fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            out.extend(files_under(&p));
        } else {
            out.push(p);
        }
    }
    out
}

#[test]
fn twenty_random_kills_lose_nothing_duplicate_nothing_and_change_nothing() {
    // Six checkpoints whose ICR goes high, low, low, high, high, high: with the detector of the
    // early-stop tests it fires at step 5, naming step 2.
    let reference = empty_run();
    write_base_config(reference.path(), "");
    let (hi, lo, rise) = checkpoints_by_icr(reference.path());
    let order = [&hi, &lo, &lo, &hi, &hi, &hi];
    let config = |port: u16| u_turn_config(rise, port, "");
    let done = |d: &Daemon, dir: &Path, receiver: &Receiver| {
        d.wait_for(
            Duration::from_secs(300),
            "six evaluations and the event",
            |_| evaluations(dir).len() >= order.len() && !receiver.accepted().is_empty(),
        );
    };

    // The uninterrupted run.
    let dir = reference.path();
    let receiver = Receiver::start(dir, free_port(), "");
    let mut d = Daemon::start(dir, &config(receiver.port));
    for (step, src) in order.iter().enumerate() {
        place(dir, src, step as i64 + 1);
    }
    done(&d, dir, &receiver);
    std::thread::sleep(Duration::from_secs(1));
    let expected_rows = evaluations(dir);
    let expected_status: Value = serde_json::from_str(&d.get("/v1/early-stop").unwrap()).unwrap();
    let expected_events = receiver.accepted();
    d.terminate();
    assert_eq!(expected_status["fired"], true, "{expected_status}");
    assert_eq!(expected_status["best_step"], 2, "{expected_status}");
    assert_eq!(expected_events.len(), 1, "{expected_events:?}");

    // The same run, SIGKILLed at seeded random moments: one more checkpoint appears after each
    // of the first restarts, so kills land in start-up, evaluation, detection and delivery.
    let killed = empty_run();
    let dir = killed.path();
    let receiver = Receiver::start(dir, free_port(), "");
    let mut d = Daemon::start(dir, &config(receiver.port));
    let mut rng = Rng(0x5eed_d1ff_0a0a_0001);
    let mut placed = 0;
    for kill in 0..KILLS {
        if placed < order.len() {
            place(dir, order[placed], placed as i64 + 1);
            placed += 1;
        }
        std::thread::sleep(Duration::from_millis(50 + rng.below(1500)));
        d.child.kill().unwrap();
        d.child.wait().unwrap();
        eprintln!(
            "kill {}: {} evaluations in the journal",
            kill + 1,
            evaluations(dir).len()
        );
        d.restart();
    }
    for (step, src) in order.iter().enumerate().skip(placed) {
        place(dir, src, step as i64 + 1);
    }
    done(&d, dir, &receiver);
    std::thread::sleep(Duration::from_secs(2));

    let rows = evaluations(dir);
    let steps: Vec<i64> = rows.iter().map(|r| r.0).collect();
    assert_eq!(
        steps,
        vec![1, 2, 3, 4, 5, 6],
        "each checkpoint evaluated exactly once"
    );
    for ((step, icr), (_, want)) in rows.iter().zip(&expected_rows) {
        assert!(
            (icr - want).abs() <= 1e-12 * want.abs(),
            "step {step}: ICR {icr} after the kills, {want} without"
        );
    }
    let status: Value = serde_json::from_str(&d.get("/v1/early-stop").unwrap()).unwrap();
    assert_eq!(comparable(&status), comparable(&expected_status));
    let events = receiver.accepted();
    let kinds = |e: &[(String, String)]| e.iter().map(|(_, k)| k.clone()).collect::<Vec<_>>();
    // Counted by id, as a receiver deduplicates on `webhook-id`: a kill between the receiver's
    // answer and the delivered-ledger's write delivers the event once more, with the same id
    // (docs/design.md §17; CI's random kills once landed there).
    let mut seen = std::collections::HashSet::new();
    let distinct: Vec<(String, String)> = events
        .iter()
        .filter(|(id, _)| seen.insert(id.clone()))
        .cloned()
        .collect();
    assert_eq!(
        kinds(&distinct),
        kinds(&expected_events),
        "the same event, delivered under one id: {events:?}"
    );
    // A repeat needs a kill in that short window; one per restart would be a ledger not kept.
    assert!(events.len() <= 3, "delivered again and again: {events:?}");
    // Its id is the one this run's state says (ids differ between folders, docs/design.md §17).
    assert_eq!(status["event"]["id"].as_str(), Some(events[0].0.as_str()));
    let stop: Value =
        serde_json::from_str(&fs::read_to_string(dir.join("EARLY_STOP")).unwrap()).unwrap();
    assert_eq!(stop["id"].as_str(), Some(events[0].0.as_str()));

    // The secret is in the environment only: not in any log, state or history file, nor on
    // any endpoint (the receiver's own log holds only its HMAC check, not the secret).
    let metrics = d.get("/metrics").unwrap();
    d.terminate();
    for text in [metrics, stderr_of_check_config(&d.config)] {
        assert!(!text.contains(SECRET), "the secret leaked:\n{text}");
    }
    for f in files_under(dir) {
        let bytes = fs::read(&f).unwrap();
        assert!(
            !bytes.windows(SECRET.len()).any(|w| w == SECRET.as_bytes()),
            "the secret is in {}",
            f.display()
        );
    }
}

/// What `check-config` prints for a config whose webhook names a set secret variable.
fn stderr_of_check_config(config: &Path) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_diffmon"))
        .args(["check-config", config.to_str().unwrap()])
        .env("DIFFMON_LOG", "trace")
        .output()
        .unwrap();
    format!("{}{}", stderr(&out), String::from_utf8_lossy(&out.stdout))
}

#[test]
fn a_taken_port_stops_the_daemon_at_start_naming_the_address() {
    let run = empty_run();
    let dir = run.path();
    let taken = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    fs::write(
        dir.join("diffmon.yaml"),
        format!(
            "run: {{dir: .}}\nmodel: {{architecture: model.ts}}\ndevice: cpu\n\
             data: {{path: train.h5}}\nicr: {{samples: 16, batch_size: 16}}\n\
             http: {{listen: \"{addr}\"}}\n"
        ),
    )
    .unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_diffmon"))
        .args([
            "watch",
            "--config",
            dir.join("diffmon.yaml").to_str().unwrap(),
        ])
        .env("DIFFMON_LOG", "warn")
        .output()
        .unwrap();
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains(&addr),
        "the error does not name {addr}:\n{err}"
    );
    assert!(
        err.to_lowercase().contains("in use"),
        "the error does not say the address is in use:\n{err}"
    );
    drop(taken);
}

#[test]
fn metrics_and_the_live_page_answer_every_request_under_load_while_evaluating() {
    // A bounded load (about 200 requests/s for as long as three evaluations take) on /metrics
    // and / from four threads of this process: every request must be answered with a body,
    // and every checkpoint evaluated. Latencies and the effect on evaluation time are measured
    // by `make bench` (its `http` workload), not asserted here.
    let run = empty_run();
    let dir = run.path();
    let d = Daemon::start(
        dir,
        "checkpoints: {pattern: \"ckpt_*.pt\", settle_secs: 0.2}\n",
    );
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let port = d.port;
    let workers: Vec<_> = (0..4)
        .map(|k| {
            let stop = stop.clone();
            std::thread::spawn(move || {
                let path = if k % 2 == 0 { "/metrics" } else { "/" };
                let (mut ok, mut failed) = (0u32, 0u32);
                while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                    match crate::common::http_get(&format!("http://127.0.0.1:{port}{path}")) {
                        Some(body) if !body.is_empty() => ok += 1,
                        _ => failed += 1,
                    }
                    std::thread::sleep(Duration::from_millis(20));
                }
                (path, ok, failed)
            })
        })
        .collect();
    for step in 1..=3 {
        place(dir, &crate::common::toy_run().join("ckpt_000060.pt"), step);
    }
    d.wait_for(Duration::from_secs(120), "three evaluations", |_| {
        evaluations(dir).len() >= 3
    });
    std::thread::sleep(Duration::from_millis(500));
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let mut total = 0;
    for w in workers {
        let (path, ok, failed) = w.join().unwrap();
        assert_eq!(
            failed, 0,
            "{failed} requests to {path} failed ({ok} answered)"
        );
        total += ok;
    }
    assert!(total >= 100, "only {total} requests were made");
    let steps: Vec<i64> = evaluations(dir).iter().map(|r| r.0).collect();
    assert_eq!(steps, vec![1, 2, 3]);
}

#[test]
fn bad_checkpoints_are_counted_by_reason_and_the_daemon_goes_on() {
    let run = empty_run();
    let dir = run.path();
    let good = crate::common::toy_run().join("ckpt_000060.pt");
    let bytes = fs::read(&good).unwrap();
    // NaN weights, and a state dict with one name changed, written by PyTorch.
    let out = Command::new(crate::common::python())
        .args([
            "-c",
            "import sys, torch\n\
             sd = torch.load(sys.argv[1])\n\
             torch.save({k: v.clone().fill_(float('nan')) if v.is_floating_point() else v\n\
                         for k, v in sd.items()}, sys.argv[2])\n\
             k = next(iter(sd)); sd['renamed.' + k] = sd.pop(k); torch.save(sd, sys.argv[3])",
            good.to_str().unwrap(),
            dir.join("nan.src").to_str().unwrap(),
            dir.join("mismatch.src").to_str().unwrap(),
        ])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    let d = Daemon::start(
        dir,
        "checkpoints: {pattern: \"ckpt_*.pt\", settle_secs: 0.2, poll_secs: 0.5}\n",
    );
    let put = |step: i64, content: &[u8]| {
        let tmp = dir.join(format!("ckpt_{step}.pt.tmp"));
        fs::write(&tmp, content).unwrap();
        fs::rename(&tmp, dir.join(format!("ckpt_{step}.pt"))).unwrap();
    };
    put(1, b"");
    put(2, &bytes[..bytes.len() / 2]);
    put(3, b"not a checkpoint, just text\n");
    put(4, &fs::read(dir.join("nan.src")).unwrap());
    put(5, &fs::read(dir.join("mismatch.src")).unwrap());
    put(6, &bytes);
    d.wait_for(
        Duration::from_secs(120),
        "five failures and one evaluation",
        |_| {
            let (evals, failures) = crate::daemon::journal(dir);
            evals.len() + failures.len() >= 6
        },
    );
    let (evals, mut failures) = crate::daemon::journal(dir);
    failures.sort();
    let reasons: Vec<(i64, &str)> = failures.iter().map(|(s, r)| (*s, r.as_str())).collect();
    assert_eq!(
        reasons,
        vec![
            (1, "unreadable"),
            (2, "unreadable"),
            (3, "unreadable"),
            (4, "non_finite"),
            (5, "mismatch"),
        ]
    );
    assert_eq!(evals, vec![6], "the good checkpoint after the bad ones");
    for (reason, n) in [("unreadable", 3.0), ("non_finite", 1.0), ("mismatch", 1.0)] {
        let series =
            format!("diffmon_checkpoint_failures_total{{run=\"test\",reason=\"{reason}\"}}");
        assert_eq!(d.metric(&series), Some(n), "{series}");
    }
    // Each failure names its checkpoint in the log.
    let log = d.log();
    for step in 1..=5 {
        assert!(
            log.contains(&format!("ckpt_{step}.pt")),
            "ckpt_{step}.pt is not named in the log:\n{log}"
        );
    }
}

#[test]
fn leftovers_of_a_killed_process_are_cleaned_up_and_nothing_is_evaluated_twice() {
    let run = empty_run();
    let dir = run.path();
    let src = crate::common::toy_run().join("ckpt_000060.pt");
    let extra = "checkpoints: {pattern: \"ckpt_*.pt\", settle_secs: 0.2, poll_secs: 0.5}\n";
    let mut d = Daemon::start(dir, extra);
    place(dir, &src, 1);
    place(dir, &src, 2);
    d.wait_for(Duration::from_secs(120), "two evaluations", |_| {
        evaluations(dir).len() >= 2
    });
    d.child.kill().unwrap();
    d.child.wait().unwrap();
    // What a kill in the middle of writing leaves: a torn journal line and a half-written
    // temporary HDF5 file.
    let state = dir.join(".diffmon");
    let mut journal = fs::OpenOptions::new()
        .append(true)
        .open(state.join("history.jsonl"))
        .unwrap();
    std::io::Write::write_all(&mut journal, b"{\"kind\":\"evaluation\",\"record\":{\"st").unwrap();
    drop(journal);
    fs::write(state.join("history.h5.tmp"), b"\x89HDF\r\n half written").unwrap();
    place(dir, &src, 3);
    d.restart();
    d.wait_for(Duration::from_secs(120), "the third evaluation", |_| {
        evaluations(dir).len() >= 3
    });
    let steps: Vec<i64> = evaluations(dir).iter().map(|r| r.0).collect();
    assert_eq!(steps, vec![1, 2, 3], "nothing lost, nothing twice");
    let text = fs::read_to_string(state.join("history.jsonl")).unwrap();
    assert!(
        text.lines()
            .all(|l| serde_json::from_str::<Value>(l).is_ok()),
        "the torn line is still in the journal:\n{text}"
    );
    assert!(
        d.log().contains("dropping an incomplete last journal line"),
        "{}",
        d.log()
    );
    // The HDF5 history was rewritten whole over the leftover: three rows, readable by h5py.
    let out = Command::new(crate::common::python())
        .args([
            "-c",
            "import sys, h5py; print(len(h5py.File(sys.argv[1])['evaluations/step']))",
            state.join("history.h5").to_str().unwrap(),
        ])
        .output()
        .unwrap();
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        "3",
        "{}",
        stderr(&out)
    );
    assert!(!state.join("history.h5.tmp").exists());
}

#[test]
fn training_data_of_the_wrong_shape_or_without_the_dataset_stops_the_start_naming_it() {
    let run = empty_run();
    let dir = run.path();
    // Images [N, H, W]: no channel axis. And a file whose only dataset has another name.
    let out = Command::new(crate::common::python())
        .args([
            "-c",
            "import sys, h5py, numpy as np\n\
             h5py.File(sys.argv[1], 'w')['images'] = np.zeros((8, 16, 16), np.float32)\n\
             h5py.File(sys.argv[2], 'w')['pictures'] = np.zeros((8, 1, 16, 16), np.float32)",
            dir.join("flat.h5").to_str().unwrap(),
            dir.join("renamed.h5").to_str().unwrap(),
        ])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    for (data, expect) in [
        (
            "flat.h5",
            vec![
                "flat.h5",
                "`images`",
                "[8, 16, 16]",
                "expected 4 dimensions",
            ],
        ),
        (
            "renamed.h5",
            vec!["renamed.h5", "no dataset `images`", "pictures"],
        ),
    ] {
        fs::write(
            dir.join("bad.yaml"),
            format!(
                "run: {{dir: .}}\nmodel: {{architecture: model.ts}}\ndevice: cpu\n\
                 data: {{path: {data}}}\nicr: {{samples: 16, batch_size: 16}}\n\
                 http: {{listen: \"127.0.0.1:{}\"}}\n",
                free_port()
            ),
        )
        .unwrap();
        let out = Command::new(env!("CARGO_BIN_EXE_diffmon"))
            .args(["watch", "--config", dir.join("bad.yaml").to_str().unwrap()])
            .env("DIFFMON_LOG", "warn")
            .output()
            .unwrap();
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(1), "{data}: {err}");
        for e in expect {
            assert!(err.contains(e), "{data}: `{e}` is not in the error:\n{err}");
        }
    }
}

#[test]
fn a_receiver_that_hangs_is_timed_out_and_the_event_retried_until_delivered() {
    let run = empty_run();
    let dir = run.path();
    write_base_config(dir, "");
    let (hi, lo, rise) = checkpoints_by_icr(dir);
    // The receiver holds the first request without answering (longer than the 10 s request
    // timeout), then answers 200.
    let receiver = Receiver::start(dir, free_port(), "0");
    let d = Daemon::start(dir, &u_turn_config(rise, receiver.port, ""));
    for (step, src) in [&hi, &lo, &lo, &hi, &hi].iter().enumerate() {
        place(dir, src, step as i64 + 1);
    }
    d.wait_for(
        Duration::from_secs(120),
        "a delivery after the hung one",
        |_| !receiver.accepted().is_empty(),
    );
    let requests = receiver.requests();
    assert_eq!(requests[0]["status"], 0, "{requests:?}");
    let accepted = receiver.accepted();
    assert_eq!(accepted.len(), 1, "{accepted:?}");
    assert_eq!(Some(accepted[0].0.as_str()), requests[0]["id"].as_str());
    let series = |o: &str| {
        format!(
            "diffmon_webhook_deliveries_total{{run=\"test\",receiver=\"webhook\",outcome=\"{o}\"}}"
        )
    };
    d.wait_for(
        Duration::from_secs(10),
        "the delivered outcome counted",
        |d| d.metric(&series("delivered")) == Some(1.0),
    );
    assert!(d.metric(&series("retried")).unwrap_or(0.0) >= 1.0);
}

#[test]
fn an_unreachable_alertmanager_holds_nothing_up_and_gets_the_alert_once_it_is_up() {
    let run = empty_run();
    let dir = run.path();
    write_base_config(dir, "");
    let (hi, lo, rise) = checkpoints_by_icr(dir);
    let receiver = Receiver::start(dir, free_port(), "");
    let am_port = free_port(); // nothing listens there yet
    let alertmanager = format!("  alertmanager:\n    url: http://127.0.0.1:{am_port}\n");
    let d = Daemon::start(dir, &u_turn_config(rise, receiver.port, &alertmanager));
    for (step, src) in [&hi, &lo, &lo, &hi, &hi].iter().enumerate() {
        place(dir, src, step as i64 + 1);
    }
    // With Alertmanager down, the webhook and the stop file still go out.
    d.wait_for(Duration::from_secs(120), "the webhook delivery", |_| {
        !receiver.accepted().is_empty()
    });
    assert!(dir.join("EARLY_STOP").exists());
    // Alertmanager comes up on its address: the daemon's retries reach it.
    let am = Alertmanager::start_on(dir, am_port);
    d.wait_for(
        Duration::from_secs(120),
        "the alert in Alertmanager",
        |_| {
            am.active_alerts().iter().any(|a| {
                a["labels"]["alertname"] == "DiffusionEarlyStop" && a["labels"]["run"] == "test"
            })
        },
    );
    assert_eq!(receiver.accepted().len(), 1);
}

#[test]
fn a_checkpoint_replaced_during_its_evaluation_is_evaluated_again_as_the_new_file() {
    let run = empty_run();
    let dir = run.path();
    let (a, b) = (
        crate::common::toy_run().join("ckpt_000030.pt"),
        crate::common::toy_run().join("ckpt_000060.pt"),
    );
    // Many ICR samples, so that the evaluation takes long enough to replace the file meanwhile.
    let d = Daemon::start(
        dir,
        "checkpoints: {pattern: \"ckpt_*.pt\", settle_secs: 0.2, poll_secs: 0.5}\n\
         icr: {samples: 4096, batch_size: 512}\n",
    );
    place(dir, &a, 1);
    d.wait_for_evaluation_of("ckpt_1.pt");
    // The training job saves step 1 again (to a temporary name, renamed over the old file).
    place(dir, &b, 1);
    d.wait_for(
        Duration::from_secs(180),
        "the new file's evaluation",
        |_| !evaluations(dir).is_empty(),
    );
    std::thread::sleep(Duration::from_secs(2));
    // The evaluation of the old weights is discarded as a `vanished` failure (its file is no
    // longer what was read), and the new file is evaluated once.
    let (steps, failures) = crate::daemon::journal(dir);
    assert_eq!(failures, vec![(1, "vanished".to_string())]);
    assert_eq!(steps, vec![1]);
    let out = crate::common::diffmon(&[
        "eval",
        "--config",
        d.config.to_str().unwrap(),
        b.to_str().unwrap(),
        "--json",
    ]);
    let want = serde_json::from_str::<Value>(crate::common::stdout(&out).trim()).unwrap()["icr"]
        .as_f64()
        .unwrap();
    let got = evaluations(dir)[0].1;
    assert!(
        (got - want).abs() <= 1e-12 * want.abs(),
        "ICR {got}, the new file's is {want}"
    );
}

/// A tmpfs mounted for one test (the disk-full tests here and in the chaos suite), unmounted
/// when dropped.
pub(crate) struct Tmpfs(PathBuf);

impl Tmpfs {
    pub(crate) fn mount(at: &Path, size: &str) -> Tmpfs {
        fs::create_dir_all(at).unwrap();
        let out = Command::new("mount")
            .args([
                "-t",
                "tmpfs",
                "-o",
                &format!("size={size},mode=0700"),
                "tmpfs",
            ])
            .arg(at)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "this test mounts a {size} tmpfs, which needs root (as `make setup` does): {}",
            stderr(&out)
        );
        Tmpfs(at.to_path_buf())
    }

    /// Fills the file system with one file, until a write fails; returns the file.
    pub(crate) fn fill(&self) -> PathBuf {
        let path = self.0.join("filler");
        let mut f = fs::File::create(&path).unwrap();
        let page = [0u8; 4096];
        while matches!(std::io::Write::write(&mut f, &page), Ok(n) if n > 0) {}
        path
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.0).status();
    }
}

/// The steps in `history.h5` as h5py reads them (`[1, 2]`), or h5py's error.
fn hdf5_rows(state: &Path) -> String {
    let out = Command::new(crate::common::python())
        .args([
            "-c",
            "import sys, h5py; print(h5py.File(sys.argv[1])['evaluations/step'][:].tolist())",
            state.join("history.h5").to_str().unwrap(),
        ])
        .output()
        .unwrap();
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout).trim(),
        stderr(&out)
    )
}

/// Places checkpoints `step + 1`, `step + 2`, ... until one's outcome cannot be recorded (the
/// journal's last page has room for a line or two after the disk is full); returns the last step
/// placed, whose outcome waits.
fn place_until_one_waits(d: &Daemon, dir: &Path, src: &Path, mut step: i64) -> i64 {
    let stalls = d.log().matches("cannot record the outcome").count();
    loop {
        step += 1;
        assert!(step < 20, "the journal never stopped taking lines");
        place(dir, src, step);
        let stalled = |d: &Daemon| d.log().matches("cannot record the outcome").count() > stalls;
        d.wait_for(Duration::from_secs(120), "the outcome", |d| {
            stalled(d) || evaluations(dir).len() as i64 == step
        });
        if stalled(d) {
            return step;
        }
    }
}

#[test]
fn a_full_state_folder_holds_outcomes_back_in_order_and_loses_nothing() {
    let run = empty_run();
    let dir = run.path();
    let state = dir.join(".diffmon");
    let disk = Tmpfs::mount(&state, "1m");
    let src = crate::common::toy_run().join("ckpt_000060.pt");
    let extra = "checkpoints: {pattern: \"ckpt_*.pt\", settle_secs: 0.2, poll_secs: 0.5}\n";
    let mut d = Daemon::start(dir, extra);
    place(dir, &src, 1);
    d.wait_for(Duration::from_secs(120), "the first evaluation", |_| {
        hdf5_rows(&state) == "[1]"
    });

    // The disk fills up during the run. The journal line that does not fit in its last page
    // fails, after part of it went into that page.
    let filler = disk.fill();
    let waiting = place_until_one_waits(&d, dir, &src, 1);
    place(dir, &src, waiting + 1);
    d.wait_for(Duration::from_secs(120), "two outcomes waiting", |d| {
        d.log().contains("waiting=2")
    });
    let log = d.log();
    assert!(
        log.contains("history.jsonl: No space left on device (os error 28)"),
        "the error names the journal and the errno:\n{log}"
    );
    assert!(log.contains("cannot rewrite the HDF5 history"), "{log}");
    // Nothing acts on an outcome before it is recorded, and the torn line was cut.
    assert_eq!(d.evaluated(), (waiting - 1) as f64);
    let text = fs::read_to_string(state.join("history.jsonl")).unwrap();
    assert!(text.ends_with('\n'), "a torn line was left:\n{text}");
    assert_eq!(evaluations(dir).len() as i64, waiting - 1);

    // Space comes back: the waiting outcomes are recorded, in order, then published.
    fs::remove_file(&filler).unwrap();
    d.wait_for(Duration::from_secs(30), "the waiting outcomes", |d| {
        d.evaluated() == (waiting + 1) as f64
    });
    let steps: Vec<i64> = evaluations(dir).iter().map(|r| r.0).collect();
    assert_eq!(steps, (1..=waiting + 1).collect::<Vec<_>>());
    assert!(d.log().contains("the state folder can be written again"));
    d.wait_for(Duration::from_secs(10), "history.h5 with every row", |_| {
        hdf5_rows(&state) == format!("{steps:?}")
    });
    assert!(!state.join("history.h5.tmp").exists());

    // A start on a full disk: the daemon comes up, outcomes wait, nothing is evaluated twice.
    let filler = disk.fill();
    d.restart();
    assert!(
        d.log().contains("cannot rewrite the HDF5 history"),
        "{}",
        d.log()
    );
    let last = place_until_one_waits(&d, dir, &src, waiting + 1);
    fs::remove_file(&filler).unwrap();
    d.wait_for(Duration::from_secs(30), "the last outcome", |_| {
        evaluations(dir).len() as i64 == last
    });
    let steps: Vec<i64> = evaluations(dir).iter().map(|r| r.0).collect();
    assert_eq!(
        steps,
        (1..=last).collect::<Vec<_>>(),
        "nothing lost, nothing twice"
    );
    d.wait_for(Duration::from_secs(10), "history.h5 with every row", |_| {
        hdf5_rows(&state) == format!("{steps:?}")
    });
    drop(d);
}
