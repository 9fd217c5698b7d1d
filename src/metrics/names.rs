//! The exported names: every metric's name (constants; the gauges of the record's fields are
//! re-exported from `record::gauge_names`), the known values of the `stage` and Slurm `reason`
//! labels, and [`exported_names`], every name as the text format writes it; which of them are
//! the process' ([`PROCESS_METRICS`], once per daemon, no `run` label) and which the Slurm
//! executor's ([`SLURM_METRICS`], only with that executor).

use crate::record::FIELDS;

// The gauges of the record's fields (`ICR`, `DENOISE_LOSS`, ...): their names are defined beside
// the table of fields, which names each field's gauge, so that `record` depends on nothing.
pub use crate::record::gauge_names::*;
pub const ICR_SMOOTHED: &str = "diffmon_icr_smoothed";
pub const LAST_EVALUATED_STEP: &str = "diffmon_last_evaluated_step";
pub const BEST_STEP: &str = "diffmon_best_step";
pub const EARLY_STOP_TRIGGERED: &str = "diffmon_early_stop_triggered";
pub const EARLY_STOP_UNCONFIRMED: &str = "diffmon_early_stop_unconfirmed";
pub const HISTORY_SEGMENT: &str = "diffmon_history_segment";
pub const CHECKPOINTS_EVALUATED: &str = "diffmon_checkpoints_evaluated";
pub const CHECKPOINT_FAILURES: &str = "diffmon_checkpoint_failures";
pub const CHECKPOINTS_PENDING: &str = "diffmon_checkpoints_pending";
pub const CHECKPOINTS_SKIPPED: &str = "diffmon_checkpoints_skipped";
pub const CHECKPOINTS_IGNORED: &str = "diffmon_checkpoints_ignored";
/// The disk only diffmon's pins hold (`store::pin`): pinned files rotation has deleted.
pub const PINNED_BYTES: &str = "diffmon_pinned_bytes";
pub const EVALUATION_DURATION: &str = "diffmon_evaluation_duration_seconds";
// The run's pace (`daemon/pace.rs`): absent until measured.
pub const EVALUATION_SECONDS: &str = "diffmon_evaluation_seconds";
pub const GPU_SECONDS: &str = "diffmon_gpu_seconds";
pub const CHECKPOINT_INTERVAL: &str = "diffmon_checkpoint_interval_seconds";
pub const WEBHOOK_DELIVERIES: &str = "diffmon_webhook_deliveries";
pub const BUILD_INFO: &str = "diffmon_build_info";
pub const LAST_EVALUATION_TIMESTAMP: &str = "diffmon_last_evaluation_timestamp_seconds";
pub const BEST_STEP_TIMESTAMP: &str = "diffmon_best_step_timestamp_seconds";
pub const EARLY_STOP_TIMESTAMP: &str = "diffmon_early_stop_timestamp_seconds";
// The Slurm executor's jobs (exported only with `evaluation.executor: slurm`).
pub const SLURM_JOBS_SUBMITTED: &str = "diffmon_slurm_jobs_submitted";
pub const SLURM_JOBS_RUNNING: &str = "diffmon_slurm_jobs_running";
pub const SLURM_JOBS_FAILED: &str = "diffmon_slurm_jobs_failed";
pub const SLURM_QUEUE_WAIT: &str = "diffmon_slurm_queue_wait_seconds";
pub const SLURM_RUN: &str = "diffmon_slurm_run_seconds";
// A sweep's own (no `run` label: it concerns no one run; [`SweepMetrics`]).
pub const RUNS_IGNORED: &str = "diffmon_runs_ignored";
/// The Slurm executor's metrics (family names): exported only with that executor, as are the
/// `job_*` reasons of `diffmon_checkpoint_failures_total`.
pub const SLURM_METRICS: [&str; 5] = [
    SLURM_JOBS_SUBMITTED,
    SLURM_JOBS_RUNNING,
    SLURM_JOBS_FAILED,
    SLURM_QUEUE_WAIT,
    SLURM_RUN,
];

