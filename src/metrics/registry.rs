//! A run's [`Metrics`]: its families, their registration (in the exposition's order) and the
//! series that exist, at zero, from the start: those of the executor in use only (the Slurm
//! executor's jobs with `evaluation.executor: slurm`).

use super::labels::{
    EarlyStopLabels, FCounter, FGauge, FieldLabels, OutcomeLabels, ReasonLabels, RunLabel,
    StageLabels, VersionLabels,
};
use super::names::*;
use crate::alerts::{DeliveryOutcome, Receiver};
use crate::config::{EarlyStopMetric, ExecutorKind};
use crate::record::{FIELDS, FailureReason};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use std::sync::Mutex;

/// The daemon's metrics; cheap to share (`Arc`) between the evaluation and HTTP threads.
pub struct Metrics {
    pub(super) run: String,
    pub registry: Registry,
    /// The gauge of each record field that has one, in [`FIELDS`]' order (fields that share a
    /// gauge share its family).
    pub(super) fields: Vec<Option<Family<FieldLabels, FGauge>>>,
    pub(super) icr_smoothed: Family<RunLabel, FGauge>,
    pub(super) last_evaluated_step: Family<RunLabel, Gauge>,
    pub(super) best_step: Family<RunLabel, Gauge>,
    pub(super) early_stop_triggered: Family<EarlyStopLabels, Gauge>,
    /// The detector's series, `early_stop.metric` (the `metric` label of the early-stop gauge).
    pub(super) early_stop_metric: String,
    pub(super) early_stop_unconfirmed: Family<RunLabel, Gauge>,
    pub(super) history_segment: Family<RunLabel, Gauge>,
    pub(super) checkpoints_evaluated: Family<RunLabel, Counter>,
    pub(super) checkpoint_failures: Family<ReasonLabels, Counter>,
    pub(super) checkpoints_pending: Family<RunLabel, Gauge>,
    pub(super) checkpoints_ignored: Family<RunLabel, Gauge>,
    pub(super) pinned_bytes: Family<RunLabel, Gauge>,
    pub(super) checkpoints_skipped: Family<RunLabel, Counter>,
    pub(super) evaluation_duration: Family<StageLabels, Histogram>,
    pub(super) evaluation_seconds: Family<RunLabel, FGauge>,
    pub(super) gpu_seconds: Family<RunLabel, FCounter>,
    pub(super) checkpoint_interval: Family<RunLabel, FGauge>,
    pub(super) webhook_deliveries: Family<OutcomeLabels, Counter>,
    pub(super) last_evaluation_timestamp: Family<RunLabel, FGauge>,
    pub(super) best_step_timestamp: Family<RunLabel, FGauge>,
    pub(super) early_stop_timestamp: Family<RunLabel, FGauge>,
    pub(super) slurm_jobs_submitted: Family<RunLabel, Counter>,
    pub(super) slurm_jobs_running: Family<RunLabel, Gauge>,
    pub(super) slurm_jobs_failed: Family<ReasonLabels, Counter>,
    pub(super) slurm_queue_wait: Family<RunLabel, Histogram>,
    pub(super) slurm_run: Family<RunLabel, Histogram>,
    /// The detector's state last published: (best step, fired), to time their changes.
    pub(super) seen: Mutex<(Option<i64>, bool)>,
}

/// Bucket bounds of the duration histogram, in seconds: from 1 ms (loading a small checkpoint
/// takes a few) to 10 minutes.
pub const DURATION_BUCKETS: [f64; 19] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
    120.0, 300.0, 600.0, 1200.0,
];

fn duration_histogram() -> Histogram {
    Histogram::new(DURATION_BUCKETS)
}

impl Metrics {
    /// The label `run` of these metrics.
    pub fn run(&self) -> &str {
        &self.run
    }

    /// A run's metrics on the local executor: no Slurm series, no Slurm failure reasons; its
    /// detector watching ICR.
    pub fn new(run: &str) -> Metrics {
        Metrics::of_run(run, ExecutorKind::Local, EarlyStopMetric::Icr)
    }

