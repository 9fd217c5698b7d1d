//! The evaluation record (docs/design.md §13): one JSON line per checkpoint from `diffmon eval
//! --json`, one history row in the daemon. A metric that is disabled is absent, not zero.
//!
//! [`FIELDS`] is the one table of the record's scalar metric fields: each one's name (its JSON
//! key and HDF5 column), how it is read from a record, its Prometheus gauge, its columns in the
//! one-line summaries and the report's table, and its series in the report's plots. The HDF5
//! history, the metrics, both summary lines and the report iterate it: adding a metric to the
//! record is one field of [`Evaluation`] and one entry here.

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Evaluation {
    pub step: i64,
    pub checkpoint: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub icr: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub icr_invariant_trace: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub icr_residual_trace: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub icr_eigenvalues: Option<Vec<f64>>,
    /// Tr(Σ_s) and Tr(Σ_ξ) of l2-normalized features.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub icr_invariant_trace_normalized: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub icr_residual_trace_normalized: Option<f64>,
    /// Standard error of `icr` (delete-group jackknife over the view pairs, docs/design.md §2).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub icr_stderr: Option<f64>,
    /// The number of view pairs `icr` was computed from (`icr.samples`; images repeat when the
    /// data has fewer): ICR depends on it, so compare curves only at equal `icr_samples`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub icr_samples: Option<i64>,
    /// ICR at each sigma of `icr.sigmas`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub icr_sweep: Option<Vec<SweepPoint>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pfd_generalization: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pfd_memorization: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub memorization_ratio: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tail_rmsqe: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tail_loader: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub loss_train: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub loss_heldout: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub generalization_gap: Option<f64>,
    /// Standard error of `generalization_gap`: of a difference of two means of per-image losses
    /// over independent images (docs/design.md §8).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub generalization_gap_stderr: Option<f64>,
    /// On CUDA: the seconds of the network's forward passes, each synchronized at both ends (the
    /// pauses of `evaluation.gpu_share` are not in them).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gpu_seconds: Option<f64>,
    /// On CUDA: the most bytes PyTorch's caching allocator reserved on the GPU during the
    /// evaluation (the CUDA context not included).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gpu_memory_peak_bytes: Option<i64>,
    pub seconds: f64,
    /// Seconds per stage (`load`, `icr`, `loss`), for the duration histogram; not serialized.
    #[serde(skip)]
    pub stages: Vec<(&'static str, f64)>,
    /// The parameterization check, when this evaluation ran it
    /// (`crate::engine::model::consistency`); not serialized.
    #[serde(skip)]
    pub parameterization: ParameterizationCheck,
}

/// What the parameterization check said of a checkpoint's weights.
#[derive(Debug, Clone, Default, PartialEq)]
pub enum ParameterizationCheck {
    /// Not run on this checkpoint (it passed on an earlier one).
    #[default]
    NotRun,
    /// The warning, with its remedy.
    Warned(String),
    Passed,
}

/// ICR at one noise level of the sweep.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct SweepPoint {
    pub sigma: f64,
    pub icr: f64,
    /// Standard error of `icr` (the same jackknife as `icr_stderr`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stderr: Option<f64>,
}

label_enum! {
    /// Why a checkpoint could not be evaluated (docs/design.md §16): the journal's `reason` and
    /// the `reason` label of `diffmon_checkpoint_failures_total`. [`FailureReason::as_str`] is
    /// the one spelling of each; other tools read these strings, so they never change.
    /// [`FailureReason::ALL`] is the order the metric's series are created in (each at 0; the
    /// [`slurm_only`](FailureReason::slurm_only) ones only on the Slurm executor).
    pub enum FailureReason {
        /// The weights cannot be read or loaded into the architecture.
        Unreadable => "unreadable",
        /// The weights do not fit the architecture (names, shapes).
        Mismatch => "mismatch",
        /// A metric came out NaN or infinite.
        NonFinite => "non_finite",
        /// The checkpoint was deleted or rewritten while it was evaluated.
        Vanished => "vanished",
        /// The checkpoint was deleted before its turn (the training job's rotation), unpinned.
        Rotated => "rotated",
        /// Anything else.
        Error => "error",
        /// The process died (a fatal signal) while evaluating it; recorded after the restart.
        Crashed => "crashed",
        /// Its Slurm job failed (a non-zero exit of the job script outside `diffmon eval`, a node
        /// failure, out of memory) after every retry.
        JobFailed => "job_failed",
        /// Its Slurm job ran past its time limit, after every retry.
        JobTimeout => "job_timeout",
        /// Its Slurm job was cancelled or preempted, after every retry.
        JobCancelled => "job_cancelled",
        /// Its Slurm job left the queue without a result, after every retry.
        JobLost => "job_lost",
    }
}

