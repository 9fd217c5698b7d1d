//! The early-stop detector (docs/design.md §9): finds the turn of the ICR (or E_gen) U-curve.
//!
//! Each evaluation adds one raw value. The smoothed value is the median of the last `window`
//! raw values (`smoother: median`), or their exponential moving average (`smoother: ema`).
//! `best` is the smallest smoothed value so far, named after a checkpoint of the window: the one
//! the median picked (the middle one by value; for an even window, the lower middle one), so the
//! checkpoint it names has that very value; for the average, the checkpoint at its centre of
//! mass, `(window − 1)/2` checkpoints back.
//!
//! **Noise.** The series' own noise `σ` is a robust scale of its checkpoint-to-checkpoint
//! scatter: `1.4826 · MAD(Δ²x) / √6` over the second differences of the last [`NOISE_SPAN`]
//! values (the median absolute deviation about their median; `√6` makes it the standard
//! deviation of white noise; second differences leave a steady trend out, and the MAD a few
//! jumps). It needs [`MIN_NOISE_POINTS`] values. Before that, ICR's jackknife standard error
//! stands in when the records have it: it overstates the noise of a rise, since every checkpoint
//! sees the same views and most of that error is shared. The smoothed value's noise is `σ` times
//! [`Smoother`]'s factor: `√(π/(2·window))` (at most 1) for the median, `1/√window` for the
//! average.
//!
//! **Turn.** The rise that counts is `threshold = max(min_rise·|best|, noise_multiple · noise)`.
//! The detector fires when the smoothed value has stayed above `best + threshold` for
//! `patience` consecutive checkpoints, after `warmup` checkpoints, and only if the curve actually
//! came down to its minimum (its first smoothed value is at least `best + threshold`): a flat or
//! only-rising curve never fires, nor does a decreasing one. With the noise rule on
//! (`noise_multiple > 0`) nothing fires while the noise is unknown. It fires once per run. A
//! later dip below the old best by the threshold (double descent) yields one `resolved`. With a
//! confirmation signal configured, a turn fires only once that signal has risen since the best
//! step too, beyond its noise floor; until then the turn is reported as unconfirmed and sends
//! nothing. The signal is taken at its last measurement (the PF-ODE metrics may run on every
//! `pfd.every`-th checkpoint only).
//!
//! **Memorization.** Whatever confirms, and turned or not, the early stop also fires at the first
//! measurement of the memorization ratio at `memorization_level` or above (0 turns it off),
//! naming the best of the checkpoints evaluated before that one ([`Trigger::Memorization`]): with
//! few training images a model can copy them while the curve still falls or stays flat. While the
//! ratio's last measurement is at the level, a dip does not resolve a stop. Where the ratio stays
//! under the level, every decision is the one the detector without the rule makes.
//!
//! The state is plain data and is never stored: the daemon (and `diffmon report`, `diffmon
//! replay`) derives it by replaying the history journal through a fresh detector
//! (docs/design.md §9), so it cannot disagree with the journal, and a restart neither forgets the
//! best nor fires twice (the replayed events keep their ids, and the alerter delivers each id
//! once).

use crate::config::{Confirmation, EarlyStopMetric, EarlyStopSettings, Smoother, Trigger};
use crate::record::Evaluation;
use crate::store::history::{CheckpointKey, Entry, segments};
use serde::{Deserialize, Serialize};

/// The gap's noise floor, as a fraction of the held-out loss at the best step.
const GAP_FLOOR: f64 = 0.1;
/// The memorization ratio's noise floor (one memorized sample in a hundred).
const MEMORIZATION_FLOOR: f64 = 0.01;
/// The values the noise is estimated from: the newest ones, at most this many.
pub const NOISE_SPAN: usize = 64;
/// Values needed before the scatter estimates the noise (six second differences).
pub const MIN_NOISE_POINTS: usize = 8;
/// 1/Φ⁻¹(3/4): the median absolute deviation of normal noise times this is its standard
/// deviation.
const MAD_TO_SD: f64 = 1.482_602_218_505_602;

/// One evaluation as the detector sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct Observation {
    pub step: i64,
    pub checkpoint: String,
    /// The monitored metric (ICR or E_gen); `None` when it was not computed for this checkpoint.
    pub value: Option<f64>,
    /// The standard error of `value`, when the record has one (ICR's jackknife).
    pub stderr: Option<f64>,
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
            stderr: match metric {
                EarlyStopMetric::Icr => r.icr_stderr,
                EarlyStopMetric::PfdGeneralization => None,
            },
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
    /// The confirmation signal's last measurement when this best was found (at the newest
    /// checkpoint of the window or before, which may be later than `step`), when one is
    /// configured and was measured.
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
    /// The noise of the smoothed value (see the module docs); `None` until it is known.
    pub noise: Option<f64>,
    /// The rise over the best that counts as a turn, `max(min_rise·|best|, noise_multiple ·
    /// noise)`; `None` while the noise rule is on and the noise unknown (nothing fires then).
    pub threshold: Option<f64>,
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
    #[serde(default)]
    pub stderr: Option<f64>,
}

/// The detector's whole state: plain data, rebuilt by replaying the journal (never stored).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct DetectorState {
    /// The last `window` evaluations that had a value.
    pub recent: Vec<Point>,
    /// The last [`NOISE_SPAN`] values, for the noise.
    #[serde(default)]
    pub values: Vec<f64>,
    /// The exponential moving average (`smoother: ema`).
    #[serde(default)]
    pub average: Option<f64>,
    pub evaluated: usize,
    pub first_smoothed: Option<f64>,
    pub best: Option<Best>,
    /// Consecutive checkpoints above `best + threshold`.
    pub wait: usize,
    pub last_step: Option<i64>,
    pub last_value: Option<f64>,
    pub last_smoothed: Option<f64>,
    #[serde(default)]
    pub last_noise: Option<f64>,
    #[serde(default)]
    pub last_threshold: Option<f64>,
    /// The confirmation signal's last measurement and its noise floor.
    #[serde(default)]
    pub confirm_last: Option<(f64, f64)>,
    /// The memorization ratio's last measurement, whatever confirms.
    #[serde(default)]
    pub memorization_last: Option<f64>,
    /// The best when the early stop fired (kept after a later, better minimum).
    pub fired: Option<Best>,
    pub fired_step: Option<i64>,
    /// Why it fired.
    #[serde(default)]
    pub fired_by: Option<Trigger>,
    pub resolved: bool,
    pub unconfirmed: bool,
}

