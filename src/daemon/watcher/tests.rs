use super::notifications::Notifications;
use super::*;
use crate::config::{Backlog, CheckpointsConfig};
use crate::metrics::Metrics;
use crate::store::history::CheckpointKey;
use crossbeam_channel::Receiver;
use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

fn config(backlog: Backlog) -> CheckpointsConfig {
    CheckpointsConfig {
        pattern: crate::config::Glob::parse("ckpt_*.pt").unwrap(),
        settle: Duration::ZERO,
        backlog,
        ..CheckpointsConfig::default()
    }
}

/// A watcher of `dir` with nothing evaluated yet, files settling for `settle_ms`.
fn watcher(dir: &Path, backlog: Backlog, settle_ms: u64) -> Watcher {
    let cfg = CheckpointsConfig {
        settle: Duration::from_millis(settle_ms),
        ..config(backlog)
    };
    Watcher::new(dir, &cfg, HashSet::new(), Arc::new(Metrics::new("t")))
}

/// Steps of everything the watcher offers now, each taken as the evaluator would.
fn take_all(w: &mut Watcher) -> Vec<i64> {
    let mut steps = Vec::new();
    while let Some(item) = w.next() {
        steps.push(item.step);
        w.taken(&item);
    }
    steps
}

fn write_checkpoint(path: &Path) {
    // A minimal valid safetensors file: header length, JSON header, no tensors.
    let header = b"{}      ";
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header);
    std::fs::write(path, bytes).unwrap();
}

#[test]
fn offers_in_step_order_and_skips_temporary_known_and_nested_files() {
    let dir = tempfile::tempdir().unwrap();
    for name in [
        "ckpt_200.pt",
        "ckpt_50.pt",
        "ckpt_100.pt",
        "ckpt_300.pt.tmp",
        ".ckpt_400.pt",
        "notes.txt",
    ] {
        write_checkpoint(&dir.path().join(name));
    }
    // Only files directly inside the run folder: not a subfolder's, not a folder.
    std::fs::create_dir(dir.path().join("sub")).unwrap();
    write_checkpoint(&dir.path().join("sub/ckpt_500.pt"));
    std::fs::create_dir(dir.path().join("ckpt_600.pt")).unwrap();
    let done = HashSet::from([CheckpointKey::of(&dir.path().join("ckpt_100.pt")).unwrap()]);
    let mut w = Watcher::new(
        dir.path(),
        &config(Backlog::All),
        done,
        Arc::new(Metrics::new("t")),
    );
    w.scan();
    assert_eq!(take_all(&mut w), vec![50, 200]);
}

/// An accelerate-style checkpoint folder: weights plus optimizer state.
fn write_folder(dir: &Path) {
    std::fs::create_dir_all(dir).unwrap();
    write_checkpoint(&dir.join("model.safetensors"));
    std::fs::write(dir.join("optimizer.bin"), b"state").unwrap();
}

#[test]
fn folders_are_checkpoints_named_by_the_folder_once_stable() {
    let dir = tempfile::tempdir().unwrap();
    for s in [200, 50] {
        write_folder(&dir.path().join(format!("checkpoint-{s}")));
    }
    // A folder without weights yet is not complete.
    std::fs::create_dir(dir.path().join("checkpoint-10")).unwrap();
    // The architecture the config names is never a checkpoint, whatever its name.
    write_checkpoint(&dir.path().join("model_1.ts"));
    let cfg = CheckpointsConfig {
        settle: Duration::from_millis(300),
        ..CheckpointsConfig::default()
    };
    let mut w = Watcher::new(
        dir.path(),
        &cfg,
        HashSet::new(),
        Arc::new(Metrics::new("t")),
    )
    .with_excluded([dir.path().join("model_1.ts")]);
    w.scan();
    assert!(w.next().is_none(), "ready before settling");
    // A file written inside a folder restarts its settle time.
    std::thread::sleep(Duration::from_millis(200));
    std::fs::write(dir.path().join("checkpoint-50/scheduler.bin"), b"s").unwrap();
    std::thread::sleep(Duration::from_millis(150));
    w.scan();
    // checkpoint-200 has settled, but waits for the older checkpoint-50, still settling.
    assert!(w.ready.keys().any(|(s, _)| *s == 200));
    assert!(w.next().is_none(), "checkpoint-200 overtook checkpoint-50");
    std::thread::sleep(Duration::from_millis(350));
    w.scan();
    let items: Vec<WorkItem> = std::iter::from_fn(|| {
        let i = w.next()?;
        w.taken(&i);
        Some(i)
    })
    .collect();
    assert_eq!(
        items.iter().map(|i| i.step).collect::<Vec<_>>(),
        vec![50, 200]
    );
    assert_eq!(items[0].path, dir.path().join("checkpoint-50"));
    assert_eq!(
        items[0].key,
        crate::store::unit::key(&items[0].path).unwrap()
    );
}

