//! The `pfd` section (docs/design.md §3 and §4: the PF-ODE samples and the distances computed
//! from them) and the two sections that use its samples, `memorization` (§6) and `tail` (§7):
//! read as written, with the ranges and dependencies they are checked against.

use super::validate::{MAX_BATCH, MAX_SAMPLES, MAX_SIGMA, Validator, default_batch_size, num};
use serde::{Deserialize, Serialize};
use std::fmt;
use std::path::PathBuf;

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct PfdConfig {
    #[serde(default)]
    pub enabled: bool,
    /// Teacher TorchScript (same contract as the model); E_gen is computed only with one.
    #[serde(default)]
    pub teacher: Option<PathBuf>,
    #[serde(default = "default_pfd_samples")]
    pub samples: usize,
    #[serde(default = "default_steps")]
    pub steps: usize,
    #[serde(default = "default_sigma_min")]
    pub sigma_min: f64,
    #[serde(default = "default_sigma_max")]
    pub sigma_max: f64,
    #[serde(default = "default_rho")]
    pub rho: f64,
    /// Image descriptor Ψ: a TorchScript `[B,C,H,W] → [B,k]`; absent: identity (pixels).
    #[serde(default)]
    pub descriptor: Option<PathBuf>,
    #[serde(default)]
    pub seed: u64,
    /// HDF5 file whose `/latents` `[M,C,H,W]` are used instead of seeded ones.
    #[serde(default)]
    pub latents: Option<PathBuf>,
    /// Evaluate the PF-ODE metrics every k-th checkpoint.
    #[serde(default = "default_every")]
    pub every: usize,
    #[serde(default = "default_batch_size")]
    pub batch_size: usize,
}

fn default_pfd_samples() -> usize {
    10_000
}
fn default_steps() -> usize {
    18
}
fn default_sigma_min() -> f64 {
    0.002
}
fn default_sigma_max() -> f64 {
    80.0
}
fn default_rho() -> f64 {
    7.0
}
fn default_every() -> usize {
    1
}

impl Default for PfdConfig {
    fn default() -> Self {
        PfdConfig {
            enabled: false,
            teacher: None,
            samples: default_pfd_samples(),
            steps: default_steps(),
            sigma_min: default_sigma_min(),
            sigma_max: default_sigma_max(),
            rho: default_rho(),
            descriptor: None,
            seed: 0,
            latents: None,
            every: default_every(),
            batch_size: default_batch_size(),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum MemorizationCriterion {
    /// Nearest / second-nearest training image distance ratio below the threshold.
    NnRatio,
    /// Best cosine similarity in the descriptor space above the threshold.
    Cosine,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct MemorizationConfig {
    #[serde(default)]
    pub enabled: bool,
    #[serde(default = "default_criterion")]
    pub criterion: MemorizationCriterion,
    /// Default: 1/3 for `nn_ratio`, 0.6 for `cosine`.
    #[serde(default)]
    pub threshold: Option<f64>,
}

fn default_criterion() -> MemorizationCriterion {
    MemorizationCriterion::NnRatio
}

impl Default for MemorizationConfig {
    fn default() -> Self {
        MemorizationConfig {
            enabled: false,
            criterion: default_criterion(),
            threshold: None,
        }
    }
}

impl MemorizationConfig {
    pub fn threshold(&self) -> f64 {
        self.threshold.unwrap_or(match self.criterion {
            MemorizationCriterion::NnRatio => 1.0 / 3.0,
            MemorizationCriterion::Cosine => 0.6,
        })
    }
}

/// A scalar observable of a sample (docs/design.md §7).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Observable {
    Max,
    Min,
    Mean,
    Sum,
    Quantile(f64),
}

impl std::str::FromStr for Observable {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "max" => Ok(Observable::Max),
            "min" => Ok(Observable::Min),
            "mean" => Ok(Observable::Mean),
            "sum" => Ok(Observable::Sum),
            _ => match s.strip_prefix("quantile:").map(str::parse::<f64>) {
                Some(Ok(q)) if (0.0..=1.0).contains(&q) => Ok(Observable::Quantile(q)),
                _ => Err(format!(
                    "must be max, min, mean, sum or quantile:q with q in [0, 1], got `{s}`"
                )),
            },
        }
    }
}

impl fmt::Display for Observable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Observable::Max => write!(f, "max"),
            Observable::Min => write!(f, "min"),
            Observable::Mean => write!(f, "mean"),
            Observable::Sum => write!(f, "sum"),
            Observable::Quantile(q) => write!(f, "quantile:{q}"),
        }
    }
}

