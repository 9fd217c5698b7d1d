//! `diffmon watch`: the pipeline of ARCHITECTURE.md ("Threads").
//!
//! ```text
//! watcher thread ──WorkItem──► evaluator thread ──Outcome──► recorder thread ──► history (journal + HDF5)
//!  (notify + rescan,   rendezvous  (owns the tch      crossbeam     │  ├──► metrics ◄── HTTP (tokio)
//!   settle check)      channel      model and data)                 │  └──► detector ──Event──► alerts (tokio)
//! ```
//!
//! The recorder appends every outcome to the history before anything acts on it; when the state
//! folder cannot be written (a full disk), outcomes wait in memory, in order, and are retried
//! every [`RECORD_RETRY`] until they are recorded, then published. The detector's
//! state is derived from the history by replay at start-up, so it can never disagree with it: a
//! restart neither forgets the best nor fires twice (events carry ids derived from their content,
//! and the alerter delivers each id once). Errors at start (bad architecture, unbindable port,
//! unreadable state) stop the daemon with a message; per-checkpoint problems are logged, counted
//! and survived. The first SIGINT/SIGTERM drains (the evaluation in flight finishes and is
//! recorded, for at most `shutdown_drain_secs`); a second one exits at once (status 130),
//! whatever is blocked.
//!
//! One daemon per state folder: [`crate::lock`]. A checkpoint that made the process die (a fatal
//! signal, or a panic of the evaluator) is recorded after the restart as a failure with reason
//! [`FailureReason::Crashed`] rather than evaluated again ([`crate::crash`]); a panic in any thread ends the
//! process with status 1.

use crate::alerts::{Alerter, Event, EventKind, event_id};
use crate::config::Config;
use crate::crash::{Crash, InFlight};
use crate::detector::{Best, Decision, Detector, DetectorState, Observation, Signal};
use crate::eval::{EvalError, Evaluator};
use crate::history::{Entry, History};
use crate::http::EarlyStopStatus;
use crate::lock::StateLock;
use crate::metrics::Metrics;
use crate::model::ModelError;
use crate::pfd::PfdError;
use crate::record::{Evaluation, FailureReason};
use crate::report::Snapshot;
use crate::safe_fs::{untrusted, untrusted_text};
use crate::watcher::{Watcher, WorkItem, work_channel};
use anyhow::{Context, Result};
use crossbeam_channel::RecvTimeoutError;
use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// How often the recorder tries again to write outcomes it could not record.
const RECORD_RETRY: Duration = Duration::from_secs(2);

/// What the evaluator thread reports for one work item.
enum Outcome {
    Done(WorkItem, Box<Evaluation>),
    Failed(WorkItem, FailureReason, String),
}

/// Failure reason label of `diffmon_checkpoint_failures_total{reason}`.
fn failure_reason(item: &WorkItem, e: &EvalError) -> FailureReason {
    if crate::unit::key(&item.path).ok().as_ref() != Some(&item.key) {
        return FailureReason::Vanished;
    }
    match e {
        EvalError::Model(ModelError::Weights(_) | ModelError::Load { .. }) => {
            FailureReason::Unreadable
        }
        EvalError::Model(ModelError::Mismatch { .. }) => FailureReason::Mismatch,
        EvalError::Unit(_) => FailureReason::Unreadable,
        EvalError::Invalid { .. } | EvalError::Icr(_) | EvalError::Pfd(PfdError::NonFinite(_)) => {
            FailureReason::NonFinite
        }
        _ => FailureReason::Error,
    }
}

/// A lock that a panicked holder did not poison for the others (the data stays usable).
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn now_rfc3339() -> String {
    crate::alerts::rfc3339_utc(std::time::SystemTime::now())
}

/// The detector plus what turns its decisions into events, metrics and status.
struct Recorder {
    config: Config,
    run: String,
    history: History,
    detector: Detector,
    metrics: Arc<Metrics>,
    status: Arc<Mutex<EarlyStopStatus>>,
    /// What the live page (`GET /`) plots.
    snapshot: Arc<Mutex<Snapshot>>,
    /// Outcomes not in the history yet (it could not be written), oldest first, with the time
    /// they arrived.
    unrecorded: VecDeque<(Outcome, String)>,
    /// The oldest of `unrecorded` failed to be written, and that was logged.
    stalled: bool,
    /// Rewriting `history.h5` failed, and that was logged.
    hdf5_failing: bool,
    /// Keeps the best checkpoint in `<state_dir>/best/` (`early_stop.keep_best`), on its own
    /// thread.
    keeper: Option<crate::keep_best::Keeper>,
}

