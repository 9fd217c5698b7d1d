//! Prometheus metrics (docs/design.md §16), through the official `prometheus-client` crate. Every
//! metric carries the label `run`. Metric names are the constants below (without the `_total`
//! suffix the text format adds to counters; the gauges of the record's fields, which the table
//! `record::FIELDS` registers and sets, are re-exported from `record::gauge_names`); dashboards
//! and tests refer to these. So are the known values of every other label ([`STAGES`],
//! [`FailureReason::ALL`], [`Receiver::ALL`] and [`DeliveryOutcome::ALL`]): each of their series
//! exists, at zero, from the start.
//!
//! `/metrics` speaks both exposition formats, chosen from the `Accept` header like Prometheus'
//! own client libraries do ([`Format::negotiate`]): OpenMetrics 1.0 (what `prometheus-client`
//! writes) when asked for `application/openmetrics-text`, else the text format 0.0.4
//! ([`openmetrics_to_text`]).

use crate::alerts::{DeliveryOutcome, Receiver};
use crate::record::{Evaluation, FIELDS, FailureReason};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::{ConstGauge, Gauge};
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use std::sync::Mutex;
use std::sync::atomic::AtomicU64;
use std::time::{SystemTime, UNIX_EPOCH};

// The gauges of the record's fields (`ICR`, `DENOISE_LOSS`, ...): their names are defined beside
// the table of fields, which names each field's gauge, so that `record` depends on nothing.
pub use crate::record::gauge_names::*;
pub const ICR_SMOOTHED: &str = "diffmon_icr_smoothed";
pub const LAST_EVALUATED_STEP: &str = "diffmon_last_evaluated_step";
pub const BEST_STEP: &str = "diffmon_best_step";
pub const EARLY_STOP_TRIGGERED: &str = "diffmon_early_stop_triggered";
pub const EARLY_STOP_UNCONFIRMED: &str = "diffmon_early_stop_unconfirmed";
pub const CHECKPOINTS_EVALUATED: &str = "diffmon_checkpoints_evaluated";
pub const CHECKPOINT_FAILURES: &str = "diffmon_checkpoint_failures";
pub const CHECKPOINTS_PENDING: &str = "diffmon_checkpoints_pending";
pub const CHECKPOINTS_SKIPPED: &str = "diffmon_checkpoints_skipped";
pub const CHECKPOINTS_IGNORED: &str = "diffmon_checkpoints_ignored";
pub const EVALUATION_DURATION: &str = "diffmon_evaluation_duration_seconds";
pub const WEBHOOK_DELIVERIES: &str = "diffmon_webhook_deliveries";
pub const BUILD_INFO: &str = "diffmon_build_info";
pub const LAST_EVALUATION_TIMESTAMP: &str = "diffmon_last_evaluation_timestamp_seconds";
pub const BEST_STEP_TIMESTAMP: &str = "diffmon_best_step_timestamp_seconds";
pub const EARLY_STOP_TIMESTAMP: &str = "diffmon_early_stop_timestamp_seconds";
// The Slurm executor's jobs (zero with the local executor).
pub const SLURM_JOBS_SUBMITTED: &str = "diffmon_slurm_jobs_submitted";
pub const SLURM_JOBS_RUNNING: &str = "diffmon_slurm_jobs_running";
pub const SLURM_JOBS_FAILED: &str = "diffmon_slurm_jobs_failed";
pub const SLURM_QUEUE_WAIT: &str = "diffmon_slurm_queue_wait_seconds";
pub const SLURM_RUN: &str = "diffmon_slurm_run_seconds";
// A sweep's own (no `run` label: it concerns no one run; [`SweepMetrics`]).
pub const RUNS_IGNORED: &str = "diffmon_runs_ignored";

/// `reason` label values of `diffmon_slurm_jobs_failed_total`: how a job ended without a result.
pub const SLURM_JOB_FAILURES: [&str; 5] = ["failed", "timeout", "cancelled", "preempted", "lost"];
// The standard process metrics (https://prometheus.io/docs/instrumenting/writing_clientlibs/),
// read from /proc/self at each scrape (absent where /proc is not).
pub const PROCESS_CPU_SECONDS: &str = "process_cpu_seconds";
pub const PROCESS_RESIDENT_MEMORY: &str = "process_resident_memory_bytes";
pub const PROCESS_VIRTUAL_MEMORY: &str = "process_virtual_memory_bytes";
pub const PROCESS_START_TIME: &str = "process_start_time_seconds";
pub const PROCESS_OPEN_FDS: &str = "process_open_fds";
pub const PROCESS_MAX_FDS: &str = "process_max_fds";

/// `stage` label values of the duration histogram: the whole evaluation and its stages.
pub const STAGE_TOTAL: &str = "total";
pub const STAGE_LOAD: &str = "load";
pub const STAGE_ICR: &str = "icr";
pub const STAGE_LOSS: &str = "loss";
pub const STAGE_PFD: &str = "pfd";
pub const STAGES: [&str; 5] = [STAGE_TOTAL, STAGE_LOAD, STAGE_ICR, STAGE_LOSS, STAGE_PFD];

