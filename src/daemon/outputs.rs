//! The outputs: where a run's evaluations and events go out once they are recorded and the run's
//! state has taken them. [`Console`] prints a summary line per evaluation and announces events;
//! [`Alerts`] hands events to the [`Alerter`] (stop file, webhooks, Alertmanager);
//! each [`Tracker`] writes both into an experiment tracker (TensorBoard, MLflow).
//! Each is a [`RunOutput`]; [`RunOutputs`] passes everything to each of them in order.

use crate::alerts::{AlertError, Alerter, Event, EventKind};
use crate::engine::detector::DetectorState;
use crate::record::Evaluation;
use crate::store::history::CheckpointKey;
use std::time::Duration;

/// How long the alerter gets, at shutdown, to finish the deliveries in progress.
const ALERTS_SHUTDOWN: Duration = Duration::from_secs(5);

#[derive(Debug, thiserror::Error)]
pub enum OutputError {
    #[error("cannot queue a replayed alert")]
    Replayed(#[source] AlertError),
}

/// One destination of a run's evaluations and events. Every method does nothing unless the
/// output has a use for it.
pub trait RunOutput: Send {
    /// An evaluation of the checkpoint `key` was recorded, live; `state` is the detector's state
    /// after it. (An output that acts on the best checkpoint finds it in `state.best`.)
    fn evaluation(&mut self, _key: &CheckpointKey, _record: &Evaluation, _state: &DetectorState) {}

    /// An event the detector decided on a live evaluation, after that evaluation's
    /// [`RunOutput::evaluation`].
    fn event(&mut self, _event: &Event) {}

    /// The events the replay of the history found at start-up, oldest first, to be sent again;
    /// an error stops the start.
    fn replayed(&mut self, _events: &[Event]) -> Result<(), OutputError> {
        Ok(())
    }

    /// The daemon stops: finish what is under way, in a bounded time.
    fn close(self: Box<Self>, _runtime: &tokio::runtime::Runtime) {}
}

/// The outputs of a run, each given everything in order.
pub struct RunOutputs(Vec<Box<dyn RunOutput>>);

impl RunOutputs {
    pub fn new(outputs: Vec<Box<dyn RunOutput>>) -> RunOutputs {
        RunOutputs(outputs)
    }

    pub fn evaluation(&mut self, key: &CheckpointKey, record: &Evaluation, state: &DetectorState) {
        for output in &mut self.0 {
            output.evaluation(key, record, state);
        }
    }

    pub fn event(&mut self, event: &Event) {
        for output in &mut self.0 {
            output.event(event);
        }
    }

    pub fn replayed(&mut self, events: &[Event]) -> Result<(), OutputError> {
        self.0
            .iter_mut()
            .try_for_each(|output| output.replayed(events))
    }

    pub fn close(self, runtime: &tokio::runtime::Runtime) {
        for output in self.0 {
            output.close(runtime);
        }
    }
}

/// Standard output: a summary line per evaluation, and the early stop and its resolution
/// announced (and logged at WARN). In a sweep each line starts with the run's name, `[run] `
/// (the runs' lines are interleaved on the one output); a single run's lines do not.
#[derive(Default)]
pub struct Console {
    /// The rise over the best that the last evaluation had to exceed (the larger of `min_rise`
    /// and the noise rule's), quoted by the early-stop announcement that follows it.
    threshold: Option<f64>,
    /// The run's name in a sweep; `None` for a single run.
    run: Option<String>,
}

impl Console {
    /// The console of the run `run` of a sweep: its name starts each of its lines. (A run's
    /// name is letters, digits, `.`, `_` and `-`, safe on a terminal.)
    pub fn of_sweep_run(run: &str) -> Console {
        Console {
            threshold: None,
            run: Some(run.to_string()),
        }
    }

    /// `line` as this console prints it.
    fn line(&self, line: String) -> String {
        match &self.run {
            Some(run) => format!("[{run}] {line}"),
            None => line,
        }
    }

    /// The line of an evaluation (`state`: the detector's after it).
    fn evaluation_line(&mut self, record: &Evaluation, state: &DetectorState) -> String {
        self.threshold = state.last_threshold;
        self.line(summary(record, state))
    }

    /// The line announcing an event.
    fn event_line(&self, e: &Event) -> String {
        self.line(match e.event {
            EventKind::EarlyStop => early_stop_line(e, self.threshold),
            EventKind::Resolved => format!(
                "RESOLVED: {} went below the best again at step {} ({:.4})",
                e.metric, e.current_step, e.current_value
            ),
        })
    }
}

impl RunOutput for Console {
    fn evaluation(&mut self, _: &CheckpointKey, record: &Evaluation, state: &DetectorState) {
        println!("{}", self.evaluation_line(record, state));
    }

