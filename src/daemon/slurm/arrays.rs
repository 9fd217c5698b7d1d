//! Job arrays: the items taken together submitted as one array (`sbatch --array`), its driver
//! script and its tasks' journal lines; the ids of an array's tasks as `squeue` shows them.

use super::journal::{ArrayTask, JournalLine};
use super::runner::{Job, JobEnd, Runner, State};
use super::script::{job_name, quoted};
use crate::daemon::executor::Outcome;
use crate::record::FailureReason;
use std::collections::VecDeque;

/// Most tasks in one job array (Slurm's default `MaxArraySize` is 1001).
const MAX_ARRAY_TASKS: usize = 1000;

impl Runner {
    /// Submits the jobs taken since the last call: one alone as a job, several as one job
    /// array.
    pub(super) fn submit_taken(&mut self, jobs: &mut VecDeque<Job>) {
        let mut taken: Vec<&mut Job> = jobs
            .iter_mut()
            .filter(|j| matches!(j.state, State::Unsubmitted))
            .collect();
        for chunk in taken.chunks_mut(MAX_ARRAY_TASKS) {
            match chunk.len() {
                0 => {}
                1 => self.submit(chunk[0]),
                _ => self.submit_array(chunk),
            }
        }
    }

    /// Submits `jobs` as one job array (`--array=0-<k-1>`): task `i` runs the script in the
    /// folder of `jobs[i]`, each journaled as a task of the array (comment `array-<token>`)
    /// and then with its id `<array id>_<i>`. A submission that fails is each job's failure
    /// (each retried alone).
    fn submit_array(&mut self, jobs: &mut [&mut Job]) {
        let token = Self::token();
        let comment = format!("array-{token}");
        let mut tasks: Vec<&mut Job> = Vec::new();
        for job in jobs.iter_mut() {
            if self.prepare(job, &token) {
                tasks.push(job);
            }
        }
        if tasks.is_empty() {
            return;
        }
        // The driver, in the first task's folder: each task runs its own folder's script,
        // its output in that folder's `slurm.out`.
        let first = self.jobs_dir.join(&tasks[0].folder);
        let mut driver = String::from(
            "#!/bin/sh\n# diffmon watch: a job array\ncase \"$SLURM_ARRAY_TASK_ID\" in\n",
        );
        for (i, job) in tasks.iter().enumerate() {
            let dir = self.jobs_dir.join(&job.folder);
            driver += &format!(
                "{i}) exec /bin/sh {} > {} 2>&1 ;;\n",
                quoted(&dir.join("job.sh").display().to_string()),
                quoted(&dir.join("slurm.out").display().to_string()),
            );
        }
        driver += "*) echo \"no task $SLURM_ARRAY_TASK_ID\" >&2; exit 1 ;;\nesac\n";
        if let Err(e) =
            crate::store::safe_fs::atomic_write(&first.join("array.sh"), driver.as_bytes())
        {
            for job in tasks {
                job.state = State::Finished(Outcome::Failed(
                    job.item.clone(),
                    FailureReason::Error,
                    format!(
                        "cannot write the job array's script in {}: {e}",
                        first.display()
                    ),
                ));
            }
            return;
        }
        for (index, job) in tasks.iter_mut().enumerate() {
            job.array = Some(ArrayTask {
                comment: comment.clone(),
                index,
            });
            self.journal_surely(&JournalLine::Submitting {
                key: job.item.key.clone(),
                step: job.item.step,
                attempt: job.attempt,
                folder: job.folder.clone(),
                array: job.array.clone(),
            });
        }
        let (low, high) = (tasks[0].item.step, tasks[tasks.len() - 1].item.step);
        let extra = [
            format!("--array=0-{}", tasks.len() - 1),
            format!("--job-name={}-{high}", job_name(&self.run, low)),
            format!("--comment={comment}"),
            format!("--output={}", first.join("array-%a.out").display()),
        ];
        match self.sbatch(&extra, &first.join("array.sh")) {
            Ok(id) => {
                tracing::info!(steps = %format!("{low}..{high}"), job = %id, tasks = tasks.len(), "submitted to Slurm as a job array");
                for (index, job) in tasks.into_iter().enumerate() {
                    self.metrics.slurm_submitted();
                    self.queued(job, format!("{id}_{index}"));
                }
            }
            Err(why) => {
                tracing::warn!(steps = %format!("{low}..{high}"), "sbatch of a job array failed: {why}");
                for job in tasks {
                    self.ended(job, JobEnd::Failed, format!("sbatch failed: {why}"));
                }
            }
        }
    }
}

/// Bound on the tasks read from one line of `squeue` (`<id>_[0-99999]`).
const MAX_QUEUE_TASKS: usize = 100_000;

/// The job ids one `squeue` id stands for: itself, or for the pending tasks of an array that
/// `squeue` shows as one line, `<id>_[0-3,7%2]`, each task's `<id>_<index>` (the `%` limit
/// dropped).
pub(super) fn queue_ids(id: &str) -> Vec<String> {
    let Some((base, rest)) = id.split_once("_[") else {
        return vec![id.to_string()];
    };
    let ranges = rest.trim_end_matches(']');
    let ranges = ranges.split('%').next().unwrap_or("");
    let mut ids = Vec::new();
    for part in ranges.split(',') {
        let (low, high) = part.split_once('-').unwrap_or((part, part));
        let (Ok(low), Ok(high)) = (low.trim().parse::<usize>(), high.trim().parse::<usize>())
        else {
            continue;
        };
        for index in low..=high.min(low.saturating_add(MAX_QUEUE_TASKS)) {
            if ids.len() >= MAX_QUEUE_TASKS {
                return ids;
            }
            ids.push(format!("{base}_{index}"));
        }
    }
    ids
}

/// The array's own id in a task's id (`<id>_<index>`, `<id>_[0-3]`), or the job's id.
pub(super) fn array_id(id: &str) -> &str {
    id.split('_').next().unwrap_or(id)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `squeue`'s ids: a job, a running task, and pending tasks folded into one line (with a
    /// limit of tasks at once), each task as `<id>_<index>`; the array's id of a task.
    #[test]
    fn queue_ids_expand_an_arrays_pending_tasks() {
        assert_eq!(queue_ids("41"), ["41"]);
        assert_eq!(queue_ids("42_3"), ["42_3"]);
        assert_eq!(queue_ids("42_[0-3]"), ["42_0", "42_1", "42_2", "42_3"]);
        assert_eq!(queue_ids("42_[1,4-5%2]"), ["42_1", "42_4", "42_5"]);
        assert_eq!(queue_ids("42_[x-y]"), Vec::<String>::new());
        assert_eq!(queue_ids("42_[0-99999999999]").len(), MAX_QUEUE_TASKS);
        assert_eq!(array_id("42_3"), "42");
        assert_eq!(array_id("42_[0-3]"), "42");
        assert_eq!(array_id("41"), "41");
    }
}
