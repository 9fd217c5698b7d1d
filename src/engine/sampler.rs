//! The probability-flow ODE sampler (docs/design.md §3): the deterministic Heun sampler of Karras
//! et al. 2022, i.e. NVlabs/edm's `edm_sampler` with `S_churn = 0`. The schedule and the state are
//! float64; each denoiser decides the precision of its own evaluation (the network runs in
//! float32, the empirical denoiser in float64). 2N − 1 denoiser evaluations per sample.
//!
//! Denoisers: a TorchScript model of the contract ([`ModelDenoiser`]) and the empirical denoiser of
//! a training set ([`EmpiricalDenoiser`], docs/design.md §4), which also answers nearest-neighbour
//! queries for the memorization ratio.

use crate::config::PfdConfig;
use crate::engine::model::{Model, ModelError};
use crate::engine::progress::Progress;
use tch::{Device, Kind, Tensor};

#[derive(Debug, thiserror::Error)]
pub enum SamplerError {
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error("{what}: the sampler produced non-finite values")]
    NonFinite { what: String },
}

/// The EDM time discretization.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct Schedule {
    pub steps: usize,
    pub sigma_min: f64,
    pub sigma_max: f64,
    pub rho: f64,
}

impl Schedule {
    pub fn of(pfd: &PfdConfig) -> Schedule {
        Schedule {
            steps: pfd.steps,
            sigma_min: pfd.sigma_min,
            sigma_max: pfd.sigma_max,
            rho: pfd.rho,
        }
    }

    /// `t_0 > t_1 > … > t_{N−1} = σmin`, then `t_N = 0`, in float64.
    pub fn sigmas(&self) -> Vec<f64> {
        let n = self.steps;
        let (a, b) = (
            self.sigma_max.powf(1.0 / self.rho),
            self.sigma_min.powf(1.0 / self.rho),
        );
        let mut t: Vec<f64> = (0..n)
            .map(|i| (a + i as f64 / (n - 1) as f64 * (b - a)).powf(self.rho))
            .collect();
        t.push(0.0);
        t
    }

    /// Denoiser evaluations per sample.
    pub fn evaluations(&self) -> usize {
        2 * self.steps - 1
    }
}

/// `D(x; σ)` on a float64 batch `[B,C,H,W]` on the denoiser's device, returning float64.
pub trait Denoiser {
    fn denoise(&mut self, x: &Tensor, sigma: f64) -> Result<Tensor, SamplerError>;
    fn device(&self) -> Device;
    /// What it is, for messages.
    fn name(&self) -> String;
}

/// A TorchScript model of the contract: called in float32 with `sigma` as a `[B]` tensor.
pub struct ModelDenoiser<'a> {
    model: &'a Model,
    /// Network evaluations made so far (batches, not images).
    pub calls: u64,
}

impl<'a> ModelDenoiser<'a> {
    pub fn new(model: &'a Model) -> Self {
        ModelDenoiser { model, calls: 0 }
    }
}

impl Denoiser for ModelDenoiser<'_> {
    fn denoise(&mut self, x: &Tensor, sigma: f64) -> Result<Tensor, SamplerError> {
        let b = x.size()[0];
        let s = Tensor::full([b], sigma, (Kind::Float, self.model.device()));
        let (d, _) = self.model.forward(&x.to_kind(Kind::Float), &s)?;
        self.calls += 1;
        Ok(d.to_kind(Kind::Double))
    }

    fn device(&self) -> Device {
        self.model.device()
    }

    fn name(&self) -> String {
        self.model.path().display().to_string()
    }
}