    fn event(&mut self, e: &Event) {
        println!("{}", self.event_line(e));
        match e.event {
            EventKind::EarlyStop => {
                tracing::warn!(run = %e.run, best_step = e.best_step, best_checkpoint = %e.best_checkpoint, "early stop fired");
            }
            EventKind::Resolved => {
                tracing::warn!(run = %e.run, step = e.current_step, "early stop resolved (double descent)");
            }
        }
    }
}

/// The console's announcement of the early stop (`threshold`: the rise the last evaluation had
/// to exceed). The checkpoint's name is escaped as in the logs: it is chosen by whoever writes
/// `run.dir`, and a terminal would act on its escape sequences and newlines.
fn early_stop_line(e: &Event, threshold: Option<f64>) -> String {
    let escaped = crate::store::safe_fs::untrusted_text;
    format!(
        "EARLY STOP: {} turned at step {} (smoothed {:.4} > best {:.4} + {:.4}); best checkpoint: {} (step {}){}",
        e.metric,
        e.current_step,
        e.current_value,
        e.best_value,
        threshold.unwrap_or(f64::NAN),
        escaped(&e.best_checkpoint),
        e.best_step,
        match &e.best_checkpoint_kept {
            Some(kept) => format!(", kept as {}", escaped(kept)),
            None => format!(", {}", crate::store::keep_best::NOT_KEPT),
        }
    )
}

/// The console's line for one evaluation (`s`: the detector's state after it).
fn summary(r: &Evaluation, s: &DetectorState) -> String {
    let detector = [
        s.last_smoothed.map(|v| format!("smoothed {v:.4}")),
        s.best
            .as_ref()
            .map(|b| format!("best {:.4} @ {}", b.value, b.step)),
    ];
    crate::record::watch_line(r, detector.into_iter().flatten())
}

/// The early-stop signal: the stop file, webhooks and Alertmanager (`alerts/`).
pub struct Alerts(pub Alerter);

impl RunOutput for Alerts {
    fn event(&mut self, event: &Event) {
        if let Err(e) = self.0.send(event) {
            tracing::error!(event = %event.id, "cannot queue the alert: {e}");
        }
    }

    fn replayed(&mut self, events: &[Event]) -> Result<(), OutputError> {
        self.0.send_replayed(events).map_err(OutputError::Replayed)
    }

    /// Deliveries in progress get [`ALERTS_SHUTDOWN`]; what remains stays in the outbox.
    fn close(self: Box<Self>, runtime: &tokio::runtime::Runtime) {
        runtime.block_on(self.0.shutdown(ALERTS_SHUTDOWN));
    }
}

/// A tracker (`trackers/`: TensorBoard, MLflow), as an output.
pub struct Tracker(pub Box<dyn crate::trackers::Tracker>);

impl RunOutput for Tracker {
    fn evaluation(&mut self, key: &CheckpointKey, record: &Evaluation, state: &DetectorState) {
        self.0.evaluation(record, key, state);
    }

    fn event(&mut self, event: &Event) {
        self.0.event(event);
    }

    /// The history's items go out once the replayed events are placed among them.
    fn replayed(&mut self, events: &[Event]) -> Result<(), OutputError> {
        self.0.replayed(events);
        Ok(())
    }

