//! `trackers.tensorboard`: a run's evaluations and early-stop events as TensorBoard event files
//! (docs/design.md §21), in `<dir>/diffmon/<run>/`, so that `tensorboard --logdir <dir>` shows
//! them beside the training job's own runs.
//!
//! Every evaluation is one event at the checkpoint's step, its wall time the checkpoint's
//! modification time: a scalar `diffmon/<field>` per metric of the record
//! ([`crate::record::FIELDS`]), the early-stop metric's smoothed value and the evaluation's
//! seconds. An early stop or its resolution is one event at the step it was decided: the marker
//! scalar `diffmon/early_stop` (1 fired, 0 resolved) and its sentence as text. A `diffmon resume`
//! from step S is a `SessionLog` START at S + 1, on which TensorBoard drops the abandoned
//! branch.
//!
//! Each start that has something to write makes a new file, which begins with a START at the
//! largest step (it drops nothing: TensorBoard's server purges only on the STARTs after a run's
//! first), and nothing is written twice: the writer reads its own files back (bounded) and knows
//! each item it wrote by its kind, step and wall time; the history's items not among them are
//! written, in order. When an item in the middle is missing (a file deleted), or the files
//! cannot all be read back, the whole history is written again after a START at the lowest
//! step, so that the reader drops the older copy. A folder that cannot be written is a WARN
//! naming it; the items wait in memory (at most [`MAX_PENDING`]) and each later evaluation tries
//! again.

use super::event_file::{self, Event, Kind, Value, What};
use super::timeline::{
    EARLY_STOP_TAG, EARLY_STOP_TEXT_TAG, Item, SECONDS_TAG, Timeline, now, stop,
};
use crate::alerts::Event as StopEvent;
use crate::config::{EarlyStopSettings, TensorboardConfig};
use crate::engine::detector::DetectorState;
use crate::record::Evaluation;
use crate::store::history::{CheckpointKey, Entry};
use crate::store::safe_fs::untrusted;
use std::collections::{HashSet, VecDeque};
use std::ffi::CString;
use std::fs::File;
use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

/// Items that wait for a folder that cannot be written; the oldest go first beyond it.
pub const MAX_PENDING: usize = 100_000;
/// Read-back bounds: files in the run's folder, and bytes of each.
const MAX_FILES: usize = 4096;
const MAX_FILE_BYTES: u64 = 64 << 20;

/// How an item is known when read back: its kind, step and wall time (bits).
type Key = (u8, i64, u64);

fn key(item: &Item) -> Key {
    let kind = match item {
        Item::Point { .. } => 0,
        Item::Stop { .. } => 1,
        Item::Start { .. } => 2,
    };
    (kind, item.step(), item.wall_time().to_bits())
}

/// The item as TensorBoard's event (scalars as float32, as TensorBoard keeps them).
fn event_of(item: &Item) -> Event {
    let what = match item {
        Item::Point { values, .. } => What::Summary(
            values
                .iter()
                .map(|(tag, v)| (tag.clone(), Value::Scalar(*v as f32)))
                .collect(),
        ),
        Item::Stop { event, text, .. } => What::Summary(vec![
            (
                EARLY_STOP_TAG.into(),
                Value::Scalar(Item::marker(event) as f32),
            ),
            (EARLY_STOP_TEXT_TAG.into(), Value::Text(text.clone())),
        ]),
        Item::Start { .. } => What::Start,
    };
    Event {
        wall_time: item.wall_time(),
        step: item.step(),
        what,
    }
}

/// The key of an event read back, if it is one of the writer's items.
fn key_of(head: &event_file::EventHead) -> Option<Key> {
    let kind = match &head.kind {
        Kind::Summary(tags) if tags.iter().any(|t| t == SECONDS_TAG) => 0,
        Kind::Summary(tags) if tags.iter().any(|t| t == EARLY_STOP_TAG) => 1,
        Kind::SessionLog(1) if head.step != i64::MAX => 2,
        _ => return None,
    };
    Some((kind, head.step, head.wall_time.to_bits()))
}

