//! The evaluation record (docs/design.md §13): one JSON line per checkpoint from `diffmon eval
//! --json`, one history row in the daemon. A metric that is disabled is absent, not zero.

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
    pub seconds: f64,
    /// Seconds per stage (`load`, `icr`, `loss`), for the duration histogram; not serialized.
    #[serde(skip)]
    pub stages: Vec<(&'static str, f64)>,
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

/// Why a checkpoint could not be evaluated (docs/design.md §16): the journal's `reason` and the
/// `reason` label of `diffmon_checkpoint_failures_total`. [`FailureReason::as_str`] is the one
/// spelling of each; other tools read these strings, so they never change.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FailureReason {
    /// The weights cannot be read or loaded into the architecture.
    Unreadable,
    /// The weights do not fit the architecture (names, shapes).
    Mismatch,
    /// A metric came out NaN or infinite.
    NonFinite,
    /// The checkpoint was deleted or rewritten while it was evaluated.
    Vanished,
    /// Anything else.
    Error,
    /// The process died (a fatal signal) while evaluating it; recorded after the restart.
    Crashed,
}

impl FailureReason {
    /// Every reason, in the order the metric's series are created (each at 0).
    pub const ALL: [FailureReason; 6] = [
        FailureReason::Unreadable,
        FailureReason::Mismatch,
        FailureReason::NonFinite,
        FailureReason::Vanished,
        FailureReason::Error,
        FailureReason::Crashed,
    ];

    /// The journal's `reason` and the metric's label value.
    pub const fn as_str(self) -> &'static str {
        match self {
            FailureReason::Unreadable => "unreadable",
            FailureReason::Mismatch => "mismatch",
            FailureReason::NonFinite => "non_finite",
            FailureReason::Vanished => "vanished",
            FailureReason::Error => "error",
            FailureReason::Crashed => "crashed",
        }
    }
}

impl std::fmt::Display for FailureReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
                "error",
                "crashed"
            ]
        );
        assert_eq!(FailureReason::NonFinite.to_string(), "non_finite");
    }
}