impl FailureReason {
    /// A reason only the Slurm executor records (`job_*`): its series exist only on that
    /// executor.
    pub fn slurm_only(self) -> bool {
        matches!(
            self,
            FailureReason::JobFailed
                | FailureReason::JobTimeout
                | FailureReason::JobCancelled
                | FailureReason::JobLost
        )
    }
}

// ------------------------------------------------------------------------------------------------
// The table of fields

/// One scalar metric field of [`Evaluation`]: the row of [`FIELDS`] that says where it goes.
#[derive(Debug)]
pub struct Field {
    /// The JSON key and the HDF5 column: an interface, never changes.
    pub name: &'static str,
    /// How it is read from a record (absent: `None`), and its HDF5 column's type.
    pub get: Get,
    /// Its Prometheus gauge, set by every evaluation that has the field.
    pub gauge: Option<Gauge>,
    /// Its column in the summary lines and the report's table of the last evaluations.
    pub column: Option<Column>,
    /// Its series in one of the report's plots.
    pub series: Option<Series>,
}

/// How a field is read from a record. The variant is its type: an HDF5 float64 column (NaN
/// where absent) or int64 column (-1 where absent).
#[derive(Debug, Clone, Copy)]
pub enum Get {
    Float(fn(&Evaluation) -> Option<f64>),
    Int(fn(&Evaluation) -> Option<i64>),
}

/// A field's value.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Value {
    Float(f64),
    Int(i64),
}

impl Value {
    pub fn as_f64(self) -> f64 {
        match self {
            Value::Float(v) => v,
            Value::Int(v) => v as f64,
        }
    }
}

impl Field {
    /// The field's value in a record; `None` where it was not computed.
    pub fn value(&self, r: &Evaluation) -> Option<Value> {
        match self.get {
            Get::Float(get) => get(r).map(Value::Float),
            Get::Int(get) => get(r).map(Value::Int),
        }
    }

    /// The value as a float (gauges, plots, tables).
    pub fn float(&self, r: &Evaluation) -> Option<f64> {
        self.value(r).map(Value::as_f64)
    }
}

/// A field's Prometheus gauge (docs/design.md §16). Every series also has the label `run`.
#[derive(Debug, Clone, Copy)]
pub struct Gauge {
    /// One of [`gauge_names`]. Fields may share a gauge, told apart by `labels`.
    pub name: &'static str,
    /// The HELP text (the exposition adds the full stop); the same for every field of a gauge.
    pub help: &'static str,
    /// Labels after `run`, e.g. `split="train"`.
    pub labels: &'static [(&'static str, &'static str)],
}

/// A field's column in the one-line summaries and the report's table; `None`: not shown there.
#[derive(Debug, Clone, Copy)]
pub struct Column {
    /// Its place among the columns (ascending), in every line and table.
    pub rank: u8,
    /// `diffmon watch`'s console line: label and format.
    pub watch: Option<(&'static str, Format)>,
    /// `diffmon eval`'s line: the label (the value as `{:.5}`).
    pub eval: Option<&'static str>,
    /// The report's table of the last evaluations: the header (the value as `{:.5}`).
    pub report: Option<&'static str>,
    /// Its standard error, written after the value in `diffmon eval`'s line (`icr 0.81230 ±
    /// 0.00420`) when the record has it.
    pub stderr: Option<fn(&Evaluation) -> Option<f64>>,
}

/// How `diffmon watch`'s line writes a value.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Format {
    /// This many decimals: `0.8123`.
    Fixed(usize),
    /// This many decimals and a sign: `+0.01234`.
    Signed(usize),
    /// A share as a percentage with this many decimals: `3.1%`.
    Percent(usize),
}

impl Format {
    pub fn show(self, v: f64) -> String {
        match self {
            Format::Fixed(p) => format!("{v:.p$}"),
            Format::Signed(p) => format!("{v:+.p$}"),
            Format::Percent(p) => format!("{:.p$}%", 100.0 * v),
        }
    }
}

/// A field's series in the report's plots (`data-series` is the field's name).
#[derive(Debug, Clone, Copy)]
pub struct Series {
    /// The plot it is drawn in: the id of one of the report's plots.
    pub plot: &'static str,
    /// Its legend.
    pub label: &'static str,
    pub color: &'static str,
}