/// The writer of one run.
pub struct Tensorboard {
    /// `<dir>`, as configured, and the run's name (its folder under `<dir>/diffmon/`).
    dir: PathBuf,
    run: String,
    /// The history's items until the replayed events are placed among them.
    timeline: Timeline,
    /// The items not written yet, in order.
    pending: VecDeque<Item>,
    /// The run's folder, once opened and read back; the open file, once something was written.
    folder: Option<OwnedFd>,
    file: Option<File>,
    /// The last problem, said once until it changes or clears.
    failing: Option<String>,
    dropped: usize,
}

impl Tensorboard {
    /// The writer of run `run`, holding the history's items (`entries`: the journal, replayed
    /// with the run's early-stop settings for the smoothed values). Nothing is written until the
    /// replayed events are placed ([`Tensorboard::replayed`]) or the next evaluation.
    pub fn open(
        config: &TensorboardConfig,
        run: &str,
        entries: &[Entry],
        early_stop: EarlyStopSettings,
    ) -> Tensorboard {
        Tensorboard {
            dir: config.dir.clone(),
            run: run.to_string(),
            timeline: Timeline::of_history(entries, early_stop),
            pending: VecDeque::new(),
            folder: None,
            file: None,
            failing: None,
            dropped: 0,
        }
    }

    /// `<dir>/diffmon/<run>`.
    pub fn folder(&self) -> PathBuf {
        self.dir.join(TensorboardConfig::FOLDER).join(&self.run)
    }

    fn push(&mut self, item: Item) {
        if self.pending.len() >= MAX_PENDING {
            self.pending.pop_front();
            self.dropped += 1;
            if self.dropped == 1 {
                tracing::warn!(folder = %untrusted(&self.folder()),
                    "trackers.tensorboard: over {MAX_PENDING} items wait for the folder; the oldest are dropped");
            }
        }
        self.pending.push_back(item);
        self.flush();
    }

    /// Writes what waits: opens the folder first if needed (reading back what earlier starts
    /// wrote). A problem is said once (WARN, naming the folder and the key) and tried again at
    /// the next item.
    fn flush(&mut self) {
        if self.pending.is_empty() && self.folder.is_some() {
            return;
        }
        let result = self.write_pending();
        match (result, &self.failing) {
            (Ok(()), Some(_)) => {
                tracing::info!(folder = %untrusted(&self.folder()), "trackers.tensorboard: writing again");
                self.failing = None;
            }
            (Ok(()), None) => {}
            (Err(e), failing) => {
                // Opened and read back again at the next item: a new file.
                self.file = None;
                self.folder = None;
                let message = e.to_string();
                if failing.as_deref() != Some(message.as_str()) {
                    tracing::warn!(folder = %untrusted(&self.folder()), waiting = self.pending.len(),
                        "trackers.tensorboard.dir: cannot write the TensorBoard events ({message}); the evaluations go on and the events wait in memory");
                    self.failing = Some(message);
                }
            }
        }
    }

    fn write_pending(&mut self) -> io::Result<()> {
        if self.folder.is_none() {
            let folder = open_run_folder(&self.dir, &self.run)?;
            let written = read_back(&folder, &self.folder());
            self.pending = to_write(std::mem::take(&mut self.pending), written.as_ref()).into();
            self.folder = Some(folder);
        }
        if self.pending.is_empty() {
            return Ok(());
        }
        if self.file.is_none() {
            let mut file = new_file(self.folder.as_ref().expect("opened above"))?;
            // The version, then a START that drops nothing: TensorBoard's server takes the
            // first START of a run as its beginning and purges only on later ones.
            for (step, what) in [(0, What::FileVersion), (i64::MAX, What::Start)] {
                let event = Event {
                    wall_time: now(),
                    step,
                    what,
                };
                file.write_all(&event_file::record(&event.encode()))?;
            }
            self.file = Some(file);
        }
        let file = self.file.as_mut().expect("opened above");
        while let Some(item) = self.pending.front() {
            file.write_all(&event_file::record(&event_of(item).encode()))?;
            self.pending.pop_front();
        }
        Ok(())
    }
}

