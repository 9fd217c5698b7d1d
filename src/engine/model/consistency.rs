//! The parameterization check on trained weights, run by the daemon and `diffmon eval` on the
//! first checkpoint: the rule of the exporter's `consistency_warning`
//! (`python/diffmon/export/scheduler.py`), since an architecture exported from its constructor
//! has no trained weights for the exporter to check. The user's side of it:
//! docs/guide/model-contract.md, "When the parameterization is wrong".
//!
//! From pure noise (a zero image plus noise) at two high noise levels, `s` / 4 and `s` =
//! min([`SIGMA`], 0.9 × a discrete VP schedule's highest sigma) ([`check_sigma`]), a trained
//! denoiser returns about the mean of its data at both; a network converted
//! with the wrong parameterization (a velocity network exported as `eps`, or the other way
//! round) returns values that grow with sigma. An untrained network grows too, so a warning on
//! an early checkpoint may be undertraining: the check runs again on each checkpoint after a
//! warning until one passes, and that is said too.

use super::{Family, Model, ModelError, NetworkNote};
use rand::{Rng, SeedableRng};
use tch::{Kind, Tensor};

/// The higher noise level at most (EDM's `sigma_max`).
pub const SIGMA: f64 = 80.0;

/// The higher noise level of the check for a network with this note (`None`: not from
/// `diffmon-export`); `None` when the check cannot be made: a discrete VP schedule whose
/// highest sigma the note does not give (a file of an older exporter), since beyond it the
/// network was never trained.
pub fn check_sigma(note: Option<&NetworkNote>) -> Option<f64> {
    let Some(note) = note else {
        return Some(SIGMA);
    };
    let discrete_vp =
        note.family == Some(Family::Vp) && note.schedule.as_deref() != Some("continuous");
    match (discrete_vp, note.sigma_max) {
        (_, Some(top)) => Some(SIGMA.min(0.9 * top)),
        (true, None) => None,
        (false, None) => Some(SIGMA),
    }
}
/// Pure-noise images per level.
const IMAGES: i64 = 4;
/// The noise's seed (the exporter's).
const SEED: u64 = 2;

/// The root mean square of the denoised output from pure noise at `sigma / 4` and `sigma`.
pub fn pure_noise_rms(model: &Model, shape: &[i64], sigma: f64) -> Result<[f64; 2], ModelError> {
    let mut dims = vec![IMAGES];
    dims.extend_from_slice(shape);
    let n: i64 = dims.iter().product();
    let mut rng = rand::rngs::StdRng::seed_from_u64(SEED);
    let values: Vec<f32> = (0..n).map(|_| normal(&mut rng) as f32).collect();
    let noise = Tensor::from_slice(&values)
        .reshape(dims.as_slice())
        .to_device(model.device());
    let mut rms = [0.0; 2];
    for (i, s) in [sigma / 4.0, sigma].into_iter().enumerate() {
        let sigma = Tensor::full([IMAGES], s, (Kind::Float, model.device()));
        let (denoised, _) = model.forward(&(&noise * s), &sigma)?;
        rms[i] = denoised
            .to_kind(Kind::Double)
            .square()
            .mean(Kind::Double)
            .sqrt()
            .double_value(&[]);
    }
    Ok(rms)
}

/// The warning `rms` at `sigma` calls for ([`pure_noise_rms`]), with the remedy; `None` when it
/// looks like a trained denoiser of the stated parameterization.
pub fn warning(rms: [f64; 2], sigma: f64, parameterization: Option<&str>) -> Option<String> {
    if !(rms[1] > 4.0 && rms[1] > 2.0 * rms[0]) {
        return None;
    }
    let stated = parameterization.map_or(String::new(), |p| format!(" (`{p}`)"));
    Some(format!(
        "the denoised output from pure noise has root mean square {:.3} at sigma {} and {:.3} at \
         sigma {sigma}; a trained denoiser's stays near its data's mean at both. If the network is \
         trained, its parameterization is probably not the one it was exported with{stated} (a \
         flow-matching network exported as eps/v/x0, or the other way round): export it again \
         naming its training scheduler (`diffmon-export --scheduler`) or its parameterization",
        rms[0],
        sigma / 4.0,
        rms[1]
    ))
}

/// A standard normal draw (Box–Muller) from a generator of this check's own, so that the check
/// leaves libtorch's global generator as it was.
fn normal(rng: &mut impl Rng) -> f64 {
    let u: f64 = rng.r#gen::<f64>().max(f64::MIN_POSITIVE);
    let v: f64 = rng.r#gen();
    (-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The rule: growing with sigma past 4 warns, a bounded or a shrinking output does not.
    #[test]
    fn the_warning_needs_a_large_output_that_grows_with_sigma() {
        assert!(warning([0.5, 0.6], SIGMA, Some("eps")).is_none());
        assert!(
            warning([3.0, 5.0], SIGMA, Some("eps")).is_none(),
            "not twice"
        );
        assert!(
            warning([1.0, 3.9], SIGMA, Some("eps")).is_none(),
            "not past 4"
        );
        let w = warning([2.0, 9.0], SIGMA, Some("eps")).unwrap();
        assert!(w.contains("(`eps`)") && w.contains("--scheduler"), "{w}");
        assert!(
            w.contains("2.000 at sigma 20") && w.contains("9.000 at sigma 80"),
            "{w}"
        );
    }

    /// The levels: 80 unless a discrete schedule ends lower; none for a discrete schedule of
    /// unknown end.
    #[test]
    fn the_check_stays_below_a_discrete_schedules_end() {
        let note = |json: &str| -> NetworkNote { serde_json::from_str(json).unwrap() };
        assert_eq!(check_sigma(None), Some(SIGMA));
        let sd = note(r#"{"family": "vp", "schedule": "scaled_linear", "sigma_max": 14.6}"#);
        assert!((check_sigma(Some(&sd)).unwrap() - 13.14).abs() < 1e-9);
        let ddpm = note(r#"{"family": "vp", "schedule": "linear", "sigma_max": 157.4}"#);
        assert_eq!(check_sigma(Some(&ddpm)), Some(SIGMA));
        let old = note(r#"{"family": "vp", "schedule": "linear"}"#);
        assert_eq!(check_sigma(Some(&old)), None);
        let continuous = note(r#"{"family": "vp", "schedule": "continuous"}"#);
        assert_eq!(check_sigma(Some(&continuous)), Some(SIGMA));
        let flow = note(r#"{"family": "flow", "path": "rectified_flow"}"#);
        assert_eq!(check_sigma(Some(&flow)), Some(SIGMA));
    }

    /// Box–Muller draws have mean 0 and variance 1 (20 000 draws: the mean's standard error is
    /// 0.007, the variance's 0.01; bounds at five of them).
    #[test]
    fn the_noise_is_standard_normal() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(SEED);
        let x: Vec<f64> = (0..20_000).map(|_| normal(&mut rng)).collect();
        let mean = x.iter().sum::<f64>() / x.len() as f64;
        let var = x.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / (x.len() - 1) as f64;
        assert!(mean.abs() < 0.035, "{mean}");
        assert!((var - 1.0).abs() < 0.05, "{var}");
    }
}
