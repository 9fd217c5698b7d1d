//! Prometheus metrics (DESIGN.md §2.6), through the official `prometheus-client` crate. Every
//! metric carries the label `run`. Metric names are the constants below (without the `_total`
//! suffix the text format adds to counters); dashboards and tests refer to these.

use crate::record::Evaluation;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use std::sync::atomic::AtomicU64;

pub const ICR: &str = "diffmon_icr";
pub const ICR_SMOOTHED: &str = "diffmon_icr_smoothed";
pub const ICR_INVARIANT_TRACE: &str = "diffmon_icr_invariant_trace";
pub const ICR_RESIDUAL_TRACE: &str = "diffmon_icr_residual_trace";
pub const PFD_GENERALIZATION: &str = "diffmon_pfd_generalization";
pub const PFD_MEMORIZATION: &str = "diffmon_pfd_memorization";
pub const MEMORIZATION_RATIO: &str = "diffmon_memorization_ratio";
pub const TAIL_RMSQE: &str = "diffmon_tail_rmsqe";
pub const TAIL_LOADER: &str = "diffmon_tail_loader";
pub const DENOISE_LOSS: &str = "diffmon_denoise_loss";
pub const GENERALIZATION_GAP: &str = "diffmon_generalization_gap";
pub const LAST_EVALUATED_STEP: &str = "diffmon_last_evaluated_step";
pub const BEST_STEP: &str = "diffmon_best_step";
pub const EARLY_STOP_TRIGGERED: &str = "diffmon_early_stop_triggered";
pub const EARLY_STOP_UNCONFIRMED: &str = "diffmon_early_stop_unconfirmed";
pub const CHECKPOINTS_EVALUATED: &str = "diffmon_checkpoints_evaluated";
pub const CHECKPOINT_FAILURES: &str = "diffmon_checkpoint_failures";
pub const CHECKPOINTS_PENDING: &str = "diffmon_checkpoints_pending";
pub const CHECKPOINTS_SKIPPED: &str = "diffmon_checkpoints_skipped";
pub const EVALUATION_DURATION: &str = "diffmon_evaluation_duration_seconds";
pub const WEBHOOK_DELIVERIES: &str = "diffmon_webhook_deliveries";
pub const BUILD_INFO: &str = "diffmon_build_info";

