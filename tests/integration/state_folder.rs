//! The state folder is the daemon's own (docs/design.md §10, issue #29 items 2, 3, 6, 7): a link
//! or another user's folder at its name is refused and never written through, its files are
//! private, a replaced run folder gets it back, and nothing planted in it is delivered as an
//! alert. Real daemons, a real signed-webhook receiver, real files.

use crate::common::{stderr, toy_run};
use crate::daemon::{Daemon, config_outside, empty_run, free_port, journal};
use crate::early_stop::{Receiver, checkpoints_by_icr, place, u_turn_config, write_base_config};
use serde_json::Value;
use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::Output;
use std::time::{Duration, Instant};

/// The user the tests give folders to: another user than the daemon's (root's).
const NOBODY: u32 = 65534;

fn mode(p: &Path) -> u32 {
    fs::metadata(p).unwrap().permissions().mode() & 0o777
}

/// `diffmon watch` on `config`, expected to exit by itself within a minute (a refusal at start);
/// the daemon is killed and the test fails if it runs on.
fn watch_refused(config: &Path) -> Output {
    let bin = env!("CARGO_BIN_EXE_diffmon");
    let mut child = std::process::Command::new(bin)
        .args(["watch", "--config", config.to_str().unwrap()])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let start = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if start.elapsed() > Duration::from_secs(60) {
            let _ = child.kill();
            let out = child.wait_with_output().unwrap();
            panic!("the daemon started:\n{}", stderr(&out));
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let out = child.wait_with_output().unwrap();
    assert!(!out.status.success(), "{}", stderr(&out));
    out
}

#[test]
fn a_linked_or_foreign_state_folder_is_refused_and_nothing_is_written_through_it() {
    let base = empty_run();
    let top = base.path();
    let run = top.join("run");
    fs::create_dir(&run).unwrap();
    let (config, _) = config_outside(top);
    place(&run, &toy_run().join("ckpt_000030.pt"), 1);
    // Another folder of the daemon's user, with a kept checkpoint and a crash marker.
    let victim = top.join("victim");
    fs::create_dir_all(victim.join("best/sub")).unwrap();
    fs::write(victim.join("best/keep.pt"), "precious").unwrap();
    fs::write(victim.join("crash"), "old marker").unwrap();
    std::os::unix::fs::symlink(&victim, run.join(".diffmon")).unwrap();
    let out = watch_refused(&config);
    let err = stderr(&out);
    assert!(
        err.contains(".diffmon") && err.contains("symbolic link"),
        "{err}"
    );
    let mut left: Vec<String> = fs::read_dir(&victim)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    left.sort();
    assert_eq!(left, ["best", "crash"], "written into the link's target");
    assert_eq!(
        fs::read_to_string(victim.join("best/keep.pt")).unwrap(),
        "precious"
    );
    assert!(victim.join("best/sub").is_dir());
    assert_eq!(
        fs::read_to_string(victim.join("crash")).unwrap(),
        "old marker"
    );

    // A folder someone else made there, and one anyone may write.
    fs::remove_file(run.join(".diffmon")).unwrap();
    fs::create_dir_all(run.join(".diffmon/outbox")).unwrap();
    std::os::unix::fs::chown(run.join(".diffmon"), Some(NOBODY), Some(NOBODY)).unwrap();
    let err = stderr(&watch_refused(&config));
    assert!(err.contains(&format!("owned by uid {NOBODY}")), "{err}");
    std::os::unix::fs::chown(run.join(".diffmon"), Some(0), Some(0)).unwrap();
    fs::set_permissions(run.join(".diffmon"), fs::Permissions::from_mode(0o777)).unwrap();
    let err = stderr(&watch_refused(&config));
    assert!(
        err.contains("writable by anyone") && err.contains("chmod 700"),
        "{err}"
    );
    assert!(!run.join(".diffmon/history.jsonl").exists());
}

#[test]
fn a_replaced_run_folder_gets_its_state_folder_back_and_its_files_are_private() {
    let base = empty_run();
    let top = base.path();
    let run = top.join("run");
    fs::create_dir(&run).unwrap();
    let (config, port) = config_outside(top);
    let mut d = Daemon::spawn(config.clone(), port);
    place(&run, &toy_run().join("ckpt_000030.pt"), 1);
    d.wait_for(Duration::from_secs(180), "ckpt_1", |_| {
        journal(&run).0 == vec![1]
    });
    let state = run.join(".diffmon");
    assert_eq!(mode(&state), 0o700);
    for f in ["history.jsonl", "lock"] {
        assert_eq!(mode(&state.join(f)), 0o600, "{f}");
    }

    // The run folder moved aside and a new one made in its place, while the daemon runs.
    fs::rename(&run, top.join("run.old")).unwrap();
    fs::create_dir(&run).unwrap();
    d.wait_for(Duration::from_secs(60), "the state folder back", |d| {
        d.log().contains("was moved back into the new one")
    });
    assert_eq!(journal(&run).0, vec![1]);
    assert!(!top.join("run.old/.diffmon").exists());
    // The lock came with it: a second daemon on the same config refuses.
    let err = stderr(&watch_refused(&config));
    assert!(err.contains("in use by another diffmon"), "{err}");
    place(&run, &toy_run().join("ckpt_000060.pt"), 2);
    d.wait_for(Duration::from_secs(180), "ckpt_2 in the new folder", |_| {
        journal(&run).0 == vec![1, 2]
    });
    // After a restart nothing is evaluated again: the history is where the daemon looks.
    d.terminate();
    d.restart();
    d.wait_for(Duration::from_secs(60), "the history restored", |d| {
        d.log().contains("history restored") && d.log().contains("evaluations=2")
    });
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(journal(&run).0, vec![1, 2]);
    assert_eq!(d.evaluated(), 0.0);
}

/// An entry as the outbox held it before MACs: the genuine event with another id and a
/// forged checkpoint, for destination `dest`.
fn forged_entry(genuine: &Value, dest: &str) -> (String, Value) {
    let mut event = genuine.clone();
    let id = "f".repeat(64);
    event["id"] = Value::from(id.as_str());
    event["run"] = Value::from("production-run");
    event["best_checkpoint"] = Value::from("FORGED: rm -rf checkpoints/");
    let entry = serde_json::json!({"version": 1, "dest": dest, "seq": 1, "event": event});
    (format!("{id}.{dest}.json"), entry)
}

#[test]
fn outbox_entries_the_daemon_did_not_write_are_never_delivered() {
    let run = empty_run();
    let dir = run.path();
    write_base_config(dir, "");
    let (hi, lo, rise) = checkpoints_by_icr(dir);
    let receiver_port = free_port();
    let receiver = Receiver::start(dir, receiver_port, "");
    let mut d = Daemon::start(dir, &u_turn_config(rise, receiver_port, ""));
    for (step, src) in [(1, &hi), (2, &lo), (3, &lo), (4, &hi), (5, &hi)] {
        place(dir, src, step);
    }
    d.wait_for(Duration::from_secs(300), "the genuine delivery", |_| {
        receiver.accepted().len() == 1
    });
    d.terminate();
    let genuine = receiver.requests()[0]["body"].clone();
    let state = dir.join(".diffmon");
    let ledger: Value =
        serde_json::from_str(&fs::read_to_string(state.join("alerts_delivered.json")).unwrap())
            .unwrap();
    let dest = ledger["delivered"][0]
        .as_str()
        .unwrap()
        .split('/')
        .nth(1)
        .unwrap()
        .to_string();

    // Planted in the daemon's own folder: one without a MAC (the old format), one with a made-up
    // MAC.
    let (name, entry) = forged_entry(&genuine, &dest);
    let json = serde_json::to_vec_pretty(&entry).unwrap();
    fs::write(state.join("outbox").join(&name), &json).unwrap();
    let mut with_mac = format!("diffmon-outbox-v2 {}\n", "0".repeat(64)).into_bytes();
    with_mac.extend_from_slice(&json);
    fs::write(
        state
            .join("outbox")
            .join(format!("{}.{dest}.json", "e".repeat(64))),
        &with_mac,
    )
    .unwrap();
    d.restart();
    let series = "diffmon_webhook_deliveries_total{run=\"test\",receiver=\"webhook\",outcome=\"unauthenticated\"}";
    d.wait_for(Duration::from_secs(60), "both counted", |d| {
        d.metric(series) == Some(2.0)
    });
    assert_eq!(d.log().matches("skipping an outbox entry").count(), 2);
    assert!(
        state
            .join("outbox")
            .join(format!("{name}.unauthenticated"))
            .exists()
    );
    std::thread::sleep(Duration::from_secs(3));
    let requests = receiver.requests();
    assert_eq!(requests.len(), 1, "{requests:#?}");
    assert!(!requests[0].to_string().contains("FORGED"));

    // A state folder renamed away and replaced by one of another user: refused at start.
    d.terminate();
    fs::rename(&state, dir.join(".diffmon.old")).unwrap();
    fs::create_dir_all(state.join("outbox")).unwrap();
    fs::write(state.join("outbox").join(&name), &json).unwrap();
    for p in [state.clone(), state.join("outbox")] {
        std::os::unix::fs::chown(p, Some(NOBODY), Some(NOBODY)).unwrap();
    }
    let err = stderr(&watch_refused(&d.config));
    assert!(err.contains(&format!("owned by uid {NOBODY}")), "{err}");
    assert_eq!(receiver.requests().len(), 1);
}