impl Recorder {
    /// Feeds one record to the detector; returns the event to send, if any.
    fn decide(&mut self, r: &Evaluation, at: &str) -> Option<Event> {
        let before = self
            .detector
            .state
            .best
            .as_ref()
            .map(|b| b.checkpoint.clone());
        let decision = self
            .detector
            .observe(&Observation::of(r, self.config.early_stop.metric));
        // keep_best: a new best checkpoint is kept before rotation can delete it.
        if let (Some(keeper), Some(best)) = (&self.keeper, &self.detector.state.best)
            && before.as_ref() != Some(&best.checkpoint)
        {
            keeper.keep(std::path::Path::new(&best.checkpoint));
        }
        if decision.unconfirmed {
            let confirm = self.detector.config().confirm.as_str();
            tracing::info!(
                step = r.step,
                confirm,
                "{} has turned, but {confirm} has not risen since the best step (early_stop.confirm): no early stop yet",
                self.config.early_stop.metric.as_str()
            );
        }
        self.act(r, at, &decision, &self.detector.state)
    }

    /// Publishes what the detector decided on a record (`s`: its state afterwards) to the live
    /// page, the metrics and the status; returns the event to send, if any.
    fn act(
        &self,
        r: &Evaluation,
        at: &str,
        decision: &Decision,
        s: &DetectorState,
    ) -> Option<Event> {
        lock(&self.snapshot).push(r, at, decision, s);
        self.metrics.set_detector(
            decision.smoothed,
            s.best.as_ref().map(|b| b.step),
            s.fired.is_some() && !s.resolved,
            decision.unconfirmed,
            at,
        );
        let mut status = self.status.lock().unwrap_or_else(|e| e.into_inner());
        status.fired = s.fired.is_some() && !s.resolved;
        if let Some(b) = &s.best {
            status.best_step = Some(b.step);
            status.best_checkpoint = Some(b.checkpoint.clone());
            status.best_value = Some(b.value);
        }
        status.last_step = Some(r.step);
        status.last_value = decision.smoothed;
        let signal = decision.signal?;
        let (kind, best): (EventKind, &Best) = match signal {
            Signal::EarlyStop => (EventKind::EarlyStop, s.fired.as_ref().expect("fired")),
            Signal::Resolved => (EventKind::Resolved, s.best.as_ref().expect("a best")),
        };
        let event = Event {
            id: event_id(&self.run, kind, best.step, r.step),
            event: kind,
            run: self.run.clone(),
            metric: self.config.early_stop.metric.as_str().to_string(),
            best_step: best.step,
            best_checkpoint: best.checkpoint.clone(),
            best_checkpoint_kept: self.keeper.as_ref().and_then(|k| {
                let kept = k.kept(std::path::Path::new(&best.checkpoint))?;
                Some(kept.display().to_string())
            }),
            best_value: best.value,
            current_step: r.step,
            current_value: decision.smoothed.unwrap_or(f64::NAN),
            fired_at: at.to_string(),
        };
        status.event = Some(event.clone());
        Some(event)
    }

    /// Takes one outcome: it is recorded durably, then published, after any older outcome still
    /// waiting to be recorded.
    fn record(&mut self, outcome: Outcome, alerter: &Alerter) {
        if let Outcome::Failed(item, reason, message) = &outcome {
            tracing::warn!(checkpoint = %untrusted(&item.path), step = item.step, reason = reason.as_str(), "evaluation failed: {}", untrusted_text(message));
        }
        self.unrecorded.push_back((outcome, now_rfc3339()));
        self.flush(alerter);
    }

    /// Records the checkpoint a crashed process was evaluating (from its crash marker) as a
    /// failure with reason [`FailureReason::Crashed`], unless the history has it already.
    fn record_crash(&mut self, crash: Crash, alerter: &Alerter) {
        let Some(InFlight { key, step }) = crash.checkpoint else {
            tracing::warn!(
                "the last run died ({}) outside any evaluation; no checkpoint is blamed",
                crash.cause
            );
            return;
        };
        if self.history.contains(&key) {
            return;
        }
        tracing::error!(
            checkpoint = %crate::safe_fs::untrusted_text(&key.path),
            step,
            "the last run died ({}) while evaluating this checkpoint; it is recorded as a failure (reason {}) and not evaluated again",
            crash.cause,
            FailureReason::Crashed
        );
        let message = format!("the process died ({}) while evaluating it", crash.cause);
        let item = WorkItem {
            path: key.path.clone().into(),
            step,
            key,
        };
        self.record(
            Outcome::Failed(item, FailureReason::Crashed, message),
            alerter,
        );
    }

