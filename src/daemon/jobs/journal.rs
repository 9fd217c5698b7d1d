//! The journal `jobs.jsonl`: its lines, and reading it (the latest attempt of each checkpoint at
//! start; what the tests count). Its lines are written as jobs are submitted (`submit.rs`).

use super::error::JobsError;
use crate::store::history::CheckpointKey;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::io::Read;
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
        /// The job's folder name under `jobs/` (also its tag in the scheduler's queue, for a
        /// single job).
        folder: String,
        /// A task of a batch (a Slurm job array): the batch's tag and this task's index.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        array: Option<ArrayTask>,
    },
    /// `sbatch` answered with this id.
    Submitted { folder: String, job_id: String },
    /// The job ended without a result.
    Failed { folder: String, reason: String },
}

impl JournalLine {
    /// Are the folder, the job id and the batch's tag names of the kind the daemon writes
    /// ([`is_plain_name`])? A line that is not (an absolute or `..` folder that would take the
    /// daemon's reads out of `jobs/`, an id that a scheduler's command would read as an option)
    /// was not written by the daemon and is set aside like garbage.
    fn names_what_the_daemon_writes(&self) -> bool {
        match self {
            JournalLine::Submitting { folder, array, .. } => {
                is_plain_name(folder) && array.as_ref().is_none_or(|a| is_plain_name(&a.comment))
            }
            JournalLine::Submitted { folder, job_id } => {
                is_plain_name(folder) && is_plain_name(job_id)
            }
            JournalLine::Failed { folder, .. } => is_plain_name(folder),
        }
    }
}

/// A job folder's name (`<step>-<attempt>-<token>`), a scheduler's job id (`1234`, `1234_5`) or
/// a batch's tag (`array-<token>`): 1 to 128 ASCII letters, digits, `_`, `.` and `-`, the first
/// a letter or a digit: one path component that is neither `..` nor an option.
fn is_plain_name(name: &str) -> bool {
    (1..=128).contains(&name.len())
        && name.starts_with(|c: char| c.is_ascii_alphanumeric())
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-'))
}

/// A task of a batch (a Slurm job array): the batch's tag (`array-<token>`; `comment` on disk,
/// after Slurm's `--comment`) and the task's index (Slurm's `$SLURM_ARRAY_TASK_ID`).
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

/// The file beside the journal where lines that are not journal lines are kept aside.
pub const JOURNAL_CORRUPT: &str = "jobs.jsonl.corrupt";

