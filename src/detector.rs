//! The early-stop detector (docs/design.md §9): finds the turn of the ICR (or E_gen) U-curve.
//!
//! Each evaluation adds one raw value; the smoothed value is the median of the last `window` raw
//! values; `best` is the smallest smoothed value so far, named after the checkpoint the median
//! picked (the middle one of the window by value; for an even window, the lower middle one), so
//! the checkpoint it names has that very value, not the newest checkpoint of the window.
//!
//! The detector fires when the smoothed value has stayed above `best · (1 + min_rise)` for
//! `patience` consecutive checkpoints, after `warmup` checkpoints, and only if the curve
//! actually came down to its minimum (its first smoothed value is at least
//! `best · (1 + min_rise)`): a flat or only-rising curve never fires, nor does a decreasing one.
//! It fires once per run. A later dip below the old best by `min_rise` (double descent) yields
//! one `resolved`. With a confirmation signal configured, a turn fires only once that signal has
//! risen since the best step too, beyond its noise floor; until then the turn is reported as
//! unconfirmed and sends nothing.
//!
//! The state is plain data and is never stored: the daemon (and `diffmon report`) derives it by
//! replaying the history journal through a fresh detector at start-up (docs/design.md §9), so it
//! cannot disagree with the journal, and a restart neither forgets the best nor fires twice (the
//! replayed events keep their ids, and the alerter delivers each id once).

use crate::config::{Confirm, EarlyStopConfig, EarlyStopMetric};
use crate::history::Entry;
use crate::record::Evaluation;
use serde::{Deserialize, Serialize};

/// The gap's noise floor, as a fraction of the held-out loss at the best step.
const GAP_FLOOR: f64 = 0.1;
/// The memorization ratio's noise floor (one memorized sample in a hundred).
const MEMORIZATION_FLOOR: f64 = 0.01;

/// One evaluation as the detector sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct Observation {
    pub step: i64,
    pub checkpoint: String,
    /// The monitored metric (ICR or E_gen); `None` when it was not computed for this checkpoint.
    pub value: Option<f64>,
    pub generalization_gap: Option<f64>,
    /// The held-out loss: the scale below which a change of the gap is noise.
    pub loss_heldout: Option<f64>,
    pub memorization_ratio: Option<f64>,
}

