//! `diffmon watch` as a real process over a real run folder: completion detection, exactly-once
//! evaluation, failures, polling without inotify, crash and restart.

use crate::common::{diffmon, stderr, stdout, toy_run};
use serde_json::Value;
use std::fs;
use std::io::Write;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A port nothing listens on, never handed out before in this process, and below the kernel's
/// ephemeral range: a daemon restarted on its port (a kill test) must find it free, and in the
/// ephemeral range another test's outgoing connection may take it as its source port meanwhile
/// (CI once failed so, `Address already in use`). Falls back to the kernel's choice where the
/// ephemeral range leaves too little below it.
pub fn free_port() -> u16 {
    use std::sync::atomic::{AtomicU32, Ordering};
    const FIRST: u32 = 10_000;
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let ephemeral_low: u32 = fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .unwrap_or(32_768);
    let span = ephemeral_low.saturating_sub(FIRST);
    if span >= 1_000 {
        // Start at a place of this process's own, so that two test processes rarely meet.
        let _ = NEXT.compare_exchange(
            0,
            std::process::id() % span,
            Ordering::Relaxed,
            Ordering::Relaxed,
        );
        for _ in 0..span {
            let port = FIRST + NEXT.fetch_add(1, Ordering::Relaxed) % span;
            if TcpListener::bind(("127.0.0.1", port as u16)).is_ok() {
                return port as u16;
            }
        }
    }
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// The child's status once it exits, or `None` if it still runs after `deadline`.
pub fn exited_within(child: &mut Child, deadline: Duration) -> Option<std::process::ExitStatus> {
    let start = Instant::now();
    while start.elapsed() < deadline {
        if let Some(status) = child.try_wait().unwrap() {
            return Some(status);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    None
}

/// A run folder holding the toy run's architecture and data, without checkpoints.
pub fn empty_run() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for f in ["model.ts", "train.h5", "heldout.h5"] {
        fs::copy(toy_run().join(f), dir.path().join(f)).unwrap();
    }
    dir
}

/// `<top>/diffmon.yaml` for the run folder `<top>/run`, the model and data in `top` (so the run
/// folder can be deleted or replaced), on a free port: (config, port).
pub fn config_outside(top: &Path) -> (PathBuf, u16) {
    let port = free_port();
    let config = top.join("diffmon.yaml");
    fs::write(
        &config,
        format!(
            "run: {{dir: run, name: test}}\nmodel: {{architecture: model.ts}}\ndevice: cpu\n\
             data: {{path: train.h5, heldout_path: heldout.h5}}\n\
             http: {{listen: \"127.0.0.1:{port}\"}}\nicr: {{samples: 256, batch_size: 256}}\n\
             checkpoints: {{pattern: \"ckpt_*.pt\", settle_secs: 0.2, poll_secs: 0.5}}\n"
        ),
    )
    .unwrap();
    (config, port)
}

/// A `diffmon watch` process, killed when dropped.
pub struct Daemon {
    pub child: Child,
    pub port: u16,
    pub config: PathBuf,
    pub log: PathBuf,
}

impl Daemon {
    /// Writes `<dir>/diffmon.yaml` (fast settings plus `extra` YAML) and starts the daemon.
    pub fn start(dir: &Path, extra: &str) -> Daemon {
        let port = free_port();
        let config = dir.join("diffmon.yaml");
        fs::write(
            &config,
            format!(
                "run: {{dir: ., name: test}}\nmodel: {{architecture: model.ts}}\ndevice: cpu\n\
                 data: {{path: train.h5, heldout_path: heldout.h5}}\n\
                 http: {{listen: \"127.0.0.1:{port}\"}}\n{fast_icr}{extra}",
                fast_icr = if extra.contains("icr:") {
                    ""
                } else {
                    "icr: {samples: 256, batch_size: 256}\n"
                }
            ),
        )
        .unwrap();
        Daemon::spawn(config, port)
    }

    /// Starts the daemon again on the same config.
    pub fn restart(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        *self = Daemon::spawn(self.config.clone(), self.port);
    }

    pub fn spawn(config: PathBuf, port: u16) -> Daemon {
        Daemon::spawn_wrapped(config, port, &[])
    }

    /// [`Daemon::spawn`] through `wrapper`, a command that runs the daemon (`setpriv ...`),
    /// when it is not empty. Waits until the HTTP endpoint answers, and fails at once, with the
    /// log, if the daemon exits first (a config it refuses). Without a wrapper its temporary
    /// folder is the config's: what a killed daemon leaves there (libtorch's unpacked copy of a
    /// compiled package) goes with the test's.
    pub fn spawn_wrapped(config: PathBuf, port: u16, wrapper: &[&str]) -> Daemon {
        let log = config.with_file_name(format!(
            "daemon-{}.log",
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos()
        ));
        let out = fs::File::create(&log).unwrap();
        let bin = env!("CARGO_BIN_EXE_diffmon");
        let mut cmd = match wrapper.split_first() {
            Some((first, rest)) => {
                let mut c = Command::new(first);
                c.args(rest).arg(bin);
                c
            }
            None => {
                let mut c = Command::new(bin);
                c.env("TMPDIR", config.parent().unwrap());
                c
            }
        };
        let child = cmd
            .args(["watch", "--config", config.to_str().unwrap()])
            .env("DIFFMON_LOG", "info,diffmon=debug")
            .stdout(out.try_clone().unwrap())
            .stderr(out)
            .stdin(Stdio::null())
            .spawn()
            .unwrap();
        let mut d = Daemon {
            child,
            port,
            config,
            log,
        };
        let start = Instant::now();
        while d.get("/healthz").is_none() {
            if let Some(status) = d.child.try_wait().unwrap() {
                panic!(
                    "the daemon exited ({status}) before answering; daemon log:\n{}",
                    d.log()
                );
            }
            assert!(
                start.elapsed() < Duration::from_secs(180),
                "timed out after 180s waiting for the HTTP endpoint; daemon log:\n{}",
                d.log()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        d
    }

    pub fn log(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// `GET path` on the daemon, body when 200.
    pub fn get(&self, path: &str) -> Option<String> {
        crate::common::http_get(&format!("http://127.0.0.1:{}{path}", self.port))
    }

    /// Waits until the daemon has started evaluating the checkpoint file `name`.
    pub fn wait_for_evaluation_of(&self, name: &str) {
        self.wait_for(
            Duration::from_secs(120),
            &format!("the evaluation of {name} to start"),
            |d| {
                d.log()
                    .lines()
                    .any(|l| l.contains("evaluating") && l.contains(name))
            },
        );
    }

    /// The value of a metric series, e.g. `diffmon_checkpoints_evaluated_total{run="test"}`.
    pub fn metric(&self, series: &str) -> Option<f64> {
        let text = self.get("/metrics")?;
        text.lines().find_map(|l| {
            l.strip_prefix(series)
                .and_then(|rest| rest.trim().parse().ok())
        })
    }

    pub fn evaluated(&self) -> f64 {
        self.metric("diffmon_checkpoints_evaluated_total{run=\"test\"}")
            .unwrap_or(-1.0)
    }

    pub fn wait_for(&self, timeout: Duration, what: &str, mut cond: impl FnMut(&Daemon) -> bool) {
        let start = Instant::now();
        while start.elapsed() < timeout {
            if cond(self) {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        panic!(
            "timed out after {timeout:?} waiting for {what}; daemon log:\n{}",
            self.log()
        );
    }

    pub fn terminate(&mut self) {
        unsafe { libc_kill(self.child.id() as i32, 15) };
        let start = Instant::now();
        while start.elapsed() < Duration::from_secs(120) {
            if self.child.try_wait().unwrap().is_some() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!("the daemon did not stop on SIGTERM:\n{}", self.log());
    }
}

unsafe extern "C" {
    #[link_name = "kill"]
    fn libc_kill(pid: i32, sig: i32) -> i32;
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The history journal's evaluation steps and failures, in order. A last line still being
/// written by a running daemon (no newline yet) is left out.
pub fn journal(dir: &Path) -> (Vec<i64>, Vec<(i64, String)>) {
    let mut evals = Vec::new();
    let mut failures = Vec::new();
    for v in journal_entries(dir) {
        match v["kind"].as_str().unwrap() {
            "evaluation" => evals.push(v["record"]["step"].as_i64().unwrap()),
            "resume" => {}
            _ => failures.push((
                v["step"].as_i64().unwrap(),
                v["reason"].as_str().unwrap().to_string(),
            )),
        }
    }
    (evals, failures)
}

/// The entries of the history journal as JSON, in order. A last line still being written by a
/// running daemon (no newline yet) is left out; every other line must parse.
pub fn journal_entries(dir: &Path) -> Vec<Value> {
    let text = fs::read_to_string(dir.join(".diffmon/history.jsonl")).unwrap_or_default();
    let complete = &text[..text.rfind('\n').map_or(0, |i| i + 1)];
    complete
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// Writes `src` to `dst` in `chunks` pieces, `pause` apart (a slow writer).
fn write_slowly(src: &Path, dst: &Path, chunks: usize, pause: Duration) {
    let bytes = fs::read(src).unwrap();
    let mut f = fs::File::create(dst).unwrap();
    for chunk in bytes.chunks(bytes.len().div_ceil(chunks)) {
        f.write_all(chunk).unwrap();
        f.flush().unwrap();
        std::thread::sleep(pause);
    }
}

#[test]
fn each_complete_checkpoint_is_evaluated_exactly_once() {
    let run = empty_run();
    let dir = run.path();
    let ckpt = toy_run().join("ckpt_000030.pt");
    // Many ICR samples, so that an evaluation takes long enough to delete its file meanwhile.
    let d = Daemon::start(
        dir,
        "checkpoints: {pattern: \"ckpt_*.pt\", settle_secs: 1.0, poll_secs: 0.5}\nicr: {samples: 8192, batch_size: 512}\n",
    );

    // 1. Written in place, slowly: must not be read before it has settled.
    write_slowly(
        &ckpt,
        &dir.join("ckpt_000100.pt"),
        4,
        Duration::from_millis(400),
    );
    // 2. Written under a temporary name, then renamed into place.
    write_slowly(
        &ckpt,
        &dir.join("ckpt_000200.pt.tmp"),
        3,
        Duration::from_millis(200),
    );
    fs::rename(dir.join("ckpt_000200.pt.tmp"), dir.join("ckpt_000200.pt")).unwrap();
    d.wait_for(Duration::from_secs(180), "two evaluations", |d| {
        d.evaluated() >= 2.0
    });

    // 3. Deleted during its evaluation (ICR takes a while with many samples), as rotation
    //    does: it was pinned when found complete, so it is evaluated from its pin and recorded
    //    under its name (docs/guide/watching.md, "Rotation").
    fs::copy(&ckpt, dir.join("ckpt_000300.pt.tmp")).unwrap();
    fs::rename(dir.join("ckpt_000300.pt.tmp"), dir.join("ckpt_000300.pt")).unwrap();
    d.wait_for_evaluation_of("ckpt_000300.pt");
    fs::remove_file(dir.join("ckpt_000300.pt")).unwrap();
    d.wait_for(Duration::from_secs(180), "the deleted one's record", |d| {
        d.evaluated() >= 3.0
    });

    // 3b. Rewritten in place during its evaluation: the pin shares its file, so what was read
    //     is no longer there: a `vanished` failure (the new version is evaluated in its turn).
    fs::copy(&ckpt, dir.join("ckpt_000350.pt.tmp")).unwrap();
    fs::rename(dir.join("ckpt_000350.pt.tmp"), dir.join("ckpt_000350.pt")).unwrap();
    d.wait_for_evaluation_of("ckpt_000350.pt");
    fs::copy(toy_run().join("ckpt_000060.pt"), dir.join("ckpt_000350.pt")).unwrap();
    d.wait_for(Duration::from_secs(180), "the failure to be counted", |d| {
        d.metric("diffmon_checkpoint_failures_total{run=\"test\",reason=\"vanished\"}") == Some(1.0)
    });

    // 4. The daemon is still alive and evaluates the next ones (the rewritten file, then 400).
    fs::copy(&ckpt, dir.join("ckpt_000400.pt.tmp")).unwrap();
    fs::rename(dir.join("ckpt_000400.pt.tmp"), dir.join("ckpt_000400.pt")).unwrap();
    d.wait_for(
        Duration::from_secs(180),
        "the evaluations after the failure",
        |d| d.evaluated() >= 5.0,
    );

    std::thread::sleep(Duration::from_secs(2)); // a later rescan must not evaluate anything twice
    let (mut evals, failures) = journal(dir);
    // The renamed file is complete at once, the slowly written one only once it settles: the
    // order may vary, the count may not.
    evals.sort();
    assert_eq!(evals, vec![100, 200, 300, 350, 400], "{}", d.log());
    assert_eq!(failures, vec![(350, "vanished".to_string())]);
    assert_eq!(d.evaluated(), 5.0);
    // No pin outlives its record (the best's is held while it is the best).
    let pins = fs::read_dir(dir.join(".diffmon/pins")).unwrap().count();
    assert!(pins <= 1, "{pins} pins");
}

#[test]
fn polling_alone_finds_checkpoints_within_poll_secs() {
    let run = empty_run();
    let dir = run.path();
    let d = Daemon::start(
        dir,
        "checkpoints: {pattern: \"ckpt_*.pt\", settle_secs: 0.2, poll_secs: 1.0, inotify: false}\n",
    );
    fs::copy(toy_run().join("ckpt_000030.pt"), dir.join("ckpt_000010.pt")).unwrap();
    d.wait_for(Duration::from_secs(120), "the polled checkpoint", |d| {
        d.evaluated() >= 1.0
    });
    // Found within poll_secs + settle_secs; the rest is the evaluation itself.
    let found = d.log();
    assert!(found.contains("ckpt_000010.pt"), "{found}");
    let (evals, _) = journal(dir);
    assert_eq!(evals, vec![10]);
}

#[test]
fn eval_and_watch_agree() {
    // The daemon's record for a checkpoint equals `diffmon eval`'s on the same config.
    let run = empty_run();
    let dir = run.path();
    let mut d = Daemon::start(
        dir,
        "checkpoints: {pattern: \"ckpt_*.pt\", settle_secs: 0.2, poll_secs: 0.5}\n",
    );
    fs::copy(toy_run().join("ckpt_000060.pt"), dir.join("ckpt_000060.pt")).unwrap();
    d.wait_for(Duration::from_secs(180), "one evaluation", |d| {
        d.evaluated() >= 1.0
    });
    d.terminate();
    let out = diffmon(&[
        "eval",
        "--config",
        d.config.to_str().unwrap(),
        dir.join("ckpt_000060.pt").to_str().unwrap(),
        "--json",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let from_eval: Value = serde_json::from_str(stdout(&out).trim()).unwrap();
    let line = fs::read_to_string(dir.join(".diffmon/history.jsonl")).unwrap();
    let from_watch: Value = serde_json::from_str(line.lines().next().unwrap()).unwrap();
    assert_eq!(from_watch["record"]["icr"], from_eval["icr"]);
    assert_eq!(from_watch["record"]["loss_train"], from_eval["loss_train"]);
    assert!(d.log().contains("stopped"), "{}", d.log());
}

/// Issue 33: checkpoints written 0.05 s apart (by their modification times) against evaluations
/// of a second or so: the daemon warns once, naming the run, both numbers and the remedies, and
/// exports both gauges; `check-config` then gives the measured seconds per checkpoint from the
/// history, and says nothing of it before there is one.
#[test]
fn a_daemon_slower_than_the_checkpoints_warns_once_that_it_falls_behind() {
    let run = empty_run();
    let dir = run.path();
    let mut d = Daemon::start(
        dir,
        "checkpoints: {pattern: \"ckpt_*.pt\", settle_secs: 0.2, poll_secs: 0.5}\n\
         icr: {samples: 1024, batch_size: 256}\n",
    );
    let config = d.config.to_str().unwrap().to_string();
    let check = diffmon(&["check-config", &config]);
    assert!(check.status.success(), "{}", stderr(&check));
    assert!(!stdout(&check).contains("measured"), "{}", stdout(&check));

    // Written a minute ago, 0.05 s apart, then renamed into place four at a time: the second
    // four once the first is evaluated, so that the queue grows (the warning waits for that).
    let written = std::time::SystemTime::now() - Duration::from_secs(60);
    let place = |steps: std::ops::RangeInclusive<i64>| {
        for step in steps.clone() {
            let tmp = dir.join(format!("ckpt_{:06}.pt.tmp", step * 100));
            fs::copy(toy_run().join("ckpt_000030.pt"), &tmp).unwrap();
            let f = fs::File::options().write(true).open(&tmp).unwrap();
            f.set_modified(written + Duration::from_millis(50 * step as u64))
                .unwrap();
        }
        for step in steps {
            let name = format!("ckpt_{:06}.pt", step * 100);
            fs::rename(dir.join(format!("{name}.tmp")), dir.join(name)).unwrap();
        }
    };
    place(1..=4);
    d.wait_for(Duration::from_secs(300), "one evaluation", |d| {
        d.evaluated() >= 1.0
    });
    place(5..=8);
    d.wait_for(Duration::from_secs(300), "eight evaluations", |d| {
        d.evaluated() >= 8.0
    });

    let log = d.log();
    let warnings: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("evaluation falls behind"))
        .collect();
    assert_eq!(warnings.len(), 1, "{log}");
    let warning = warnings[0];
    for part in [
        "WARN",
        "run=test",
        "a checkpoint every 0.050 s",
        "checkpoints wait (",
        " more than 0.150 s ago)",
        "Remedies (docs/guide/watching.md, \"When diffmon falls behind\"): lower icr.samples (now 1024)",
        "checkpoints.backlog: latest",
        "device: cuda",
        "or evaluate on Slurm (evaluation.executor: slurm)",
        "now network calls per checkpoint: ICR 2048",
    ] {
        assert!(warning.contains(part), "{part:?} not in {warning}");
    }
    assert!(!log.contains("keeps pace"), "{log}");
    let interval = d
        .metric("diffmon_checkpoint_interval_seconds{run=\"test\"}")
        .expect("the interval gauge");
    assert!((interval - 0.05).abs() < 0.005, "{interval}");
    let seconds = d
        .metric("diffmon_evaluation_seconds{run=\"test\"}")
        .expect("the seconds gauge");
    assert!(seconds > 4.0 * interval, "{seconds}");

    d.terminate();
    let check = diffmon(&["check-config", &config]);
    assert!(check.status.success(), "{}", stderr(&check));
    let out = stdout(&check);
    let line = out
        .lines()
        .find(|l| l.starts_with("measured: "))
        .unwrap_or_else(|| panic!("no measured line in\n{out}"));
    assert!(
        line.contains(" s per checkpoint (median of the last 8 evaluations in ")
            && line.ends_with(".diffmon)"),
        "{line}"
    );
    let measured: f64 = line["measured: ".len()..]
        .split(' ')
        .next()
        .unwrap()
        .parse()
        .unwrap();
    assert!(measured > 4.0 * interval, "{line}");
}

/// Starts `diffmon watch --config config` with `until` (its other arguments) from `cwd`, waits
/// until it watches, then creates `go` (the training waits for it) and waits for the daemon to
/// exit by itself (at most 300 s): its exit code and log.
fn watch_until(config: &Path, cwd: &Path, until: &[&str], go: &Path) -> (Option<i32>, String) {
    let log = config.with_extension("log");
    let out = fs::File::create(&log).unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_diffmon"))
        .args(["watch", "--config", config.to_str().unwrap()])
        .args(until)
        .current_dir(cwd)
        .stdout(out.try_clone().unwrap())
        .stderr(out)
        .stdin(Stdio::null())
        .spawn()
        .unwrap();
    let text = || fs::read_to_string(&log).unwrap_or_default();
    let start = Instant::now();
    let mut started = false;
    let status = loop {
        if !started && text().contains("watching for checkpoints") {
            fs::write(go, b"").unwrap();
            started = true;
        }
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if start.elapsed() > Duration::from_secs(300) {
            let _ = child.kill();
            let _ = child.wait();
            panic!("watch {until:?} did not end within 300 s:\n{}", text());
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    (status.code(), text())
}

/// A config for the run folder `<dir>/<run>` (its model and data in `dir`), with the U-turn
/// detector of `early_stop.rs`.
fn until_config(dir: &Path, run: &str, rise: f64) -> PathBuf {
    let config = dir.join(format!("{run}.yaml"));
    fs::write(
        &config,
        format!(
            "run: {{dir: {run}, name: test}}\nmodel: {{architecture: model.ts}}\ndevice: cpu\n\
             data: {{path: train.h5, heldout_path: heldout.h5}}\n\
             http: {{listen: \"127.0.0.1:{}\"}}\nicr: {{samples: 256, batch_size: 256}}\n\
             checkpoints: {{pattern: \"ckpt_*.pt\", settle_secs: 0.2, poll_secs: 0.5}}\n{}",
            free_port(),
            crate::early_stop::detector_config(rise)
        ),
    )
    .unwrap();
    fs::create_dir(dir.join(run)).unwrap();
    config
}

/// A training job as a real process: a shell that waits for the file `go`, then writes
/// `sources` as `ckpt_1.pt`, `ckpt_2.pt`, ... into `run` (each copied under a temporary name,
/// then renamed into place), the last one just before it runs `last` and exits. Not waited
/// for: once it exits it stays a zombie, which has ended all the same.
fn training(run: &Path, go: &Path, sources: &[&PathBuf], last: &str) -> Child {
    let mut script = format!(
        "set -e\nwhile [ ! -e '{}' ]; do sleep 0.1; done\n",
        go.display()
    );
    for (k, src) in sources.iter().enumerate() {
        let step = k + 1;
        script.push_str(&format!(
            "cp '{src}' '{run}/.ckpt_{step}.tmp'\nmv '{run}/.ckpt_{step}.tmp' '{run}/ckpt_{step}.pt'\n",
            src = src.display(),
            run = run.display()
        ));
        if step < sources.len() {
            script.push_str("sleep 0.3\n");
        }
    }
    script.push_str(last);
    Command::new("sh").args(["-c", &script]).spawn().unwrap()
}

/// `watch --until-pid` under a real training process (five checkpoints, ICR high, low, low,
/// high, high, the last written as the process exits): the daemon evaluates and records every
/// checkpoint, then exits 3, the early stop having fired at the fifth. `--until-file` with a
/// marker written after two checkpoints (no turn): exit 0, both recorded, the marker no
/// checkpoint. Each prints its end-of-run summary on stdout, the second as JSON (`--json`).
#[test]
fn watch_ends_with_the_training_job_after_the_last_evaluation() {
    let run = empty_run();
    let dir = run.path();
    crate::early_stop::write_base_config(dir, "");
    let (hi, lo, rise) = crate::early_stop::checkpoints_by_icr(dir);

    let config = until_config(dir, "pid", rise);
    let go = dir.join("go-pid");
    let mut job = training(
        &dir.join("pid"),
        &go,
        &[&hi, &lo, &lo, &hi, &hi],
        "exit 0\n",
    );
    let pid = job.id().to_string();
    let (code, log) = watch_until(&config, dir, &["--until-pid", &pid], &go);
    assert_eq!(code, Some(3), "{log}");
    assert_eq!(journal(&dir.join("pid")).0, [1, 2, 3, 4, 5], "{log}");
    assert!(log.contains(&format!("process {pid} ended")), "{log}");
    assert!(log.contains("exiting with status 3"), "{log}");
    let stop: Value =
        serde_json::from_str(&fs::read_to_string(dir.join("pid/EARLY_STOP")).unwrap()).unwrap();
    assert_eq!(
        (stop["best_step"].as_i64(), stop["current_step"].as_i64()),
        (Some(2), Some(5))
    );
    job.wait().unwrap(); // a zombie until now, while the daemon ran
    // Issue 62: the end of the run says what happened, on stdout.
    for said in [
        "diffmon: run `test` ended (the training job ended)",
        "  checkpoints: 5 evaluated, 0 failed, 0 rotated away before their evaluation",
        "  early stop: fired at step 5 (turn, ",
        "; best checkpoint: step 2, ",
        "pid/.diffmon/best/ckpt_2.pt",
        "  report: diffmon report --config ",
        "  resume from the best: diffmon resume --config ",
    ] {
        assert!(log.contains(said), "`{said}` is not in:\n{log}");
    }

    let config = until_config(dir, "file", rise);
    let go = dir.join("go-file");
    let marker = dir.join("file/DONE");
    let touch = format!("touch '{}'\n", marker.display());
    let mut job = training(&dir.join("file"), &go, &[&hi, &lo], &touch);
    let (code, log) = watch_until(&config, dir, &["--until-file", "file/DONE", "--json"], &go);
    assert_eq!(code, Some(0), "{log}");
    // `--json`: the summary as one object, the last line.
    let summary: Value = serde_json::from_str(log.lines().last().unwrap()).unwrap();
    assert_eq!(summary["ended"], "training_ended", "{summary}");
    let r = &summary["runs"][0];
    assert_eq!(
        (r["run"].as_str(), r["evaluated"].as_u64()),
        (Some("test"), Some(2))
    );
    assert!(
        r["early_stop"].is_null() && r["resume"].is_null(),
        "{summary}"
    );
    assert!(
        r["report"]
            .as_str()
            .unwrap()
            .starts_with("diffmon report --config ")
    );
    assert!(marker.is_file());
    assert_eq!(journal(&dir.join("file")), (vec![1, 2], vec![]), "{log}");
    assert!(log.contains("DONE exists"), "{log}");
    assert!(log.contains("exiting with status 0"), "{log}");
    assert!(!dir.join("file/EARLY_STOP").exists());
    assert!(job.wait().unwrap().success());
}