/// Every exported name as it appears in the text format (counters get `_total`): the gauges of
/// the record's fields ([`FIELDS`]), then the others.
pub fn exported_names() -> Vec<String> {
    let counters = [
        CHECKPOINTS_EVALUATED,
        CHECKPOINT_FAILURES,
        CHECKPOINTS_SKIPPED,
        WEBHOOK_DELIVERIES,
        PROCESS_CPU_SECONDS,
        SLURM_JOBS_SUBMITTED,
        SLURM_JOBS_FAILED,
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
            CHECKPOINTS_PENDING,
            CHECKPOINTS_IGNORED,
            EVALUATION_DURATION,
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

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RunLabel {
    pub run: String,
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

type FGauge = Gauge<f64, AtomicU64>;

/// The labels of a record field's gauge: `run`, then the field's own (`split`).
type FieldLabels = Vec<(&'static str, String)>;

/// The metrics of a sweep as a whole, beside its runs' [`Metrics`]; without a `run` label, since
/// they concern no one run. Clones share the values.
#[derive(Clone, Debug, Default)]
pub struct SweepMetrics {
    /// Run folders `runs_glob` matches that are not watched: the sweep is at `max_runs`.
    runs_ignored: Gauge,
}

impl SweepMetrics {
    pub fn set_runs_ignored(&self, n: usize) {
        self.runs_ignored.set(n as i64);
    }

    /// The OpenMetrics families, without the closing `# EOF`.
    fn encode(&self) -> String {
        let mut registry = Registry::default();
        registry.register(
            RUNS_IGNORED,
            "Run folders runs_glob matches that are not watched because the sweep is at max_runs",
            self.runs_ignored.clone(),
        );
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &registry)
            .expect("writing to a String");
        out.strip_suffix("# EOF\n").unwrap_or(&out).to_string()
    }
}

/// The daemon's metrics; cheap to share (`Arc`) between the evaluation and HTTP threads.
pub struct Metrics {
    run: String,
    pub registry: Registry,
    /// The gauge of each record field that has one, in [`FIELDS`]' order (fields that share a
    /// gauge share its family).
    fields: Vec<Option<Family<FieldLabels, FGauge>>>,
    icr_smoothed: Family<RunLabel, FGauge>,
    last_evaluated_step: Family<RunLabel, Gauge>,
    best_step: Family<RunLabel, Gauge>,
    early_stop_triggered: Family<RunLabel, Gauge>,
    early_stop_unconfirmed: Family<RunLabel, Gauge>,
    checkpoints_evaluated: Family<RunLabel, Counter>,
    checkpoint_failures: Family<ReasonLabels, Counter>,
    checkpoints_pending: Family<RunLabel, Gauge>,
    checkpoints_ignored: Family<RunLabel, Gauge>,
    checkpoints_skipped: Family<RunLabel, Counter>,
    evaluation_duration: Family<StageLabels, Histogram>,
    webhook_deliveries: Family<OutcomeLabels, Counter>,
    last_evaluation_timestamp: Family<RunLabel, FGauge>,
    best_step_timestamp: Family<RunLabel, FGauge>,
    early_stop_timestamp: Family<RunLabel, FGauge>,
    slurm_jobs_submitted: Family<RunLabel, Counter>,
    slurm_jobs_running: Family<RunLabel, Gauge>,
    slurm_jobs_failed: Family<ReasonLabels, Counter>,
    slurm_queue_wait: Family<RunLabel, Histogram>,
    slurm_run: Family<RunLabel, Histogram>,
    /// The detector's state last published: (best step, fired), to time their changes.
    seen: Mutex<(Option<i64>, bool)>,
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

/// The format of a `/metrics` answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// OpenMetrics 1.0.0 text.
    OpenMetrics,
    /// Prometheus text format 0.0.4.
    Text,
}

impl Format {
    pub fn content_type(self) -> &'static str {
        match self {
            Format::OpenMetrics => "application/openmetrics-text; version=1.0.0; charset=utf-8",
            Format::Text => "text/plain; version=0.0.4; charset=utf-8",
        }
    }

    /// The format an `Accept` header asks for: OpenMetrics only when it names
    /// `application/openmetrics-text` (version 1.0.0 or 0.0.1, or none) with a quality at least
    /// that of `text/plain` (or `text/*`, `*/*`); the text format otherwise, absent header
    /// included. Prometheus sends
    /// `application/openmetrics-text;version=1.0.0,...,text/plain;version=0.0.4;q=0.5,*/*;q=0.1`.
    pub fn negotiate(accept: Option<&str>) -> Format {
        let Some(accept) = accept else {
            return Format::Text;
        };
        let (mut om, mut text) = (0.0f64, 0.0f64);
        for range in accept.split(',') {
            let mut parts = range.split(';').map(str::trim);
            let media = parts.next().unwrap_or("").to_ascii_lowercase();
            let mut q = 1.0;
            let mut version_ok = true;
            for p in parts {
                let Some((k, v)) = p.split_once('=') else {
                    continue;
                };
                let v = v.trim().trim_matches('"');
                match k.trim().to_ascii_lowercase().as_str() {
                    "q" => {
                        q = v
                            .parse::<f64>()
                            .ok()
                            .filter(|q| q.is_finite())
                            .unwrap_or(0.0)
                    }
                    "version" => version_ok = matches!(v, "1.0.0" | "0.0.1"),
                    _ => {}
                }
            }
            match media.as_str() {
                "application/openmetrics-text" if version_ok => om = om.max(q),
                "text/plain" | "text/*" | "*/*" => text = text.max(q),
                _ => {}
            }
        }
        if om > 0.0 && om >= text {
            Format::OpenMetrics
        } else {
            Format::Text
        }
    }
}

/// Converts OpenMetrics text, as `prometheus-client` writes it, into the Prometheus text format
/// 0.0.4: no `# EOF` and no `# UNIT`; a counter's `HELP` and `TYPE` name its `_total` series;
/// `info` families become gauges named `*_info`, `unknown` ones `untyped`; no `_created` series;
/// exemplars dropped. `prometheus-client` writes HELP texts as they are, which must not contain
/// a backslash or a newline (ours do not: a test checks).
pub fn openmetrics_to_text(om: &str) -> String {
    let mut out = String::with_capacity(om.len());
    let mut help: Option<(&str, &str)> = None; // (family, text)
    let mut family = String::new();
    let mut kind = "";
    for line in om.lines() {
        if let Some(rest) = line.strip_prefix("# HELP ") {
            let (name, text) = rest.split_once(' ').unwrap_or((rest, ""));
            help = Some((name, text));
            continue;
        }
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, t) = rest.split_once(' ').unwrap_or((rest, "unknown"));
            kind = t.trim();
            let (series, text_type) = match kind {
                "counter" => (format!("{name}_total"), "counter"),
                "gauge" => (name.to_string(), "gauge"),
                "histogram" => (name.to_string(), "histogram"),
                "summary" => (name.to_string(), "summary"),
                "info" => (format!("{name}_info"), "gauge"),
                "stateset" => (name.to_string(), "gauge"),
                _ => (name.to_string(), "untyped"),
            };
            family = name.to_string();
            if let Some((_, text)) = help.take().filter(|(h, _)| *h == name) {
                out.push_str(&format!("# HELP {series} {text}\n"));
            }
            out.push_str(&format!("# TYPE {series} {text_type}\n"));
            continue;
        }
        if line.starts_with('#') || line.trim().is_empty() {
            continue; // # UNIT, # EOF
        }
        let sample_name = line.split(['{', ' ']).next().unwrap_or("");
        if sample_name == format!("{family}_created")
            && matches!(kind, "counter" | "histogram" | "summary")
        {
            continue;
        }
        // An exemplar follows ` # ` after the value; label values (quoted) may hold `#` and `}`.
        let body_start = labels_end(line);
        let sample = match line[body_start..].find(" # ") {
            Some(i) => &line[..body_start + i],
            None => line,
        };
        out.push_str(sample);
        out.push('\n');
    }
    out
}

