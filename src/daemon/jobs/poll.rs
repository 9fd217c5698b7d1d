//! Polling: the queue and how a job that left it ended (both from the [`Scheduler`]), and the
//! result files a job leaves in its folder (`status`, `record.json`, its output).

use super::runner::{Job, Runner, State};
use super::scheduler::{JobEnd, Scheduler};
use crate::daemon::executor::{Outcome, unchanged};
use crate::record::{Evaluation, FailureReason};
use crate::store::package_trial;
use crate::store::safe_fs::untrusted;
use std::collections::VecDeque;
use std::fs::OpenOptions;
use std::io::Read;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::time::Instant;

/// Bound on what is read of a job's record or status file.
const MAX_RESULT_BYTES: u64 = 16 << 20;

/// Reads at most [`MAX_RESULT_BYTES`] of `path` (no link followed); `None` when it is absent.
fn read_result(path: &Path) -> std::io::Result<Option<String>> {
    let file = match OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)
    {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e),
    };
    let mut text = String::new();
    file.take(MAX_RESULT_BYTES).read_to_string(&mut text)?;
    Ok(Some(text))
}

/// The last lines of a job's output (the file `output` in its folder), for a failure's message.
fn output_tail(folder: &Path, output: &str) -> String {
    let text = read_result(&folder.join(output))
        .ok()
        .flatten()
        .unwrap_or_default();
    let lines: Vec<&str> = text.lines().rev().take(3).collect();
    let tail: Vec<&str> = lines.into_iter().rev().collect();
    crate::store::safe_fs::untrusted_text(&tail.join(" | "))
}

impl<S: Scheduler> Runner<S> {
    /// An attempt journaled without its id: the queued job tagged with its folder's name (or
    /// its batch's tag), if any; else it was never submitted, and is now.
    pub(super) fn find_by_tag(&mut self, job: &mut Job) {
        let (tag, task) = match &job.array {
            Some(a) => (&a.comment, Some(a.index)),
            None => (&job.folder, None),
        };
        match self.scheduler.find(tag, task) {
            // Looked up again at the next poll (the job stays without an id).
            None => {}
            Some(Some(id)) => self.queued(job, id),
            Some(None) => {
                job.attempt += 1;
                self.submit(job);
            }
        }
    }

    /// Looks at every queued job once.
    pub(super) fn poll(&mut self, jobs: &mut VecDeque<Job>) {
        if !jobs.iter().any(Job::queued) {
            return;
        }
        // The queue first, then the files: a job gone from the queue wrote its status before.
        let queue = self.scheduler.queue();
        if queue.is_none() {
            tracing::warn!(
                "{}'s queue does not answer; the jobs are left as they are",
                S::NAME
            );
        }
        let mut running = 0;
        for job in jobs.iter_mut() {
            let State::Queued {
                job_id,
                since,
                running_since,
            } = &mut job.state
            else {
                continue;
            };
            let folder = self.jobs_dir.join(&job.folder);
            match read_result(&folder.join("status")) {
                Ok(Some(status)) => {
                    let (since, running_since) = (*since, *running_since);
                    if let Some(r) = running_since {
                        self.metrics.job_run(r.elapsed().as_secs_f64());
                    } else {
                        // Started and ended between two polls.
                        self.metrics.job_queue_wait(since.elapsed().as_secs_f64());
                    }
                    if status.trim() != "0" && package_trial::ran_in_job(&folder) {
                        // Its `diffmon eval` died while a compiled package ran on trial.
                        let message = format!(
                            "diffmon eval exited with status {} while the compiled package ran on \
                             trial; its output ends: {}",
                            crate::store::safe_fs::untrusted_text(status.trim()),
                            output_tail(&folder, S::OUTPUT)
                        );
                        self.ended(job, JobEnd::Failed, message);
                        continue;
                    }
                    let outcome = self.result(job, &folder, status.trim());
                    if matches!(outcome, Outcome::Done(..)) {
                        self.warm = true;
                    }
                    job.state = State::Finished(outcome);
                    continue;
                }
                Ok(None) => {}
                Err(e) => {
                    let outcome = Outcome::Failed(
                        job.item.clone(),
                        FailureReason::Error,
                        format!("cannot read the job's status in {}: {e}", folder.display()),
                    );
                    job.state = State::Finished(outcome);
                    continue;
                }
            }
            let Some(queue) = &queue else {
                continue;
            };
            let Some(id) = job_id.clone() else {
                self.find_by_tag(job);
                continue;
            };
            match queue.get(&id) {
                Some(true) => {
                    running += 1;
                    if running_since.is_none() {
                        self.metrics.job_queue_wait(since.elapsed().as_secs_f64());
                        *running_since = Some(Instant::now());
                    }
                }
                Some(false) => {}
                None => {
                    // Gone from the queue without a status: how did it end?
                    if let Some((end, state)) = self.scheduler.ended(&id) {
                        let message = format!(
                            "job {id} is {state}; its output ends: {}",
                            output_tail(&folder, S::OUTPUT)
                        );
                        self.ended(job, end, message);
                    }
                }
            }
        }
        self.metrics.set_jobs_running(running);
    }