    fn close(self: Box<Self>, runtime: &tokio::runtime::Runtime) {
        self.0.close(runtime);
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use crate::alerts::event_id;
    use crate::engine::detector::Best;
    use std::sync::{Arc, Mutex};

    /// An output that writes down what it is given, as `"<name> <what> <step>"`.
    pub struct Log {
        pub name: &'static str,
        pub lines: Arc<Mutex<Vec<String>>>,
    }

    impl RunOutput for Log {
        fn evaluation(&mut self, _: &CheckpointKey, record: &Evaluation, _: &DetectorState) {
            let line = format!("{} evaluation {}", self.name, record.step);
            self.lines.lock().unwrap().push(line);
        }

        fn event(&mut self, event: &Event) {
            let line = format!("{} {} {}", self.name, event.event, event.current_step);
            self.lines.lock().unwrap().push(line);
        }
    }

    pub fn event(kind: EventKind, step: i64) -> Event {
        Event {
            id: event_id("r", "", kind, 1, step),
            event: kind,
            run: "r".into(),
            metric: "icr".into(),
            trigger: crate::config::Trigger::Turn,
            best_step: 1,
            best_checkpoint: "ckpt_1.pt".into(),
            best_checkpoint_kept: None,
            best_value: 0.25,
            current_step: step,
            current_value: 0.5,
            fired_at: "2024-05-01T12:00:00.000Z".into(),
        }
    }

    #[test]
    fn every_output_gets_everything_in_order() {
        let lines = Arc::new(Mutex::new(Vec::new()));
        let log = |name| -> Box<dyn RunOutput> {
            Box::new(Log {
                name,
                lines: lines.clone(),
            })
        };
        let mut outputs = RunOutputs::new(vec![log("a"), log("b")]);
        let record = Evaluation {
            step: 5,
            ..Evaluation::default()
        };
        let key = CheckpointKey {
            path: "ckpt_5.pt".into(),
            size: 1,
            mtime_ns: 0,
        };
        outputs.evaluation(&key, &record, &DetectorState::default());
        outputs.event(&event(EventKind::EarlyStop, 5));
        outputs.replayed(&[event(EventKind::Resolved, 6)]).unwrap();
        assert_eq!(
            *lines.lock().unwrap(),
            [
                "a evaluation 5",
                "b evaluation 5",
                "a early_stop 5",
                "b early_stop 5"
            ]
        );
    }

    /// A checkpoint name with an escape sequence and a newline reached the terminal raw in the
    /// EARLY STOP line; it is escaped as in the logs.
    #[test]
    fn the_early_stop_line_escapes_the_checkpoint_name() {
        let mut e = event(EventKind::EarlyStop, 9);
        e.best_checkpoint = "/r/ckpt_\x1b[31m\nforged_1.pt".into();
        e.best_checkpoint_kept = Some("/r/best/ckpt_\x1b[31m\nforged_1.pt".into());
        let line = early_stop_line(&e, Some(0.01));
        assert!(!line.contains(['\x1b', '\n']), "{line:?}");
        assert_eq!(
            line,
            "EARLY STOP: icr turned at step 9 (smoothed 0.5000 > best 0.2500 + 0.0100); best \
             checkpoint: /r/ckpt_\\u{1b}[31m\\nforged_1.pt (step 1), kept as \
             /r/best/ckpt_\\u{1b}[31m\\nforged_1.pt"
        );
        // Without a copy, the line says the original is the only one.
        e.best_checkpoint_kept = None;
        assert!(
            early_stop_line(&e, Some(0.01))
                .ends_with("(step 1), not kept: the original is the only copy"),
            "{}",
            early_stop_line(&e, Some(0.01))
        );
    }

    /// In a sweep every console line, the evaluations' and the events', starts with the run's
    /// name (two runs' lines are interleaved on one output); a single run's lines do not.
    #[test]
    fn a_sweep_runs_console_names_the_run_on_every_line() {
        let record = Evaluation {
            step: 225,
            icr: Some(0.775),
            seconds: 1.0,
            ..Evaluation::default()
        };
        let state = DetectorState::default();
        let (mut single, mut swept) = (Console::default(), Console::of_sweep_run("small-a"));
        let single_line = single.evaluation_line(&record, &state);
        assert!(
            single_line.starts_with("step     225  ICR 0.7750"),
            "{single_line}"
        );
        assert_eq!(
            swept.evaluation_line(&record, &state),
            format!("[small-a] {single_line}")
        );
        for kind in [EventKind::EarlyStop, EventKind::Resolved] {
            let e = event(kind, 750);
            let line = single.event_line(&e);
            assert!(!line.starts_with('['), "{line}");
            assert_eq!(swept.event_line(&e), format!("[small-a] {line}"));
        }
        assert!(
            swept
                .event_line(&event(EventKind::EarlyStop, 750))
                .starts_with("[small-a] EARLY STOP: icr turned at step 750")
        );
    }

    /// The console line, written out by hand: every metric the record has, the detector's
    /// smoothed value and best, and the time taken.
    #[test]
    fn the_summary_line_shows_what_the_record_and_the_detector_have() {
        let record = Evaluation {
            step: 1200,
            icr: Some(0.123456),
            generalization_gap: Some(-0.0012345),
            pfd_generalization: Some(1.5),
            pfd_memorization: Some(0.25),
            memorization_ratio: Some(0.125),
            seconds: 2.04,
            ..Evaluation::default()
        };
        let state = DetectorState {
            last_smoothed: Some(0.2),
            best: Some(Best {
                step: 800,
                checkpoint: "ckpt_800.pt".into(),
                value: 0.1,
                confirm_value: None,
                confirm_floor: 0.0,
            }),
            ..DetectorState::default()
        };
        assert_eq!(
            summary(&record, &state),
            "step    1200  ICR 0.1235  smoothed 0.2000  best 0.1000 @ 800  gap -0.00123  E_gen 1.5000  E_mem 0.2500  memorized 12.5%  2.0s"
        );
        let bare = Evaluation {
            step: 3,
            seconds: 0.5,
            ..Evaluation::default()
        };
        assert_eq!(
            summary(&bare, &DetectorState::default()),
            "step       3  0.5s"
        );
    }
}
