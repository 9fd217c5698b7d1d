//! Submission and the journal: a job's folder and script, `sbatch`, each attempt journaled in
//! `jobs.jsonl` before it is submitted and its id once `sbatch` answers; a job that ended
//! without a result journaled, then retried or failed.

use super::journal::JournalLine;
use super::runner::{Job, JobEnd, Runner, State};
use super::script::{job_name, script};
use crate::daemon::executor::Outcome;
use crate::record::FailureReason;
use std::io::Write;
use std::os::unix::fs::DirBuilderExt;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

impl Runner {
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
            tracing::error!(journal = %self.journal_path.display(), "cannot journal a Slurm job, retrying: {e}");
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

    /// Runs `sbatch` with this executor's options and `extra`, then `script`: the job's id,
    /// or why there is none.
    pub(super) fn sbatch(&self, extra: &[String], script: &Path) -> Result<String, String> {
        let s = &self.settings;
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
            Ok(out) => {
                crate::store::safe_fs::untrusted_text(String::from_utf8_lossy(&out.stderr).trim())
            }
            Err(e) => format!("cannot run sbatch: {e}"),
        })
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
        let extra = [
            format!("--job-name={}", job_name(&self.run, job.item.step)),
            format!("--comment={}", job.folder),
            format!("--output={}", folder.join("slurm.out").display()),
        ];
        match self.sbatch(&extra, &folder.join("job.sh")) {
            Ok(id) => {
                self.metrics.slurm_submitted();
                tracing::info!(step = job.item.step, job = %id, attempt = job.attempt, "submitted to Slurm");
                self.queued(job, id);
            }
            Err(why) => {
                tracing::warn!(step = job.item.step, "sbatch failed: {why}");
                self.ended(job, JobEnd::Failed, format!("sbatch failed: {why}"));
            }
        }
    }

    /// The job has Slurm id `id` (from `sbatch`, or found in the queue): journaled, then queued.
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
        self.metrics.slurm_failed(end.label());
        self.journal_surely(&JournalLine::Failed {
            folder: job.folder.clone(),
            reason: end.label().into(),
        });
        self.retry_or_fail(job, end, message);
    }

    pub(super) fn retry_or_fail(&mut self, job: &mut Job, end: JobEnd, message: String) {
        if job.attempt < self.retries {
            tracing::warn!(
                step = job.item.step,
                reason = end.label(),
                "Slurm job ended without a result ({message}); submitting it again"
            );
            job.attempt += 1;
            self.submit(job);
        } else {
            job.state = State::Finished(Outcome::Failed(
                job.item.clone(),
                end.reason(),
                format!(
                    "Slurm job ended without a result ({}) after {} attempt(s): {message}",
                    end.label(),
                    job.attempt + 1
                ),
            ));
        }
    }
}
