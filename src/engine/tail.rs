//! Tail metrics of the Physically Interpretable Tail Evaluation (PITE; docs/design.md §7 and the
//! PITE blog post of 2024, which takes RMSQE and LOADER from the rare-event literature, its
//! references 10 and 9): two sets of
//! images — the student's samples and a reference (teacher samples or training data) — are each
//! reduced to one scalar *observable* per image, and the two one-dimensional samples of
//! observables are compared where rare, extreme events live.
//!
//! - **Observable** ([`observables`]): `o(x) = scale · g(x) + offset`, where `g` is the `max`,
//!   `min`, `mean`, `sum` or `quantile:q` of all the pixels of the image (the quantile with
//!   numpy's default linear interpolation, as below).
//! - **RMSQE** ([`rmsqe`]): `sqrt( (1/(1−η)) ∫_η^1 (F_p⁻¹(u) − F_q⁻¹(u))² du )`, η = 0.975 by
//!   default. `F⁻¹` is the empirical quantile function with linear interpolation, numpy's default
//!   method: the value at position `u·(n−1)` of the sorted sample, interpolated linearly between
//!   its two neighbours. The integral is taken by the midpoint rule on 1024 equal sub-intervals
//!   of `[η, 1]`, so RMSQE is the root mean square of the quantile differences at
//!   `u_k = η + (k + ½)(1 − η)/1024`, `k = 0..1024`. The seed writes the bare integral; the
//!   root-mean form reported here is in the observable's own (physical) units.
//! - **LOADER** ([`loader`]): `∫_a^b |log p(x) − log q(x)| dx`, with `p`, `q` Gaussian kernel
//!   density estimates of the two sets. Each uses Scott's bandwidth `h = σ · n^(−1/5)` with `σ`
//!   the sample standard deviation with `ddof = 1` — what `scipy.stats.gaussian_kde` uses. Both
//!   are *linearly binned* onto one grid of 2048 equally spaced points over `[a, b]`, `a` = the
//!   smallest observable of both sets − 3·h_max and `b` = the largest + 3·h_max (`h_max` the
//!   larger bandwidth): each observable splits its unit weight between its two neighbouring grid
//!   points in proportion to its distance from them, and the bin weights are convolved with the
//!   Gaussian kernel sampled at the grid offsets, `p(x_g) = Σ_j w_j N(x_g − x_j; h) / n`. The
//!   convolution is done directly (2048 × 2048 multiply-adds, a few milliseconds) rather than by
//!   an FFT: it is the same linear-binned estimate, without the FFT's
//!   round-off. The sampled kernel is normalized so that its samples sum to `1/Δ` (Δ the grid
//!   spacing), which keeps each density's integral at 1 even if a bandwidth were narrower than
//!   the grid spacing; whenever `h` spans a few grid spacings or more this equals the analytic
//!   Gaussian normalization to machine precision. (Δ is at most `h_max / 341`; only a set far
//!   narrower than the other's spread has a bandwidth near Δ, and then the binning limits the
//!   estimate: LOADER moved by about 1% against an exact KDE for a 300× narrower set.) Each
//!   density is floored at `1e-6 ×` its own peak on the grid before the log, so that a region
//!   where one set has no mass contributes a bounded amount. The integral is taken by
//!   Gauss–Legendre quadrature, 32 equal panels over `[a, b]` with 16 nodes each, the densities
//!   interpolated linearly from the grid at the nodes.
//!
//! Degenerate sets are errors ([`TailError`]), never NaN: an empty set, a single sample, a
//! non-finite observable, or a constant set (zero variance: no spread to estimate a bandwidth or a
//! tail from).

use crate::config::Observable;
use std::fmt;

