//! `diffmon resume` end to end (docs/design.md §9, "Resume"): the daemon over real checkpoints
//! arranged into a U-shaped ICR curve fires; rotation deletes the best; `diffmon resume` puts
//! the kept copy back, moves the abandoned branch aside and removes the stop file; the restarted
//! daemon resolves the old early stop (a real webhook receiver checks the signed deliveries),
//! follows the new segment and fires again only when the curve turns again. The training
//! stacks' own resume code is exercised in `stacks.rs`.

use crate::common::{diffmon, stderr, stdout};
use crate::daemon::{Daemon, empty_run, free_port, journal, journal_entries};
use crate::early_stop::{Receiver, checkpoints_by_icr, place, u_turn_config, write_base_config};
use serde_json::Value;
use std::fs;
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::time::Duration;

fn status(d: &Daemon) -> Value {
    serde_json::from_str(&d.get("/v1/early-stop").unwrap_or_default()).unwrap_or_default()
}

fn resume(dir: &Path, more: &[&str]) -> std::process::Output {
    let config = dir.join("diffmon.yaml");
    let mut args = vec!["resume", "--config", config.to_str().unwrap()];
    args.extend(more);
    diffmon(&args)
}

#[test]
fn resume_restores_the_kept_best_and_the_detector_fires_again_only_when_it_turns() {
    let run = empty_run();
    let dir = run.path();
    write_base_config(dir, "");
    let (hi, lo, rise) = checkpoints_by_icr(dir);
    let receiver = Receiver::start(dir, free_port(), "");
    let mut d = Daemon::start(dir, &u_turn_config(rise, receiver.port, ""));
    // High, low, low, high, high: fires at 5 with the best at 2 (kept in .diffmon/best/).
    for (step, src) in [(1, &hi), (2, &lo), (3, &lo), (4, &hi), (5, &hi)] {
        place(dir, src, step);
    }
    d.wait_for(Duration::from_secs(240), "the early stop", |d| {
        status(d)["fired"] == true
    });
    let first = status(&d);
    assert_eq!(first["best_step"], 2, "{first}");
    let stop_file = dir.join("EARLY_STOP");
    assert!(stop_file.exists());

    // Not while the daemon records: it says what to do, and changes nothing.
    let busy = resume(dir, &[]);
    assert_eq!(busy.status.code(), Some(1), "{}", stderr(&busy));
    assert!(
        stderr(&busy).contains("stop `diffmon watch` for this run first"),
        "{}",
        stderr(&busy)
    );
    assert!(stop_file.exists());

    d.terminate();
    // Saved over in place (torch.save truncates): the kept copy, a link to the same file,
    // changed with it, so it is not taken for the checkpoint evaluated; back as it was, it is.
    let best = dir.join("ckpt_2.pt");
    let (bytes, mtime) = (
        fs::read(&best).unwrap(),
        fs::metadata(&best).unwrap().modified().unwrap(),
    );
    fs::write(&best, b"saved over in place").unwrap();
    let changed = resume(dir, &["--dry-run"]);
    assert_eq!(changed.status.code(), Some(1), "{}", stdout(&changed));
    assert!(
        stderr(&changed).contains("is no longer the file evaluated at step 2"),
        "{}",
        stderr(&changed)
    );
    let f = fs::OpenOptions::new()
        .write(true)
        .truncate(true)
        .open(&best)
        .unwrap();
    std::io::Write::write_all(&mut &f, &bytes).unwrap();
    f.set_modified(mtime).unwrap();
    drop(f);
    // A folder where the stop file goes: nothing is done (before: checkpoints were moved
    // aside, then the resume failed at the stop file).
    let saved = dir.join("EARLY_STOP.saved");
    fs::rename(&stop_file, &saved).unwrap();
    fs::create_dir(&stop_file).unwrap();
    let blocked = resume(dir, &[]);
    assert_eq!(blocked.status.code(), Some(1), "{}", stdout(&blocked));
    assert!(
        stderr(&blocked).contains("a folder where the stop file goes"),
        "{}",
        stderr(&blocked)
    );
    assert!(dir.join("ckpt_3.pt").exists(), "something was moved aside");
    fs::remove_dir(&stop_file).unwrap();
    fs::rename(&saved, &stop_file).unwrap();
    // The training job's rotation deleted the best checkpoint.
    fs::remove_file(dir.join("ckpt_2.pt")).unwrap();
    let dry = resume(dir, &["--dry-run"]);
    assert!(dry.status.success(), "{}", stderr(&dry));
    assert!(stdout(&dry).contains("would resume"), "{}", stdout(&dry));
    assert!(!dir.join("ckpt_2.pt").exists() && stop_file.exists());

    let out = resume(dir, &[]);
    assert!(out.status.success(), "{}", stderr(&out));
    let report = stdout(&out);
    assert!(report.contains("from step 2"), "{report}");
    assert!(report.contains("restored from"), "{report}");
    assert!(report.contains("torch.load"), "{report}");
    // Back at its own path, the same files as the kept copy (linked), the stop file gone, the
    // abandoned branch's 3 to 5 moved aside.
    let kept = dir.join(".diffmon/best/ckpt_2.pt");
    assert_eq!(
        fs::metadata(dir.join("ckpt_2.pt")).unwrap().ino(),
        fs::metadata(&kept).unwrap().ino()
    );
    assert!(!stop_file.exists());
    for step in [3, 4, 5] {
        assert!(!dir.join(format!("ckpt_{step}.pt")).exists());
        assert!(
            dir.join(format!(".diffmon/set-aside/segment-1/ckpt_{step}.pt"))
                .exists()
        );
    }
    let last = journal_entries(dir).pop().unwrap();
    assert_eq!(
        (last["kind"].as_str(), last["step"].as_i64()),
        (Some("resume"), Some(2))
    );
    // Run again before anything is evaluated: that resume stands, nothing moves.
    let twice = resume(dir, &[]);
    assert!(twice.status.success(), "{}", stderr(&twice));
    assert!(
        stdout(&twice).contains("nothing to do"),
        "{}",
        stdout(&twice)
    );
    assert!(dir.join("ckpt_2.pt").exists());
    assert_eq!(journal_entries(dir).pop().unwrap(), last);
    // A step of the abandoned branch is no resume point.
    let again = resume(dir, &["--step", "4"]);
    assert_eq!(again.status.code(), Some(2), "{}", stderr(&again));
    assert!(stderr(&again).contains("--step 4"), "{}", stderr(&again));

    // The restarted daemon follows segment 2: not stopped, the old early stop resolved.
    d.restart();
    d.wait_for(Duration::from_secs(120), "segment 2", |d| {
        status(d)["segment"] == 2
    });
    let resumed = status(&d);
    assert_eq!(resumed["fired"], false, "{resumed}");
    assert_eq!(resumed["best_step"], 2, "{resumed}");
    assert_eq!(d.metric("diffmon_history_segment{run=\"test\"}"), Some(2.0));
    d.wait_for(Duration::from_secs(60), "the resolved event", |_| {
        receiver.accepted().len() >= 2
    });
    let kinds: Vec<String> = receiver.accepted().into_iter().map(|(_, k)| k).collect();
    assert_eq!(kinds, ["early_stop", "resolved"]);
    assert!(!stop_file.exists(), "the replay wrote the stop file again");

    // The new branch: low, high (above the best once: no turn yet), then high again (the turn).
    place(dir, &lo, 3);
    place(dir, &hi, 4);
    d.wait_for(Duration::from_secs(180), "steps 3 and 4 again", |_| {
        journal(dir).0.len() >= 7
    });
    assert_eq!(status(&d)["fired"], false, "{}", status(&d));
    assert!(!stop_file.exists());
    place(dir, &hi, 5);
    d.wait_for(Duration::from_secs(180), "the second early stop", |d| {
        status(d)["fired"] == true
    });
    let (steps, failures) = journal(dir);
    // The restored ckpt_2.pt was not evaluated again.
    assert_eq!(steps, [1, 2, 3, 4, 5, 3, 4, 5]);
    assert!(failures.is_empty(), "{failures:?}");
    let second = status(&d);
    let best = second["best_step"].as_i64().unwrap();
    assert!(best == 2 || best == 3, "{second}");
    assert_eq!(second["event"]["current_step"], 5);
    assert_ne!(second["event"]["id"], first["event"]["id"], "a new event");
    let stop: Value = serde_json::from_str(&fs::read_to_string(&stop_file).unwrap()).unwrap();
    assert_eq!(stop["id"], second["event"]["id"]);
    d.wait_for(
        Duration::from_secs(60),
        "the second early stop delivered",
        |_| receiver.accepted().len() >= 3,
    );
    let accepted = receiver.accepted();
    assert_eq!(accepted[2].1, "early_stop");
    assert_eq!(accepted[2].0, second["event"]["id"].as_str().unwrap());

    // The report keeps the abandoned branch, greyed, and marks the resume.
    let html = dir.join("report.html");
    let out = diffmon(&[
        "report",
        "--config",
        dir.join("diffmon.yaml").to_str().unwrap(),
        "--out",
        html.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let page = fs::read_to_string(&html).unwrap();
    assert!(
        page.contains("data-series=\"abandoned\""),
        "no abandoned series"
    );
    assert!(page.contains("data-marker=\"resume\""), "no resume marker");
    assert!(
        page.contains("(abandoned)"),
        "the table does not mark the branch"
    );
}

/// `diffmon resume` with the state folder on another file system (tmpfs, issue #45): the kept
/// copy comes back as a copy with the training job's mode; the later checkpoints cannot be moved
/// aside there, so it exits 1 saying what it did and what it did not, leaving the stop file and
/// the history as they were; `--keep-later` then completes it.
#[test]
fn resume_across_file_systems_does_the_whole_job_or_says_what_it_did_not() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let Ok(state) = tempfile::tempdir_in("/dev/shm") else {
        eprintln!("skipped: no /dev/shm");
        return;
    };
    if fs::metadata(dir.path()).unwrap().dev() == fs::metadata(state.path()).unwrap().dev() {
        eprintln!("skipped: /dev/shm is on the run folder's file system");
        return;
    }
    let run = dir.path();
    for f in ["model.ts", "train.h5"] {
        fs::write(run.join(f), b"").unwrap();
    }
    fs::write(
        run.join("diffmon.yaml"),
        format!(
            "run: {{dir: .}}\nstate_dir: {:?}\nmodel: {{architecture: model.ts}}\ndata: {{path: train.h5}}\n",
            state.path()
        ),
    )
    .unwrap();
    let mut lines = String::new();
    for (step, icr) in [(1, 0.9), (2, 0.5), (3, 0.7)] {
        let ck = run.join(format!("ckpt_{step}.pt"));
        fs::write(&ck, format!("weights {step}")).unwrap();
        fs::set_permissions(&ck, fs::Permissions::from_mode(0o640)).unwrap();
        let m = fs::metadata(&ck).unwrap();
        let entry = serde_json::json!({
            "kind": "evaluation",
            "key": {"path": ck.display().to_string(), "size": m.len(),
                    "mtime_ns": m.mtime() * 1_000_000_000 + m.mtime_nsec()},
            "at": "2026-01-01T00:00:00.000Z",
            "record": {"step": step, "checkpoint": ck.display().to_string(), "icr": icr,
                       "seconds": 1.0},
        });
        lines.push_str(&format!("{entry}\n"));
    }
    let journal = state.path().join("history.jsonl");
    fs::write(&journal, &lines).unwrap();
    fs::set_permissions(state.path(), fs::Permissions::from_mode(0o700)).unwrap();
    // The kept best (as keep_best leaves it: the original's mode and time), then rotation.
    let best = run.join("ckpt_2.pt");
    fs::create_dir(state.path().join("best")).unwrap();
    let kept = state.path().join("best/ckpt_2.pt");
    fs::copy(&best, &kept).unwrap();
    let f = fs::File::options().write(true).open(&kept).unwrap();
    f.set_modified(fs::metadata(&best).unwrap().modified().unwrap())
        .unwrap();
    drop(f);
    fs::remove_file(&best).unwrap();
    fs::write(run.join("EARLY_STOP"), "{}").unwrap();

    let out = resume(run, &["--step", "2"]);
    assert_eq!(out.status.code(), Some(1), "{}", stdout(&out));
    let said = stderr(&out);
    assert!(said.contains("not complete"), "{said}");
    assert!(said.contains("restored from"), "{said}");
    assert!(said.contains("cannot move ckpt_3.pt"), "{said}");
    assert!(run.join("ckpt_3.pt").exists());
    assert!(run.join("EARLY_STOP").exists(), "the stop file went");
    assert_eq!(
        fs::read_to_string(&journal).unwrap(),
        lines,
        "a resume entry"
    );
    // Restored as a copy, with the training job's mode (was 0600).
    assert_eq!(fs::read_to_string(&best).unwrap(), "weights 2");
    assert_eq!(fs::metadata(&best).unwrap().mode() & 0o777, 0o640);

    let out = resume(run, &["--step", "2", "--keep-later"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stdout(&out).contains("(in place)"), "{}", stdout(&out));
    assert!(!run.join("EARLY_STOP").exists());
}
