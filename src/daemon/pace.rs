//! A run's pace: the seconds an evaluation takes per checkpoint against the interval at which the
//! training job writes checkpoints (docs/design.md §16, "Pace"). The watcher tells it the
//! checkpoints it offers (their steps and modification times), the recorder thread each
//! evaluation; each publishes its gauge. When evaluation is found slower than the interval, one
//! WARN per run says so with the remedies; when it keeps up again, one INFO.
//!
//! - The interval is the median of the gaps between the modification times of successive
//!   checkpoints (by step), over the newest [`INTERVAL_GAPS`]` + 1` the watcher has offered or
//!   held ready at an offer. A median of mtimes, not of arrival times: a rescan or a restart finds
//!   many checkpoints at once, but their mtimes are when training wrote them; and checkpoints a
//!   rotation deleted before their turn make a few long gaps, which the median ignores.
//! - The seconds per checkpoint are the median of the `seconds` of this process's last
//!   [`RECENT`] evaluations without the PF-ODE probe, plus the median PF-ODE time of its last
//!   [`RECENT_PF_ODE`] evaluations with it over `pfd.every` (the probe runs on one checkpoint in
//!   `pfd.every`). Live evaluations only: a restart after a change of `icr.samples` must not be
//!   judged by the old cost.
//! - Behind: the seconds per checkpoint, over the evaluations at once (`evaluation.max_in_flight`
//!   on Slurm, else 1), exceed the interval; judged once there are an evaluation and two gaps.
//! - Said with hysteresis, since a run whose evaluation takes as long as its interval swings
//!   around it: the WARN only once the queue grows (no verdict that it keeps pace over the last
//!   [`HYSTERESIS_INTERVALS`] intervals, at least [`GROWING_QUEUE`] checkpoints waiting, more
//!   than at the start of that span), and the INFO that it keeps pace again only once the queue
//!   has stayed drained (at most [`DRAINED_QUEUE`] waiting) over as many intervals and the
//!   verdict is that it keeps pace. The checkpoints waiting are sampled at each offer and each
//!   evaluation, from the first (before any verdict: a queue may grow during the first
//!   evaluation).

use crate::config::{Backlog, Config, DeviceSpec};
use crate::metrics::{Metrics, STAGE_PFD};
use crate::record::Evaluation;
use crate::store::history::Entry;
use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex};

/// Gaps between successive checkpoints the interval is the median of.
pub const INTERVAL_GAPS: usize = 8;
/// Evaluations without the PF-ODE probe whose median is the plain cost of a checkpoint.
pub const RECENT: usize = 9;
/// Evaluations with the PF-ODE probe whose median is its cost.
pub const RECENT_PF_ODE: usize = 3;
/// Intervals over which the queue must grow before the warning, or stay drained before it clears.
pub const HYSTERESIS_INTERVALS: f64 = 3.0;
/// Checkpoints waiting, at least, for the queue to be said to grow.
pub const GROWING_QUEUE: i64 = 2;
/// Checkpoints waiting, at most, for the queue to be said drained (one may arrive while another
/// is evaluated, at any pace).
pub const DRAINED_QUEUE: i64 = 1;
/// Judgments kept, at most, whatever the span (a bound on memory).
const MAX_SAMPLES: usize = 4096;

/// The median of `xs` (the mean of the two middle values for an even count); `None` for none.
fn median(mut xs: Vec<f64>) -> Option<f64> {
    xs.retain(|x| x.is_finite());
    if xs.is_empty() {
        return None;
    }
    xs.sort_by(f64::total_cmp);
    let n = xs.len();
    Some(if n % 2 == 1 {
        xs[n / 2]
    } else {
        (xs[n / 2 - 1] + xs[n / 2]) / 2.0
    })
}

/// Seconds as the log shows them: 59.2, 0.050.
fn secs(s: f64) -> String {
    if s >= 1.0 {
        format!("{s:.1} s")
    } else {
        format!("{s:.3} s")
    }
}

/// The interval between checkpoints from their modification times (ns) by step: the median of
/// the positive gaps between successive steps' mtimes, and how many gaps it is the median of;
/// `None` below two. (A gap of 0 or less, checkpoints written at once or out of step order,
/// says nothing of the training's pace.)
pub fn interval(mtimes: &BTreeMap<i64, i64>) -> Option<(f64, usize)> {
    let times: Vec<i64> = mtimes.values().copied().collect();
    let gaps: Vec<f64> = times
        .windows(2)
        .map(|w| (w[1] - w[0]) as f64 / 1e9)
        .filter(|g| *g > 0.0)
        .collect();
    let n = gaps.len();
    if n < 2 {
        return None;
    }
    Some((median(gaps)?, n))
}

