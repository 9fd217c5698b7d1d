//! The Slurm executor (`evaluation.executor: slurm`, docs/design.md §18): each work item becomes
//! a Slurm job that runs `diffmon eval --json` on a compute node and leaves its record in the
//! state folder, which the compute nodes share with the daemon.
//!
//! - **Jobs.** Each attempt has its own folder `<state_dir>/jobs/<step>-<attempt>-<token>/`
//!   (created exclusively, mode 0700) holding the script `job.sh`, Slurm's output `slurm.out`,
//!   and what the script leaves: `record.json` (the record, renamed into place) and then
//!   `status` (the exit status of `diffmon eval`, renamed into place after the record).
//! - **Durability.** `<state_dir>/jobs.jsonl` journals every attempt before it is submitted
//!   (`submitting`: the item's key, the attempt, the folder) and its job id once `sbatch`
//!   answers (`submitted`), and every job that ended without a result (`failed`, with the
//!   reason), each line synced before anything relies on it. A separate journal, not entries in
//!   the history: the history holds outcomes, which every reader of it (replay, report, the
//!   HDF5 export) understands; job ids are this executor's business. A restarted daemon is
//!   offered the unrecorded checkpoints again and adopts their journaled jobs instead of
//!   submitting new ones; an attempt journaled without an id (the daemon died during `sbatch`)
//!   is looked up in the queue by the folder name, which every job carries as its comment.
//! - **Arrays.** Items taken together (several waiting, as many slots free) go as one job
//!   array (`sbatch --array=0-<k-1>`, at most [`MAX_ARRAY_TASKS`] tasks): each task has its
//!   attempt folder and journal lines as a single job does (`submitting` names the array's
//!   comment and the task's index, `submitted` the task's id `<id>_<index>`); the driver
//!   `array.sh` in the first task's folder runs the task's `job.sh`. A retry is a job alone.
//! - **Order.** Outcomes are handed on in the order the items were taken (the watcher's order,
//!   the lowest step first): a finished job waits for the earlier ones, so the detector sees
//!   the sequence the local executor gives.
//! - **Faults.** A job that fails, times out, is cancelled or preempted, or leaves the queue
//!   without a status, is counted (`diffmon_slurm_jobs_failed_total{reason}`) and submitted
//!   again, up to `evaluation.retries` times; then the checkpoint is a failure with
//!   reason `job_failed`, `job_timeout`, `job_cancelled` or `job_lost`. `diffmon eval` exiting
//!   non-zero is the checkpoint's failure, with the reason its failure line gives (the local
//!   executor's: `unreadable`, `mismatch`, ...), not retried: it would fail again. A job
//!   stopped by SIGTERM (scancel, the time limit, preemption) writes no status, so its reason is
//!   the job's state in Slurm, not the signal's exit status (which raced with it under load).
//!   When `squeue` cannot reach the controller, jobs are left as they were until it answers.
//! - **Caches.** Until one job has delivered a record (or the history has evaluations), one job
//!   runs at a time: that first job computes the PFD caches in `<state_dir>/cache/`, and the
//!   later ones read them instead of each computing them.
//! - **Sweeps.** Each run of a sweep has its own runner ([`SlurmPool::start_lane`]): its own
//!   journal, jobs folder and caches in its state folder, its own first job alone. The runs
//!   share one `evaluation.max_in_flight` ([`SlurmPool`]): a run takes a slot per job in
//!   flight, and runs waiting for one are served first come, first served, so a run with a
//!   deep backlog cannot starve the others. Its jobs run `diffmon eval --run <name>`.
//!
//! No libtorch object lives in this executor: it only writes files and runs Slurm's commands.