/// The names of the fields' Prometheus gauges (docs/design.md §16). `metrics` re-exports them
/// with its other metric names; they are defined here so that this module depends on nothing.
pub mod gauge_names {
    pub const ICR: &str = "diffmon_icr";
    pub const ICR_INVARIANT_TRACE: &str = "diffmon_icr_invariant_trace";
    pub const ICR_RESIDUAL_TRACE: &str = "diffmon_icr_residual_trace";
    pub const PFD_GENERALIZATION: &str = "diffmon_pfd_generalization";
    pub const PFD_MEMORIZATION: &str = "diffmon_pfd_memorization";
    pub const MEMORIZATION_RATIO: &str = "diffmon_memorization_ratio";
    pub const TAIL_RMSQE: &str = "diffmon_tail_rmsqe";
    pub const TAIL_LOADER: &str = "diffmon_tail_loader";
    pub const DENOISE_LOSS: &str = "diffmon_denoise_loss";
    pub const GENERALIZATION_GAP: &str = "diffmon_generalization_gap";
    pub const ICR_STDERR: &str = "diffmon_icr_stderr";
    pub const GPU_MEMORY_PEAK: &str = "diffmon_gpu_memory_peak_bytes";
}

/// Where `diffmon watch`'s line shows the detector's state (smoothed value, best): after ICR,
/// before the losses.
pub const DETECTOR_RANK: u8 = 15;

const fn field(name: &'static str, get: Get) -> Field {
    Field {
        name,
        get,
        gauge: None,
        column: None,
        series: None,
    }
}

const fn gauge(name: &'static str, help: &'static str) -> Option<Gauge> {
    Some(Gauge {
        name,
        help,
        labels: &[],
    })
}

const DENOISE_LOSS_HELP: &str = "EDM-weighted denoising loss at the ICR noise level";