/// One evaluation's time, as far as the pace needs it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Timed {
    /// The record's `seconds`.
    pub seconds: f64,
    /// The PF-ODE probe ran (one checkpoint in `pfd.every`).
    pub pf_ode: bool,
    /// Its seconds, where known: a live evaluation's stage (the history keeps no stages).
    pub pf_ode_seconds: Option<f64>,
}

impl Timed {
    pub fn of(r: &Evaluation) -> Timed {
        let stage = r.stages.iter().find(|(s, _)| *s == STAGE_PFD).map(|s| s.1);
        let values = [
            r.pfd_generalization,
            r.pfd_memorization,
            r.memorization_ratio,
        ];
        Timed {
            seconds: r.seconds,
            pf_ode: stage.is_some() || values.iter().any(Option::is_some),
            pf_ode_seconds: stage,
        }
    }
}

/// The last evaluations' times: [`RECENT`] without the PF-ODE probe, [`RECENT_PF_ODE`] with it.
#[derive(Debug, Default, Clone)]
pub struct Recent {
    plain: VecDeque<Timed>,
    pf_ode: VecDeque<Timed>,
}

impl Recent {
    pub fn push(&mut self, t: Timed) {
        let (kept, bound) = if t.pf_ode {
            (&mut self.pf_ode, RECENT_PF_ODE)
        } else {
            (&mut self.plain, RECENT)
        };
        kept.push_back(t);
        if kept.len() > bound {
            kept.pop_front();
        }
    }

    /// How many evaluations the estimate is made of.
    pub fn len(&self) -> usize {
        self.plain.len() + self.pf_ode.len()
    }

    /// Seconds per checkpoint, with the PF-ODE probe run on one checkpoint in `every`: the
    /// median plain cost plus the probe's median cost over `every`. The plain cost of an
    /// evaluation with the probe is its seconds less the probe's, where known; with no plain
    /// cost known at all (one evaluation, from the history), the median of the seconds.
    pub fn seconds_per_checkpoint(&self, every: usize) -> Option<f64> {
        let every = every.max(1);
        let all = || {
            median(
                self.plain
                    .iter()
                    .chain(&self.pf_ode)
                    .map(|t| t.seconds)
                    .collect(),
            )
        };
        if every == 1 || self.pf_ode.is_empty() {
            return all();
        }
        let plain = self.plain.iter().map(|t| Some(t.seconds)).chain(
            self.pf_ode
                .iter()
                .map(|t| t.pf_ode_seconds.map(|p| t.seconds - p)),
        );
        let Some(plain) = median(plain.flatten().collect()) else {
            return all();
        };
        let probe = self.pf_ode.iter().map(|t| {
            t.pf_ode_seconds
                .unwrap_or_else(|| (t.seconds - plain).max(0.0))
        });
        Some(plain + median(probe.collect())? / every as f64)
    }
}

/// `pfd.every` where the PF-ODE probe runs (`pfd.enabled`, or the memorization ratio that
/// `early_stop.confirm: auto` implies), else 1.
pub fn pf_ode_every(config: &Config) -> usize {
    if config.pfd.enabled {
        config.pfd.every.max(1)
    } else {
        1
    }
}

/// Seconds per checkpoint measured by a run's history (a restarted run's, for `check-config`),
/// as the daemon measures its own: (seconds, evaluations it is made of). `None` without an
/// evaluation.
pub fn measured_in_history(entries: &[Entry], every: usize) -> Option<(f64, usize)> {
    let mut recent = Recent::default();
    for e in entries {
        if let Entry::Evaluation { record, .. } = e {
            recent.push(Timed::of(record));
        }
    }
    Some((recent.seconds_per_checkpoint(every)?, recent.len()))
}

/// Is evaluation slower than the training's checkpoints?
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    KeepsUp,
    Behind,
}

/// The verdict on `seconds` per checkpoint, `parallel` evaluations at once, against a checkpoint
/// every `interval` seconds.
pub fn verdict(seconds: f64, parallel: usize, interval: f64) -> Verdict {
    if seconds / parallel.max(1) as f64 > interval {
        Verdict::Behind
    } else {
        Verdict::KeepsUp
    }
}

/// What has been said of the pace so far.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Told {
    #[default]
    Nothing,
    /// It kept pace when first judged (INFO).
    KeepsUp,
    /// The warning (WARN).
    Behind,
    /// It kept up again after the warning (INFO).
    CaughtUp,
}