    /// Records the waiting outcomes in order, publishing each once it is in the history. Stops at
    /// the first that cannot be written (a full disk): it and the later ones stay in memory, and
    /// nothing acts on them until they are recorded, by the next call.
    fn flush(&mut self, alerter: &Alerter) {
        while let Some((outcome, at)) = self.unrecorded.front() {
            let (item, entry) = match outcome {
                Outcome::Done(item, record) => (
                    item,
                    Entry::Evaluation {
                        key: item.key.clone(),
                        at: at.clone(),
                        record: record.clone(),
                    },
                ),
                Outcome::Failed(item, reason, message) => (
                    item,
                    Entry::Failure {
                        key: item.key.clone(),
                        at: at.clone(),
                        step: item.step,
                        reason: reason.as_str().to_string(),
                        message: message.clone(),
                    },
                ),
            };
            if let Err(e) = self.history.append(entry) {
                if self.stalled {
                    tracing::debug!(
                        waiting = self.unrecorded.len(),
                        "the state folder still cannot be written"
                    );
                } else {
                    tracing::error!(checkpoint = %untrusted(&item.path), "cannot record the outcome ({e}); it waits in memory, with any later ones, and is recorded and published as soon as the state folder can be written (a restart before then evaluates them again)");
                    self.stalled = true;
                }
                return;
            }
            if self.stalled {
                tracing::info!(
                    waiting = self.unrecorded.len(),
                    "the state folder can be written again; recording the waiting outcomes"
                );
                self.stalled = false;
            }
            let (outcome, at) = self.unrecorded.pop_front().expect("the front was there");
            self.publish(outcome, &at, alerter);
        }
        self.write_hdf5();
    }

    /// Brings `history.h5` up to date, logging the first failure of a series at WARN.
    fn write_hdf5(&mut self) {
        match self.history.write_hdf5() {
            Ok(()) if self.hdf5_failing => {
                tracing::info!("the HDF5 history is up to date again");
                self.hdf5_failing = false;
            }
            Ok(()) => {}
            Err(e) if self.hdf5_failing => {
                tracing::debug!("still cannot rewrite the HDF5 history: {e}")
            }
            Err(e) => {
                tracing::warn!(
                    "cannot rewrite the HDF5 history ({e}); the journal has every outcome, and the file is tried again every {RECORD_RETRY:?}"
                );
                self.hdf5_failing = true;
            }
        }
    }

    /// Are outcomes waiting to be recorded, or is `history.h5` behind the journal?
    fn behind(&self) -> bool {
        !self.unrecorded.is_empty() || self.history.hdf5_stale()
    }

    /// Acts on a recorded outcome: metrics, the detector, the live page, alerts.
    fn publish(&mut self, outcome: Outcome, at: &str, alerter: &Alerter) {
        match outcome {
            Outcome::Done(_, record) => {
                self.metrics.record(&record);
                self.metrics.evaluated(&record);
                let event = self.decide(&record, at);
                println!("{}", self.summary(&record));
                if let Some(event) = event {
                    self.announce(&event);
                    if let Err(e) = alerter.send(&event) {
                        tracing::error!(event = %event.id, "cannot queue the alert: {e}");
                    }
                }
            }
            Outcome::Failed(_, reason, _) => {
                self.metrics.failure(reason);
                lock(&self.snapshot).failures += 1;
            }
        }
    }

    fn summary(&self, r: &Evaluation) -> String {
        let s = &self.detector.state;
        let mut line = format!("step {:>7}", r.step);
        if let Some(v) = r.icr {
            line += &format!("  ICR {v:.4}");
        }
        if let Some(v) = s.last_smoothed {
            line += &format!("  smoothed {v:.4}");
        }
        if let Some(b) = &s.best {
            line += &format!("  best {:.4} @ {}", b.value, b.step);
        }
        if let Some(v) = r.generalization_gap {
            line += &format!("  gap {v:+.5}");
        }
        if let Some(v) = r.pfd_generalization {
            line += &format!("  E_gen {v:.4}");
        }
        if let Some(v) = r.pfd_memorization {
            line += &format!("  E_mem {v:.4}");
        }
        if let Some(v) = r.memorization_ratio {
            line += &format!("  memorized {:.1}%", 100.0 * v);
        }
        line + &format!("  {:.1}s", r.seconds)
    }

