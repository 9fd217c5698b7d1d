//! Submission and the journal: a job's folder and script, each attempt journaled in
//! `jobs.jsonl` before it is submitted (alone, or with the others taken together as one batch)
//! and its id once the scheduler answers; a job that ended without a result journaled, then
//! retried or failed.

use super::journal::{ArrayTask, JournalLine};
use super::runner::{Job, Runner, State};
use super::scheduler::{JobEnd, Scheduler};
use super::script::{job_name, script};
use crate::daemon::executor::Outcome;
use crate::record::FailureReason;
use std::collections::VecDeque;
use std::io::Write;
use std::os::unix::fs::DirBuilderExt;
use std::path::PathBuf;
use std::time::{Duration, Instant};

impl<S: Scheduler> Runner<S> {
    /// Appends a line to the journal and syncs it.
    fn journal(&mut self, line: &JournalLine) -> std::io::Result<()> {
        let mut text = serde_json::to_string(line).map_err(std::io::Error::other)?;
        text.push('\n');
        self.journal.write_all(text.as_bytes())?;
        self.journal.sync_data()
    }

    /// Journals `line`, retrying until it is written (a full disk): nothing goes on unjournaled.
    pub(super) fn journal_surely(&mut self, line: &JournalLine) {
        let mut delay = Duration::from_millis(100);
        while let Err(e) = self.journal(line) {
            tracing::error!(journal = %self.journal_path.display(), "cannot journal a {} job, retrying: {e}", S::NAME);
            std::thread::sleep(delay);
            delay = (delay * 2).min(Duration::from_secs(10));
        }
    }