/// The default tail threshold η of RMSQE (docs/design.md §7).
pub const DEFAULT_ETA: f64 = 0.975;
/// Midpoint-rule sub-intervals of `[η, 1]` for RMSQE.
const RMSQE_INTERVALS: usize = 1024;
/// Points of the grid the kernel density estimates are binned on.
const GRID_POINTS: usize = 2048;
/// How many (largest) bandwidths the grid extends beyond the extreme observables.
const GRID_MARGIN_BANDWIDTHS: f64 = 3.0;
/// Densities are floored at this fraction of their own peak before the log.
const DENSITY_FLOOR: f64 = 1e-6;
/// Gauss–Legendre panels over `[a, b]` for LOADER.
const QUADRATURE_PANELS: usize = 32;
/// Gauss–Legendre nodes per panel.
const QUADRATURE_NODES: usize = 16;

/// Which of the two compared sets an error is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TailSet {
    /// The first set: the student's samples.
    Samples,
    /// The second set: the reference (teacher samples or training data).
    Reference,
}

impl fmt::Display for TailSet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            TailSet::Samples => "samples",
            TailSet::Reference => "reference",
        })
    }
}

/// Why tail metrics cannot be computed for a pair of sets.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum TailError {
    #[error("the {set} set is empty: there are no observables to compare")]
    Empty { set: TailSet },
    #[error("the {set} set has only {n} sample: at least 2 are needed for quantiles and a density")]
    TooFew { set: TailSet, n: usize },
    #[error("the {set} set has a non-finite observable ({value}) at sample {index}")]
    NonFinite {
        set: TailSet,
        index: usize,
        value: f64,
    },
    #[error(
        "the {set} set's observable is constant ({value} for all {n} samples): zero variance, so \
         neither a tail nor a kernel density can be estimated from it"
    )]
    ZeroVariance { set: TailSet, value: f64, n: usize },
    #[error(
        "the {set} set's observables ({min} to {max}) are spread too widely or too narrowly for a \
         kernel density estimate in double precision"
    )]
    Unrepresentable { set: TailSet, min: f64, max: f64 },
    #[error("eta must lie in [0, 1), got {0}")]
    Eta(f64),
}

/// RMSQE and LOADER of one pair of sets, in the observable's units.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct TailMetrics {
    pub rmsqe: f64,
    pub loader: f64,
}

/// The observable of each image of `images` (`[n,C,H,W]`, any device, any float kind), mapped
/// to physical units as `scale · o + offset`. Each image is reduced on its device; only the `n`
/// values come back to the host. A NaN pixel makes its image's observable NaN, which [`rmsqe`],
/// [`loader`] and [`tail_metrics`] report as an error.
pub fn observables(images: &tch::Tensor, obs: Observable, scale: f64, offset: f64) -> Vec<f64> {
    use tch::Kind;
    let n = images.size()[0];
    let per_image = images.numel() as i64 / n.max(1);
    // libtorch's quantile takes at most 2^24 elements at once: reduce in row chunks.
    let rows = ((1i64 << 24) / per_image.max(1)).max(1);
    let mut out = Vec::with_capacity(n as usize);
    let mut start = 0;
    while start < n {
        let len = rows.min(n - start);
        let x = images
            .narrow(0, start, len)
            .to_kind(Kind::Double)
            .reshape([len, -1]);
        let g = match obs {
            Observable::Max => x.amax(1, false),
            Observable::Min => x.amin(1, false),
            Observable::Mean => x.mean_dim(1, false, Kind::Double),
            Observable::Sum => x.sum_dim_intlist(1, false, Kind::Double),
            // libtorch's `linear` interpolation is numpy's default.
            Observable::Quantile(q) => x.quantile_scalar(q, 1, false, "linear"),
        };
        let g = (g * scale + offset).to_device(tch::Device::Cpu);
        out.extend(Vec::<f64>::try_from(g).expect("a float64 vector"));
        start += len;
    }
    out
}

/// The `u`-quantile of an ascending, non-empty sample with linear interpolation, exactly as
/// numpy's default (`method="linear"`): position `u·(n−1)`, and the interpolation between the
/// neighbours `a`, `b` written as `a + (b−a)·t` for `t < ½` and `b − (b−a)·(1−t)` otherwise.
fn quantile_sorted(sorted: &[f64], u: f64) -> f64 {
    let last = sorted.len() - 1;
    let position = last as f64 * u;
    if position >= last as f64 {
        return sorted[last];
    }
    if position <= 0.0 {
        return sorted[0];
    }
    let below = position.floor();
    let t = position - below;
    let (a, b) = (sorted[below as usize], sorted[below as usize + 1]);
    let diff = b - a;
    if t >= 0.5 {
        b - diff * (1.0 - t)
    } else {
        a + diff * t
    }
}

