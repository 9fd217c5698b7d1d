//! What a jobs executor asks of the batch system its jobs run on ([`Scheduler`]), and how a job
//! can end without a result ([`JobEnd`], the `job_*` failures).

use crate::record::FailureReason;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// A batch system the jobs run on: how a job is submitted, and what its queue says. The jobs
/// layer does everything else (folders, scripts, the journal, retries, order, slots).
pub trait Scheduler: Send + 'static {
    /// Its name in messages and logs ("Slurm").
    const NAME: &'static str;
    /// The file in a job's folder that gets the job's output (its standard output and error).
    const OUTPUT: &'static str;
    /// The config key of the `diffmon` executable the jobs run (for the error when there is
    /// none).
    const BINARY_KEY: &'static str;

    /// How often the queue and the jobs' result files are looked at.
    fn poll(&self) -> Duration;
    /// The `diffmon` executable the jobs run, when it is configured (else this process' own).
    fn binary(&self) -> Option<&Path>;
    /// Submits the script `folder/job.sh` as a job named `name`, tagged `tag` (the folder's
    /// name: [`Scheduler::find`] looks for it), its output in `folder/OUTPUT`: the job's id, or
    /// why there is none.
    fn submit(&self, name: &str, tag: &str, folder: &Path) -> Result<String, String>;
    /// Most tasks in one batch; 1 for a scheduler without batches.
    fn max_batch(&self) -> usize {
        1
    }
    /// Submits the scripts `folders[i]/job.sh` as one batch named `name`, tagged `tag`, each
    /// task's output in its folder's `OUTPUT`: each task's id, in order, or why there are none.
    fn submit_batch(
        &self,
        name: &str,
        tag: &str,
        folders: &[PathBuf],
    ) -> Result<Vec<String>, String> {
        let _ = (name, tag, folders);
        Err(format!("{} has no batches", Self::NAME))
    }
    /// The jobs in the queue, by id, and whether each is running; `None` when the queue cannot
    /// be read.
    fn queue(&self) -> Option<HashMap<String, bool>>;
    /// The id of the queued job tagged `tag` (or of task `task` of the batch tagged `tag`):
    /// `Some(None)` when there is none, `None` when the queue cannot be read.
    fn find(&self, tag: &str, task: Option<usize>) -> Option<Option<String>>;
    /// How a job that left the queue without a status ended, and what the scheduler calls that
    /// (for the message); `None` while it may still give a result.
    fn ended(&self, id: &str) -> Option<(JobEnd, String)>;
}

label_enum! {
    /// How a job ended without a result. Its label is the `reason` label of
    /// `diffmon_slurm_jobs_failed_total` and of the journal's `failed` lines; [`JobEnd::reason`]
    /// is the checkpoint's failure when no retry is left.
    pub enum JobEnd {
        Failed => "failed",
        Timeout => "timeout",
        Cancelled => "cancelled",
        Preempted => "preempted",
        Lost => "lost",
    }
}

impl JobEnd {
    /// The end a journal's `failed` line names (an unknown one is a failure).
    pub(super) fn of_label(label: &str) -> JobEnd {
        JobEnd::ALL
            .into_iter()
            .find(|e| e.as_str() == label)
            .unwrap_or(JobEnd::Failed)
    }

    /// The checkpoint's failure once no retry is left.
    pub fn reason(self) -> FailureReason {
        match self {
            JobEnd::Failed => FailureReason::JobFailed,
            JobEnd::Timeout => FailureReason::JobTimeout,
            JobEnd::Cancelled | JobEnd::Preempted => FailureReason::JobCancelled,
            JobEnd::Lost => FailureReason::JobLost,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The journal's labels read back as the ends that wrote them; the metric's reasons are
    /// these labels.
    #[test]
    fn job_ends_round_trip_through_their_labels() {
        for end in JobEnd::ALL {
            assert_eq!(JobEnd::of_label(end.as_str()), end);
        }
        assert_eq!(JobEnd::of_label("made up"), JobEnd::Failed);
        let labels: Vec<&str> = JobEnd::ALL.into_iter().map(JobEnd::as_str).collect();
        assert_eq!(labels, crate::metrics::SLURM_JOB_FAILURES);
        assert_eq!(JobEnd::Preempted.reason(), FailureReason::JobCancelled);
    }
}
