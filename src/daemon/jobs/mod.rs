//! The jobs layer: what any executor that evaluates checkpoints as batch jobs needs, whatever
//! runs them (docs/design.md §18). Each work item becomes a job that runs `diffmon eval --json`
//! elsewhere and leaves its record in the state folder, which the job's machine shares with the
//! daemon. A [`Scheduler`] says how a job is submitted and what the queue says of it; Slurm's is
//! `daemon/slurm/`, and a second one (Kubernetes Jobs, say) implements that trait and nothing
//! else.
//!
//! - **Jobs.** Each attempt has its own folder `<state_dir>/jobs/<step>-<attempt>-<token>/`
//!   (created exclusively, mode 0700) holding the script `job.sh`, the job's output
//!   ([`Scheduler::OUTPUT`]), and what the script leaves: `record.json` (the record, renamed into
//!   place) and then `status` (the exit status of `diffmon eval`, renamed into place after the
//!   record).
//! - **Durability.** `<state_dir>/jobs.jsonl` journals every attempt before it is submitted
//!   (`submitting`: the item's key, the attempt, the folder) and its job id once the scheduler
//!   answers (`submitted`), and every job that ended without a result (`failed`, with the
//!   reason), each line synced before anything relies on it. A separate journal, not entries in
//!   the history: the history holds outcomes, which every reader of it (replay, report, the
//!   HDF5 export) understands; job ids are this layer's business. A restarted daemon is
//!   offered the unrecorded checkpoints again and adopts their journaled jobs instead of
//!   submitting new ones; an attempt journaled without an id (the daemon died during the
//!   submission) is looked up in the queue by its tag, the folder's name.
//! - **Batches.** Items taken together (several waiting, as many slots free) go as one batch
//!   (a Slurm job array) when the scheduler has them ([`Scheduler::max_batch`]): each task has
//!   its attempt folder and journal lines as a single job does (`submitting` names the batch's
//!   tag and the task's index, `submitted` the task's id). A retry is a job alone.
//! - **Order.** Outcomes are handed on in the order the items were taken (the watcher's order,
//!   the lowest step first): a finished job waits for the earlier ones, so the detector sees
//!   the sequence the local executor gives.
//! - **Faults.** A job that fails, times out, is cancelled or preempted, or leaves the queue
//!   without a status, is counted (`diffmon_slurm_jobs_failed_total{reason}`) and submitted
//!   again, up to `evaluation.retries` times; then the checkpoint is a failure with reason
//!   `job_failed`, `job_timeout`, `job_cancelled` or `job_lost` ([`JobEnd`]). `diffmon eval`
//!   exiting non-zero is the checkpoint's failure, with the reason its failure line gives (the
//!   local executor's: `unreadable`, `mismatch`, ...), not retried: it would fail again; unless
//!   it died while a compiled package ran on trial (its folder holds
//!   [`crate::store::package_trial::JOB_FILE`]): that is the package's death, retried up to
//!   `evaluation.retries` + [`crate::store::package_trial::MAX_STARTS`] times. A job
//!   stopped by SIGTERM (a cancel, a time limit, preemption) writes no status, so its reason is
//!   what the scheduler says of it, not the signal's exit status. When the queue cannot be
//!   read, jobs are left as they were until it answers.
//! - **Caches.** Until one job has delivered a record (or the history has evaluations), one job
//!   runs at a time: that first job computes the PFD caches in `<state_dir>/cache/`, and the
//!   later ones read them instead of each computing them.
//! - **Sweeps.** Each run of a sweep has its own runner ([`Pool::start_lane`]): its own
//!   journal, jobs folder and caches in its state folder, its own first job alone. The runs
//!   share one `evaluation.max_in_flight` ([`Pool`]): a run takes a slot per job in flight, and
//!   runs waiting for one are served first come, first served, so a run with a deep backlog
//!   cannot starve the others. Its jobs run `diffmon eval --run <name>`.
//!
//! No libtorch object lives in this layer: it only writes files and asks its scheduler.
//!
//! The files: `script.rs` (what a job runs: its `job.sh`), `journal.rs` (`jobs.jsonl`: its
//! lines, and reading them), `submit.rs` (each attempt journaled, then submitted alone or in a
//! batch; retries), `poll.rs` (the queue, and the result files a job leaves), `slots.rs` (the
//! in-flight cap the runs of a sweep share), `runner.rs` (the executor that ties them: a run's
//! thread, which takes work and hands outcomes on in order) and `error.rs` (why it cannot
//! start).

// `pub(super)`: the executor's error (`daemon/executor.rs`) names `JobsError` here, not through
// this file's re-export, which would make the two files import each other.
pub(super) mod error;
mod journal;
mod poll;
mod runner;
mod script;
mod slots;
mod submit;

mod scheduler;

pub use error::JobsError;
pub use journal::{ArrayTask, JOURNAL, JournalLine, job_ids_per_step, submissions_per_step};
pub use runner::{JOBS_DIR, Jobs, Pool};
pub use scheduler::{JobEnd, Scheduler};
pub use script::quoted;
