//! The evaluation history (DESIGN.md §2.5), durable across a crash at any moment.
//!
//! The source of truth is an append-only journal, `<state_dir>/history.jsonl`: one JSON line per
//! evaluation (or per checkpoint that could not be evaluated), written and `fsync`ed before
//! anything else acts on it. A kill can leave at most a torn last line, which the next start
//! drops; an append that fails (a full disk) is cut back to the complete lines, so the journal
//! stays readable and the caller can try the same entry again. `<state_dir>/history.h5` is
//! regenerated from the journal by [`History::write_hdf5`] once it misses evaluations, written
//! to a temporary file and renamed into place, so readers (h5py) always see a complete file: group `/evaluations` with one 1-D dataset per scalar field (NaN where a metric
//! was not computed), `checkpoint` as strings, and the ICR spectra in `icr_eigenvalues`
//! `[rows, d]`. `diffmon report` reads the journal beside a running daemon without changing it
//! ([`History::read`]).

use crate::record::Evaluation;
use serde::{Deserialize, Serialize};
use std::collections::HashSet;
use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum HistoryError {
    #[error("{path}: {message}")]
    Io { path: PathBuf, message: String },
    #[error("{path}: line {line}: {message}")]
    Corrupt {
        path: PathBuf,
        line: usize,
        message: String,
    },
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
}

impl Entry {
    pub fn key(&self) -> &CheckpointKey {
        match self {
            Entry::Evaluation { key, .. } | Entry::Failure { key, .. } => key,
        }
    }
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
pub const HDF5: &str = "history.h5";

impl History {
    /// Opens (or creates) the history in `state_dir`, reading the journal back. `history.h5` is
    /// left to [`History::write_hdf5`], so a full disk does not stop a start.
    pub fn open(state_dir: &Path) -> Result<History, HistoryError> {
        let io = |path: &Path, e: std::io::Error| HistoryError::Io {
            path: path.to_path_buf(),
            message: e.to_string(),
        };
        std::fs::create_dir_all(state_dir).map_err(|e| io(state_dir, e))?;
        let path = state_dir.join(JOURNAL);
        let (entries, good_len) = if path.exists() {
            read_journal(&path)?
        } else {
            (Vec::new(), 0)
        };
        let journal = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .map_err(|e| io(&path, e))?;
        journal.set_len(good_len).map_err(|e| io(&path, e))?;
        let keys = entries.iter().map(|e| e.key().clone()).collect();
        Ok(History {
            dir: state_dir.to_path_buf(),
            journal,
            entries,
            keys,
            len: good_len,
            torn: false,
            hdf5_stale: true,
        })
    }

    /// The entries of the journal in `state_dir`, read without changing anything (a torn last
    /// line, from a kill or from a daemon writing it right now, is left out). For readers beside
    /// a running daemon, such as `diffmon report`.
    pub fn read(state_dir: &Path) -> Result<Vec<Entry>, HistoryError> {
        Ok(read_journal(&state_dir.join(JOURNAL))?.0)
    }

    pub fn entries(&self) -> &[Entry] {
        &self.entries
    }

    /// The evaluation records, in evaluation order.
    pub fn evaluations(&self) -> impl Iterator<Item = &Evaluation> {
        self.entries.iter().filter_map(|e| match e {
            Entry::Evaluation { record, .. } => Some(record.as_ref()),
            Entry::Failure { .. } => None,
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
        self.keys.insert(entry.key().clone());
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
        let tmp = self.dir.join(format!("{HDF5}.tmp"));
        let records: Vec<&Evaluation> = self.evaluations().collect();
        let written = write_hdf5(&tmp, &records)
            .map_err(|e| HistoryError::Io {
                path: tmp.clone(),
                message: e.to_string(),
            })
            .and_then(|_| {
                File::open(&tmp)
                    .and_then(|f| f.sync_all())
                    .and_then(|_| std::fs::rename(&tmp, &path))
                    .map_err(|e| HistoryError::Io {
                        path: path.clone(),
                        message: e.to_string(),
                    })
            });
        if written.is_err() {
            let _ = std::fs::remove_file(&tmp);
        } else {
            self.hdf5_stale = false;
        }
        written
    }
}

/// The complete lines of a journal, and their length in bytes (a torn last line is dropped).
fn read_journal(path: &Path) -> Result<(Vec<Entry>, u64), HistoryError> {
    let io = |e: std::io::Error| HistoryError::Io {
        path: path.to_path_buf(),
        message: e.to_string(),
    };
    let file = File::open(path).map_err(io)?;
    let mut reader = BufReader::new(file);
    let mut entries = Vec::new();
    let mut good_len = 0u64;
    let mut line = String::new();
    let mut number = 0;
    loop {
        line.clear();
        let n = reader.read_line(&mut line).map_err(io)?;
        if n == 0 {
            break;
        }
        number += 1;
        if !line.ends_with('\n') {
            // A torn last line from a kill mid-write.
            tracing::warn!(journal = %path.display(), line = number, "dropping an incomplete last journal line");
            break;
        }
        let entry: Entry = serde_json::from_str(&line).map_err(|e| HistoryError::Corrupt {
            path: path.to_path_buf(),
            line: number,
            message: e.to_string(),
        })?;
        entries.push(entry);
        good_len += n as u64;
    }
    Ok((entries, good_len))
}

/// The scalar float fields of a record, in the history file's order.
fn float_fields(r: &Evaluation) -> [(&'static str, Option<f64>); 13] {
    [
        ("icr", r.icr),
        ("icr_invariant_trace", r.icr_invariant_trace),
        ("icr_residual_trace", r.icr_residual_trace),
        (
            "icr_invariant_trace_normalized",
            r.icr_invariant_trace_normalized,
        ),
        (
            "icr_residual_trace_normalized",
            r.icr_residual_trace_normalized,
        ),
        ("pfd_generalization", r.pfd_generalization),
        ("pfd_memorization", r.pfd_memorization),
        ("memorization_ratio", r.memorization_ratio),
        ("tail_rmsqe", r.tail_rmsqe),
        ("tail_loader", r.tail_loader),
        ("loss_train", r.loss_train),
        ("loss_heldout", r.loss_heldout),
        ("generalization_gap", r.generalization_gap),
    ]
}

fn write_hdf5(path: &Path, records: &[&Evaluation]) -> hdf5::Result<()> {
    let file = hdf5::File::create(path)?;
    let group = file.create_group("evaluations")?;
    let steps: Vec<i64> = records.iter().map(|r| r.step).collect();
    group
        .new_dataset_builder()
        .with_data(&steps)
        .create("step")?;
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
    let template = Evaluation::default();
    for (k, (name, _)) in float_fields(&template).iter().enumerate() {
        let column: Vec<f64> = records
            .iter()
            .map(|r| float_fields(r)[k].1.unwrap_or(f64::NAN))
            .collect();
        group
            .new_dataset_builder()
            .with_data(&column)
            .create(*name)?;
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
        assert!(h.contains(entry(50, None).key()));
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
}
