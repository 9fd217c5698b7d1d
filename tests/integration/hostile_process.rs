//! The daemon process against what kills, blocks or doubles it (real `diffmon watch` processes,
//! real signals): a checkpoint that crashed the process is a recorded failure after the restart;
//! one daemon per state folder; the shutdown cannot hang; a dying thread ends the process with a
//! non-zero status.

use crate::common::{stderr, toy_run};
use crate::daemon::{Daemon, empty_run, exited_within, free_port, journal, journal_entries};
use std::fs;
use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// An evaluation far longer than these tests wait: 2^20 view pairs, the most `icr.samples`
/// allows (streamed moments: little memory).
const SLOW: &str = "checkpoints: {pattern: \"ckpt_*.pt\", settle_secs: 0.2, poll_secs: 0.5}\n\
                    icr: {samples: 1048576, batch_size: 256}\n";

/// A complete checkpoint `ckpt_<step>.pt` (copied, then renamed into place).
fn place(dir: &Path, step: i64) {
    let tmp = dir.join(format!("ckpt_{step:06}.pt.tmp"));
    fs::copy(toy_run().join("ckpt_000030.pt"), &tmp).unwrap();
    fs::rename(&tmp, dir.join(format!("ckpt_{step:06}.pt"))).unwrap();
}

fn signal(child: &Child, sig: i32) {
    // SAFETY: kill(2) on our own child.
    assert_eq!(unsafe { libc::kill(child.id() as i32, sig) }, 0);
}

#[test]
fn a_checkpoint_that_crashed_the_process_is_a_recorded_failure_after_the_restart() {
    let run = empty_run();
    let dir = run.path();
    let mut d = Daemon::start(dir, SLOW);
    place(dir, 100);
    d.wait_for_evaluation_of("ckpt_000100.pt");
    signal(&d.child, libc::SIGSEGV);
    let status = exited_within(&mut d.child, Duration::from_secs(60))
        .unwrap_or_else(|| panic!("SIGSEGV did not end the daemon:\n{}", d.log()));
    assert_eq!(status.signal(), Some(libc::SIGSEGV), "{}", d.log());
    assert!(journal_entries(dir).is_empty());

    // Restarted with fast settings: the crashed checkpoint is a failure, not evaluated again.
    let config = fs::read_to_string(&d.config).unwrap();
    fs::write(
        &d.config,
        config.replace("samples: 1048576", "samples: 256"),
    )
    .unwrap();
    d.restart();
    d.wait_for(Duration::from_secs(60), "the crash to be counted", |d| {
        d.metric("diffmon_checkpoint_failures_total{run=\"test\",reason=\"crashed\"}") == Some(1.0)
    });
    assert!(
        d.log()
            .contains("while evaluating this checkpoint; it is recorded as a failure"),
        "{}",
        d.log()
    );
    place(dir, 200);
    d.wait_for(Duration::from_secs(180), "the next checkpoint", |d| {
        d.evaluated() >= 1.0
    });
    // Rescans (every 0.5 s) and a restart evaluate nothing twice; the marker is gone.
    std::thread::sleep(Duration::from_secs(2));
    d.restart();
    std::thread::sleep(Duration::from_secs(2));
    let (evals, failures) = journal(dir);
    assert_eq!(evals, vec![200], "{}", d.log());
    assert_eq!(failures, vec![(100, "crashed".to_string())], "{}", d.log());
    let failure = &journal_entries(dir)[0];
    let message = failure["message"].as_str().unwrap();
    assert!(message.contains("SIGSEGV"), "{message}");
    assert!(
        failure["key"]["path"]
            .as_str()
            .unwrap()
            .ends_with("ckpt_000100.pt"),
        "{failure}"
    );
}

#[test]
fn a_sigkilled_evaluation_is_retried_not_recorded_as_crashed() {
    let run = empty_run();
    let dir = run.path();
    let mut d = Daemon::start(dir, SLOW);
    place(dir, 100);
    d.wait_for_evaluation_of("ckpt_000100.pt");
    d.child.kill().unwrap();
    assert_eq!(d.child.wait().unwrap().signal(), Some(libc::SIGKILL));
    let config = fs::read_to_string(&d.config).unwrap();
    fs::write(
        &d.config,
        config.replace("samples: 1048576", "samples: 256"),
    )
    .unwrap();
    d.restart();
    d.wait_for(Duration::from_secs(180), "the retried evaluation", |d| {
        d.evaluated() >= 1.0
    });
    let (evals, failures) = journal(dir);
    assert_eq!(evals, vec![100]);
    assert!(failures.is_empty(), "{failures:?}");
}

