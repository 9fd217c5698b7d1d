//! `diffmon watch`: the pipeline of ARCHITECTURE.md ("Threads"), one stage per module.
//!
//! ```text
//! watcher ──WorkItem──► executor ──Outcome──► recorder ────► RunState ─────► outputs
//! (watcher/: offer.rs,  (executor.rs: the     (recorder.rs:   (run_state.rs:  (outputs.rs: console;
//!  scan.rs: rescan +     trait and its         journal, HDF5,  detector,       alerts: stop file,
//!  settle check,         types; choice.rs      retry queue)    status, live    webhooks)
//!  notifications.rs)     picks one: local.rs,                  page, metrics)
//!                        the evaluator thread,                     ▲
//!                        owns tch; jobs/ on                        └── HTTP (http.rs, tokio)
//!                        slurm/: batch jobs)
//! ```
//!
//! The recorder, the run state and the outputs share the recorder thread, in that order; the
//! main thread waits in `shutdown.rs`, the one way the daemon stops. `pipeline.rs` opens what
//! the threads need (a run's history, state and outputs; the HTTP port and the tokio runtime);
//! [`run`] here wires one run's stages, `sweep.rs` those of every run of a sweep. The executors
//! share `executor.rs` and nothing else; `choice.rs` is the one place that chooses one. No file
//! of the daemon imports this one.
//!
//! The recorder appends every outcome to the history before anything acts on it; when the state
//! folder cannot be written (a full disk), outcomes wait in memory, in order, and are retried
//! until they are recorded, then published. The run's state (the detector, the status, the live
//! page, the metrics) is derived from the history by replay at start-up, so it can never
//! disagree with it: a restart neither forgets the best nor fires twice (events carry ids
//! derived from their content, and the alerter delivers each id once). Errors at start (bad
//! architecture, unbindable port, unreadable state) stop the daemon with a message;
//! per-checkpoint problems are logged, counted and survived. The first SIGINT/SIGTERM drains
//! (the evaluation in flight finishes and is recorded, for at most `shutdown_drain_secs`); a
//! second one exits at once (status 130), whatever is blocked.
//!
//! One daemon per state folder: [`crate::store::lock`]. A checkpoint that made the process die (a fatal
//! signal, or a panic of the evaluator) is recorded after the restart as a failure with reason
//! [`crate::record::FailureReason::Crashed`] rather than evaluated again ([`crate::store::crash`]); a
//! panic in any thread ends the process with status 1.

mod choice;
mod executor;
pub mod http;
pub mod jobs;
mod local;
mod outputs;
mod pace;
mod pipeline;
mod recorder;
mod run_state;
mod shutdown;
mod slurm;
mod sweep;
mod until;
pub mod watcher;

use crate::config::Config;
use crate::daemon::watcher::{Watcher, work_channel};
use crate::store::lock::StateLock;
use anyhow::Result;
use executor::Outcome;
pub(crate) use local::failure_reason;
use outputs::Console;
pub use pace::{measured_in_history, pf_ode_every};
use pipeline::{OUTCOMES_BOUND, Opened, bind, open, serve};
use std::time::Duration;
pub use until::Until;

/// How `watch` ended, when it ended well.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ended {
    /// SIGINT or SIGTERM.
    Signalled,
    /// The training job ended (`until`) and every checkpoint it left is recorded; whether the
    /// early stop has fired (and was not resolved since).
    JobEnded { early_stop_fired: bool },
}

/// Runs the daemon until a signal, or with `until` set until the training job ends: on one
/// run, or on every run of a sweep ([`sweep`], which takes no `until`: the caller refuses it).
pub fn run(config: Config, until: Until) -> Result<Ended> {
    if config.is_sweep() {
        return sweep::run(config).map(|()| Ended::Signalled);
    }
    shutdown::exit_on_panic();
    // Held until the process ends (the kernel releases it, however the process ends).
    let lock = StateLock::acquire(&config.state_dir(), &config.run.dir)?;

    let listen = config.http.listen;
    let (listener, runtime) = bind(&config)?;
    let Opened {
        recorder,
        mut published,
        view,
        evaluated_before,
    } = open(&config, &lock, runtime.handle(), true, Console::default())?;
    let (run, metrics) = (view.name, view.metrics);

    let (work_tx, work_rx) = work_channel();
    let (outcome_tx, outcome_rx) = crossbeam_channel::bounded::<Outcome>(OUTCOMES_BOUND);
    let executor = choice::start(
        &config,
        lock.state().path(),
        metrics.clone(),
        evaluated_before,
        work_rx,
        outcome_tx,
    )?;

    let (stop, stopped) = shutdown::stop_channel();
    let done = recorder
        .entries()
        .iter()
        .filter_map(|e| e.done().cloned())
        .collect();
    let mut watcher = Watcher::new(&config.run.dir, &config.checkpoints, done, metrics.clone())
        .pacing(published.pace.clone())
        .with_excluded(config.named_files())
        .with_crash_marker(lock.state().path())
        .with_pins(lock.state().path(), config.early_stop.keep_best)
        .recognizing_kept(lock.state().path())
        .following(lock.state().clone());
    let mut finished = None;
    if until.is_set() {
        let finish = until::Finish::new(until);
        finished = Some(finish.flag());
        watcher = watcher.until(finish);
    }
    let watcher = std::thread::Builder::new()
        .name("diffmon-watch".into())
        .spawn(move || watcher.run(work_tx, stopped))?;
    let recorder = std::thread::Builder::new()
        .name("diffmon-record".into())
        .spawn(move || {
            recorder.run(outcome_rx, |outcome, at| published.recorded(outcome, at));
            published.outputs
        })?;

    let status = view.status.clone();
    let app = crate::daemon::http::router(metrics.clone(), view.status, view.snapshot);
    let server = serve(&runtime, listener, app, &config);
    tracing::info!(
        run = %run,
        dir = %config.run.dir.display(),
        metrics = %format!("http://{listen}/metrics"),
        "watching for checkpoints"
    );
    tracing::info!("{}", config.cost_summary());

    let drain = config.shutdown_drain;
    let (stopped, outputs) =
        shutdown::until_stopped(&runtime, stop, watcher, recorder, drain, finished)?;
    let _ = executor.join();
    outputs.close(&runtime);
    server.abort();
    runtime.shutdown_timeout(Duration::from_secs(1));
    match stopped {
        shutdown::Stopped::Signal => {
            tracing::info!("stopped");
            Ok(Ended::Signalled)
        }
        shutdown::Stopped::JobEnded => {
            let early_stop_fired = status.lock().unwrap_or_else(|e| e.into_inner()).fired;
            let what = if early_stop_fired {
                "the early stop has fired: exiting with status 3"
            } else {
                "the early stop has not fired: exiting with status 0"
            };
            tracing::info!("stopped: {what}");
            Ok(Ended::JobEnded { early_stop_fired })
        }
        shutdown::Stopped::Failed => anyhow::bail!("the evaluator stopped unexpectedly"),
    }
}

#[cfg(test)]
pub(super) mod tests {
    use crate::daemon::watcher::WorkItem;
    use crate::store::history::CheckpointKey;

    /// A work item for `ckpt_<step>.pt` (the stages' tests share it).
    pub(super) fn item(step: i64) -> WorkItem {
        let path = format!("ckpt_{step}.pt");
        WorkItem::new(
            path.clone().into(),
            step,
            CheckpointKey {
                path,
                size: 1000 + step as u64,
                mtime_ns: step,
            },
        )
    }
}