/// Checks that a set of observables can be compared: at least 2, all finite, not all equal.
fn check(x: &[f64], set: TailSet) -> Result<(), TailError> {
    match x.len() {
        0 => return Err(TailError::Empty { set }),
        1 => return Err(TailError::TooFew { set, n: 1 }),
        _ => {}
    }
    if let Some((index, &value)) = x.iter().enumerate().find(|(_, v)| !v.is_finite()) {
        return Err(TailError::NonFinite { set, index, value });
    }
    let (min, max) = min_max(x);
    if min == max {
        return Err(TailError::ZeroVariance {
            set,
            value: min,
            n: x.len(),
        });
    }
    Ok(())
}

fn check_eta(eta: f64) -> Result<(), TailError> {
    if (0.0..1.0).contains(&eta) {
        Ok(())
    } else {
        Err(TailError::Eta(eta))
    }
}

fn min_max(x: &[f64]) -> (f64, f64) {
    x.iter()
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), &v| {
            (lo.min(v), hi.max(v))
        })
}

fn sorted_copy(x: &[f64]) -> Vec<f64> {
    let mut s = x.to_vec();
    s.sort_unstable_by(f64::total_cmp);
    s
}

/// RMSQE between the observables `p` (samples) and `q` (reference) above the quantile level
/// `eta` (see the module documentation): the root mean square, over the 1024 midpoints `u_k` of
/// `[eta, 1]`, of the difference of the two empirical quantile functions. Zero for identical
/// sets; `|c|` for `q = p + c`.
pub fn rmsqe(p: &[f64], q: &[f64], eta: f64) -> Result<f64, TailError> {
    check_eta(eta)?;
    check(p, TailSet::Samples)?;
    check(q, TailSet::Reference)?;
    let (p, q) = (sorted_copy(p), sorted_copy(q));
    let width = 1.0 - eta;
    let sum_sq: f64 = (0..RMSQE_INTERVALS)
        .map(|k| {
            let u = eta + (k as f64 + 0.5) * width / RMSQE_INTERVALS as f64;
            let d = quantile_sorted(&p, u) - quantile_sorted(&q, u);
            d * d
        })
        .sum();
    Ok((sum_sq / RMSQE_INTERVALS as f64).sqrt())
}

/// Scott's bandwidth `σ · n^(−1/5)`, `σ` the sample standard deviation with `ddof = 1`
/// (`scipy.stats.gaussian_kde`'s default).
fn scott_bandwidth(x: &[f64]) -> f64 {
    let n = x.len() as f64;
    let mean = x.iter().sum::<f64>() / n;
    let var = x.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / (n - 1.0);
    var.sqrt() * n.powf(-0.2)
}

/// The common grid of both density estimates: `GRID_POINTS` points from `start` spaced `step`.
struct Grid {
    start: f64,
    step: f64,
}

impl Grid {
    /// The index of the grid point at or below `x` (clamped so that it has a right neighbour) and
    /// `x`'s fractional distance from it towards that neighbour.
    fn locate(&self, x: f64) -> (usize, f64) {
        let t = ((x - self.start) / self.step).clamp(0.0, (GRID_POINTS - 1) as f64);
        let j = (t.floor() as usize).min(GRID_POINTS - 2);
        (j, t - j as f64)
    }