/// One judgment: when (seconds), the checkpoints waiting, and the verdict (`None` before both
/// estimates are known: the queue may grow during the first evaluation, before any verdict).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sample {
    pub at: f64,
    pub pending: i64,
    pub behind: Option<bool>,
}

/// The queue over the last span of [`HYSTERESIS_INTERVALS`] intervals.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Queue {
    /// No verdict that it keeps pace, at least [`GROWING_QUEUE`] waiting, and more than at the
    /// span's start.
    Growing,
    /// At most [`DRAINED_QUEUE`] waiting at every judgment.
    Drained,
    /// Neither, or the judgments do not cover the span yet.
    Unsettled,
}

/// The queue from `samples` (oldest first, the last one now), over the `span` seconds before the
/// last. The first sample is the one at or before the span's start, when there is one.
pub fn queue(samples: &VecDeque<Sample>, span: f64) -> Queue {
    let (Some(first), Some(last)) = (samples.front(), samples.back()) else {
        return Queue::Unsettled;
    };
    if first.at > last.at - span {
        return Queue::Unsettled;
    }
    if samples.iter().all(|s| s.behind != Some(false))
        && last.pending >= GROWING_QUEUE
        && last.pending > first.pending
    {
        Queue::Growing
    } else if samples.iter().all(|s| s.pending <= DRAINED_QUEUE) {
        Queue::Drained
    } else {
        Queue::Unsettled
    }
}

/// What a judgment makes the pace say, having said `told`: the new state, and the line to log
/// (the state it announces), if any. The first verdict that it keeps pace is said; the warning
/// only when the queue grows, and keeping pace again only when it has drained and the verdict
/// is that it keeps pace (a queue drained because the training stopped writing is not that).
pub fn tell(told: Told, verdict: Verdict, queue: Queue) -> (Told, Option<Told>) {
    let next = match (told, verdict, queue) {
        (Told::Behind, Verdict::KeepsUp, Queue::Drained) => Told::CaughtUp,
        (Told::Behind, _, _) => return (told, None),
        (_, _, Queue::Growing) => Told::Behind,
        (Told::Nothing, Verdict::KeepsUp, _) => Told::KeepsUp,
        _ => return (told, None),
    };
    (next, Some(next))
}

/// `n` of `what` with its plural: "1 evaluation", "2 evaluations".
fn count(n: impl Into<i64>, what: &str) -> String {
    match n.into() {
        1 => format!("1 {what}"),
        n => format!("{n} {what}s"),
    }
}

/// The checkpoints waiting, as a clause: "no checkpoint waits", "1 checkpoint waits", "3
/// checkpoints wait".
fn waiting(n: i64) -> String {
    match n {
        0 => "no checkpoint waits".into(),
        1 => "1 checkpoint waits".into(),
        n => format!("{n} checkpoints wait"),
    }
}

#[derive(Debug, Default)]
struct Inner {
    /// Modification times (ns) of the newest checkpoints offered, by step.
    mtimes: BTreeMap<i64, i64>,
    recent: Recent,
    told: Told,
    /// Whether the standing falls-behind warning said every waiting checkpoint is pinned.
    said_all_pinned: bool,
    /// The judgments of the last span (and the one before it).
    samples: VecDeque<Sample>,
}

/// A run's pace, shared by its watcher and its recorder thread.
pub struct Pace {
    metrics: Arc<Metrics>,
    every: usize,
    parallel: usize,
    /// The remedies, for the warning.
    remedies: String,
    /// The origin of the judgments' times.
    started: std::time::Instant,
    inner: Mutex<Inner>,
}

/// What the executor brings to the pace (`choice::capacity`, the one place that knows the
/// executor): how many evaluations run at once, and its remedy when evaluation falls behind.
pub struct Capacity {
    pub parallel: usize,
    pub remedy: String,
}

impl Pace {
    pub fn new(config: &Config, capacity: Capacity, metrics: Arc<Metrics>) -> Pace {
        Pace {
            metrics,
            every: pf_ode_every(config),
            parallel: capacity.parallel,
            remedies: remedies(config, capacity.remedy),
            started: std::time::Instant::now(),
            inner: Mutex::new(Inner::default()),
        }
    }

    /// Seconds since the pace was made.
    fn now(&self) -> f64 {
        self.started.elapsed().as_secs_f64()
    }