impl DetectorState {
    /// The best the run's outputs name and keep: the one the early stop named while the stop
    /// stands (the curve may set lower values after a stop the memorization ratio fired, or
    /// dip by less than the threshold after a turn), else the best so far.
    pub fn named(&self) -> Option<&Best> {
        self.fired
            .as_ref()
            .filter(|_| !self.resolved)
            .or(self.best.as_ref())
    }
}

pub struct Detector {
    config: EarlyStopSettings,
    pub state: DetectorState,
}

impl Smoother {
    /// The standard deviation of the smoothed value of white noise of standard deviation 1: for
    /// the median `√(π/(2·window))` (its large-window value; it overstates small windows a
    /// little, 0.72 against 0.67 for 3), at most 1; for the average of span `window`, whose
    /// weight is `α = 2/(window + 1)`, `√(α/(2 − α)) = 1/√window`.
    pub fn noise_factor(self, window: usize) -> f64 {
        let w = window.max(1) as f64;
        match self {
            Smoother::Median => (std::f64::consts::PI / (2.0 * w)).sqrt().min(1.0),
            Smoother::Ema => 1.0 / w.sqrt(),
        }
    }
}

/// The robust scale of the scatter of `values` (module docs); `None` for fewer than
/// [`MIN_NOISE_POINTS`].
pub fn scatter(values: &[f64]) -> Option<f64> {
    if values.len() < MIN_NOISE_POINTS {
        return None;
    }
    let second: Vec<f64> = values
        .windows(3)
        .map(|w| w[2] - 2.0 * w[1] + w[0])
        .collect();
    let centre = median_of(&second);
    let deviations: Vec<f64> = second.iter().map(|d| (d - centre).abs()).collect();
    Some(MAD_TO_SD * median_of(&deviations) / 6f64.sqrt())
}