impl super::tracker::Tracker for Tensorboard {
    /// The events the history's replay decided: each placed right after the evaluation or
    /// resume that decided it, then everything written that is not yet.
    fn replayed(&mut self, events: &[StopEvent]) {
        let mut history: VecDeque<Item> = self.timeline.place(events).into();
        history.append(&mut self.pending);
        self.pending = history;
        self.flush();
    }

    /// A live evaluation of the checkpoint `key`; `state`: the detector's after it.
    fn evaluation(&mut self, record: &Evaluation, key: &CheckpointKey, state: &DetectorState) {
        let item = self.timeline.live(record, key, state);
        self.push(item);
    }

    /// A live early stop or resolution.
    fn event(&mut self, event: &StopEvent) {
        self.push(stop(event));
    }
}

/// What of `items` to write, given the keys `written` earlier (`None`: not all of them could
/// be read back): nothing already there. When an item is missing before one that is there (a
/// gap, not a missing tail), or what is there is not known, all of them after a START at the
/// lowest step, so that TensorBoard drops the earlier copy.
fn to_write(items: VecDeque<Item>, written: Option<&HashSet<Key>>) -> Vec<Item> {
    let none = HashSet::new();
    let (complete, written) = (written.is_some(), written.unwrap_or(&none));
    let Some(first) = items.iter().position(|i| !written.contains(&key(i))) else {
        return Vec::new();
    };
    let gap = items.iter().skip(first).any(|i| written.contains(&key(i)));
    if complete && !gap {
        return items.into_iter().skip(first).collect();
    }
    let start = Item::Start {
        step: i64::MIN,
        wall_time: now(),
    };
    std::iter::once(start).chain(items).collect()
}

fn c_name(name: &str) -> io::Result<CString> {
    CString::new(name).map_err(|_| io::Error::other("a NUL in the name"))
}

/// Opens `name` in the folder `at` (or the path `name` itself with `at` `None`) as a folder,
/// creating it if it is absent; never through a symbolic link.
fn open_folder(at: Option<&OwnedFd>, name: &Path) -> io::Result<OwnedFd> {
    let c = CString::new(name.as_os_str().as_bytes())
        .map_err(|_| io::Error::other("a NUL in the path"))?;
    let dirfd = at.map_or(libc::AT_FDCWD, |fd| fd.as_raw_fd());
    let flags = libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC | libc::O_RDONLY;
    for attempt in 0..2 {
        // SAFETY: `c` is a valid NUL-terminated string; the fd is owned on success.
        let fd = unsafe { libc::openat(dirfd, c.as_ptr(), flags) };
        if fd >= 0 {
            // SAFETY: a fresh descriptor this function owns.
            return Ok(unsafe { OwnedFd::from_raw_fd(fd) });
        }
        let e = io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::ELOOP) | Some(libc::ENOTDIR) => {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!(
                        "{} is a symbolic link or not a folder: diffmon writes through no link",
                        untrusted(name)
                    ),
                ));
            }
            Some(libc::ENOENT) if attempt == 0 => {
                if at.is_none() {
                    std::fs::create_dir_all(name)?;
                } else {
                    // SAFETY: as above.
                    let rc = unsafe { libc::mkdirat(dirfd, c.as_ptr(), 0o755) };
                    if rc != 0 {
                        let e = io::Error::last_os_error();
                        if e.kind() != io::ErrorKind::AlreadyExists {
                            return Err(e);
                        }
                    }
                }
            }
            _ => return Err(e),
        }
    }
    Err(io::Error::other("the folder vanished as it was made"))
}

/// `<dir>/diffmon/<run>`, opened (made where absent) without following a link.
fn open_run_folder(dir: &Path, run: &str) -> io::Result<OwnedFd> {
    let top = open_folder(None, dir)?;
    let diffmon = open_folder(Some(&top), Path::new(TensorboardConfig::FOLDER))?;
    open_folder(Some(&diffmon), Path::new(run))
}

