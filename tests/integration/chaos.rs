//! The chaos suite's own cases (RELIABILITY.md, "The chaos suite"; `make chaos` runs them, the
//! ignored ones too, with the older cases it names): a burst of checkpoints under rotation,
//! checkpoints that live just long enough to be pinned, a full checkpoint disk, SIGKILLs while
//! an alert is being delivered, `diffmon init` on a hostile folder.
//!
//! After each daemon case, [`check`] holds what every case must leave: every journal line
//! parses; no checkpoint has two outcomes; every step with an outcome was placed; every
//! checkpoint still on disk at the end was evaluated; a `rotated` failure only for one that is
//! gone; nothing outside the state folder was written or changed but what the case wrote; and
//! the daemon's peak resident memory under [`RSS_BOUND_MIB`]. Each case appends one line to
//! `$DIFFMON_CHAOS_REPORT` when it is set (scripts/chaos makes RELIABILITY.md's table of them).

use crate::common::{stderr, stdout, toy_run};
use crate::daemon::{Daemon, empty_run, free_port};
use crate::early_stop::{Receiver, checkpoints_by_icr, place, u_turn_config, write_base_config};
use crate::reliability::Tmpfs;
use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant, SystemTime};

/// The daemon's peak resident memory (VmHWM) allowed in every case: libtorch and the toy model
/// take about 200 MiB; what a case's work adds on top must stay small.
const RSS_BOUND_MIB: u64 = 512;

/// Fast completion checks (a checkpoint is complete 0.2 s after its last change).
const FAST: &str = "checkpoints: {pattern: \"ckpt_*.pt\", settle_secs: 0.2, poll_secs: 0.5}\n";

/// The peak resident memory of a live process, KiB (`VmHWM` in `/proc/<pid>/status`).
fn peak_rss_kib(pid: u32) -> u64 {
    fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines().find_map(|l| {
                l.strip_prefix("VmHWM:")?
                    .trim()
                    .strip_suffix("kB")?
                    .trim()
                    .parse()
                    .ok()
            })
        })
        .unwrap_or_else(|| panic!("no VmHWM for process {pid}"))
}

/// The daemon's peak memory, asserted under the bound; KiB.
fn bounded_peak(d: &Daemon) -> u64 {
    let peak = peak_rss_kib(d.child.id());
    assert!(
        peak <= RSS_BOUND_MIB * 1024,
        "the daemon's peak resident memory is {} MiB, over {RSS_BOUND_MIB} MiB",
        peak / 1024
    );
    peak
}

/// One line of the chaos report: `case<TAB>peak KiB<TAB>note` (peak 0: not measured by the case).
pub(crate) fn report(case: &str, peak_kib: u64, note: &str) {
    eprintln!("chaos: {case}: peak {} MiB; {note}", peak_kib / 1024);
    if let Some(path) = std::env::var_os("DIFFMON_CHAOS_REPORT") {
        let mut f = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .unwrap();
        writeln!(f, "{case}\t{peak_kib}\t{note}").unwrap();
    }
}

/// The outcomes the journal of `state` records for each step: `evaluation` or the failure's
/// reason, in order. Every line must parse (read after the daemon stopped).
fn outcomes(state: &Path) -> BTreeMap<i64, Vec<String>> {
    outcomes_in(&fs::read_to_string(state.join("history.jsonl")).unwrap_or_default())
}

/// [`outcomes`] of the journal's text.
fn outcomes_in(text: &str) -> BTreeMap<i64, Vec<String>> {
    let mut out: BTreeMap<i64, Vec<String>> = BTreeMap::new();
    for (n, line) in text.lines().enumerate() {
        let v: Value = serde_json::from_str(line)
            .unwrap_or_else(|e| panic!("journal line {} does not parse ({e}): {line}", n + 1));
        let (step, what) = match v["kind"].as_str() {
            Some("evaluation") => (&v["record"]["step"], "evaluation"),
            Some("resume") => continue,
            _ => (&v["step"], v["reason"].as_str().unwrap_or("?")),
        };
        let step = step
            .as_i64()
            .unwrap_or_else(|| panic!("journal line {} has no step: {line}", n + 1));
        out.entry(step).or_default().push(what.to_string());
    }
    out
}