/// The byte index just after a sample line's label set (after its name if it has none).
fn labels_end(line: &str) -> usize {
    let Some(open) = line.find(['{', ' ']) else {
        return line.len();
    };
    if line.as_bytes()[open] != b'{' {
        return open;
    }
    let (mut quoted, mut escaped) = (false, false);
    for (i, c) in line[open..].char_indices() {
        match c {
            _ if escaped => escaped = false,
            '\\' if quoted => escaped = true,
            '"' => quoted = !quoted,
            '}' if !quoted => return open + i + 1,
            _ => {}
        }
    }
    line.len()
}

/// Seconds since the Unix epoch now.
fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// Seconds since the Unix epoch of an RFC 3339 time in UTC as the history writes it
/// (`2023-11-14T22:13:20.123Z`, fraction optional); None if it is not one.
pub fn parse_rfc3339_utc(s: &str) -> Option<f64> {
    let b = s.as_bytes();
    if b.len() < 20
        || b[4] != b'-'
        || b[7] != b'-'
        || b[10] != b'T'
        || b[13] != b':'
        || b[16] != b':'
    {
        return None;
    }
    let num = |r: std::ops::Range<usize>| -> Option<i64> {
        let t = s.get(r)?;
        if t.bytes().all(|c| c.is_ascii_digit()) {
            t.parse().ok()
        } else {
            None
        }
    };
    let (y, mo, d) = (num(0..4)?, num(5..7)?, num(8..10)?);
    let (h, mi, sec) = (num(11..13)?, num(14..16)?, num(17..19)?);
    if !(1..=12).contains(&mo) || !(1..=31).contains(&d) || h > 23 || mi > 59 || sec > 60 {
        return None;
    }
    let rest = s.get(19..)?;
    let frac = match rest.strip_suffix('Z')? {
        "" => 0.0,
        f => {
            let digits = f.strip_prefix('.')?;
            if digits.is_empty() || digits.len() > 9 || !digits.bytes().all(|c| c.is_ascii_digit())
            {
                return None;
            }
            format!("0.{digits}").parse::<f64>().ok()?
        }
    };
    // Days from civil (H. Hinnant).
    let y = if mo <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (mo + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    Some((days * 86_400 + h * 3600 + mi * 60 + sec) as f64 + frac)
}

/// One reading of /proc/self; a field is None where it could not be read.
#[derive(Debug, Default)]
pub struct ProcessStats {
    pub cpu_seconds: Option<f64>,
    pub resident_bytes: Option<f64>,
    pub virtual_bytes: Option<f64>,
    pub start_time_seconds: Option<f64>,
    pub open_fds: Option<f64>,
    pub max_fds: Option<f64>,
}

impl ProcessStats {
    pub fn read() -> ProcessStats {
        let mut p = ProcessStats::default();
        // SAFETY: sysconf and getrlimit only read process-wide settings into our variables.
        let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as f64;
        if let Ok(stat) = std::fs::read_to_string("/proc/self/stat") {
            // Fields after the command name in parentheses (which may hold spaces): state is
            // field 3, utime 14, stime 15, starttime 22, vsize 23, rss 24.
            if let Some(i) = stat.rfind(')') {
                let f: Vec<&str> = stat[i + 1..].split_whitespace().collect();
                let field = |n: usize| f.get(n - 3).and_then(|v| v.parse::<f64>().ok());
                if ticks > 0.0 {
                    if let (Some(u), Some(s)) = (field(14), field(15)) {
                        p.cpu_seconds = Some((u + s) / ticks);
                    }
                    let boot = std::fs::read_to_string("/proc/stat").ok().and_then(|t| {
                        t.lines()
                            .find_map(|l| l.strip_prefix("btime "))
                            .and_then(|v| v.trim().parse::<f64>().ok())
                    });
                    if let (Some(b), Some(st)) = (boot, field(22)) {
                        p.start_time_seconds = Some(b + st / ticks);
                    }
                }
                p.virtual_bytes = field(23);
                if page > 0.0 {
                    p.resident_bytes = field(24).map(|r| r * page);
                }
            }
        }
        if let Ok(dir) = std::fs::read_dir("/proc/self/fd") {
            // The directory handle itself is one of the entries.
            p.open_fds = Some(dir.count().saturating_sub(1) as f64);
        }
        let mut lim = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: `lim` is a valid rlimit for getrlimit to fill.
        if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } == 0 {
            p.max_fds = Some(lim.rlim_cur as f64);
        }
        p
    }
}

