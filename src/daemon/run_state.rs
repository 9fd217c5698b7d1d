//! The state of one run: the early-stop detector, what `/v1/early-stop` serves, the live page's
//! snapshot and the run's metrics, all derived from the run's recorded outcomes. A start
//! builds it by [`RunState::replay`] of the journal (docs/design.md §9); the recorder then
//! hands it each new outcome, once recorded, through [`RunState::observe`]. Both go through the
//! same [`RunState::publish`], so a restart arrives at the state the run had before it.
//!
//! `diffmon report` draws the same snapshot from the same detector replay
//! ([`Snapshot::replay`]; a test here holds the two equal).

use super::executor::Outcome;
use crate::alerts::{Event, EventKind, event_id};
use crate::config::EarlyStopSettings;
use crate::daemon::http::EarlyStopStatus;
use crate::engine::detector::{self, Best, Decision, Detector, DetectorState, Observation, Signal};
use crate::metrics::Metrics;
use crate::record::{Evaluation, ParameterizationCheck};
use crate::report::{KeptCopy, Marker, Snapshot};
use crate::store::history::{CheckpointKey, Entry};
use crate::store::keep_best::keeper::Keeper;
use crate::store::pin::Pin;
use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex};

/// A lock that a panicked holder did not poison for the others (the data stays usable).
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The detector, status, live snapshot and metrics of one run.
pub struct RunState {
    run: String,
    /// What tells the run apart from another of the same name, for event ids
    /// (`alerts::run_instance`).
    instance: String,
    detector: Detector,
    metrics: Arc<Metrics>,
    status: Arc<Mutex<EarlyStopStatus>>,
    /// What the live page (`GET /`) plots.
    snapshot: Arc<Mutex<Snapshot>>,
    /// Keeps the best checkpoint safe from rotation (`early_stop.keep_best`).
    keeper: Option<Keeper>,
    /// The pins ([`crate::store::pin`]) of the evaluated checkpoints that are the best or that
    /// the detector may still name best ([`Detector::contenders`]; with smoothing, a checkpoint
    /// is named best evaluations after its own), by checkpoint: the keeper links from the pin
    /// once rotation has deleted the original. Released when neither.
    held: HashMap<String, Arc<Pin>>,
    /// With a keeper: each evaluated checkpoint's key when it was evaluated, so that what is
    /// kept is what was measured (`keep_best::keep`).
    evaluated: HashMap<String, CheckpointKey>,
    /// The history segment the detector follows (1 until the first resume).
    segment: u32,
}

/// What a replay found besides the state.
#[derive(Debug, Default)]
pub struct Replayed {
    /// The events the history implies, oldest first, to be sent again (the alerter delivers
    /// each id once, so only undelivered ones go out).
    pub events: Vec<Event>,
    /// The evaluations (not failures) in the history.
    pub evaluations: usize,
}

impl RunState {
    /// The state of run `run` after the outcomes of `entries` (a journal, in order), watched
    /// by a detector with settings `early_stop` (`confirm: auto` resolved), with its metrics
    /// in `metrics`. Replayed evaluations set the metrics' gauges but not their counters, which
    /// count this process's evaluations and failures. With a `keeper`, the replayed best is
    /// kept (again: a restart finds what is kept already), and every later best.
    pub fn replay(
        run: &str,
        instance: &str,
        early_stop: EarlyStopSettings,
        entries: &[Entry],
        metrics: Arc<Metrics>,
        keeper: Option<Keeper>,
    ) -> (RunState, Replayed) {
        let metric = early_stop.metric;
        let snapshot = Arc::new(Mutex::new(Snapshot::new(run, metric)));
        // The live page names the kept copy once the keeper's thread has made it, even when no
        // evaluation follows (the training job stopped).
        let keeper = keeper.map(|k| {
            let shown = snapshot.clone();
            k.on_kept(Arc::new(move |checkpoint: &Path, kept: Option<&Path>| {
                let copy =
                    kept.map_or(KeptCopy::NotKept, |p| KeptCopy::At(p.display().to_string()));
                lock(&shown).kept = Some((checkpoint.display().to_string(), copy));
            }))
        });
        let mut state = RunState {
            run: run.to_string(),
            instance: instance.to_string(),
            detector: Detector::new(early_stop.clone(), DetectorState::default()),
            metrics,
            status: Arc::new(Mutex::new(EarlyStopStatus {
                segment: 1,
                ..EarlyStopStatus::default()
            })),
            snapshot,
            evaluated: HashMap::new(),
            keeper,
            held: HashMap::new(),
            segment: 1,
        };
        if state.keeper.is_some() {
            for entry in entries {
                if let Entry::Evaluation { key, record, .. } = entry {
                    state
                        .evaluated
                        .insert(record.checkpoint.clone(), key.clone());
                }
            }
        }
        let mut replayed = Replayed::default();
        let mut detector = Detector::new(early_stop, DetectorState::default());
        let failures =
            crate::engine::detector::replay(&mut detector, metric, entries, |entry| match entry {
                detector::Replayed::Evaluation {
                    record,
                    at,
                    decision,
                    state: s,
                    ..
                } => {
                    replayed.evaluations += 1;
                    state.metrics.record(record);
                    replayed
                        .events
                        .extend(state.publish(record, at, decision, s));
                }
                detector::Replayed::Resume {
                    step,
                    at,
                    segment,
                    state: s,
                    ..
                } => replayed.events.extend(state.resumed(step, segment, at, s)),
            });
        state.detector = detector;
        lock(&state.snapshot).failures = failures;
        state.keep_best();
        (state, replayed)
    }