/// Does the journal of `state` (read while the daemon runs) record an evaluation of `step`?
fn evaluated(state: &Path, step: i64) -> bool {
    outcomes_while_running(state)
        .get(&step)
        .is_some_and(|o| o.iter().any(|w| w == "evaluation"))
}

/// The journal's invariants (module docs) over the steps the case placed and those still on
/// disk; returns how many steps ended in each outcome.
fn check(state: &Path, placed: &BTreeSet<i64>, on_disk: &BTreeSet<i64>) -> BTreeMap<String, usize> {
    let outcomes = outcomes(state);
    let mut counts = BTreeMap::new();
    for (step, o) in &outcomes {
        assert!(placed.contains(step), "step {step} was never placed: {o:?}");
        assert_eq!(o.len(), 1, "step {step} has {} outcomes: {o:?}", o.len());
        assert!(
            o[0] != "rotated" || !on_disk.contains(step),
            "step {step} is still on disk, yet recorded as rotated"
        );
        *counts.entry(o[0].clone()).or_insert(0) += 1;
    }
    for step in on_disk {
        assert_eq!(
            outcomes.get(step).map(|o| o[0].as_str()),
            Some("evaluation"),
            "step {step} is still on disk and was not evaluated"
        );
    }
    counts
}

/// Every file under `dir` (its folder `.diffmon` left out, links not followed): relative path
/// to (length, modification time).
fn files_outside_state(dir: &Path) -> BTreeMap<PathBuf, (u64, SystemTime)> {
    fn walk(top: &Path, at: &Path, out: &mut BTreeMap<PathBuf, (u64, SystemTime)>) {
        for e in fs::read_dir(at).unwrap().flatten() {
            let path = e.path();
            let rel = path.strip_prefix(top).unwrap().to_path_buf();
            if rel == Path::new(".diffmon") {
                continue;
            }
            let meta = fs::symlink_metadata(&path).unwrap();
            if meta.is_dir() {
                walk(top, &path, out);
            } else {
                out.insert(rel, (meta.len(), meta.modified().unwrap()));
            }
        }
    }
    let mut out = BTreeMap::new();
    walk(dir, dir, &mut out);
    out
}

/// Nothing under `dir` outside its state folder was changed between `before` and now, and what
/// is new is what `is_the_cases` says the case wrote (or a daemon's log, the test's own).
fn unchanged_outside_state(
    dir: &Path,
    before: &BTreeMap<PathBuf, (u64, SystemTime)>,
    is_the_cases: impl Fn(&str) -> bool,
) {
    let ours = |rel: &Path| {
        let name = rel.to_string_lossy();
        is_the_cases(&name) || name.starts_with("daemon-") && name.ends_with(".log")
    };
    let after = files_outside_state(dir);
    for (rel, was) in before.iter().filter(|(rel, _)| !ours(rel)) {
        assert_eq!(after.get(rel), Some(was), "{} was changed", rel.display());
    }
    for rel in after.keys().filter(|r| !before.contains_key(*r)) {
        assert!(
            ours(rel),
            "{} was written outside the state folder",
            rel.display()
        );
    }
}

fn ckpt(dir: &Path, step: i64) -> PathBuf {
    dir.join(format!("ckpt_{step}.pt"))
}

fn is_checkpoint(name: &str) -> bool {
    name.starts_with("ckpt_") && name.ends_with(".pt")
}

/// `count` checkpoints in one second, each written under a temporary name and renamed into
/// place, and each deleted once `keep` newer ones exist, as a training job rotating to its
/// newest few would (`None`: all kept). Returns how long the writing took.
fn burst(dir: &Path, count: i64, keep: Option<i64>) -> Duration {
    let src = toy_run().join("ckpt_000060.pt");
    let start = Instant::now();
    for step in 1..=count {
        place(dir, &src, step);
        if let Some(keep) = keep.filter(|k| step > *k) {
            fs::remove_file(ckpt(dir, step - keep)).unwrap();
        }
        let due = Duration::from_secs(1).mul_f64(step as f64 / count as f64);
        std::thread::sleep(due.saturating_sub(start.elapsed()));
    }
    start.elapsed()
}