/// Every scalar metric field of [`Evaluation`], in the HDF5 history's column order (new ones at
/// the end). `step`, `checkpoint` and `seconds`, in every record, have fixed places in every
/// output instead; the vectors (`icr_eigenvalues`, `icr_sweep`) have their own.
pub const FIELDS: [Field; 18] = {
    use Format::{Fixed, Percent, Signed};
    use gauge_names as m;
    [
        Field {
            gauge: gauge(
                m::ICR,
                "Invariant Contamination Ratio of the last checkpoint",
            ),
            column: Some(Column {
                rank: 10,
                watch: Some(("ICR", Fixed(4))),
                eval: Some("icr"),
                // The report's table shows the early-stop metric itself.
                report: None,
                stderr: Some(|r| r.icr_stderr),
            }),
            // The early-stop plot shows the early-stop metric, raw and smoothed.
            ..field("icr", Get::Float(|r| r.icr))
        },
        Field {
            gauge: gauge(
                m::ICR_INVARIANT_TRACE,
                "Tr(Sigma_s): invariant (signal) energy of the features",
            ),
            series: Some(Series {
                plot: "traces",
                label: "invariant",
                color: "#17becf",
            }),
            ..field("icr_invariant_trace", Get::Float(|r| r.icr_invariant_trace))
        },
        Field {
            gauge: gauge(
                m::ICR_RESIDUAL_TRACE,
                "Tr(Sigma_xi): residual (view-dependent) energy of the features",
            ),
            series: Some(Series {
                plot: "traces",
                label: "residual",
                color: "#bcbd22",
            }),
            ..field("icr_residual_trace", Get::Float(|r| r.icr_residual_trace))
        },
        field(
            "icr_invariant_trace_normalized",
            Get::Float(|r| r.icr_invariant_trace_normalized),
        ),
        field(
            "icr_residual_trace_normalized",
            Get::Float(|r| r.icr_residual_trace_normalized),
        ),
        Field {
            gauge: gauge(
                m::PFD_GENERALIZATION,
                "E_gen: probability flow distance to the teacher",
            ),
            column: Some(Column {
                rank: 50,
                watch: Some(("E_gen", Fixed(4))),
                eval: Some("E_gen"),
                report: Some("E_gen"),
                stderr: None,
            }),
            series: Some(Series {
                plot: "pfd",
                label: "E_gen",
                color: "#9467bd",
            }),
            ..field("pfd_generalization", Get::Float(|r| r.pfd_generalization))
        },
        Field {
            gauge: gauge(
                m::PFD_MEMORIZATION,
                "E_mem: probability flow distance to the empirical flow",
            ),
            column: Some(Column {
                rank: 60,
                watch: Some(("E_mem", Fixed(4))),
                eval: Some("E_mem"),
                report: Some("E_mem"),
                stderr: None,
            }),
            series: Some(Series {
                plot: "pfd",
                label: "E_mem",
                color: "#8c564b",
            }),
            ..field("pfd_memorization", Get::Float(|r| r.pfd_memorization))
        },
        Field {
            gauge: gauge(
                m::MEMORIZATION_RATIO,
                "Fraction of generated samples that copy a training image",
            ),
            column: Some(Column {
                rank: 70,
                watch: Some(("memorized", Percent(1))),
                eval: Some("mem"),
                report: Some("memorized"),
                stderr: None,
            }),
            series: Some(Series {
                plot: "memorization",
                label: "memorized",
                color: "#e377c2",
            }),
            ..field("memorization_ratio", Get::Float(|r| r.memorization_ratio))
        },
        Field {
            gauge: gauge(m::TAIL_RMSQE, "Root-mean-square quantile error of the tail"),
            ..field("tail_rmsqe", Get::Float(|r| r.tail_rmsqe))
        },
        Field {
            gauge: gauge(
                m::TAIL_LOADER,
                "LOADER: integrated absolute log-density difference",
            ),
            ..field("tail_loader", Get::Float(|r| r.tail_loader))
        },
        Field {
            gauge: Some(Gauge {
                name: m::DENOISE_LOSS,
                help: DENOISE_LOSS_HELP,
                labels: &[("split", "train")],
            }),
            column: Some(Column {
                rank: 20,
                watch: None,
                eval: Some("loss_train"),
                report: None,
                stderr: None,
            }),
            ..field("loss_train", Get::Float(|r| r.loss_train))
        },
        Field {
            gauge: Some(Gauge {
                name: m::DENOISE_LOSS,
                help: DENOISE_LOSS_HELP,
                labels: &[("split", "heldout")],
            }),
            column: Some(Column {
                rank: 30,
                watch: None,
                eval: Some("loss_heldout"),
                report: None,
                stderr: None,
            }),
            ..field("loss_heldout", Get::Float(|r| r.loss_heldout))
        },
        Field {
            gauge: gauge(
                m::GENERALIZATION_GAP,
                "Held-out minus training denoising loss",
            ),
            column: Some(Column {
                rank: 40,
                watch: Some(("gap", Signed(5))),
                eval: Some("gap"),
                report: Some("gap"),
                stderr: Some(|r| r.generalization_gap_stderr),
            }),
            series: Some(Series {
                plot: "gap",
                label: "gap",
                color: "#7f7f7f",
            }),
            ..field("generalization_gap", Get::Float(|r| r.generalization_gap))
        },
        Field {
            gauge: gauge(
                m::ICR_STDERR,
                "Standard error of the ICR (delete-group jackknife over the view pairs)",
            ),
            ..field("icr_stderr", Get::Float(|r| r.icr_stderr))
        },
        field("icr_samples", Get::Int(|r| r.icr_samples)),
        field(
            "generalization_gap_stderr",
            Get::Float(|r| r.generalization_gap_stderr),
        ),
        // Its total over evaluations is the counter `diffmon_gpu_seconds_total`.
        field("gpu_seconds", Get::Float(|r| r.gpu_seconds)),
        Field {
            gauge: gauge(
                m::GPU_MEMORY_PEAK,
                "Most GPU memory the last evaluation reserved (PyTorch's caching allocator)",
            ),
            ..field(
                "gpu_memory_peak_bytes",
                Get::Int(|r| r.gpu_memory_peak_bytes),
            )
        },
    ]
};

/// The fields that have a column (their index in [`FIELDS`]), in column order.
pub fn columns() -> Vec<(usize, Column)> {
    let mut out: Vec<(usize, Column)> = FIELDS
        .iter()
        .enumerate()
        .filter_map(|(k, f)| f.column.map(|c| (k, c)))
        .collect();
    out.sort_by_key(|(_, c)| c.rank);
    out
}

