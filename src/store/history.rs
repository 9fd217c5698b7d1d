//! The evaluation history (docs/design.md §13), durable across a crash at any moment.
//!
//! The source of truth is an append-only journal, `<state_dir>/history.jsonl`: one JSON line per
//! evaluation (or per checkpoint that could not be evaluated; or a `resume`, which starts a new
//! segment: docs/design.md §9), written and `fsync`ed before anything else acts on it. A kill can leave at most a torn last line, which the next start
//! drops; an append that fails (a full disk) is cut back to the complete lines, so the journal
//! stays readable and the caller can try the same entry again. `<state_dir>/history.h5` is
//! regenerated from the journal by [`History::write_hdf5`] once it misses evaluations, written
//! to a temporary file and renamed into place, so readers (h5py) always see a complete file:
//! group `/evaluations` with one 1-D dataset per scalar field (`step`, `segment`, each field of
//! `record::FIELDS` with NaN, or [`ABSENT_INT`], where a metric was not computed, and `seconds`),
//! `checkpoint` as strings, and the ICR spectra in `icr_eigenvalues` `[rows, d]`. `diffmon
//! report` reads the journal beside a running daemon without changing it ([`History::read`]).

use crate::record::{Evaluation, FIELDS, Get};
use serde::{Deserialize, Serialize};
use std::collections::HashSet;
use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum HistoryError {
    #[error("{path}: {message}")]
    Io { path: PathBuf, message: String },
}

/// Identifies one version of a checkpoint file: the same path rewritten is a new checkpoint.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct CheckpointKey {
    pub path: String,
    pub size: u64,
    pub mtime_ns: i64,
}

