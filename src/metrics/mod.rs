//! Prometheus metrics (docs/design.md §16), through the official `prometheus-client` crate. Every
//! metric carries the label `run` but the process' (`process_*`, the daemon's: once per
//! exposition) and a sweep's own; the Slurm executor's only exist with that executor. Metric names are the constants below (without the `_total`
//! suffix the text format adds to counters; the gauges of the record's fields, which the table
//! `record::FIELDS` registers and sets, are re-exported from `record::gauge_names`); dashboards
//! and tests refer to these. So are the known values of every other label ([`STAGES`],
//! [`FailureReason::ALL`](crate::record::FailureReason::ALL),
//! [`Receiver::ALL`](crate::alerts::Receiver::ALL) and
//! [`DeliveryOutcome::ALL`](crate::alerts::DeliveryOutcome::ALL)): each of their series exists,
//! at zero, from the start.
//!
//! `/metrics` speaks both exposition formats, chosen from the `Accept` header like Prometheus'
//! own client libraries do ([`Format::negotiate`]): OpenMetrics 1.0 (what `prometheus-client`
//! writes) when asked for `application/openmetrics-text`, else the text format 0.0.4
//! ([`openmetrics_to_text`]).
//!
//! Files, by family: `names.rs` the metric names, the known label values and
//! [`exported_names`]; `labels.rs` the families' label sets; `registry.rs` a run's [`Metrics`]
//! (its families, their registration, the series at zero from the start); `evaluation.rs` what
//! each evaluation publishes (the record's gauges, durations, the seconds per checkpoint, the
//! detector's state and its timestamps); `checkpoints.rs` the counts of checkpoints (failures,
//! pending, ignored, skipped) and their interval; `jobs.rs` a jobs executor's jobs (Slurm's); `delivery.rs` alert deliveries;
//! `process.rs` the `process_*` metrics; `sweep.rs` a sweep's own [`SweepMetrics`];
//! `exposition.rs` the two formats and the encoding of a run, of several runs and of a sweep;
//! `time.rs` the clock and the RFC 3339 parser.

mod checkpoints;
mod delivery;
mod evaluation;
mod exposition;
mod jobs;
mod labels;
mod names;
mod process;
mod registry;
mod sweep;
mod time;

pub use exposition::{Format, openmetrics_to_text};
pub use labels::{OutcomeLabels, ReasonLabels, RunLabel, StageLabels, VersionLabels};
pub use names::*;
pub use process::ProcessStats;
pub use registry::{DURATION_BUCKETS, Metrics};
pub use sweep::SweepMetrics;
pub use time::parse_rfc3339_utc;
