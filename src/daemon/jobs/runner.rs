//! The executor that ties the jobs together: [`Jobs`] (one run) and [`Pool`] (the runs of a
//! sweep) each start a runner per run on a thread of its own, which takes work items, has them
//! submitted (`submit.rs`) and polled (`poll.rs`), and hands their outcomes on in the order it
//! took them.

use super::error::JobsError;
use super::journal::{ArrayTask, JOURNAL, Journaled, read_journal};
use super::scheduler::{JobEnd, Scheduler};
use super::slots::Slots;
use crate::config::Config;
use crate::daemon::executor::{Executor, ExecutorError, Lane, Outcome};
use crate::daemon::watcher::WorkItem;
use crate::metrics::Metrics;
use crate::store::history::CheckpointKey;
use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};
use std::collections::{HashMap, VecDeque};
use std::path::PathBuf;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long the runner waits for the watcher's next item before it submits what it has taken:
/// the items taken within it go as one batch. Short against a scheduler's seconds, long enough
/// for a watcher thread on a busy machine to offer the next waiting checkpoint.
const GATHER: Duration = Duration::from_millis(250);

/// The folder of the jobs' scripts, outputs and results, in the state folder.
pub const JOBS_DIR: &str = "jobs";

/// The executor of one run: its jobs go to `scheduler` (see the module's docs, `jobs/mod.rs`).
pub struct Jobs<S> {
    pub scheduler: S,
    pub config: Config,
    pub metrics: Arc<Metrics>,
    /// Evaluations in the history before this start (`pfd.every`, and whether the caches
    /// exist).
    pub evaluated_before: usize,
}

/// What the thread works with.
pub(super) struct Runner<S> {
    pub(super) scheduler: S,
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

impl<S> Drop for Runner<S> {
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
    /// Submitted as `job_id` (`None`: journaled, the scheduler's answer lost; looked up by its
    /// tag).
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

impl<S: Scheduler> Executor for Jobs<S> {
    fn start(
        self,
        work: Receiver<WorkItem>,
        outcomes: Sender<Outcome>,
    ) -> Result<JoinHandle<()>, ExecutorError> {
        let pool = Pool::new(self.config.evaluation.max_in_flight);
        let runner = Runner::new(
            self.scheduler,
            &self.config,
            self.metrics,
            self.evaluated_before,
            &pool,
            None,
        )
        .map_err(ExecutorError::Jobs)?;
        runner.spawn(work, outcomes)
    }
}

/// The in-flight cap that the runs of a sweep share (`evaluation.max_in_flight`): one slot per
/// job in flight, whichever run it belongs to. A run that wants a slot while none is free
/// queues for one; the runs queued are served in the order they asked (see [`Slots::try_take`]).
#[derive(Clone)]
pub struct Pool {
    slots: Arc<Slots>,
}

impl Pool {
    /// A pool of `max_in_flight` slots.
    pub fn new(max_in_flight: usize) -> Pool {
        Pool {
            slots: Arc::new(Slots::new(max_in_flight)),
        }
    }

    /// Starts the runner of one run of a sweep on its own thread: its jobs run
    /// `diffmon eval --run <name>` on the config file `lane.config.source`, and it takes its
    /// slots from this pool; its jobs go to `scheduler`. A lane may be started at any time, also
    /// while others run.
    pub fn start_lane<S: Scheduler>(
        &self,
        scheduler: S,
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
            scheduler,
            &config,
            metrics,
            evaluated_before,
            self,
            Some(config.run_name()),
        )
        .map_err(ExecutorError::Jobs)?;
        runner.spawn(work, outcomes)
    }
}

impl<S: Scheduler> Runner<S> {
    fn new(
        scheduler: S,
        config: &Config,
        metrics: Arc<Metrics>,
        evaluated_before: usize,
        pool: &Pool,
        sweep_run: Option<String>,
    ) -> Result<Runner<S>, JobsError> {
        let state_dir = config.state_dir();
        let jobs_dir = state_dir.join(JOBS_DIR);
        crate::store::safe_fs::create_private_dir(&jobs_dir).map_err(|source| {
            JobsError::JobsDir {
                path: jobs_dir.clone(),
                source,
            }
        })?;
        let journal_path = state_dir.join(JOURNAL);
        let journaled = read_journal(&journal_path)?;
        let journal =
            crate::store::safe_fs::open_private_append(&journal_path).map_err(|source| {
                JobsError::Journal {
                    path: journal_path.clone(),
                    source,
                }
            })?;
        let config_file = config
            .source
            .clone()
            .ok_or(JobsError::NoConfigFile(S::NAME))?;
        let binary = match scheduler.binary() {
            Some(b) => b.to_path_buf(),
            None => std::env::current_exe().map_err(|e| JobsError::NoBinary(S::BINARY_KEY, e))?,
        };
        Ok(Runner {
            scheduler,
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
            .name(format!("diffmon-{}", S::NAME.to_lowercase()))
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
                    self.slots.wait(self.scheduler.poll());
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
                    match work.recv_timeout(self.scheduler.poll()) {
                        Ok(item) => pending = Some(item),
                        Err(RecvTimeoutError::Disconnected) => open = false,
                        Err(RecvTimeoutError::Timeout) => {}
                    }
                } else if free && pending.is_some() {
                    // Woken early when another run's job gives its slot back.
                    self.slots.wait(self.scheduler.poll());
                } else {
                    std::thread::sleep(self.scheduler.poll());
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
                    tracing::info!(step = job.item.step, job = ?j.job_id, folder = %folder.display(), "adopting the {} job of an earlier start", S::NAME);
                    if j.job_id.is_none() && !folder.join("status").exists() {
                        self.find_by_tag(&mut job);
                    }
                }
                Some(reason) => {
                    // Its failure was journaled, its retry not yet submitted.
                    let end = JobEnd::of_label(reason);
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