    /// Takes one outcome recorded at `at` (RFC 3339): the metrics, the detector, the live
    /// snapshot and the status follow it. Returns the event it decided, if any.
    pub fn observe(&mut self, outcome: &Outcome, at: &str) -> Option<Event> {
        match outcome {
            Outcome::Done(item, record) => {
                if self.keeper.is_some() {
                    self.evaluated
                        .insert(record.checkpoint.clone(), item.key.clone());
                }
                self.metrics.record(record);
                match &record.parameterization {
                    ParameterizationCheck::NotRun => {}
                    ParameterizationCheck::Warned(w) => {
                        lock(&self.snapshot).parameterization = Some((record.step, w.clone()))
                    }
                    ParameterizationCheck::Passed => lock(&self.snapshot).parameterization = None,
                }
                // Its pin, should it be the best now or later: the keeper links from it.
                if let (Some(pin), Some(_)) = (&item.pin, &self.keeper) {
                    self.held.insert(record.checkpoint.clone(), pin.clone());
                }
                let event = self.decide(record, at);
                self.release_pins();
                // Counted once the status and the live page have it: whoever waits for the
                // count sees them complete.
                self.metrics.evaluated(record);
                event
            }
            Outcome::Failed(_, reason, _) => {
                self.metrics.failure(*reason);
                lock(&self.snapshot).failures += 1;
                None
            }
        }
    }

    /// Releases the pins of the checkpoints that are neither the best nor one the detector may
    /// still name best.
    fn release_pins(&mut self) {
        if self.held.is_empty() {
            return;
        }
        let state = &self.detector.state;
        let best = state.best.as_ref().map(|b| b.checkpoint.as_str());
        let named = state.named().map(|b| b.checkpoint.as_str());
        let contenders = self.detector.contenders();
        self.held.retain(|c, _| {
            let c = c.as_str();
            Some(c) == best || Some(c) == named || contenders.contains(&c)
        });
    }

    /// The checkpoints whose pins are held, for tests.
    #[cfg(test)]
    fn held(&self) -> Vec<String> {
        let mut held: Vec<String> = self.held.keys().cloned().collect();
        held.sort();
        held
    }

    /// Asks the keeper (if any) to keep the best checkpoint the run names
    /// ([`DetectorState::named`]), as it was evaluated, from its pin while there is one (held
    /// while it is named or may become it: [`RunState::release_pins`]).
    fn keep_best(&mut self) {
        if let (Some(keeper), Some(best)) = (&self.keeper, self.detector.state.named()) {
            let evaluated = self.evaluated.get(&best.checkpoint).cloned();
            let pin = self.held.get(&best.checkpoint).cloned();
            let source = pin.map(|p| crate::store::keep_best::keeper::Source {
                path: p.path().to_path_buf(),
                hold: p,
            });
            // Before the request: the keeper's answer may come at once, and must stand.
            lock(&self.snapshot).kept = Some((best.checkpoint.clone(), KeptCopy::Keeping));
            keeper.keep(Path::new(&best.checkpoint), evaluated, source);
        }
    }

    /// The detector's state (its best, the turn, the smoothed value).
    pub fn detector(&self) -> &DetectorState {
        &self.detector.state
    }

    /// What `/v1/early-stop` serves.
    pub fn status(&self) -> Arc<Mutex<EarlyStopStatus>> {
        self.status.clone()
    }

    /// What the live page plots.
    pub fn snapshot(&self) -> Arc<Mutex<Snapshot>> {
        self.snapshot.clone()
    }

    /// Feeds one live record to the detector; returns the event to send, if any.
    fn decide(&mut self, r: &Evaluation, at: &str) -> Option<Event> {
        let metric = self.detector.config().metric;
        let before = self.detector.state.named().map(|b| b.step);
        let decision = self.detector.observe(&Observation::of(r, metric));
        // A new best is kept before the training job's rotation can delete it.
        if self.detector.state.named().map(|b| b.step) != before {
            self.keep_best();
        }
        if decision.unconfirmed {
            let confirm = self.detector.config().confirm.as_str();
            // How far it rose, against what it needs: a rise that looks large from a value near
            // zero can be within its noise.
            let rise = match self.detector.confirmation() {
                Some((base, now, needed)) => format!(
                    " ({base:.4} at the best step, {now:.4} now: it needs to rise by more than \
                     {needed:.4}, early_stop.confirm_rise of its value there or of its noise)"
                ),
                None => String::new(),
            };
            tracing::info!(
                step = r.step,
                confirm,
                "{} has turned, but {confirm} has not risen since the best step{rise} (early_stop.confirm): no early stop yet",
                metric.as_str()
            );
        }
        self.publish(r, at, &decision, &self.detector.state)
    }

