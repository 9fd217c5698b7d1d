//! ICR, the Invariant Contamination Ratio (docs/design.md §2): two noisy augmented views of each of
//! `n` training images, the model's pooled features of both, streaming float64 moments of their
//! mean `t` and difference `u`, then `Σ_ξ = ½ Cov(u)`, `Σ_s = Cov(t) − ¼ Cov(u)`, a relative ridge
//! on `Σ_ξ`, and the generalized eigenvalues `λ` of `Σ_s v = λ Σ_ξ v`:
//! `ICR = 1 / (1 + mean λ)`.

use crate::config::{AugmentConfig, IcrConfig};
use crate::model::{Model, ModelError};
use tch::{Device, Kind, Tensor};

#[derive(Debug, thiserror::Error)]
pub enum IcrError {
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error("{0}")]
    Numeric(String),
}

/// The result of one ICR computation.
#[derive(Debug, Clone, PartialEq)]
pub struct IcrResult {
    pub icr: f64,
    /// Tr(Σ_s), before the ridge.
    pub invariant_trace: f64,
    /// Tr(Σ_ξ), before the ridge.
    pub residual_trace: f64,
    /// The same two traces on l2-normalized features.
    pub invariant_trace_normalized: f64,
    pub residual_trace_normalized: f64,
    /// Generalized eigenvalues, ascending.
    pub eigenvalues: Vec<f64>,
    pub samples: usize,
    pub dim: usize,
}

/// Streaming float64 moments of `t = (h1+h2)/2` and `u = h1 − h2` (full second moments), and of
/// their l2-normalized counterparts (diagonal only: the traces need nothing more). Moments are
/// taken about a shift (the first batch's mean) to keep the covariance free of cancellation.
pub struct Moments {
    n: usize,
    shift_t: Option<Tensor>,
    sum_t: Tensor,
    sum_u: Tensor,
    sq_t: Tensor,
    sq_u: Tensor,
    norm: [Tensor; 4],
}

impl Moments {
    pub fn new(dim: usize, device: Device) -> Moments {
        let z1 = || Tensor::zeros([dim as i64], (Kind::Double, device));
        let z2 = || Tensor::zeros([dim as i64, dim as i64], (Kind::Double, device));
        Moments {
            n: 0,
            shift_t: None,
            sum_t: z1(),
            sum_u: z1(),
            sq_t: z2(),
            sq_u: z2(),
            norm: [z1(), z1(), z1(), z1()],
        }
    }

    /// Adds a batch of feature pairs `h1, h2: [B,d]`.
    pub fn add(&mut self, h1: &Tensor, h2: &Tensor) {
        let h1 = h1.to_kind(Kind::Double);
        let h2 = h2.to_kind(Kind::Double);
        let t = (&h1 + &h2) * 0.5;
        let u = &h1 - &h2;
        let shift = self
            .shift_t
            .get_or_insert_with(|| t.mean_dim(0, false, Kind::Double));
        let tc = &t - &*shift;
        self.sum_t += tc.sum_dim_intlist(0, false, Kind::Double);
        self.sum_u += u.sum_dim_intlist(0, false, Kind::Double);
        self.sq_t += tc.transpose(0, 1).matmul(&tc);
        self.sq_u += u.transpose(0, 1).matmul(&u);
        let unit = |h: &Tensor| h / h.norm_scalaropt_dim(2.0, [1], true).clamp_min(1e-12);
        let (n1, n2) = (unit(&h1), unit(&h2));
        let tn = (&n1 + &n2) * 0.5;
        let un = &n1 - &n2;
        self.norm[0] += tn.sum_dim_intlist(0, false, Kind::Double);
        self.norm[1] += tn.square().sum_dim_intlist(0, false, Kind::Double);
        self.norm[2] += un.sum_dim_intlist(0, false, Kind::Double);
        self.norm[3] += un.square().sum_dim_intlist(0, false, Kind::Double);
        self.n += h1.size()[0] as usize;
    }