/// Integrates one batch of latents `[B,C,H,W]` (any float kind, on the denoiser's device) from
/// `t_0` to 0, returning `Φ(latents)` in float64. `tick` is called after every evaluation.
pub fn integrate(
    denoiser: &mut dyn Denoiser,
    latents: &Tensor,
    schedule: &Schedule,
    tick: &mut dyn FnMut(),
) -> Result<Tensor, SamplerError> {
    let t = schedule.sigmas();
    let n = schedule.steps;
    let mut x = latents.to_kind(Kind::Double) * t[0];
    for i in 0..n {
        let (t_cur, t_next) = (t[i], t[i + 1]);
        let denoised = denoiser.denoise(&x, t_cur)?;
        tick();
        let d = (&x - denoised) / t_cur;
        let x_next = &x + &d * (t_next - t_cur);
        x = if i < n - 1 {
            let denoised = denoiser.denoise(&x_next, t_next)?;
            tick();
            let d_prime = (&x_next - denoised) / t_next;
            &x + (d + d_prime) * (0.5 * (t_next - t_cur))
        } else {
            x_next
        };
    }
    let finite = x.isfinite().all().int64_value(&[]) != 0;
    if !finite {
        return Err(SamplerError::NonFinite {
            what: denoiser.name(),
        });
    }
    Ok(x)
}

/// Integrates all `latents` (`[M,C,H,W]`, any device) in batches of `batch`, handing each
/// result (float64, on the denoiser's device) with its first index to `sink`; the first error
/// (of the sampler or of `sink`) stops it. Progress is reported on `progress` when given.
pub fn integrate_all<E: From<SamplerError>>(
    denoiser: &mut dyn Denoiser,
    latents: &Tensor,
    schedule: &Schedule,
    batch: usize,
    mut progress: Option<&mut Progress>,
    sink: &mut dyn FnMut(i64, Tensor) -> Result<(), E>,
) -> Result<(), E> {
    let m = latents.size()[0];
    let device = denoiser.device();
    let mut start = 0;
    while start < m {
        let len = (batch as i64).min(m - start);
        let z = latents.narrow(0, start, len).to_device(device);
        let mut tick = || {
            if let Some(p) = progress.as_deref_mut() {
                p.advance(1);
            }
        };
        let x = integrate(denoiser, &z, schedule, &mut tick)?;
        sink(start, x)?;
        start += len;
    }
    Ok(())
}

/// Total evaluations of [`integrate_all`], for progress reporting.
pub fn evaluations_for(m: i64, batch: usize, schedule: &Schedule) -> u64 {
    let batches = (m as u64).div_ceil(batch as u64);
    batches * schedule.evaluations() as u64
}

/// The empirical denoiser of a training set `{y_j}` (docs/design.md §4):
/// `D(x; σ) = Σ_j softmax_j(−‖x − y_j‖² / 2σ²) y_j`, with float64 distances from matrix products
/// (`‖x‖² + ‖y‖² − 2x·y`), the max-subtracted (log-sum-exp) form, and the training set taken in
/// chunks whose partial sums are merged, so memory stays bounded for large sets.
pub struct EmpiricalDenoiser {
    /// `[N,D]` on the device: float64 when that fits in [`F64_BYTES`], else float32 (the data's
    /// own precision) with each chunk widened to float64 as it is used.
    images: Tensor,
    /// `‖y_j‖²` in float64, `[N]`.
    norms: Tensor,
    shape: Vec<i64>,
    chunk: i64,
    name: String,
    pub calls: u64,
}

/// Bytes one chunk's float64 matrices may take.
const CHUNK_BYTES: i64 = 64 << 20;
/// Largest training set kept in float64 (widening a chunk at every evaluation costs about as
/// much as its matrix product when the query batch is small).
const F64_BYTES: i64 = 4 << 30;

impl EmpiricalDenoiser {
    /// `images`: `[N,C,H,W]` on the device the flow will run on.
    pub fn new(images: &Tensor, name: &str) -> EmpiricalDenoiser {
        let size = images.size();
        let flat = images.to_kind(Kind::Float).flatten(1, -1).contiguous();
        let norms = flat
            .to_kind(Kind::Double)
            .square()
            .sum_dim_intlist(1, false, Kind::Double);
        let flat = if flat.numel() as i64 * 8 <= F64_BYTES {
            flat.to_kind(Kind::Double)
        } else {
            flat
        };
        EmpiricalDenoiser {
            chunk: (CHUNK_BYTES / 8 / flat.size()[1].max(1)).max(1),
            images: flat,
            norms,
            shape: size[1..].to_vec(),
            name: name.to_string(),
            calls: 0,
        }
    }

