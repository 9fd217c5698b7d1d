//! The `icr` section (docs/design.md §2): the noise level or sweep of them, the number of view
//! pairs, the ridge, the batch, the two-view augmentations and the bias correction, read as
//! written, with the ranges they are checked against.

use super::validate::{
    MAX_BATCH, MAX_SAMPLES, MAX_SIGMA, Validator, default_batch_size, default_true,
};
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct IcrConfig {
    #[serde(default = "default_true")]
    pub enabled: bool,
    #[serde(default = "default_icr_sigma")]
    pub sigma: f64,
    /// Noise-level sweep: ICR at each of these sigmas (absent: no sweep).
    #[serde(default)]
    pub sigmas: Option<Vec<f64>>,
    #[serde(default = "default_icr_samples")]
    pub samples: usize,
    #[serde(default = "default_ridge")]
    pub ridge: f64,
    #[serde(default)]
    pub seed: u64,
    #[serde(default = "default_batch_size")]
    pub batch_size: usize,
    #[serde(default)]
    pub augment: AugmentConfig,
    /// Correction of ICR's finite-n bias (docs/design.md §2); off by default.
    #[serde(default)]
    pub bias_correction: BiasCorrection,
}

/// `icr.bias_correction`: how ICR's dependence on the number of view pairs is corrected.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum BiasCorrection {
    /// The plain estimate.
    #[default]
    None,
    /// The jackknife's bias correction `G·ICR − (G−1)·mean of the leave-one-group-out ICRs`.
    Jackknife,
}

fn default_icr_sigma() -> f64 {
    0.29
}
fn default_icr_samples() -> usize {
    4096
}
fn default_ridge() -> f64 {
    1e-4
}

impl Default for IcrConfig {
    fn default() -> Self {
        IcrConfig {
            enabled: true,
            sigma: default_icr_sigma(),
            sigmas: None,
            samples: default_icr_samples(),
            ridge: default_ridge(),
            seed: 0,
            batch_size: default_batch_size(),
            augment: AugmentConfig::default(),
            bias_correction: BiasCorrection::None,
        }
    }
}

/// The two-view augmentations of ICR (docs/design.md §2); 0 or false switches one off.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct AugmentConfig {
    /// Random crop with reflect padding of this fraction of the side.
    #[serde(default = "default_crop")]
    pub crop: f64,
    /// Horizontal flip with probability 0.5.
    #[serde(default = "default_true")]
    pub flip: bool,
    /// Brightness, contrast and saturation jitter strength.
    #[serde(default = "default_jitter")]
    pub jitter: f64,
}

fn default_crop() -> f64 {
    0.125
}
fn default_jitter() -> f64 {
    0.4
}

impl Default for AugmentConfig {
    fn default() -> Self {
        AugmentConfig {
            crop: default_crop(),
            flip: true,
            jitter: default_jitter(),
        }
    }
}

/// The `icr` section's ranges (the problems are in `v`).
pub(super) fn check_icr(v: &mut Validator, i: &IcrConfig) {
    v.positive("icr.sigma", i.sigma, MAX_SIGMA);
    if let Some(sigmas) = &i.sigmas {
        v.check(
            !sigmas.is_empty(),
            "icr.sigmas",
            "must list at least one sigma",
        );
        v.check(
            sigmas.len() <= 64,
            "icr.sigmas",
            format!("lists {} sigmas; at most 64", sigmas.len()),
        );
        for (k, s) in sigmas.iter().enumerate() {
            v.positive(&format!("icr.sigmas[{k}]"), *s, MAX_SIGMA);
        }
    }
    v.count("icr.samples", i.samples, 2..=MAX_SAMPLES);
    v.real("icr.ridge", i.ridge, 0.0..=1.0);
    v.count("icr.batch_size", i.batch_size, 1..=MAX_BATCH);
    v.check(
        (0.0..0.5).contains(&i.augment.crop),
        "icr.augment.crop",
        format!("must be in [0, 0.5), got {}", i.augment.crop),
    );
    v.check(
        (0.0..=1.0).contains(&i.augment.jitter),
        "icr.augment.jitter",
        format!("must be in [0, 1], got {}", i.augment.jitter),
    );
}