impl<'de> Deserialize<'de> for Observable {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

impl Serialize for Observable {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum TailReference {
    /// The teacher's samples from the same latents.
    Teacher,
    /// The training images.
    Training,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct TailConfig {
    #[serde(default)]
    pub enabled: bool,
    #[serde(default = "default_observable")]
    pub observable: Observable,
    #[serde(default = "default_eta")]
    pub eta: f64,
    #[serde(default = "default_tail_reference")]
    pub reference: TailReference,
    /// Affine map to physical units applied to the observable: `scale · o + offset`.
    #[serde(default = "default_scale")]
    pub scale: f64,
    #[serde(default)]
    pub offset: f64,
}

fn default_observable() -> Observable {
    Observable::Max
}
fn default_eta() -> f64 {
    0.975
}
fn default_tail_reference() -> TailReference {
    TailReference::Teacher
}
fn default_scale() -> f64 {
    1.0
}

impl Default for TailConfig {
    fn default() -> Self {
        TailConfig {
            enabled: false,
            observable: default_observable(),
            eta: default_eta(),
            reference: default_tail_reference(),
            scale: default_scale(),
            offset: 0.0,
        }
    }
}

/// The `pfd` section's ranges and files (the problems are in `v`).
pub(super) fn check_pfd(v: &mut Validator, p: &PfdConfig) {
    v.count("pfd.samples", p.samples, 1..=MAX_SAMPLES);
    v.count("pfd.steps", p.steps, 2..=1000);
    v.positive("pfd.sigma_min", p.sigma_min, MAX_SIGMA);
    v.positive("pfd.sigma_max", p.sigma_max, MAX_SIGMA);
    v.check(
        p.sigma_max > p.sigma_min || !(p.sigma_max.is_finite() && p.sigma_min.is_finite()),
        "pfd.sigma_max",
        format!(
            "must be greater than pfd.sigma_min ({}), got {}",
            p.sigma_min, p.sigma_max
        ),
    );
    v.positive("pfd.rho", p.rho, 100.0);
    v.count("pfd.every", p.every, 1..=1_000_000);
    v.count("pfd.batch_size", p.batch_size, 1..=MAX_BATCH);
    for (key, path) in [
        ("pfd.teacher", &p.teacher),
        ("pfd.descriptor", &p.descriptor),
        ("pfd.latents", &p.latents),
    ] {
        if let Some(path) = path {
            v.file(key, path);
        }
    }
}

/// The `memorization` section's threshold and its needs of `pfd` (the problems are in `v`).
pub(super) fn check_memorization(v: &mut Validator, m: &MemorizationConfig, p: &PfdConfig) {
    if m.enabled {
        v.check(
            p.enabled,
            "memorization.enabled",
            "needs pfd.enabled: the ratio is computed from the PFD samples",
        );
        if m.criterion == MemorizationCriterion::Cosine {
            v.check(
                p.descriptor.is_some(),
                "memorization.criterion",
                "`cosine` needs a descriptor model in pfd.descriptor",
            );
        }
    }
    let t = m.threshold();
    v.check(
        t > 0.0 && t <= 1.0,
        "memorization.threshold",
        format!("must be in (0, 1], got {t}"),
    );
}

/// The `tail` section's ranges and its needs of `pfd` (the problems are in `v`).
pub(super) fn check_tail(v: &mut Validator, tl: &TailConfig, p: &PfdConfig) {
    if tl.enabled {
        v.check(
            p.enabled,
            "tail.enabled",
            "needs pfd.enabled: tail metrics use the PFD samples",
        );
        if tl.reference == TailReference::Teacher {
            v.check(
                p.teacher.is_some(),
                "tail.reference",
                "`teacher` needs pfd.teacher (or use `training`)",
            );
        }
    }
    v.check(
        tl.eta > 0.0 && tl.eta < 1.0,
        "tail.eta",
        format!("must be in (0, 1), got {}", tl.eta),
    );
    v.check(
        tl.scale != 0.0 && tl.scale.is_finite(),
        "tail.scale",
        format!("must be a finite, non-zero number, got {}", num(tl.scale)),
    );
    v.real("tail.offset", tl.offset, f64::MIN..=f64::MAX);
}