/// 300 checkpoints in a second, the newest two kept: each lives about 7 ms. One renamed into
/// place is complete at once and pinned while pins are free (16), the others are `rotated` or
/// never seen (docs/guide/watching.md, "Rotation"); the two that stay are evaluated, every
/// outcome is recorded once, and nothing grows.
#[test]
fn a_burst_of_300_checkpoints_rotated_to_the_newest_two_leaves_them_evaluated_once() {
    let run = empty_run();
    let dir = run.path();
    let d = Daemon::start(dir, FAST);
    let state = dir.join(".diffmon");
    let before = files_outside_state(dir);
    let took = burst(dir, 300, Some(2));
    d.wait_for(
        Duration::from_secs(180),
        "the newest two checkpoints' evaluations",
        |_| evaluated(&state, 299) && evaluated(&state, 300),
    );
    std::thread::sleep(Duration::from_secs(2)); // a later scan must not add anything
    let peak = bounded_peak(&d);
    let mut d = d;
    d.terminate();
    let counts = check(&state, &(1..=300).collect(), &[299, 300].into());
    unchanged_outside_state(dir, &before, is_checkpoint);
    report(
        "burst: 300 checkpoints in a second, newest 2 kept",
        peak,
        &format!(
            "written in {:.2} s; outcomes {counts:?}",
            took.as_secs_f64()
        ),
    );
}

/// 300 checkpoints in a second, all kept: every one is evaluated exactly once, in the daemon's
/// own time (a few minutes on 2 cores; chaos suite only).
#[test]
#[ignore = "minutes: make chaos runs it"]
fn a_burst_of_300_kept_checkpoints_is_evaluated_once_each() {
    let run = empty_run();
    let dir = run.path();
    let d = Daemon::start(dir, FAST);
    let state = dir.join(".diffmon");
    let before = files_outside_state(dir);
    let took = burst(dir, 300, None);
    d.wait_for(Duration::from_secs(900), "300 evaluations", |d| {
        d.evaluated() >= 300.0
    });
    std::thread::sleep(Duration::from_secs(2));
    let peak = bounded_peak(&d);
    let mut d = d;
    d.terminate();
    let all: BTreeSet<i64> = (1..=300).collect();
    let counts = check(&state, &all, &all);
    unchanged_outside_state(dir, &before, is_checkpoint);
    report(
        "burst: 300 checkpoints in a second, all kept",
        peak,
        &format!(
            "written in {:.2} s; outcomes {counts:?}",
            took.as_secs_f64()
        ),
    );
}

/// Rotation to the newest two, a checkpoint every `interval`, with evaluation slower than that:
/// each checkpoint lives two intervals, longer than it takes to be found and pinned, so all
/// are evaluated from their pins while no more than the 16 pins' worth wait (docs/guide/
/// watching.md, "Rotation"). Returns (outcomes, peak KiB, the daemon's log).
fn rotation_with_pins(count: i64, interval: Duration) -> (BTreeMap<String, usize>, u64, String) {
    let run = empty_run();
    let dir = run.path();
    // 1024 samples make one evaluation take several intervals.
    let d = Daemon::start(
        dir,
        &format!("{FAST}icr: {{samples: 1024, batch_size: 256}}\n"),
    );
    let state = dir.join(".diffmon");
    let before = files_outside_state(dir);
    let src = toy_run().join("ckpt_000060.pt");
    for step in 1..=count {
        place(dir, &src, step);
        if step > 2 {
            fs::remove_file(ckpt(dir, step - 2)).unwrap();
        }
        std::thread::sleep(interval);
    }
    d.wait_for(
        Duration::from_secs(300),
        "an outcome for every checkpoint",
        |_| outcomes(&state).len() as i64 >= count,
    );
    std::thread::sleep(Duration::from_secs(1));
    let peak = bounded_peak(&d);
    let mut d = d;
    d.terminate();
    let counts = check(&state, &(1..=count).collect(), &[count - 1, count].into());
    unchanged_outside_state(dir, &before, is_checkpoint);
    (counts, peak, d.log())
}

/// Issue 62's lost checkpoints, kept within the pins' bound: 14 checkpoints 0.3 s apart, the
/// newest two kept, evaluation slower than the interval; none is lost to rotation.
#[test]
fn checkpoints_that_live_longer_than_a_scan_are_all_evaluated_under_fast_rotation() {
    let (counts, peak, _) = rotation_with_pins(14, Duration::from_millis(300));
    assert_eq!(
        counts,
        [("evaluation".to_string(), 14)].into(),
        "every checkpoint evaluated from its pin"
    );
    report(
        "rotation: 14 checkpoints 0.3 s apart, newest 2 kept, evaluation slower",
        peak,
        &format!("outcomes {counts:?}"),
    );
}

