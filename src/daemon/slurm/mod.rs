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
//!   array (`sbatch --array=0-<k-1>`, at most [`MAX_ARRAY_TASKS`](arrays::MAX_ARRAY_TASKS)
//!   tasks): each task has its attempt folder and journal lines as a single job does
//!   (`submitting` names the array's comment and the task's index, `submitted` the task's id
//!   `<id>_<index>`); the driver `array.sh` in the first task's folder runs the task's
//!   `job.sh`. A retry is a job alone.
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
//!
//! The files, by job: `script.rs` (what a job runs: its `job.sh`), `journal.rs` (`jobs.jsonl`:
//! its lines, and reading them), `submit.rs` (`sbatch`, each attempt journaled, retries),
//! `arrays.rs` (items submitted together as one job array; its tasks' ids), `poll.rs` (`squeue`
//! and `scontrol`, the result files a job leaves), `slots.rs` (the in-flight cap the runs of a
//! sweep share), `runner.rs` (the executor that ties them: a run's thread, which takes work and
//! hands outcomes on in order) and `error.rs` (why it cannot start).

mod arrays;
// `pub(super)`: the executor's error (`daemon/executor.rs`) names `SlurmError` here, not through
// this file's re-export, which would make the two files import each other.
pub(super) mod error;
mod journal;
mod poll;
mod runner;
mod script;
mod slots;
mod submit;

pub use error::SlurmError;
pub use journal::{ArrayTask, JOURNAL, JournalLine, job_ids_per_step, submissions_per_step};
pub use runner::{JOBS_DIR, Slurm, SlurmPool};