    fn announce(&self, e: &Event) {
        match e.event {
            EventKind::EarlyStop => {
                println!(
                    "EARLY STOP: {} turned at step {} (smoothed {:.4} > best {:.4} + {:.4}); best checkpoint: {} (step {}){}",
                    e.metric,
                    e.current_step,
                    e.current_value,
                    e.best_value,
                    self.detector.state.last_threshold.unwrap_or(f64::NAN),
                    e.best_checkpoint,
                    e.best_step,
                    match &e.best_checkpoint_kept {
                        Some(kept) => format!(", kept as {kept}"),
                        None => String::new(),
                    }
                );
                tracing::warn!(run = %e.run, best_step = e.best_step, best_checkpoint = %e.best_checkpoint, "early stop fired");
            }
            EventKind::Resolved => {
                println!(
                    "RESOLVED: {} went below the best again at step {} ({:.4})",
                    e.metric, e.current_step, e.current_value
                );
                tracing::warn!(run = %e.run, step = e.current_step, "early stop resolved (double descent)");
            }
        }
    }
}

/// Runs the daemon until a signal.
pub fn run(config: Config) -> Result<()> {
    let run = config.run_name();
    let state_dir = config.state_dir();
    // A thread that dies takes the process with it, with a status a service manager restarts.
    crate::crash::on_panic(|thread, message| {
        tracing::error!(
            thread,
            "a thread of the daemon panicked ({message}); exiting with status 1"
        );
        crate::crash::exit_now(1);
    });
    // Held until the process ends (the kernel releases it, however the process ends).
    let _lock = StateLock::acquire(&state_dir)?;
    let history = History::open(&state_dir).context("cannot open the history")?;
    let crash = match crate::crash::read_marker(&state_dir) {
        Ok(crash) => crash,
        Err(e) => {
            tracing::warn!("{e}; ignoring it");
            None
        }
    };
    let metrics = Arc::new(Metrics::new(&run));
    let status = Arc::new(Mutex::new(EarlyStopStatus::default()));
    let snapshot = Arc::new(Mutex::new(Snapshot::new(&run, config.early_stop.metric)));
    let mut recorder = Recorder {
        detector: Detector::new(config.early_stop_resolved(), DetectorState::default()),
        config: config.clone(),
        run: run.clone(),
        history,
        metrics: metrics.clone(),
        status: status.clone(),
        snapshot: snapshot.clone(),
        unrecorded: VecDeque::new(),
        stalled: false,
        hdf5_failing: false,
        keeper: config
            .early_stop
            .keep_best
            .then(|| crate::keep_best::Keeper::new(&state_dir)),
    };
    recorder.write_hdf5();
    // The detector's state is the history replayed; replayed events are re-sent below (the
    // alerter delivers each id once, so only undelivered ones go out).
    let mut replayed = Vec::new();
    let mut evaluated_before = 0;
    let mut detector = Detector::new(config.early_stop_resolved(), DetectorState::default());
    let failures = crate::detector::replay(
        &mut detector,
        config.early_stop.metric,
        recorder.history.entries(),
        |record, at, decision, state| {
            evaluated_before += 1;
            recorder.metrics.record(record);
            replayed.extend(recorder.act(record, at, decision, state));
        },
    );
    recorder.detector = detector;
    if let (Some(keeper), Some(best)) = (&recorder.keeper, &recorder.detector.state.best) {
        keeper.keep(std::path::Path::new(&best.checkpoint));
    }
    lock(&snapshot).failures = failures;
    if evaluated_before > 0 {
        tracing::info!(evaluations = evaluated_before, state = %state_dir.display(), "history restored");
    }

    let listen: SocketAddr = config.http.listen.parse().expect("validated by the config");
    let listener = std::net::TcpListener::bind(listen).with_context(|| {
        format!("cannot listen on {listen} (http.listen): is another process using the port?")
    })?;
    listener.set_nonblocking(true)?;

    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("diffmon-io")
        .enable_all()
        .build()?;
    let alerter = {
        // The alerter's delivery tasks run on this runtime.
        let _guard = runtime.enter();
        let outcome_metrics = metrics.clone();
        let alerter = Alerter::start(
            &config.alerts,
            &config.run.dir,
            &state_dir,
            Arc::new(move |receiver, outcome| outcome_metrics.delivery(receiver, outcome)),
        )?;
        for event in &replayed {
            alerter
                .send(event)
                .context("cannot queue a replayed alert")?;
        }
        alerter
    };

    if let Some(crash) = crash {
        recorder.record_crash(crash, &alerter);
    }
    crate::crash::arm(&state_dir)?;

    // The evaluator owns libtorch and HDF5 objects: it is built on its own thread.
    let (ready_tx, ready_rx) = crossbeam_channel::bounded::<Result<(), EvalError>>(1);
    let (work_tx, work_rx) = work_channel();
    let (outcome_tx, outcome_rx) = crossbeam_channel::bounded::<Outcome>(16);
    let evaluator_config = config.clone();
    let evaluator = std::thread::Builder::new()
        .name(crate::crash::EVALUATOR_THREAD.into())
        .spawn(move || {
            let mut evaluator = match Evaluator::new(&evaluator_config) {
                Ok(mut e) => {
                    // `pfd.every` counts from the run's first evaluation, across restarts.
                    e.set_evaluated(evaluated_before);
                    let _ = ready_tx.send(Ok(()));
                    e
                }
                Err(e) => {
                    let _ = ready_tx.send(Err(e));
                    return;
                }
            };
            for item in work_rx {
                crate::crash::evaluating(Some(&InFlight {
                    key: item.key.clone(),
                    step: item.step,
                }));
                // Logged once a crash would be recorded against this checkpoint.
                tracing::debug!(checkpoint = %untrusted(&item.path), step = item.step, "evaluating");
                let evaluated = evaluator.evaluate(&item.path, item.step);
                crate::crash::evaluating(None);
                let outcome = match evaluated {
                    // A file deleted or rewritten while it was read may not be what was evaluated.
                    Ok(_) if crate::unit::key(&item.path).ok().as_ref() != Some(&item.key) => {
                        Outcome::Failed(
                            item,
                            FailureReason::Vanished,
                            "the checkpoint was deleted or rewritten during its evaluation".into(),
                        )
                    }
                    Ok(record) => Outcome::Done(item, Box::new(record)),
                    Err(e) => {
                        Outcome::Failed(item.clone(), failure_reason(&item, &e), e.to_string())
                    }
                };
                if outcome_tx.send(outcome).is_err() {
                    return;
                }
            }
        })?;
    match ready_rx.recv() {
        Ok(Ok(())) => {}
        Ok(Err(e)) => return Err(e).context("cannot start the evaluator"),
        Err(_) => anyhow::bail!("the evaluator thread stopped during start-up"),
    }

    let shutdown = Arc::new(AtomicBool::new(false));
    let done = recorder
        .history
        .entries()
        .iter()
        .map(|e| e.key().clone())
        .collect();
    let watcher = Watcher::new(&config.run.dir, &config.checkpoints, done, metrics.clone())
        .with_excluded(config.named_files());
    let watcher_shutdown = shutdown.clone();
    let watcher = std::thread::Builder::new()
        .name("diffmon-watch".into())
        .spawn(move || watcher.run(work_tx, watcher_shutdown))?;

    let (finished_tx, finished_rx) = tokio::sync::oneshot::channel::<()>();
    let recorder_thread = std::thread::Builder::new()
        .name("diffmon-record".into())
        .spawn(move || {
            loop {
                let next = if recorder.behind() {
                    outcome_rx.recv_timeout(RECORD_RETRY)
                } else {
                    outcome_rx.recv().map_err(|_| RecvTimeoutError::Disconnected)
                };
                match next {
                    Ok(outcome) => recorder.record(outcome, &alerter),
                    Err(RecvTimeoutError::Timeout) => recorder.flush(&alerter),
                    Err(RecvTimeoutError::Disconnected) => break,
                }
            }
            if recorder.behind() {
                recorder.flush(&alerter);
            }
            if !recorder.unrecorded.is_empty() {
                tracing::error!(
                    waiting = recorder.unrecorded.len(),
                    "outcomes could not be recorded (the state folder cannot be written); their checkpoints will be evaluated again after a restart"
                );
            }
            let _ = finished_tx.send(());
            alerter
        })?;

    let app = crate::http::router(metrics.clone(), status.clone(), snapshot);
    let limits = crate::http::Limits::of(&config.http);
    let server = runtime.spawn(async move {
        let listener =
            tokio::net::TcpListener::from_std(listener).expect("a non-blocking std listener");
        crate::http::serve(listener, app, limits).await;
    });
    tracing::info!(
        run = %run,
        dir = %config.run.dir.display(),
        metrics = %format!("http://{listen}/metrics"),
        "watching for checkpoints"
    );
    tracing::info!("{}", config.cost_summary());

    let mut signals = {
        let _guard = runtime.enter();
        Signals::install()?
    };
    let signalled = runtime.block_on(async {
        let signalled = tokio::select! {
            _ = signals.next() => {
                tracing::info!("draining: the evaluation in flight finishes (signal again to exit now)");
                true
            }
            _ = finished_rx => {
                tracing::error!("the evaluator stopped unexpectedly");
                false
            }
        };
        shutdown.store(true, Ordering::SeqCst);
        // From now on a signal ends the process in its handler, whatever is blocked; one that
        // came before the handler was in place is still queued here.
        exit_on_next_signal();
        tokio::spawn(async move {
            signals.next().await;
            second_signal();
        });
        signalled
    });
    // Everything that waits for the evaluation in flight is bounded by one timeout.
    let drain = Duration::from_secs_f64(config.shutdown_drain_secs);
    let drained = runtime.block_on(async {
        tokio::time::timeout(
            drain,
            tokio::task::spawn_blocking(move || {
                let _ = watcher.join();
                recorder_thread.join()
            }),
        )
        .await
    });
    let Ok(Ok(Ok(alerter))) = drained else {
        // The evaluator is still busy (or blocked): nothing waits for it, and nothing it does
        // from now on is the checkpoint's fault.
        crate::crash::disarm();
        tracing::warn!(
            "the evaluation in flight did not finish within {drain:?} (shutdown_drain_secs); it will be evaluated again after a restart"
        );
        tracing::info!("stopped");
        crate::crash::exit_now(if signalled { 0 } else { 1 });
    };
    let _ = evaluator.join();
    runtime.block_on(alerter.shutdown(Duration::from_secs(5)));
    server.abort();
    runtime.shutdown_timeout(Duration::from_secs(1));
    tracing::info!("stopped");
    if !signalled {
        anyhow::bail!("the evaluator stopped unexpectedly");
    }
    Ok(())
}

