//! `diffmon watch`: the pipeline of ARCHITECTURE.md ("Threads"), one stage per module.
//!
//! ```text
//! watcher ──WorkItem──► executor ──Outcome──► recorder ────► RunState ─────► sinks
//! (watcher.rs:          (executor.rs: the     (recorder.rs:   (run_state.rs:  (sinks.rs: console;
//!  notify + rescan,      evaluator thread,     journal, HDF5,  detector,       alerts: stop file,
//!  settle check)         owns tch)             retry queue)    status, live    webhooks)
//!                                                              page, metrics)
//!                                                                  ▲
//!                                                                  └── HTTP (tokio)
//! ```
//!
//! The recorder, the run state and the sinks share the recorder thread, in that order; the
//! main thread waits in `shutdown.rs`, the one way the daemon stops.
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

mod executor;
pub mod http;
mod recorder;
mod run_state;
mod shutdown;
mod sinks;
pub mod slurm;
mod sweep;
pub mod watcher;

use crate::alerts::Alerter;
use crate::config::{Config, ExecutorKind};
use crate::daemon::http::RunView;
use crate::daemon::watcher::{Watcher, work_channel};
use crate::metrics::Metrics;
use crate::store::lock::StateLock;
use anyhow::{Context, Result};
pub(crate) use executor::failure_reason;
use executor::{Executor, Local, Outcome};
use recorder::Recorder;
use run_state::RunState;
use sinks::{Alerts, Console, Sinks};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

/// How many outcomes may wait between the executor and the recorder.
const OUTCOMES_BOUND: usize = 16;

/// A run's state and its sinks: what a recorded outcome goes to, in order.
struct Published {
    state: RunState,
    sinks: Sinks,
}

impl Published {
    fn recorded(&mut self, outcome: Outcome, at: &str) {
        let event = self.state.observe(&outcome, at);
        if let Outcome::Done(_, record) = &outcome {
            self.sinks.evaluation(record, self.state.detector());
        }
        if let Some(event) = event {
            self.sinks.event(&event);
        }
    }
}

/// A run's pipeline up to its executor, as [`open`] leaves it.
struct Opened {
    recorder: Recorder,
    published: Published,
    /// Its name, metrics, status and live snapshot, for the HTTP server.
    view: RunView,
    /// Evaluations in its history (the executor's `pfd.every` count).
    evaluated_before: usize,
}

/// Opens a run whose state folder is locked: its history (rewriting the HDF5 export), its
/// state replayed from it, its alerter (on `runtime`) and sinks, which get the replay's events
/// again (the alerter delivers only those not delivered yet); records a crash the last process
/// left, and (with `arm`) arms a fresh crash marker: not for a run joining a sweep while another
/// run's checkpoint may be evaluated, whose marker the evaluator holds; the evaluator arms the
/// run's own before its first item. The one set-up of a single run and of each run of a sweep.
///
/// Everything it writes goes through `lock`'s state folder handle (`crate::store::state_dir`).
fn open(
    config: &Config,
    lock: &StateLock,
    runtime: &tokio::runtime::Handle,
    arm: bool,
) -> Result<Opened> {
    let run = config.run_name();
    let state = lock.state();
    let state_dir = state.path().to_path_buf();
    let mut recorder = Recorder::open(&state_dir)
        .context("cannot open the history")?
        .following(state.clone());
    let crash = match crate::store::crash::read_marker(&state_dir) {
        Ok(crash) => crash,
        Err(e) => {
            tracing::warn!("{e}; ignoring it");
            None
        }
    };
    let metrics = Arc::new(Metrics::new(&run));
    recorder.write_hdf5();
    let instance = crate::alerts::run_instance(&config.run.dir, state.shown());
    let (run_state, replayed) = RunState::replay(
        &run,
        &instance,
        config.early_stop_resolved(),
        recorder.entries(),
        metrics.clone(),
        config
            .early_stop
            .keep_best
            .then(|| crate::store::keep_best::Keeper::new(&state_dir).showing(state.shown())),
    );
    if replayed.evaluations > 0 {
        tracing::info!(run = %run, evaluations = replayed.evaluations, state = %state.shown().display(), "history restored");
    }
    let alerter = {
        // The alerter's delivery tasks run on this runtime.
        let _guard = runtime.enter();
        let outcome_metrics = metrics.clone();
        Alerter::start(
            &config.alerts,
            &config.run.dir,
            &state_dir,
            &instance,
            Arc::new(move |receiver, outcome| outcome_metrics.delivery(receiver, outcome)),
        )?
    };
    // A state folder deleted under the daemon is made again empty: the alerter writes its key and
    // ledger there again, so a restart does not deliver what was delivered.
    state.on_remade(Box::new(alerter.on_state_remade()));
    let mut sinks = Sinks::new(vec![
        Box::new(Console::default()),
        Box::new(Alerts(alerter)),
    ]);
    for event in &replayed.events {
        sinks.replayed(event)?;
    }
    let view = RunView {
        name: run,
        metrics,
        status: run_state.status(),
        snapshot: run_state.snapshot(),
    };
    let mut published = Published {
        state: run_state,
        sinks,
    };
    if let Some(crash) = crash {
        recorder.record_crash(crash, &mut |outcome, at| published.recorded(outcome, at));
    }
    if arm {
        crate::store::crash::arm(&state_dir)?;
    }
    Ok(Opened {
        recorder,
        published,
        view,
        evaluated_before: replayed.evaluations,
    })
}