    /// Σ_ξ, Σ_s, the traces and the generalized eigenvalues, with a ridge of
    /// `ridge · Tr(Σ_ξ)/d` on Σ_ξ. `what` names the source (checkpoint) in errors.
    pub fn finish(&self, ridge: f64, what: &str) -> Result<IcrResult, IcrError> {
        let n = self.n as f64;
        if self.n < 2 {
            return Err(IcrError::Numeric(format!(
                "{what}: ICR needs at least 2 view pairs, got {}",
                self.n
            )));
        }
        let cov = |sum: &Tensor, sq: &Tensor| {
            let mean = sum / n;
            (sq - mean.outer(&mean) * n) / (n - 1.0)
        };
        let cov_t = cov(&self.sum_t, &self.sq_t);
        let cov_u = cov(&self.sum_u, &self.sq_u);
        let sigma_xi = &cov_u * 0.5;
        let sigma_s = &cov_t - &cov_u * 0.25;
        let finite = |t: &Tensor| t.isfinite().all().int64_value(&[]) == 1;
        if !finite(&sigma_xi) || !finite(&sigma_s) {
            return Err(IcrError::Numeric(format!(
                "{what}: the feature covariance has NaN or Inf entries (the model's features are not finite)"
            )));
        }
        let d = sigma_xi.size()[0];
        let residual_trace = sigma_xi.trace().double_value(&[]);
        let invariant_trace = sigma_s.trace().double_value(&[]);
        let var_trace = |sum: &Tensor, sq: &Tensor| {
            ((sq - sum.square() / n) / (n - 1.0))
                .sum(Kind::Double)
                .double_value(&[])
        };
        let cov_tn = var_trace(&self.norm[0], &self.norm[1]);
        let cov_un = var_trace(&self.norm[2], &self.norm[3]);

        let tau = ridge * residual_trace / d as f64;
        let eye = Tensor::eye(d, (Kind::Double, sigma_xi.device()));
        let regularized = &sigma_xi + eye * tau;
        let chol = regularized.f_linalg_cholesky(false).map_err(|e| {
            IcrError::Numeric(format!(
                "{what}: the residual covariance Σ_ξ is not positive definite even with the ridge \
                 (τ = {tau:e}); are the two views identical, or the features constant? ({e})"
            ))
        })?;
        // A = L⁻¹ Σ_s L⁻ᵀ has the generalized eigenvalues of (Σ_s, Σ_ξ).
        let left = chol
            .f_linalg_solve_triangular(&sigma_s, false, true, false)
            .map_err(|e| IcrError::Numeric(format!("{what}: whitening failed: {e}")))?;
        let a = chol
            .f_linalg_solve_triangular(&left.transpose(0, 1), false, true, false)
            .map_err(|e| IcrError::Numeric(format!("{what}: whitening failed: {e}")))?;
        let a = (&a + a.transpose(0, 1)) * 0.5;
        let lambda = a
            .f_linalg_eigvalsh("L")
            .map_err(|e| IcrError::Numeric(format!("{what}: eigen-decomposition failed: {e}")))?;
        let eigenvalues: Vec<f64> = Vec::<f64>::try_from(lambda.to_device(Device::Cpu))
            .map_err(|e| IcrError::Numeric(format!("{what}: {e}")))?;
        let mean = eigenvalues.iter().sum::<f64>() / eigenvalues.len() as f64;
        let icr = 1.0 / (1.0 + mean);
        if !icr.is_finite() {
            return Err(IcrError::Numeric(format!(
                "{what}: ICR is not finite (mean eigenvalue {mean})"
            )));
        }
        Ok(IcrResult {
            icr,
            invariant_trace,
            residual_trace,
            invariant_trace_normalized: cov_tn - 0.25 * cov_un,
            residual_trace_normalized: 0.5 * cov_un,
            eigenvalues,
            samples: self.n,
            dim: d as usize,
        })
    }
}

/// ICR of precomputed feature pairs `h1, h2: [n,d]` (the `icr-features` command).
pub fn icr_of_features(
    h1: &Tensor,
    h2: &Tensor,
    ridge: f64,
    what: &str,
) -> Result<IcrResult, IcrError> {
    let mut m = Moments::new(h1.size()[1] as usize, h1.device());
    m.add(h1, h2);
    m.finish(ridge, what)
}