#[test]
fn entries_that_look_like_checkpoints_but_never_match_are_counted() {
    let dir = tempfile::tempdir().unwrap();
    write_folder(&dir.path().join("ckpt-step-a"));
    write_folder(&dir.path().join("run_state"));
    write_checkpoint(&dir.path().join("weights.safetensors"));
    std::fs::write(dir.path().join("notes.txt"), b"x").unwrap();
    let metrics = Arc::new(Metrics::new("t"));
    let mut w = Watcher::new(
        dir.path(),
        &config(Backlog::All),
        HashSet::new(),
        metrics.clone(),
    );
    w.scan();
    let mut names: Vec<&str> = w.ignored.iter().map(|(n, _)| n.as_str()).collect();
    names.sort();
    assert_eq!(
        names,
        vec!["ckpt-step-a/", "run_state/", "weights.safetensors"]
    );
    assert!(
        metrics
            .encode()
            .contains("diffmon_checkpoints_ignored{run=\"t\"} 3")
    );
    assert!(
        w.warned_ignored_at.is_some(),
        "no warning at the first scan"
    );
}

#[test]
fn latest_backlog_keeps_only_the_newest() {
    let dir = tempfile::tempdir().unwrap();
    for s in [10, 20, 30] {
        write_checkpoint(&dir.path().join(format!("ckpt_{s}.pt")));
    }
    let metrics = Arc::new(Metrics::new("t"));
    let mut w = Watcher::new(
        dir.path(),
        &config(Backlog::Latest),
        HashSet::new(),
        metrics.clone(),
    );
    w.scan();
    let item = w.next().unwrap();
    assert_eq!(item.step, 30);
    w.taken(&item);
    assert!(w.next().is_none());
    assert!(
        metrics
            .encode()
            .contains("diffmon_checkpoints_skipped_total{run=\"t\"} 2")
    );
}

/// A sweep's runs share one inotify instance: each folder's events reach its own watcher
/// only, and a watcher that stops takes its folder's watch with it, not the others'.
#[test]
fn runs_share_one_inotify_instance_and_get_their_own_events() {
    let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let shared = SharedNotifications::new().expect("inotify");
    let watcher = |dir: &Path| {
        Watcher::new(
            dir,
            &config(Backlog::All),
            HashSet::new(),
            Arc::new(Metrics::new("t")),
        )
        .with_notifications(Some(shared.clone()))
    };
    let (wa, wb) = (watcher(a.path()), watcher(b.path()));
    let (tx_a, rx_a) = crossbeam_channel::unbounded();
    let (tx_b, rx_b) = crossbeam_channel::unbounded();
    let na = wa.start_notifications(tx_a).expect("a watch");
    let _nb = wb.start_notifications(tx_b).expect("b watch");
    assert!(matches!(na, Notifications::Shared(_)));
    let paths = |rx: &Receiver<notify::Result<notify::Event>>| -> Vec<PathBuf> {
        std::thread::sleep(Duration::from_millis(300));
        rx.try_iter()
            .flat_map(|e| e.unwrap().paths)
            .collect::<Vec<_>>()
    };
    write_checkpoint(&a.path().join("ckpt_1.pt"));
    let got = paths(&rx_a);
    assert!(
        !got.is_empty() && got.iter().all(|p| p.starts_with(a.path())),
        "{got:?}"
    );
    assert!(paths(&rx_b).is_empty(), "b got a's events");
    write_checkpoint(&b.path().join("ckpt_1.pt"));
    assert!(!paths(&rx_b).is_empty());
    assert!(paths(&rx_a).is_empty(), "a got b's events");
    drop(na);
    write_checkpoint(&a.path().join("ckpt_2.pt"));
    write_checkpoint(&b.path().join("ckpt_2.pt"));
    assert!(
        paths(&rx_a).is_empty(),
        "a stopped watcher still gets events"
    );
    assert!(!paths(&rx_b).is_empty(), "b lost its watch with a's");
}