/// Round four's case itself: 30 checkpoints 0.3 s apart, more waiting than there are pins.
/// What is lost is said (`rotated`), never two outcomes, never a silent gap (chaos only).
#[test]
#[ignore = "a minute: make chaos runs it"]
fn more_checkpoints_waiting_than_pins_are_recorded_rotated_never_forgotten() {
    let (counts, peak, log) = rotation_with_pins(30, Duration::from_millis(300));
    assert_eq!(counts.values().sum::<usize>(), 30, "{counts:?}");
    // Had a warning said they were all pinned, it was withdrawn before any was lost.
    if counts.contains_key("rotated") {
        assert!(
            log.contains("only 16 of them are pinned against rotation"),
            "{log}"
        );
    }
    report(
        "rotation: 30 checkpoints 0.3 s apart, newest 2 kept, evaluation slower",
        peak,
        &format!("outcomes {counts:?}"),
    );
}

/// The checkpoint folder's disk fills up: the training job's write of step 2 stops part-way (as
/// `torch.save` leaves it on ENOSPC), space is freed and step 3 is written. The truncated file
/// is a recorded failure; 1 and 3 are evaluated, once each. The state folder is on another disk
/// (a full state folder is reliability::a_full_state_folder_holds_outcomes_back_in_order_...).
/// The cut file waits its give-up time before it is a failure (a file found by a scan may still
/// be growing on NFS): most of a minute, so chaos suite only.
#[test]
#[ignore = "a minute, mostly waiting: make chaos runs it"]
fn a_full_checkpoint_disk_makes_the_cut_checkpoint_a_failure_and_the_next_is_evaluated() {
    let top = empty_run();
    let dir = top.path().join("run");
    let src = toy_run().join("ckpt_000060.pt");
    let size = fs::metadata(&src).unwrap().len();
    // Room for three checkpoints; the filler takes all but half of one.
    let disk = Tmpfs::mount(&dir, &format!("{}k", 3 * size.div_ceil(1024) + 64));
    let port = free_port();
    let config = top.path().join("diffmon.yaml");
    fs::write(
        &config,
        format!(
            "run: {{dir: run, name: test}}\nmodel: {{architecture: model.ts}}\ndevice: cpu\n\
             data: {{path: train.h5, heldout_path: heldout.h5}}\nstate_dir: state\n\
             http: {{listen: \"127.0.0.1:{port}\"}}\nicr: {{samples: 256, batch_size: 256}}\n{FAST}"
        ),
    )
    .unwrap();
    let mut d = Daemon::spawn(config, port);
    let state = top.path().join("state");
    place(&dir, &src, 1);
    d.wait_for(Duration::from_secs(120), "step 1's evaluation", |_| {
        evaluated(&state, 1)
    });

    let filler = disk.fill();
    let full = fs::metadata(&filler).unwrap().len();
    fs::OpenOptions::new()
        .write(true)
        .open(&filler)
        .unwrap()
        .set_len(full - size / 2)
        .unwrap();
    let cut = fs::write(ckpt(&dir, 2), fs::read(&src).unwrap());
    assert!(cut.is_err(), "the disk had room for the whole checkpoint");
    let written = fs::metadata(ckpt(&dir, 2)).unwrap().len();
    assert!(written < size, "{written} of {size} bytes");
    d.wait_for(Duration::from_secs(120), "step 2's outcome", |_| {
        outcomes_while_running(&state).contains_key(&2)
    });
    fs::remove_file(&filler).unwrap();
    place(&dir, &src, 3);
    d.wait_for(Duration::from_secs(120), "step 3's evaluation", |_| {
        evaluated(&state, 3)
    });
    std::thread::sleep(Duration::from_secs(1));
    let peak = bounded_peak(&d);
    d.terminate();
    let counts = check(&state, &[1, 2, 3].into(), &[1, 3].into());
    let failed = &outcomes(&state)[&2][0];
    assert_ne!(failed, "evaluation", "the cut checkpoint was evaluated");
    let log = d.log();
    assert!(
        log.lines()
            .any(|l| l.contains("ckpt_2.pt") && (l.contains("WARN") || l.contains("ERROR"))),
        "the failure is not logged naming the checkpoint:\n{log}"
    );
    report(
        "full checkpoint disk: a cut checkpoint, then room again",
        peak,
        &format!("{written} of {size} bytes written; step 2 `{failed}`; outcomes {counts:?}"),
    );
}