/// The daemon's HTTP port, bound at start (a port in use is a start-up error), and its tokio
/// runtime (alerter deliveries, the HTTP server, signals).
fn bind(config: &Config) -> Result<(std::net::TcpListener, tokio::runtime::Runtime)> {
    let listen: SocketAddr = config.http.listen;
    let listener = std::net::TcpListener::bind(listen).with_context(|| {
        format!("cannot listen on {listen} (http.listen): is another process using the port?")
    })?;
    listener.set_nonblocking(true)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("diffmon-io")
        .enable_all()
        .build()?;
    Ok((listener, runtime))
}

/// Serves `app` on the port [`bind`] bound, with the limits of `config.http`, until the task
/// is aborted.
fn serve(
    runtime: &tokio::runtime::Runtime,
    listener: std::net::TcpListener,
    app: axum::Router,
    config: &Config,
) -> tokio::task::JoinHandle<()> {
    let limits = crate::daemon::http::Limits::of(&config.http);
    runtime.spawn(async move {
        let listener =
            tokio::net::TcpListener::from_std(listener).expect("a non-blocking std listener");
        crate::daemon::http::serve(listener, app, limits).await;
    })
}

/// Runs the daemon until a signal: on one run, or on every run of a sweep ([`sweep`]).
pub fn run(config: Config) -> Result<()> {
    if config.is_sweep() {
        return sweep::run(config);
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
    } = open(&config, &lock, runtime.handle(), true)?;
    let (run, metrics) = (view.name, view.metrics);

    let (work_tx, work_rx) = work_channel();
    let (outcome_tx, outcome_rx) = crossbeam_channel::bounded::<Outcome>(OUTCOMES_BOUND);
    let executor = match config.evaluation.executor {
        ExecutorKind::Local => Local {
            config: config.writing_state_through(lock.state().path()),
            evaluated_before,
        }
        .start(work_rx, outcome_tx)?,
        ExecutorKind::Slurm => slurm::Slurm {
            config: config.clone(),
            metrics: metrics.clone(),
            evaluated_before,
        }
        .start(work_rx, outcome_tx)?,
    };

    let (stop, stopped) = shutdown::stop_channel();
    let done = recorder.entries().iter().map(|e| e.key().clone()).collect();
    let watcher = Watcher::new(&config.run.dir, &config.checkpoints, done, metrics.clone())
        .with_excluded(config.named_files())
        .with_crash_marker(lock.state().path())
        .following(lock.state().clone());
    let watcher = std::thread::Builder::new()
        .name("diffmon-watch".into())
        .spawn(move || watcher.run(work_tx, stopped))?;
    let recorder = std::thread::Builder::new()
        .name("diffmon-record".into())
        .spawn(move || {
            recorder.run(outcome_rx, |outcome, at| published.recorded(outcome, at));
            published.sinks
        })?;

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
    let (signalled, sinks) = shutdown::until_stopped(&runtime, stop, watcher, recorder, drain)?;
    let _ = executor.join();
    sinks.close(&runtime);
    server.abort();
    runtime.shutdown_timeout(Duration::from_secs(1));
    tracing::info!("stopped");
    if !signalled {
        anyhow::bail!("the evaluator stopped unexpectedly");
    }
    Ok(())
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use crate::config::{Confirmation, EarlyStopMetric, EarlyStopSettings, Smoother};
    use crate::daemon::watcher::WorkItem;
    use crate::record::{Evaluation, FailureReason};
    use crate::store::history::CheckpointKey;
    use std::sync::Mutex;

    /// A work item for `ckpt_<step>.pt` (the stages' tests share it).
    pub(super) fn item(step: i64) -> WorkItem {
        let path = format!("ckpt_{step}.pt");
        WorkItem {
            path: path.clone().into(),
            step,
            key: CheckpointKey {
                path,
                size: 1000 + step as u64,
                mtime_ns: step,
            },
        }
    }

    /// A recorded evaluation goes to the run's state, then to the sinks: first the evaluation,
    /// then the event it decided; a failure goes to no sink.
    #[test]
    fn a_recorded_outcome_reaches_the_sinks_after_the_run_state() {
        // Window 1, patience 1: 3, 1, 2 turns at the third checkpoint.
        let early_stop = EarlyStopSettings {
            metric: EarlyStopMetric::Icr,
            smoother: Smoother::Median,
            window: 1,
            warmup: 1,
            patience: 1,
            min_rise: 0.005,
            noise_multiple: 0.0,
            confirm: Confirmation::None,
            confirm_rise: 0.5,
        };
        let (state, _) =
            RunState::replay("r", "", early_stop, &[], Arc::new(Metrics::new("r")), None);
        let lines = Arc::new(Mutex::new(Vec::new()));
        let log = sinks::tests::Log {
            name: "log",
            lines: lines.clone(),
        };
        let status = state.status();
        let mut published = Published {
            state,
            sinks: Sinks::new(vec![Box::new(log)]),
        };
        let at = "2024-05-01T12:00:00.000Z";
        for (step, icr) in [(1, 3.0), (2, 1.0), (3, 2.0)] {
            let record = Evaluation {
                step,
                checkpoint: format!("ckpt_{step}.pt"),
                icr: Some(icr),
                ..Evaluation::default()
            };
            published.recorded(Outcome::Done(item(step), Box::new(record)), at);
            if step == 2 {
                let failure = Outcome::Failed(item(9), FailureReason::Error, "no".into());
                published.recorded(failure, at);
            }
        }
        assert_eq!(
            *lines.lock().unwrap(),
            [
                "log evaluation 1",
                "log evaluation 2",
                "log evaluation 3",
                "log early_stop 3"
            ]
        );
        assert!(status.lock().unwrap().fired, "the state saw the turn");
    }
}