impl CheckpointKey {
    /// The key of the file as it is now on disk (links followed); an error for anything but a
    /// regular file.
    pub fn of(path: &Path) -> std::io::Result<CheckpointKey> {
        let meta = std::fs::metadata(path)?;
        if !meta.is_file() {
            return Err(std::io::Error::other("not a regular file"));
        }
        let mtime = meta.modified()?;
        let mtime_ns = match mtime.duration_since(std::time::UNIX_EPOCH) {
            Ok(d) => d.as_nanos() as i64,
            Err(e) => -(e.duration().as_nanos() as i64),
        };
        Ok(CheckpointKey {
            path: path.display().to_string(),
            size: meta.len(),
            mtime_ns,
        })
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Entry {
    Evaluation {
        key: CheckpointKey,
        /// RFC 3339 time the evaluation finished.
        at: String,
        record: Box<Evaluation>,
    },
    Failure {
        key: CheckpointKey,
        at: String,
        step: i64,
        reason: String,
        message: String,
    },
    /// `diffmon resume`: training went back to the checkpoint of `step`, and the entries after
    /// this one are a new segment of the history (docs/design.md §9, "Resume").
    Resume {
        at: String,
        /// The step training resumed from, and the checkpoint (as the records name it).
        step: i64,
        checkpoint: String,
        /// The unit `diffmon resume` restored from the kept copy, as it was on disk then: it is
        /// the checkpoint already evaluated, so the watcher takes it as done.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        restored: Option<CheckpointKey>,
        /// Where the checkpoints of the abandoned branch (steps after `step`) were moved.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        set_aside: Vec<String>,
    },
}

impl Entry {
    /// The checkpoint version the entry records (`None` for a resume).
    pub fn key(&self) -> Option<&CheckpointKey> {
        match self {
            Entry::Evaluation { key, .. } | Entry::Failure { key, .. } => Some(key),
            Entry::Resume { .. } => None,
        }
    }

    /// The checkpoint version the entry makes done for the watcher: the one recorded, or the
    /// one a resume restored.
    pub fn done(&self) -> Option<&CheckpointKey> {
        match self {
            Entry::Resume { restored, .. } => restored.as_ref(),
            _ => self.key(),
        }
    }
}

/// The segment (1, 2, …) of each entry of a journal: a resume starts the next one.
pub fn segments(entries: &[Entry]) -> impl Iterator<Item = (u32, &Entry)> {
    entries.iter().scan(1u32, |segment, e| {
        if matches!(e, Entry::Resume { .. }) {
            *segment += 1;
        }
        Some((*segment, e))
    })
}

pub struct History {
    dir: PathBuf,
    journal: File,
    entries: Vec<Entry>,
    keys: HashSet<CheckpointKey>,
    /// Length of the journal's complete lines.
    len: u64,
    /// A failed append left bytes after `len` that could not be cut yet.
    torn: bool,
    /// `history.h5` misses evaluations of the journal.
    hdf5_stale: bool,
}

pub const JOURNAL: &str = "history.jsonl";
/// Where journal lines that are not entries are kept, appended, when they are removed from the
/// journal (in the state folder).
pub const JOURNAL_CORRUPT: &str = "history.jsonl.corrupt";
pub const HDF5: &str = "history.h5";

impl History {
    /// The state folder it is in.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Opens (or creates) the history in `state_dir`, reading the journal back. `history.h5` is
    /// left to [`History::write_hdf5`], so a full disk does not stop a start.
    pub fn open(state_dir: &Path) -> Result<History, HistoryError> {
        let io = |path: &Path, e: std::io::Error| HistoryError::Io {
            path: path.to_path_buf(),
            message: e.to_string(),
        };
        crate::store::safe_fs::create_private_dir(state_dir).map_err(|e| io(state_dir, e))?;
        crate::store::safe_fs::remove_leftover_temps(state_dir, HDF5);
        crate::store::safe_fs::remove_leftover_temps(state_dir, JOURNAL);
        let path = state_dir.join(JOURNAL);
        let (entries, good_len, repairs) = if path.exists() {
            read_journal(&path)?
        } else {
            (Vec::new(), 0, Repairs::default())
        };
        repairs.log(&path);
        // Lines that are not entries leave the journal only once they are kept aside.
        let repaired = repairs.changed() && repairs.set_aside(state_dir);
        let journal =
            crate::store::safe_fs::open_private_append(&path).map_err(|e| io(&path, e))?;
        journal.set_len(good_len).map_err(|e| io(&path, e))?;
        if journal.metadata().is_ok_and(|m| m.mode() & 0o077 != 0) {
            // Made 0644 by earlier versions.
            use std::os::unix::fs::PermissionsExt;
            journal
                .set_permissions(std::fs::Permissions::from_mode(0o600))
                .map_err(|e| io(&path, e))?;
        }
        let keys = entries.iter().filter_map(|e| e.done().cloned()).collect();
        let mut history = History {
            dir: state_dir.to_path_buf(),
            journal,
            entries,
            keys,
            len: good_len,
            torn: false,
            hdf5_stale: true,
        };
        if repaired {
            // Written back without the dropped lines, so the next start has nothing to repair.
            history.rewrite_journal()?;
        }
        Ok(history)
    }

    /// Writes the journal anew from the entries in memory (exclusive temporary file, then
    /// rename) and appends to the new file from now on.
    fn rewrite_journal(&mut self) -> Result<(), HistoryError> {
        let path = self.dir.join(JOURNAL);
        let io = |e: std::io::Error| HistoryError::Io {
            path: path.clone(),
            message: e.to_string(),
        };
        let mut text = String::new();
        for e in &self.entries {
            text.push_str(&serde_json::to_string(e).expect("entries serialize"));
            text.push('\n');
        }
        crate::store::safe_fs::atomic_write(&path, text.as_bytes()).map_err(io)?;
        self.journal = OpenOptions::new()
            .append(true)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&path)
            .map_err(io)?;
        self.len = text.len() as u64;
        self.torn = false;
        Ok(())
    }

    /// Was the journal file deleted under the daemon (`run.dir` or the state folder removed)?
    /// Appends would go to a file nobody can see.
    fn journal_deleted(&self) -> bool {
        self.journal.metadata().is_ok_and(|m| m.nlink() == 0)
    }

    /// Re-creates the state folder and the journal from the entries in memory after they were
    /// deleted. The folder's parent must exist: the daemon never re-creates `run.dir` itself (the
    /// training job does), so until it is back this fails and the caller retries.
    fn recreate(&mut self) -> Result<(), HistoryError> {
        let journal = self.dir.join(JOURNAL);
        let parent = crate::store::safe_fs::parent(&self.dir);
        if !parent.is_dir() {
            return Err(HistoryError::Io {
                path: journal,
                message: format!(
                    "the journal was deleted and its folder's parent {} is gone; waiting for it to come back",
                    crate::store::safe_fs::untrusted(parent)
                ),
            });
        }
        crate::store::safe_fs::create_private_dir(&self.dir).map_err(|e| HistoryError::Io {
            path: self.dir.clone(),
            message: e.to_string(),
        })?;
        self.rewrite_journal()?;
        self.hdf5_stale = true;
        tracing::warn!(journal = %crate::store::safe_fs::untrusted(&journal), entries = self.entries.len(), "journal re-created from the entries in memory; history.h5 follows");
        Ok(())
    }

    /// The entries of the journal in `state_dir`, read without changing anything (a torn last
    /// line, from a kill or from a daemon writing it right now, is left out). For readers beside
    /// a running daemon, such as `diffmon report`.
    pub fn read(state_dir: &Path) -> Result<Vec<Entry>, HistoryError> {
        let path = state_dir.join(JOURNAL);
        let (entries, _, repairs) = read_journal(&path)?;
        if !repairs.corrupt.is_empty() {
            tracing::warn!(journal = %crate::store::safe_fs::untrusted(&path), lines = %corrupt_lines(&repairs.corrupt), "journal lines that are not entries skipped");
        }
        Ok(entries)
    }

    pub fn entries(&self) -> &[Entry] {
        &self.entries
    }

    /// The evaluation records, in evaluation order.
    pub fn evaluations(&self) -> impl Iterator<Item = &Evaluation> {
        self.entries.iter().filter_map(|e| match e {
            Entry::Evaluation { record, .. } => Some(record.as_ref()),
            _ => None,
        })
    }

    /// Was this version of the checkpoint already evaluated (or found broken)?
    pub fn contains(&self, key: &CheckpointKey) -> bool {
        self.keys.contains(key)
    }

    /// Appends an entry to the journal durably (written and `fsync`ed). On failure the journal
    /// is cut back to its complete lines and the entry is not in the history: the caller may try
    /// it again later.
    pub fn append(&mut self, entry: Entry) -> Result<(), HistoryError> {
        let path = self.dir.join(JOURNAL);
        let io = |e: std::io::Error| HistoryError::Io {
            path: path.clone(),
            message: e.to_string(),
        };
        if self.journal_deleted() {
            tracing::error!(journal = %crate::store::safe_fs::untrusted(&path), "the history journal was deleted (was run.dir or the state folder removed?); re-creating it from the {} entries in memory", self.entries.len());
            self.recreate()?;
        }
        if self.torn {
            self.journal.set_len(self.len).map_err(io)?;
            self.torn = false;
        }
        let mut line = serde_json::to_string(&entry).expect("entries serialize");
        line.push('\n');
        let written = self
            .journal
            .write_all(line.as_bytes())
            .and_then(|_| self.journal.sync_data());
        if let Err(e) = written {
            // Part of the line may be in the file (a disk filling up mid-write).
            self.torn = self.journal.set_len(self.len).is_err();
            return Err(io(e));
        }
        self.len += line.len() as u64;
        if let Some(key) = entry.done() {
            self.keys.insert(key.clone());
        }
        self.hdf5_stale |= matches!(entry, Entry::Evaluation { .. });
        self.entries.push(entry);
        Ok(())
    }

    /// Does `history.h5` miss evaluations of the journal?
    pub fn hdf5_stale(&self) -> bool {
        self.hdf5_stale
    }

    /// Rewrites `history.h5` from the journal if it misses evaluations (temporary file, then
    /// rename). On failure the temporary file is removed and the next call tries again.
    pub fn write_hdf5(&mut self) -> Result<(), HistoryError> {
        if !self.hdf5_stale {
            return Ok(());
        }
        let path = self.dir.join(HDF5);
        let io = |path: &Path, e: std::io::Error| HistoryError::Io {
            path: path.to_path_buf(),
            message: e.to_string(),
        };
        // The temporary file is created exclusively (O_EXCL|O_NOFOLLOW) under a random name;
        // HDF5 then opens it again by path. That path cannot be swapped for a link in between:
        // its name is unpredictable and the state folder is the daemon's own (mode 0700), and
        // `persist` checks that the file renamed into place is still the one created here.
        let (file, tmp) = crate::store::safe_fs::temp_file(&path).map_err(|e| io(&path, e))?;
        let (segments, records): (Vec<u32>, Vec<&Evaluation>) = segments(&self.entries)
            .filter_map(|(segment, e)| match e {
                Entry::Evaluation { record, .. } => Some((segment, record.as_ref())),
                _ => None,
            })
            .unzip();
        let written = write_hdf5(&tmp, &records, &segments)
            .map_err(|e| HistoryError::Io {
                path: tmp.clone(),
                message: e.to_string(),
            })
            .and_then(|_| {
                crate::store::safe_fs::persist(&file, &tmp, &path).map_err(|e| io(&path, e))
            });
        if written.is_err() {
            let _ = std::fs::remove_file(&tmp);
        } else {
            self.hdf5_stale = false;
        }
        written
    }
}

/// Lines of a journal that reading it dropped or noticed (1-based line numbers).
#[derive(Debug, Default, PartialEq)]
struct Repairs {
    /// Blank lines, skipped.
    blank: Vec<usize>,
    /// (line, line of the first entry for the same checkpoint version): dropped, the first kept.
    duplicates: Vec<(usize, usize)>,
    /// Evaluations with a lower step than an evaluation before them: kept (a checkpoint that
    /// arrived late is evaluated after newer ones).
    out_of_order: Vec<usize>,
    /// (line, why, the line's bytes): lines that are not entries (garbage, a line cut short
    /// and followed by others), skipped; set aside in [`JOURNAL_CORRUPT`] and removed.
    corrupt: Vec<(usize, String, Vec<u8>)>,
}

impl Repairs {
    fn changed(&self) -> bool {
        !self.blank.is_empty() || !self.duplicates.is_empty() || !self.corrupt.is_empty()
    }