/// The `process_*` metrics, read at each scrape. (A collector's HELP is written as given: with
/// its full stop, which `Registry::register` adds to the others.)
#[derive(Debug)]
struct ProcessCollector {
    label: RunLabel,
}

impl Collector for ProcessCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let p = ProcessStats::read();
        if let Some(v) = p.cpu_seconds {
            let c = ConstCounter::new(v);
            let mut e = encoder.encode_descriptor(
                PROCESS_CPU_SECONDS,
                "Total user and system CPU time spent in seconds.",
                None,
                c.metric_type(),
            )?;
            c.encode(e.encode_family(&self.label)?)?;
        }
        let gauges = [
            (
                PROCESS_RESIDENT_MEMORY,
                "Resident memory size in bytes.",
                p.resident_bytes,
            ),
            (
                PROCESS_VIRTUAL_MEMORY,
                "Virtual memory size in bytes.",
                p.virtual_bytes,
            ),
            (
                PROCESS_START_TIME,
                "Start time of the process since unix epoch in seconds.",
                p.start_time_seconds,
            ),
            (
                PROCESS_OPEN_FDS,
                "Number of open file descriptors.",
                p.open_fds,
            ),
            (
                PROCESS_MAX_FDS,
                "Maximum number of open file descriptors.",
                p.max_fds,
            ),
        ];
        for (name, help, value) in gauges {
            if let Some(v) = value {
                let g = ConstGauge::new(v);
                let mut e = encoder.encode_descriptor(name, help, None, g.metric_type())?;
                g.encode(e.encode_family(&self.label)?)?;
            }
        }
        Ok(())
    }
}

impl Metrics {
    /// The label `run` of these metrics.
    pub fn run(&self) -> &str {
        &self.run
    }