    /// A resume from `step` (recorded at `at`) starts `segment`; `s` is the detector's state,
    /// restarted on the run's lineage (`detector::replay`). The live page, the metrics and the
    /// status follow it. An early stop that stood is resolved: the returned event removes the
    /// stop file and resolves the alert (its id is the new segment's).
    fn resumed(&mut self, step: i64, segment: u32, at: &str, s: &DetectorState) -> Option<Event> {
        let stood = {
            let snapshot = lock(&self.snapshot);
            snapshot.fired.clone().filter(|_| !snapshot.resolved)
        };
        self.segment = segment;
        lock(&self.snapshot).resumed(step, segment, at, s);
        let mut status = self.follow(s, step, s.last_smoothed, s.unconfirmed, at);
        let (best, _) = stood.filter(|_| !status.fired)?;
        let event = self.event(EventKind::Resolved, &best, step, s.last_smoothed, at);
        status.event = Some(event.clone());
        Some(event)
    }

    /// What tells this run's events apart in event ids: the run's instance, and the segment
    /// after a resume (a resumed run that turns again at the same steps fires anew).
    fn event_instance(&self) -> String {
        match self.segment {
            1 => self.instance.clone(),
            n => format!("{}#segment-{n}", self.instance),
        }
    }

    /// Publishes what the detector decided on a record (`s`: its state afterwards) to the live
    /// page, the metrics and the status; returns the event to send, if any.
    fn publish(
        &self,
        r: &Evaluation,
        at: &str,
        decision: &Decision,
        s: &DetectorState,
    ) -> Option<Event> {
        lock(&self.snapshot).push(r, at, decision, s);
        let mut status = self.follow(s, r.step, decision.smoothed, decision.unconfirmed, at);
        let (kind, best): (EventKind, &Best) = match decision.signal? {
            Signal::EarlyStop => (EventKind::EarlyStop, s.fired.as_ref().expect("fired")),
            Signal::Resolved => (EventKind::Resolved, s.best.as_ref().expect("a best")),
        };
        let best = Marker {
            step: best.step,
            checkpoint: best.checkpoint.clone(),
            value: best.value,
        };
        let event = self.event(kind, &best, r.step, decision.smoothed, at);
        status.event = Some(event.clone());
        Some(event)
    }