/// Reads the journal at start: the latest attempt of each key (a key journaled again and again,
/// a forged duplicate too, is its last attempt). Repaired as the history journal is: a line
/// that is not a journal line (garbage, bytes that are not UTF-8, names the daemon never writes:
/// [`JournalLine::names_what_the_daemon_writes`]; a byte-order mark is dropped) is skipped
/// with a WARN, kept aside in [`JOURNAL_CORRUPT`] and removed, and a last
/// line cut short by a crash is dropped (its attempt was never submitted), so appends start on a
/// line of their own. A link, a FIFO or anything but a regular file is an error, never waited on.
pub(super) fn read_journal(path: &Path) -> Result<HashMap<CheckpointKey, Journaled>, JobsError> {
    let mut map: HashMap<CheckpointKey, Journaled> = HashMap::new();
    let journal_error = |source| JobsError::Journal {
        path: path.into(),
        source,
    };
    let bytes = match read_bytes(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(map),
        Err(source) => return Err(journal_error(source)),
    };
    let mut good = Vec::new();
    let mut bad: Vec<(usize, &[u8])> = Vec::new();
    let torn = !bytes.is_empty() && !bytes.ends_with(b"\n");
    let lines: Vec<&[u8]> = bytes.split(|b| *b == b'\n').collect();
    let complete = lines.len() - 1; // after the last newline: empty, or the torn line
    let mut parsed_lines = Vec::new();
    for (i, raw) in lines[..complete].iter().enumerate() {
        let line = raw.strip_prefix(b"\xEF\xBB\xBF".as_slice()).unwrap_or(raw);
        if line.trim_ascii().is_empty() {
            continue;
        }
        match std::str::from_utf8(line)
            .ok()
            .and_then(|t| serde_json::from_str::<JournalLine>(t).ok())
            .filter(JournalLine::names_what_the_daemon_writes)
        {
            Some(l) => {
                good.extend_from_slice(line);
                good.push(b'\n');
                parsed_lines.push(l);
            }
            None => bad.push((i + 1, raw)),
        }
    }
    if !bad.is_empty() || torn || bytes.starts_with(b"\xEF\xBB\xBF") {
        set_aside(path, &bad, torn);
        crate::store::safe_fs::atomic_write(path, &good).map_err(journal_error)?;
    }
    let mut by_folder: HashMap<String, CheckpointKey> = HashMap::new();
    for parsed in parsed_lines {
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

/// The journal's bytes: no link followed, no FIFO waited on, a regular file, at most
/// [`MAX_JOURNAL_BYTES`].
fn read_bytes(path: &Path) -> std::io::Result<Vec<u8>> {
    let file = crate::store::safe_fs::open_regular(path)?;
    let mut bytes = Vec::new();
    file.take(MAX_JOURNAL_BYTES).read_to_end(&mut bytes)?;
    Ok(bytes)
}

/// The journal's text for the tests' counts (lines that are not UTF-8 are lost).
fn read_bounded(path: &Path) -> std::io::Result<String> {
    Ok(String::from_utf8_lossy(&read_bytes(path)?).into_owned())
}

/// Says which lines of the journal are dropped, and appends those that are not journal lines
/// to [`JOURNAL_CORRUPT`] (never through a link).
fn set_aside(path: &Path, bad: &[(usize, &[u8])], torn: bool) {
    use std::io::Write;
    if torn {
        tracing::warn!(journal = %path.display(), "dropping an incomplete last line of the jobs journal (its job was never submitted)");
    }
    if bad.is_empty() {
        return;
    }
    let numbers: Vec<String> = bad.iter().map(|(n, _)| n.to_string()).collect();
    let aside = crate::store::safe_fs::parent(path).join(JOURNAL_CORRUPT);
    let kept = crate::store::safe_fs::open_private_append(&aside).and_then(|mut f| {
        for (_, line) in bad {
            f.write_all(line)?;
            f.write_all(b"\n")?;
        }
        f.sync_all()
    });
    tracing::warn!(
        journal = %path.display(),
        lines = %numbers.join(", "),
        "lines of the jobs journal that are not lines the daemon writes: skipped and removed{}",
        match kept {
            Ok(()) => format!(", kept in {}", aside.display()),
            Err(e) => format!(" (cannot keep them in {}: {e})", aside.display()),
        }
    );
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

/// The job ids journaled for each step, in order: what the tests look at (an array's tasks
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
        // Garbage, a BOM and bytes that are not UTF-8 (issue #45: each stopped every start)
        // are skipped, kept aside and removed; the torn last line is dropped from the file.
        let mut hostile = b"garbage\n".to_vec();
        hostile.extend_from_slice(b"\xEF\xBB\xBF");
        hostile.extend_from_slice(text.as_bytes());
        let torn_at = hostile.len() - text.rsplit('\n').next().unwrap().len();
        hostile.splice(torn_at..torn_at, b"\xff\xfe not json\n".iter().copied());
        std::fs::write(&path, &hostile).unwrap();
        let again = read_journal(&path).unwrap();
        assert_eq!(again, map);
        let repaired = std::fs::read(&path).unwrap();
        let clean: String = lines
            .iter()
            .map(|l| serde_json::to_string(l).unwrap() + "\n")
            .collect();
        assert_eq!(String::from_utf8(repaired).unwrap(), clean);
        assert_eq!(
            std::fs::read(dir.path().join(JOURNAL_CORRUPT)).unwrap(),
            b"garbage\n\xff\xfe not json\n"
        );
        // A FIFO is not waited on, a link not followed.
        std::fs::remove_file(&path).unwrap();
        let c = std::ffi::CString::new(path.to_str().unwrap()).unwrap();
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        assert!(read_journal(&path).is_err());
        std::fs::remove_file(&path).unwrap();
        std::os::unix::fs::symlink("/dev/zero", &path).unwrap();
        assert!(read_journal(&path).is_err());
    }

    /// A forged journal (issue 62's chaos suite): thousands of lines journaling one key again
    /// and again, folders that leave `jobs/`, ids a scheduler's command would read as options.
    /// The forged lines are set aside, the key is its last real attempt, and nothing else is
    /// adopted.
    #[test]
    fn forged_and_duplicated_journal_lines_are_set_aside_or_superseded() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(JOURNAL);
        let key = CheckpointKey {
            path: "ckpt_1.pt".into(),
            size: 1,
            mtime_ns: 1,
        };
        let submitting = |attempt: usize, folder: &str| JournalLine::Submitting {
            key: key.clone(),
            step: 1,
            attempt,
            folder: folder.into(),
            array: None,
        };
        let submitted = |folder: &str, job_id: &str| JournalLine::Submitted {
            folder: folder.into(),
            job_id: job_id.into(),
        };
        let mut lines = Vec::new();
        for attempt in 0..5000 {
            let folder = format!("1-{attempt}-t");
            lines.push(submitting(attempt, &folder));
            lines.push(submitted(&folder, &attempt.to_string()));
        }
        let forged = [
            submitting(9000, "/etc"),
            submitting(9001, "../../outside"),
            submitting(9002, ".."),
            submitted("1-4999-t", "--signal=KILL"),
            submitted("1-4999-t", "7 8"),
            JournalLine::Submitting {
                key: key.clone(),
                step: 1,
                attempt: 9003,
                folder: "1-9003-t".into(),
                array: Some(ArrayTask {
                    comment: "array-x/../../y".into(),
                    index: 0,
                }),
            },
            JournalLine::Failed {
                folder: "/etc".into(),
                reason: "cancelled".into(),
            },
        ];
        let text: String = lines
            .iter()
            .chain(&forged)
            .map(|l| serde_json::to_string(l).unwrap() + "\n")
            .collect();
        std::fs::write(&path, &text).unwrap();
        let map = read_journal(&path).unwrap();
        assert_eq!(
            map[&key],
            Journaled {
                attempt: 4999,
                folder: "1-4999-t".into(),
                array: None,
                job_id: Some("4999".into()),
                failed: None,
            }
        );
        assert_eq!(map.len(), 1);
        let aside = std::fs::read_to_string(dir.path().join(JOURNAL_CORRUPT)).unwrap();
        assert_eq!(aside.lines().count(), forged.len(), "{aside}");
        for name in [
            "/etc",
            "../../outside",
            "--signal=KILL",
            "7 8",
            "array-x/../../y",
        ] {
            assert!(aside.contains(name), "{name} was not set aside: {aside}");
        }
        let kept = std::fs::read_to_string(&path).unwrap();
        assert_eq!(kept.lines().count(), lines.len());
    }

    #[test]
    fn plain_names_are_one_component_and_never_an_option() {
        for good in ["1-0-18c2f3a9e1b", "1234", "1234_5", "array-ab12", "v1.2"] {
            assert!(is_plain_name(good), "{good}");
        }
        let long = "a".repeat(129);
        for bad in [
            "",
            "..",
            ".x",
            "-x",
            "a/b",
            "/etc",
            "a b",
            "a\nb",
            "é",
            long.as_str(),
        ] {
            assert!(!is_plain_name(bad), "{bad:?}");
        }
    }
}