    /// The watcher offers a checkpoint: `checkpoints` are (step, mtime in ns) of those it offers
    /// and holds ready.
    pub fn offered(&self, checkpoints: impl IntoIterator<Item = (i64, i64)>) {
        self.offered_at(checkpoints, self.now());
    }

    /// [`Pace::offered`] at `now` (seconds on the pace's clock).
    pub fn offered_at(&self, checkpoints: impl IntoIterator<Item = (i64, i64)>, now: f64) {
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let before = interval(&inner.mtimes);
        inner.mtimes.extend(checkpoints);
        while inner.mtimes.len() > INTERVAL_GAPS + 1 {
            inner.mtimes.pop_first();
        }
        if let Some((seconds, _)) = interval(&inner.mtimes)
            && interval(&inner.mtimes) != before
        {
            self.metrics.set_checkpoint_interval(seconds);
        }
        self.judge(&mut inner, now);
    }

    /// An evaluation was recorded, live.
    pub fn evaluated(&self, record: &Evaluation) {
        self.evaluated_at(record, self.now());
    }

    /// [`Pace::evaluated`] at `now` (seconds on the pace's clock).
    pub fn evaluated_at(&self, record: &Evaluation, now: f64) {
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        inner.recent.push(Timed::of(record));
        if let Some(seconds) = inner.recent.seconds_per_checkpoint(self.every) {
            self.metrics.set_evaluation_seconds(seconds);
        }
        self.judge(&mut inner, now);
    }

    /// Judges the pace now, with the checkpoints waiting now, and says what changed; before both
    /// estimates are known, only keeps the checkpoints waiting.
    fn judge(&self, inner: &mut Inner, now: f64) {
        let pending = self.metrics.pending();
        let known = (
            inner.recent.seconds_per_checkpoint(self.every),
            interval(&inner.mtimes),
        );
        let verdict = match known {
            (Some(seconds), Some((interval, _))) => Some(verdict(seconds, self.parallel, interval)),
            _ => None,
        };
        inner.samples.push_back(Sample {
            at: now,
            pending,
            behind: verdict.map(|v| v == Verdict::Behind),
        });
        while inner.samples.len() > MAX_SAMPLES {
            inner.samples.pop_front();
        }
        let (Some(verdict), (Some(seconds), Some((interval, gaps)))) = (verdict, known) else {
            return;
        };
        let span = HYSTERESIS_INTERVALS * interval;
        while inner.samples.get(1).is_some_and(|s| s.at <= now - span) {
            inner.samples.pop_front();
        }
        let before = inner.samples.front().map_or(0, |s| s.pending);
        let (told, say) = tell(inner.told, verdict, queue(&inner.samples, span));
        inner.told = told;
        let (said_all_pinned, outgrown) = pins_claim(inner.said_all_pinned, told, say, pending);
        inner.said_all_pinned = said_all_pinned;
        let run = self.metrics.run();
        let at_once = match self.parallel {
            1 => String::new(),
            n => format!(" ({n} at once: {})", secs(seconds / n as f64)),
        };
        let (each, every, over) = (secs(seconds), secs(interval), secs(span));
        let n = count(inner.recent.len() as i64, "evaluation");
        let wait = waiting(pending);
        match say {
            Some(Told::KeepsUp) => tracing::info!(
                run = %run, seconds_per_checkpoint = seconds, checkpoint_interval = interval,
                "evaluation keeps pace: {each} per checkpoint{at_once} (median of {n}), a checkpoint every {every} (median of {gaps} gaps)"
            ),
            Some(Told::Behind) => {
                let pinned = self.metrics.pinned_bytes();
                tracing::warn!(
                    run = %run, seconds_per_checkpoint = seconds, checkpoint_interval = interval, pending, pinned_bytes = pinned,
                    "evaluation falls behind: {each} per checkpoint{at_once} (median of {n}), a checkpoint every {every} (median of {gaps} gaps); {wait} ({} more than {over} ago), {}. {}",
                    pending - before,
                    pins_note(pending, pinned),
                    self.remedies
                )
            }
            _ if outgrown => tracing::warn!(
                run = %run, pending,
                "evaluation is still behind and {wait} now: {}",
                pins_note(pending, self.metrics.pinned_bytes())
            ),
            Some(Told::CaughtUp) => tracing::info!(
                run = %run, seconds_per_checkpoint = seconds, checkpoint_interval = interval, pending,
                "evaluation keeps pace again: {each} per checkpoint{at_once}, a checkpoint every {every}; at most {} waited over the last {over}",
                count(DRAINED_QUEUE, "checkpoint")
            ),
            _ => {}
        }
    }
}