    /// The linear-binned Gaussian KDE of `x` with bandwidth `h` at the grid points, floored at
    /// `DENSITY_FLOOR` times its peak.
    fn floored_density(&self, x: &[f64], h: f64) -> Vec<f64> {
        let mut weights = vec![0.0; GRID_POINTS];
        for &v in x {
            let (j, f) = self.locate(v);
            weights[j] += 1.0 - f;
            weights[j + 1] += f;
        }
        // exp(−z²/2) underflows to 0 well before z = 40: the discrete kernel's sum to that point
        // is its sum over all integer offsets.
        let gauss = |k: usize| (-0.5 * (k as f64 * self.step / h).powi(2)).exp();
        let mut total = 1.0;
        let mut k = 1;
        while k as f64 * self.step <= 40.0 * h {
            total += 2.0 * gauss(k);
            k += 1;
        }
        let norm = 1.0 / (total * self.step * x.len() as f64);
        let kernel: Vec<f64> = (0..GRID_POINTS).map(|k| gauss(k) * norm).collect();
        let mut density = vec![0.0; GRID_POINTS];
        for (j, &w) in weights.iter().enumerate().filter(|(_, w)| **w != 0.0) {
            // Grid points at and right of j at offsets 0, 1, ...; left of j at offsets 1, 2, ...
            for (d, k) in density[j..].iter_mut().zip(&kernel) {
                *d += w * k;
            }
            for (d, k) in density[..j].iter_mut().rev().zip(&kernel[1..]) {
                *d += w * k;
            }
        }
        let floor = DENSITY_FLOOR * density.iter().copied().fold(0.0, f64::max);
        for d in &mut density {
            *d = d.max(floor);
        }
        density
    }

    /// Linear interpolation of grid values at `x`.
    fn interpolate(&self, values: &[f64], x: f64) -> f64 {
        let (j, f) = self.locate(x);
        values[j] * (1.0 - f) + values[j + 1] * f
    }
}

/// `P_n(x)` and `P_n'(x)`, the Legendre polynomial of degree `n ≥ 1` and its derivative, by the
/// three-term recurrence (`|x| < 1`).
fn legendre(n: usize, x: f64) -> (f64, f64) {
    let (mut p_prev, mut p) = (1.0, x);
    for k in 2..=n {
        let k = k as f64;
        (p_prev, p) = (p, ((2.0 * k - 1.0) * x * p - (k - 1.0) * p_prev) / k);
    }
    (p, n as f64 * (x * p - p_prev) / (x * x - 1.0))
}

/// Nodes (ascending) and weights of the `N`-point Gauss–Legendre rule on `[−1, 1]`, exact for
/// polynomials of degree up to `2N − 1`: the roots of `P_N` by Newton's iteration from the usual
/// cosine initial guesses, and the weights `2 / ((1 − x²) P_N'(x)²)`.
fn gauss_legendre<const N: usize>() -> ([f64; N], [f64; N]) {
    let (mut nodes, mut weights) = ([0.0; N], [0.0; N]);
    for i in 0..N.div_ceil(2) {
        let mut x = (std::f64::consts::PI * (i as f64 + 0.75) / (N as f64 + 0.5)).cos();
        for _ in 0..100 {
            let (p, derivative) = legendre(N, x);
            let step = p / derivative;
            x -= step;
            if step.abs() <= 1e-15 {
                break;
            }
        }
        let derivative = legendre(N, x).1;
        let w = 2.0 / ((1.0 - x * x) * derivative * derivative);
        (nodes[i], weights[i]) = (-x, w);
        (nodes[N - 1 - i], weights[N - 1 - i]) = (x, w);
    }
    (nodes, weights)
}