/// Every exported name as it appears in the text format (counters get `_total`).
pub fn exported_names() -> Vec<String> {
    let counters = [
        CHECKPOINTS_EVALUATED,
        CHECKPOINT_FAILURES,
        CHECKPOINTS_SKIPPED,
        WEBHOOK_DELIVERIES,
    ];
    let mut names: Vec<String> = [
        ICR,
        ICR_SMOOTHED,
        ICR_INVARIANT_TRACE,
        ICR_RESIDUAL_TRACE,
        PFD_GENERALIZATION,
        PFD_MEMORIZATION,
        MEMORIZATION_RATIO,
        TAIL_RMSQE,
        TAIL_LOADER,
        DENOISE_LOSS,
        GENERALIZATION_GAP,
        LAST_EVALUATED_STEP,
        BEST_STEP,
        EARLY_STOP_TRIGGERED,
        EARLY_STOP_UNCONFIRMED,
        CHECKPOINTS_PENDING,
        EVALUATION_DURATION,
        BUILD_INFO,
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    names.extend(counters.iter().map(|c| format!("{c}_total")));
    names
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RunLabel {
    pub run: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SplitLabels {
    pub run: String,
    pub split: String,
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
    pub outcome: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct VersionLabels {
    pub run: String,
    pub version: String,
}

type FGauge = Gauge<f64, AtomicU64>;

/// The daemon's metrics; cheap to share (`Arc`) between the evaluation and HTTP threads.
pub struct Metrics {
    run: String,
    pub registry: Registry,
    icr: Family<RunLabel, FGauge>,
    icr_smoothed: Family<RunLabel, FGauge>,
    icr_invariant_trace: Family<RunLabel, FGauge>,
    icr_residual_trace: Family<RunLabel, FGauge>,
    pfd_generalization: Family<RunLabel, FGauge>,
    pfd_memorization: Family<RunLabel, FGauge>,
    memorization_ratio: Family<RunLabel, FGauge>,
    tail_rmsqe: Family<RunLabel, FGauge>,
    tail_loader: Family<RunLabel, FGauge>,
    denoise_loss: Family<SplitLabels, FGauge>,
    generalization_gap: Family<RunLabel, FGauge>,
    last_evaluated_step: Family<RunLabel, Gauge>,
    best_step: Family<RunLabel, Gauge>,
    early_stop_triggered: Family<RunLabel, Gauge>,
    early_stop_unconfirmed: Family<RunLabel, Gauge>,
    checkpoints_evaluated: Family<RunLabel, Counter>,
    checkpoint_failures: Family<ReasonLabels, Counter>,
    checkpoints_pending: Family<RunLabel, Gauge>,
    checkpoints_skipped: Family<RunLabel, Counter>,
    evaluation_duration: Family<StageLabels, Histogram>,
    webhook_deliveries: Family<OutcomeLabels, Counter>,
}

fn duration_histogram() -> Histogram {
    Histogram::new([
        0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
    ])
}

impl Metrics {
    pub fn new(run: &str) -> Metrics {
        let mut registry = Registry::default();
        let m = Metrics {
            run: run.to_string(),
            icr: Family::default(),
            icr_smoothed: Family::default(),
            icr_invariant_trace: Family::default(),
            icr_residual_trace: Family::default(),
            pfd_generalization: Family::default(),
            pfd_memorization: Family::default(),
            memorization_ratio: Family::default(),
            tail_rmsqe: Family::default(),
            tail_loader: Family::default(),
            denoise_loss: Family::default(),
            generalization_gap: Family::default(),
            last_evaluated_step: Family::default(),
            best_step: Family::default(),
            early_stop_triggered: Family::default(),
            early_stop_unconfirmed: Family::default(),
            checkpoints_evaluated: Family::default(),
            checkpoint_failures: Family::default(),
            checkpoints_pending: Family::default(),
            checkpoints_skipped: Family::default(),
            evaluation_duration: Family::new_with_constructor(duration_histogram),
            webhook_deliveries: Family::default(),
            registry: Registry::default(),
        };
        registry.register(
            ICR,
            "Invariant Contamination Ratio of the last checkpoint",
            m.icr.clone(),
        );
        registry.register(
            ICR_SMOOTHED,
            "ICR smoothed by the early-stop detector (running median)",
            m.icr_smoothed.clone(),
        );
        registry.register(
            ICR_INVARIANT_TRACE,
            "Tr(Sigma_s): invariant (signal) energy of the features",
            m.icr_invariant_trace.clone(),
        );
        registry.register(
            ICR_RESIDUAL_TRACE,
            "Tr(Sigma_xi): residual (view-dependent) energy of the features",
            m.icr_residual_trace.clone(),
        );
        registry.register(
            PFD_GENERALIZATION,
            "E_gen: probability flow distance to the teacher",
            m.pfd_generalization.clone(),
        );
        registry.register(
            PFD_MEMORIZATION,
            "E_mem: probability flow distance to the empirical flow",
            m.pfd_memorization.clone(),
        );
        registry.register(
            MEMORIZATION_RATIO,
            "Fraction of generated samples that copy a training image",
            m.memorization_ratio.clone(),
        );
        registry.register(
            TAIL_RMSQE,
            "Root-mean-square quantile error of the tail",
            m.tail_rmsqe.clone(),
        );
        registry.register(
            TAIL_LOADER,
            "LOADER: integrated absolute log-density difference",
            m.tail_loader.clone(),
        );
        registry.register(
            DENOISE_LOSS,
            "EDM-weighted denoising loss at the ICR noise level",
            m.denoise_loss.clone(),
        );
        registry.register(
            GENERALIZATION_GAP,
            "Held-out minus training denoising loss",
            m.generalization_gap.clone(),
        );
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
            "1 once the early stop has fired",
            m.early_stop_triggered.clone(),
        );
        registry.register(
            EARLY_STOP_UNCONFIRMED,
            "1 while the curve has turned but the confirmation signal has not risen",
            m.early_stop_unconfirmed.clone(),
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
            WEBHOOK_DELIVERIES,
            "Alert deliveries by outcome",
            m.webhook_deliveries.clone(),
        );
        let build: Family<VersionLabels, Gauge> = Family::default();
        build
            .get_or_create(&VersionLabels {
                run: run.to_string(),
                version: env!("CARGO_PKG_VERSION").to_string(),
            })
            .set(1);
        registry.register(BUILD_INFO, "diffmon's version", build);
        // Series that exist from the start, so dashboards and alerts see zeros, not gaps.
        let l = m.label();
        m.checkpoints_evaluated.get_or_create(&l).inc_by(0);
        m.checkpoints_skipped.get_or_create(&l).inc_by(0);
        m.checkpoints_pending.get_or_create(&l).set(0);
        m.early_stop_triggered.get_or_create(&l).set(0);
        m.early_stop_unconfirmed.get_or_create(&l).set(0);
        Metrics { registry, ..m }
    }

    fn label(&self) -> RunLabel {
        RunLabel {
            run: self.run.clone(),
        }
    }

    /// The text exposition format.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry)
            .expect("writing to a String");
        out
    }

    /// Publishes one evaluation's values (gauges only: a restart republishes the last one).
    pub fn record(&self, e: &Evaluation) {
        let l = self.label();
        let set = |f: &Family<RunLabel, FGauge>, v: Option<f64>| {
            if let Some(v) = v {
                f.get_or_create(&l).set(v);
            }
        };
        set(&self.icr, e.icr);
        set(&self.icr_invariant_trace, e.icr_invariant_trace);
        set(&self.icr_residual_trace, e.icr_residual_trace);
        set(&self.pfd_generalization, e.pfd_generalization);
        set(&self.pfd_memorization, e.pfd_memorization);
        set(&self.memorization_ratio, e.memorization_ratio);
        set(&self.tail_rmsqe, e.tail_rmsqe);
        set(&self.tail_loader, e.tail_loader);
        set(&self.generalization_gap, e.generalization_gap);
        for (split, v) in [("train", e.loss_train), ("heldout", e.loss_heldout)] {
            if let Some(v) = v {
                let labels = SplitLabels {
                    run: self.run.clone(),
                    split: split.into(),
                };
                self.denoise_loss.get_or_create(&labels).set(v);
            }
        }
        self.last_evaluated_step.get_or_create(&l).set(e.step);
    }

    /// Counts one evaluation done by this process and its durations (total and per stage).
    pub fn evaluated(&self, e: &Evaluation) {
        self.checkpoints_evaluated
            .get_or_create(&self.label())
            .inc();
        self.observe_stage("total", e.seconds);
        for (stage, seconds) in &e.stages {
            self.observe_stage(stage, *seconds);
        }
    }

    pub fn observe_stage(&self, stage: &str, seconds: f64) {
        let labels = StageLabels {
            run: self.run.clone(),
            stage: stage.into(),
        };
        self.evaluation_duration
            .get_or_create(&labels)
            .observe(seconds);
    }

    pub fn set_detector(
        &self,
        smoothed: Option<f64>,
        best_step: Option<i64>,
        triggered: bool,
        unconfirmed: bool,
    ) {
        let l = self.label();
        if let Some(s) = smoothed {
            self.icr_smoothed.get_or_create(&l).set(s);
        }
        if let Some(b) = best_step {
            self.best_step.get_or_create(&l).set(b);
        }
        self.early_stop_triggered
            .get_or_create(&l)
            .set(triggered as i64);
        self.early_stop_unconfirmed
            .get_or_create(&l)
            .set(unconfirmed as i64);
    }

    pub fn failure(&self, reason: &str) {
        let labels = ReasonLabels {
            run: self.run.clone(),
            reason: reason.into(),
        };
        self.checkpoint_failures.get_or_create(&labels).inc();
    }

    pub fn set_pending(&self, n: usize) {
        self.checkpoints_pending
            .get_or_create(&self.label())
            .set(n as i64);
    }

    pub fn skipped(&self, n: usize) {
        self.checkpoints_skipped
            .get_or_create(&self.label())
            .inc_by(n as u64);
    }

    pub fn delivery(&self, outcome: &str) {
        let labels = OutcomeLabels {
            run: self.run.clone(),
            outcome: outcome.into(),
        };
        self.webhook_deliveries.get_or_create(&labels).inc();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_named_metric_is_exported_with_the_run_label() {
        let m = Metrics::new("exp1");
        m.record(&Evaluation {
            step: 100,
            checkpoint: "c.pt".into(),
            icr: Some(0.5),
            icr_invariant_trace: Some(1.0),
            icr_residual_trace: Some(2.0),
            pfd_generalization: Some(0.1),
            pfd_memorization: Some(0.2),
            memorization_ratio: Some(0.0),
            tail_rmsqe: Some(0.3),
            tail_loader: Some(0.4),
            loss_train: Some(0.1),
            loss_heldout: Some(0.2),
            generalization_gap: Some(0.1),
            seconds: 1.5,
            ..Evaluation::default()
        });
        m.evaluated(&Evaluation {
            seconds: 1.5,
            stages: vec![("icr", 1.0)],
            ..Evaluation::default()
        });
        m.set_detector(Some(0.5), Some(100), false, false);
        m.failure("corrupt");
        m.delivery("delivered");
        let text = m.encode();
        for name in exported_names() {
            let series = if name == EVALUATION_DURATION {
                format!("{name}_count{{")
            } else {
                format!("{name}{{")
            };
            let line = text.lines().find(|l| l.starts_with(&series));
            let line = line.unwrap_or_else(|| panic!("{name} missing in\n{text}"));
            assert!(line.contains("run=\"exp1\""), "{line}");
        }
        assert!(
            text.contains("diffmon_denoise_loss{run=\"exp1\",split=\"heldout\"} 0.2"),
            "{text}"
        );
        assert!(
            text.contains("diffmon_last_evaluated_step{run=\"exp1\"} 100"),
            "{text}"
        );
    }

    /// Every metric a shipped dashboard queries is one the code exports.
    #[test]
    fn dashboards_query_only_defined_metrics() {
        let names = exported_names();
        let folder = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("dashboards");
        let re = regex::Regex::new(r"diffmon_[a-z_]+").unwrap();
        let mut checked = 0;
        for entry in std::fs::read_dir(&folder).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().and_then(|e| e.to_str()) != Some("json") {
                continue;
            }
            let text = std::fs::read_to_string(&path).unwrap();
            serde_json::from_str::<serde_json::Value>(&text).unwrap();
            for m in re.find_iter(&text) {
                let name = m.as_str();
                let base = ["_bucket", "_sum", "_count"]
                    .iter()
                    .find_map(|s| name.strip_suffix(s).filter(|b| *b == EVALUATION_DURATION))
                    .unwrap_or(name);
                assert!(
                    names.iter().any(|n| n == base),
                    "{}: unknown metric {name}",
                    path.display()
                );
                checked += 1;
            }
        }
        assert!(checked > 10, "only {checked} metric references found");
    }
}