fn median_of(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

impl Detector {
    pub fn new(config: EarlyStopSettings, state: DetectorState) -> Detector {
        Detector { config, state }
    }

    /// Its settings.
    pub fn config(&self) -> &EarlyStopSettings {
        &self.config
    }

    /// The confirmation signal of an observation, and its noise floor.
    fn confirm_signal(&self, o: &Observation) -> Option<(f64, f64)> {
        match self.config.confirm {
            Confirmation::None => None,
            Confirmation::GeneralizationGap => o
                .generalization_gap
                .map(|g| (g, GAP_FLOOR * o.loss_heldout.unwrap_or(0.0).abs())),
            Confirmation::MemorizationRatio => {
                o.memorization_ratio.map(|m| (m, MEMORIZATION_FLOOR))
            }
        }
        .filter(|(v, _)| v.is_finite())
    }

    /// Has the confirmation signal (its last measurement) risen since the best step by
    /// `confirm_rise` of its value there, and by at least `confirm_rise` of the noise floor?
    /// Without the floor a gap that hovers around zero (data-rich training) would "rise by 50%"
    /// on noise alone.
    fn confirmed(&self) -> bool {
        if self.config.confirm == Confirmation::None {
            return true;
        }
        self.confirmation()
            .is_some_and(|(base, now, needed)| now - base > needed)
    }

    /// The confirmation signal at the best step, now, and the rise it needs
    /// ([`Detector::confirmed`]); `None` before both are measured.
    pub fn confirmation(&self) -> Option<(f64, f64, f64)> {
        let best = self.state.best.as_ref()?;
        let (base, (now, _)) = (best.confirm_value?, self.state.confirm_last?);
        Some((
            base,
            now,
            self.config.confirm_rise * base.abs().max(best.confirm_floor),
        ))
    }

    /// Has the memorization ratio (its last measurement) reached `memorization_level`?
    fn memorizing(&self) -> bool {
        let level = self.config.memorization_level;
        level > 0.0 && self.state.memorization_last.is_some_and(|m| m >= level)
    }

    /// Fires the early stop, naming `best`, at `step`.
    fn fire(&mut self, best: Best, step: i64, by: Trigger) -> Signal {
        let s = &mut self.state;
        s.fired = Some(best);
        s.fired_step = Some(step);
        s.fired_by = Some(by);
        s.unconfirmed = false;
        Signal::EarlyStop
    }

    /// The early stop by memorization, before anything fired: at the first measurement of the
    /// memorization ratio at `memorization_level` or above, naming the best of the checkpoints
    /// evaluated before this one (`before`), or, with none, this one's.
    fn memorization_stop(&mut self, step: i64, before: Option<Best>) -> Option<Signal> {
        if self.state.fired.is_some() || !self.memorizing() {
            return None;
        }
        let best = before.or_else(|| self.state.best.clone())?;
        Some(self.fire(best, step, Trigger::Memorization))
    }

    /// The noise of the smoothed value, once known (module docs).
    fn noise(&self) -> Option<f64> {
        let s = &self.state;
        let raw = scatter(&s.values).or_else(|| {
            let errors: Vec<f64> = s
                .recent
                .iter()
                .filter_map(|p| p.stderr)
                .filter(|e| e.is_finite() && *e >= 0.0)
                .collect();
            (!errors.is_empty()).then(|| median_of(&errors))
        })?;
        Some(raw * self.config.smoother.noise_factor(self.config.window))
    }

    /// The rise over `best` that counts, with the smoothed value's `noise`.
    fn threshold(&self, best: f64, noise: Option<f64>) -> Option<f64> {
        let c = &self.config;
        let floor = c.min_rise * best.abs();
        if c.noise_multiple <= 0.0 {
            return Some(floor);
        }
        noise.map(|n| floor.max(c.noise_multiple * n))
    }

    /// The smoothed value and the point it names.
    fn smooth(&mut self) -> (f64, Point) {
        let c = &self.config;
        let s = &mut self.state;
        let newest = s.recent.last().expect("a value was just added");
        match c.smoother {
            Smoother::Median => median(&s.recent),
            Smoother::Ema => {
                let alpha = 2.0 / (c.window as f64 + 1.0);
                let v = newest.value;
                let average = s.average.map_or(v, |a| alpha * v + (1.0 - alpha) * a);
                s.average = Some(average);
                let back = ((c.window.max(1) - 1) / 2).min(s.recent.len() - 1);
                (average, s.recent[s.recent.len() - 1 - back].clone())
            }
        }
    }

    /// The checkpoints of the smoothing window that a later observation may still name best
    /// (besides the best itself): whoever holds their files against rotation (the pins,
    /// `RunState`) must hold them until they leave this list. A window that is full loses its
    /// oldest point at the next observation. The median names a point whose value is the
    /// smoothed one (or, for an even window, below it), so only points below the best's value
    /// can be named a new best; the average names the point `(window − 1)/2` back, so only the
    /// newest `(window − 1)/2` points can still be named. At most half the window.
    pub fn contenders(&self) -> Vec<&str> {
        let window = self.config.window.max(1);
        let recent = &self.state.recent;
        let staying = &recent[(recent.len() + 1).saturating_sub(window).min(recent.len())..];
        match self.config.smoother {
            Smoother::Median => {
                let best = self.state.best.as_ref().map_or(f64::INFINITY, |b| b.value);
                staying
                    .iter()
                    .filter(|p| p.value < best)
                    .map(|p| p.checkpoint.as_str())
                    .collect()
            }
            Smoother::Ema => {
                let back = (window - 1) / 2;
                staying[staying.len().saturating_sub(back)..]
                    .iter()
                    .map(|p| p.checkpoint.as_str())
                    .collect()
            }
        }
    }

    /// Adds one evaluation; returns what it decided.
    pub fn observe(&mut self, o: &Observation) -> Decision {
        self.state.last_step = Some(o.step);
        if let Some(signal) = self.confirm_signal(o) {
            self.state.confirm_last = Some(signal);
        }
        if let Some(m) = o.memorization_ratio.filter(|m| m.is_finite()) {
            self.state.memorization_last = Some(m);
        }
        let before = self.state.best.clone();
        let Some(value) = o.value.filter(|v| v.is_finite()) else {
            let signal = self.memorization_stop(o.step, before);
            let s = &self.state;
            return Decision {
                smoothed: s.last_smoothed,
                noise: s.last_noise,
                threshold: s.last_threshold,
                signal,
                unconfirmed: false,
            };
        };
        let window = self.config.window.max(1);
        let s = &mut self.state;
        s.evaluated += 1;
        s.last_value = Some(value);
        s.recent.push(Point {
            step: o.step,
            checkpoint: o.checkpoint.clone(),
            value,
            stderr: o.stderr,
        });
        if s.recent.len() > window {
            s.recent.remove(0);
        }
        s.values.push(value);
        if s.values.len() > NOISE_SPAN {
            s.values.remove(0);
        }
        let (smoothed, at) = self.smooth();
        let noise = self.noise();
        let s = &mut self.state;
        s.last_smoothed = Some(smoothed);
        s.last_noise = noise;
        s.first_smoothed.get_or_insert(smoothed);

        let mut signal = None;
        let improved = s.best.as_ref().is_none_or(|b| smoothed < b.value);
        if improved {
            // A model that copies its training images has not recovered because the curve dips.
            if let (Some(fired), false) = (&self.state.fired, self.state.resolved)
                && !self.memorizing()
                && let Some(t) = self.threshold(fired.value, noise)
                && smoothed < fired.value - t
            {
                self.state.resolved = true;
                signal = Some(Signal::Resolved);
            }
            let s = &mut self.state;
            let (confirm_value, confirm_floor) = match s.confirm_last {
                Some((v, floor)) => (Some(v), floor),
                None => (None, 0.0),
            };
            s.best = Some(Best {
                step: at.step,
                checkpoint: at.checkpoint,
                value: smoothed,
                confirm_value,
                confirm_floor,
            });
            s.wait = 0;
        }
        let best = self.state.best.clone().expect("set on the first value");
        let threshold = self.threshold(best.value, noise);
        let s = &mut self.state;
        s.last_threshold = threshold;
        if !improved {
            s.wait = match threshold {
                Some(t) if smoothed > best.value + t => s.wait + 1,
                _ => 0,
            };
        }

        let mut unconfirmed = false;
        let descended = match (s.first_smoothed, threshold) {
            (Some(first), Some(t)) => first >= best.value + t,
            _ => false,
        };
        let c = &self.config;
        let turned = s.evaluated >= c.warmup && s.wait >= c.patience && descended;
        if turned && s.fired.is_none() {
            if self.confirmed() {
                signal = Some(self.fire(best, o.step, Trigger::Turn));
            } else {
                unconfirmed = true;
                self.state.unconfirmed = true;
            }
        }
        if let Some(stop) = self.memorization_stop(o.step, before) {
            signal = Some(stop);
            unconfirmed = false;
        }
        Decision {
            smoothed: Some(smoothed),
            noise,
            threshold,
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

/// What [`replay`] hands on for each entry of a history that is not a failure.
pub enum Replayed<'a, 'b> {
    /// An evaluation, with the detector's decision on it and its state afterwards.
    Evaluation {
        record: &'a Evaluation,
        /// The checkpoint's key in the journal.
        key: &'a CheckpointKey,
        at: &'a str,
        decision: &'b Decision,
        state: &'b DetectorState,
    },
    /// A resume: the detector restarted on the resumed lineage; its state afterwards.
    Resume {
        step: i64,
        checkpoint: &'a str,
        at: &'a str,
        /// The segment it starts (2 for the first resume).
        segment: u32,
        state: &'b DetectorState,
    },
}

/// Replays a history (docs/design.md §9): feeds its evaluations, in journal order, to
/// `detector` (a fresh one, for the state the journal implies) watching `metric`, and hands each
/// to `each` with the detector's decision and its state afterwards. Failures are not observed;
/// returns how many there were. The daemon rebuilds its state at start-up this way, `diffmon
/// report` its plots, and `diffmon replay` prints what the detector decides.
///
/// A resume (`diffmon resume`) restarts the detector on the run's *lineage*: the evaluations
/// of the branch training went on from, up to the resume step, fed to a fresh detector (their
/// decisions are not handed on again); those after the step are the abandoned branch, which
/// the detector never sees again. The new segment's evaluations follow.
pub fn replay<'a>(
    detector: &mut Detector,
    metric: EarlyStopMetric,
    entries: &'a [Entry],
    mut each: impl FnMut(Replayed<'a, '_>),
) -> usize {
    let mut failures = 0;
    let mut lineage: Vec<&'a Evaluation> = Vec::new();
    for (segment, entry) in segments(entries) {
        match entry {
            Entry::Evaluation { key, record, at } => {
                let decision = detector.observe(&Observation::of(record, metric));
                lineage.push(record);
                each(Replayed::Evaluation {
                    record,
                    key,
                    at,
                    decision: &decision,
                    state: &detector.state,
                });
            }
            Entry::Failure { .. } => failures += 1,
            Entry::Resume {
                step,
                checkpoint,
                at,
                ..
            } => {
                lineage.retain(|r| r.step <= *step);
                // What `diffmon resume` resumed from, when it is the best the early stop named or
                // the best so far (the same replay picked it).
                let before = &detector.state;
                let resumed_best = [
                    before.fired.as_ref().filter(|_| !before.resolved),
                    before.best.as_ref(),
                ]
                .into_iter()
                .flatten()
                .find(|b| b.step == *step && b.checkpoint == *checkpoint)
                .cloned();
                *detector = Detector::new(detector.config.clone(), DetectorState::default());
                for r in &lineage {
                    detector.observe(&Observation::of(r, metric));
                }
                // One best for `resume` and the detector: the lineage alone, cut at the resume
                // step, lacks the later evaluations whose smoothing window named that best, and
                // may name an earlier checkpoint (deleted, and not the kept one). The restarted
                // detector goes on from the best training resumed from.
                if let Some(b) = resumed_best
                    && detector
                        .state
                        .best
                        .as_ref()
                        .is_none_or(|n| n.step != b.step)
                {
                    detector.state.best = Some(b);
                    detector.state.wait = 0;
                }
                each(Replayed::Resume {
                    step: *step,
                    checkpoint,
                    at,
                    segment,
                    state: &detector.state,
                });
            }
        }
    }
    failures
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(values: &[f64], config: EarlyStopSettings) -> (Detector, Vec<(i64, Decision)>) {
        run_with(values, &vec![None; values.len()], config)
    }

    fn run_with(
        values: &[f64],
        gaps: &[Option<f64>],
        config: EarlyStopSettings,
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
            stderr: None,
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
        let (d, decisions) = run(&values, EarlyStopSettings::default());
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
        let (d, _) = run(&values, EarlyStopSettings::default());
        let best = d.state.best.unwrap();
        assert_eq!((best.step, best.value), (200, 0.80));
        assert_eq!(best.checkpoint, "ckpt_200.pt");
        // Even window: the mean of the two middle values, named after the lower one.
        let config = EarlyStopSettings {
            window: 2,
            ..EarlyStopSettings::default()
        };
        let (d, _) = run(&[0.9, 0.7, 0.8, 0.95], config);
        let best = d.state.best.unwrap();
        assert_eq!(best.step, 100);
        assert!((best.value - 0.75).abs() < 1e-12);
    }

    /// Every checkpoint the detector ever names best was among its `contenders` at every
    /// observation from its own evaluation until it was named (so a pin held while it is one
    /// is there when the keeper needs it), for both smoothers and windows 1 to 7 over noisy
    /// U-curves with ties; and there are never more than half the window of them.
    #[test]
    fn every_checkpoint_named_best_was_a_contender_until_then() {
        for smoother in [Smoother::Median, Smoother::Ema] {
            for window in 1..=7 {
                for seed in 0..6 {
                    let config = EarlyStopSettings {
                        smoother,
                        window,
                        ..EarlyStopSettings::default()
                    };
                    let mut d = Detector::new(config, DetectorState::default());
                    // contenders after observation k, and the best it named.
                    let mut held: Vec<Vec<String>> = Vec::new();
                    for i in 0..40 {
                        let x = i as f64 - 15.0 - seed as f64;
                        // Rounded: ties between values.
                        let v = ((0.8 + 0.001 * x * x + 0.05 * noise(i + 100 * seed)) * 100.0)
                            .round()
                            / 100.0;
                        let before = d.state.best.clone();
                        d.observe(&observation(i, v, None));
                        let best = d.state.best.clone().unwrap();
                        if before.as_ref() != Some(&best) {
                            let evaluated = (best.step / 50 - 1) as usize;
                            for (k, c) in held.iter().enumerate().skip(evaluated) {
                                assert!(
                                    c.contains(&best.checkpoint),
                                    "{smoother:?} window {window} seed {seed}: {} named best at \
                                     observation {i}, not a contender after {k}: {c:?}",
                                    best.checkpoint
                                );
                            }
                        }
                        let c: Vec<String> = d.contenders().into_iter().map(String::from).collect();
                        assert!(c.len() <= window / 2, "{c:?}, window {window}");
                        held.push(c);
                    }
                }
            }
        }
    }

    #[test]
    fn noisy_decreasing_curve_never_fires() {
        let values: Vec<f64> = (0..40)
            .map(|i| 0.9 * (-(i as f64) / 15.0).exp() + 0.3 + 0.003 * noise(i))
            .collect();
        let (_, decisions) = run(&values, EarlyStopSettings::default());
        assert!(decisions.iter().all(|(_, d)| d.signal.is_none()));
    }

    #[test]
    fn flat_or_only_rising_curve_never_fires() {
        let rising: Vec<f64> = (0..30).map(|i| 0.5 + 0.01 * i as f64).collect();
        let (_, decisions) = run(&rising, EarlyStopSettings::default());
        assert!(decisions.iter().all(|(_, d)| d.signal.is_none()));
        let flat: Vec<f64> = (0..30).map(|i| 0.5 + 0.002 * noise(i)).collect();
        let (_, decisions) = run(&flat, EarlyStopSettings::default());
        assert!(decisions.iter().all(|(_, d)| d.signal.is_none()));
    }

    /// A U-curve (minimum at index 8) that turns, then a second descent below its best.
    fn double_descent() -> Vec<f64> {
        let mut values: Vec<f64> = (0..20)
            .map(|i| 0.8 + 0.003 * (i as f64 - 8.0).powi(2))
            .collect();
        values.extend((0..10).map(|i| 0.78 - 0.01 * i as f64));
        values
    }

    #[test]
    fn dip_below_the_old_best_sends_resolved_once() {
        let values = double_descent();
        let (_, decisions) = run(&values, EarlyStopSettings::default());
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
        let config = EarlyStopSettings {
            confirm: Confirmation::GeneralizationGap,
            ..EarlyStopSettings::default()
        };
        // A flat gap never confirms; the log says by how much it would have to rise.
        let (d, decisions) = run_with(&values, &vec![Some(0.01); 30], config.clone());
        assert!(decisions.iter().all(|(_, d)| d.signal.is_none()));
        assert!(decisions.iter().any(|(_, d)| d.unconfirmed));
        let (base, now, needed) = d.confirmation().unwrap();
        assert_eq!((base, now), (0.01, 0.01));
        assert!(needed >= 0.5 * 0.01, "{needed}");
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
        let (whole, decisions) = run(&values, EarlyStopSettings::default());
        let fired = fired_at(&decisions, Signal::EarlyStop);
        // Split the run at step 750 and carry the state over through JSON.
        let (first, _) = run(&values[..15], EarlyStopSettings::default());
        let json = serde_json::to_string(&first.state).unwrap();
        let mut d = Detector::new(
            EarlyStopSettings::default(),
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
        // serde_json reads some decimals back one unit in the last place off: the values kept
        // for the noise are compared to 1e-12, the rest exactly.
        let mut state = d.state.clone();
        assert_eq!(state.values.len(), whole.state.values.len());
        for (a, b) in state.values.iter().zip(&whole.state.values) {
            assert!((a - b).abs() < 1e-12, "{a} {b}");
        }
        state.values = whole.state.values.clone();
        assert_eq!(state, whole.state);
    }

    /// A replayed journal gives each evaluation the decision and state of feeding the records
    /// to a detector one by one, skips and counts the failures, and reads the configured metric.
    #[test]
    fn replay_feeds_the_evaluations_in_order_and_counts_failures() {
        use crate::store::history::CheckpointKey;
        let values: Vec<f64> = (0..30)
            .map(|i| 0.8 + 0.002 * (i as f64 - 10.0).powi(2))
            .collect();
        let (direct, decisions) = run(&values, EarlyStopSettings::default());
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
        let mut d = Detector::new(EarlyStopSettings::default(), DetectorState::default());
        let mut seen = Vec::new();
        let failures = replay(&mut d, EarlyStopMetric::Icr, &entries, |replayed| {
            let Replayed::Evaluation {
                record: r,
                at,
                decision,
                state,
                ..
            } = replayed
            else {
                panic!("no resume in this history")
            };
            assert_eq!(at, format!("at {}", r.step / 50 - 1));
            assert_eq!(state.last_step, Some(r.step));
            seen.push((r.step, decision.clone()));
        });
        assert_eq!(failures, 4);
        assert_eq!(seen, decisions);
        assert_eq!(d.state, direct.state);
        assert!(!fired_at(&seen, Signal::EarlyStop).is_empty());
    }

    /// A journal of `segments`: each a list of (step, value), every segment after the first
    /// opened by a resume from its `resume` step.
    fn segmented(segments: &[(i64, &[(i64, f64)])]) -> Vec<Entry> {
        let mut entries = Vec::new();
        for (k, &(resume, evaluations)) in segments.iter().enumerate() {
            if k > 0 {
                entries.push(Entry::Resume {
                    at: format!("resume {k}"),
                    step: resume,
                    checkpoint: format!("ckpt_{resume}.pt"),
                    restored: None,
                    set_aside: Vec::new(),
                });
            }
            for &(step, v) in evaluations {
                entries.push(Entry::Evaluation {
                    key: crate::store::history::CheckpointKey {
                        path: format!("ckpt_{step}.pt"),
                        size: k as u64,
                        mtime_ns: step,
                    },
                    at: format!("at {step}"),
                    record: Box::new(Evaluation {
                        step,
                        checkpoint: format!("ckpt_{step}.pt"),
                        icr: Some(v),
                        ..Evaluation::default()
                    }),
                });
            }
        }
        entries
    }

    /// What a replay hands on: ("eval", step, signal) and ("resume", step, fired) rows.
    fn replayed(entries: &[Entry], config: EarlyStopSettings) -> (Detector, Vec<String>) {
        let mut d = Detector::new(config, DetectorState::default());
        let mut seen = Vec::new();
        replay(&mut d, EarlyStopMetric::Icr, entries, |r| match r {
            Replayed::Evaluation {
                record, decision, ..
            } => seen.push(format!("{} {:?}", record.step, decision.signal)),
            Replayed::Resume {
                step,
                segment,
                state,
                ..
            } => seen.push(format!(
                "resume {step} segment {segment} best {:?} fired {}",
                state.best.as_ref().map(|b| b.step),
                state.fired.is_some()
            )),
        });
        (d, seen)
    }

    #[test]
    fn a_resume_restarts_the_detector_on_the_lineage_and_it_fires_again_only_when_it_turns() {
        // Window 1, warm-up 2, patience 2: a turn is two values above the best by min_rise.
        let config = EarlyStopSettings {
            window: 1,
            warmup: 2,
            patience: 2,
            min_rise: 0.01,
            noise_multiple: 0.0,
            ..EarlyStopSettings::default()
        };
        let first: &[(i64, f64)] = &[(1, 0.9), (2, 0.5), (3, 0.6), (4, 0.7), (5, 0.8)];
        // Resumed from step 2 (the best): 3 dips below it, 4 rises, 5 dips again (no turn yet),
        // then 6 and 7 rise: the turn, with the best at 5.
        let second: &[(i64, f64)] = &[(3, 0.45), (4, 0.6), (5, 0.44), (6, 0.5), (7, 0.55)];
        let entries = segmented(&[(0, first), (2, second)]);
        let (d, seen) = replayed(&entries, config.clone());
        assert_eq!(
            seen,
            [
                "1 None",
                "2 None",
                "3 None",
                "4 Some(EarlyStop)",
                "5 None",
                // The lineage is steps 1 and 2: best 2, not fired.
                "resume 2 segment 2 best Some(2) fired false",
                "3 None",
                "4 None",
                "5 None",
                "6 None",
                "7 Some(EarlyStop)",
            ]
        );
        let fired = d.state.fired.as_ref().unwrap();
        assert_eq!((fired.step, d.state.fired_step), (5, Some(7)));
        // The same as a detector fed the lineage and the new segment directly.
        let (direct, _) = run_series(&[first[0], first[1]], second, config.clone());
        assert_eq!(d.state, direct.state);

        // A second resume, from step 4 of the second segment: the lineage is 1, 2 and the
        // second segment's 3, 4 (the first segment's 3 to 5 were abandoned at the first resume).
        // Its 4 is already one above the best (3): the next rise is the second, the turn.
        let third: &[(i64, f64)] = &[(5, 0.7), (6, 0.8)];
        let entries = segmented(&[(0, first), (2, second), (4, third)]);
        let (d, seen) = replayed(&entries, config.clone());
        assert_eq!(seen[11], "resume 4 segment 3 best Some(3) fired false");
        assert_eq!(seen[12..], ["5 Some(EarlyStop)", "6 None"]);
        assert_eq!(d.state.fired.as_ref().unwrap().step, 3);
        let (direct, _) = run_series(&[first[0], first[1], second[0], second[1]], third, config);
        assert_eq!(d.state, direct.state);
    }

    /// A detector fed `lineage`, then `after`, as one series.
    fn run_series(
        lineage: &[(i64, f64)],
        after: &[(i64, f64)],
        config: EarlyStopSettings,
    ) -> (Detector, Vec<Decision>) {
        let mut d = Detector::new(config, DetectorState::default());
        let decisions = lineage
            .iter()
            .chain(after)
            .map(|&(step, v)| {
                d.observe(&Observation {
                    step,
                    checkpoint: format!("ckpt_{step}.pt"),
                    value: Some(v),
                    stderr: None,
                    generalization_gap: None,
                    loss_heldout: None,
                    memorization_ratio: None,
                })
            })
            .collect();
        (d, decisions)
    }

    /// Standard-normal draws from a seeded generator (Box–Muller).
    fn gaussian(rng: &mut rand::rngs::StdRng) -> f64 {
        use rand::Rng;
        let u: f64 = rng.r#gen::<f64>().max(f64::MIN_POSITIVE);
        let v: f64 = rng.r#gen();
        (-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()
    }

    fn seeded(seed: u64) -> rand::rngs::StdRng {
        use rand::SeedableRng;
        rand::rngs::StdRng::seed_from_u64(seed)
    }

    /// The share of `series` on which a detector with `config` fires.
    fn firing_rate(series: &[Vec<f64>], config: &EarlyStopSettings) -> f64 {
        let fired = series
            .iter()
            .filter(|values| {
                let (_, decisions) = run(values, config.clone());
                !fired_at(&decisions, Signal::EarlyStop).is_empty()
            })
            .count();
        fired as f64 / series.len() as f64
    }

    /// The documented false-alarm rate (docs/guide/early-stop.md, "The detector"; docs/design.md §9): on
    /// series of pure Gaussian noise, the default rule fires on fewer than 1.5% of 60-checkpoint
    /// runs and 2% of 120-checkpoint runs (measured on these 2000 seeded series each: 1.1% and
    /// 1.4%; the binomial standard error of such a rate is 0.25%). Without the noise rule
    /// (min_rise alone) the same series fire far more often.
    #[test]
    fn pure_noise_fires_at_most_the_documented_rate() {
        let mut rng = seeded(18);
        // ICR's level on the toy runs, with 1% noise (raw weights): twice min_rise.
        let series: Vec<Vec<f64>> = (0..2000)
            .map(|_| (0..120).map(|_| 0.8 + 0.008 * gaussian(&mut rng)).collect())
            .collect();
        let defaults = EarlyStopSettings::default();
        let short: Vec<Vec<f64>> = series.iter().map(|s| s[..60].to_vec()).collect();
        let rate_60 = firing_rate(&short, &defaults);
        let rate_120 = firing_rate(&series, &defaults);
        eprintln!("pure noise: {rate_60} of 60-checkpoint series, {rate_120} of 120 fire");
        assert!(rate_60 <= 0.015, "{rate_60}");
        assert!(rate_120 <= 0.02, "{rate_120}");
        let without = EarlyStopSettings {
            noise_multiple: 0.0,
            ..EarlyStopSettings::default()
        };
        let rate_without = firing_rate(&short, &without);
        assert!(rate_without > 0.3, "{rate_without}");
    }

    /// The scatter estimates the noise of a series with a trend: a U-curve (quadratic, whose
    /// second differences are constant) plus Gaussian noise of known σ.
    #[test]
    fn the_scatter_estimates_known_noise_under_a_trend() {
        for (seed, sigma) in [(1, 0.002), (2, 0.005), (3, 0.01)] {
            let mut rng = seeded(seed);
            let mut ratios = Vec::new();
            for _ in 0..200 {
                let values: Vec<f64> = (0..NOISE_SPAN)
                    .map(|i| 0.8 + 0.0004 * (i as f64 - 20.0).powi(2) + sigma * gaussian(&mut rng))
                    .collect();
                ratios.push(scatter(&values).unwrap() / sigma);
            }
            // The estimator is consistent: its median over many series is σ within 5%.
            let m = median_of(&ratios);
            assert!((m - 1.0).abs() < 0.05, "σ = {sigma}: median ratio {m}");
        }
        assert_eq!(scatter(&[0.8; MIN_NOISE_POINTS - 1]), None);
        // A straight line or a parabola has no noise.
        let line: Vec<f64> = (0..20).map(|i| 0.9 - 0.01 * i as f64).collect();
        assert!(scatter(&line).unwrap() < 1e-12);
    }

    /// The rise must exceed the noise: a U-curve whose rise after the minimum is twice the
    /// noise does not fire, one whose rise is twelve times the noise does, and the threshold is
    /// `noise_multiple` times the smoothed value's noise (`√(π/6)·σ` for a median of 3).
    #[test]
    fn a_turn_must_rise_above_the_noise() {
        let sigma = 0.005;
        let curve = |rise: f64, rng: &mut rand::rngs::StdRng| -> Vec<f64> {
            (0..40)
                .map(|i| {
                    let t = i as f64;
                    let trend = if t < 15.0 {
                        0.8 + 0.1 * (15.0 - t) / 15.0
                    } else {
                        0.8 + rise * ((t - 15.0) / 10.0).min(1.0)
                    };
                    trend + sigma * gaussian(rng)
                })
                .collect()
        };
        let mut rng = seeded(7);
        let mut small = 0;
        let mut large = 0;
        let mut ratios = Vec::new();
        for _ in 0..50 {
            let (d, decisions) = run(&curve(2.0 * sigma, &mut rng), EarlyStopSettings::default());
            small += usize::from(!fired_at(&decisions, Signal::EarlyStop).is_empty());
            let (_, last) = decisions.last().unwrap();
            let noise = last.noise.unwrap();
            let factor = (std::f64::consts::PI / 6.0).sqrt();
            ratios.push(noise / (factor * sigma));
            let best = d.state.best.unwrap().value;
            assert_eq!(last.threshold, Some((6.0 * noise).max(0.005 * best)));
            let (_, decisions) = run(&curve(12.0 * sigma, &mut rng), EarlyStopSettings::default());
            large += usize::from(!fired_at(&decisions, Signal::EarlyStop).is_empty());
        }
        // The noise it saw, over the 50 runs: σ within 15%.
        let ratio = median_of(&ratios);
        assert!((ratio - 1.0).abs() < 0.15, "{ratio}");
        assert!(small <= 2, "{small} of 50 shallow turns fired");
        assert!(large >= 48, "only {large} of 50 deep turns fired");
    }

    /// Until the scatter is known (8 values), ICR's jackknife error stands in; without it,
    /// nothing fires that early. Once the scatter is known it is the noise, however large the
    /// jackknife error (shared views make that error overstate the noise of a rise).
    #[test]
    fn the_jackknife_error_stands_in_until_the_scatter_is_known() {
        let values = [0.9, 0.8, 0.7, 0.7, 0.8, 0.9, 0.9];
        let observe = |stderr: Option<f64>, values: &[f64]| {
            let mut d = Detector::new(EarlyStopSettings::default(), DetectorState::default());
            let decisions: Vec<(i64, Decision)> = values
                .iter()
                .enumerate()
                .map(|(i, &v)| {
                    let mut o = observation(i, v, None);
                    o.stderr = stderr;
                    (o.step, d.observe(&o))
                })
                .collect();
            decisions
        };
        // No noise known after 7 values: no threshold, no firing.
        let none = observe(None, &values);
        assert!(
            none.iter()
                .all(|(_, d)| d.noise.is_none() && d.threshold.is_none())
        );
        assert!(fired_at(&none, Signal::EarlyStop).is_empty());
        // A small jackknife error: the rise of 0.2 clears 6 · √(π/6) · 0.001.
        let small = observe(Some(0.001), &values);
        assert_eq!(fired_at(&small, Signal::EarlyStop), vec![350]);
        let noise = small.last().unwrap().1.noise.unwrap();
        assert!((noise - (std::f64::consts::PI / 6.0).sqrt() * 0.001).abs() < 1e-15);
        // A large one holds it back.
        let large = observe(Some(0.05), &values);
        assert!(fired_at(&large, Signal::EarlyStop).is_empty());
        // With the scatter known (a clean curve: no scatter), the large error no longer counts.
        let longer = [0.95, 0.9, 0.85, 0.8, 0.75, 0.7, 0.7, 0.75, 0.8, 0.85, 0.9];
        let known = observe(Some(0.05), &longer);
        assert!(!fired_at(&known, Signal::EarlyStop).is_empty());
        // noise_multiple 0 is the rule without noise: min_rise alone, from the first values.
        let config = EarlyStopSettings {
            noise_multiple: 0.0,
            ..EarlyStopSettings::default()
        };
        let (_, decisions) = run(&values, config);
        assert_eq!(fired_at(&decisions, Signal::EarlyStop), vec![350]);
    }

    /// `smoother: ema`: the exponential moving average of span `window` (weight 2/(window+1)),
    /// computed here by its closed form `Σ α(1−α)^k x_{n−k} + (1−α)^n x_0`; the best names the
    /// checkpoint at the average's centre of mass, (window − 1)/2 back.
    #[test]
    fn the_exponential_smoother_follows_its_closed_form() {
        let values = [0.95, 0.9, 0.82, 0.8, 0.81, 0.85, 0.9, 0.95, 0.97];
        let config = EarlyStopSettings {
            smoother: Smoother::Ema,
            window: 5,
            ..EarlyStopSettings::default()
        };
        let (d, decisions) = run(&values, config);
        let alpha: f64 = 2.0 / 6.0;
        for (n, (_, decision)) in decisions.iter().enumerate() {
            let mut want = (1.0 - alpha).powi(n as i32) * values[0];
            for k in 0..n {
                want += alpha * (1.0 - alpha).powi(k as i32) * values[n - k];
            }
            assert!((decision.smoothed.unwrap() - want).abs() < 1e-12, "{n}");
        }
        let smoothed: Vec<f64> = decisions.iter().map(|(_, d)| d.smoothed.unwrap()).collect();
        let lowest = (0..smoothed.len())
            .min_by(|&a, &b| smoothed[a].total_cmp(&smoothed[b]))
            .unwrap();
        let best = d.state.best.unwrap();
        assert_eq!(best.value, smoothed[lowest]);
        // Two checkpoints before the one whose average was lowest.
        assert_eq!(best.step, 50 * (lowest as i64 - 2 + 1));
        assert_eq!(Smoother::Ema.noise_factor(4), 0.5);
        assert_eq!(Smoother::Median.noise_factor(1), 1.0);
    }

    /// The memorization ratio confirms a turn once it has risen since the best step by more
    /// than half its value there and half its floor (0.01), and it is taken at its last
    /// measurement: with `pfd.every: 3` most records have none.
    #[test]
    fn the_memorization_ratio_confirms_from_its_last_measurement() {
        let values: Vec<f64> = (0..30)
            .map(|i| 0.8 + 0.002 * (i as f64 - 10.0).powi(2))
            .collect();
        let config = EarlyStopSettings {
            confirm: Confirmation::MemorizationRatio,
            memorization_level: 0.0,
            ..EarlyStopSettings::default()
        };
        let decide =
            |ratio: &dyn Fn(usize) -> f64| run_memorizing(&values, ratio, 3, config.clone()).1;
        // No memorized sample ever: the turn stays unconfirmed.
        let flat = decide(&|_| 0.0);
        assert!(fired_at(&flat, Signal::EarlyStop).is_empty());
        assert!(flat.iter().any(|(_, d)| d.unconfirmed));
        // One sample in 128 from index 18 on: measured at index 18 (step 950), it confirms
        // there, and the turn (from step 700) fires at that step.
        let rising = decide(&|i| if i >= 18 { 1.0 / 128.0 } else { 0.0 });
        assert_eq!(fired_at(&rising, Signal::EarlyStop), vec![950]);
        // A ratio that was already 4% at the best must reach more than 6%.
        let high = decide(&|i| if i >= 21 { 0.065 } else { 0.04 });
        assert_eq!(fired_at(&high, Signal::EarlyStop), vec![1100]);
    }

    /// Runs `values` with the memorization ratio `ratio(i)` measured at every `every`-th
    /// evaluation.
    fn run_memorizing(
        values: &[f64],
        ratio: impl Fn(usize) -> f64,
        every: usize,
        config: EarlyStopSettings,
    ) -> (Detector, Vec<(i64, Decision)>) {
        let mut d = Detector::new(config, DetectorState::default());
        let decisions = values
            .iter()
            .enumerate()
            .map(|(i, &v)| {
                let mut o = observation(i, v, None);
                o.memorization_ratio = (i % every == 0).then(|| ratio(i));
                (o.step, d.observe(&o))
            })
            .collect();
        (d, decisions)
    }

    /// A curve that keeps falling never turns; the memorization ratio reaching the level stops
    /// it at the checkpoint that measured it, naming the best before that one, and the curve's
    /// later lows do not resolve it while the ratio stays there. With a window of 1 the best
    /// before step 50·(k+1) is step 50·k.
    #[test]
    fn the_memorization_ratio_at_its_level_stops_a_curve_that_never_turns() {
        let values: Vec<f64> = (0..30).map(|i| 0.9 - 0.005 * i as f64).collect();
        let config = EarlyStopSettings {
            window: 1,
            ..EarlyStopSettings::default()
        };
        let ratio = |i: usize| if i >= 12 { 0.02 * (i - 11) as f64 } else { 0.0 };
        // 0.02, 0.04, then 0.06 at index 14 (step 750).
        let (d, decisions) = run_memorizing(&values, ratio, 1, config.clone());
        assert_eq!(fired_at(&decisions, Signal::EarlyStop), vec![750]);
        assert!(fired_at(&decisions, Signal::Resolved).is_empty());
        let fired = d.state.fired.as_ref().unwrap();
        assert_eq!((fired.step, fired.value), (700, values[13]));
        assert_eq!(d.state.fired_by, Some(Trigger::Memorization));
        assert_eq!(d.state.fired_step, Some(750));
        // Measured on every third checkpoint only: first at index 15 (0.08, step 800), naming
        // step 750.
        let (d, decisions) = run_memorizing(&values, ratio, 3, config.clone());
        assert_eq!(fired_at(&decisions, Signal::EarlyStop), vec![800]);
        assert_eq!(d.state.fired.unwrap().step, 750);
        // Off (level 0), or a ratio that stays under the level: nothing fires.
        let off = EarlyStopSettings {
            memorization_level: 0.0,
            ..config.clone()
        };
        let (_, decisions) = run_memorizing(&values, ratio, 1, off);
        assert!(fired_at(&decisions, Signal::EarlyStop).is_empty());
        let (_, decisions) = run_memorizing(&values, |_| 0.049, 1, config);
        assert!(fired_at(&decisions, Signal::EarlyStop).is_empty());
    }

    /// Where the ratio stays under the level the rule is inert: on noisy U-curves, every
    /// decision is the same as with the rule off (so a study whose runs never reach the level
    /// decides as before it existed).
    #[test]
    fn a_ratio_under_the_level_changes_no_decision() {
        for seed in 0..20 {
            let values: Vec<f64> = (0..60)
                .map(|i| 0.8 + 0.0004 * (i as f64 - 25.0).powi(2) + 0.004 * noise(i + 97 * seed))
                .collect();
            let ratio = |i: usize| 0.049 * i as f64 / 60.0;
            for confirm in [Confirmation::None, Confirmation::MemorizationRatio] {
                let on = EarlyStopSettings {
                    confirm,
                    ..EarlyStopSettings::default()
                };
                let off = EarlyStopSettings {
                    memorization_level: 0.0,
                    ..on.clone()
                };
                let (a, da) = run_memorizing(&values, ratio, 1, on);
                let (b, db) = run_memorizing(&values, ratio, 1, off);
                assert_eq!(da, db, "seed {seed}");
                assert_eq!(a.state, b.state, "seed {seed}");
            }
        }
    }

    /// A stop the turn fired is resolved by a dip below its best only while the memorization
    /// ratio is under the level; the memorization rule never fires a second stop.
    #[test]
    fn a_dip_does_not_resolve_a_stop_while_the_model_memorizes() {
        let values = double_descent();
        let config = EarlyStopSettings::default();
        let (fired, _) = run(&values, config.clone());
        let at = fired.state.fired_step.unwrap();
        let (d, decisions) = run_memorizing(
            &values,
            |i| if 50 * (i as i64 + 1) > at { 0.3 } else { 0.0 },
            1,
            config,
        );
        assert_eq!(fired_at(&decisions, Signal::EarlyStop), vec![at]);
        assert_eq!(d.state.fired_by, Some(Trigger::Turn));
        assert!(fired_at(&decisions, Signal::Resolved).is_empty());
        assert!(!d.state.resolved);
    }
}