    pub fn len(&self) -> i64 {
        self.images.size()[0]
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Overrides the chunk length (rows of the training set per matrix product), for tests.
    pub fn with_chunk(mut self, rows: i64) -> Self {
        self.chunk = rows.max(1);
        self
    }

    /// Rows per chunk for a query batch of `b`: both `[b, rows]` and `[rows, D]` stay bounded.
    fn rows(&self, b: i64) -> i64 {
        let per_row = 8 * b.max(self.images.size()[1]);
        self.chunk.min((CHUNK_BYTES / per_row).max(1))
    }

    /// Squared distances `[B, rows]` between `x` (`[B,D]` f64) and training rows `start..start+len`,
    /// with the chunk's float64 images.
    fn distances(&self, x: &Tensor, x_norms: &Tensor, start: i64, len: i64) -> (Tensor, Tensor) {
        let y = self.images.narrow(0, start, len).to_kind(Kind::Double);
        let d2 = (x_norms.unsqueeze(1) + self.norms.narrow(0, start, len).unsqueeze(0)
            - x.mm(&y.tr()) * 2.0)
            .clamp_min(0.0);
        (d2, y)
    }

    /// Distances to the nearest and second-nearest training images, `([B], [B])`, for float64
    /// queries `[B,C,H,W]` (or `[B,D]`).
    pub fn nearest_two(&self, x: &Tensor) -> (Tensor, Tensor) {
        let b = x.size()[0];
        let x = x.flatten(1, -1).to_kind(Kind::Double);
        let x_norms = x.square().sum_dim_intlist(1, false, Kind::Double);
        let n = self.len();
        let rows = self.rows(b);
        let mut best: Option<Tensor> = None;
        let mut start = 0;
        while start < n {
            let len = rows.min(n - start);
            let (d2, _) = self.distances(&x, &x_norms, start, len);
            let k = len.min(2);
            let (top, _) = d2.topk(k, 1, false, true);
            best = Some(match best {
                None => top,
                Some(b) => {
                    let both = Tensor::cat(&[b, top], 1);
                    let keep = both.size()[1].min(2);
                    both.topk(keep, 1, false, true).0
                }
            });
            start += len;
        }
        let best = best.expect("a non-empty training set").sqrt();
        let d1 = best.select(1, 0);
        let d2 = if best.size()[1] > 1 {
            best.select(1, 1)
        } else {
            Tensor::full([b], f64::INFINITY, (Kind::Double, x.device()))
        };
        (d1, d2)
    }
}

impl Denoiser for EmpiricalDenoiser {
    fn denoise(&mut self, x: &Tensor, sigma: f64) -> Result<Tensor, SamplerError> {
        let b = x.size()[0];
        let xf = x.flatten(1, -1).to_kind(Kind::Double);
        let x_norms = xf.square().sum_dim_intlist(1, false, Kind::Double);
        let opts = (Kind::Double, xf.device());
        let mut max = Tensor::full([b, 1], f64::NEG_INFINITY, opts);
        let mut sum = Tensor::zeros([b, 1], opts);
        let mut acc = Tensor::zeros(xf.size(), opts);
        let n = self.len();
        let rows = self.rows(b);
        let inv = -0.5 / (sigma * sigma);
        let mut start = 0;
        while start < n {
            let len = rows.min(n - start);
            let (d2, y) = self.distances(&xf, &x_norms, start, len);
            let logits = d2 * inv;
            let new_max = max.maximum(&logits.amax(1, true));
            let rescale = (&max - &new_max).exp();
            let w = (logits - &new_max).exp();
            sum = &sum * &rescale + w.sum_dim_intlist(1, true, Kind::Double);
            acc = &acc * &rescale + w.mm(&y);
            max = new_max;
            start += len;
        }
        self.calls += 1;
        let mut shape = vec![b];
        shape.extend_from_slice(&self.shape);
        Ok((acc / sum).view(shape.as_slice()))
    }

    fn device(&self) -> Device {
        self.images.device()
    }

