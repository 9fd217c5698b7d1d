//! Polling: the queue and how a job that left it ended (both from the [`Scheduler`]), and the
//! result files a job leaves in its folder (`status`, `record.json`, its output).

use super::runner::{Job, Runner, State};
use super::scheduler::{JobEnd, Scheduler};
use crate::daemon::executor::{Outcome, unchanged};
use crate::record::{Evaluation, FailureReason};
use crate::store::package_trial;
use crate::store::safe_fs::untrusted;
use std::collections::VecDeque;
use std::io::{Read, Seek, SeekFrom};
use std::path::Path;
use std::time::Instant;

/// Bound on what is read of a job's record file.
const MAX_RESULT_BYTES: u64 = 16 << 20;
/// Bound on what is read of a job's status file (an exit status).
const MAX_STATUS_BYTES: u64 = 64;
/// How much of the end of a job's output is read for a failure's message.
const OUTPUT_TAIL_BYTES: u64 = 64 << 10;
/// The most characters of a failure's message that come from a job's files (its output, its
/// failure line, its status): a message is one journal line, and the journal's reader bounds
/// its lines.
const MAX_MESSAGE_CHARS: usize = 4096;

/// Reads at most `max` bytes of `path`: no link followed, no wait on a FIFO, a regular file
/// only; `None` when it is absent.
fn read_result(path: &Path, max: u64) -> std::io::Result<Option<String>> {
    let file = match crate::store::safe_fs::open_regular(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e),
    };
    let mut bytes = Vec::new();
    file.take(max).read_to_end(&mut bytes)?;
    Ok(Some(String::from_utf8_lossy(&bytes).into_owned()))
}

/// The last lines of a job's output (the file `output` in its folder), for a failure's message:
/// read from its last [`OUTPUT_TAIL_BYTES`], shown escaped, its last [`MAX_MESSAGE_CHARS`].
fn output_tail(folder: &Path, output: &str) -> String {
    let read = || -> std::io::Result<String> {
        let mut file = crate::store::safe_fs::open_regular(&folder.join(output))?;
        let len = file.metadata()?.len();
        file.seek(SeekFrom::Start(len.saturating_sub(OUTPUT_TAIL_BYTES)))?;
        let mut bytes = Vec::new();
        file.take(OUTPUT_TAIL_BYTES).read_to_end(&mut bytes)?;
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    };
    let text = read().unwrap_or_default();
    let lines: Vec<&str> = text.lines().rev().take(3).collect();
    let tail: Vec<&str> = lines.into_iter().rev().collect();
    let tail = crate::store::safe_fs::untrusted_text(&tail.join(" | "));
    // Its end says why: what is cut is the start.
    let n = tail.chars().count();
    match tail.char_indices().nth(n.saturating_sub(MAX_MESSAGE_CHARS)) {
        Some((at, _)) if at > 0 => format!("(cut) …{}", &tail[at..]),
        _ => tail,
    }
}