    /// The outcome of a job that wrote its status.
    fn result(&self, job: &Job, folder: &Path, status: &str) -> Outcome {
        let item = job.item.clone();
        if status != "0" {
            // `diffmon eval` says why on its failure line; its reason is the local executor's.
            if let Some((reason, message)) = read_result(&folder.join("record.json"))
                .ok()
                .flatten()
                .and_then(|t| failure_line(&t))
            {
                return Outcome::Failed(item, reason, message);
            }
            return Outcome::Failed(
                item,
                FailureReason::Error,
                format!(
                    "diffmon eval exited with status {} in {} job folder {}: {}",
                    crate::store::safe_fs::untrusted_text(status),
                    S::NAME,
                    folder.display(),
                    output_tail(folder, S::OUTPUT)
                ),
            );
        }
        let record = read_result(&folder.join("record.json"))
            .map_err(|e| e.to_string())
            .and_then(|t| t.ok_or_else(|| "no record.json".to_string()))
            .and_then(|t| {
                let line = t.lines().find(|l| !l.trim().is_empty()).unwrap_or("");
                serde_json::from_str::<Evaluation>(line).map_err(|e| e.to_string())
            });
        match record {
            Ok(_) if !unchanged(&item) => Outcome::Failed(
                item,
                FailureReason::Vanished,
                "the checkpoint was deleted or rewritten during its evaluation".into(),
            ),
            Ok(record) if record.step != item.step => Outcome::Failed(
                item.clone(),
                FailureReason::Error,
                format!(
                    "the job's record is of step {}, not {} ({})",
                    record.step,
                    item.step,
                    folder.display()
                ),
            ),
            Ok(record) => {
                tracing::debug!(checkpoint = %untrusted(&item.path), step = item.step, "record read from its {} job", S::NAME);
                Outcome::Done(item, Box::new(record))
            }
            Err(e) => Outcome::Failed(
                item,
                FailureReason::Error,
                format!("unreadable record in {}: {e}", folder.display()),
            ),
        }
    }
}

/// The reason and message of `diffmon eval --failure-lines`'s failure line in `text`.
fn failure_line(text: &str) -> Option<(FailureReason, String)> {
    let v: serde_json::Value = serde_json::from_str(text.lines().next()?).ok()?;
    let f = v.get("failure")?;
    let reason = f.get("reason")?.as_str()?;
    let reason = FailureReason::ALL
        .into_iter()
        .find(|r| r.as_str() == reason)?;
    let message = f.get("message")?.as_str()?.to_string();
    Some((reason, message))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `diffmon eval --failure-lines`'s line gives the reason; anything else gives none.
    #[test]
    fn failure_lines_give_the_reason_and_message() {
        let line = r#"{"failure":{"step":6,"reason":"unreadable","message":"not a zip"}}"#;
        assert_eq!(
            failure_line(line),
            Some((FailureReason::Unreadable, "not a zip".to_string()))
        );
        for other in [
            "",
            "{}",
            r#"{"failure":{"reason":"made_up","message":"m"}}"#,
            r#"{"step":6,"icr":0.5}"#,
        ] {
            assert_eq!(failure_line(other), None, "{other}");
        }
    }
}