/// The two-view probe: a fixed subset of training images (on the model's device) and the
/// augmentation settings; views and noise are drawn from `seed` afresh for every computation,
/// so every checkpoint sees the very same views.
pub struct ViewProbe {
    images: Tensor,
    samples: usize,
    seed: u64,
    batch_pairs: usize,
    augment: AugmentConfig,
}

impl ViewProbe {
    /// `images`: the fixed subset `[m,C,H,W]`; pair `i` uses image `i mod m`.
    pub fn new(images: Tensor, config: &IcrConfig) -> ViewProbe {
        ViewProbe {
            images,
            samples: config.samples,
            seed: config.seed,
            batch_pairs: (config.batch_size / 2).max(1),
            augment: config.augment.clone(),
        }
    }

    /// ICR of `model` at noise level `sigma`.
    pub fn run(
        &self,
        model: &Model,
        sigma: f64,
        ridge: f64,
        what: &str,
    ) -> Result<IcrResult, IcrError> {
        let device = model.device();
        tch::manual_seed(self.seed as i64);
        let m = self.images.size()[0];
        let mut moments: Option<Moments> = None;
        let mut done = 0usize;
        while done < self.samples {
            let b = self.batch_pairs.min(self.samples - done) as i64;
            let idx = (Tensor::arange_start(done as i64, done as i64 + b, (Kind::Int64, device)))
                .remainder(m);
            let x0 = self.images.index_select(0, &idx);
            let v1 = augment(&x0, &self.augment) + Tensor::randn_like(&x0) * sigma;
            let v2 = augment(&x0, &self.augment) + Tensor::randn_like(&x0) * sigma;
            let x = Tensor::cat(&[v1, v2], 0);
            let s = Tensor::full([2 * b], sigma, (Kind::Float, device));
            let (_, features) = model.forward(&x, &s)?;
            let h = pool(&features);
            let moments = moments.get_or_insert_with(|| Moments::new(h.size()[1] as usize, device));
            moments.add(&h.narrow(0, 0, b), &h.narrow(0, b, b));
            done += b as usize;
        }
        moments
            .expect("at least one batch (icr.samples ≥ 2)")
            .finish(ridge, what)
    }
}

/// Mean-pools a `[B,C,H,W]` feature map over `H,W`; a `[B,d]` output is used as is.
pub fn pool(features: &Tensor) -> Tensor {
    if features.dim() == 4 {
        features.mean_dim([2, 3].as_slice(), false, Kind::Float)
    } else {
        features.shallow_clone()
    }
}

