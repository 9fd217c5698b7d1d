//! The Slurm executor (`evaluation.executor: slurm`, docs/design.md §18): the jobs layer
//! (`daemon/jobs/`: folders, scripts, the journal, retries, order, slots) on Slurm's commands.
//! This file is the [`Scheduler`] Slurm is: `sbatch` submits (with `evaluation.slurm`'s
//! options, `--no-requeue`, the job's folder name as its `--comment`, by which an attempt
//! journaled without its id is found in `squeue` again), `squeue` is the queue and `scontrol`
//! says how a job that left it ended. Items taken together go as one job array
//! (`sbatch --array=0-<k-1>`, at most [`MAX_ARRAY_TASKS`](arrays::MAX_ARRAY_TASKS) tasks), whose
//! driver `array.sh` (`arrays.rs`) in the first task's folder runs each task's `job.sh`; a
//! task's id is `<id>_<index>`, and `squeue` folds pending tasks into one line (`arrays.rs`).

mod arrays;

use crate::config::SlurmConfig;
use crate::daemon::jobs::{JobEnd, Scheduler};
use arrays::{array_id, queue_ids};
use std::collections::HashMap;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

/// Slurm, with the `evaluation.slurm` settings.
pub struct Slurm(pub SlurmConfig);

impl Scheduler for Slurm {
    const NAME: &'static str = "Slurm";
    const OUTPUT: &'static str = "slurm.out";
    const BINARY_KEY: &'static str = "evaluation.slurm.binary";

    fn poll(&self) -> Duration {
        self.0.poll
    }

    fn binary(&self) -> Option<&Path> {
        self.0.binary.as_deref()
    }

    fn submit(&self, name: &str, tag: &str, folder: &Path) -> Result<String, String> {
        let extra = [
            format!("--job-name={name}"),
            format!("--comment={tag}"),
            format!("--output={}", folder.join(Self::OUTPUT).display()),
        ];
        self.sbatch(&extra, &folder.join("job.sh"))
    }

    fn max_batch(&self) -> usize {
        arrays::MAX_ARRAY_TASKS
    }

    fn submit_batch(
        &self,
        name: &str,
        tag: &str,
        folders: &[std::path::PathBuf],
    ) -> Result<Vec<String>, String> {
        let first = folders.first().ok_or("an empty job array")?;
        let driver = arrays::driver(folders, Self::OUTPUT);
        crate::store::safe_fs::atomic_write(&first.join("array.sh"), driver.as_bytes()).map_err(
            |e| {
                format!(
                    "cannot write the job array's script in {}: {e}",
                    first.display()
                )
            },
        )?;
        let extra = [
            format!("--array=0-{}", folders.len() - 1),
            format!("--job-name={name}"),
            format!("--comment={tag}"),
            format!("--output={}", first.join("array-%a.out").display()),
        ];
        let id = self.sbatch(&extra, &first.join("array.sh"))?;
        tracing::info!(job = %id, tasks = folders.len(), "submitted to Slurm as a job array");
        // Task `i` is `<id>_<i>`.
        Ok((0..folders.len()).map(|i| format!("{id}_{i}")).collect())
    }

    fn queue(&self) -> Option<HashMap<String, bool>> {
        let text = squeue("%i|%T")?;
        Some(
            text.lines()
                .filter_map(|l| l.split_once('|'))
                .flat_map(|(i, s)| {
                    let running = matches!(s.trim(), "RUNNING" | "COMPLETING");
                    queue_ids(i.trim()).into_iter().map(move |i| (i, running))
                })
                .collect(),
        )
    }

    fn find(&self, tag: &str, task: Option<usize>) -> Option<Option<String>> {
        let text = squeue("%i|%k")?;
        let found = text.lines().find_map(|l| {
            let (id, c) = l.split_once('|')?;
            (c.trim() == tag).then(|| id.trim().to_string())
        });
        // Any task of the array gives the array's id; this task's is `<id>_<index>`.
        Some(match (task, found) {
            (Some(index), Some(id)) => Some(format!("{}_{index}", array_id(&id))),
            (_, found) => found,
        })
    }