#[test]
fn its_own_scans_do_not_wake_it_but_a_renamed_checkpoint_does() {
    // Real inotify: a scan opens the folder, which notifies an access. Were that taken as a
    // change, every scan would trigger the next and an idle daemon would spin.
    let dir = tempfile::tempdir().unwrap();
    let mut w = watcher(dir.path(), Backlog::All, 0);
    let (tx, rx) = crossbeam_channel::unbounded();
    let _notifier = w.start_notifications(tx).expect("inotify");
    let drain = |rx: &Receiver<notify::Result<notify::Event>>| {
        std::thread::sleep(Duration::from_millis(300));
        rx.try_iter().collect::<Vec<_>>()
    };
    w.scan();
    let own = drain(&rx);
    assert!(
        !own.is_empty(),
        "the scan's own folder access was not notified"
    );
    for e in own {
        assert!(!w.on_event(e), "a scan's own access counted as a change");
    }
    let tmp = dir.path().join("ckpt_7.pt.tmp");
    write_checkpoint(&tmp);
    std::fs::rename(&tmp, dir.path().join("ckpt_7.pt")).unwrap();
    let changes: Vec<bool> = drain(&rx).into_iter().map(|e| w.on_event(e)).collect();
    assert!(
        changes.contains(&true),
        "a renamed checkpoint did not count"
    );
    w.scan();
    assert_eq!(w.next().map(|i| i.step), Some(7));
}

#[test]
fn a_renamed_checkpoint_waits_for_an_older_one_still_settling() {
    // After a restart, ckpt_1 (found by the scan) must settle; ckpt_2 arrives by rename and
    // is complete at once, but is offered only after ckpt_1.
    let dir = tempfile::tempdir().unwrap();
    write_checkpoint(&dir.path().join("ckpt_1.pt"));
    let mut w = watcher(dir.path(), Backlog::All, 300);
    w.scan();
    let renamed = dir.path().join("ckpt_2.pt");
    write_checkpoint(&renamed);
    w.renamed(&renamed);
    w.scan();
    assert!(w.next().is_none(), "ckpt_2 overtook ckpt_1");
    // ckpt_1 has settled, but its structure is checked only at the next scan: until then it
    // still holds ckpt_2 back (a restart in CI once evaluated step 5 before step 4 this way).
    std::thread::sleep(Duration::from_millis(350));
    assert!(
        w.next().is_none(),
        "ckpt_2 overtook ckpt_1, settled but not yet checked"
    );
    w.scan();
    assert_eq!(take_all(&mut w), vec![1, 2]);
}

#[test]
fn an_older_file_found_not_valid_once_settled_holds_nothing_back() {
    // ckpt_1 is not a valid container (being written in a way size and mtime do not show, or
    // corrupt): it waits for the give-up time to be recorded as a failure, and ckpt_2 goes.
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("ckpt_1.pt"), b"not yet a checkpoint").unwrap();
    write_checkpoint(&dir.path().join("ckpt_2.pt"));
    let mut w = watcher(dir.path(), Backlog::All, 100);
    w.scan();
    std::thread::sleep(Duration::from_millis(150));
    w.scan();
    assert_eq!(take_all(&mut w), vec![2]);
    // Rewritten whole, it is a candidate again and is checked afresh once it settles.
    write_checkpoint(&dir.path().join("ckpt_1.pt"));
    w.scan();
    assert!(w.next().is_none(), "offered before it settled");
    std::thread::sleep(Duration::from_millis(150));
    w.scan();
    assert_eq!(take_all(&mut w), vec![1]);
}

#[test]
fn a_corrupt_file_renamed_into_place_is_handed_over_at_once() {
    // Renamed into place means complete: an invalid container is recorded as a failure
    // now, not after the give-up time that files found by a scan get.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ckpt_9.pt");
    std::fs::write(&path, b"not a checkpoint").unwrap();
    let mut w = watcher(dir.path(), Backlog::All, 0);
    w.renamed(&path);
    w.scan();
    assert_eq!(w.next().map(|i| i.step), Some(9));
}

#[test]
fn a_growing_file_is_not_ready_until_it_settles() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ckpt_5.pt");
    write_checkpoint(&path);
    let mut w = watcher(dir.path(), Backlog::All, 300);
    w.scan();
    assert!(w.next().is_none(), "ready before settling");
    std::thread::sleep(Duration::from_millis(350));
    w.scan();
    assert_eq!(w.next().map(|i| i.step), Some(5));
}

