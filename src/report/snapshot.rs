//! The [`Snapshot`]: everything the plots show, as plain data that the daemon keeps up to date
//! after every evaluation and that the report command rebuilds by replaying the history.

use crate::config::{EarlyStopMetric, EarlyStopSettings, Trigger};
use crate::engine::detector::{Decision, Detector, DetectorState, Replayed};
use crate::record::{Evaluation, FIELDS};
use crate::store::history::Entry;

/// One evaluation as the plots show it.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Row {
    pub step: i64,
    pub checkpoint: String,
    /// The early-stop metric (ICR or E_gen), raw.
    pub value: Option<f64>,
    /// The detector's smoothed value after this evaluation.
    pub smoothed: Option<f64>,
    /// The standard error of `value` where the record has one (ICR's jackknife, docs/design.md
    /// §2); drawn as a band value ± stderr.
    pub stderr: Option<f64>,
    /// The value of each field of `record::FIELDS`, in its order.
    pub fields: Vec<Option<f64>>,
    /// The history segment it was recorded in (1 until the first `diffmon resume`).
    pub segment: u32,
    /// On a branch a resume abandoned (a step after the resume point, recorded before it).
    pub abandoned: bool,
}

/// A checkpoint the detector singled out.
#[derive(Debug, Clone, PartialEq)]
pub struct Marker {
    pub step: i64,
    pub checkpoint: String,
    /// Its smoothed value.
    pub value: f64,
}

/// What `early_stop.keep_best` made of a checkpoint (docs/design.md §9).
#[derive(Debug, Clone, PartialEq)]
pub enum KeptCopy {
    /// Asked for, not done yet (a copy across file systems takes a while).
    Keeping,
    /// Kept at this path.
    At(String),
    /// Not kept (`keep_best` off, or keeping it failed): the original is the only copy.
    NotKept,
}

/// Everything the plots show: plain data, cheap to clone, safe to send between threads.
#[derive(Debug, Clone, PartialEq)]
pub struct Snapshot {
    pub run: String,
    pub metric: EarlyStopMetric,
    /// One row per evaluation, in evaluation order.
    pub rows: Vec<Row>,
    /// The smallest smoothed value so far.
    pub best: Option<Marker>,
    /// The best when the early stop fired, and the step it fired at (the turn).
    pub fired: Option<(Marker, i64)>,
    /// Why it fired (with `fired`).
    pub fired_by: Option<Trigger>,
    /// A later dip below the fired best resolved the early stop.
    pub resolved: bool,
    /// The curve has turned but the confirmation signal has not risen (nothing sent).
    pub unconfirmed: bool,
    /// Checkpoints that could not be evaluated.
    pub failures: usize,
    /// When the last evaluation was recorded (RFC 3339).
    pub last_at: Option<String>,
    /// With `early_stop.keep_best`: the checkpoint last asked to be kept, and what became of
    /// it; `None` without (see [`Snapshot::best_kept`]).
    pub kept: Option<(String, KeptCopy)>,
    /// The current segment of the history (1 until the first resume).
    pub segment: u32,
    /// Each resume: (the step training resumed from, the segment it started).
    pub resumes: Vec<(i64, u32)>,
    /// The early stops of the segments a resume ended (the current one's is `fired`), oldest
    /// first: after a resume, the report and the live page still show them.
    pub earlier_stops: Vec<EarlierStop>,
    /// The parameterization check's warning while it stands: the step it was made at, and the
    /// warning (`crate::engine::model::consistency`).
    pub parameterization: Option<(i64, String)>,
}

/// The early stop of a segment that a resume ended.
#[derive(Debug, Clone, PartialEq)]
pub struct EarlierStop {
    pub segment: u32,
    /// The best it named, and the step it fired at.
    pub best: Marker,
    pub at: i64,
    /// A later dip below that best resolved it before the resume.
    pub resolved: bool,
}

impl Snapshot {
    pub fn new(run: &str, metric: EarlyStopMetric) -> Snapshot {
        Snapshot {
            run: run.to_string(),
            metric,
            rows: Vec::new(),
            best: None,
            fired: None,
            fired_by: None,
            resolved: false,
            unconfirmed: false,
            failures: 0,
            last_at: None,
            kept: None,
            segment: 1,
            resumes: Vec::new(),
            earlier_stops: Vec::new(),
            parameterization: None,
        }
    }