/// A slow disk: a checkpoint written in place stalls half-way for 3 s, fifteen times the time a
/// file must stay unchanged to be complete (`settle_secs` 0.2), as a write to a busy network
/// file system does. The half file is read and cannot be parsed; it is not recorded as a
/// failure while it may still be written (30 s unchanged), and once the write completes the
/// checkpoint is evaluated, once.
#[test]
#[ignore = "make chaos runs it (make test's 30 minutes)"]
fn a_checkpoint_stalled_half_written_on_a_slow_disk_is_evaluated_once_complete() {
    let run = empty_run();
    let dir = run.path();
    let d = Daemon::start(dir, FAST);
    let state = dir.join(".diffmon");
    let before = files_outside_state(dir);
    let bytes = fs::read(toy_run().join("ckpt_000060.pt")).unwrap();
    let mut f = fs::File::create(ckpt(dir, 1)).unwrap();
    f.write_all(&bytes[..bytes.len() / 2]).unwrap();
    f.sync_all().unwrap();
    std::thread::sleep(Duration::from_secs(3));
    f.write_all(&bytes[bytes.len() / 2..]).unwrap();
    drop(f);
    d.wait_for(Duration::from_secs(120), "step 1's evaluation", |_| {
        evaluated(&state, 1)
    });
    std::thread::sleep(Duration::from_secs(2));
    let peak = bounded_peak(&d);
    let mut d = d;
    d.terminate();
    let counts = check(&state, &[1].into(), &[1].into());
    assert_eq!(counts.get("evaluation"), Some(&1), "{counts:?}");
    assert_eq!(counts.len(), 1, "a failure was recorded: {counts:?}");
    unchanged_outside_state(dir, &before, is_checkpoint);
    report(
        "slow disk: a checkpoint stalled half-written for 3 s",
        peak,
        &format!("outcomes {counts:?}"),
    );
}

/// [`outcomes`] while the daemon runs: a last line still being written is left out.
fn outcomes_while_running(state: &Path) -> BTreeMap<i64, Vec<String>> {
    let text = fs::read_to_string(state.join("history.jsonl")).unwrap_or_default();
    outcomes_in(&text[..text.rfind('\n').map_or(0, |i| i + 1)])
}

/// The early stop's webhook held by the receiver without an answer, and the daemon SIGKILLed
/// while it waits, three times; then the receiver answers. The event reaches it under one id,
/// the one the stop file and `/v1/early-stop` name, and it is accepted once (chaos only).
#[test]
#[ignore = "a minute: make chaos runs it"]
fn sigkills_while_the_alert_is_being_delivered_deliver_it_under_one_id() {
    let run = empty_run();
    let dir = run.path();
    write_base_config(dir, "");
    let (hi, lo, rise) = checkpoints_by_icr(dir);
    // Three requests held (30 s each, longer than the daemon waits), then 200.
    let receiver = Receiver::start(dir, free_port(), "0,0,0");
    let mut d = Daemon::start(dir, &u_turn_config(rise, receiver.port, ""));
    let before = files_outside_state(dir);
    for (step, src) in [&hi, &lo, &lo, &hi, &hi].iter().enumerate() {
        place(dir, src, step as i64 + 1);
    }
    for held in 1..=3 {
        d.wait_for(
            Duration::from_secs(180),
            &format!("delivery {held} to reach the receiver"),
            |_| receiver.requests().len() >= held,
        );
        d.child.kill().unwrap();
        d.child.wait().unwrap();
        d.restart();
    }
    d.wait_for(Duration::from_secs(180), "the event to be accepted", |_| {
        !receiver.accepted().is_empty()
    });
    std::thread::sleep(Duration::from_secs(2));
    let status: Value = serde_json::from_str(&d.get("/v1/early-stop").unwrap()).unwrap();
    let peak = bounded_peak(&d);
    d.terminate();
    let ids: BTreeSet<String> = receiver
        .requests()
        .iter()
        .map(|r| r["id"].as_str().unwrap().to_string())
        .collect();
    let accepted = receiver.accepted();
    assert_eq!(ids.len(), 1, "one event, one id: {ids:?}");
    assert_eq!(accepted.len(), 1, "accepted once: {accepted:?}");
    assert_eq!(status["event"]["id"].as_str(), Some(accepted[0].0.as_str()));
    let stop: Value =
        serde_json::from_str(&fs::read_to_string(dir.join("EARLY_STOP")).unwrap()).unwrap();
    assert_eq!(stop["id"], status["event"]["id"]);
    let all: BTreeSet<i64> = (1..=5).collect();
    let counts = check(&dir.join(".diffmon"), &all, &all);
    unchanged_outside_state(dir, &before, |name| {
        is_checkpoint(name) || name == "EARLY_STOP" || name.starts_with("receiver-")
    });
    report(
        "3 SIGKILLs while the alert is held by the receiver",
        peak,
        &format!(
            "{} deliveries, one id, accepted once; outcomes {counts:?}",
            receiver.requests().len()
        ),
    );
}