    fn ended(&self, id: &str) -> Option<(JobEnd, String)> {
        match scontrol_state(id) {
            Some(state) => end_of_state(&state).map(|end| (end, state)),
            None => Some((JobEnd::Lost, "unknown to Slurm".into())),
        }
    }
}

impl Slurm {
    /// Runs `sbatch` with this executor's options and `extra`, then `script`: the job's id,
    /// or why there is none.
    fn sbatch(&self, extra: &[String], script: &Path) -> Result<String, String> {
        let s = &self.0;
        let mut cmd = Command::new("sbatch");
        cmd.arg("--parsable").arg("--no-requeue").args(extra);
        for (flag, value) in [
            ("--partition", &s.partition),
            ("--account", &s.account),
            ("--time", &s.time_limit),
            ("--gres", &s.gres),
        ] {
            if let Some(v) = value {
                cmd.arg(format!("{flag}={v}"));
            }
        }
        cmd.args(&s.sbatch_args).arg(script).envs(&s.env);
        let answer = cmd.output();
        let id = match &answer {
            Ok(out) if out.status.success() => {
                let text = String::from_utf8_lossy(&out.stdout);
                // `--parsable`: `<id>` or `<id>;<cluster>`.
                let id = text.trim().split(';').next().unwrap_or("").to_string();
                (!id.is_empty() && id.chars().all(|c| c.is_ascii_digit())).then_some(id)
            }
            _ => None,
        };
        id.ok_or_else(|| match answer {
            Ok(out) => format!(
                "sbatch failed: {}",
                crate::store::safe_fs::untrusted_text(String::from_utf8_lossy(&out.stderr).trim())
            ),
            Err(e) => format!("sbatch failed: cannot run sbatch: {e}"),
        })
    }
}

/// This user's jobs in `squeue`, one line each in `format`, every task of an array (`-r`);
/// `None` when the controller does not answer.
fn squeue(format: &str) -> Option<String> {
    let out = Command::new("squeue")
        .args(["-h", "--me", "-r", "-o", format])
        .output()
        .ok()
        .filter(|o| o.status.success())?;
    Some(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// `JobState` of a job from `scontrol show job` (kept for `MinJobAge` after it ends); `None`
/// when Slurm no longer knows it.
fn scontrol_state(id: &str) -> Option<String> {
    let out = Command::new("scontrol")
        .args(["show", "job", "-o", id])
        .output()
        .ok()
        .filter(|o| o.status.success())?;
    let text = String::from_utf8_lossy(&out.stdout);
    text.split_whitespace()
        .find_map(|w| w.strip_prefix("JobState="))
        .map(str::to_string)
}

/// How a job that left the queue ended, by its `JobState` (from `scontrol show job`); `None`
/// while it may still give a result.
fn end_of_state(state: &str) -> Option<JobEnd> {
    match state {
        "PENDING" | "RUNNING" | "CONFIGURING" | "COMPLETING" | "SUSPENDED" | "REQUEUED"
        | "REQUEUE_HOLD" | "REQUEUE_FED" | "RESIZING" | "SIGNALING" | "STAGE_OUT" => None,
        "TIMEOUT" | "DEADLINE" => Some(JobEnd::Timeout),
        "CANCELLED" => Some(JobEnd::Cancelled),
        "PREEMPTED" => Some(JobEnd::Preempted),
        // Finished, yet no status file: the script did not get to write it.
        "COMPLETED" => Some(JobEnd::Lost),
        _ => Some(JobEnd::Failed),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn job_states_map_to_ends() {
        assert_eq!(end_of_state("RUNNING"), None);
        assert_eq!(end_of_state("TIMEOUT"), Some(JobEnd::Timeout));
        assert_eq!(end_of_state("CANCELLED"), Some(JobEnd::Cancelled));
        assert_eq!(end_of_state("COMPLETED"), Some(JobEnd::Lost));
        assert_eq!(end_of_state("NODE_FAIL"), Some(JobEnd::Failed));
    }
}