    /// A run's metrics on the Slurm executor (`evaluation.executor: slurm`): with the jobs'
    /// series (`diffmon_slurm_*`) and the Slurm failure reasons (`job_*`), at zero from the start.
    pub fn with_slurm(run: &str) -> Metrics {
        Metrics::of_run(run, ExecutorKind::Slurm, EarlyStopMetric::Icr)
    }

    /// A run's metrics: with the series of its `executor` (the Slurm jobs' with Slurm); `metric`
    /// is what its detector watches (`early_stop.metric`).
    pub fn of_run(run: &str, executor: ExecutorKind, metric: EarlyStopMetric) -> Metrics {
        let slurm = executor == ExecutorKind::Slurm;
        let mut registry = Registry::default();
        let m = Metrics {
            run: run.to_string(),
            fields: Vec::new(),
            icr_smoothed: Family::default(),
            last_evaluated_step: Family::default(),
            best_step: Family::default(),
            early_stop_triggered: Family::default(),
            early_stop_metric: metric.as_str().to_string(),
            early_stop_unconfirmed: Family::default(),
            checkpoints_evaluated: Family::default(),
            checkpoint_failures: Family::default(),
            checkpoints_pending: Family::default(),
            pinned_bytes: Family::default(),
            checkpoints_ignored: Family::default(),
            checkpoints_skipped: Family::default(),
            evaluation_duration: Family::new_with_constructor(duration_histogram),
            history_segment: Family::default(),
            evaluation_seconds: Family::default(),
            gpu_seconds: Family::default(),
            checkpoint_interval: Family::default(),
            webhook_deliveries: Family::default(),
            last_evaluation_timestamp: Family::default(),
            best_step_timestamp: Family::default(),
            early_stop_timestamp: Family::default(),
            slurm_jobs_submitted: Family::default(),
            slurm_jobs_running: Family::default(),
            slurm_jobs_failed: Family::default(),
            slurm_queue_wait: Family::new_with_constructor(duration_histogram),
            slurm_run: Family::new_with_constructor(duration_histogram),
            seen: Mutex::new((None, false)),
            registry: Registry::default(),
        };
        // One family per gauge, registered in the table's order; fields sharing a gauge share it.
        let mut registered: Vec<(&str, Family<FieldLabels, FGauge>)> = Vec::new();
        let mut fields = Vec::new();
        for g in FIELDS.iter().map(|f| f.gauge) {
            let Some(g) = g else {
                fields.push(None);
                continue;
            };
            if let Some((_, family)) = registered.iter().find(|(name, _)| *name == g.name) {
                fields.push(Some(family.clone()));
                continue;
            }
            let family = Family::default();
            registry.register(g.name, g.help, family.clone());
            if g.name == ICR {
                // The detector's smoothed value, beside the raw one in the exposition.
                registry.register(
                    ICR_SMOOTHED,
                    "ICR smoothed by the early-stop detector (running median)",
                    m.icr_smoothed.clone(),
                );
            }
            registered.push((g.name, family.clone()));
            fields.push(Some(family));
        }
        registry.register(
            LAST_EVALUATED_STEP,
            "Training step of the last evaluated checkpoint",
            m.last_evaluated_step.clone(),
        );
        registry.register(
            BEST_STEP,
            "Training step of the best checkpoint so far",
            m.best_step.clone(),
        );
        registry.register(
            EARLY_STOP_TRIGGERED,
            "1 once the early stop has fired (0 again after `resolved` or a resume); label `metric`: the series the detector watches (early_stop.metric)",
            m.early_stop_triggered.clone(),
        );
        registry.register(
            EARLY_STOP_UNCONFIRMED,
            "1 while the curve has turned but the confirmation signal has not risen",
            m.early_stop_unconfirmed.clone(),
        );
        registry.register(
            HISTORY_SEGMENT,
            "Segment of the history the detector follows: 1, then one more at each `diffmon resume` (absent before the first evaluation)",
            m.history_segment.clone(),
        );
        registry.register(
            CHECKPOINTS_EVALUATED,
            "Checkpoints evaluated",
            m.checkpoints_evaluated.clone(),
        );
        registry.register(
            CHECKPOINT_FAILURES,
            "Checkpoints that could not be evaluated, by reason",
            m.checkpoint_failures.clone(),
        );
        registry.register(
            CHECKPOINTS_PENDING,
            "Complete checkpoints waiting for evaluation",
            m.checkpoints_pending.clone(),
        );
        registry.register(
            CHECKPOINTS_IGNORED,
            "Entries of the run folder that look like checkpoints but are not evaluated (no match for checkpoints.pattern, no step, no weights file)",
            m.checkpoints_ignored.clone(),
        );
        registry.register(
            PINNED_BYTES,
            "Bytes that only diffmon's pins hold: files of pinned checkpoints (waiting, or the best and those the detector may still name best) that the training job's rotation has deleted",
            m.pinned_bytes.clone(),
        );
        registry.register(
            CHECKPOINTS_SKIPPED,
            "Checkpoints skipped by the `latest` backlog policy",
            m.checkpoints_skipped.clone(),
        );
        registry.register(
            EVALUATION_DURATION,
            "Evaluation time per stage",
            m.evaluation_duration.clone(),
        );
        registry.register(
            EVALUATION_SECONDS,
            "Seconds per checkpoint: the median of this process's last evaluations, the PF-ODE probe's time spread over pfd.every (absent before the first)",
            m.evaluation_seconds.clone(),
        );
        registry.register(
            GPU_SECONDS,
            "Seconds of the network's forward passes on the GPU, over the evaluations of this process (absent on the CPU)",
            m.gpu_seconds.clone(),
        );
        registry.register(
            CHECKPOINT_INTERVAL,
            "Seconds between checkpoints: the median gap between the modification times of the last checkpoints offered, by step (absent before two gaps)",
            m.checkpoint_interval.clone(),
        );
        registry.register(
            WEBHOOK_DELIVERIES,
            "Alert deliveries by receiver (webhook, alertmanager) and outcome",
            m.webhook_deliveries.clone(),
        );
        registry.register(
            LAST_EVALUATION_TIMESTAMP,
            "Unix time of the last checkpoint evaluated by this process (absent before the first)",
            m.last_evaluation_timestamp.clone(),
        );
        registry.register(
            BEST_STEP_TIMESTAMP,
            "Unix time of the evaluation that made the best step what it is (0 before any)",
            m.best_step_timestamp.clone(),
        );
        registry.register(
            EARLY_STOP_TIMESTAMP,
            "Unix time of the evaluation that fired the early stop last (0 if it never fired)",
            m.early_stop_timestamp.clone(),
        );
        if slurm {
            registry.register(
                SLURM_JOBS_SUBMITTED,
                "Slurm jobs submitted (retries included)",
                m.slurm_jobs_submitted.clone(),
            );
            registry.register(
                SLURM_JOBS_RUNNING,
                "Slurm jobs running now",
                m.slurm_jobs_running.clone(),
            );
            registry.register(
                SLURM_JOBS_FAILED,
                "Slurm jobs that ended without a result, by reason (each retry counts)",
                m.slurm_jobs_failed.clone(),
            );
            registry.register(
                SLURM_QUEUE_WAIT,
                "Time from a Slurm job's submission until it was seen running",
                m.slurm_queue_wait.clone(),
            );
            registry.register(
                SLURM_RUN,
                "Time a Slurm job was seen running until its result was read",
                m.slurm_run.clone(),
            );
        }
        let build: Family<VersionLabels, Gauge> = Family::default();
        build
            .get_or_create(&VersionLabels {
                run: run.to_string(),
                version: env!("CARGO_PKG_VERSION").to_string(),
            })
            .set(1);
        registry.register(BUILD_INFO, "diffmon's version", build);
        let m = Metrics { fields, ..m };
        // Series that exist from the start, so dashboards and alerts see zeros, not gaps.
        let l = m.label();
        m.checkpoints_evaluated.get_or_create(&l).inc_by(0);
        m.checkpoints_skipped.get_or_create(&l).inc_by(0);
        m.checkpoints_pending.get_or_create(&l).set(0);
        m.checkpoints_ignored.get_or_create(&l).set(0);
        m.pinned_bytes.get_or_create(&l).set(0);
        m.early_stop_triggered
            .get_or_create(&m.early_stop_labels())
            .set(0);
        m.early_stop_unconfirmed.get_or_create(&l).set(0);
        m.best_step_timestamp.get_or_create(&l).set(0.0);
        m.early_stop_timestamp.get_or_create(&l).set(0.0);
        for reason in FailureReason::ALL
            .into_iter()
            .filter(|r| slurm || !r.slurm_only())
        {
            m.checkpoint_failures
                .get_or_create(&m.reason_labels(reason))
                .inc_by(0);
        }
        if slurm {
            m.slurm_jobs_submitted.get_or_create(&l).inc_by(0);
            m.slurm_jobs_running.get_or_create(&l).set(0);
            let _ = m.slurm_queue_wait.get_or_create(&l);
            let _ = m.slurm_run.get_or_create(&l);
            for reason in SLURM_JOB_FAILURES {
                m.slurm_jobs_failed
                    .get_or_create(&ReasonLabels {
                        run: run.to_string(),
                        reason: reason.into(),
                    })
                    .inc_by(0);
            }
        }
        for stage in STAGES {
            let _ = m.evaluation_duration.get_or_create(&m.stage_labels(stage));
        }
        for receiver in Receiver::ALL {
            for outcome in DeliveryOutcome::ALL {
                m.webhook_deliveries
                    .get_or_create(&m.outcome_labels(receiver, outcome))
                    .inc_by(0);
            }
        }
        Metrics { registry, ..m }
    }