/// `diffmon watch`'s console line of an evaluation. `detector` (the detector's smoothed value
/// and best, formatted) goes at [`DETECTOR_RANK`].
pub fn watch_line(r: &Evaluation, detector: impl IntoIterator<Item = String>) -> String {
    let mut line = format!("step {:>7}", r.step);
    let mut detector = Some(detector);
    for (k, c) in columns() {
        if c.rank > DETECTOR_RANK {
            for cell in detector.take().into_iter().flatten() {
                line += &format!("  {cell}");
            }
        }
        if let (Some((label, format)), Some(v)) = (c.watch, FIELDS[k].float(r)) {
            line += &format!("  {label} {}", format.show(v));
        }
    }
    for cell in detector.take().into_iter().flatten() {
        line += &format!("  {cell}");
    }
    line + &format!("  {:.1}s", r.seconds)
}

/// `diffmon eval`'s line of an evaluation.
pub fn eval_line(r: &Evaluation) -> String {
    let mut parts = vec![format!("step {:>7}", r.step)];
    for (k, c) in columns() {
        if let (Some(label), Some(v)) = (c.eval, FIELDS[k].float(r)) {
            match c.stderr.and_then(|se| se(r)) {
                Some(se) => parts.push(format!("{label} {v:.5} ± {se:.5}")),
                None => parts.push(format!("{label} {v:.5}")),
            }
        }
    }
    parts.push(format!("{:.2}s", r.seconds));
    parts.push(r.checkpoint.clone());
    parts.join("  ")
}

/// The time format of records, history entries and events (RFC 3339).
/// Formats a time as RFC 3339 in UTC with milliseconds: `2023-11-14T22:13:20.123Z`.
/// Times before 1970 are clamped to the epoch.
pub fn rfc3339_utc(t: std::time::SystemTime) -> String {
    let since = t
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or(std::time::Duration::ZERO);
    let secs = since.as_secs() as i64;
    let millis = since.subsec_millis();
    let days = secs.div_euclid(86_400);
    let rem = secs.rem_euclid(86_400);
    let (y, m, d) = civil_from_days(days);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}.{millis:03}Z",
        rem / 3600,
        (rem % 3600) / 60,
        rem % 60
    )
}

/// Days since 1970-01-01 to a proleptic Gregorian (year, month, day) (H. Hinnant's algorithm).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