/// Opens `name` in `folder`: to read (a regular file, no link followed, no wait on a FIFO) or
/// to create (exclusively).
fn open_in(folder: &OwnedFd, name: &str, create: bool) -> io::Result<File> {
    let c = c_name(name)?;
    let flags = libc::O_NOFOLLOW
        | libc::O_CLOEXEC
        | if create {
            libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL
        } else {
            libc::O_RDONLY | libc::O_NONBLOCK
        };
    // SAFETY: valid fd and NUL-terminated name; the fd is owned on success.
    let fd = unsafe { libc::openat(folder.as_raw_fd(), c.as_ptr(), flags, 0o644 as libc::c_uint) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor this function owns.
    let file = unsafe { File::from_raw_fd(fd) };
    if !create && !file.metadata()?.is_file() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "not a regular file",
        ));
    }
    Ok(file)
}

/// The names of the event files in `folder` (TensorBoard's rule: `tfevents` in the name),
/// sorted; at most [`MAX_FILES`].
fn event_files(folder: &OwnedFd) -> io::Result<Vec<String>> {
    let path = format!("/proc/self/fd/{}", folder.as_raw_fd());
    let mut names: Vec<String> = std::fs::read_dir(path)?
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n.contains("tfevents"))
        .take(MAX_FILES + 1)
        .collect();
    if names.len() > MAX_FILES {
        return Err(io::Error::other(format!(
            "over {MAX_FILES} event files: not read back"
        )));
    }
    names.sort();
    Ok(names)
}

/// The keys of the items earlier starts wrote in `folder` (shown as `shown`); `None` when not
/// every file could be read (a WARN): then the whole history is written again, after a START
/// that drops what TensorBoard read of the earlier files.
fn read_back(folder: &OwnedFd, shown: &Path) -> Option<HashSet<Key>> {
    let mut keys = HashSet::new();
    let names = match event_files(folder) {
        Ok(names) => names,
        Err(e) => {
            tracing::warn!(folder = %untrusted(shown), "trackers.tensorboard: cannot list the event files ({e}); writing the history again");
            return None;
        }
    };
    let mut complete = true;
    for name in names {
        let read = open_in(folder, &name, false).and_then(|f| {
            let mut bytes = Vec::new();
            f.take(MAX_FILE_BYTES + 1).read_to_end(&mut bytes)?;
            if bytes.len() as u64 > MAX_FILE_BYTES {
                return Err(io::Error::other(format!(
                    "over {MAX_FILE_BYTES} bytes: not read"
                )));
            }
            Ok(bytes)
        });
        let bytes = match read {
            Ok(bytes) => bytes,
            Err(e) => {
                tracing::warn!(file = %untrusted(&shown.join(&name)), "trackers.tensorboard: cannot read back an event file ({e}); writing the history again");
                complete = false;
                continue;
            }
        };
        // What is readable counts, up to a corrupt record.
        let (records, error) = match event_file::records(&bytes) {
            Ok((records, _torn)) => (records, None),
            Err(e) => (Vec::new(), Some(e)),
        };
        if let Some(e) = error {
            tracing::warn!(file = %untrusted(&shown.join(&name)), "trackers.tensorboard: an event file is corrupt ({e}); writing the history again");
            complete = false;
        }
        keys.extend(
            records
                .iter()
                .filter_map(|r| event_file::decode(r).ok())
                .filter_map(|head| key_of(&head)),
        );
    }
    complete.then_some(keys)
}