    /// The metrics and `/v1/early-stop` after the detector's state `s`, the last step `step`
    /// (smoothed value `value`) recorded at `at`; returns the status, still locked, for the
    /// event that may follow.
    fn follow(
        &self,
        s: &DetectorState,
        step: i64,
        value: Option<f64>,
        unconfirmed: bool,
        at: &str,
    ) -> std::sync::MutexGuard<'_, EarlyStopStatus> {
        let fired = s.fired.is_some() && !s.resolved;
        let best = s.named();
        self.metrics
            .set_detector(value, best.map(|b| b.step), fired, unconfirmed, at);
        self.metrics.set_segment(self.segment);
        let mut status = lock(&self.status);
        status.fired = fired;
        if let Some(b) = best {
            status.best_step = Some(b.step);
            status.best_checkpoint = Some(b.checkpoint.clone());
            status.best_value = Some(b.value);
        }
        status.last_step = Some(step);
        status.last_value = value;
        status.segment = self.segment;
        status
    }

    /// The event of `kind` naming `best`, decided at `step` (smoothed value `value`) at `at`.
    fn event(
        &self,
        kind: EventKind,
        best: &Marker,
        step: i64,
        value: Option<f64>,
        at: &str,
    ) -> Event {
        Event {
            id: event_id(&self.run, &self.event_instance(), kind, best.step, step),
            event: kind,
            run: self.run.clone(),
            metric: self.detector.config().metric.as_str().to_string(),
            trigger: self.detector.state.fired_by.unwrap_or_default(),
            best_step: best.step,
            best_checkpoint: best.checkpoint.clone(),
            best_checkpoint_kept: self.keeper.as_ref().and_then(|k| {
                let kept = k.kept(Path::new(&best.checkpoint))?;
                Some(kept.display().to_string())
            }),
            best_value: best.value,
            current_step: step,
            current_value: value.unwrap_or(f64::NAN),
            fired_at: at.to_string(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Confirmation, EarlyStopMetric, Smoother, Trigger};
    use crate::daemon::tests::item;
    use crate::daemon::watcher::WorkItem;
    use crate::metrics::{
        BEST_STEP, BEST_STEP_TIMESTAMP, CHECKPOINT_FAILURES, CHECKPOINTS_EVALUATED,
        EARLY_STOP_TIMESTAMP, EARLY_STOP_TRIGGERED, EARLY_STOP_UNCONFIRMED, HISTORY_SEGMENT, ICR,
        ICR_SMOOTHED, LAST_EVALUATED_STEP,
    };
    use crate::record::FailureReason;

    /// A window of one, so the smoothed value is the raw one and the turn has a closed form.
    fn settings() -> EarlyStopSettings {
        EarlyStopSettings {
            metric: EarlyStopMetric::Icr,
            smoother: Smoother::Median,
            window: 1,
            warmup: 3,
            patience: 2,
            min_rise: 0.005,
            noise_multiple: 0.0,
            confirm: Confirmation::None,
            confirm_rise: 0.5,
            memorization_level: 0.05,
        }
    }

    fn done(step: i64, icr: f64) -> Outcome {
        Outcome::Done(
            item(step),
            Box::new(Evaluation {
                step,
                checkpoint: format!("ckpt_{step}.pt"),
                icr: Some(icr),
                seconds: 1.5,
                ..Evaluation::default()
            }),
        )
    }

    fn failed(step: i64) -> Outcome {
        Outcome::Failed(item(step), FailureReason::Mismatch, "no such tensor".into())
    }

    /// The time an outcome with this step was recorded.
    fn at(step: i64) -> String {
        format!("2024-05-01T12:{:02}:00.000Z", step / 100)
    }

    /// The journal entry the recorder writes for an outcome.
    fn entry(outcome: &Outcome) -> Entry {
        match outcome {
            Outcome::Done(item, record) => Entry::Evaluation {
                key: item.key.clone(),
                at: at(item.step),
                record: record.clone(),
            },
            Outcome::Failed(item, reason, message) => Entry::Failure {
                key: item.key.clone(),
                at: at(item.step),
                step: item.step,
                reason: reason.as_str().to_string(),
                message: message.clone(),
            },
        }
    }

    /// Down to 2 at step 400, up for two checkpoints (the turn at 600), a failure, then below
    /// the old best by more than `min_rise` (resolved at 800).
    fn run_outcomes() -> Vec<Outcome> {
        vec![
            done(100, 5.0),
            done(200, 4.0),
            done(300, 3.0),
            done(400, 2.0),
            done(500, 3.0),
            done(600, 4.0),
            failed(700),
            done(800, 1.0),
        ]
    }

    fn fresh() -> RunState {
        replayed(&[]).0
    }

    /// The state of run `r` (no run folder, no keeper) replayed from `entries`.
    fn replayed(entries: &[Entry]) -> (RunState, Replayed) {
        RunState::replay(
            "r",
            "",
            settings(),
            entries,
            Arc::new(Metrics::new("r")),
            None,
        )
    }

    /// The value of the first series of `metrics` named `series` whose labels hold `label`.
    fn sample(state: &RunState, series: &str, label: &str) -> Option<f64> {
        let text = state.metrics.encode();
        let line = text
            .lines()
            .find(|l| l.starts_with(&format!("{series}{{")) && l.contains(label))?;
        line.rsplit(' ').next()?.parse().ok()
    }

    fn status(state: &RunState) -> serde_json::Value {
        serde_json::to_value(&*lock(&state.status)).unwrap()
    }

    /// Replaying the first `k` outcomes and observing the rest live arrives at what observing
    /// them all live does, for every `k`: detector, snapshot, status, events, and the gauges
    /// (the counters count only this process's evaluations).
    #[test]
    fn replay_then_observe_equals_observing_everything_live() {
        let outcomes = run_outcomes();
        let mut live = fresh();
        let live_events: Vec<Event> = outcomes
            .iter()
            .filter_map(|o| live.observe(o, &at(item_of(o).step)))
            .collect();
        assert_eq!(live_events.len(), 2, "the run fires and resolves");
        let gauges = [
            ICR,
            ICR_SMOOTHED,
            LAST_EVALUATED_STEP,
            BEST_STEP,
            EARLY_STOP_TRIGGERED,
            EARLY_STOP_UNCONFIRMED,
            BEST_STEP_TIMESTAMP,
            EARLY_STOP_TIMESTAMP,
        ];
        for k in 0..=outcomes.len() {
            let entries: Vec<Entry> = outcomes[..k].iter().map(entry).collect();
            let (mut state, replayed) = replayed(&entries);
            let evaluations = outcomes[..k]
                .iter()
                .filter(|o| matches!(o, Outcome::Done(..)))
                .count();
            assert_eq!(replayed.evaluations, evaluations, "k = {k}");
            let mut events = replayed.events;
            for o in &outcomes[k..] {
                events.extend(state.observe(o, &at(item_of(o).step)));
            }
            assert_eq!(events, live_events, "k = {k}");
            assert_eq!(state.detector(), live.detector(), "k = {k}");
            assert_eq!(*lock(&state.snapshot), *lock(&live.snapshot), "k = {k}");
            assert_eq!(status(&state), status(&live), "k = {k}");
            for g in gauges {
                assert_eq!(
                    sample(&state, g, "run=\"r\""),
                    sample(&live, g, "run=\"r\""),
                    "{g}, k = {k}"
                );
            }
            let counted = outcomes[k..]
                .iter()
                .filter(|o| matches!(o, Outcome::Done(..)))
                .count() as f64;
            assert_eq!(
                sample(&state, &format!("{CHECKPOINTS_EVALUATED}_total"), "run="),
                Some(counted),
                "k = {k}"
            );
        }
    }

    fn item_of(o: &Outcome) -> &WorkItem {
        match o {
            Outcome::Done(item, _) | Outcome::Failed(item, ..) => item,
        }
    }

    /// A failure is counted (metric by reason, snapshot) and changes nothing else.
    #[test]
    fn a_failure_is_counted_and_changes_nothing_else() {
        let mut state = fresh();
        state.observe(&done(100, 5.0), &at(100));
        let (detector, status_before) = (state.detector().clone(), status(&state));
        let rows = lock(&state.snapshot).rows.clone();
        assert_eq!(state.observe(&failed(200), &at(200)), None);
        assert_eq!(lock(&state.snapshot).failures, 1);
        assert_eq!(lock(&state.snapshot).rows, rows);
        assert_eq!(state.detector(), &detector);
        assert_eq!(status(&state), status_before);
        let failures = format!("{CHECKPOINT_FAILURES}_total");
        assert_eq!(sample(&state, &failures, "reason=\"mismatch\""), Some(1.0));
        assert_eq!(sample(&state, &failures, "reason=\"vanished\""), Some(0.0));
        // A replayed failure is in the snapshot, not in this process's counter.
        let entries = vec![entry(&failed(200))];
        let (replayed, _) = replayed(&entries);
        assert_eq!(lock(&replayed.snapshot).failures, 1);
        assert_eq!(
            sample(&replayed, &failures, "reason=\"mismatch\""),
            Some(0.0)
        );
    }

    /// ICR still falling at step 300, where the memorization ratio reaches 0.1: the stop fires
    /// there by memorization, naming step 200 (the best before it), and its event says so.
    #[test]
    fn a_memorization_stop_names_the_best_before_it_and_says_why() {
        let mut state = fresh();
        let mut events = Vec::new();
        for (step, icr, ratio) in [(100, 5.0, 0.0), (200, 4.0, 0.02), (300, 3.0, 0.1)] {
            let mut o = done(step, icr);
            if let Outcome::Done(_, r) = &mut o {
                r.memorization_ratio = Some(ratio);
            }
            events.extend(state.observe(&o, &at(step)));
        }
        let [fired] = events.as_slice() else {
            panic!("one event, not {events:?}")
        };
        assert_eq!(fired.event, EventKind::EarlyStop);
        assert_eq!((fired.best_step, fired.current_step), (200, 300));
        assert_eq!(fired.trigger, Trigger::Memorization);
    }

    /// The turn of a window-1 curve 5, 4, 3, 2, 3, 4: best 2 at step 400, above it by more than
    /// `min_rise` at 500 and 600, so with `patience: 2` it fires at 600; then 1 at 800 is below
    /// 2 · (1 − 0.005): resolved.
    #[test]
    fn the_status_snapshot_and_metrics_follow_a_fired_turn_and_its_resolution() {
        let mut state = fresh();
        let mut events = Vec::new();
        for o in run_outcomes() {
            let step = item_of(&o).step;
            if let Some(e) = state.observe(&o, &at(step)) {
                events.push(e);
            }
            if step == 600 {
                break;
            }
        }
        let [fired] = events.as_slice() else {
            panic!("one event, not {events:?}")
        };
        let expected = Event {
            id: event_id("r", "", EventKind::EarlyStop, 400, 600),
            event: EventKind::EarlyStop,
            run: "r".into(),
            metric: "icr".into(),
            trigger: Trigger::Turn,
            best_step: 400,
            best_checkpoint: "ckpt_400.pt".into(),
            best_checkpoint_kept: None,
            best_value: 2.0,
            current_step: 600,
            current_value: 4.0,
            fired_at: at(600),
        };
        assert_eq!(fired, &expected);
        let s = status(&state);
        assert_eq!(s["fired"], true);
        assert_eq!(s["best_step"], 400);
        assert_eq!(s["best_checkpoint"], "ckpt_400.pt");
        assert_eq!(s["best_value"], 2.0);
        assert_eq!(s["last_step"], 600);
        assert_eq!(s["last_value"], 4.0);
        assert_eq!(s["event"], serde_json::to_value(&expected).unwrap());
        {
            let snap = lock(&state.snapshot);
            let marker = Marker {
                step: 400,
                checkpoint: "ckpt_400.pt".into(),
                value: 2.0,
            };
            assert_eq!(snap.rows.len(), 6);
            assert_eq!(snap.best.as_ref(), Some(&marker));
            assert_eq!(snap.fired, Some((marker, 600)));
            assert!(!snap.resolved);
            assert_eq!(snap.last_at.as_deref(), Some(at(600).as_str()));
        }
        let run = "run=\"r\"";
        assert_eq!(sample(&state, EARLY_STOP_TRIGGERED, run), Some(1.0));
        assert_eq!(sample(&state, BEST_STEP, run), Some(400.0));
        assert_eq!(sample(&state, ICR_SMOOTHED, run), Some(4.0));

        assert_eq!(state.observe(&failed(700), &at(700)), None);
        let resolved = state.observe(&done(800, 1.0), &at(800)).expect("resolved");
        assert_eq!(resolved.event, EventKind::Resolved);
        assert_eq!(
            resolved.id,
            event_id("r", "", EventKind::Resolved, 800, 800)
        );
        assert_eq!((resolved.best_step, resolved.best_value), (800, 1.0));
        let s = status(&state);
        assert_eq!(s["fired"], false);
        assert_eq!(s["best_step"], 800);
        assert_eq!(s["event"]["event"], "resolved");
        assert!(lock(&state.snapshot).resolved);
        assert_eq!(lock(&state.snapshot).failures, 1);
        assert_eq!(sample(&state, EARLY_STOP_TRIGGERED, run), Some(0.0));
        assert_eq!(sample(&state, BEST_STEP, run), Some(800.0));
    }

    /// A run folder with a state folder, its pins, and run `r`'s state (no history) with a
    /// keeper there.
    fn keeping(
        early_stop: EarlyStopSettings,
    ) -> (
        tempfile::TempDir,
        std::path::PathBuf,
        crate::store::pin::Pins,
        RunState,
    ) {
        let run = tempfile::tempdir().unwrap();
        let state_dir = run.path().join("state");
        std::fs::create_dir(&state_dir).unwrap();
        let pins = crate::store::pin::Pins::open(&state_dir).unwrap();
        let (state, _) = RunState::replay(
            "r",
            "",
            early_stop,
            &[],
            Arc::new(Metrics::new("r")),
            Some(Keeper::new(&state_dir)),
        );
        (run, state_dir, pins, state)
    }

    /// Checkpoint `step` written in `run`, pinned, then deleted as by rotation: its work item
    /// and its path.
    fn pinned_then_rotated(
        run: &Path,
        pins: &crate::store::pin::Pins,
        step: i64,
    ) -> (WorkItem, String) {
        let path = run.join(format!("ckpt_{step}.pt"));
        std::fs::write(&path, format!("weights {step}")).unwrap();
        let key = crate::store::unit::key(&path).unwrap();
        let mut work = WorkItem::new(path.clone(), step, key.clone());
        work.pin = pins.pin(&path, &key, step);
        assert!(work.pin.is_some());
        std::fs::remove_file(&path).unwrap();
        (work, path.display().to_string())
    }

    /// Waits (10 s at most) until the live snapshot says `want` of the best's kept copy.
    fn wait_for_kept(state: &RunState, want: KeptCopy) {
        let start = std::time::Instant::now();
        while lock(&state.snapshot).best_kept() != Some(want.clone()) {
            assert!(
                start.elapsed() < std::time::Duration::from_secs(10),
                "{:?}, not {want:?}",
                lock(&state.snapshot).kept
            );
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
    }

    /// With a keeper, the live snapshot names the best's kept copy once the keeper's thread has
    /// made it, with no evaluation after it (a stopped training job sends none); a new best that
    /// cannot be kept is named the only copy.
    #[test]
    fn the_snapshot_names_the_kept_copy_once_it_is_made() {
        let run = tempfile::tempdir().unwrap();
        let state_dir = run.path().join("state");
        std::fs::create_dir(&state_dir).unwrap();
        let entries: Vec<Entry> = [(100, 5.0), (200, 4.0), (300, 6.0)]
            .into_iter()
            .map(|(step, icr)| {
                let path = run.path().join(format!("ckpt_{step}.pt"));
                std::fs::write(&path, format!("weights {step}")).unwrap();
                Entry::Evaluation {
                    key: CheckpointKey::of(&path).unwrap(),
                    at: at(step),
                    record: Box::new(Evaluation {
                        step,
                        checkpoint: path.display().to_string(),
                        icr: Some(icr),
                        ..Evaluation::default()
                    }),
                }
            })
            .collect();
        let (mut state, _) = RunState::replay(
            "r",
            "",
            settings(),
            &entries,
            Arc::new(Metrics::new("r")),
            Some(Keeper::new(&state_dir)),
        );
        let copy = state_dir.join("best/ckpt_200.pt").display().to_string();
        wait_for_kept(&state, KeptCopy::At(copy));
        // `ckpt_400.pt` does not exist: nothing to keep.
        state.observe(&done(400, 1.0), &at(400));
        wait_for_kept(&state, KeptCopy::NotKept);
    }

    /// A stop the memorization ratio fired at step 30 names step 20; ICR goes on falling
    /// (steps 40 and 50 are new lows), but the stop stands, so its best stays the one kept,
    /// from its pin after rotation deleted the file, and the status names it.
    #[test]
    fn the_stop_s_best_stays_kept_while_the_curve_goes_on_falling() {
        let (run, state_dir, pins, mut state) = keeping(settings());
        let mut events = Vec::new();
        for (step, icr, ratio) in [
            (10, 5.0, 0.0),
            (20, 4.0, 0.0),
            (30, 3.0, 0.1),
            (40, 2.0, 0.2),
            (50, 1.0, 0.3),
        ] {
            let (work, checkpoint) = pinned_then_rotated(run.path(), &pins, step);
            let record = Evaluation {
                step,
                checkpoint,
                icr: Some(icr),
                memorization_ratio: Some(ratio),
                ..Evaluation::default()
            };
            events.extend(state.observe(&Outcome::Done(work, Box::new(record)), &at(step)));
        }
        assert_eq!(events.len(), 1, "{events:?}");
        assert_eq!(
            (events[0].best_step, events[0].trigger),
            (20, Trigger::Memorization)
        );
        assert_eq!(state.detector().best.as_ref().unwrap().step, 50);
        assert_eq!(state.detector().named().unwrap().step, 20);
        let status = state.status();
        assert_eq!(lock(&status).best_step, Some(20));
        let kept = state_dir.join("best/ckpt_20.pt");
        wait_for_kept(&state, KeptCopy::At(kept.display().to_string()));
        assert_eq!(std::fs::read_to_string(&kept).unwrap(), "weights 20");
        assert!(!state_dir.join("best/ckpt_50.pt").exists());
    }

    /// Evaluation behind rotation with a smoothed detector (median of 3): each checkpoint is
    /// deleted by rotation as soon as it is pinned, and is named best only one or two
    /// evaluations after its own. Its pin is held until the detector can no longer name it, so
    /// every step ever named best is kept, from its pin, with the files that were evaluated;
    /// then only the best's and the contenders' pins remain.
    #[test]
    fn every_best_is_kept_from_its_pin_though_named_after_rotation_deleted_it() {
        let (run, state_dir, pins, mut state) = keeping(EarlyStopSettings {
            window: 3,
            ..settings()
        });
        let mut named = Vec::new();
        for (step, icr) in [
            (10, 5.0),
            (20, 4.5),
            (30, 4.0),
            (40, 3.0),
            (50, 2.0),
            (60, 2.5),
        ]
        .into_iter()
        .chain([(70, 1.0), (80, 3.5), (90, 4.0), (100, 4.5)])
        {
            // Rotation deletes it long before its turn.
            let (work, checkpoint) = pinned_then_rotated(run.path(), &pins, step);
            let record = Evaluation {
                step,
                checkpoint,
                icr: Some(icr),
                ..Evaluation::default()
            };
            let before = state.detector().best.as_ref().map(|b| b.step);
            state.observe(&Outcome::Done(work, Box::new(record)), &at(step));
            let best = state.detector().best.clone().unwrap();
            if before != Some(best.step) {
                named.push(best.step);
                let kept = state
                    .keeper
                    .as_ref()
                    .unwrap()
                    .kept(Path::new(&best.checkpoint));
                let expected = state_dir.join(format!("best/ckpt_{}.pt", best.step));
                assert_eq!(
                    kept.as_ref(),
                    Some(&expected),
                    "step {} named best",
                    best.step
                );
                assert_eq!(
                    std::fs::read_to_string(&expected).unwrap(),
                    format!("weights {}", best.step)
                );
            }
        }
        // The medians of 3 are 5, 4.75, 4.5, 4, 3, 2.5, 2, 2.5, 3.5, 4: each names the middle
        // value's step, one evaluation late (30 at 40's), or two (50 at 70's).
        assert_eq!(named, [10, 20, 30, 40, 60, 50]);
        // Left held: the best's pin (50, 2.0); the window's 4.0 and 4.5 cannot be named.
        let best = state.detector().best.clone().unwrap();
        assert_eq!(state.held(), [best.checkpoint]);
        let on_disk = std::fs::read_dir(state_dir.join(crate::store::pin::PINS_DIR))
            .unwrap()
            .count();
        assert_eq!(on_disk, 1);
        drop(state);
    }

    /// `diffmon report` draws what the live page of a restarted daemon shows.
    #[test]
    fn the_replayed_snapshot_is_the_reports() {
        let entries: Vec<Entry> = run_outcomes().iter().map(entry).collect();
        let (state, _) = replayed(&entries);
        let report = Snapshot::replay("r", EarlyStopMetric::Icr, settings(), &entries);
        assert_eq!(*lock(&state.snapshot), report);
    }

    /// The turn of [`run_outcomes`] (fired at 600, best 400), then `diffmon resume` from 400.
    fn resumed_at_400() -> Vec<Entry> {
        let mut entries: Vec<Entry> = run_outcomes()[..6].iter().map(entry).collect();
        entries.push(Entry::Resume {
            at: at(650),
            step: 400,
            checkpoint: "ckpt_400.pt".into(),
            restored: None,
            set_aside: vec!["set-aside/segment-1/ckpt_500.pt".into()],
        });
        entries
    }

    /// One best for `diffmon resume` and the restarted detector (issue #45): with the median of
    /// 3, step 350 is named best only by the window 300, 350, 400; `resume` (no early stop yet)
    /// takes it as the best so far, and the detector restarted on the lineage up to 350, which
    /// alone would name 300 (the median of 250, 300, 350), goes on from 350 too.
    #[test]
    fn resume_and_the_restarted_detector_name_the_same_best() {
        let window3 = EarlyStopSettings {
            window: 3,
            ..settings()
        };
        let mut entries: Vec<Entry> = [(250, 0.6), (300, 0.5), (350, 0.45), (400, 0.4), (450, 0.9)]
            .into_iter()
            .map(|(step, icr)| entry(&done(step, icr)))
            .collect();
        let before = Snapshot::replay("r", EarlyStopMetric::Icr, window3.clone(), &entries);
        let best = before.best.clone().unwrap();
        assert_eq!((best.step, best.value), (350, 0.45));
        assert_eq!(before.fired, None);
        entries.push(Entry::Resume {
            at: at(460),
            step: 350,
            checkpoint: best.checkpoint.clone(),
            restored: None,
            set_aside: Vec::new(),
        });
        let (state, _) = RunState::replay(
            "r",
            "",
            window3.clone(),
            &entries,
            Arc::new(Metrics::new("r")),
            None,
        );
        let after = state.detector().best.clone().unwrap();
        assert_eq!((after.step, after.value), (350, 0.45));
        assert_eq!(status(&state)["best_step"], 350);
        let report = Snapshot::replay("r", EarlyStopMetric::Icr, window3, &entries);
        assert_eq!(report.best.map(|b| b.step), Some(350));
    }

    /// After a resume the run is not stopped any more: the replay ends with a `resolved` event
    /// for the early stop that stood (its id the new segment's, so the same steps turning again
    /// fire anew), the status and metrics show the lineage's best and segment 2, and the live
    /// page keeps the abandoned branch, marked.
    #[test]
    fn a_resume_resolves_the_early_stop_and_starts_a_segment() {
        let entries = resumed_at_400();
        let (mut state, replayed) = replayed(&entries);
        let kinds: Vec<_> = replayed.events.iter().map(|e| e.event).collect();
        assert_eq!(kinds, [EventKind::EarlyStop, EventKind::Resolved]);
        let resolved = &replayed.events[1];
        assert_eq!(
            resolved.id,
            event_id("r", "#segment-2", EventKind::Resolved, 400, 400)
        );
        assert_eq!((resolved.best_step, resolved.current_step), (400, 400));
        let s = status(&state);
        assert_eq!(s["fired"], false);
        assert_eq!(s["segment"], 2);
        assert_eq!(s["best_step"], 400);
        assert_eq!(s["last_step"], 400);
        let run = "run=\"r\"";
        assert_eq!(sample(&state, EARLY_STOP_TRIGGERED, run), Some(0.0));
        assert_eq!(sample(&state, HISTORY_SEGMENT, run), Some(2.0));
        {
            let snap = lock(&state.snapshot);
            let abandoned: Vec<i64> = snap
                .rows
                .iter()
                .filter(|r| r.abandoned)
                .map(|r| r.step)
                .collect();
            assert_eq!(abandoned, [500, 600]);
            assert_eq!(
                (snap.segment, snap.resumes.as_slice()),
                (2, &[(400, 2)][..])
            );
            assert_eq!(snap.fired, None);
        }
        // The new segment turns at the same steps: a new early stop, with a new id.
        assert_eq!(state.observe(&done(500, 3.0), &at(700)), None);
        let again = state
            .observe(&done(600, 4.0), &at(800))
            .expect("fires again");
        assert_eq!(again.event, EventKind::EarlyStop);
        assert_eq!(
            again.id,
            event_id("r", "#segment-2", EventKind::EarlyStop, 400, 600)
        );
        assert_ne!(again.id, replayed.events[0].id);
        assert_eq!(lock(&state.snapshot).rows.last().unwrap().segment, 2);
        // The report draws the same.
        let mut all = entries.clone();
        all.extend([done(500, 3.0), done(600, 4.0)].iter().map(entry));
        let (restarted, _) = self::replayed(&all);
        let report = Snapshot::replay("r", EarlyStopMetric::Icr, settings(), &all);
        assert_eq!(*lock(&restarted.snapshot), report);
    }
}