    fn name(&self) -> String {
        format!("empirical flow of {}", self.name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schedule_matches_the_closed_form_endpoints() {
        let s = Schedule {
            steps: 18,
            sigma_min: 0.002,
            sigma_max: 80.0,
            rho: 7.0,
        };
        let t = s.sigmas();
        assert_eq!(t.len(), 19);
        assert!((t[0] - 80.0).abs() < 1e-12);
        assert!((t[17] - 0.002).abs() < 1e-15);
        assert_eq!(t[18], 0.0);
        assert!(t.windows(2).all(|w| w[0] > w[1]));
        assert_eq!(s.evaluations(), 35);
    }

    /// A denoiser that always answers the same image `c`: the ODE dx/dt = (x − c)/t has the
    /// exact solution x(t) = c + (x0 − c)·t/t0, and Heun on a linear-in-t solution is exact.
    struct Constant(Tensor, u64);
    impl Denoiser for Constant {
        fn denoise(&mut self, x: &Tensor, _sigma: f64) -> Result<Tensor, SamplerError> {
            self.1 += 1;
            Ok(self.0.expand_as(x).to_kind(Kind::Double))
        }
        fn device(&self) -> Device {
            Device::Cpu
        }
        fn name(&self) -> String {
            "constant".into()
        }
    }

    #[test]
    fn heun_reaches_a_constant_denoisers_target_with_2n_minus_1_calls() {
        let c = Tensor::from_slice(&[0.25f64, -0.5, 0.75, 0.0]).view([1, 1, 2, 2]);
        let mut den = Constant(c.shallow_clone(), 0);
        tch::manual_seed(3);
        let z = Tensor::randn([3, 1, 2, 2], (Kind::Float, Device::Cpu));
        let s = Schedule {
            steps: 18,
            sigma_min: 0.002,
            sigma_max: 80.0,
            rho: 7.0,
        };
        let x = integrate(&mut den, &z, &s, &mut || {}).unwrap();
        let err = (x - c).abs().max().double_value(&[]);
        assert!(err < 1e-12, "{err}");
        assert_eq!(den.1, 35);
    }

    #[test]
    fn empirical_denoiser_chunks_agree_and_match_a_direct_softmax() {
        tch::manual_seed(5);
        let y = Tensor::rand([37, 2, 3, 3], (Kind::Float, Device::Cpu)) * 2.0 - 1.0;
        let x = Tensor::randn([5, 2, 3, 3], (Kind::Double, Device::Cpu));
        for sigma in [0.002, 0.3, 5.0] {
            // Direct form: distances by subtraction, softmax by libtorch.
            let yd = y.to_kind(Kind::Double).flatten(1, -1);
            let xd = x.flatten(1, -1);
            let d2 = (xd.unsqueeze(1) - yd.unsqueeze(0))
                .square()
                .sum_dim_intlist(2, false, Kind::Double);
            let w = (d2 * (-0.5 / (sigma * sigma))).softmax(1, Kind::Double);
            let want = w.mm(&yd).view([5, 2, 3, 3]);
            for chunk in [1, 4, 37, 1000] {
                let mut den = EmpiricalDenoiser::new(&y, "t").with_chunk(chunk);
                let got = den.denoise(&x, sigma).unwrap();
                let err = (got - &want).abs().max().double_value(&[]);
                assert!(err < 1e-12, "sigma {sigma} chunk {chunk}: {err}");
            }
        }
    }

    #[test]
    fn nearest_two_matches_sorting_all_distances() {
        tch::manual_seed(9);
        let y = Tensor::rand([23, 1, 4, 4], (Kind::Float, Device::Cpu));
        let x = Tensor::rand([6, 1, 4, 4], (Kind::Double, Device::Cpu));
        let yd = y.to_kind(Kind::Double).flatten(1, -1);
        let d = (x.flatten(1, -1).unsqueeze(1) - yd.unsqueeze(0))
            .square()
            .sum_dim_intlist(2, false, Kind::Double)
            .sqrt();
        let (sorted, _) = d.sort(1, false);
        for chunk in [1, 3, 23] {
            let den = EmpiricalDenoiser::new(&y, "t").with_chunk(chunk);
            let (d1, d2) = den.nearest_two(&x);
            let e1 = (d1 - sorted.select(1, 0)).abs().max().double_value(&[]);
            let e2 = (d2 - sorted.select(1, 1)).abs().max().double_value(&[]);
            assert!(e1 < 1e-9 && e2 < 1e-9, "chunk {chunk}: {e1} {e2}");
        }
    }
}