/// What the warning says of the `pending` waiting checkpoints' safety: pins protect at most
/// [`crate::store::pin::MAX_PINS`] of them (the others may be deleted by rotation before their
/// turn: said so, not claimed pinned), at the cost of the disk `pinned` bytes that only the pins
/// hold once rotation deleted the originals.
fn pins_note(pending: i64, pinned: u64) -> String {
    let max = crate::store::pin::MAX_PINS as i64;
    let which = if pending > max {
        format!(
            "only {max} of them are pinned against rotation, which may delete the other {} \
             before their turn (they are then recorded `rotated`)",
            pending - max
        )
    } else {
        "they are pinned against rotation (unless the state folder cannot hold links to the \
         run folder's files)"
            .to_string()
    };
    format!(
        "{which} (docs/guide/watching.md, \"Rotation\"); the pins alone hold {:.1} MB of \
         checkpoints rotation has deleted (diffmon_pinned_bytes)",
        pinned as f64 / 1e6
    )
}

/// Whether the falls-behind warning, once `told` and `say` are known, now claims that every one
/// of the `pending` checkpoints is pinned, and whether that claim `said` before has just stopped
/// holding (more wait than the pins protect, while the run is still behind): then said once more,
/// so that the warning that stands does not claim what is no longer so (issue 62).
fn pins_claim(said: bool, told: Told, say: Option<Told>, pending: i64) -> (bool, bool) {
    let fits = pending <= crate::store::pin::MAX_PINS as i64;
    match (told, say) {
        (Told::Behind, Some(Told::Behind)) => (fits, false),
        (Told::Behind, _) => (said && fits, said && !fits),
        _ => (false, false),
    }
}