    /// Appends the corrupt lines to [`JOURNAL_CORRUPT`] in `state_dir` (never through a link)
    /// and syncs it; whether the journal may now drop them. When they cannot be kept there they
    /// stay in the journal, skipped again at the next start, and nothing is rewritten.
    fn set_aside(&self, state_dir: &Path) -> bool {
        if self.corrupt.is_empty() {
            return true;
        }
        let path = state_dir.join(JOURNAL_CORRUPT);
        let written = crate::store::safe_fs::open_private_append(&path).and_then(|mut f| {
            for (_, _, bytes) in &self.corrupt {
                f.write_all(bytes)?;
                if !bytes.ends_with(b"\n") {
                    f.write_all(b"\n")?;
                }
            }
            f.sync_all()
        });
        match written {
            Ok(()) => true,
            Err(e) => {
                tracing::error!(file = %crate::store::safe_fs::untrusted(&path), "cannot keep the unreadable journal lines aside ({e}); they stay in the journal and are skipped at each start");
                false
            }
        }
    }

    fn log(&self, path: &Path) {
        let journal = crate::store::safe_fs::untrusted(path);
        if let Some((first, why, _)) = self.corrupt.first() {
            tracing::warn!(%journal, lines = %corrupt_lines(&self.corrupt), "journal lines that are not entries skipped (line {first}: {}); kept in {JOURNAL_CORRUPT} and removed from the journal", crate::store::safe_fs::untrusted_text(why));
        }
        if !self.blank.is_empty() {
            tracing::warn!(%journal, lines = ?self.blank, "blank journal lines skipped (and removed from the journal)");
        }
        if !self.duplicates.is_empty() {
            let pairs: Vec<String> = self
                .duplicates
                .iter()
                .map(|(l, first)| format!("{l} (same checkpoint as line {first})"))
                .collect();
            tracing::warn!(%journal, lines = %pairs.join(", "), "duplicate journal lines dropped: the first entry of each checkpoint version is kept (repaired in the journal)");
        }
        if !self.out_of_order.is_empty() {
            tracing::info!(%journal, lines = ?self.out_of_order, "journal evaluations with a lower step than an earlier one (checkpoints that arrived late); kept, in evaluation order");
        }
    }
}

/// The line numbers of corrupt lines, for a log: the first 20, then how many more.
fn corrupt_lines(corrupt: &[(usize, String, Vec<u8>)]) -> String {
    let mut text: Vec<String> = corrupt
        .iter()
        .take(20)
        .map(|(l, _, _)| l.to_string())
        .collect();
    if corrupt.len() > 20 {
        text.push(format!("and {} more", corrupt.len() - 20));
    }
    text.join(", ")
}

/// The longest journal line read as an entry (an entry is a few kilobytes).
const MAX_LINE: usize = 1 << 20;

/// The complete lines of a journal, their length in bytes (a torn last line is dropped), and
/// what was repaired: blank lines and lines that are not entries are skipped, and a second entry
/// for the same checkpoint version is dropped (the first is kept).
fn read_journal(path: &Path) -> Result<(Vec<Entry>, u64, Repairs), HistoryError> {
    let io = |e: std::io::Error| HistoryError::Io {
        path: path.to_path_buf(),
        message: e.to_string(),
    };
    // No link followed, no FIFO waited on, a regular file; each line read bounded below.
    let file = crate::store::safe_fs::open_regular(path).map_err(io)?;
    let mut reader = BufReader::new(file);
    let mut entries = Vec::new();
    let mut repairs = Repairs::default();
    let mut first_line: std::collections::HashMap<CheckpointKey, usize> = Default::default();
    let mut max_step: Option<i64> = None;
    let mut good_len = 0u64;
    let mut line = Vec::new();
    let mut number = 0;
    loop {
        line.clear();
        let n = (&mut reader)
            .take(MAX_LINE as u64 + 1)
            .read_until(b'\n', &mut line)
            .map_err(io)?;
        if n == 0 {
            break;
        }
        number += 1;
        if n > MAX_LINE && !line.ends_with(b"\n") {
            // No entry is this long: skipped to its end, unkept, as a line that is not one.
            let mut skipped = n as u64;
            let ended = loop {
                line.clear();
                let m = (&mut reader)
                    .take(1 << 20)
                    .read_until(b'\n', &mut line)
                    .map_err(io)?;
                skipped += m as u64;
                if m == 0 || line.ends_with(b"\n") {
                    break m > 0;
                }
            };
            if !ended {
                tracing::warn!(journal = %path.display(), line = number, "dropping an incomplete last journal line");
                break;
            }
            good_len += skipped;
            repairs.corrupt.push((
                number,
                format!("longer than {MAX_LINE} bytes ({skipped}): not an entry"),
                Vec::new(),
            ));
            continue;
        }
        if !line.ends_with(b"\n") {
            // A torn last line from a kill mid-write.
            tracing::warn!(journal = %path.display(), line = number, "dropping an incomplete last journal line");
            break;
        }
        good_len += n as u64;
        if line.trim_ascii().is_empty() {
            repairs.blank.push(number);
            continue;
        }
        let entry: Entry = match serde_json::from_slice(&line) {
            Ok(entry) => entry,
            Err(e) => {
                repairs.corrupt.push((number, e.to_string(), line.clone()));
                continue;
            }
        };
        if let Some(key) = entry.key() {
            if let Some(&first) = first_line.get(key) {
                repairs.duplicates.push((number, first));
                continue;
            }
            first_line.insert(key.clone(), number);
        }
        match &entry {
            Entry::Evaluation { record, .. } => {
                if max_step.is_some_and(|m| record.step < m) {
                    repairs.out_of_order.push(number);
                }
                max_step = Some(max_step.map_or(record.step, |m| m.max(record.step)));
            }
            // A new segment starts from a lower step.
            Entry::Resume { .. } => max_step = None,
            Entry::Failure { .. } => {}
        }
        entries.push(entry);
    }
    Ok((entries, good_len, repairs))
}

/// What an int64 column holds where the record does not have the field (also the dataset's
/// fill value); float64 columns hold NaN.
pub const ABSENT_INT: i64 = -1;

/// `segments`: the history segment of each record (1 until the first resume).
fn write_hdf5(path: &Path, records: &[&Evaluation], segments: &[u32]) -> hdf5::Result<()> {
    let file = hdf5::File::create(path)?;
    let group = file.create_group("evaluations")?;
    let steps: Vec<i64> = records.iter().map(|r| r.step).collect();
    group
        .new_dataset_builder()
        .with_data(&steps)
        .create("step")?;
    group
        .new_dataset_builder()
        .with_data(segments)
        .create("segment")?;
    let names: Vec<hdf5::types::VarLenUnicode> = records
        .iter()
        .map(|r| {
            r.checkpoint
                .parse()
                .expect("checkpoint names have no NUL byte")
        })
        .collect();
    group
        .new_dataset_builder()
        .with_data(&names)
        .create("checkpoint")?;
    for field in &FIELDS {
        match field.get {
            Get::Float(get) => {
                let column: Vec<f64> = records.iter().map(|r| get(r).unwrap_or(f64::NAN)).collect();
                group
                    .new_dataset_builder()
                    .with_data(&column)
                    .create(field.name)?;
            }
            Get::Int(get) => {
                let column: Vec<i64> = records
                    .iter()
                    .map(|r| get(r).unwrap_or(ABSENT_INT))
                    .collect();
                group
                    .new_dataset_builder()
                    .fill_value(ABSENT_INT)
                    .with_data(&column)
                    .create(field.name)?;
            }
        }
    }
    let seconds: Vec<f64> = records.iter().map(|r| r.seconds).collect();
    group
        .new_dataset_builder()
        .with_data(&seconds)
        .create("seconds")?;
    let d = records
        .iter()
        .filter_map(|r| r.icr_eigenvalues.as_ref().map(Vec::len))
        .max()
        .unwrap_or(0);
    let mut spectra = ndarray::Array2::<f64>::from_elem((records.len(), d), f64::NAN);
    for (i, r) in records.iter().enumerate() {
        for (j, v) in r.icr_eigenvalues.iter().flatten().enumerate() {
            spectra[[i, j]] = *v;
        }
    }
    group
        .new_dataset_builder()
        .with_data(&spectra)
        .create("icr_eigenvalues")?;
    file.close()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(step: i64, icr: Option<f64>) -> Entry {
        Entry::Evaluation {
            key: CheckpointKey {
                path: format!("/r/ckpt_{step}.pt"),
                size: 10,
                mtime_ns: step,
            },
            at: "2026-01-01T00:00:00Z".into(),
            record: Box::new(Evaluation {
                step,
                checkpoint: format!("/r/ckpt_{step}.pt"),
                icr,
                icr_eigenvalues: icr.map(|v| vec![v, 2.0 * v]),
                seconds: 1.0,
                ..Evaluation::default()
            }),
        }
    }

    /// A resume entry survives a reopen, makes its restored checkpoint done without being a
    /// duplicate of its evaluation (a file restored by a hard link has the same key), is no
    /// out-of-order line for the lower steps after it, and numbers the segments of
    /// `history.h5`.
    #[test]
    fn a_resume_starts_a_segment_and_its_restored_checkpoint_is_done() {
        let dir = tempfile::tempdir().unwrap();
        let mut h = History::open(dir.path()).unwrap();
        for step in [50, 100, 150] {
            h.append(entry(step, Some(0.5))).unwrap();
        }
        let restored = entry(50, None).key().unwrap().clone();
        let resume = Entry::Resume {
            at: "2026-01-02T00:00:00Z".into(),
            step: 50,
            checkpoint: "/r/ckpt_50.pt".into(),
            restored: Some(restored.clone()),
            set_aside: vec!["/s/set-aside/segment-1/ckpt_100.pt".into()],
        };
        h.append(resume.clone()).unwrap();
        let mut again = entry(100, Some(0.4));
        if let Entry::Evaluation { key, .. } = &mut again {
            key.mtime_ns = 1000; // checkpoint-100 of the new branch
        }
        h.append(again).unwrap();
        drop(h);
        let (_, _, repairs) = read_journal(&dir.path().join(JOURNAL)).unwrap();
        assert_eq!(repairs, Repairs::default(), "nothing to repair");
        let mut h = History::open(dir.path()).unwrap();
        assert_eq!(h.entries()[3], resume);
        assert!(h.contains(&restored));
        let segments: Vec<u32> = segments(h.entries()).map(|(s, _)| s).collect();
        assert_eq!(segments, [1, 1, 1, 2, 2]);
        h.write_hdf5().unwrap();
        let file = hdf5::File::open(dir.path().join(HDF5)).unwrap();
        let g = file.group("evaluations").unwrap();
        assert_eq!(
            g.dataset("step").unwrap().read_raw::<i64>().unwrap(),
            [50, 100, 150, 100]
        );
        assert_eq!(
            g.dataset("segment").unwrap().read_raw::<u32>().unwrap(),
            [1, 1, 1, 2]
        );
    }

    #[test]
    fn read_leaves_a_torn_line_in_place_for_the_writer() {
        let dir = tempfile::tempdir().unwrap();
        let mut h = History::open(dir.path()).unwrap();
        h.append(entry(50, Some(0.5))).unwrap();
        // A daemon in the middle of writing the next line.
        let journal = dir.path().join(JOURNAL);
        let mut f = OpenOptions::new().append(true).open(&journal).unwrap();
        f.write_all(b"{\"kind\":\"evaluation\",").unwrap();
        let len = std::fs::metadata(&journal).unwrap().len();
        let entries = History::read(dir.path()).unwrap();
        assert_eq!(entries.len(), 1);
        assert_eq!(entries[0], entry(50, Some(0.5)));
        assert_eq!(
            std::fs::metadata(&journal).unwrap().len(),
            len,
            "read changed the journal"
        );
    }

    #[test]
    fn appends_survive_reopen_and_a_torn_line_is_dropped() {
        let dir = tempfile::tempdir().unwrap();
        let mut h = History::open(dir.path()).unwrap();
        h.append(entry(50, Some(0.5))).unwrap();
        h.append(entry(100, None)).unwrap();
        drop(h);
        // A kill in the middle of the third line.
        let mut f = OpenOptions::new()
            .append(true)
            .open(dir.path().join(JOURNAL))
            .unwrap();
        f.write_all(b"{\"kind\":\"evaluation\",\"key\":{\"pa")
            .unwrap();
        drop(f);
        let mut h = History::open(dir.path()).unwrap();
        assert_eq!(h.entries().len(), 2);
        assert!(h.contains(entry(50, None).key().unwrap()));
        h.append(entry(150, Some(0.4))).unwrap();
        drop(h);
        let mut h = History::open(dir.path()).unwrap();
        let steps: Vec<i64> = h.evaluations().map(|r| r.step).collect();
        assert_eq!(steps, vec![50, 100, 150]);
        assert!(h.hdf5_stale());
        h.write_hdf5().unwrap();
        assert!(!h.hdf5_stale());
        assert!(!dir.path().join(format!("{HDF5}.tmp")).exists());

        let file = hdf5::File::open(dir.path().join(HDF5)).unwrap();
        let g = file.group("evaluations").unwrap();
        assert_eq!(
            g.dataset("step").unwrap().read_raw::<i64>().unwrap(),
            vec![50, 100, 150]
        );
        let icr = g.dataset("icr").unwrap().read_raw::<f64>().unwrap();
        assert_eq!(icr[0], 0.5);
        assert!(icr[1].is_nan());
        let spectra = g.dataset("icr_eigenvalues").unwrap();
        assert_eq!(spectra.shape(), vec![3, 2]);
        let names = g
            .dataset("checkpoint")
            .unwrap()
            .read_raw::<hdf5::types::VarLenUnicode>()
            .unwrap();
        assert_eq!(names[2].as_str(), "/r/ckpt_150.pt");
    }

    /// Every field of the table has its column, of its type: the value of a full record, and
    /// NaN (float64) or [`ABSENT_INT`] (int64) for a record without it.
    #[test]
    fn every_field_of_the_table_has_its_hdf5_column() {
        let dir = tempfile::tempdir().unwrap();
        let mut h = History::open(dir.path()).unwrap();
        let full = crate::record::full_record();
        let empty = Evaluation {
            step: 200,
            checkpoint: "/r/empty.pt".into(),
            ..Evaluation::default()
        };
        for (k, r) in [&full, &empty].into_iter().enumerate() {
            h.append(Entry::Evaluation {
                key: CheckpointKey {
                    path: r.checkpoint.clone(),
                    size: 1,
                    mtime_ns: k as i64,
                },
                at: "2026-01-01T00:00:00Z".into(),
                record: Box::new(r.clone()),
            })
            .unwrap();
        }
        h.write_hdf5().unwrap();
        let file = hdf5::File::open(dir.path().join(HDF5)).unwrap();
        let g = file.group("evaluations").unwrap();
        let mut want: Vec<&str> = FIELDS.iter().map(|f| f.name).collect();
        want.extend([
            "step",
            "segment",
            "checkpoint",
            "seconds",
            "icr_eigenvalues",
        ]);
        want.sort();
        assert_eq!(g.member_names().unwrap(), want);
        for f in &FIELDS {
            let d = g.dataset(f.name).unwrap();
            match f.get {
                Get::Float(get) => {
                    assert!(d.dtype().unwrap().is::<f64>(), "{}", f.name);
                    let v = d.read_raw::<f64>().unwrap();
                    assert_eq!(v[0], get(&full).unwrap(), "{}", f.name);
                    assert!(v[1].is_nan(), "{}: {}", f.name, v[1]);
                }
                Get::Int(get) => {
                    assert!(d.dtype().unwrap().is::<i64>(), "{}", f.name);
                    let v = d.read_raw::<i64>().unwrap();
                    assert_eq!(v, [get(&full).unwrap(), ABSENT_INT], "{}", f.name);
                    let fill = d.dcpl().unwrap().fill_value_as::<i64>();
                    assert_eq!(fill, Some(ABSENT_INT), "{}", f.name);
                }
            }
        }
    }

    fn journal_lines(dir: &Path) -> Vec<String> {
        std::fs::read_to_string(dir.join(JOURNAL))
            .unwrap()
            .lines()
            .map(str::to_string)
            .collect()
    }

    fn write_lines(dir: &Path, lines: &[String]) {
        let text: String = lines.iter().map(|l| format!("{l}\n")).collect();
        std::fs::write(dir.join(JOURNAL), text).unwrap();
    }

    fn line(e: &Entry) -> String {
        serde_json::to_string(e).unwrap()
    }

    #[test]
    fn a_blank_journal_line_is_skipped_and_removed() {
        let dir = tempfile::tempdir().unwrap();
        write_lines(
            dir.path(),
            &[
                line(&entry(50, Some(0.5))),
                String::new(),
                "   ".into(),
                line(&entry(100, None)),
            ],
        );
        let (_, _, repairs) = read_journal(&dir.path().join(JOURNAL)).unwrap();
        assert_eq!(repairs.blank, vec![2, 3]);
        let h = History::open(dir.path()).unwrap();
        let steps: Vec<i64> = h.evaluations().map(|r| r.step).collect();
        assert_eq!(steps, vec![50, 100]);
        assert_eq!(
            journal_lines(dir.path()),
            vec![line(&entry(50, Some(0.5))), line(&entry(100, None))],
            "the journal was not repaired"
        );
        // Appends after the repair land after the kept lines.
        let mut h = h;
        h.append(entry(150, None)).unwrap();
        drop(h);
        assert_eq!(History::open(dir.path()).unwrap().entries().len(), 3);
    }

    /// The journal is read without following a link and line by line with a bound (issue #45:
    /// `history.jsonl -> /dev/zero` grew without end and aborted `watch`): a link, or a FIFO,
    /// is an error naming the file, at once; a line of 3 MiB without an entry is skipped, kept
    /// aside as a line that is not one.
    #[test]
    fn a_journal_is_read_with_a_bound_and_never_through_a_link() {
        let dir = tempfile::tempdir().unwrap();
        let journal = dir.path().join(JOURNAL);
        std::os::unix::fs::symlink("/dev/zero", &journal).unwrap();
        let e = History::read(dir.path()).unwrap_err().to_string();
        assert!(e.contains(JOURNAL) && e.contains("symbolic link"), "{e}");
        std::fs::remove_file(&journal).unwrap();
        let c = std::ffi::CString::new(journal.to_str().unwrap()).unwrap();
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let e = History::open(dir.path())
            .err()
            .expect("a FIFO refused")
            .to_string();
        assert!(e.contains("not a regular file"), "{e}");
        std::fs::remove_file(&journal).unwrap();
        let mut bytes = format!("{}\n", line(&entry(50, Some(0.5)))).into_bytes();
        bytes.extend(std::iter::repeat_n(b'x', 3 << 20));
        bytes.push(b'\n');
        bytes.extend_from_slice(format!("{}\n", line(&entry(100, None))).as_bytes());
        std::fs::write(&journal, &bytes).unwrap();
        let (entries, len, repairs) = read_journal(&journal).unwrap();
        assert_eq!(entries.len(), 2);
        assert_eq!(len, bytes.len() as u64);
        assert_eq!(repairs.corrupt.len(), 1);
        assert!(
            repairs.corrupt[0].1.contains("longer than"),
            "{:?}",
            repairs.corrupt[0].1
        );
    }

    /// A line in the middle that is not an entry (here garbage with bytes that are not UTF-8,
    /// and a line cut short) no longer stops every start: skipped, kept aside, removed.
    #[test]
    fn a_garbage_journal_line_is_skipped_kept_aside_and_removed() {
        let dir = tempfile::tempdir().unwrap();
        let journal = dir.path().join(JOURNAL);
        let mut bytes = format!("{}\n", line(&entry(50, Some(0.5)))).into_bytes();
        bytes.extend_from_slice(b"garbage \xff\x1b[31m\n");
        bytes.extend_from_slice(b"{\"kind\":\"evaluation\",\"key\n");
        bytes.extend_from_slice(format!("{}\n", line(&entry(100, None))).as_bytes());
        std::fs::write(&journal, &bytes).unwrap();
        let (_, _, repairs) = read_journal(&journal).unwrap();
        let lines: Vec<usize> = repairs.corrupt.iter().map(|(l, _, _)| *l).collect();
        assert_eq!(lines, vec![2, 3]);
        // A reader beside the daemon skips them without changing the journal.
        assert_eq!(History::read(dir.path()).unwrap().len(), 2);
        assert_eq!(std::fs::read(&journal).unwrap(), bytes);
        let mut h = History::open(dir.path()).expect("a start with a garbage line");
        let steps: Vec<i64> = h.evaluations().map(|r| r.step).collect();
        assert_eq!(steps, vec![50, 100]);
        assert_eq!(
            journal_lines(dir.path()),
            vec![line(&entry(50, Some(0.5))), line(&entry(100, None))],
            "the journal was not repaired"
        );
        assert_eq!(
            std::fs::read(dir.path().join(JOURNAL_CORRUPT)).unwrap(),
            b"garbage \xff\x1b[31m\n{\"kind\":\"evaluation\",\"key\n",
            "the lines were not kept aside"
        );
        h.append(entry(150, None)).unwrap();
        drop(h);
        assert_eq!(History::open(dir.path()).unwrap().entries().len(), 3);
    }

    /// When the lines cannot be kept aside (a link planted at its name, never followed), they
    /// stay in the journal, skipped at each start.
    #[test]
    fn garbage_journal_lines_stay_when_they_cannot_be_kept_aside() {
        let dir = tempfile::tempdir().unwrap();
        let victim = dir.path().join("victim");
        std::fs::write(&victim, "precious").unwrap();
        std::os::unix::fs::symlink(&victim, dir.path().join(JOURNAL_CORRUPT)).unwrap();
        let text = format!("garbage\n{}\n", line(&entry(50, None)));
        std::fs::write(dir.path().join(JOURNAL), &text).unwrap();
        let h = History::open(dir.path()).unwrap();
        assert_eq!(h.entries().len(), 1);
        assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious");
        assert_eq!(
            std::fs::read_to_string(dir.path().join(JOURNAL)).unwrap(),
            text
        );
    }

    #[test]
    fn a_duplicate_journal_line_is_dropped_keeping_the_first() {
        let dir = tempfile::tempdir().unwrap();
        // The same checkpoint version twice (other values), and a failure for it as well.
        let failure = Entry::Failure {
            key: entry(50, None).key().unwrap().clone(),
            at: "2026-01-01T00:00:01Z".into(),
            step: 50,
            reason: "error".into(),
            message: "x".into(),
        };
        write_lines(
            dir.path(),
            &[
                line(&entry(50, Some(0.5))),
                line(&entry(100, Some(0.4))),
                line(&entry(50, Some(0.9))),
                line(&failure),
            ],
        );
        let (_, _, repairs) = read_journal(&dir.path().join(JOURNAL)).unwrap();
        assert_eq!(repairs.duplicates, vec![(3, 1), (4, 1)]);
        let h = History::open(dir.path()).unwrap();
        assert_eq!(
            h.entries(),
            &[entry(50, Some(0.5)), entry(100, Some(0.4))],
            "not the first entry of each checkpoint"
        );
        assert_eq!(
            journal_lines(dir.path()).len(),
            2,
            "the journal was not repaired"
        );
        // `read` (beside a running daemon) drops them too, without changing the file.
        assert_eq!(History::read(dir.path()).unwrap().len(), 2);
    }

    #[test]
    fn evaluations_out_of_step_order_are_kept_and_reported() {
        // A checkpoint that arrives late is evaluated after newer ones: legitimate, kept.
        let dir = tempfile::tempdir().unwrap();
        write_lines(
            dir.path(),
            &[
                line(&entry(100, Some(0.5))),
                line(&entry(50, Some(0.4))),
                line(&entry(150, Some(0.3))),
            ],
        );
        let before = std::fs::read(dir.path().join(JOURNAL)).unwrap();
        let (entries, _, repairs) = read_journal(&dir.path().join(JOURNAL)).unwrap();
        assert_eq!(entries.len(), 3);
        assert_eq!(repairs.out_of_order, vec![2]);
        assert!(!repairs.changed());
        let h = History::open(dir.path()).unwrap();
        let steps: Vec<i64> = h.evaluations().map(|r| r.step).collect();
        assert_eq!(steps, vec![100, 50, 150]);
        assert_eq!(std::fs::read(dir.path().join(JOURNAL)).unwrap(), before);
    }

    #[test]
    fn the_hdf5_temporary_file_never_follows_a_planted_link() {
        let dir = tempfile::tempdir().unwrap();
        let state = dir.path().join("state");
        std::fs::create_dir(&state).unwrap();
        let victim = dir.path().join("victim");
        std::fs::write(&victim, "precious").unwrap();
        // The old fixed name, and a guess at the new pattern.
        std::os::unix::fs::symlink(&victim, state.join("history.h5.tmp")).unwrap();
        std::os::unix::fs::symlink(&victim, state.join(".history.h5.aaaaaaaaaaaa.tmp")).unwrap();
        let mut h = History::open(&state).unwrap();
        h.append(entry(50, Some(0.5))).unwrap();
        // Planted again after the start-up clean-up.
        std::os::unix::fs::symlink(&victim, state.join("history.h5.tmp")).unwrap();
        h.write_hdf5().unwrap();
        assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious");
        let file = hdf5::File::open(state.join(HDF5)).unwrap();
        assert_eq!(
            file.dataset("evaluations/step")
                .unwrap()
                .read_raw::<i64>()
                .unwrap(),
            vec![50]
        );
        let leftovers: Vec<String> = std::fs::read_dir(&state)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.contains(".tmp") && n != "history.h5.tmp")
            .collect();
        assert!(leftovers.is_empty(), "{leftovers:?}");
    }