#[test]
fn files_without_a_step_are_skipped_without_opening_them() {
    let dir = tempfile::tempdir().unwrap();
    for name in ["ckpt_best.pt", "ckpt_last.pt", "ckpt_final.pt"] {
        write_checkpoint(&dir.path().join(name));
    }
    write_checkpoint(&dir.path().join("ckpt_3.pt"));
    let mut w = watcher(dir.path(), Backlog::All, 0);
    for _ in 0..5 {
        w.scan();
    }
    assert_eq!(take_all(&mut w), vec![3]);
    for _ in 0..5 {
        w.scan();
    }
    // Only ckpt_3 was ever opened, once; the others are known by name.
    assert_eq!(w.structure_checks, 1, "files without a step were checked");
    assert_eq!(w.warned_no_step.len(), 3);
    assert!(w.candidates.is_empty());
}

#[test]
fn a_fifo_named_like_a_checkpoint_is_skipped_and_never_opened() {
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("ckpt_1.pt");
    let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o644) }, 0);
    // A link to the FIFO as well.
    std::os::unix::fs::symlink(&fifo, dir.path().join("ckpt_2.pt")).unwrap();
    write_checkpoint(&dir.path().join("ckpt_3.pt"));
    let mut w = watcher(dir.path(), Backlog::All, 0);
    // Renamed into place (as a notification would say) changes nothing.
    w.renamed(&fifo);
    for _ in 0..3 {
        w.scan();
    }
    assert_eq!(take_all(&mut w), vec![3]);
    assert_eq!(w.warned_not_regular.len(), 2);
    assert_eq!(w.structure_checks, 1);
}

/// A name that is not UTF-8 was skipped silently: now warned about once and counted in
/// `diffmon_checkpoints_ignored` (0 before), while the other checkpoints go on.
#[test]
fn a_name_that_is_not_utf8_is_counted_and_warned_about_once() {
    use std::os::unix::ffi::OsStrExt;
    let dir = tempfile::tempdir().unwrap();
    let odd = std::ffi::OsStr::from_bytes(b"ckpt_\xff\x1b[31m.pt");
    write_checkpoint(&dir.path().join(odd));
    // Hidden ones are skipped as any hidden file is.
    write_checkpoint(
        &dir.path()
            .join(std::ffi::OsStr::from_bytes(b".ckpt_\xff.pt")),
    );
    write_checkpoint(&dir.path().join("ckpt_3.pt"));
    let metrics = Arc::new(Metrics::new("t"));
    let mut w = Watcher::new(
        dir.path(),
        &config(Backlog::All),
        HashSet::new(),
        metrics.clone(),
    );
    for _ in 0..3 {
        w.scan();
    }
    assert_eq!(take_all(&mut w), vec![3]);
    assert_eq!(w.warned_not_utf8.len(), 1);
    assert_eq!(
        w.ignored,
        [(
            "ckpt_\\xff\\u{1b}[31m.pt".to_string(),
            "has a name that is not UTF-8"
        )]
    );
    let text = metrics.encode();
    assert!(
        text.contains("diffmon_checkpoints_ignored{run=\"t\"} 1"),
        "{text}"
    );
    std::fs::remove_file(dir.path().join(odd)).unwrap();
    w.scan();
    assert!(w.warned_not_utf8.is_empty(), "a gone entry is forgotten");
}

#[test]
fn a_run_folder_deleted_and_recreated_is_watched_again() {
    let base = tempfile::tempdir().unwrap();
    let dir = base.path().join("run");
    std::fs::create_dir(&dir).unwrap();
    write_checkpoint(&dir.join("ckpt_1.pt"));
    let mut w = Watcher::new(
        &dir,
        &config(Backlog::All),
        HashSet::new(),
        Arc::new(Metrics::new("t")),
    );
    w.scan();
    assert_eq!(take_all(&mut w), vec![1]);
    std::fs::remove_dir_all(&dir).unwrap();
    w.scan();
    assert_eq!(w.dir_present, Some(false));
    assert!(!dir.exists(), "the watcher re-created the run folder");
    std::fs::create_dir(&dir).unwrap();
    write_checkpoint(&dir.join("ckpt_2.pt"));
    w.scan();
    assert!(w.rewatch, "the notifications are not set up again");
    assert_eq!(take_all(&mut w), vec![2]);
}