/// What makes a checkpoint cheaper or evaluation faster, as the config stands, the executor's
/// `remedy` last: the warning's second half.
fn remedies(config: &Config, remedy: String) -> String {
    let mut r = Vec::new();
    if config.icr.enabled {
        r.push(format!("lower icr.samples (now {})", config.icr.samples));
    }
    if config.pfd.enabled {
        r.push(format!("raise pfd.every (now {})", config.pfd.every));
    }
    if config.checkpoints.backlog == Backlog::All {
        r.push("set checkpoints.backlog: latest (evaluate the newest, skip the rest)".into());
    }
    if !matches!(config.device, DeviceSpec::Cuda(_)) {
        r.push("evaluate on a GPU (device: cuda)".into());
    }
    r.push(remedy);
    let last = r.pop().expect("one remedy at least");
    let listed = if r.is_empty() {
        last
    } else {
        format!("{}, or {last}", r.join(", "))
    };
    format!(
        "Remedies (docs/guide/watching.md, \"When diffmon falls behind\"): {listed}; now {}",
        config.cost_summary()
    )
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    const S: i64 = 1_000_000_000;

    /// A minimal valid config (its files made, then removed).
    pub(in crate::daemon) fn config() -> Config {
        let dir = tempfile::tempdir().unwrap();
        for f in ["m.ts", "d.h5"] {
            std::fs::write(dir.path().join(f), b"").unwrap();
        }
        let text = format!(
            "run: {{dir: r}}\nmodel: {{architecture: {}}}\ndata: {{path: {}}}\n",
            dir.path().join("m.ts").display(),
            dir.path().join("d.h5").display()
        );
        let file = crate::config::ConfigFile::parse(&text, "t.yaml").unwrap();
        file.settings(false).unwrap()
    }

    /// The local executor's capacity for that config.
    pub(in crate::daemon) fn capacity() -> Capacity {
        crate::daemon::choice::capacity(&config())
    }

    fn mtimes(pairs: &[(i64, f64)]) -> BTreeMap<i64, i64> {
        pairs
            .iter()
            .map(|&(step, t)| (step, (t * S as f64) as i64))
            .collect()
    }

    fn plain(seconds: f64) -> Timed {
        Timed {
            seconds,
            pf_ode: false,
            pf_ode_seconds: None,
        }
    }

    /// The interval is the median of the positive gaps by step; rotation's long gaps and
    /// checkpoints written at once do not move it; below two gaps it is not known.
    #[test]
    fn the_interval_is_the_median_gap_between_successive_mtimes() {
        assert_eq!(interval(&mtimes(&[])), None);
        assert_eq!(interval(&mtimes(&[(10, 0.0), (20, 9.0)])), None);
        assert_eq!(
            interval(&mtimes(&[(10, 0.0), (20, 9.0), (30, 18.0)])),
            Some((9.0, 2))
        );
        // Seen three at a time, a rotation deleting the rest: gaps 9, 9, 41, 9, 9.
        let rotated = mtimes(&[
            (10, 0.0),
            (20, 9.0),
            (30, 18.0),
            (80, 59.0),
            (90, 68.0),
            (100, 77.0),
        ]);
        assert_eq!(interval(&rotated), Some((9.0, 5)));
        // Written at once (a copy), or out of step order: those gaps are left out.
        let copied = mtimes(&[(1, 5.0), (2, 5.0), (3, 5.0), (4, 7.0), (5, 6.0), (6, 8.0)]);
        assert_eq!(interval(&copied), Some((2.0, 2)));
        // An even count: the mean of the two middle gaps.
        let even = mtimes(&[(1, 0.0), (2, 1.0), (3, 3.0), (4, 6.0), (5, 10.0)]);
        assert_eq!(interval(&even), Some((2.5, 4)));
    }

    /// Seconds per checkpoint: the median; with `pfd.every`, the plain median plus the PF-ODE
    /// probe's median over `every`, from the stage where known, else from the plain cost.
    #[test]
    fn seconds_per_checkpoint_spread_the_pf_ode_over_pfd_every() {
        let mut r = Recent::default();
        assert_eq!(r.seconds_per_checkpoint(1), None);
        for s in [59.0, 61.0, 1000.0, 58.0, 60.0] {
            r.push(plain(s));
        }
        assert_eq!(r.seconds_per_checkpoint(1), Some(60.0));
        // Only the last RECENT plain evaluations count.
        for _ in 0..RECENT {
            r.push(plain(2.0));
        }
        assert_eq!(r.seconds_per_checkpoint(1), Some(2.0));
        assert_eq!(r.len(), RECENT);

        // Live: the first evaluation ran the probe, 100 s of its 102 s.
        let mut live = Recent::default();
        live.push(Timed {
            seconds: 102.0,
            pf_ode: true,
            pf_ode_seconds: Some(100.0),
        });
        assert_eq!(live.seconds_per_checkpoint(10), Some(12.0));
        assert_eq!(live.seconds_per_checkpoint(1), Some(102.0));
        // From a history (no stages): the probe's share from the plain ones.
        let mut history = Recent::default();
        for s in [102.0, 2.0, 2.0, 2.0] {
            history.push(Timed {
                seconds: s,
                pf_ode: s > 50.0,
                pf_ode_seconds: None,
            });
        }
        assert_eq!(history.seconds_per_checkpoint(10), Some(12.0));
        // One evaluation with the probe and nothing else known: its seconds.
        let mut one = Recent::default();
        one.push(Timed {
            seconds: 102.0,
            pf_ode: true,
            pf_ode_seconds: None,
        });
        assert_eq!(one.seconds_per_checkpoint(10), Some(102.0));
    }

    /// The issue's run: a checkpoint every 9 s, 59 s an evaluation. Behind; four Slurm jobs at
    /// once are not enough, seven are.
    #[test]
    fn evaluation_slower_than_the_interval_is_behind() {
        assert_eq!(verdict(59.0, 1, 9.0), Verdict::Behind);
        assert_eq!(verdict(5.0, 1, 9.0), Verdict::KeepsUp);
        assert_eq!(verdict(9.0, 1, 9.0), Verdict::KeepsUp);
        assert_eq!(verdict(59.0, 4, 9.0), Verdict::Behind);
        assert_eq!(verdict(59.0, 7, 9.0), Verdict::KeepsUp);
        assert_eq!(verdict(59.0, 0, 9.0), Verdict::Behind);
    }

    /// The first verdict that it keeps pace is said; the warning waits for a growing queue,
    /// keeping pace again for a drained one and a verdict that it keeps pace; nothing in
    /// between, however the verdicts swing.
    #[test]
    fn the_warning_waits_for_a_growing_queue_and_clears_on_a_drained_one() {
        use Queue::*;
        use Verdict::*;
        let said = |judgments: &[(Verdict, Queue)]| {
            let mut told = Told::Nothing;
            let mut lines = Vec::new();
            for &(v, q) in judgments {
                let (next, say) = tell(told, v, q);
                told = next;
                lines.extend(say);
            }
            lines
        };
        assert_eq!(said(&[]), []);
        assert_eq!(said(&[(KeepsUp, Unsettled); 3]), [Told::KeepsUp]);
        assert_eq!(said(&[(Behind, Unsettled); 5]), [], "no growing queue yet");
        assert_eq!(
            said(&[
                (KeepsUp, Unsettled),
                (Behind, Unsettled),
                (KeepsUp, Drained),
                (Behind, Growing),
                (KeepsUp, Unsettled),
                (Behind, Growing),
                (Behind, Drained),
                (KeepsUp, Drained),
                (KeepsUp, Drained),
                (Behind, Unsettled),
                (Behind, Growing),
            ]),
            [Told::KeepsUp, Told::Behind, Told::CaughtUp, Told::Behind]
        );
    }

    /// The queue over the span: growing only when every verdict was Behind and at least two
    /// wait, more than at the span's start; drained when at most one waited throughout;
    /// nothing before the judgments cover the span.
    #[test]
    fn the_queue_grows_or_drains_over_the_span() {
        let samples = |s: &[(f64, i64, Option<bool>)]| -> VecDeque<Sample> {
            s.iter()
                .map(|&(at, pending, behind)| Sample {
                    at,
                    pending,
                    behind,
                })
                .collect()
        };
        assert_eq!(queue(&samples(&[]), 10.0), Queue::Unsettled);
        let (b, k) = (Some(true), Some(false));
        let grew = samples(&[(0.0, 1, b), (5.0, 2, b), (10.0, 3, b)]);
        assert_eq!(queue(&grew, 10.0), Queue::Growing);
        assert_eq!(queue(&grew, 11.0), Queue::Unsettled, "the span not covered");
        let once_kept_up = samples(&[(0.0, 1, b), (5.0, 2, k), (10.0, 3, b)]);
        assert_eq!(queue(&once_kept_up, 10.0), Queue::Unsettled);
        let level = samples(&[(0.0, 3, b), (10.0, 3, b)]);
        assert_eq!(queue(&level, 10.0), Queue::Unsettled, "not growing");
        // Grown during the first evaluation, before any verdict.
        let first = samples(&[(0.0, 0, None), (10.0, 4, None), (10.0, 4, b)]);
        assert_eq!(queue(&first, 10.0), Queue::Growing);
        let one = samples(&[(0.0, 0, b), (10.0, 1, b)]);
        assert_eq!(
            queue(&one, 10.0),
            Queue::Drained,
            "one waiting is not a queue"
        );
        let drained = samples(&[(0.0, 1, k), (5.0, 0, b), (10.0, 1, k)]);
        assert_eq!(queue(&drained, 10.0), Queue::Drained);
    }

    /// Plurals.
    #[test]
    fn counts_are_said_with_their_plural() {
        assert_eq!(count(1, "evaluation"), "1 evaluation");
        assert_eq!(count(9, "evaluation"), "9 evaluations");
        assert_eq!(waiting(0), "no checkpoint waits");
        assert_eq!(waiting(1), "1 checkpoint waits");
        assert_eq!(waiting(12), "12 checkpoints wait");
    }

    /// A run simulated as the threads drive the pace: the training writes a checkpoint every
    /// `interval` seconds; the evaluator takes the oldest waiting one when idle (an offer) and
    /// spends `seconds(k)` on the k-th (an evaluation). Returns what the pace said, in order.
    fn simulate(interval: f64, n: usize, seconds: impl Fn(usize) -> f64) -> Vec<Told> {
        let metrics = Arc::new(Metrics::new("r"));
        let pace = Pace::new(&config(), capacity(), metrics.clone());
        // A hair past each multiple of the interval, which float division may put just below.
        let written = |t: f64| ((t / interval + 1e-9).floor() as usize).min(n);
        let mtime = |k: usize| ((k as f64 + 1.0) * interval * S as f64).round() as i64;
        let (mut now, mut taken, mut said) = (interval, 0usize, Vec::new());
        let record = |pace: &Pace, told: &mut Vec<Told>| {
            let t = lock(pace).told;
            if told.last().copied().unwrap_or_default() != t {
                told.push(t);
            }
        };
        while taken < n {
            if written(now) <= taken {
                now = (taken + 1) as f64 * interval; // idle until the next checkpoint
                continue;
            }
            let k = taken;
            taken += 1;
            metrics.set_pending(written(now) - taken);
            pace.offered_at((k..written(now)).map(|j| (j as i64, mtime(j))), now);
            record(&pace, &mut said);
            now += seconds(k);
            metrics.set_pending(written(now) - taken);
            let record_k = Evaluation {
                step: k as i64,
                seconds: seconds(k),
                ..Evaluation::default()
            };
            pace.evaluated_at(&record_k, now);
            record(&pace, &mut said);
        }
        said
    }

    /// The issue's run: a checkpoint every 4.8 s and 4.8 s an evaluation, give or take a tenth
    /// of a second. The verdicts swing on every checkpoint, at most one checkpoint ever waits:
    /// the pace says once that it keeps pace, and never warns.
    #[test]
    fn no_flapping_when_the_evaluation_takes_the_interval() {
        let jitter = |k: usize| [0.0, 0.1, -0.1, 0.05, -0.05, 0.1, -0.1][k % 7];
        let said = simulate(4.8, 300, |k| 4.8 + jitter(k));
        assert_eq!(said, [Told::KeepsUp], "{said:?}");
        // Exactly the interval, every time.
        assert_eq!(simulate(4.8, 300, |_| 4.8), [Told::KeepsUp]);
    }

    /// Evaluation at 1.5 intervals for 40 checkpoints, then at half an interval: one warning
    /// once the queue grows, one INFO once it has drained, nothing else.
    #[test]
    fn a_run_that_falls_behind_then_catches_up_is_told_once_each() {
        let said = simulate(4.8, 200, |k| if k < 40 { 7.2 } else { 2.4 });
        assert_eq!(said, [Told::Behind, Told::CaughtUp], "{said:?}");
    }

    /// The pace as the threads drive it: the gauges appear once known, and the verdict waits
    /// for two gaps and an evaluation.
    #[test]
    fn the_pace_publishes_its_gauges_and_judges_once_both_are_known() {
        let config = config();
        let metrics = Arc::new(Metrics::new("r"));
        let pace = Pace::new(&config, capacity(), metrics.clone());
        let text = || metrics.encode();
        pace.offered([(100, 0), (200, S / 5)]);
        assert!(!text().contains("diffmon_checkpoint_interval_seconds{"));
        pace.evaluated(&Evaluation {
            step: 100,
            seconds: 3.0,
            ..Evaluation::default()
        });
        assert!(text().contains("diffmon_evaluation_seconds{run=\"r\"} 3.0"));
        assert_eq!(lock(&pace).told, Told::Nothing, "one gap only");
        pace.offered([(200, S / 5), (300, 2 * S / 5), (400, 3 * S / 5)]);
        assert!(
            text().contains("diffmon_checkpoint_interval_seconds{run=\"r\"} 0.2"),
            "{}",
            text()
        );
        assert_eq!(
            lock(&pace).told,
            Told::Nothing,
            "behind, but no queue has grown"
        );
        assert!(pace.remedies.contains("icr.samples"), "{}", pace.remedies);
        // The warning says the waiting checkpoints are pinned, and what the pins hold.
        metrics.set_pinned_bytes(61_234_567);
        let note = pins_note(3, metrics.pinned_bytes());
        assert!(
            note.starts_with("they are pinned against rotation"),
            "{note}"
        );
        assert!(note.contains("61.2 MB"), "{note}");
        // Over the pins' bound, the warning does not claim what did not happen (issue 62: 5 of
        // 30 checkpoints were rotated away after it said they were pinned).
        let over = pins_note(21, 0);
        assert!(
            over.starts_with(
                "only 16 of them are pinned against rotation, which may delete the other 5"
            ),
            "{over}"
        );
        assert!(!note.contains("rotation may delete them before their turn"));
        assert!(pace.remedies.contains("network calls per checkpoint"));
    }

    /// The falls-behind warning's claim that the waiting checkpoints are pinned is withdrawn
    /// once, when more wait than the pins hold while the run is still behind.
    #[test]
    fn the_pinned_claim_is_withdrawn_once_when_the_queue_outgrows_the_pins() {
        let mut said = false;
        let mut told_again = Vec::new();
        let steps = [
            (Told::Behind, Some(Told::Behind), 5),
            (Told::Behind, None, 12),
            (Told::Behind, None, 17),
            (Told::Behind, None, 30),
            (Told::CaughtUp, Some(Told::CaughtUp), 0),
            (Told::Behind, Some(Told::Behind), 20),
            (Told::Behind, None, 40),
        ];
        for (told, say, pending) in steps {
            let (claim, again) = pins_claim(said, told, say, pending);
            said = claim;
            told_again.push(again);
        }
        assert_eq!(
            told_again,
            [false, false, true, false, false, false, false],
            "once at 17 waiting; never when the warning itself said only 16 are pinned"
        );
    }

    fn lock(p: &Pace) -> std::sync::MutexGuard<'_, Inner> {
        p.inner.lock().unwrap()
    }
}