/// A record with every field present (a struct literal without `..`: a field added to
/// [`Evaluation`] must be added here, and the tests then ask for it in [`FIELDS`]).
#[cfg(test)]
pub(crate) fn full_record() -> Evaluation {
    Evaluation {
        step: 100,
        checkpoint: "/runs/x/ckpt_100.pt".into(),
        icr: Some(0.8123),
        icr_invariant_trace: Some(12.5),
        icr_residual_trace: Some(3.25),
        icr_eigenvalues: Some(vec![0.1, 0.2]),
        icr_invariant_trace_normalized: Some(0.61),
        icr_residual_trace_normalized: Some(0.17),
        icr_stderr: Some(0.0042),
        icr_samples: Some(256),
        icr_sweep: Some(vec![SweepPoint {
            sigma: 0.5,
            icr: 0.8,
            stderr: Some(0.004),
        }]),
        pfd_generalization: Some(0.0456),
        pfd_memorization: Some(0.0789),
        memorization_ratio: Some(0.031),
        tail_rmsqe: Some(0.21),
        tail_loader: Some(0.33),
        loss_train: Some(0.1111),
        loss_heldout: Some(0.1234),
        generalization_gap: Some(0.0123),
        generalization_gap_stderr: Some(0.0021),
        gpu_seconds: Some(9.5),
        gpu_memory_peak_bytes: Some(5 << 30),
        seconds: 12.34,
        stages: vec![("icr", 1.0)],
        parameterization: ParameterizationCheck::Passed,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rfc3339_matches_python_datetime() {
        // datetime.fromtimestamp(t, timezone.utc).isoformat() for each t.
        let at = |s: u64, ms: u64| {
            std::time::UNIX_EPOCH + std::time::Duration::from_millis(s * 1000 + ms)
        };
        assert_eq!(rfc3339_utc(at(0, 0)), "1970-01-01T00:00:00.000Z");
        assert_eq!(
            rfc3339_utc(at(1_700_000_000, 123)),
            "2023-11-14T22:13:20.123Z"
        );
        assert_eq!(rfc3339_utc(at(951_782_400, 0)), "2000-02-29T00:00:00.000Z");
        assert_eq!(
            rfc3339_utc(at(4_102_444_799, 999)),
            "2099-12-31T23:59:59.999Z"
        );
    }

    /// Keys of the JSON record that are not table fields: in every record, or not scalars.
    const NOT_IN_THE_TABLE: [&str; 5] = [
        "step",
        "checkpoint",
        "seconds",
        "icr_eigenvalues",
        "icr_sweep",
    ];

    /// The table is the record's scalar fields, no more and no less: each entry reads its own
    /// field (the JSON key of its name holds its value), and every other JSON key of a full
    /// record is one of the few outside the table.
    #[test]
    fn the_table_has_every_scalar_field_of_the_json_record() {
        let json = serde_json::to_value(full_record()).unwrap();
        let json = json.as_object().unwrap();
        let mut names = std::collections::BTreeSet::new();
        for f in &FIELDS {
            assert!(names.insert(f.name), "{} twice in the table", f.name);
            let v = f
                .value(&full_record())
                .unwrap_or_else(|| panic!("{} absent", f.name));
            let want = match v {
                Value::Float(v) => serde_json::json!(v),
                Value::Int(v) => serde_json::json!(v),
            };
            assert_eq!(json.get(f.name), Some(&want), "{}", f.name);
        }
        for key in json.keys() {
            assert!(
                names.contains(key.as_str()) || NOT_IN_THE_TABLE.contains(&key.as_str()),
                "the record's field {key} is not in record::FIELDS"
            );
        }
        // Absent stays absent: an empty record has no value in any field.
        for f in &FIELDS {
            assert_eq!(f.value(&Evaluation::default()), None, "{}", f.name);
        }
    }

    /// Fields that share a gauge (the denoising loss) share its help and differ by a label.
    #[test]
    fn fields_sharing_a_gauge_differ_by_their_labels() {
        let gauges: Vec<&Gauge> = FIELDS.iter().filter_map(|f| f.gauge.as_ref()).collect();
        for (i, a) in gauges.iter().enumerate() {
            assert!(a.name.starts_with("diffmon_"), "{}", a.name);
            for b in &gauges[i + 1..] {
                if a.name == b.name {
                    assert_eq!(a.help, b.help, "{}", a.name);
                    assert_ne!(a.labels, b.labels, "{}", a.name);
                }
            }
        }
        let ranks: Vec<u8> = columns().iter().map(|(_, c)| c.rank).collect();
        let mut unique = ranks.clone();
        unique.dedup();
        assert_eq!(ranks, unique, "two columns of the same rank");
        assert!(!ranks.contains(&DETECTOR_RANK));
    }

    /// The console lines of a full record, as they have always been written (`diffmon eval`'s
    /// with the standard errors since they exist).
    #[test]
    fn the_summary_lines_of_a_full_record() {
        let r = full_record();
        let detector = ["smoothed 0.8123".to_string(), "best 0.8123 @ 100".into()];
        assert_eq!(
            watch_line(&r, detector.clone()),
            "step     100  ICR 0.8123  smoothed 0.8123  best 0.8123 @ 100  gap +0.01230  \
             E_gen 0.0456  E_mem 0.0789  memorized 3.1%  12.3s"
        );
        assert_eq!(
            eval_line(&r),
            "step     100  icr 0.81230 ± 0.00420  loss_train 0.11110  loss_heldout 0.12340  \
             gap 0.01230 ± 0.00210  \
             E_gen 0.04560  E_mem 0.07890  mem 0.03100  12.34s  /runs/x/ckpt_100.pt"
        );
        // Absent fields leave no column; the detector's state stays after where ICR would be.
        let r = Evaluation {
            step: 400,
            checkpoint: "c.pt".into(),
            generalization_gap: Some(-0.0177),
            seconds: 1.0,
            ..Evaluation::default()
        };
        assert_eq!(
            watch_line(&r, detector),
            "step     400  smoothed 0.8123  best 0.8123 @ 100  gap -0.01770  1.0s"
        );
        assert_eq!(watch_line(&r, None), "step     400  gap -0.01770  1.0s");
        assert_eq!(eval_line(&r), "step     400  gap -0.01770  1.00s  c.pt");
    }

    /// The strings are an interface (the journal, Prometheus labels): pinned here.
    #[test]
    fn failure_reasons_keep_their_names() {
        let names: Vec<&str> = FailureReason::ALL.iter().map(|r| r.as_str()).collect();
        assert_eq!(
            names,
            [
                "unreadable",
                "mismatch",
                "non_finite",
                "vanished",
                "rotated",
                "error",
                "crashed",
                "job_failed",
                "job_timeout",
                "job_cancelled",
                "job_lost"
            ]
        );
        assert_eq!(FailureReason::NonFinite.to_string(), "non_finite");
    }
}