/// LOADER between the observables `p` (samples) and `q` (reference): `∫ |log p(x) − log q(x)|
/// dx` over the common grid's range with linear-binned Gaussian KDEs (see the module
/// documentation). Zero for identical sets, and symmetric in its arguments (exactly, in floating
/// point).
pub fn loader(p: &[f64], q: &[f64]) -> Result<f64, TailError> {
    check(p, TailSet::Samples)?;
    check(q, TailSet::Reference)?;
    let (p_min, p_max) = min_max(p);
    let (q_min, q_max) = min_max(q);
    let (h_p, h_q) = (scott_bandwidth(p), scott_bandwidth(q));
    for (set, h, min, max) in [
        (TailSet::Samples, h_p, p_min, p_max),
        (TailSet::Reference, h_q, q_min, q_max),
    ] {
        if !(h.is_finite() && h > 0.0) {
            return Err(TailError::Unrepresentable { set, min, max });
        }
    }
    let margin = GRID_MARGIN_BANDWIDTHS * h_p.max(h_q);
    let (a, b) = (p_min.min(q_min) - margin, p_max.max(q_max) + margin);
    let step = (b - a) / (GRID_POINTS - 1) as f64;
    if !(step.is_finite() && step > 0.0) {
        // Both sets are finite and each has a finite spread: only their union can overflow.
        let set = if p_max - p_min >= q_max - q_min {
            TailSet::Samples
        } else {
            TailSet::Reference
        };
        let (min, max) = match set {
            TailSet::Samples => (p_min, p_max),
            TailSet::Reference => (q_min, q_max),
        };
        return Err(TailError::Unrepresentable { set, min, max });
    }
    let grid = Grid { start: a, step };
    let (density_p, density_q) = (grid.floored_density(p, h_p), grid.floored_density(q, h_q));
    let (nodes, weights) = gauss_legendre::<QUADRATURE_NODES>();
    let half_panel = (b - a) / (2 * QUADRATURE_PANELS) as f64;
    let mut integral = 0.0;
    for panel in 0..QUADRATURE_PANELS {
        let mid = a + (2 * panel + 1) as f64 * half_panel;
        for (xi, wi) in nodes.iter().zip(&weights) {
            let x = mid + half_panel * xi;
            let log_ratio =
                grid.interpolate(&density_p, x).ln() - grid.interpolate(&density_q, x).ln();
            integral += half_panel * wi * log_ratio.abs();
        }
    }
    Ok(integral)
}