    pub fn new(run: &str) -> Metrics {
        let mut registry = Registry::default();
        let m = Metrics {
            run: run.to_string(),
            fields: Vec::new(),
            icr_smoothed: Family::default(),
            last_evaluated_step: Family::default(),
            best_step: Family::default(),
            early_stop_triggered: Family::default(),
            early_stop_unconfirmed: Family::default(),
            checkpoints_evaluated: Family::default(),
            checkpoint_failures: Family::default(),
            checkpoints_pending: Family::default(),
            checkpoints_ignored: Family::default(),
            checkpoints_skipped: Family::default(),
            evaluation_duration: Family::new_with_constructor(duration_histogram),
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
            CHECKPOINTS_IGNORED,
            "Entries of the run folder that look like checkpoints but are not evaluated (no match for checkpoints.pattern, no step, no weights file)",
            m.checkpoints_ignored.clone(),
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
            "Alert deliveries by receiver (webhook, alertmanager) and outcome",
            m.webhook_deliveries.clone(),
        );
        registry.register(
            LAST_EVALUATION_TIMESTAMP,
            "Unix time of the last checkpoint evaluated by this process (its start until the first)",
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
        registry.register_collector(Box::new(ProcessCollector { label: m.label() }));
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
        m.early_stop_triggered.get_or_create(&l).set(0);
        m.early_stop_unconfirmed.get_or_create(&l).set(0);
        m.last_evaluation_timestamp
            .get_or_create(&l)
            .set(unix_now());
        m.best_step_timestamp.get_or_create(&l).set(0.0);
        m.early_stop_timestamp.get_or_create(&l).set(0.0);
        for reason in FailureReason::ALL {
            m.checkpoint_failures
                .get_or_create(&m.reason_labels(reason))
                .inc_by(0);
        }
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

    fn label(&self) -> RunLabel {
        RunLabel {
            run: self.run.clone(),
        }
    }

    fn reason_labels(&self, reason: FailureReason) -> ReasonLabels {
        ReasonLabels {
            run: self.run.clone(),
            reason: reason.as_str().into(),
        }
    }

    fn stage_labels(&self, stage: &str) -> StageLabels {
        StageLabels {
            run: self.run.clone(),
            stage: stage.into(),
        }
    }

    fn outcome_labels(&self, receiver: Receiver, outcome: DeliveryOutcome) -> OutcomeLabels {
        OutcomeLabels {
            run: self.run.clone(),
            receiver: receiver.as_str().into(),
            outcome: outcome.as_str().into(),
        }
    }

    /// The OpenMetrics text exposition.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry)
            .expect("writing to a String");
        out
    }

    /// The exposition in the given format.
    pub fn encode_as(&self, format: Format) -> String {
        match format {
            Format::OpenMetrics => self.encode(),
            Format::Text => openmetrics_to_text(&self.encode()),
        }
    }

    /// The OpenMetrics exposition of several runs' metrics (a sweep) as one: each family once,
    /// with every run's samples (each under its own `run` label), in the first run's order.
    pub fn encode_runs(runs: &[std::sync::Arc<Metrics>]) -> String {
        // (family name, its `# HELP`/`# TYPE`/`# UNIT` lines, its samples)
        let mut families: Vec<(String, Vec<String>, Vec<String>)> = Vec::new();
        for m in runs {
            let text = m.encode();
            let mut current: Option<usize> = None;
            for line in text.lines() {
                if line == "# EOF" {
                    continue;
                }
                let meta = ["# HELP ", "# TYPE ", "# UNIT "]
                    .iter()
                    .find_map(|p| line.strip_prefix(p));
                if let Some(rest) = meta {
                    let name = rest.split(' ').next().unwrap_or_default();
                    let at = match families.iter().position(|f| f.0 == name) {
                        Some(at) => at,
                        None => {
                            families.push((name.to_string(), Vec::new(), Vec::new()));
                            families.len() - 1
                        }
                    };
                    let header = &mut families[at].1;
                    if !header.iter().any(|h| h == line) {
                        header.push(line.to_string());
                    }
                    current = Some(at);
                } else if let Some(at) = current {
                    families[at].2.push(line.to_string());
                }
            }
        }
        let mut out = String::new();
        for (_, header, samples) in &families {
            for line in header.iter().chain(samples) {
                out.push_str(line);
                out.push('\n');
            }
        }
        out.push_str("# EOF\n");
        out
    }

    /// [`Metrics::encode_runs`] in the given format.
    pub fn encode_runs_as(runs: &[std::sync::Arc<Metrics>], format: Format) -> String {
        match format {
            Format::OpenMetrics => Metrics::encode_runs(runs),
            Format::Text => openmetrics_to_text(&Metrics::encode_runs(runs)),
        }
    }

    /// A sweep's exposition: its runs' ([`Metrics::encode_runs`]), then its own
    /// ([`SweepMetrics`]), in the given format.
    pub fn encode_sweep_as(
        runs: &[std::sync::Arc<Metrics>],
        sweep: &SweepMetrics,
        format: Format,
    ) -> String {
        let runs = Metrics::encode_runs(runs);
        let text = format!(
            "{}{}# EOF\n",
            runs.strip_suffix("# EOF\n").unwrap_or(&runs),
            sweep.encode()
        );
        match format {
            Format::OpenMetrics => text,
            Format::Text => openmetrics_to_text(&text),
        }
    }

    /// Publishes one evaluation's values (gauges only: a restart republishes the last one). A
    /// field the record does not have leaves its gauge as it was.
    pub fn record(&self, e: &Evaluation) {
        for (f, family) in FIELDS.iter().zip(&self.fields) {
            if let (Some(g), Some(family), Some(v)) = (f.gauge, family, f.float(e)) {
                let mut labels: FieldLabels = vec![("run", self.run.clone())];
                labels.extend(g.labels.iter().map(|(k, v)| (*k, v.to_string())));
                family.get_or_create(&labels).set(v);
            }
        }
        self.last_evaluated_step
            .get_or_create(&self.label())
            .set(e.step);
    }

    /// Counts one evaluation done by this process and its durations (total and per stage).
    pub fn evaluated(&self, e: &Evaluation) {
        self.checkpoints_evaluated
            .get_or_create(&self.label())
            .inc();
        self.last_evaluation_timestamp
            .get_or_create(&self.label())
            .set(unix_now());
        self.observe_stage(STAGE_TOTAL, e.seconds);
        for (stage, seconds) in &e.stages {
            self.observe_stage(stage, *seconds);
        }
    }

    pub fn observe_stage(&self, stage: &str, seconds: f64) {
        self.evaluation_duration
            .get_or_create(&self.stage_labels(stage))
            .observe(seconds);
    }

    /// Publishes the detector's state after the evaluation made at `at` (RFC 3339, as the
    /// history records it; replayed evaluations keep their own time). A change of the best step,
    /// and the early stop firing, set their timestamp gauges to that time: the dashboard's
    /// annotations read them as the annotation's time, so none is missed between two steps.
    pub fn set_detector(
        &self,
        smoothed: Option<f64>,
        best_step: Option<i64>,
        triggered: bool,
        unconfirmed: bool,
        at: &str,
    ) {
        let l = self.label();
        {
            let mut seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
            let when = || parse_rfc3339_utc(at).unwrap_or_else(unix_now);
            if best_step.is_some() && best_step != seen.0 {
                self.best_step_timestamp.get_or_create(&l).set(when());
            }
            if triggered && !seen.1 {
                self.early_stop_timestamp.get_or_create(&l).set(when());
            }
            *seen = (best_step.or(seen.0), triggered);
        }
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

    /// Counts one failure.
    pub fn failure(&self, reason: FailureReason) {
        self.checkpoint_failures
            .get_or_create(&self.reason_labels(reason))
            .inc();
    }

    pub fn set_pending(&self, n: usize) {
        self.checkpoints_pending
            .get_or_create(&self.label())
            .set(n as i64);
    }

    pub fn set_ignored(&self, n: usize) {
        self.checkpoints_ignored
            .get_or_create(&self.label())
            .set(n as i64);
    }

    pub fn skipped(&self, n: usize) {
        self.checkpoints_skipped
            .get_or_create(&self.label())
            .inc_by(n as u64);
    }

    /// Counts one Slurm job submitted.
    pub fn slurm_submitted(&self) {
        self.slurm_jobs_submitted.get_or_create(&self.label()).inc();
    }

    pub fn set_slurm_running(&self, n: usize) {
        self.slurm_jobs_running
            .get_or_create(&self.label())
            .set(n as i64);
    }

    /// Counts one Slurm job that ended without a result; `reason` is one of
    /// [`SLURM_JOB_FAILURES`].
    pub fn slurm_failed(&self, reason: &str) {
        self.slurm_jobs_failed
            .get_or_create(&ReasonLabels {
                run: self.run.clone(),
                reason: reason.into(),
            })
            .inc();
    }

    pub fn slurm_queue_wait(&self, seconds: f64) {
        self.slurm_queue_wait
            .get_or_create(&self.label())
            .observe(seconds);
    }

    pub fn slurm_run(&self, seconds: f64) {
        self.slurm_run.get_or_create(&self.label()).observe(seconds);
    }

    /// Counts one delivery outcome of a receiver.
    pub fn delivery(&self, receiver: Receiver, outcome: DeliveryOutcome) {
        self.webhook_deliveries
            .get_or_create(&self.outcome_labels(receiver, outcome))
            .inc();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A sweep's exposition: each family once (its metadata once), with every run's samples,
    /// A sweep's exposition: its runs' families, then its own gauge without a `run` label, one
    /// `# EOF`, in both formats.
    #[test]
    fn a_sweep_exposition_ends_with_its_own_gauge() {
        let runs = vec![std::sync::Arc::new(Metrics::new("a"))];
        let sweep = SweepMetrics::default();
        sweep.set_runs_ignored(44);
        let open = Metrics::encode_sweep_as(&runs, &sweep, Format::OpenMetrics);
        assert!(open.contains("diffmon_build_info{run=\"a\""), "{open}");
        assert!(
            open.ends_with("# TYPE diffmon_runs_ignored gauge\ndiffmon_runs_ignored 44\n# EOF\n"),
            "{open}"
        );
        assert_eq!(open.matches("# EOF").count(), 1, "{open}");
        let text = Metrics::encode_sweep_as(&runs, &sweep, Format::Text);
        assert!(text.contains("\ndiffmon_runs_ignored 44\n"), "{text}");
        assert!(!text.contains("# EOF"), "{text}");
    }

    /// each under its own label; one `# EOF`; a run's lines as its own exposition has them.
    #[test]
    fn several_runs_encode_as_one_exposition() {
        let runs: Vec<std::sync::Arc<Metrics>> = ["a", "b"]
            .into_iter()
            .map(|r| std::sync::Arc::new(Metrics::new(r)))
            .collect();
        runs[1].record(&Evaluation {
            step: 7,
            icr: Some(0.25),
            ..Evaluation::default()
        });
        let all = Metrics::encode_runs(&runs);
        assert!(
            all.ends_with("# EOF\n") && all.matches("# EOF").count() == 1,
            "{all}"
        );
        let meta: Vec<&str> = all.lines().filter(|l| l.starts_with("# ")).collect();
        let mut unique = meta.clone();
        unique.sort();
        unique.dedup();
        assert_eq!(meta.len(), unique.len(), "a family's metadata twice");
        // The process' own gauges (memory, CPU time) are read at each encoding: compared by name.
        let name = |l: &str| l.split(' ').next().unwrap_or("").to_string();
        for m in &runs {
            for line in m.encode().lines() {
                let found = if line.starts_with("process_") {
                    all.lines().any(|l| name(l) == name(line))
                } else {
                    all.lines().any(|l| l == line)
                };
                assert!(found, "{line} missing");
            }
        }
        assert!(all.contains("diffmon_icr{run=\"b\"} 0.25"), "{all}");
        // Every sample line follows its family's metadata: no family is split in two.
        let mut seen = Vec::new();
        let mut family = "";
        for l in all.lines() {
            if let Some(rest) = l.strip_prefix("# TYPE ") {
                family = rest.split(' ').next().unwrap();
                assert!(!seen.contains(&family), "{family} twice");
                seen.push(family);
            } else if !l.starts_with('#') {
                assert!(l.starts_with(family), "{l} outside {family}");
            }
        }
        let text = Metrics::encode_runs_as(&runs, Format::Text);
        assert!(!text.contains("# EOF"));
        assert!(text.contains("run=\"a\"") && text.contains("run=\"b\""));
    }

    #[test]
    fn every_named_metric_is_exported_with_the_run_label() {
        let m = Metrics::new("exp1");
        m.record(&crate::record::full_record());
        m.evaluated(&Evaluation {
            seconds: 1.5,
            stages: vec![("icr", 1.0)],
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
        let text = m.encode();
        for name in exported_names() {
            let series =
                if [EVALUATION_DURATION, SLURM_QUEUE_WAIT, SLURM_RUN].contains(&name.as_str()) {
                    format!("{name}_count{{")
                } else {
                    format!("{name}{{")
                };
            let line = text.lines().find(|l| l.starts_with(&series));
            let line = line.unwrap_or_else(|| panic!("{name} missing in\n{text}"));
            assert!(line.contains("run=\"exp1\""), "{line}");
        }
        assert!(
            text.contains("diffmon_denoise_loss{run=\"exp1\",split=\"heldout\"} 0.1234\n"),
            "{text}"
        );
        assert!(
            text.contains("diffmon_last_evaluated_step{run=\"exp1\"} 100"),
            "{text}"
        );
    }

    /// Each field of the table with a gauge is registered and set from a full record, with its
    /// labels, its help and its value; a record without the field leaves its gauge as it was.
    #[test]
    fn every_gauge_of_the_field_table_is_registered_and_set() {
        let full = crate::record::full_record();
        let m = Metrics::new("r");
        let before = m.encode_as(Format::Text);
        m.record(&Evaluation {
            step: 7,
            ..Evaluation::default()
        });
        let empty = m.encode_as(Format::Text);
        m.record(&full);
        let text = m.encode_as(Format::Text);
        m.record(&Evaluation {
            step: 8,
            ..Evaluation::default()
        });
        let after_empty = m.encode_as(Format::Text);
        let mut gauges = 0;
        for f in &crate::record::FIELDS {
            let Some(g) = f.gauge else { continue };
            gauges += 1;
            assert!(exported_names().iter().any(|n| n == g.name), "{}", g.name);
            assert!(
                text.contains(&format!(
                    "# HELP {} {}.\n# TYPE {} gauge\n",
                    g.name, g.help, g.name
                )),
                "{}: {text}",
                g.name
            );
            let labels: String = g
                .labels
                .iter()
                .map(|(k, v)| format!(",{k}=\"{v}\""))
                .collect();
            let series = format!("{}{{run=\"r\"{labels}}} ", g.name);
            let value = f.float(&full).unwrap();
            let line = text.lines().find(|l| l.starts_with(&series));
            let line = line.unwrap_or_else(|| panic!("no {series} in\n{text}"));
            assert_eq!(
                line[series.len()..].parse::<f64>().unwrap(),
                value,
                "{line}"
            );
            for t in [&before, &empty] {
                assert!(!t.contains(&series), "{series} set without a value");
            }
            assert!(
                after_empty.contains(line),
                "{series} changed by a record without it"
            );
        }
        assert_eq!(gauges, 12);
        assert!(
            text.contains(&format!("{ICR_STDERR}{{run=\"r\"}} 0.0042\n")),
            "{text}"
        );
    }

    /// Issue 15: the text format 0.0.4 (no `# EOF`, no `# UNIT`, counters' HELP and TYPE name
    /// the `_total` series, no `_created`), with a HELP line for every TYPE.
    #[test]
    fn text_format_is_prometheus_0_0_4() {
        let m = Metrics::new("exp1");
        m.failure(FailureReason::Vanished);
        m.observe_stage(STAGE_LOAD, 0.002);
        let om = m.encode();
        assert!(om.ends_with("# EOF\n"), "{om}");
        let text = m.encode_as(Format::Text);
        assert!(
            !text.contains("# EOF") && !text.contains("# UNIT"),
            "{text}"
        );
        assert!(!text.contains("_created"), "{text}");
        for c in [
            CHECKPOINTS_EVALUATED,
            CHECKPOINT_FAILURES,
            WEBHOOK_DELIVERIES,
        ] {
            assert!(
                text.contains(&format!("# TYPE {c}_total counter\n")),
                "{c}: {text}"
            );
            assert!(text.contains(&format!("# HELP {c}_total ")), "{c}: {text}");
        }
        assert!(text.contains("# TYPE process_cpu_seconds_total counter\n"));
        assert!(text.contains(&format!("# TYPE {EVALUATION_DURATION} histogram\n")));
        // Every TYPE has its HELP just before, naming the same series; every sample belongs to
        // the family of the TYPE before it.
        let lines: Vec<&str> = text.lines().collect();
        let mut family = "";
        for (i, l) in lines.iter().enumerate() {
            if let Some(rest) = l.strip_prefix("# TYPE ") {
                family = rest.split(' ').next().unwrap();
                let help = lines[i - 1];
                assert!(
                    help.starts_with(&format!("# HELP {family} ")),
                    "{help} / {l}"
                );
            } else if !l.starts_with('#') {
                let name = l.split(['{', ' ']).next().unwrap();
                let ok = name == family
                    || ["_bucket", "_sum", "_count"]
                        .iter()
                        .any(|s| name == format!("{family}{s}"));
                assert!(ok, "{name} under TYPE {family}");
            }
        }
        // Samples are the same in both formats, but for OpenMetrics' extra lines.
        let samples = |t: &str| -> Vec<String> {
            t.lines()
                .filter(|l| !l.starts_with('#'))
                .map(str::to_string)
                .collect()
        };
        let (a, b) = (samples(&om), samples(&text));
        assert_eq!(a.len(), b.len());
        assert!(
            b.contains(
                &"diffmon_checkpoint_failures_total{run=\"exp1\",reason=\"vanished\"} 1"
                    .to_string()
            ),
            "{text}"
        );
    }

    #[test]
    fn conversion_handles_what_prometheus_client_may_write() {
        let om = "# HELP a_seconds A.\n# TYPE a_seconds counter\n# UNIT a_seconds seconds\n\
                  a_seconds_total{x=\"}#\"} 3 # {id=\"e\"} 1.0\na_seconds_created 1.7e9\n\
                  # HELP i Build.\n# TYPE i info\ni_info{v=\"1\"} 1\n\
                  # HELP u U.\n# TYPE u unknown\nu 2\n# EOF\n";
        assert_eq!(
            openmetrics_to_text(om),
            "# HELP a_seconds_total A.\n# TYPE a_seconds_total counter\n\
             a_seconds_total{x=\"}#\"} 3\n\
             # HELP i_info Build.\n# TYPE i_info gauge\ni_info{v=\"1\"} 1\n\
             # HELP u U.\n# TYPE u untyped\nu 2\n"
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

    /// Issue 15: negotiated like Prometheus' client libraries.
    #[test]
    fn accept_header_negotiation() {
        let om = Format::OpenMetrics;
        let text = Format::Text;
        for (accept, want) in [
            (None, text),
            (Some(""), text),
            (Some("*/*"), text),
            (Some("text/plain;version=0.0.4"), text),
            (Some("text/plain; version=0.0.4; charset=utf-8"), text),
            (Some("application/openmetrics-text"), om),
            (
                Some("application/openmetrics-text; version=1.0.0; charset=utf-8"),
                om,
            ),
            // What Prometheus 2.42 sends.
            (
                Some(
                    "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1",
                ),
                om,
            ),
            // Prometheus with `scrape_classic...`/text preferred.
            (
                Some("text/plain;version=0.0.4;q=1,application/openmetrics-text;q=0.5"),
                text,
            ),
            (Some("application/openmetrics-text;q=0"), text),
            (Some("application/openmetrics-text;version=9.9.9"), text),
            (Some("application/json"), text),
        ] {
            assert_eq!(Format::negotiate(accept), want, "{accept:?}");
        }
        assert_eq!(
            Format::Text.content_type(),
            "text/plain; version=0.0.4; charset=utf-8"
        );
    }

    /// Issue 15: every known label value's series exists at zero from the start; so do the
    /// process metrics and the timestamps.
    #[test]
    fn known_series_exist_at_zero_from_the_start() {
        let m = Metrics::new("exp1");
        let text = m.encode_as(Format::Text);
        for reason in FailureReason::ALL {
            let s = format!("{CHECKPOINT_FAILURES}_total{{run=\"exp1\",reason=\"{reason}\"}} 0\n");
            assert!(text.contains(&s), "{s} missing in\n{text}");
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
        let started = text
            .lines()
            .find_map(|l| l.strip_prefix(&format!("{LAST_EVALUATION_TIMESTAMP}{{run=\"exp1\"}} ")))
            .unwrap()
            .parse::<f64>()
            .unwrap();
        assert!((started - unix_now()).abs() < 3600.0, "{started}");
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

    /// The annotation gauges move only when the best step changes or the stop fires, to the
    /// evaluation's own time.
    #[test]
    fn best_step_and_early_stop_timestamps_are_the_evaluations_times() {
        let m = Metrics::new("r");
        let value = |name: &str| -> f64 {
            let text = m.encode_as(Format::Text);
            text.lines()
                .find_map(|l| l.strip_prefix(&format!("{name}{{run=\"r\"}} ")))
                .unwrap()
                .parse()
                .unwrap()
        };
        m.set_detector(Some(1.0), Some(1), false, false, "2023-11-14T22:13:20.500Z");
        assert_eq!(value(BEST_STEP_TIMESTAMP), 1_700_000_000.5);
        m.set_detector(Some(1.0), Some(1), false, false, "2023-11-14T22:13:30.000Z");
        assert_eq!(value(BEST_STEP_TIMESTAMP), 1_700_000_000.5);
        m.set_detector(Some(0.5), Some(2), false, false, "2023-11-14T22:13:40Z");
        assert_eq!(value(BEST_STEP_TIMESTAMP), 1_700_000_020.0);
        assert_eq!(value(EARLY_STOP_TIMESTAMP), 0.0);
        m.set_detector(Some(0.9), Some(2), true, false, "2023-11-14T22:13:50.000Z");
        m.set_detector(Some(0.9), Some(2), true, false, "2023-11-14T22:14:00.000Z");
        assert_eq!(value(EARLY_STOP_TIMESTAMP), 1_700_000_030.0);
        assert_eq!(value(BEST_STEP_TIMESTAMP), 1_700_000_020.0);
    }

    #[test]
    fn rfc3339_times_parse_back() {
        use std::time::{Duration, UNIX_EPOCH};
        for secs in [0u64, 951_782_400, 1_700_000_000, 4_102_444_800 + 86_399] {
            for ms in [0u64, 1, 999] {
                let t = UNIX_EPOCH + Duration::from_millis(secs * 1000 + ms);
                let s = crate::record::rfc3339_utc(t);
                let back = parse_rfc3339_utc(&s).unwrap();
                assert!(
                    (back - (secs as f64 + ms as f64 / 1000.0)).abs() < 1e-6,
                    "{s}"
                );
            }
        }
        for bad in [
            "",
            "2023-11-14 22:13:20Z",
            "2023-13-14T22:13:20Z",
            "2023-11-14T22:13:20",
            "2023-11-14T22:13:20.Z",
            "2023-11-14T22:13:20.1234567890Z",
            "２023-11-14T22:13:20Z",
        ] {
            assert_eq!(parse_rfc3339_utc(bad), None, "{bad}");
        }
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
