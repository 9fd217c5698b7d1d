//! The journal `jobs.jsonl`: its lines, and reading it (the latest attempt of each checkpoint at
//! start; what the tests count). Its lines are written as jobs are submitted (`submit.rs`).

use super::error::SlurmError;
use crate::store::history::CheckpointKey;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::fs::OpenOptions;
use std::io::Read;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

/// The journal of submitted jobs, in the state folder.
pub const JOURNAL: &str = "jobs.jsonl";

/// Bound on the journal read at start.
const MAX_JOURNAL_BYTES: u64 = 256 << 20;

/// One line of `jobs.jsonl`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum JournalLine {
    /// Written before `sbatch` runs.
    Submitting {
        key: CheckpointKey,
        step: i64,
        attempt: usize,
        /// The job's folder name under `jobs/` (also its Slurm comment, for a single job).
        folder: String,
        /// A task of a job array: the array's Slurm comment and this task's index.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        array: Option<ArrayTask>,
    },
    /// `sbatch` answered with this id.
    Submitted { folder: String, job_id: String },
    /// The job ended without a result.
    Failed { folder: String, reason: String },
}

/// A task of a job array: the array's comment (`array-<token>`) and the task's index
/// (`$SLURM_ARRAY_TASK_ID`; its Slurm id is `<array id>_<index>`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ArrayTask {
    pub comment: String,
    pub index: usize,
}

/// What the journal says about one checkpoint key: its latest attempt.
#[derive(Debug, Clone, Default, PartialEq)]
pub(super) struct Journaled {
    pub(super) attempt: usize,
    pub(super) folder: String,
    pub(super) array: Option<ArrayTask>,
    pub(super) job_id: Option<String>,
    pub(super) failed: Option<String>,
}

/// Reads the journal: the latest attempt of each key.
pub(super) fn read_journal(path: &Path) -> Result<HashMap<CheckpointKey, Journaled>, SlurmError> {
    let mut map: HashMap<CheckpointKey, Journaled> = HashMap::new();
    let text = match read_bounded(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(map),
        Err(source) => {
            return Err(SlurmError::Journal {
                path: path.into(),
                source,
            });
        }
    };
    let mut by_folder: HashMap<String, CheckpointKey> = HashMap::new();
    let n = text.lines().count();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let parsed: JournalLine = match serde_json::from_str(line) {
            Ok(l) => l,
            // A last line cut short by a crash is dropped: its attempt was never submitted.
            Err(_) if i + 1 == n && !text.ends_with('\n') => break,
            Err(source) => {
                return Err(SlurmError::Corrupt {
                    path: path.into(),
                    line: i + 1,
                    source,
                });
            }
        };
        match parsed {
            JournalLine::Submitting {
                key,
                attempt,
                folder,
                array,
                ..
            } => {
                by_folder.insert(folder.clone(), key.clone());
                map.insert(
                    key,
                    Journaled {
                        attempt,
                        folder,
                        array,
                        job_id: None,
                        failed: None,
                    },
                );
            }
            JournalLine::Submitted { folder, job_id } => {
                if let Some(j) = by_folder.get(&folder).and_then(|k| map.get_mut(k))
                    && j.folder == folder
                {
                    j.job_id = Some(job_id);
                }
            }
            JournalLine::Failed { folder, reason } => {
                if let Some(j) = by_folder.get(&folder).and_then(|k| map.get_mut(k))
                    && j.folder == folder
                {
                    j.failed = Some(reason);
                }
            }
        }
    }
    Ok(map)
}

fn read_bounded(path: &Path) -> std::io::Result<String> {
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)?;
    let mut text = String::new();
    file.take(MAX_JOURNAL_BYTES).read_to_string(&mut text)?;
    Ok(text)
}

/// Every attempt journaled for each step: what the tests count.
pub fn submissions_per_step(state_dir: &Path) -> std::io::Result<HashMap<i64, usize>> {
    let text = read_bounded(&state_dir.join(JOURNAL))?;
    let mut counts = HashMap::new();
    for line in text.lines() {
        if let Ok(JournalLine::Submitting { step, .. }) = serde_json::from_str(line) {
            *counts.entry(step).or_default() += 1;
        }
    }
    Ok(counts)
}

/// The Slurm ids journaled for each step, in order: what the tests look at (an array's tasks
/// are `<id>_<index>`).
pub fn job_ids_per_step(state_dir: &Path) -> std::io::Result<HashMap<i64, Vec<String>>> {
    let text = read_bounded(&state_dir.join(JOURNAL))?;
    let mut steps: HashMap<String, i64> = HashMap::new();
    let mut ids: HashMap<i64, Vec<String>> = HashMap::new();
    for line in text.lines() {
        match serde_json::from_str(line) {
            Ok(JournalLine::Submitting { step, folder, .. }) => {
                steps.insert(folder, step);
            }
            Ok(JournalLine::Submitted { folder, job_id }) => {
                if let Some(step) = steps.get(&folder) {
                    ids.entry(*step).or_default().push(job_id);
                }
            }
            _ => {}
        }
    }
    Ok(ids)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The journal's latest attempt per key, its id and its failure; a torn last line is
    /// dropped, a torn line before the end is an error naming it.
    #[test]
    fn the_journal_gives_each_key_its_latest_attempt() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(JOURNAL);
        let key = |n: i64| CheckpointKey {
            path: format!("ckpt_{n}.pt"),
            size: 1,
            mtime_ns: n,
        };
        let lines = [
            JournalLine::Submitting {
                key: key(1),
                step: 1,
                attempt: 0,
                folder: "1-0-a".into(),
                array: None,
            },
            JournalLine::Submitted {
                folder: "1-0-a".into(),
                job_id: "7".into(),
            },
            JournalLine::Failed {
                folder: "1-0-a".into(),
                reason: "cancelled".into(),
            },
            JournalLine::Submitting {
                key: key(1),
                step: 1,
                attempt: 1,
                folder: "1-1-b".into(),
                array: None,
            },
            JournalLine::Submitted {
                folder: "1-1-b".into(),
                job_id: "8".into(),
            },
            JournalLine::Submitting {
                key: key(2),
                step: 2,
                attempt: 0,
                folder: "2-0-c".into(),
                array: Some(ArrayTask {
                    comment: "array-c".into(),
                    index: 1,
                }),
            },
        ];
        let mut text: String = lines
            .iter()
            .map(|l| serde_json::to_string(l).unwrap() + "\n")
            .collect();
        text += "{\"event\":\"submitted\",\"fol";
        std::fs::write(&path, &text).unwrap();
        let map = read_journal(&path).unwrap();
        assert_eq!(
            map[&key(1)],
            Journaled {
                attempt: 1,
                folder: "1-1-b".into(),
                array: None,
                job_id: Some("8".into()),
                failed: None
            }
        );
        assert_eq!(map[&key(2)].job_id, None);
        assert_eq!(
            map[&key(2)].array,
            Some(ArrayTask {
                comment: "array-c".into(),
                index: 1
            })
        );
        let counts = submissions_per_step(dir.path()).unwrap();
        assert_eq!((counts[&1], counts[&2]), (2, 1));
        std::fs::write(&path, format!("garbage\n{text}")).unwrap();
        let e = read_journal(&path).unwrap_err();
        assert!(e.to_string().contains("line 1"), "{e}");
    }
}