    /// The best checkpoint the run names and keeps: the stop's while it stands, else the best
    /// so far (as [`DetectorState::named`]).
    pub fn named(&self) -> Option<&Marker> {
        let stands = self.fired.as_ref().filter(|_| !self.resolved);
        stands.map(|(b, _)| b).or(self.best.as_ref())
    }

    /// The kept copy of the best checkpoint the run names ([`Snapshot::named`]):
    /// [`KeptCopy::Keeping`] while the keeper has not answered for it yet, [`KeptCopy::NotKept`]
    /// without `keep_best`; `None` without a best.
    pub fn best_kept(&self) -> Option<KeptCopy> {
        let best = self.named()?;
        Some(match &self.kept {
            None => KeptCopy::NotKept,
            Some((checkpoint, copy)) if *checkpoint == best.checkpoint => copy.clone(),
            Some(_) => KeptCopy::Keeping,
        })
    }

    /// Adds one evaluation, with what the detector decided on it and its state afterwards.
    pub fn push(&mut self, r: &Evaluation, at: &str, decision: &Decision, state: &DetectorState) {
        let value = self.metric.value(r).filter(|v| v.is_finite());
        self.rows.push(Row {
            step: r.step,
            checkpoint: r.checkpoint.clone(),
            value,
            smoothed: value.and(decision.smoothed),
            stderr: value
                .and(metric_stderr(self.metric, r))
                .filter(|e| e.is_finite() && *e >= 0.0),
            fields: FIELDS.iter().map(|f| f.float(r)).collect(),
            segment: self.segment,
            abandoned: false,
        });
        self.follow(state);
        self.unconfirmed = decision.unconfirmed;
        self.last_at = Some(at.to_string());
    }

    /// A resume from `step` (recorded at `at`) starts `segment`: the rows after `step` on the
    /// branch it leaves are abandoned; `state` is the detector's, restarted on the lineage.
    pub fn resumed(&mut self, step: i64, segment: u32, at: &str, state: &DetectorState) {
        for row in self.rows.iter_mut().filter(|r| !r.abandoned) {
            row.abandoned = row.step > step;
        }
        if let Some((best, at)) = self.fired.take() {
            self.earlier_stops.push(EarlierStop {
                segment: self.segment,
                best,
                at,
                resolved: self.resolved,
            });
        }
        self.segment = segment;
        self.resumes.push((step, segment));
        self.follow(state);
        self.unconfirmed = state.unconfirmed;
        self.last_at = Some(at.to_string());
    }

    /// The rows of the run's current lineage (those no resume abandoned), in order.
    pub fn lineage(&self) -> impl Iterator<Item = &Row> {
        self.rows.iter().filter(|r| !r.abandoned)
    }

    /// Takes the best, the fired best and the resolution from the detector's state.
    fn follow(&mut self, state: &DetectorState) {
        let marker = |b: &crate::engine::detector::Best| Marker {
            step: b.step,
            checkpoint: b.checkpoint.clone(),
            value: b.value,
        };
        self.best = state.best.as_ref().map(marker);
        self.fired = state
            .fired
            .as_ref()
            .zip(state.fired_step)
            .map(|(b, step)| (marker(b), step));
        self.fired_by = state.fired_by;
        self.resolved = state.resolved;
    }

    /// The snapshot of a history: its evaluations replayed through a detector, as the daemon
    /// does at start-up.
    pub fn replay(
        run: &str,
        metric: EarlyStopMetric,
        detector: EarlyStopSettings,
        entries: &[Entry],
    ) -> Snapshot {
        let mut snapshot = Snapshot::new(run, metric);
        let mut detector = Detector::new(detector, DetectorState::default());
        snapshot.failures =
            crate::engine::detector::replay(&mut detector, metric, entries, |replayed| {
                match replayed {
                    Replayed::Evaluation {
                        record,
                        at,
                        decision,
                        state,
                        ..
                    } => snapshot.push(record, at, decision, state),
                    Replayed::Resume {
                        step,
                        segment,
                        at,
                        state,
                        ..
                    } => snapshot.resumed(step, segment, at, state),
                }
            });
        snapshot
    }
}

/// The standard error of the early-stop metric in a record: ICR has one (docs/design.md §2),
/// E_gen none.
fn metric_stderr(metric: EarlyStopMetric, r: &Evaluation) -> Option<f64> {
    match metric {
        EarlyStopMetric::Icr => r.icr_stderr,
        EarlyStopMetric::PfdGeneralization => None,
    }
}
