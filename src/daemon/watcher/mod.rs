//! Finds complete checkpoints in `run.dir` and hands them to the evaluator in step order.
//!
//! A checkpoint is a *unit* ([`crate::store::unit`]): a file or a folder directly in `run.dir` whose
//! name matches `checkpoints.pattern` and holds a step; the files the config names never match.
//! Filesystem notifications (inotify) wake the watcher early; a periodic rescan every
//! `checkpoints.poll_secs` finds units where notifications are silent (NFS, Lustre) or switched
//! off. A unit is complete when it was renamed into place, or when its key (size and mtime; for
//! a folder, over its whole tree) has been stable for `checkpoints.settle_secs`; in both cases
//! its weights must be there and their container structure valid. A unit that stays invalid
//! long after it stopped changing is handed over anyway, so the evaluator records it as a
//! failure instead of waiting forever.
//!
//! Never silent: while nothing has been found, entries that look like checkpoints but are
//! skipped (no match for the pattern, no step, not a regular file) are named in a warning at
//! the first scan and then once a minute, and counted in `diffmon_checkpoints_ignored`.
//!
//! Work is offered on a rendezvous channel: the evaluator takes an item only when it is idle, so
//! the watcher always offers the best next one: the lowest pending step (`backlog: all`) or the
//! newest (`backlog: latest`, which drops the older pending ones and counts them as skipped).
//!
//! The structure check opens a unit before it is ever evaluated, so it is guarded like an
//! evaluation ([`crate::store::crash::ThreadMarker`]): while the watcher checks a unit, a fatal signal
//! or a panic on its thread writes that unit to `<state_dir>/crash-scan`; after the restart the
//! unit is recorded as a `crashed` failure and never opened again, so a file that kills the
//!
//! The files: `offer.rs` (the [`Watcher`], its thread, and the item it offers next),
//! `scan.rs` (listing the folder: which entries are units, when a unit is complete, the
//! warnings about skipped entries) and `notifications.rs` (inotify, a run's own or a sweep's
//! shared instance).

mod notifications;
mod offer;
mod scan;
#[cfg(test)]
mod tests;

pub use notifications::SharedNotifications;
pub use offer::{Watcher, WorkItem, work_channel};
