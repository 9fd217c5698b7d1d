//! The label sets of the metrics' families: `run` on every one, then the family's own.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::gauge::Gauge;
use std::sync::atomic::AtomicU64;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RunLabel {
    pub run: String,
}

/// `diffmon_early_stop_triggered`'s: the run and the series its detector watches
/// (`early_stop.metric`), the labels of the alert the daemon posts, so that the alert rule on it
/// raises the same alert.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct EarlyStopLabels {
    pub run: String,
    pub metric: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabels {
    pub run: String,
    pub reason: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StageLabels {
    pub run: String,
    pub stage: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabels {
    pub run: String,
    pub receiver: String,
    pub outcome: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct VersionLabels {
    pub run: String,
    pub version: String,
}

pub(super) type FGauge = Gauge<f64, AtomicU64>;
/// A counter of seconds.
pub(super) type FCounter = prometheus_client::metrics::counter::Counter<f64, AtomicU64>;

/// The labels of a record field's gauge: `run`, then the field's own (`split`).
pub(super) type FieldLabels = Vec<(&'static str, String)>;