/// RMSQE (above `eta`) and LOADER between the observables of the student's `samples` and of the
/// `reference`.
pub fn tail_metrics(
    samples: &[f64],
    reference: &[f64],
    eta: f64,
) -> Result<TailMetrics, TailError> {
    check_eta(eta)?;
    check(samples, TailSet::Samples)?;
    check(reference, TailSet::Reference)?;
    Ok(TailMetrics {
        rmsqe: rmsqe(samples, reference, eta)?,
        loader: loader(samples, reference)?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A deterministic, skewed, heavy-ish-tailed sample (no RNG dependency): a squared-logistic
    /// transform of a Weyl sequence.
    fn sample(n: usize, seed: f64) -> Vec<f64> {
        (0..n)
            .map(|i| {
                let u = ((i as f64 + seed) * 0.618_033_988_749_894_9).fract() * 0.998 + 0.001;
                let z = (u / (1.0 - u)).ln();
                z + 0.1 * z * z.abs()
            })
            .collect()
    }

    #[test]
    fn quantiles_match_numpy() {
        // np.quantile([3, 1, 4, 1, 5, 9, 2, 6], u) for these u, as numpy 2.4 prints them (the
        // same floating-point operations give the same bits). By hand: sorted 1 1 2 3 4 5 6 9,
        // u = 0.9 is position 6.3, 6 + 0.3 · (9 − 6) = 6.9 (numpy's rounding: 6.8999999999999995).
        let s = sorted_copy(&[3.0, 1.0, 4.0, 1.0, 5.0, 9.0, 2.0, 6.0]);
        let cases = [
            (0.0, 1.0),
            (0.1, 1.0),
            (0.3, 2.1),
            (0.5, 3.5),
            (0.9, 6.899_999_999_999_999_5),
            (0.99, 8.79),
            (1.0, 9.0),
        ];
        for (u, expected) in cases {
            assert_eq!(quantile_sorted(&s, u), expected, "u = {u}");
        }
    }

    #[test]
    fn observables_reduce_each_sample() {
        // Two samples of 5 pixels.
        let images =
            tch::Tensor::from_slice(&[1.0f32, 5.0, 2.0, 4.0, 3.0, -1.0, 0.0, 10.0, 2.0, 4.0])
                .view([2, 1, 1, 5]);
        let o = |obs| observables(&images, obs, 2.0, 1.0);
        assert_eq!(o(Observable::Max), [11.0, 21.0]);
        assert_eq!(o(Observable::Min), [3.0, -1.0]);
        assert_eq!(o(Observable::Mean), [7.0, 7.0]);
        assert_eq!(o(Observable::Sum), [31.0, 31.0]);
        // np.quantile([1, 5, 2, 4, 3], 0.9) = 4.6; np.quantile([-1, 0, 10, 2, 4], 0.25) = 0.
        let q = observables(&images, Observable::Quantile(0.9), 1.0, 0.0)[0];
        assert!((q - 4.6).abs() < 1e-12, "{q}");
        assert_eq!(
            observables(&images, Observable::Quantile(0.25), 1.0, 0.0)[1],
            0.0
        );
        let with_nan = tch::Tensor::from_slice(&[1.0f64, f64::NAN, 2.0, 3.0]).view([2, 1, 1, 2]);
        for obs in [
            Observable::Max,
            Observable::Min,
            Observable::Mean,
            Observable::Sum,
            Observable::Quantile(0.5),
        ] {
            let o = observables(&with_nan, obs, 1.0, 0.0);
            assert!(o[0].is_nan() && o[1].is_finite(), "{obs:?}: {o:?}");
        }
    }

    #[test]
    fn rmsqe_of_a_set_against_itself_is_zero() {
        let x = sample(997, 0.3);
        assert_eq!(rmsqe(&x, &x, DEFAULT_ETA).unwrap(), 0.0);
        assert_eq!(rmsqe(&x, &x, 0.0).unwrap(), 0.0);
    }

    #[test]
    fn rmsqe_of_a_shift_is_the_shift() {
        let x = sample(1000, 0.7);
        for c in [0.25, -3.5, 10.0] {
            let y: Vec<f64> = x.iter().map(|v| v + c).collect();
            for eta in [DEFAULT_ETA, 0.5, 0.0] {
                let r = rmsqe(&x, &y, eta).unwrap();
                assert!((r - c.abs()).abs() <= 1e-12, "c = {c}, eta = {eta}: {r}");
            }
        }
    }

    #[test]
    fn rmsqe_sees_only_the_tail() {
        // Changing the bulk (below the 0.9 quantile) leaves RMSQE above 0.975 unchanged.
        let x = sorted_copy(&sample(1000, 0.1));
        let mut y = x.clone();
        for v in &mut y[..800] {
            *v -= 1.0;
        }
        assert_eq!(rmsqe(&x, &y, DEFAULT_ETA).unwrap(), 0.0);
        assert!(rmsqe(&x, &y, 0.5).unwrap() > 0.0);
    }

    #[test]
    fn loader_of_a_set_against_itself_is_zero_and_loader_is_symmetric() {
        let (x, y) = (sample(800, 0.2), sample(1200, 0.9));
        assert_eq!(loader(&x, &x).unwrap(), 0.0);
        let (xy, yx) = (loader(&x, &y).unwrap(), loader(&y, &x).unwrap());
        assert!(xy > 0.0);
        assert_eq!(xy, yx);
    }

    #[test]
    fn loader_grows_with_a_shift() {
        let x = sample(1000, 0.4);
        let shifted = |c: f64| -> Vec<f64> { x.iter().map(|v| v + c).collect() };
        let values: Vec<f64> = [0.1, 0.5, 2.0]
            .iter()
            .map(|&c| loader(&x, &shifted(c)).unwrap())
            .collect();
        assert!(values.windows(2).all(|w| w[0] < w[1]), "{values:?}");
    }

    #[test]
    fn binned_densities_integrate_to_one() {
        let x = sample(500, 0.5);
        let (lo, hi) = min_max(&x);
        let h = scott_bandwidth(&x);
        let (a, b) = (lo - 3.0 * h, hi + 3.0 * h);
        let grid = Grid {
            start: a,
            step: (b - a) / (GRID_POINTS - 1) as f64,
        };
        let density = grid.floored_density(&x, h);
        // Trapezoid rule over the grid; the floor and the mass beyond ±3h of the extreme samples
        // (≈ 0.13% of 1/n each side) are the only departures from 1.
        let integral =
            grid.step * (density.iter().sum::<f64>() - 0.5 * (density[0] + density[2047]));
        assert!((integral - 1.0).abs() < 1e-4, "{integral}");
        // A bandwidth far below the grid spacing still gives unit mass.
        let narrow = grid.floored_density(&x, grid.step * 1e-3);
        let integral = grid.step * narrow.iter().sum::<f64>();
        assert!((integral - 1.0).abs() < 1e-3, "{integral}");
    }

    #[test]
    fn gauss_legendre_is_exact_for_polynomials_up_to_degree_31() {
        let (nodes, weights) = gauss_legendre::<QUADRATURE_NODES>();
        for degree in 0..=31 {
            let integral: f64 = nodes
                .iter()
                .zip(&weights)
                .map(|(x, w)| w * x.powi(degree))
                .sum();
            let exact = if degree % 2 == 1 {
                0.0
            } else {
                2.0 / (degree + 1) as f64
            };
            assert!(
                (integral - exact).abs() <= 1e-14,
                "x^{degree}: {integral} vs {exact}"
            );
        }
        // The largest node and its weight, as tabulated (numpy's leggauss(16) agrees to 1e-16).
        assert!((nodes[15] - 0.989_400_934_991_649_9).abs() <= 1e-15);
        assert!((weights[15] - 0.027_152_459_411_754_095).abs() <= 1e-15);
        assert!(nodes.windows(2).all(|w| w[0] < w[1]));
        assert!(nodes.iter().zip(nodes.iter().rev()).all(|(a, b)| a == &-b));
    }

    #[test]
    fn degenerate_sets_are_errors_naming_the_set() {
        let good = sample(100, 0.5);
        assert_eq!(
            rmsqe(&[], &good, DEFAULT_ETA),
            Err(TailError::Empty {
                set: TailSet::Samples
            })
        );
        assert_eq!(
            loader(&good, &[1.0]),
            Err(TailError::TooFew {
                set: TailSet::Reference,
                n: 1
            })
        );
        let constant = vec![0.1; 50];
        let err = tail_metrics(&constant, &good, DEFAULT_ETA).unwrap_err();
        assert_eq!(
            err,
            TailError::ZeroVariance {
                set: TailSet::Samples,
                value: 0.1,
                n: 50
            }
        );
        assert!(
            err.to_string().contains("samples set") && err.to_string().contains("zero variance")
        );
        let mut bad = good.clone();
        bad[7] = f64::NAN;
        let err = tail_metrics(&good, &bad, DEFAULT_ETA).unwrap_err();
        assert!(matches!(
            err,
            TailError::NonFinite {
                set: TailSet::Reference,
                index: 7,
                ..
            }
        ));
        assert!(err.to_string().contains("reference set"), "{err}");
        bad[7] = f64::INFINITY;
        assert!(matches!(
            loader(&bad, &good),
            Err(TailError::NonFinite {
                set: TailSet::Samples,
                index: 7,
                ..
            })
        ));
        for eta in [1.0, -0.1, f64::NAN] {
            assert!(matches!(rmsqe(&good, &good, eta), Err(TailError::Eta(_))));
        }
        let huge = [-1e308, 1e308];
        assert!(matches!(
            loader(&huge, &good),
            Err(TailError::Unrepresentable {
                set: TailSet::Samples,
                ..
            })
        ));
    }

    #[test]
    fn tail_metrics_serialize_as_the_cli_prints_them() {
        let (x, y) = (sample(300, 0.1), sample(300, 0.6));
        let m = tail_metrics(&x, &y, DEFAULT_ETA).unwrap();
        assert_eq!(m.rmsqe, rmsqe(&x, &y, DEFAULT_ETA).unwrap());
        assert_eq!(m.loader, loader(&x, &y).unwrap());
        let json = serde_json::to_value(m).unwrap();
        assert_eq!(json["rmsqe"].as_f64(), Some(m.rmsqe));
        assert_eq!(json["loader"].as_f64(), Some(m.loader));
        assert_eq!(json.as_object().unwrap().len(), 2);
    }
}