/// `message` (from a job's files) cut to [`MAX_MESSAGE_CHARS`].
fn bounded(message: String) -> String {
    match message.char_indices().nth(MAX_MESSAGE_CHARS) {
        Some((at, _)) => format!("{}… (cut)", &message[..at]),
        None => message,
    }
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
            match read_result(&folder.join("status"), MAX_STATUS_BYTES) {
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
                        // Bounded by its parts: a status of at most 64 bytes, the output's tail.
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
            if let Some((reason, message)) =
                read_result(&folder.join("record.json"), MAX_RESULT_BYTES)
                    .ok()
                    .flatten()
                    .and_then(|t| failure_line(&t))
            {
                return Outcome::Failed(item, reason, bounded(message));
            }
            return Outcome::Failed(
                item,
                FailureReason::Error,
                // Bounded by its parts (cut at its end, the output's tail would lose its reason).
                format!(
                    "diffmon eval exited with status {} in {} job folder {}: {}",
                    crate::store::safe_fs::untrusted_text(status),
                    S::NAME,
                    folder.display(),
                    output_tail(folder, S::OUTPUT)
                ),
            );
        }
        let record = read_result(&folder.join("record.json"), MAX_RESULT_BYTES)
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
            Ok(record) if let Some(what) = out_of_range(&record) => Outcome::Failed(
                item,
                FailureReason::Error,
                format!(
                    "the job's record holds {what}, which no evaluation gives ({})",
                    folder.display()
                ),
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
            Ok(mut record) => {
                tracing::debug!(checkpoint = %untrusted(&item.path), step = item.step, "record read from its {} job", S::NAME);
                // The checkpoint is the one the job was given, whatever its record names.
                record.checkpoint = item.path.display().to_string();
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

/// Values no evaluation gives: a value of magnitude over 1e30 (the plots subtract them, and
/// ±1e308 overflows), or a negative time. `diffmon eval` writes the record; a job's folder is
/// the job's to write, so it is checked as it is read.
fn out_of_range(record: &Evaluation) -> Option<String> {
    fn walk(key: &str, v: &serde_json::Value) -> Option<String> {
        match v {
            serde_json::Value::Number(n) => n
                .as_f64()
                .filter(|x| x.abs() > 1e30 || (key == "seconds" && *x < 0.0))
                .map(|x| format!("{key} = {x:e}")),
            serde_json::Value::Array(a) => a.iter().find_map(|v| walk(key, v)),
            serde_json::Value::Object(o) => o.iter().find_map(|(k, v)| walk(k, v)),
            _ => None,
        }
    }
    walk("", &serde_json::to_value(record).ok()?)
}

/// The reason and message of `diffmon eval --failure-lines`'s failure line in `text`.
fn failure_line(text: &str) -> Option<(FailureReason, String)> {
    let v: serde_json::Value = serde_json::from_str(text.lines().next()?).ok()?;
    let f = v.get("failure")?;
    let reason = f.get("reason")?.as_str()?;
    let reason = FailureReason::ALL
        .into_iter()
        .find(|r| r.as_str() == reason)?;
    let message = crate::store::safe_fs::untrusted_text(f.get("message")?.as_str()?);
    Some((reason, message))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What a job leaves is read bounded and never waited on: a FIFO at its status is an
    /// error at once, a long output gives its last lines (not its first 16 MiB's, and not
    /// nothing for bytes that are not UTF-8), a long message is cut.
    #[test]
    fn a_jobs_files_are_read_bounded_and_never_waited_on() {
        let dir = tempfile::tempdir().unwrap();
        let status = dir.path().join("status");
        let fifo = std::ffi::CString::new(status.as_os_str().as_encoded_bytes()).unwrap();
        assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o600) }, 0);
        let e = read_result(&status, MAX_STATUS_BYTES).unwrap_err();
        assert!(e.to_string().contains("not a regular file"), "{e}");
        assert_eq!(read_result(&dir.path().join("none"), 9).unwrap(), None);
        let mut output = vec![b'x'; 20 << 20];
        output.extend(b"\ncaf\xe9\nREAL LAST LINE: the reason\n");
        std::fs::write(dir.path().join("out"), output).unwrap();
        let tail = output_tail(dir.path(), "out");
        assert!(
            tail.ends_with("caf\u{fffd} | REAL LAST LINE: the reason"),
            "{}",
            &tail[tail.len().saturating_sub(80)..]
        );
        assert!(
            tail.chars().count() <= MAX_MESSAGE_CHARS + 8,
            "{}",
            tail.len()
        );
        let long = bounded("m".repeat(3_000_000));
        assert!(long.ends_with("… (cut)") && long.chars().count() < 4200);
    }

    /// A record with a value no evaluation gives is refused: one that would break the plots
    /// (±1e308), a negative time.
    #[test]
    fn records_with_values_no_evaluation_gives_are_refused() {
        let ok = crate::record::full_record();
        assert_eq!(out_of_range(&ok), None);
        let mut huge = ok.clone();
        huge.icr = Some(1e308);
        assert_eq!(out_of_range(&huge).as_deref(), Some("icr = 1e308"));
        let mut negative = ok.clone();
        negative.seconds = -5.0;
        assert_eq!(out_of_range(&negative).as_deref(), Some("seconds = -5e0"));
    }

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