use super::executor::{ExecutorError, Lane, Outcome, unchanged};
use crate::config::{Config, SlurmConfig};
use crate::daemon::watcher::WorkItem;
use crate::metrics::Metrics;
use crate::record::{Evaluation, FailureReason};
use crate::store::history::CheckpointKey;
use crate::store::safe_fs::untrusted;
use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};
use serde::{Deserialize, Serialize};
use std::collections::{HashMap, VecDeque};
use std::fs::OpenOptions;
use std::io::{Read, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// The journal of submitted jobs, in the state folder.
pub const JOURNAL: &str = "jobs.jsonl";
/// How long the runner waits for the watcher's next item before it submits what it has taken:
/// the items taken within it go as one job array. Short against Slurm's seconds of scheduling,
/// long enough for a watcher thread on a busy machine to offer the next waiting checkpoint.
const GATHER: Duration = Duration::from_millis(250);
/// The folder of the jobs' scripts, outputs and results, in the state folder.
pub const JOBS_DIR: &str = "jobs";
/// Bound on what is read of a job's record or status file.
const MAX_RESULT_BYTES: u64 = 16 << 20;
/// Most tasks in one job array (Slurm's default `MaxArraySize` is 1001).
const MAX_ARRAY_TASKS: usize = 1000;
/// Bound on the journal read at start.
const MAX_JOURNAL_BYTES: u64 = 256 << 20;

#[derive(Debug, thiserror::Error)]
pub enum SlurmError {
    #[error("cannot open the jobs journal {path}")]
    Journal {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("the jobs journal {path} is corrupt at line {line}")]
    Corrupt {
        path: PathBuf,
        line: usize,
        #[source]
        source: serde_json::Error,
    },
    #[error("cannot create the jobs folder {path}")]
    JobsDir {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("the Slurm executor needs the config file's path (the jobs read it)")]
    NoConfigFile,
    #[error("cannot find diffmon's own executable for the jobs (set evaluation.slurm.binary)")]
    NoBinary(#[source] std::io::Error),
}

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
struct Journaled {
    attempt: usize,
    folder: String,
    array: Option<ArrayTask>,
    job_id: Option<String>,
    failed: Option<String>,
}

/// How a job ended without a result: the metric's `reason`, and the checkpoint's failure when
/// no retry is left.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum JobEnd {
    Failed,
    Timeout,
    Cancelled,
    Preempted,
    Lost,
}

impl JobEnd {
    fn label(self) -> &'static str {
        match self {
            JobEnd::Failed => "failed",
            JobEnd::Timeout => "timeout",
            JobEnd::Cancelled => "cancelled",
            JobEnd::Preempted => "preempted",
            JobEnd::Lost => "lost",
        }
    }

    fn reason(self) -> FailureReason {
        match self {
            JobEnd::Failed => FailureReason::JobFailed,
            JobEnd::Timeout => FailureReason::JobTimeout,
            JobEnd::Cancelled | JobEnd::Preempted => FailureReason::JobCancelled,
            JobEnd::Lost => FailureReason::JobLost,
        }
    }

    /// A finished job's `JobState` (from `scontrol show job`); `None` while it may still give
    /// a result.
    fn of_state(state: &str) -> Option<JobEnd> {
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
}

/// The executor: see the module's docs.
pub struct Slurm {
    pub config: Config,
    pub metrics: Arc<Metrics>,
    /// Evaluations in the history before this start (`pfd.every`, and whether the caches
    /// exist).
    pub evaluated_before: usize,
}

/// What the thread works with.
struct Runner {
    settings: SlurmConfig,
    max_in_flight: usize,
    /// Resubmissions of a job that ended without a result (`evaluation.retries`).
    retries: usize,
    run: String,
    config_file: PathBuf,
    binary: PathBuf,
    jobs_dir: PathBuf,
    journal_path: PathBuf,
    journal: std::fs::File,
    journaled: HashMap<CheckpointKey, Journaled>,
    metrics: Arc<Metrics>,
    /// Items taken so far, plus the history's evaluations: the next job's `pfd.every` index.
    index: usize,
    /// A record has come back (or the history has one): the caches exist.
    warm: bool,
    /// The in-flight cap shared with the other runs of a sweep, this run's ticket in it and
    /// the slots its jobs hold.
    slots: Arc<Slots>,
    ticket: u64,
    held: usize,
    /// The run's name in a sweep's config file (`diffmon eval --run`); `None` for one run.
    sweep_run: Option<String>,
}

impl Drop for Runner {
    fn drop(&mut self) {
        self.slots.give_back(self.held);
        self.slots.leave(self.ticket);
    }
}

#[derive(Debug)]
enum State {
    /// Taken, holding a slot; submitted (alone or with others as an array) once the items
    /// waiting now are taken.
    Unsubmitted,
    /// Submitted as `job_id` (`None`: journaled, `sbatch`'s answer lost; looked up by comment).
    Queued {
        job_id: Option<String>,
        since: Instant,
        running_since: Option<Instant>,
    },
    Finished(Outcome),
}

#[derive(Debug)]
struct Job {
    item: WorkItem,
    index: usize,
    attempt: usize,
    folder: String,
    state: State,
    /// Holds one of the shared slots (given back once the job is finished).
    slot: bool,
    /// The attempt is a task of a job array.
    array: Option<ArrayTask>,
}

impl Job {
    /// In flight: holds its slot.
    fn queued(&self) -> bool {
        matches!(self.state, State::Queued { .. } | State::Unsubmitted)
    }
}

impl super::executor::Executor for Slurm {
    fn start(
        self,
        work: Receiver<WorkItem>,
        outcomes: Sender<Outcome>,
    ) -> Result<JoinHandle<()>, ExecutorError> {
        let pool = SlurmPool::new(self.config.evaluation.max_in_flight);
        let runner = Runner::new(
            &self.config,
            self.metrics,
            self.evaluated_before,
            &pool,
            None,
        )
        .map_err(ExecutorError::Slurm)?;
        runner.spawn(work, outcomes)
    }
}

/// The in-flight cap that the runs of a sweep share (`evaluation.max_in_flight`): one slot per
/// job in flight, whichever run it belongs to. A run that wants a slot while none is free
/// queues for one; the runs queued are served in the order they asked (see [`Slots::try_take`]).
#[derive(Clone)]
pub struct SlurmPool {
    slots: Arc<Slots>,
}

impl SlurmPool {
    /// A pool of `max_in_flight` slots.
    pub fn new(max_in_flight: usize) -> SlurmPool {
        SlurmPool {
            slots: Arc::new(Slots::new(max_in_flight)),
        }
    }

    /// Starts the runner of one run of a sweep on its own thread: its jobs run
    /// `diffmon eval --run <name>` on the config file `lane.config.source`, and it takes its
    /// slots from this pool. A lane may be started at any time, also while others run.
    pub fn start_lane(
        &self,
        lane: Lane,
        metrics: Arc<Metrics>,
    ) -> Result<JoinHandle<()>, ExecutorError> {
        let Lane {
            config,
            evaluated_before,
            work,
            outcomes,
        } = lane;
        let runner = Runner::new(
            &config,
            metrics,
            evaluated_before,
            self,
            Some(config.run_name()),
        )
        .map_err(ExecutorError::Slurm)?;
        runner.spawn(work, outcomes)
    }
}

/// The shared slots: how many are taken, and the runs (by their ticket) waiting for one.
struct Slots {
    cap: usize,
    state: Mutex<SlotState>,
    freed: Condvar,
}

#[derive(Default)]
struct SlotState {
    used: usize,
    /// Runs waiting for a slot, in the order they first asked.
    waiting: VecDeque<u64>,
    next_ticket: u64,
}

impl Slots {
    fn new(cap: usize) -> Slots {
        Slots {
            cap: cap.max(1),
            state: Mutex::new(SlotState::default()),
            freed: Condvar::new(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, SlotState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A ticket for a new run.
    fn ticket(&self) -> u64 {
        let mut s = self.lock();
        s.next_ticket += 1;
        s.next_ticket
    }

    /// Takes a slot for `ticket` if one is free for it: free slots go to the runs waiting
    /// longest, so one is free for `ticket` when more are free than runs wait ahead of it.
    /// Otherwise `ticket` waits (keeping its place) and this is false.
    fn try_take(&self, ticket: u64) -> bool {
        let mut s = self.lock();
        let ahead = s
            .waiting
            .iter()
            .position(|&t| t == ticket)
            .unwrap_or(s.waiting.len());
        if s.used + ahead < self.cap {
            s.used += 1;
            s.waiting.retain(|&t| t != ticket);
            true
        } else {
            if !s.waiting.contains(&ticket) {
                s.waiting.push_back(ticket);
            }
            false
        }
    }

    /// Takes a slot even over the cap: a job adopted from an earlier start is in flight already.
    fn take_anyway(&self) {
        self.lock().used += 1;
    }

    /// Gives `n` slots back and wakes the runs waiting.
    fn give_back(&self, n: usize) {
        if n == 0 {
            return;
        }
        let mut s = self.lock();
        s.used = s.used.saturating_sub(n);
        drop(s);
        self.freed.notify_all();
    }

    /// `ticket` no longer waits (its run ended).
    fn leave(&self, ticket: u64) {
        self.lock().waiting.retain(|&t| t != ticket);
        self.freed.notify_all();
    }

    /// Sleeps until a slot is given back, at most `timeout`.
    fn wait(&self, timeout: Duration) {
        let s = self.lock();
        let _ = self.freed.wait_timeout(s, timeout);
    }
}

/// `text` in single quotes for `sh`.
fn quoted(text: &str) -> String {
    format!("'{}'", text.replace('\'', r"'\''"))
}

/// A Slurm job name: `diffmon-<run>-<step>` with characters outside `[A-Za-z0-9._-]` as `_`.
fn job_name(run: &str, step: i64) -> String {
    let run: String = run
        .chars()
        .take(64)
        .map(|c| {
            if c.is_ascii_alphanumeric() || "._-".contains(c) {
                c
            } else {
                '_'
            }
        })
        .collect();
    format!("diffmon-{run}-{step}")
}

/// The script of one job.
fn script(
    binary: &Path,
    config: &Path,
    run: Option<&str>,
    folder: &Path,
    item: &WorkItem,
    index: usize,
) -> String {
    let dir = quoted(&folder.display().to_string());
    let run = run
        .map(|r| format!(" --run {}", quoted(r)))
        .unwrap_or_default();
    format!(
        "#!/bin/sh\n\
         # diffmon watch: evaluation of step {step}\n\
         dir={dir}\n\
         {bin} eval --json --failure-lines --evaluated-before {index} --config {config}{run} -- {checkpoint} > \"$dir/record.json.tmp\"\n\
         status=$?\n\
         # Stopped by SIGTERM (scancel, the time limit, preemption): no status, so the job's\n\
         # state in Slurm says why, not the signal's exit status.\n\
         [ \"$status\" -ne 143 ] || exit 143\n\
         mv -f \"$dir/record.json.tmp\" \"$dir/record.json\"\n\
         echo \"$status\" > \"$dir/status.tmp\" && mv -f \"$dir/status.tmp\" \"$dir/status\"\n\
         exit \"$status\"\n",
        step = item.step,
        bin = quoted(&binary.display().to_string()),
        config = quoted(&config.display().to_string()),
        checkpoint = quoted(&item.path.display().to_string()),
    )
}

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

/// The last lines of a job's output, for a failure's message.
fn output_tail(folder: &Path) -> String {
    let text = read_result(&folder.join("slurm.out"))
        .ok()
        .flatten()
        .unwrap_or_default();
    let lines: Vec<&str> = text.lines().rev().take(3).collect();
    let tail: Vec<&str> = lines.into_iter().rev().collect();
    crate::store::safe_fs::untrusted_text(&tail.join(" | "))
}

/// Reads the journal: the latest attempt of each key.
fn read_journal(path: &Path) -> Result<HashMap<CheckpointKey, Journaled>, SlurmError> {
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

impl Runner {
    fn new(
        config: &Config,
        metrics: Arc<Metrics>,
        evaluated_before: usize,
        pool: &SlurmPool,
        sweep_run: Option<String>,
    ) -> Result<Runner, SlurmError> {
        let state_dir = config.state_dir();
        let jobs_dir = state_dir.join(JOBS_DIR);
        crate::store::safe_fs::create_private_dir(&jobs_dir).map_err(|source| {
            SlurmError::JobsDir {
                path: jobs_dir.clone(),
                source,
            }
        })?;
        let journal_path = state_dir.join(JOURNAL);
        let journaled = read_journal(&journal_path)?;
        let journal = OpenOptions::new()
            .create(true)
            .append(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&journal_path)
            .map_err(|source| SlurmError::Journal {
                path: journal_path.clone(),
                source,
            })?;
        let config_file = config.source.clone().ok_or(SlurmError::NoConfigFile)?;
        let binary = match &config.evaluation.slurm.binary {
            Some(b) => b.clone(),
            None => std::env::current_exe().map_err(SlurmError::NoBinary)?,
        };
        Ok(Runner {
            settings: config.evaluation.slurm.clone(),
            max_in_flight: config.evaluation.max_in_flight,
            retries: config.evaluation.retries,
            run: config.run_name(),
            config_file,
            binary,
            jobs_dir,
            journal_path,
            journal,
            journaled,
            metrics,
            index: evaluated_before,
            warm: evaluated_before > 0,
            slots: pool.slots.clone(),
            ticket: pool.slots.ticket(),
            held: 0,
            sweep_run,
        })
    }

    fn spawn(
        mut self,
        work: Receiver<WorkItem>,
        outcomes: Sender<Outcome>,
    ) -> Result<JoinHandle<()>, ExecutorError> {
        std::thread::Builder::new()
            .name("diffmon-slurm".into())
            .spawn(move || self.run(work, outcomes))
            .map_err(ExecutorError::Spawn)
    }

    /// Appends a line to the journal and syncs it.
    fn journal(&mut self, line: &JournalLine) -> std::io::Result<()> {
        let mut text = serde_json::to_string(line).map_err(std::io::Error::other)?;
        text.push('\n');
        self.journal.write_all(text.as_bytes())?;
        self.journal.sync_data()
    }

    /// Journals `line`, retrying until it is written (a full disk): nothing goes on unjournaled.
    fn journal_surely(&mut self, line: &JournalLine) {
        let mut delay = Duration::from_millis(100);
        while let Err(e) = self.journal(line) {
            tracing::error!(journal = %self.journal_path.display(), "cannot journal a Slurm job, retrying: {e}");
            std::thread::sleep(delay);
            delay = (delay * 2).min(Duration::from_secs(10));
        }
    }

    fn limit(&self) -> usize {
        if self.warm { self.max_in_flight } else { 1 }
    }

    /// This run's jobs in flight.
    fn in_flight(jobs: &VecDeque<Job>) -> usize {
        jobs.iter().filter(|j| j.queued()).count()
    }

    /// Gives back the slots of the jobs that are finished.
    fn settle(&mut self, jobs: &mut VecDeque<Job>) {
        for job in jobs.iter_mut().filter(|j| j.slot && !j.queued()) {
            job.slot = false;
            self.held -= 1;
            self.slots.give_back(1);
        }
    }

    fn run(&mut self, work: Receiver<WorkItem>, outcomes: Sender<Outcome>) {
        let mut jobs: VecDeque<Job> = VecDeque::new();
        // An item taken from the watcher that waits for a shared slot.
        let mut pending: Option<WorkItem> = None;
        let mut open = true;
        loop {
            // Take work while this run may have another job in flight and a slot is free.
            while (open || pending.is_some())
                && Self::in_flight(&jobs) < self.limit()
                && jobs.len() < self.max_in_flight * 4 + 16
            {
                let item = match pending.take() {
                    Some(item) => item,
                    None => {
                        let taken = if jobs.is_empty() {
                            work.recv().map_err(|_| RecvTimeoutError::Disconnected)
                        } else {
                            work.recv_timeout(GATHER)
                        };
                        match taken {
                            Ok(item) => item,
                            Err(RecvTimeoutError::Disconnected) => {
                                open = false;
                                break;
                            }
                            Err(RecvTimeoutError::Timeout) => break,
                        }
                    }
                };
                if self.journaled.contains_key(&item.key) {
                    // Adopted: in flight already, over the cap or not.
                    self.slots.take_anyway();
                } else if !self.slots.try_take(self.ticket) {
                    pending = Some(item);
                    break;
                }
                self.held += 1;
                let job = self.begin(item);
                jobs.push_back(job);
                self.settle(&mut jobs);
            }
            self.submit_taken(&mut jobs);
            self.settle(&mut jobs);
            if jobs.is_empty() {
                if pending.is_some() {
                    self.slots.wait(self.settings.poll);
                    continue;
                }
                if open {
                    continue;
                }
                return;
            }
            self.poll(&mut jobs);
            self.settle(&mut jobs);
            while let Some(State::Finished(_)) = jobs.front().map(|j| &j.state) {
                let job = jobs.pop_front().expect("a front job");
                let State::Finished(outcome) = job.state else {
                    unreachable!()
                };
                if outcomes.send(outcome).is_err() {
                    return;
                }
            }
            if jobs.iter().any(Job::queued) {
                let free = Self::in_flight(&jobs) < self.limit();
                if open && free && pending.is_none() {
                    match work.recv_timeout(self.settings.poll) {
                        Ok(item) => pending = Some(item),
                        Err(RecvTimeoutError::Disconnected) => open = false,
                        Err(RecvTimeoutError::Timeout) => {}
                    }
                } else if free && pending.is_some() {
                    // Woken early when another run's job gives its slot back.
                    self.slots.wait(self.settings.poll);
                } else {
                    std::thread::sleep(self.settings.poll);
                }
            }
        }
    }

    /// A job for a newly taken item: the journaled one when there is one, else a submission.
    fn begin(&mut self, item: WorkItem) -> Job {
        let index = self.index;
        self.index += 1;
        if let Some(j) = self.journaled.remove(&item.key) {
            let folder = self.jobs_dir.join(&j.folder);
            let mut job = Job {
                item,
                index,
                attempt: j.attempt,
                folder: j.folder.clone(),
                state: State::Queued {
                    job_id: j.job_id.clone(),
                    since: Instant::now(),
                    running_since: None,
                },
                slot: true,
                array: j.array.clone(),
            };
            match &j.failed {
                None => {
                    tracing::info!(step = job.item.step, job = ?j.job_id, folder = %folder.display(), "adopting the Slurm job of an earlier start");
                    if j.job_id.is_none() && !folder.join("status").exists() {
                        self.find_by_comment(&mut job);
                    }
                }
                Some(reason) => {
                    // Its failure was journaled, its retry not yet submitted.
                    let end = match reason.as_str() {
                        "timeout" => JobEnd::Timeout,
                        "cancelled" => JobEnd::Cancelled,
                        "preempted" => JobEnd::Preempted,
                        "lost" => JobEnd::Lost,
                        _ => JobEnd::Failed,
                    };
                    self.retry_or_fail(&mut job, end, "journaled before a restart".into());
                }
            }
            return job;
        }
        // Submitted by `submit_taken`, alone or in an array.
        Job {
            item,
            index,
            attempt: 0,
            folder: String::new(),
            state: State::Unsubmitted,
            slot: true,
            array: None,
        }
    }

    /// Submits the jobs taken since the last call: one alone as a job, several as one job
    /// array.
    fn submit_taken(&mut self, jobs: &mut VecDeque<Job>) {
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

    /// An attempt journaled without its id: the queue's job whose comment is its folder, if
    /// any; else it was never submitted, and is now.
    fn find_by_comment(&mut self, job: &mut Job) {
        let out = Command::new("squeue")
            .args(["-h", "--me", "-r", "-o", "%i|%k"])
            .output();
        let Some(out) = out.ok().filter(|o| o.status.success()) else {
            return; // Looked up again at the next poll (the job stays without an id).
        };
        let text = String::from_utf8_lossy(&out.stdout);
        let comment = job.array.as_ref().map_or(&job.folder, |a| &a.comment);
        let found = text.lines().find_map(|l| {
            let (id, c) = l.split_once('|')?;
            (c.trim() == comment).then(|| id.trim().to_string())
        });
        // Any task of the array gives the array's id; this task's is `<id>_<index>`.
        let found = match (&job.array, found) {
            (Some(a), Some(id)) => Some(format!("{}_{}", array_id(&id), a.index)),
            (_, found) => found,
        };
        match found {
            Some(id) => self.queued(job, id),
            None => {
                job.attempt += 1;
                self.submit(job);
            }
        }
    }

    /// A fresh folder name's token: the time and this process.
    fn token() -> String {
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
    fn prepare(&self, job: &mut Job, token: &str) -> bool {
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
    fn sbatch(&self, extra: &[String], script: &Path) -> Result<String, String> {
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
    fn submit(&mut self, job: &mut Job) {
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

    /// The job has Slurm id `id` (from `sbatch`, or found in the queue): journaled, then queued.
    fn queued(&mut self, job: &mut Job, id: String) {
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
    fn ended(&mut self, job: &mut Job, end: JobEnd, message: String) {
        self.metrics.slurm_failed(end.label());
        self.journal_surely(&JournalLine::Failed {
            folder: job.folder.clone(),
            reason: end.label().into(),
        });
        self.retry_or_fail(job, end, message);
    }

    fn retry_or_fail(&mut self, job: &mut Job, end: JobEnd, message: String) {
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

    /// Looks at every queued job once.
    fn poll(&mut self, jobs: &mut VecDeque<Job>) {
        if !jobs.iter().any(Job::queued) {
            return;
        }
        // The queue first, then the files: a job gone from the queue wrote its status before.
        let queue: Option<HashMap<String, String>> = Command::new("squeue")
            .args(["-h", "--me", "-r", "-o", "%i|%T"])
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| {
                String::from_utf8_lossy(&o.stdout)
                    .lines()
                    .filter_map(|l| l.split_once('|'))
                    .flat_map(|(i, s)| {
                        queue_ids(i.trim())
                            .into_iter()
                            .map(move |i| (i, s.trim().to_string()))
                    })
                    .collect()
            });
        if queue.is_none() {
            tracing::warn!("squeue does not answer; the Slurm jobs are left as they are");
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
                        self.metrics.slurm_run(r.elapsed().as_secs_f64());
                    } else {
                        // Started and ended between two polls.
                        self.metrics.slurm_queue_wait(since.elapsed().as_secs_f64());
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
                self.find_by_comment(job);
                continue;
            };
            match queue.get(&id).map(String::as_str) {
                Some("RUNNING" | "COMPLETING") => {
                    running += 1;
                    if running_since.is_none() {
                        self.metrics.slurm_queue_wait(since.elapsed().as_secs_f64());
                        *running_since = Some(Instant::now());
                    }
                }
                Some(_) => {}
                None => {
                    // Gone from the queue without a status: how did it end?
                    let state = scontrol_state(&id);
                    if let Some(end) = match state.as_deref() {
                        Some(s) => JobEnd::of_state(s),
                        None => Some(JobEnd::Lost),
                    } {
                        let message = format!(
                            "job {id} is {}; its output ends: {}",
                            state.as_deref().unwrap_or("unknown to Slurm"),
                            output_tail(&folder)
                        );
                        self.ended(job, end, message);
                    }
                }
            }
        }
        self.metrics.set_slurm_running(running);
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
                    "diffmon eval exited with status {} in Slurm job folder {}: {}",
                    crate::store::safe_fs::untrusted_text(status),
                    folder.display(),
                    output_tail(folder)
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
                tracing::debug!(checkpoint = %untrusted(&item.path), step = item.step, "record read from its Slurm job");
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

/// Bound on the tasks read from one line of `squeue` (`<id>_[0-99999]`).
const MAX_QUEUE_TASKS: usize = 100_000;

/// The job ids one `squeue` id stands for: itself, or for the pending tasks of an array that
/// `squeue` shows as one line, `<id>_[0-3,7%2]`, each task's `<id>_<index>` (the `%` limit
/// dropped).
fn queue_ids(id: &str) -> Vec<String> {
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
fn array_id(id: &str) -> &str {
    id.split('_').next().unwrap_or(id)
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Quoting survives every character a checkpoint's name may hold.
    #[test]
    fn quoted_text_is_one_word_for_sh() {
        for text in ["plain", "it's", "a b", "$(touch x)", "new\nline", "'\"`\\"] {
            let out = Command::new("sh")
                .arg("-c")
                .arg(format!("printf %s {}", quoted(text)))
                .output()
                .unwrap();
            assert_eq!(String::from_utf8_lossy(&out.stdout), text);
        }
    }

    /// The shared cap holds across runs; a slot given back goes to the run that has waited
    /// longest, not to the one that asks again first (a deep backlog does not starve the
    /// others); a run that leaves gives up its place.
    #[test]
    fn shared_slots_are_capped_and_served_first_come_first_served() {
        let slots = Slots::new(2);
        let (deep, a, b) = (slots.ticket(), slots.ticket(), slots.ticket());
        assert!(slots.try_take(deep));
        assert!(slots.try_take(deep));
        assert!(!slots.try_take(deep), "over the cap");
        assert!(!slots.try_take(a));
        assert!(!slots.try_take(b));
        slots.give_back(1);
        // `deep` was refused before `a` and `b` were: its turn.
        assert!(slots.try_take(deep), "deep queued first: its turn");
        assert!(!slots.try_take(deep), "and now it waits behind a and b");
        slots.give_back(1);
        assert!(!slots.try_take(deep), "a waits longer");
        assert!(!slots.try_take(b), "a waits longer");
        assert!(slots.try_take(a));
        slots.give_back(1);
        assert!(!slots.try_take(deep), "b waits longer");
        assert!(slots.try_take(b));
        slots.give_back(2);
        // Two free slots, `deep` alone waiting: it takes both.
        assert!(slots.try_take(deep));
        assert!(slots.try_take(deep));
        // An adopted job counts over the cap; a run that leaves is no longer waited for.
        slots.take_anyway();
        assert!(!slots.try_take(a));
        slots.leave(a);
        slots.give_back(3);
        assert!(slots.try_take(b), "a left: b is first");
        assert!(slots.try_take(b));
        assert!(!slots.try_take(b));
    }

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

    #[test]
    fn job_names_keep_to_safe_characters() {
        assert_eq!(job_name("run 1/x", 300), "diffmon-run_1_x-300");
    }

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

    #[test]
    fn job_states_map_to_ends() {
        assert_eq!(JobEnd::of_state("RUNNING"), None);
        assert_eq!(JobEnd::of_state("TIMEOUT"), Some(JobEnd::Timeout));
        assert_eq!(JobEnd::of_state("CANCELLED"), Some(JobEnd::Cancelled));
        assert_eq!(JobEnd::of_state("NODE_FAIL"), Some(JobEnd::Failed));
        assert_eq!(JobEnd::Preempted.reason(), FailureReason::JobCancelled);
    }
}