impl Observation {
    /// An evaluation record as the detector sees it, watching `metric`.
    pub fn of(r: &Evaluation, metric: EarlyStopMetric) -> Observation {
        Observation {
            step: r.step,
            checkpoint: r.checkpoint.clone(),
            value: metric.value(r),
            generalization_gap: r.generalization_gap,
            loss_heldout: r.loss_heldout,
            memorization_ratio: r.memorization_ratio,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Best {
    pub step: i64,
    pub checkpoint: String,
    pub value: f64,
    /// The confirmation signal when this best was found (at the newest checkpoint of the
    /// window, which may be later than `step`), when one is configured and was measured.
    pub confirm_value: Option<f64>,
    /// The smallest rise of the confirmation signal that is not noise, taken with
    /// `confirm_value` (see [`Detector::confirmed`]).
    #[serde(default)]
    pub confirm_floor: f64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Signal {
    EarlyStop,
    Resolved,
}

/// What one observation decided.
#[derive(Debug, Clone, PartialEq)]
pub struct Decision {
    pub smoothed: Option<f64>,
    /// An event to send now.
    pub signal: Option<Signal>,
    /// The curve has turned, but the confirmation signal has not risen: nothing is sent.
    pub unconfirmed: bool,
}

/// One raw value of the smoothing window.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Point {
    pub step: i64,
    pub checkpoint: String,
    pub value: f64,
}

/// The detector's whole state: plain data, rebuilt by replaying the journal (never stored).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct DetectorState {
    /// The last `window` evaluations that had a value.
    pub recent: Vec<Point>,
    pub evaluated: usize,
    pub first_smoothed: Option<f64>,
    pub best: Option<Best>,
    /// Consecutive checkpoints above `best · (1 + min_rise)`.
    pub wait: usize,
    pub last_step: Option<i64>,
    pub last_value: Option<f64>,
    pub last_smoothed: Option<f64>,
    /// The best when the early stop fired (kept after a later, better minimum).
    pub fired: Option<Best>,
    pub fired_step: Option<i64>,
    pub resolved: bool,
    pub unconfirmed: bool,
}

pub struct Detector {
    config: EarlyStopConfig,
    pub state: DetectorState,
}

impl Detector {
    pub fn new(config: EarlyStopConfig, state: DetectorState) -> Detector {
        Detector { config, state }
    }

    /// Its settings (with `confirm: auto` resolved by the caller).
    pub fn config(&self) -> &EarlyStopConfig {
        &self.config
    }

    /// The confirmation signal of an observation, and its noise floor.
    fn confirm_signal(&self, o: &Observation) -> (Option<f64>, f64) {
        match self.config.confirm {
            // `auto` is resolved by the caller (Config::early_stop_resolved); unresolved, it
            // confirms nothing, like `none`.
            Confirm::None | Confirm::Auto => (None, 0.0),
            Confirm::GeneralizationGap => (
                o.generalization_gap,
                GAP_FLOOR * o.loss_heldout.unwrap_or(0.0).abs(),
            ),
            Confirm::MemorizationRatio => (o.memorization_ratio, MEMORIZATION_FLOOR),
        }
    }

    /// Has the confirmation signal risen since the best step by `confirm_rise` of its value
    /// there, and by at least `confirm_rise` of the noise floor? Without the floor a gap that
    /// hovers around zero (data-rich training) would "rise by 50%" on noise alone.
    fn confirmed(&self, now: Option<f64>) -> bool {
        if matches!(self.config.confirm, Confirm::None | Confirm::Auto) {
            return true;
        }
        let Some(best) = self.state.best.as_ref() else {
            return false;
        };
        match (best.confirm_value, now) {
            (Some(base), Some(now)) => {
                now - base > self.config.confirm_rise * base.abs().max(best.confirm_floor)
            }
            _ => false,
        }
    }

    /// Adds one evaluation; returns what it decided.
    pub fn observe(&mut self, o: &Observation) -> Decision {
        let c = &self.config;
        let s = &mut self.state;
        s.last_step = Some(o.step);
        let Some(value) = o.value.filter(|v| v.is_finite()) else {
            return Decision {
                smoothed: s.last_smoothed,
                signal: None,
                unconfirmed: false,
            };
        };
        s.evaluated += 1;
        s.last_value = Some(value);
        s.recent.push(Point {
            step: o.step,
            checkpoint: o.checkpoint.clone(),
            value,
        });
        if s.recent.len() > c.window {
            s.recent.remove(0);
        }
        let (smoothed, at) = median(&s.recent);
        s.last_smoothed = Some(smoothed);
        s.first_smoothed.get_or_insert(smoothed);
        let (confirm_now, confirm_floor) = self.confirm_signal(o);
        let s = &mut self.state;

        let mut signal = None;
        let improved = s.best.as_ref().is_none_or(|b| smoothed < b.value);
        if improved {
            if let (Some(fired), false) = (&s.fired, s.resolved)
                && smoothed < fired.value * (1.0 - c.min_rise)
            {
                s.resolved = true;
                signal = Some(Signal::Resolved);
            }
            s.best = Some(Best {
                step: at.step,
                checkpoint: at.checkpoint,
                value: smoothed,
                confirm_value: confirm_now,
                confirm_floor,
            });
            s.wait = 0;
        } else {
            let best = s.best.as_ref().expect("set on the first value").value;
            if smoothed > best * (1.0 + c.min_rise) {
                s.wait += 1;
            } else {
                s.wait = 0;
            }
        }

        let mut unconfirmed = false;
        let best = s.best.clone().expect("set on the first value");
        let descended = s
            .first_smoothed
            .is_some_and(|f| f >= best.value * (1.0 + c.min_rise));
        let turned = s.evaluated >= c.warmup && s.wait >= c.patience && descended;
        if turned && s.fired.is_none() {
            if self.confirmed(confirm_now) {
                let s = &mut self.state;
                s.fired = Some(best);
                s.fired_step = Some(o.step);
                s.unconfirmed = false;
                signal = Some(Signal::EarlyStop);
            } else {
                unconfirmed = true;
                self.state.unconfirmed = true;
            }
        }
        Decision {
            smoothed: Some(smoothed),
            signal,
            unconfirmed,
        }
    }
}

/// The median of the points' values, and the point it names: the middle one by value (for an
/// even count, the median is the mean of the two middle values and names the lower one).
fn median(points: &[Point]) -> (f64, Point) {
    let mut v: Vec<&Point> = points.iter().collect();
    v.sort_by(|a, b| a.value.total_cmp(&b.value));
    let n = v.len();
    if n % 2 == 1 {
        (v[n / 2].value, v[n / 2].clone())
    } else {
        let (lo, hi) = (v[n / 2 - 1], v[n / 2]);
        ((lo.value + hi.value) / 2.0, lo.clone())
    }
}

/// Replays a history (docs/design.md §9): feeds its evaluations, in journal order, to
/// `detector` (a fresh one, for the state the journal implies) watching `metric`, and hands each
/// to `each` with the detector's decision and its state afterwards. Failures are not observed;
/// returns how many there were. The daemon rebuilds its state at start-up this way, and
/// `diffmon report` its plots.
pub fn replay<'a>(
    detector: &mut Detector,
    metric: EarlyStopMetric,
    entries: &'a [Entry],
    mut each: impl FnMut(&'a Evaluation, &'a str, &Decision, &DetectorState),
) -> usize {
    let mut failures = 0;
    for entry in entries {
        match entry {
            Entry::Evaluation { record, at, .. } => {
                let decision = detector.observe(&Observation::of(record, metric));
                each(record, at, &decision, &detector.state);
            }
            Entry::Failure { .. } => failures += 1,
        }
    }
    failures
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(values: &[f64], config: EarlyStopConfig) -> (Detector, Vec<(i64, Decision)>) {
        run_with(values, &vec![None; values.len()], config)
    }

    fn run_with(
        values: &[f64],
        gaps: &[Option<f64>],
        config: EarlyStopConfig,
    ) -> (Detector, Vec<(i64, Decision)>) {
        let mut d = Detector::new(config, DetectorState::default());
        let decisions = values
            .iter()
            .zip(gaps)
            .enumerate()
            .map(|(i, (&v, &gap))| {
                let o = observation(i, v, gap);
                (o.step, d.observe(&o))
            })
            .collect();
        (d, decisions)
    }

    /// The `i`-th evaluation of a run with a checkpoint every 50 steps.
    fn observation(i: usize, value: f64, gap: Option<f64>) -> Observation {
        let step = 50 * (i as i64 + 1);
        Observation {
            step,
            checkpoint: format!("ckpt_{step}.pt"),
            value: Some(value),
            generalization_gap: gap,
            loss_heldout: Some(0.1),
            memorization_ratio: None,
        }
    }

    /// Deterministic noise in [-1, 1].
    fn noise(i: usize) -> f64 {
        let x = (i as f64 * 12.9898).sin() * 43758.5453;
        2.0 * (x - x.floor()) - 1.0
    }

    fn fired_at(decisions: &[(i64, Decision)], signal: Signal) -> Vec<i64> {
        decisions
            .iter()
            .filter(|(_, d)| d.signal == Some(signal))
            .map(|(s, _)| *s)
            .collect()
    }

    #[test]
    fn noisy_u_curve_fires_once_after_the_minimum() {
        // Minimum at index 12 (step 650); ±0.5% noise.
        let values: Vec<f64> = (0..30)
            .map(|i| 0.8 + 0.002 * (i as f64 - 12.0).powi(2) + 0.004 * noise(i))
            .collect();
        let (d, decisions) = run(&values, EarlyStopConfig::default());
        let fired = fired_at(&decisions, Signal::EarlyStop);
        assert_eq!(fired.len(), 1, "{decisions:?}");
        let best = d.state.fired.unwrap();
        assert!((550..=750).contains(&best.step), "best step {}", best.step);
        assert!(fired[0] > best.step);
        assert!(fired_at(&decisions, Signal::Resolved).is_empty());
    }

    #[test]
    fn best_names_the_checkpoint_the_median_picked() {
        // Window 3: the smallest median, 0.80, is the value of step 200, though it becomes the
        // median only at step 250 (window 0.85, 0.80, 0.79).
        let values = [0.95, 0.90, 0.85, 0.80, 0.79, 0.86, 0.88, 0.90];
        let (d, _) = run(&values, EarlyStopConfig::default());
        let best = d.state.best.unwrap();
        assert_eq!((best.step, best.value), (200, 0.80));
        assert_eq!(best.checkpoint, "ckpt_200.pt");
        // Even window: the mean of the two middle values, named after the lower one.
        let config = EarlyStopConfig {
            window: 2,
            ..EarlyStopConfig::default()
        };
        let (d, _) = run(&[0.9, 0.7, 0.8, 0.95], config);
        let best = d.state.best.unwrap();
        assert_eq!(best.step, 100);
        assert!((best.value - 0.75).abs() < 1e-12);
    }

    #[test]
    fn noisy_decreasing_curve_never_fires() {
        let values: Vec<f64> = (0..40)
            .map(|i| 0.9 * (-(i as f64) / 15.0).exp() + 0.3 + 0.003 * noise(i))
            .collect();
        let (_, decisions) = run(&values, EarlyStopConfig::default());
        assert!(decisions.iter().all(|(_, d)| d.signal.is_none()));
    }

    #[test]
    fn flat_or_only_rising_curve_never_fires() {
        let rising: Vec<f64> = (0..30).map(|i| 0.5 + 0.01 * i as f64).collect();
        let (_, decisions) = run(&rising, EarlyStopConfig::default());
        assert!(decisions.iter().all(|(_, d)| d.signal.is_none()));
        let flat: Vec<f64> = (0..30).map(|i| 0.5 + 0.002 * noise(i)).collect();
        let (_, decisions) = run(&flat, EarlyStopConfig::default());
        assert!(decisions.iter().all(|(_, d)| d.signal.is_none()));
    }

    #[test]
    fn dip_below_the_old_best_sends_resolved_once() {
        let mut values: Vec<f64> = (0..20)
            .map(|i| 0.8 + 0.003 * (i as f64 - 8.0).powi(2))
            .collect();
        values.extend((0..10).map(|i| 0.78 - 0.01 * i as f64));
        let (_, decisions) = run(&values, EarlyStopConfig::default());
        assert_eq!(fired_at(&decisions, Signal::EarlyStop).len(), 1);
        assert_eq!(fired_at(&decisions, Signal::Resolved).len(), 1);
        // It fired once per run: the second descent and rise do not fire again.
        assert!(
            fired_at(&decisions, Signal::Resolved)[0] > fired_at(&decisions, Signal::EarlyStop)[0]
        );
    }

    #[test]
    fn unconfirmed_turn_sends_nothing_until_the_gap_rises() {
        let values: Vec<f64> = (0..30)
            .map(|i| 0.8 + 0.002 * (i as f64 - 10.0).powi(2))
            .collect();
        let config = EarlyStopConfig {
            confirm: Confirm::GeneralizationGap,
            ..EarlyStopConfig::default()
        };
        // A flat gap never confirms.
        let (_, decisions) = run_with(&values, &vec![Some(0.01); 30], config.clone());
        assert!(decisions.iter().all(|(_, d)| d.signal.is_none()));
        assert!(decisions.iter().any(|(_, d)| d.unconfirmed));
        // The gap rises by more than 50% from step 1000 on: the turn fires then.
        let gaps: Vec<Option<f64>> = (0..30)
            .map(|i| Some(if i >= 19 { 0.02 } else { 0.01 }))
            .collect();
        let (_, decisions) = run_with(&values, &gaps, config.clone());
        assert_eq!(fired_at(&decisions, Signal::EarlyStop), vec![1000]);
        // A gap hovering around zero (data-rich training) changes by far more than 50% of
        // itself, but never by 5% of the held-out loss (floor 0.1 · 0.1 · 0.5): no confirmation.
        let gaps: Vec<Option<f64>> = (0..30).map(|i| Some(0.002 * noise(i))).collect();
        let (_, decisions) = run_with(&values, &gaps, config);
        assert!(decisions.iter().all(|(_, d)| d.signal.is_none()));
        assert!(decisions.iter().any(|(_, d)| d.unconfirmed));
    }

    #[test]
    fn restored_state_neither_forgets_nor_fires_twice() {
        let values: Vec<f64> = (0..30)
            .map(|i| 0.8 + 0.002 * (i as f64 - 10.0).powi(2))
            .collect();
        let (whole, decisions) = run(&values, EarlyStopConfig::default());
        let fired = fired_at(&decisions, Signal::EarlyStop);
        // Split the run at step 750 and carry the state over through JSON.
        let (first, _) = run(&values[..15], EarlyStopConfig::default());
        let json = serde_json::to_string(&first.state).unwrap();
        let mut d = Detector::new(
            EarlyStopConfig::default(),
            serde_json::from_str(&json).unwrap(),
        );
        let mut signals = Vec::new();
        for (i, &v) in values.iter().enumerate().skip(15) {
            let o = observation(i, v, None);
            if let Some(s) = d.observe(&o).signal {
                signals.push((o.step, s));
            }
        }
        let all: Vec<i64> = fired.clone();
        let resumed: Vec<i64> = signals
            .iter()
            .filter(|(_, s)| *s == Signal::EarlyStop)
            .map(|(st, _)| *st)
            .collect();
        let before_split: Vec<i64> = all.iter().copied().filter(|&s| s <= 750).collect();
        assert_eq!([before_split, resumed].concat(), all);
        assert_eq!(d.state, whole.state);
    }

    /// A replayed journal gives each evaluation the decision and state of feeding the records
    /// to a detector one by one, skips and counts the failures, and reads the configured metric.
    #[test]
    fn replay_feeds_the_evaluations_in_order_and_counts_failures() {
        use crate::history::CheckpointKey;
        let values: Vec<f64> = (0..30)
            .map(|i| 0.8 + 0.002 * (i as f64 - 10.0).powi(2))
            .collect();
        let (direct, decisions) = run(&values, EarlyStopConfig::default());
        let key = |i: usize| CheckpointKey {
            path: format!("ckpt_{i}.pt"),
            size: 1,
            mtime_ns: 0,
        };
        let mut entries = Vec::new();
        for (i, &v) in values.iter().enumerate() {
            let o = observation(i, v, None);
            if i % 7 == 3 {
                entries.push(Entry::Failure {
                    key: key(100 + i),
                    at: "t".into(),
                    step: o.step - 1,
                    reason: "error".into(),
                    message: "m".into(),
                });
            }
            entries.push(Entry::Evaluation {
                key: key(i),
                at: format!("at {i}"),
                record: Box::new(Evaluation {
                    step: o.step,
                    checkpoint: o.checkpoint,
                    // The other metric: a replay watching ICR must not read it.
                    icr: Some(v),
                    pfd_generalization: Some(-v),
                    loss_heldout: o.loss_heldout,
                    ..Evaluation::default()
                }),
            });
        }
        let mut d = Detector::new(EarlyStopConfig::default(), DetectorState::default());
        let mut seen = Vec::new();
        let failures = replay(
            &mut d,
            EarlyStopMetric::Icr,
            &entries,
            |r, at, decision, state| {
                assert_eq!(at, format!("at {}", r.step / 50 - 1));
                assert_eq!(state.last_step, Some(r.step));
                seen.push((r.step, decision.clone()));
            },
        );
        assert_eq!(failures, 4);
        assert_eq!(seen, decisions);
        assert_eq!(d.state, direct.state);
        assert!(!fired_at(&seen, Signal::EarlyStop).is_empty());
    }
}