/// The second signal: exits at once, with status 130 (`cli::Exit::Interrupted`).
fn second_signal() -> ! {
    tracing::warn!("second signal: exiting now");
    crate::crash::exit_now(130);
}

/// Makes SIGINT and SIGTERM end the process in the signal handler itself, so that no blocked
/// thread or runtime can hold it up.
fn exit_on_next_signal() {
    extern "C" fn on_signal(_: libc::c_int) {
        const MESSAGE: &[u8] = b"second signal: exiting now\n";
        // SAFETY: write and _exit are async-signal-safe.
        unsafe {
            libc::write(2, MESSAGE.as_ptr().cast(), MESSAGE.len());
            libc::_exit(130);
        }
    }
    for sig in [libc::SIGINT, libc::SIGTERM] {
        // SAFETY: a zeroed sigaction with an async-signal-safe handler.
        unsafe {
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = on_signal as extern "C" fn(libc::c_int) as usize;
            libc::sigemptyset(&mut action.sa_mask);
            libc::sigaction(sig, &action, std::ptr::null_mut());
        }
    }
}

/// SIGINT and SIGTERM, installed once so that a second signal is told from the first.
struct Signals {
    interrupt: tokio::signal::unix::Signal,
    terminate: tokio::signal::unix::Signal,
}

impl Signals {
    fn install() -> std::io::Result<Signals> {
        use tokio::signal::unix::{SignalKind, signal};
        Ok(Signals {
            interrupt: signal(SignalKind::interrupt())?,
            terminate: signal(SignalKind::terminate())?,
        })
    }

    async fn next(&mut self) {
        tokio::select! {
            _ = self.interrupt.recv() => {}
            _ = self.terminate.recv() => {}
        }
    }
}