/// `reason` label values of `diffmon_slurm_jobs_failed_total`: how a job ended without a result.
pub const SLURM_JOB_FAILURES: [&str; 5] = ["failed", "timeout", "cancelled", "preempted", "lost"];
// The standard process metrics (https://prometheus.io/docs/instrumenting/writing_clientlibs/),
// read from /proc/self at each scrape (absent where /proc is not): the daemon's, once per
// exposition, without a `run` label.
pub const PROCESS_CPU_SECONDS: &str = "process_cpu_seconds";
pub const PROCESS_RESIDENT_MEMORY: &str = "process_resident_memory_bytes";
pub const PROCESS_VIRTUAL_MEMORY: &str = "process_virtual_memory_bytes";
pub const PROCESS_START_TIME: &str = "process_start_time_seconds";
pub const PROCESS_OPEN_FDS: &str = "process_open_fds";
pub const PROCESS_MAX_FDS: &str = "process_max_fds";
/// The process metrics (family names).
pub const PROCESS_METRICS: [&str; 6] = [
    PROCESS_CPU_SECONDS,
    PROCESS_RESIDENT_MEMORY,
    PROCESS_VIRTUAL_MEMORY,
    PROCESS_START_TIME,
    PROCESS_OPEN_FDS,
    PROCESS_MAX_FDS,
];

/// `stage` label values of the duration histogram: the whole evaluation and its stages.
pub const STAGE_TOTAL: &str = "total";
pub const STAGE_LOAD: &str = "load";
pub const STAGE_ICR: &str = "icr";
pub const STAGE_LOSS: &str = "loss";
pub const STAGE_PFD: &str = "pfd";
pub const STAGES: [&str; 5] = [STAGE_TOTAL, STAGE_LOAD, STAGE_ICR, STAGE_LOSS, STAGE_PFD];

/// Every name the daemon can export as it appears in the text format (counters get `_total`):
/// the gauges of the record's fields ([`FIELDS`]), then the others; the Slurm executor's
/// ([`SLURM_METRICS`]) are exported only with that executor, and the process'
/// ([`PROCESS_METRICS`]) without the `run` label the others carry.
pub fn exported_names() -> Vec<String> {
    let counters = [
        CHECKPOINTS_EVALUATED,
        CHECKPOINT_FAILURES,
        CHECKPOINTS_SKIPPED,
        WEBHOOK_DELIVERIES,
        PROCESS_CPU_SECONDS,
        SLURM_JOBS_SUBMITTED,
        SLURM_JOBS_FAILED,
        GPU_SECONDS,
    ];
    let mut names: Vec<String> = Vec::new();
    for g in FIELDS.iter().filter_map(|f| f.gauge) {
        if !names.iter().any(|n| n == g.name) {
            names.push(g.name.to_string());
        }
    }
    names.extend(
        [
            ICR_SMOOTHED,
            LAST_EVALUATED_STEP,
            BEST_STEP,
            EARLY_STOP_TRIGGERED,
            EARLY_STOP_UNCONFIRMED,
            HISTORY_SEGMENT,
            CHECKPOINTS_PENDING,
            CHECKPOINTS_IGNORED,
            PINNED_BYTES,
            EVALUATION_DURATION,
            EVALUATION_SECONDS,
            CHECKPOINT_INTERVAL,
            BUILD_INFO,
            LAST_EVALUATION_TIMESTAMP,
            BEST_STEP_TIMESTAMP,
            EARLY_STOP_TIMESTAMP,
            SLURM_JOBS_RUNNING,
            SLURM_QUEUE_WAIT,
            SLURM_RUN,
            PROCESS_RESIDENT_MEMORY,
            PROCESS_VIRTUAL_MEMORY,
            PROCESS_START_TIME,
            PROCESS_OPEN_FDS,
            PROCESS_MAX_FDS,
        ]
        .iter()
        .map(|s| s.to_string()),
    );
    names.extend(counters.iter().map(|c| format!("{c}_total")));
    names
}

#[cfg(test)]
mod tests {
    use super::*;

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
                    .find_map(|s| {
                        name.strip_suffix(s).filter(|b| {
                            [EVALUATION_DURATION, SLURM_QUEUE_WAIT, SLURM_RUN].contains(b)
                        })
                    })
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