/// `diffmon init` on a folder a hostile user filled: 3 000 checkpoints among 5 000 other files,
/// a link to itself and a loop of links named like checkpoints, a folder link back up, a sparse
/// 10 GB "checkpoint", a FIFO, names with a terminal escape and a newline. It ends within a
/// bound, with bounded memory, says what it chose, prints no raw control character, and writes
/// nothing into the folder.
#[test]
fn init_on_a_hostile_folder_is_bounded_says_what_it_chose_and_writes_nothing() {
    let run = empty_run();
    let dir = run.path();
    let src = toy_run().join("ckpt_000060.pt");
    for step in 1..=3000 {
        fs::hard_link(&src, ckpt(dir, step * 10)).unwrap();
    }
    for i in 0..5000 {
        fs::write(dir.join(format!("noise_{i}.bin")), b"x").unwrap();
    }
    let link = |target: &str, name: &str| std::os::unix::fs::symlink(target, dir.join(name));
    link("ckpt_90001.pt", "ckpt_90001.pt").unwrap();
    link("ckpt_90003.pt", "ckpt_90002.pt").unwrap();
    link("ckpt_90002.pt", "ckpt_90003.pt").unwrap();
    fs::create_dir(dir.join("logs")).unwrap();
    link("..", "logs/up").unwrap();
    fs::File::create(ckpt(dir, 90004))
        .unwrap()
        .set_len(10 << 30)
        .unwrap();
    let fifo = Command::new("mkfifo")
        .arg(ckpt(dir, 90005))
        .status()
        .unwrap();
    assert!(fifo.success());
    fs::copy(&src, dir.join("ckpt_90006\x1b[2J.pt")).unwrap();
    fs::copy(&src, dir.join("ckpt_90007\nINFO forged.pt")).unwrap();
    let before = files_outside_state(dir);

    let start = Instant::now();
    let out = Command::new("/usr/bin/time")
        .args(["-f", "peak-kib %M"])
        .arg(env!("CARGO_BIN_EXE_diffmon"))
        .args(["init", "--run-dir"])
        .arg(dir)
        .output()
        .unwrap();
    let took = start.elapsed();
    let (said, config) = (stderr(&out), stdout(&out));
    assert!(out.status.success(), "{said}");
    assert!(took < Duration::from_secs(60), "init took {took:?}");
    let peak: u64 = said
        .lines()
        .find_map(|l| l.strip_prefix("peak-kib ")?.trim().parse().ok())
        .unwrap();
    assert!(peak <= RSS_BOUND_MIB * 1024, "init's peak {peak} KiB");
    for (what, text) in [("stderr", &said), ("stdout", &config)] {
        assert!(
            !text.contains('\x1b'),
            "a raw escape on init's {what}:\n{text}"
        );
        assert!(
            !text.lines().any(|l| l.starts_with("INFO forged")),
            "a name's newline forged a line on init's {what}:\n{text}"
        );
    }
    assert!(
        config.contains("model.ts") && config.contains("pattern:"),
        "init did not say what it chose:\n{config}"
    );
    unchanged_outside_state(dir, &before, |_| false);
    report(
        "init on a hostile folder (8 000 entries, link loops, a sparse 10 GB file, a FIFO, escapes)",
        peak,
        &format!("{:.2} s", took.as_secs_f64()),
    );
}