    #[test]
    fn the_state_folder_is_private() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let state = dir.path().join("run/.diffmon");
        History::open(&state).unwrap();
        let mode = std::fs::metadata(&state).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o700);
    }

    #[test]
    fn a_deleted_state_folder_is_recreated_with_every_entry() {
        let dir = tempfile::tempdir().unwrap();
        let run = dir.path().join("run");
        let state = run.join(".diffmon");
        let mut h = History::open(&state).unwrap();
        h.append(entry(50, Some(0.5))).unwrap();
        h.write_hdf5().unwrap();
        // `run.dir` deleted: appends cannot go anywhere until it is back.
        std::fs::remove_dir_all(&run).unwrap();
        assert!(h.append(entry(100, Some(0.4))).is_err());
        assert!(!run.exists(), "the daemon re-created run.dir itself");
        std::fs::create_dir(&run).unwrap();
        h.append(entry(100, Some(0.4))).unwrap();
        assert!(h.hdf5_stale());
        h.write_hdf5().unwrap();
        drop(h);
        let h = History::open(&state).unwrap();
        let steps: Vec<i64> = h.evaluations().map(|r| r.step).collect();
        assert_eq!(steps, vec![50, 100]);
        let file = hdf5::File::open(state.join(HDF5)).unwrap();
        assert_eq!(
            file.dataset("evaluations/step")
                .unwrap()
                .read_raw::<i64>()
                .unwrap(),
            vec![50, 100]
        );
    }
}
