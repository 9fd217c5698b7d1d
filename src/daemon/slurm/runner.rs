//! The executor that ties the jobs together: [`Slurm`] (one run) and [`SlurmPool`] (the runs of
//! a sweep) each start a runner per run on a thread of its own, which takes work items, has
//! them submitted (`submit.rs`, `arrays.rs`) and polled (`poll.rs`), and hands their outcomes on
//! in the order it took them.

use super::error::SlurmError;
use super::journal::{ArrayTask, JOURNAL, Journaled, read_journal};
use super::slots::Slots;
use crate::config::{Config, SlurmConfig};
use crate::daemon::executor::{Executor, ExecutorError, Lane, Outcome};
use crate::daemon::watcher::WorkItem;
use crate::metrics::Metrics;
use crate::record::FailureReason;
use crate::store::history::CheckpointKey;
use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};
use std::collections::{HashMap, VecDeque};
use std::fs::OpenOptions;
use std::os::unix::fs::OpenOptionsExt;
use std::path::PathBuf;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long the runner waits for the watcher's next item before it submits what it has taken:
/// the items taken within it go as one job array. Short against Slurm's seconds of scheduling,
/// long enough for a watcher thread on a busy machine to offer the next waiting checkpoint.
const GATHER: Duration = Duration::from_millis(250);

/// The folder of the jobs' scripts, outputs and results, in the state folder.
pub const JOBS_DIR: &str = "jobs";

/// How a job ended without a result: the metric's `reason`, and the checkpoint's failure when
/// no retry is left.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum JobEnd {
    Failed,
    Timeout,
    Cancelled,
    Preempted,
    Lost,
}

impl JobEnd {
    pub(super) fn label(self) -> &'static str {
        match self {
            JobEnd::Failed => "failed",
            JobEnd::Timeout => "timeout",
            JobEnd::Cancelled => "cancelled",
            JobEnd::Preempted => "preempted",
            JobEnd::Lost => "lost",
        }
    }

    pub(super) fn reason(self) -> FailureReason {
        match self {
            JobEnd::Failed => FailureReason::JobFailed,
            JobEnd::Timeout => FailureReason::JobTimeout,
            JobEnd::Cancelled | JobEnd::Preempted => FailureReason::JobCancelled,
            JobEnd::Lost => FailureReason::JobLost,
        }
    }

    /// A finished job's `JobState` (from `scontrol show job`); `None` while it may still give
    /// a result.
    pub(super) fn of_state(state: &str) -> Option<JobEnd> {
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

/// The executor: see the module's docs (`slurm/mod.rs`).
pub struct Slurm {
    pub config: Config,
    pub metrics: Arc<Metrics>,
    /// Evaluations in the history before this start (`pfd.every`, and whether the caches
    /// exist).
    pub evaluated_before: usize,
}

/// What the thread works with.
pub(super) struct Runner {
    pub(super) settings: SlurmConfig,
    pub(super) max_in_flight: usize,
    /// Resubmissions of a job that ended without a result (`evaluation.retries`).
    pub(super) retries: usize,
    pub(super) run: String,
    pub(super) config_file: PathBuf,
    pub(super) binary: PathBuf,
    pub(super) jobs_dir: PathBuf,
    pub(super) journal_path: PathBuf,
    pub(super) journal: std::fs::File,
    pub(super) journaled: HashMap<CheckpointKey, Journaled>,
    pub(super) metrics: Arc<Metrics>,
    /// Items taken so far, plus the history's evaluations: the next job's `pfd.every` index.
    pub(super) index: usize,
    /// A record has come back (or the history has one): the caches exist.
    pub(super) warm: bool,
    /// The in-flight cap shared with the other runs of a sweep, this run's ticket in it and
    /// the slots its jobs hold.
    pub(super) slots: Arc<Slots>,
    pub(super) ticket: u64,
    pub(super) held: usize,
    /// The run's name in a sweep's config file (`diffmon eval --run`); `None` for one run.
    pub(super) sweep_run: Option<String>,
}

impl Drop for Runner {
    fn drop(&mut self) {
        self.slots.give_back(self.held);
        self.slots.leave(self.ticket);
    }
}

#[derive(Debug)]
pub(super) enum State {
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
pub(super) struct Job {
    pub(super) item: WorkItem,
    pub(super) index: usize,
    pub(super) attempt: usize,
    pub(super) folder: String,
    pub(super) state: State,
    /// Holds one of the shared slots (given back once the job is finished).
    pub(super) slot: bool,
    /// The attempt is a task of a job array.
    pub(super) array: Option<ArrayTask>,
}

impl Job {
    /// In flight: holds its slot.
    pub(super) fn queued(&self) -> bool {
        matches!(self.state, State::Queued { .. } | State::Unsubmitted)
    }
}

impl Executor for Slurm {
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
                if let Some(outcome) = crate::daemon::executor::rotated(&item) {
                    // Never submitted: its outcome waits for its turn in the queue.
                    jobs.push_back(Job {
                        item,
                        index: self.index,
                        attempt: 0,
                        folder: String::new(),
                        state: State::Finished(outcome),
                        slot: false,
                        array: None,
                    });
                    self.index += 1;
                    continue;
                }
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
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn job_states_map_to_ends() {
        assert_eq!(JobEnd::of_state("RUNNING"), None);
        assert_eq!(JobEnd::of_state("TIMEOUT"), Some(JobEnd::Timeout));
        assert_eq!(JobEnd::of_state("CANCELLED"), Some(JobEnd::Cancelled));
        assert_eq!(JobEnd::of_state("NODE_FAIL"), Some(JobEnd::Failed));
        assert_eq!(JobEnd::Preempted.reason(), FailureReason::JobCancelled);
    }
}
