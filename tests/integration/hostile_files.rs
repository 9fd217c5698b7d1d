//! The daemon against hostile or unlucky files in the folders it watches and writes (docs/design.md
//! §10): a stop file that cannot be written, links planted at temporary names, a FIFO named like a
//! checkpoint, a file it may not read yet, a name holding a newline, and `run.dir` deleted and
//! recreated under it. Real daemons, real files, no timed assertions.

use crate::common::toy_run;
use crate::daemon::{Daemon, config_outside, empty_run, free_port, journal};
use crate::early_stop::{checkpoints_by_icr, detector_config, place, write_base_config};
use serde_json::Value;
use std::fs;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Daemon config text for a U-turn without webhooks (the stop file only).
fn u_turn(rise: f64) -> String {
    format!(
        "checkpoints: {{pattern: \"ckpt_*.pt\", settle_secs: 0.2, poll_secs: 0.5}}\n{}",
        detector_config(rise)
    )
}

/// Places the U-turn's five checkpoints and waits for the early stop to be reported.
fn fire(d: &Daemon, dir: &Path, hi: &Path, lo: &Path) -> Value {
    for (step, src) in [(1, hi), (2, lo), (3, lo), (4, hi), (5, hi)] {
        place(dir, src, step);
    }
    d.wait_for(Duration::from_secs(300), "the early stop", |d| {
        d.get("/v1/early-stop")
            .is_some_and(|s| s.contains("\"fired\":true"))
    });
    serde_json::from_str(&d.get("/v1/early-stop").unwrap()).unwrap()
}

#[test]
fn a_stop_file_that_cannot_be_written_is_retried_until_it_is() {
    let run = empty_run();
    let dir = run.path();
    write_base_config(dir, "");
    let (hi, lo, rise) = checkpoints_by_icr(dir);
    // A folder at the stop file's path: no rename can replace it, not even root's.
    let stop = dir.join("EARLY_STOP");
    fs::create_dir(&stop).unwrap();
    fs::write(stop.join("keep"), "x").unwrap();
    let d = Daemon::start(dir, &u_turn(rise));
    let status = fire(&d, dir, &hi, &lo);
    d.wait_for(Duration::from_secs(60), "the failure to be logged", |d| {
        d.log().contains("cannot update the stop file")
    });
    assert!(stop.is_dir(), "the obstacle went away by itself");
    // Several attempts fail while the obstacle is there.
    d.wait_for(Duration::from_secs(120), "a retry to fail", |d| {
        d.log().matches("cannot update the stop file").count() >= 3
    });
    fs::remove_dir_all(&stop).unwrap();
    d.wait_for(Duration::from_secs(180), "the stop file", |_| {
        stop.is_file()
    });
    let written: Value = serde_json::from_str(&fs::read_to_string(&stop).unwrap()).unwrap();
    assert_eq!(written["event"], "early_stop");
    assert_eq!(
        written["id"], status["event"]["id"],
        "{written} vs {status}"
    );
    assert_eq!(written["best_step"], 2);
    d.wait_for(Duration::from_secs(30), "the INFO line", |d| {
        d.log().contains("stop file updated after failed attempts")
    });
}

#[test]
fn links_planted_at_temporary_names_are_never_followed() {
    let run = empty_run();
    let dir = run.path();
    write_base_config(dir, "");
    let (hi, lo, rise) = checkpoints_by_icr(dir);
    let victim = dir.join("victim.txt");
    fs::write(&victim, "precious").unwrap();
    let state = dir.join(".diffmon");
    fs::create_dir(&state).unwrap();
    // The old fixed name of the HDF5 rewrite, planted before the start...
    std::os::unix::fs::symlink(&victim, state.join("history.h5.tmp")).unwrap();
    let d = Daemon::start(dir, &u_turn(rise));
    // ...and again after it, with the stop file's old temporary names for this process.
    let pid = d.child.id();
    let _ = fs::remove_file(state.join("history.h5.tmp"));
    std::os::unix::fs::symlink(&victim, state.join("history.h5.tmp")).unwrap();
    for n in 0..4 {
        std::os::unix::fs::symlink(&victim, dir.join(format!(".EARLY_STOP.tmp.{pid}.{n}")))
            .unwrap();
    }
    fire(&d, dir, &hi, &lo);
    d.wait_for(Duration::from_secs(60), "the stop file", |_| {
        dir.join("EARLY_STOP").is_file()
    });
    d.wait_for(Duration::from_secs(60), "history.h5 with five rows", |_| {
        hdf5::File::open(state.join("history.h5"))
            .and_then(|f| f.dataset("evaluations/step"))
            .and_then(|ds| ds.read_raw::<i64>())
            .is_ok_and(|s| s.len() == 5)
    });
    assert_eq!(fs::read_to_string(&victim).unwrap(), "precious");
    assert!(
        !fs::symlink_metadata(dir.join("EARLY_STOP"))
            .unwrap()
            .is_symlink()
    );
}