    pub(super) fn label(&self) -> RunLabel {
        RunLabel {
            run: self.run.clone(),
        }
    }

    pub(super) fn early_stop_labels(&self) -> EarlyStopLabels {
        EarlyStopLabels {
            run: self.run.clone(),
            metric: self.early_stop_metric.clone(),
        }
    }

    pub(super) fn reason_labels(&self, reason: FailureReason) -> ReasonLabels {
        ReasonLabels {
            run: self.run.clone(),
            reason: reason.as_str().into(),
        }
    }

    pub(super) fn stage_labels(&self, stage: &str) -> StageLabels {
        StageLabels {
            run: self.run.clone(),
            stage: stage.into(),
        }
    }

    pub(super) fn outcome_labels(
        &self,
        receiver: Receiver,
        outcome: DeliveryOutcome,
    ) -> OutcomeLabels {
        OutcomeLabels {
            run: self.run.clone(),
            receiver: receiver.as_str().into(),
            outcome: outcome.as_str().into(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::exposition::Format;
    use crate::metrics::process::ProcessStats;
    use crate::metrics::time::unix_now;
    use crate::record::Evaluation;

    /// Every name is exported: each with the run's label but the process' (once, without it);
    /// the Slurm executor's only with that executor.
    #[test]
    fn every_named_metric_is_exported_with_the_run_label() {
        let m = Metrics::with_slurm("exp1");
        m.record(&crate::record::full_record());
        m.evaluated(&Evaluation {
            seconds: 1.5,
            stages: vec![("icr", 1.0)],
            gpu_seconds: Some(0.75),
            ..Evaluation::default()
        });
        m.set_detector(
            Some(0.5),
            Some(100),
            false,
            false,
            "2023-11-14T22:13:20.123Z",
        );
        m.failure(FailureReason::Mismatch);
        m.delivery(Receiver::Webhook, DeliveryOutcome::Delivered);
        m.set_evaluation_seconds(59.2);
        m.set_checkpoint_interval(9.0);
        m.set_segment(1);
        let text = m.encode();
        for name in exported_names() {
            let series =
                if [EVALUATION_DURATION, SLURM_QUEUE_WAIT, SLURM_RUN].contains(&name.as_str()) {
                    format!("{name}_count{{")
                } else {
                    format!("{name}{{")
                };
            let process = PROCESS_METRICS.iter().any(|p| name.starts_with(p));
            if process {
                // `process_cpu_seconds_total 1.2`: no label set, one series.
                let lines: Vec<&str> = text
                    .lines()
                    .filter(|l| l.starts_with(&format!("{name} ")))
                    .collect();
                assert_eq!(lines.len(), 1, "{name} in\n{text}");
                assert!(!text.contains(&format!("{name}{{")), "{name} has labels");
                continue;
            }
            let line = text.lines().find(|l| l.starts_with(&series));
            let line = line.unwrap_or_else(|| panic!("{name} missing in\n{text}"));
            assert!(line.contains("run=\"exp1\""), "{line}");
        }
        // On the local executor: no Slurm series, no Slurm failure reason.
        let local = Metrics::new("exp1").encode();
        for name in SLURM_METRICS {
            assert!(!local.contains(name), "{name} in\n{local}");
        }
        assert!(!local.contains("reason=\"job_"), "{local}");
        assert!(
            text.contains("diffmon_denoise_loss{run=\"exp1\",split=\"heldout\"} 0.1234\n"),
            "{text}"
        );
        assert!(
            text.contains("diffmon_last_evaluated_step{run=\"exp1\"} 100"),
            "{text}"
        );
    }

    /// HELP texts go out unescaped: none may hold a backslash or a newline; prometheus-client
    /// adds the final full stop.
    #[test]
    fn help_texts_need_no_escaping() {
        let text = Metrics::new("r").encode();
        for l in text.lines().filter(|l| l.starts_with("# HELP ")) {
            assert!(!l.contains('\\'), "{l}");
            assert!(l.ends_with('.') && !l.ends_with(".."), "{l}");
        }
    }

    /// Issue 15: every known label value's series exists at zero from the start; so do the
    /// process metrics and the timestamps but the last evaluation's, absent until the first.
    /// Issue 34: the Slurm reasons only with the Slurm executor.
    #[test]
    fn known_series_exist_at_zero_from_the_start() {
        let m = Metrics::new("exp1");
        let text = m.encode_as(Format::Text);
        for reason in FailureReason::ALL {
            let s = format!("{CHECKPOINT_FAILURES}_total{{run=\"exp1\",reason=\"{reason}\"}} 0\n");
            assert_eq!(text.contains(&s), !reason.slurm_only(), "{s} in\n{text}");
        }
        let slurm = Metrics::with_slurm("exp1").encode_as(Format::Text);
        for reason in FailureReason::ALL {
            let s = format!("{CHECKPOINT_FAILURES}_total{{run=\"exp1\",reason=\"{reason}\"}} 0\n");
            assert!(slurm.contains(&s), "{s} missing in\n{slurm}");
        }
        for stage in STAGES {
            let s = format!("{EVALUATION_DURATION}_count{{run=\"exp1\",stage=\"{stage}\"}} 0\n");
            assert!(text.contains(&s), "{s} missing in\n{text}");
        }
        for receiver in Receiver::ALL {
            for outcome in DeliveryOutcome::ALL {
                let s = format!(
                    "{WEBHOOK_DELIVERIES}_total{{run=\"exp1\",receiver=\"{receiver}\",outcome=\"{outcome}\"}} 0\n"
                );
                assert!(text.contains(&s), "{s} missing in\n{text}");
            }
        }
        for name in [BEST_STEP_TIMESTAMP, EARLY_STOP_TIMESTAMP] {
            assert!(
                text.contains(&format!("{name}{{run=\"exp1\"}} 0.0\n")),
                "{name}: {text}"
            );
        }
        assert!(!text.contains(LAST_EVALUATION_TIMESTAMP), "{text}");
        m.evaluated(&Evaluation::default());
        let text = m.encode_as(Format::Text);
        let evaluated = text
            .lines()
            .find_map(|l| l.strip_prefix(&format!("{LAST_EVALUATION_TIMESTAMP}{{run=\"exp1\"}} ")))
            .unwrap()
            .parse::<f64>()
            .unwrap();
        assert!((evaluated - unix_now()).abs() < 3600.0, "{evaluated}");
        let p = ProcessStats::read();
        assert!(
            p.cpu_seconds.is_some() && p.resident_bytes.unwrap() > 0.0,
            "{p:?}"
        );
        assert!(p.open_fds.unwrap() >= 3.0 && p.max_fds.unwrap() >= p.open_fds.unwrap());
        let start = p.start_time_seconds.unwrap();
        assert!(start <= unix_now() + 1.0 && start > unix_now() - 86400.0 * 365.0);
        assert_eq!(DURATION_BUCKETS[0], 0.001);
    }
}
