//! What the daemon opens before its threads start, for one run ([`super::run`]) and for each
//! run of a sweep (`sweep.rs`): a run's history, state, alerter and outputs ([`open`]), what a
//! recorded outcome goes to ([`Published`]), the bound between its executor and its recorder,
//! and the daemon's HTTP port and tokio runtime ([`bind`], [`serve`]).

use super::executor::Outcome;
use super::outputs::{Alerts, Console, RunOutput, RunOutputs, Tracker};
use super::pace::Pace;
use super::recorder::Recorder;
use super::run_state::RunState;
use crate::alerts::Alerter;
use crate::config::Config;
use crate::daemon::http::RunView;
use crate::metrics::Metrics;
use crate::store::lock::StateLock;
use anyhow::{Context, Result};
use std::net::SocketAddr;
use std::sync::Arc;

/// How many outcomes may wait between the executor and the recorder.
pub(super) const OUTCOMES_BOUND: usize = 16;

/// A run's state, its outputs and its pace: what a recorded outcome goes to, in order.
pub(super) struct Published {
    pub(super) state: RunState,
    pub(super) outputs: RunOutputs,
    /// Shared with the run's watcher, which tells it the checkpoints it offers.
    pub(super) pace: Arc<Pace>,
}

impl Published {
    pub(super) fn recorded(&mut self, outcome: Outcome, at: &str) {
        let event = self.state.observe(&outcome, at);
        if let Outcome::Done(item, record) = &outcome {
            self.outputs
                .evaluation(&item.key, record, self.state.detector());
            self.pace.evaluated(record);
        }
        if let Some(event) = event {
            self.outputs.event(&event);
        }
    }
}

/// A run's pipeline up to its executor, as [`open`] leaves it.
pub(super) struct Opened {
    pub(super) recorder: Recorder,
    pub(super) published: Published,
    /// Its name, metrics, status and live snapshot, for the HTTP server.
    pub(super) view: RunView,
    /// Evaluations in its history (the executor's `pfd.every` count).
    pub(super) evaluated_before: usize,
}

/// Opens a run whose state folder is locked: its history (rewriting the HDF5 export), its
/// state replayed from it, its alerter (on `runtime`) and outputs, which get the replay's events
/// again (the alerter delivers only those not delivered yet); records a crash the last process
/// left, and (with `arm`) arms a fresh crash marker: not for a run joining a sweep while another
/// run's checkpoint may be evaluated, whose marker the evaluator holds; the evaluator arms the
/// run's own before its first item. The one set-up of a single run and of each run of a sweep.
///
/// Everything it writes goes through `lock`'s state folder handle (`crate::store::state_dir`).
/// `console`: the run's console output (a sweep's names the run on each line).
pub(super) fn open(
    config: &Config,
    lock: &StateLock,
    runtime: &tokio::runtime::Handle,
    arm: bool,
    console: Console,
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
    // The executor's own series only: the Slurm jobs' with the Slurm executor.
    let metrics = Arc::new(Metrics::of_run(
        &run,
        config.evaluation.executor,
        config.early_stop.metric,
    ));
    recorder.write_hdf5();
    let instance = crate::alerts::run_instance(&config.run.dir, state.shown());
    let (run_state, replayed) = RunState::replay(
        &run,
        &instance,
        config.early_stop_resolved(),
        recorder.entries(),
        metrics.clone(),
        config.early_stop.keep_best.then(|| {
            crate::store::keep_best::keeper::Keeper::new(&state_dir).showing(state.shown())
        }),
    );
    if replayed.evaluations > 0 {
        tracing::info!(run = %run, evaluations = replayed.evaluations, state = %state.shown().display(), "history restored");
    }
    // The parameterization check's warning of an earlier start, until this one checks again.
    if let Some(w) = crate::store::parameterization::read(&state_dir) {
        let snapshot = run_state.snapshot();
        let mut shown = snapshot.lock().unwrap_or_else(|e| e.into_inner());
        shown.parameterization = Some((w.step, w.warning));
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
    let mut outputs: Vec<Box<dyn RunOutput>> = vec![Box::new(console), Box::new(Alerts(alerter))];
    if let Some(tb) = &config.trackers.tensorboard {
        outputs.push(Box::new(Tracker(Box::new(
            crate::trackers::Tensorboard::open(
                tb,
                &run,
                recorder.entries(),
                config.early_stop_resolved(),
            ),
        ))));
    }
    if let Some(mlflow) = &config.trackers.mlflow {
        outputs.push(Box::new(Tracker(Box::new(crate::trackers::Mlflow::open(
            mlflow,
            &run,
            &state_dir,
            recorder.entries(),
            config.early_stop_resolved(),
            runtime,
        )))));
    }
    let mut outputs = RunOutputs::new(outputs);
    outputs.replayed(&replayed.events)?;
    let view = RunView {
        name: run,
        metrics,
        status: run_state.status(),
        snapshot: run_state.snapshot(),
    };
    let mut published = Published {
        state: run_state,
        outputs,
        pace: Arc::new(Pace::new(
            config,
            super::choice::capacity(config),
            view.metrics.clone(),
        )),
    };
    if let Some(crash) = crash {
        recorder.record_crash(crash, &mut |outcome, at| published.recorded(outcome, at));
    }
    if arm {
        crate::store::crash::arm(&state_dir)?;
        crate::store::package_trial::keep_in(&state_dir);
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
pub(super) fn bind(config: &Config) -> Result<(std::net::TcpListener, tokio::runtime::Runtime)> {
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
pub(super) fn serve(
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Confirmation, EarlyStopMetric, EarlyStopSettings, Smoother};
    use crate::daemon::outputs;
    use crate::daemon::tests::item;
    use crate::record::{Evaluation, FailureReason};
    use std::sync::Mutex;

    /// A recorded evaluation goes to the run's state, then to the outputs: first the evaluation,
    /// then the event it decided; a failure goes to no output.
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
            memorization_level: 0.05,
        };
        let (state, _) =
            RunState::replay("r", "", early_stop, &[], Arc::new(Metrics::new("r")), None);
        let lines = Arc::new(Mutex::new(Vec::new()));
        let log = outputs::tests::Log {
            name: "log",
            lines: lines.clone(),
        };
        let status = state.status();
        let metrics = Arc::new(Metrics::new("r"));
        let config = crate::daemon::pace::tests::config();
        let mut published = Published {
            state,
            outputs: RunOutputs::new(vec![Box::new(log)]),
            pace: Arc::new(Pace::new(
                &config,
                crate::daemon::pace::tests::capacity(),
                metrics,
            )),
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