    /// A fresh folder name's token: the time and this process.
    pub(super) fn token() -> String {
        format!(
            "{:x}{:x}",
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos())
                .unwrap_or(0),
            std::process::id()
        )
    }

    /// Creates the attempt's folder (named with `token`) and its script; on failure the job is
    /// the checkpoint's failure and this is false.
    pub(super) fn prepare(&self, job: &mut Job, token: &str) -> bool {
        job.folder = format!("{}-{}-{token}", job.item.step, job.attempt);
        let folder = self.jobs_dir.join(&job.folder);
        let prepared = std::fs::DirBuilder::new()
            .mode(0o700)
            .create(&folder)
            .and_then(|_| {
                crate::store::safe_fs::atomic_write(
                    &folder.join("job.sh"),
                    script(
                        &self.binary,
                        &self.config_file,
                        self.sweep_run.as_deref(),
                        &folder,
                        &job.item,
                        job.index,
                    )
                    .as_bytes(),
                )
            });
        if let Err(e) = prepared {
            job.state = State::Finished(Outcome::Failed(
                job.item.clone(),
                FailureReason::Error,
                format!("cannot write the job's folder {}: {e}", folder.display()),
            ));
            return false;
        }
        true
    }

    /// Writes the job's folder and script, journals the attempt and submits it as a job of
    /// its own. A submission that fails is a job failure (retried like one).
    pub(super) fn submit(&mut self, job: &mut Job) {
        job.array = None;
        if !self.prepare(job, &Self::token()) {
            return;
        }
        let folder = self.jobs_dir.join(&job.folder);
        self.journal_surely(&JournalLine::Submitting {
            key: job.item.key.clone(),
            step: job.item.step,
            attempt: job.attempt,
            folder: job.folder.clone(),
            array: None,
        });
        let name = job_name(&self.run, job.item.step);
        match self.scheduler.submit(&name, &job.folder, &folder) {
            Ok(id) => {
                self.metrics.job_submitted();
                tracing::info!(step = job.item.step, job = %id, attempt = job.attempt, "submitted to {}", S::NAME);
                self.queued(job, id);
            }
            Err(why) => {
                tracing::warn!(step = job.item.step, "{why}");
                self.ended(job, JobEnd::Failed, why);
            }
        }
    }

    /// The job has id `id` (from its submission, or found in the queue): journaled, then
    /// queued.
    pub(super) fn queued(&mut self, job: &mut Job, id: String) {
        self.journal_surely(&JournalLine::Submitted {
            folder: job.folder.clone(),
            job_id: id.clone(),
        });
        job.state = State::Queued {
            job_id: Some(id),
            since: Instant::now(),
            running_since: None,
        };
    }

    /// A job ended without a result: journaled and counted, then retried or failed.
    pub(super) fn ended(&mut self, job: &mut Job, end: JobEnd, message: String) {
        self.metrics.job_failed(end.as_str());
        self.journal_surely(&JournalLine::Failed {
            folder: job.folder.clone(),
            reason: end.as_str().into(),
        });
        self.retry_or_fail(job, end, message);
    }

    pub(super) fn retry_or_fail(&mut self, job: &mut Job, end: JobEnd, message: String) {
        // A job whose `diffmon eval` died while a compiled package ran on trial died of the
        // package: the trial refuses it after `MAX_STARTS` such deaths (TorchScript evaluates
        // the checkpoint under `auto`), so as many attempts more are its own.
        let retries = if crate::store::package_trial::ran_in_job(&self.jobs_dir.join(&job.folder)) {
            self.retries + crate::store::package_trial::MAX_STARTS as usize
        } else {
            self.retries
        };
        if job.attempt < retries {
            tracing::warn!(
                step = job.item.step,
                reason = end.as_str(),
                "{} job ended without a result ({message}); submitting it again",
                S::NAME
            );
            job.attempt += 1;
            self.submit(job);
        } else {
            job.state = State::Finished(Outcome::Failed(
                job.item.clone(),
                end.reason(),
                format!(
                    "{} job ended without a result ({}) after {} attempt(s): {message}",
                    S::NAME,
                    end.as_str(),
                    job.attempt + 1
                ),
            ));
        }
    }

    /// Submits the jobs taken since the last call: one alone as a job, several as one batch
    /// (as many as the scheduler takes in one) when the scheduler has batches.
    pub(super) fn submit_taken(&mut self, jobs: &mut VecDeque<Job>) {
        let mut taken: Vec<&mut Job> = jobs
            .iter_mut()
            .filter(|j| matches!(j.state, State::Unsubmitted))
            .collect();
        for chunk in taken.chunks_mut(self.scheduler.max_batch().max(1)) {
            match chunk.len() {
                0 => {}
                1 => self.submit(chunk[0]),
                _ => self.submit_batch(chunk),
            }
        }
    }

    /// Submits `jobs` as one batch: task `i` runs the script in the folder of `jobs[i]`, each
    /// journaled as a task of the batch (tag `array-<token>`) and then with its id. A
    /// submission that fails is each job's failure (each retried alone).
    fn submit_batch(&mut self, jobs: &mut [&mut Job]) {
        let token = Self::token();
        let tag = format!("array-{token}");
        let mut tasks: Vec<&mut Job> = Vec::new();
        for job in jobs.iter_mut() {
            if self.prepare(job, &token) {
                tasks.push(job);
            }
        }
        if tasks.is_empty() {
            return;
        }
        for (index, job) in tasks.iter_mut().enumerate() {
            job.array = Some(ArrayTask {
                comment: tag.clone(),
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
        let name = format!("{}-{high}", job_name(&self.run, low));
        let folders: Vec<PathBuf> = tasks
            .iter()
            .map(|j| self.jobs_dir.join(&j.folder))
            .collect();
        match self.scheduler.submit_batch(&name, &tag, &folders) {
            Ok(ids) if ids.len() == tasks.len() => {
                tracing::info!(steps = %format!("{low}..{high}"), tasks = tasks.len(), "submitted to {} as one batch", S::NAME);
                for (job, id) in tasks.into_iter().zip(ids) {
                    self.metrics.job_submitted();
                    self.queued(job, id);
                }
            }
            answer => {
                let why = answer.err().unwrap_or_else(|| {
                    format!(
                        "{} gave a batch of {} tasks another number of ids",
                        S::NAME,
                        tasks.len()
                    )
                });
                tracing::warn!(steps = %format!("{low}..{high}"), "{why}");
                for job in tasks {
                    self.ended(job, JobEnd::Failed, why.clone());
                }
            }
        }
    }
}