#[test]
fn a_fifo_named_like_a_checkpoint_is_skipped_and_blocks_nothing() {
    let run = empty_run();
    let dir = run.path();
    let fifo = dir.join("ckpt_1.pt");
    let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: a valid C string.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o644) }, 0);
    let mut d = Daemon::start(
        dir,
        "checkpoints: {pattern: \"ckpt_*.pt\", settle_secs: 0.2, poll_secs: 0.5, inotify: false}\n",
    );
    place(dir, &toy_run().join("ckpt_000030.pt"), 2);
    d.wait_for(Duration::from_secs(180), "ckpt_2 to be evaluated", |_| {
        journal(dir).0 == vec![2]
    });
    let log = d.log();
    let warnings = log
        .lines()
        .filter(|l| l.contains("not a regular file") && l.contains("ckpt_1.pt"))
        .count();
    assert_eq!(warnings, 1, "{log}");
    assert!(journal(dir).1.is_empty(), "the FIFO was recorded: {log}");
    d.terminate();
}

#[test]
fn a_file_that_cannot_be_read_yet_is_retried_not_failed() {
    // Root reads a mode-000 file anyway: the daemon runs as `nobody`.
    let run = empty_run();
    let dir = run.path();
    use std::os::unix::fs::PermissionsExt;
    fs::set_permissions(dir, fs::Permissions::from_mode(0o777)).unwrap();
    for f in ["model.ts", "train.h5", "heldout.h5"] {
        fs::set_permissions(dir.join(f), fs::Permissions::from_mode(0o644)).unwrap();
    }
    let port = free_port();
    let config = dir.join("diffmon.yaml");
    fs::write(
        &config,
        format!(
            "run: {{dir: ., name: test}}\nmodel: {{architecture: model.ts}}\ndevice: cpu\n\
             data: {{path: train.h5, heldout_path: heldout.h5}}\n\
             http: {{listen: \"127.0.0.1:{port}\"}}\nicr: {{samples: 256, batch_size: 256}}\n\
             checkpoints: {{pattern: \"ckpt_*.pt\", settle_secs: 0.2, poll_secs: 0.5}}\n"
        ),
    )
    .unwrap();
    let d = Daemon::spawn_wrapped(
        config.clone(),
        port,
        &[
            "setpriv",
            "--reuid=nobody",
            "--regid=nogroup",
            "--clear-groups",
        ],
    );
    // Renamed into place, unreadable: complete, but not readable yet.
    let tmp = dir.join("ckpt_1.pt.tmp");
    fs::copy(toy_run().join("ckpt_000030.pt"), &tmp).unwrap();
    fs::set_permissions(&tmp, fs::Permissions::from_mode(0o000)).unwrap();
    fs::rename(&tmp, dir.join("ckpt_1.pt")).unwrap();
    d.wait_for(Duration::from_secs(60), "the warning", |d| {
        d.log().contains("cannot read the file")
    });
    // A readable checkpoint placed after it is evaluated: scans went on, and the unreadable one
    // is still waiting, not recorded as a failure.
    place(dir, &toy_run().join("ckpt_000060.pt"), 2);
    d.wait_for(Duration::from_secs(180), "ckpt_2", |_| {
        journal(dir).0 == vec![2]
    });
    assert!(journal(dir).1.is_empty(), "{}", d.log());
    fs::set_permissions(dir.join("ckpt_1.pt"), fs::Permissions::from_mode(0o644)).unwrap();
    d.wait_for(Duration::from_secs(180), "the evaluation of ckpt_1", |_| {
        journal(dir).0 == vec![2, 1]
    });
    let log = d.log();
    assert_eq!(log.matches("cannot read the file").count(), 1, "{log}");
    assert!(journal(dir).1.is_empty(), "{log}");
}

