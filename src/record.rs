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
}