#[test]
fn a_checkpoint_being_read_at_three_sigkills_is_recorded_as_crashed() {
    // What the out-of-memory killer does to a checkpoint whose reading takes too much memory
    // (here: allowed by a large checkpoints.max_total_mib, 2 GiB declared and inflated): a
    // SIGKILL while its weights are read, no marker. One is an interrupted evaluation; at the
    // third the checkpoint is recorded as crashed instead of being retried forever.
    let run = empty_run();
    let dir = run.path();
    let tmp = dir.join("bomb.tmp");
    crate::hostile::declared_gib(Path::new("-"), &tmp, dir, 2);
    let mut d = Daemon::start(
        dir,
        "checkpoints: {pattern: \"ckpt_*.pt\", settle_secs: 0.2, poll_secs: 0.5, max_total_mib: 8192}\n",
    );
    fs::rename(&tmp, dir.join("ckpt_000100.pt")).unwrap();
    for death in 1..=3 {
        d.wait_for_evaluation_of("ckpt_000100.pt");
        d.child.kill().unwrap();
        assert_eq!(d.child.wait().unwrap().signal(), Some(libc::SIGKILL));
        assert!(journal_entries(dir).is_empty(), "death {death}");
        d.restart();
    }
    d.wait_for(Duration::from_secs(60), "the crash to be counted", |d| {
        d.metric("diffmon_checkpoint_failures_total{run=\"test\",reason=\"crashed\"}") == Some(1.0)
    });
    place(dir, 200);
    d.wait_for(Duration::from_secs(180), "the next checkpoint", |d| {
        d.evaluated() >= 1.0
    });
    let (evals, failures) = journal(dir);
    assert_eq!(evals, vec![200], "{}", d.log());
    assert_eq!(failures, vec![(100, "crashed".to_string())], "{}", d.log());
    let message = journal_entries(dir)[0]["message"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(
        message.contains("weights were being read at 3 process deaths without a crash marker"),
        "{message}"
    );
}

/// The config of `d` with another HTTP port: a second daemon on the same state folder.
fn second_config(d: &Daemon) -> (std::path::PathBuf, u16) {
    let text = fs::read_to_string(&d.config).unwrap();
    let second = d.config.with_file_name("second.yaml");
    let port = free_port();
    fs::write(
        &second,
        text.replace(&format!(":{}\"", d.port), &format!(":{port}\"")),
    )
    .unwrap();
    assert_ne!(fs::read_to_string(&second).unwrap(), text);
    (second, port)
}

#[test]
fn a_second_daemon_on_the_same_state_folder_refuses_to_start_naming_the_holder() {
    let run = empty_run();
    let dir = run.path();
    let mut d = Daemon::start(
        dir,
        "checkpoints: {pattern: \"ckpt_*.pt\", settle_secs: 0.2, poll_secs: 0.5}\n",
    );
    let (second, second_port) = second_config(&d);
    let mut other = Command::new(env!("CARGO_BIN_EXE_diffmon"))
        .args(["watch", "--config", second.to_str().unwrap()])
        .env("DIFFMON_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let Some(status) = exited_within(&mut other, Duration::from_secs(120)) else {
        let _ = other.kill();
        panic!("a second daemon runs on the same state folder");
    };
    let out = other.wait_with_output().unwrap();
    let message = stderr(&out);
    assert_eq!(status.code(), Some(1), "{message}");
    let lock = dir.join(".diffmon/lock");
    assert!(message.contains(&lock.display().to_string()), "{message}");
    assert!(
        message.contains(&format!("pid {} on host ", d.child.id())),
        "{message}"
    );
    assert!(message.contains(" since "), "{message}");

    // The first one works on alone; `diffmon report` reads its history beside it.
    place(dir, 100);
    d.wait_for(Duration::from_secs(180), "one evaluation", |d| {
        d.evaluated() >= 1.0
    });
    let report = dir.join("report.html");
    let out = crate::common::diffmon(&[
        "report",
        "--config",
        d.config.to_str().unwrap(),
        "--out",
        report.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", stderr(&out));

    // A SIGKILLed holder leaves no stale lock: the second daemon starts at once.
    d.child.kill().unwrap();
    d.child.wait().unwrap();
    d.config = second;
    d.port = second_port;
    d.restart();
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(journal(dir).0, vec![100], "evaluated once, by one daemon");
}

#[test]
fn a_first_signal_ends_the_process_when_the_drain_times_out() {
    let run = empty_run();
    let dir = run.path();
    let mut d = Daemon::start(dir, &format!("{SLOW}shutdown_drain_secs: 1\n"));
    place(dir, 100);
    d.wait_for_evaluation_of("ckpt_000100.pt");
    signal(&d.child, libc::SIGTERM);
    // Before, the process hung after logging "stopped" (the runtime waited for the evaluation)
    // and a second signal was ignored: send it once "stopped" is logged, if still running.
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(60)
        && d.child.try_wait().unwrap().is_none()
        && !d.log().contains("stopped")
    {
        std::thread::sleep(Duration::from_millis(50));
    }
    if d.child.try_wait().unwrap().is_none() {
        signal(&d.child, libc::SIGTERM);
    }
    let status = exited_within(&mut d.child, Duration::from_secs(60))
        .unwrap_or_else(|| panic!("the daemon did not exit:\n{}", d.log()));
    let log = d.log();
    assert!(
        status.code() == Some(0) || status.code() == Some(130),
        "{status:?}\n{log}"
    );
    assert!(log.contains("did not finish within 1s"), "{log}");
    // The checkpoint in flight is evaluated again after a restart, not a failure.
    assert!(journal_entries(dir).is_empty());
}

#[test]
fn a_second_signal_exits_at_once_during_the_drain() {
    let run = empty_run();
    let dir = run.path();
    let mut d = Daemon::start(dir, SLOW);
    place(dir, 100);
    d.wait_for_evaluation_of("ckpt_000100.pt");
    signal(&d.child, libc::SIGTERM);
    d.wait_for(Duration::from_secs(30), "the drain", |d| {
        d.log().contains("draining")
    });
    signal(&d.child, libc::SIGINT);
    let status = exited_within(&mut d.child, Duration::from_secs(30))
        .unwrap_or_else(|| panic!("the second signal did not end the daemon:\n{}", d.log()));
    assert_eq!(status.code(), Some(130), "{}", d.log());
    assert!(
        d.log().contains("second signal: exiting now"),
        "{}",
        d.log()
    );
}

#[test]
fn a_thread_that_dies_ends_the_process_with_a_non_zero_status() {
    // `poll_secs: 1e20` panicked the watcher thread, and the process exited 0. (Once the config
    // refuses such values, this start fails at the config, with status 2: non-zero all the same.)
    let run = empty_run();
    let dir = run.path();
    let port = free_port();
    let config = dir.join("diffmon.yaml");
    fs::write(
        &config,
        format!(
            "run: {{dir: ., name: test}}\nmodel: {{architecture: model.ts}}\ndevice: cpu\n\
             data: {{path: train.h5, heldout_path: heldout.h5}}\n\
             http: {{listen: \"127.0.0.1:{port}\"}}\nicr: {{samples: 256, batch_size: 256}}\n\
             checkpoints: {{poll_secs: 1.0e20}}\n"
        ),
    )
    .unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_diffmon"))
        .args(["watch", "--config", config.to_str().unwrap()])
        .env("DIFFMON_LOG", "info")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let Some(status) = exited_within(&mut child, Duration::from_secs(120)) else {
        let _ = child.kill();
        panic!("the daemon runs on without its watcher");
    };
    let log = stderr(&child.wait_with_output().unwrap());
    assert_ne!(status.code(), Some(0), "{log}");
    if status.code() == Some(1) {
        assert!(
            log.contains("ERROR") && log.contains("thread=\"diffmon-watch\""),
            "{log}"
        );
    } else {
        assert_eq!(status.code(), Some(2), "{log}");
    }
}