#[test]
fn a_newline_in_a_checkpoint_name_does_not_forge_a_log_line() {
    let run = empty_run();
    let dir = run.path();
    let d = Daemon::start(
        dir,
        "checkpoints: {pattern: \"ckpt_*.pt\", settle_secs: 0.2, poll_secs: 0.5}\n",
    );
    let name = "ckpt_7\nERROR forged by a file name.pt";
    let tmp = dir.join("incoming.tmp");
    fs::copy(toy_run().join("ckpt_000030.pt"), &tmp).unwrap();
    fs::rename(&tmp, dir.join(name)).unwrap();
    d.wait_for(Duration::from_secs(180), "the evaluation", |_| {
        journal(dir).0 == vec![7]
    });
    // (history.h5 is written with no rows at the start, then rewritten.)
    d.wait_for(Duration::from_secs(30), "history.h5 with one row", |_| {
        hdf5::File::open(dir.join(".diffmon/history.h5"))
            .and_then(|f| f.dataset("evaluations/checkpoint"))
            .is_ok_and(|ds| ds.shape() == vec![1])
    });
    let log = d.log();
    assert!(
        !log.lines().any(|l| l.starts_with("ERROR forged")),
        "a file name forged a log line:\n{log}"
    );
    assert!(log.contains("ckpt_7\\nERROR forged"), "{log}");
    // The journal (JSON) and history.h5 (a string dataset) keep the real name.
    let entries = crate::daemon::journal_entries(dir);
    assert_eq!(
        entries[0]["record"]["checkpoint"].as_str().unwrap(),
        dir.join(name).to_str().unwrap()
    );
    let names = hdf5::File::open(dir.join(".diffmon/history.h5"))
        .unwrap()
        .dataset("evaluations/checkpoint")
        .unwrap()
        .read_raw::<hdf5::types::VarLenUnicode>()
        .unwrap();
    assert_eq!(names[0].as_str(), dir.join(name).to_str().unwrap());
}

#[test]
fn run_dir_deleted_and_recreated_keeps_the_whole_history() {
    // The config, the model and the data live outside run.dir, which is deleted.
    let base = empty_run();
    let top = base.path();
    let run: PathBuf = top.join("run");
    fs::create_dir(&run).unwrap();
    let (config, port) = config_outside(top);
    let d = Daemon::spawn(config.clone(), port);
    place(&run, &toy_run().join("ckpt_000030.pt"), 1);
    d.wait_for(Duration::from_secs(180), "ckpt_1", |_| {
        journal(&run).0 == vec![1]
    });
    // The daemon is done writing after ckpt_1 (history.h5 and the kept best follow the journal):
    // a file it made in the middle of `rm -rf` would fail the removal ("Directory not empty").
    d.wait_for(
        Duration::from_secs(60),
        "history.h5 and the kept best",
        |_| {
            h5_steps(&run.join(".diffmon/history.h5")) == vec![1]
                && run.join(".diffmon/best/ckpt_1.pt").is_file()
        },
    );
    fs::remove_dir_all(&run).unwrap();
    d.wait_for(Duration::from_secs(60), "the ERROR", |d| {
        d.log()
            .lines()
            .any(|l| l.contains("ERROR") && l.contains("run folder disappeared"))
    });
    fs::create_dir(&run).unwrap();
    place(&run, &toy_run().join("ckpt_000060.pt"), 2);
    d.wait_for(Duration::from_secs(180), "ckpt_2 in the new folder", |_| {
        journal(&run).0 == vec![1, 2]
    });
    d.wait_for(
        Duration::from_secs(60),
        "history.h5 in the new folder",
        |_| h5_steps(&run.join(".diffmon/history.h5")) == vec![1, 2],
    );
    assert!(
        d.log()
            .lines()
            .any(|l| l.contains("ERROR") && l.contains("journal was deleted")),
        "{}",
        d.log()
    );
}

/// The steps in a `history.h5` (empty when it cannot be read yet).
fn h5_steps(path: &Path) -> Vec<i64> {
    hdf5::File::open(path)
        .and_then(|f| f.dataset("evaluations/step"))
        .and_then(|ds| ds.read_raw::<i64>())
        .unwrap_or_default()
}