/// A new event file in `folder`: `events.out.tfevents.<secs>.<host>.<pid>.diffmon`, its seconds
/// later than every file's there, so that it sorts last (TensorBoard reads a folder's files in
/// name order).
fn new_file(folder: &OwnedFd) -> io::Result<File> {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let latest = event_files(folder)?
        .iter()
        .filter_map(|n| {
            n.strip_prefix("events.out.tfevents.")?
                .split('.')
                .next()?
                .parse::<u64>()
                .ok()
        })
        .max();
    let secs = latest.map_or(now, |l| now.max(l + 1));
    let host: String = crate::store::lock::hostname()
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' {
                c
            } else {
                '_'
            }
        })
        .take(64)
        .collect();
    let name = format!(
        "events.out.tfevents.{secs:010}.{host}.{}.diffmon",
        std::process::id()
    );
    open_in(folder, &name, true)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pt(step: i64, t: f64) -> Item {
        Item::Point {
            step,
            wall_time: t,
            values: vec![(SECONDS_TAG.into(), 1.0)],
        }
    }

    #[test]
    fn only_the_missing_tail_is_written_and_a_gap_writes_everything_after_a_start() {
        let items: VecDeque<Item> = (0..5).map(|i| pt(i * 100, i as f64)).collect();
        let keys =
            |r: std::ops::Range<usize>| -> HashSet<Key> { r.map(|i| key(&items[i])).collect() };
        assert_eq!(to_write(items.clone(), Some(&keys(0..5))), []);
        assert_eq!(
            to_write(items.clone(), Some(&keys(0..3))),
            items.range(3..).cloned().collect::<Vec<_>>()
        );
        assert_eq!(
            to_write(items.clone(), Some(&HashSet::new())),
            Vec::from(items.clone())
        );
        // Not all read back: everything, after a START that drops the rest.
        let unknown = to_write(items.clone(), None);
        assert!(
            matches!(unknown[0], Item::Start { step: i64::MIN, .. }),
            "{unknown:?}"
        );
        assert_eq!(unknown[1..], Vec::from(items.clone()));
        let mut gap = keys(0..5);
        gap.remove(&key(&items[1]));
        let out = to_write(items.clone(), Some(&gap));
        assert!(
            matches!(out[0], Item::Start { step: i64::MIN, .. }),
            "{out:?}"
        );
        assert_eq!(out[1..], Vec::from(items));
    }

    /// An item read back is known by the same key it was written with.
    #[test]
    fn items_are_known_again_when_read_back() {
        let stop = stop(&crate::trackers::timeline::tests::event(
            7,
            "2026-01-01T00:00:02.000Z",
        ));
        for item in [
            pt(5, 1.25),
            stop,
            Item::Start {
                step: 9,
                wall_time: 2.0,
            },
        ] {
            let head = event_file::decode(&event_of(&item).encode()).unwrap();
            assert_eq!(key_of(&head), Some(key(&item)), "{item:?}");
        }
    }

    #[test]
    fn a_symlinked_folder_is_refused_naming_it() {
        let tmp = tempfile::tempdir().unwrap();
        let real = tmp.path().join("real");
        std::fs::create_dir(&real).unwrap();
        std::os::unix::fs::symlink(&real, tmp.path().join("logs")).unwrap();
        let e = open_run_folder(&tmp.path().join("logs"), "r").unwrap_err();
        assert!(e.to_string().contains("symbolic link"), "{e}");
        // Below the configured folder too.
        std::fs::create_dir(tmp.path().join("top")).unwrap();
        std::os::unix::fs::symlink(&real, tmp.path().join("top/diffmon")).unwrap();
        let e = open_run_folder(&tmp.path().join("top"), "r").unwrap_err();
        assert!(e.to_string().contains("symbolic link"), "{e}");
        assert_eq!(
            std::fs::read_dir(&real).unwrap().count(),
            0,
            "nothing written through a link"
        );
        // A missing folder is made, with the run's below it.
        open_run_folder(&tmp.path().join("new/logs"), "r").unwrap();
        assert!(tmp.path().join("new/logs/diffmon/r").is_dir());
    }

    #[test]
    fn each_new_file_sorts_after_the_ones_there() {
        let tmp = tempfile::tempdir().unwrap();
        let folder = open_run_folder(tmp.path(), "r").unwrap();
        let later = now() as u64 + 1000;
        let planted = format!("events.out.tfevents.{later}.h.1.diffmon");
        std::fs::write(tmp.path().join("diffmon/r").join(&planted), b"").unwrap();
        new_file(&folder).unwrap();
        let names = event_files(&folder).unwrap();
        assert_eq!(names.len(), 2);
        assert_eq!(names[0], planted);
        let want = format!("events.out.tfevents.{}.", later + 1);
        assert!(names[1].starts_with(&want), "{names:?}");
    }
}