/// Random augmentation of each image of `x: [B,C,H,W]` in [-1, 1] (docs/design.md §2): crop with
/// reflect padding, horizontal flip with p = 0.5, then brightness, contrast and saturation
/// jitter (in that order) in [0, 1] colour space.
pub fn augment(x: &Tensor, a: &AugmentConfig) -> Tensor {
    let (b, c, h, w) = x.size4().expect("images are [B,C,H,W]");
    let device = x.device();
    let mut y = x.shallow_clone();
    let pad = (a.crop * h.min(w) as f64).round() as i64;
    if pad > 0 {
        let padded = y.pad([pad, pad, pad, pad], "reflect", None);
        // Per-image offsets in [0, 2·pad]; gather rows then columns.
        let oy = Tensor::randint_low(0, 2 * pad + 1, [b, 1], (Kind::Int64, device));
        let ox = Tensor::randint_low(0, 2 * pad + 1, [b, 1], (Kind::Int64, device));
        let rows = (oy + Tensor::arange(h, (Kind::Int64, device)).unsqueeze(0))
            .view([b, 1, h, 1])
            .expand([b, c, h, w + 2 * pad], false);
        let cols = (ox + Tensor::arange(w, (Kind::Int64, device)).unsqueeze(0))
            .view([b, 1, 1, w])
            .expand([b, c, h, w], false);
        y = padded.gather(2, &rows, false).gather(3, &cols, false);
    }
    if a.flip {
        let flip = Tensor::rand([b, 1, 1, 1], (Kind::Float, device)).lt(0.5);
        y = y.flip([3]).where_self(&flip, &y);
    }
    if a.jitter > 0.0 {
        let s = a.jitter;
        let factor = || Tensor::rand([b, 1, 1, 1], (Kind::Float, device)) * (2.0 * s) + (1.0 - s);
        let mut z = (y + 1.0) * 0.5;
        z = (z * factor()).clamp(0.0, 1.0);
        let gray = |z: &Tensor| {
            if c == 3 {
                let wts = Tensor::from_slice(&[0.299f32, 0.587, 0.114])
                    .to_device(device)
                    .view([1, 3, 1, 1]);
                (z * wts).sum_dim_intlist(1, true, Kind::Float)
            } else {
                z.mean_dim(1, true, Kind::Float)
            }
        };
        let mean = gray(&z).mean_dim([1, 2, 3].as_slice(), true, Kind::Float);
        z = ((&z - &mean) * factor() + &mean).clamp(0.0, 1.0);
        if c == 3 {
            let g = gray(&z);
            z = ((&z - &g) * factor() + &g).clamp(0.0, 1.0);
        }
        y = z * 2.0 - 1.0;
    }
    y
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Mutex, MutexGuard};

    /// libtorch's generator is process-wide: tests that seed it take turns.
    fn rng() -> MutexGuard<'static, ()> {
        static LOCK: Mutex<()> = Mutex::new(());
        LOCK.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// h_k = s + ξ_k with s ~ N(0, diag(a)) shared by both views and ξ_k ~ N(0, diag(b))
    /// independent per view: Cov(u) = 2·diag(b), so Σ_ξ = diag(b); Cov(t) = diag(a) + ½diag(b),
    /// so Σ_s = diag(a). Hence λ = a/b and ICR = 1/(1 + mean(a/b)) exactly in the limit.
    #[test]
    fn icr_matches_closed_form_on_synthetic_features() {
        let _rng = rng();
        tch::manual_seed(7);
        let n = 200_000;
        let a = Tensor::from_slice(&[4.0f64, 1.0, 0.25, 2.0]);
        let b = Tensor::from_slice(&[1.0f64, 0.5, 1.0, 2.0]);
        let s = Tensor::randn([n, 4], (Kind::Double, Device::Cpu)) * a.sqrt();
        let h1 = &s + Tensor::randn([n, 4], (Kind::Double, Device::Cpu)) * b.sqrt();
        let h2 = &s + Tensor::randn([n, 4], (Kind::Double, Device::Cpu)) * b.sqrt();
        let r = icr_of_features(&h1, &h2, 0.0, "synthetic").unwrap();
        let expected = 1.0 / (1.0 + (4.0 + 2.0 + 0.25 + 1.0) / 4.0);
        // Each eigenvalue is a ratio of variance estimates with relative standard error about
        // sqrt(2/n)·(1+λ) ≈ 0.016 at n = 2e5; 0.5% on ICR is > 3 standard errors of the mean.
        assert!(
            (r.icr - expected).abs() / expected < 5e-3,
            "{} vs {expected}",
            r.icr
        );
        assert!(
            (r.invariant_trace - 7.25).abs() / 7.25 < 2e-2,
            "{}",
            r.invariant_trace
        );
        assert!(
            (r.residual_trace - 4.5).abs() / 4.5 < 2e-2,
            "{}",
            r.residual_trace
        );
        assert_eq!(r.eigenvalues.len(), 4);
    }

    /// Shared signal plus independent noise per view: Σ_s ⪰ 0 (checked on the estimate itself
    /// through its generalized eigenvalues), so every λ ≥ 0 and ICR lies in (0, 1].
    #[test]
    fn icr_lies_in_zero_one_when_the_invariant_covariance_is_psd() {
        let _rng = rng();
        for seed in 0..5 {
            tch::manual_seed(seed);
            let (n, d) = (4000, 6);
            let mix = Tensor::randn([d, d], (Kind::Double, Device::Cpu));
            let s = Tensor::randn([n, d], (Kind::Double, Device::Cpu)).mm(&mix) * 3.0;
            let h1 = &s + Tensor::randn([n, d], (Kind::Double, Device::Cpu));
            let h2 = &s + Tensor::randn([n, d], (Kind::Double, Device::Cpu));
            let r = icr_of_features(&h1, &h2, 1e-4, "psd").unwrap();
            assert!(
                r.eigenvalues.iter().all(|&l| l >= 0.0),
                "{:?}",
                r.eigenvalues
            );
            assert!(r.icr > 0.0 && r.icr <= 1.0, "{}", r.icr);
        }
    }

    /// ICR is a ratio of covariances whitened by Σ_ξ (and the ridge is relative to Tr Σ_ξ), so a
    /// constant scale of the features cancels.
    #[test]
    fn scaling_the_features_leaves_icr_unchanged() {
        let _rng = rng();
        tch::manual_seed(11);
        let s = Tensor::randn([3000, 5], (Kind::Double, Device::Cpu));
        let h1 = &s + Tensor::randn([3000, 5], (Kind::Double, Device::Cpu)) * 0.7;
        let h2 = &s + Tensor::randn([3000, 5], (Kind::Double, Device::Cpu)) * 0.7;
        let base = icr_of_features(&h1, &h2, 1e-4, "base").unwrap().icr;
        for c in [1e-3, 7.5, 1e4] {
            let r = icr_of_features(&(&h1 * c), &(&h2 * c), 1e-4, "scaled").unwrap();
            assert!(
                (r.icr - base).abs() <= 1e-9 * base,
                "c = {c}: {} vs {base}",
                r.icr
            );
        }
    }

    /// Identical views (no augmentation, no noise) leave no residual: Σ_ξ = 0, and the ridge,
    /// relative to Tr Σ_ξ, is 0 too. That is a clear error, never NaN.
    #[test]
    fn identical_views_are_a_clear_error() {
        let _rng = rng();
        tch::manual_seed(2);
        let h = Tensor::randn([500, 4], (Kind::Double, Device::Cpu));
        let e = icr_of_features(&h, &h, 1e-4, "ckpt_000100.pt").unwrap_err();
        let msg = e.to_string();
        assert!(
            msg.contains("ckpt_000100.pt") && msg.contains("identical"),
            "{msg}"
        );
    }

    #[test]
    fn streaming_equals_one_shot() {
        let _rng = rng();
        tch::manual_seed(3);
        let h1 = Tensor::randn([1000, 6], (Kind::Double, Device::Cpu)) + 5.0;
        let h2 = &h1 + Tensor::randn([1000, 6], (Kind::Double, Device::Cpu)) * 0.3;
        let one = icr_of_features(&h1, &h2, 1e-4, "x").unwrap();
        let mut m = Moments::new(6, Device::Cpu);
        for k in 0..10 {
            m.add(&h1.narrow(0, k * 100, 100), &h2.narrow(0, k * 100, 100));
        }
        let streamed = m.finish(1e-4, "x").unwrap();
        assert!((one.icr - streamed.icr).abs() < 1e-12 * one.icr.abs().max(1.0));
        for (x, y) in one.eigenvalues.iter().zip(&streamed.eigenvalues) {
            assert!((x - y).abs() < 1e-9 * x.abs().max(1.0), "{x} {y}");
        }
    }

    #[test]
    fn non_finite_features_are_an_error_naming_the_source() {
        let h1 = Tensor::from_slice(&[1.0f64, f64::NAN, 2.0, 3.0]).view([2, 2]);
        let h2 = Tensor::from_slice(&[1.0f64, 2.0, 2.5, 3.0]).view([2, 2]);
        let err = icr_of_features(&h1, &h2, 1e-4, "ckpt_9.pt")
            .unwrap_err()
            .to_string();
        assert!(err.contains("ckpt_9.pt") && err.contains("NaN"), "{err}");
    }

    #[test]
    fn augment_keeps_shape_and_range_and_is_seeded() {
        let _rng = rng();
        let x = Tensor::rand([5, 3, 8, 8], (Kind::Float, Device::Cpu)) * 2.0 - 1.0;
        let cfg = AugmentConfig::default();
        tch::manual_seed(1);
        let y1 = augment(&x, &cfg);
        tch::manual_seed(1);
        let y2 = augment(&x, &cfg);
        assert_eq!(y1.size(), x.size());
        assert!(y1.abs().max().double_value(&[]) <= 1.0 + 1e-6);
        assert_eq!(y1, y2);
        let off = AugmentConfig {
            crop: 0.0,
            flip: false,
            jitter: 0.0,
        };
        assert_eq!(augment(&x, &off), x);
    }
}
