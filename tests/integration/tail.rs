//! `diffmon tail` (docs/design.md §7) against an independent numpy/scipy computation of RMSQE and
//! LOADER from their definitions — `np.quantile` for RMSQE, `scipy.stats.gaussian_kde` evaluated
//! exactly (no binning) at the Gauss–Legendre nodes for LOADER — and on the properties the
//! metrics exist for: zero against themselves, worse for a shifted tail, errors (not NaN) for
//! degenerate sets.

use crate::common::{diffmon, run_python, stderr, stdout};
use serde_json::Value;
use std::path::Path;

/// Python helpers: writing and reading image files, the observables and the two metrics.
const METRICS: &str = r#"
import json, h5py, numpy as np
from scipy.stats import gaussian_kde

def write(path, images, dataset="samples"):
    with h5py.File(path, "w") as f:
        f[dataset] = np.asarray(images, dtype="float32")

def read(path):
    # The float32 values the binary reads, as float64.
    with h5py.File(path, "r") as f:
        return np.asarray(f["samples"], dtype=np.float64)

def observable(images, kind):
    x = images.reshape(len(images), -1)
    if kind == "max":
        return x.max(axis=1)
    if kind == "mean":
        return x.mean(axis=1)
    return np.quantile(x, float(kind.removeprefix("quantile:")), axis=1)

def rmsqe(p, q, eta=0.975):
    # Midpoint rule on 1024 equal sub-intervals of [eta, 1], numpy's linear quantiles.
    u = eta + (np.arange(1024) + 0.5) * (1 - eta) / 1024
    return float(np.sqrt(np.mean((np.quantile(p, u) - np.quantile(q, u)) ** 2)))

def loader(p, q):
    # Exact Gaussian KDEs (Scott's bandwidth, ddof = 1) at the nodes of 32 panels of 16-point
    # Gauss-Legendre over [a, b], each floored at 1e-6 x its maximum over the 2048-point grid.
    kp, kq = gaussian_kde(p), gaussian_kde(q)
    h_max = max(np.sqrt(kp.covariance[0, 0]), np.sqrt(kq.covariance[0, 0]))
    a, b = min(p.min(), q.min()) - 3 * h_max, max(p.max(), q.max()) + 3 * h_max
    grid = np.linspace(a, b, 2048)
    floor_p, floor_q = 1e-6 * kp(grid).max(), 1e-6 * kq(grid).max()
    xi, wi = np.polynomial.legendre.leggauss(16)
    half = (b - a) / 64
    nodes = ((a + (2 * np.arange(32) + 1) * half)[:, None] + half * xi).ravel()
    log_p = np.log(np.maximum(kp(nodes), floor_p))
    log_q = np.log(np.maximum(kq(nodes), floor_q))
    return float(np.sum(np.tile(half * wi, 32) * np.abs(log_p - log_q)))
"#;

fn path_str(p: &Path) -> String {
    p.display().to_string()
}

/// Runs `diffmon tail` on two files and returns its JSON, asserting success and finite values.
fn tail(samples: &Path, reference: &Path, extra: &[&str]) -> Value {
    let (s, r) = (path_str(samples), path_str(reference));
    let mut args = vec!["tail", "--samples", &s, "--reference", &r];
    args.extend_from_slice(extra);
    let out = diffmon(&args);
    assert!(out.status.success(), "{args:?}: {}", stderr(&out));
    let json: Value = serde_json::from_str(stdout(&out).trim())
        .unwrap_or_else(|e| panic!("{args:?}: not one JSON object ({e}): {}", stdout(&out)));
    for key in ["rmsqe", "loader"] {
        let v = json[key].as_f64();
        assert!(v.is_some_and(f64::is_finite), "{args:?}: {key} in {json}");
    }
    json
}

fn metric(json: &Value, key: &str) -> f64 {
    json[key].as_f64().unwrap()
}

#[test]
fn tail_matches_scipy_with_exact_kde() {
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = (dir.path().join("a.h5"), dir.path().join("b.h5"));
    let script = format!(
        r#"{METRICS}
rng = np.random.default_rng(2024)
n = 2000
# Two different heavy-ish-tailed pixel laws: the per-image max has a long right tail.
write({a:?}, rng.standard_t(5, size=(n, 1, 8, 8)))
write({b:?}, 0.8 * rng.standard_t(4, size=(n, 1, 8, 8)) + 0.3 * rng.normal(size=(n, 1, 8, 8)))
samples, reference = read({a:?}), read({b:?})
out = {{}}
for kind in ["max", "mean", "quantile:0.9"]:
    p, q = observable(samples, kind), observable(reference, kind)
    out[kind] = {{"rmsqe": rmsqe(p, q), "loader": loader(p, q)}}
print(json.dumps(out))
"#,
        a = path_str(&a),
        b = path_str(&b),
    );
    let reference: Value = serde_json::from_str(&stdout(&run_python(&["-c", &script]))).unwrap();
    for (kind, extra) in [
        ("max", &[][..]),
        ("max", &["--observable", "max", "--eta", "0.975"][..]),
        ("mean", &["--observable", "mean"][..]),
        ("quantile:0.9", &["--observable", "quantile:0.9"][..]),
    ] {
        let ours = tail(&a, &b, extra);
        let expected = &reference[kind];
        // RMSQE: the same empirical quantiles and midpoint rule on both sides; only the rounding
        // of the observable (e.g. a float32 or differently ordered mean) can differ.
        let (r, r_ref) = (metric(&ours, "rmsqe"), metric(expected, "rmsqe"));
        assert!(
            (r - r_ref).abs() <= 1e-4 * r_ref,
            "{kind} {extra:?}: rmsqe {r} vs scipy {r_ref}"
        );
        // LOADER: the binary bins each KDE linearly on 2048 points and interpolates linearly
        // between them; scipy evaluates the KDE exactly. Here the bandwidths are ≳ 30 grid
        // spacings, where the binning and interpolation errors are O((Δ/h)²) ≈ 1e-3 of the local
        // curvature term and average out to ~1e-4 of the integral (measured: 1e-5 to 2e-4 on
        // such data, heavy tails included) — far inside 1%.
        let (l, l_ref) = (metric(&ours, "loader"), metric(expected, "loader"));
        assert!(
            (l - l_ref).abs() <= 1e-2 * l_ref,
            "{kind} {extra:?}: loader {l} vs scipy {l_ref}"
        );
        assert!(r > 0.0 && l > 0.0, "{kind}: {ours}");
    }
}

#[test]
fn tail_of_a_set_against_itself_is_zero() {
    let dir = tempfile::tempdir().unwrap();
    let (a, training) = (dir.path().join("a.h5"), dir.path().join("training.h5"));
    run_python(&[
        "-c",
        &format!(
            r#"{METRICS}
images = np.random.default_rng(5).standard_t(3, size=(500, 2, 4, 4))
write({a:?}, images)
write({training:?}, images, dataset="images")
"#,
            a = path_str(&a),
            training = path_str(&training),
        ),
    ]);
    for (reference, extra) in [
        (&a, &[][..]),
        (&a, &["--observable", "quantile:0.5"][..]),
        (&training, &["--reference-dataset", "images"][..]),
    ] {
        let json = tail(&a, reference, extra);
        assert_eq!(metric(&json, "rmsqe"), 0.0, "{extra:?}: {json}");
        assert_eq!(metric(&json, "loader"), 0.0, "{extra:?}: {json}");
    }
}

#[test]
fn a_shifted_heavy_tail_scores_worse_than_an_independent_draw() {
    let dir = tempfile::tempdir().unwrap();
    let [reference, independent, shifted] =
        ["reference.h5", "independent.h5", "shifted.h5"].map(|f| dir.path().join(f));
    // Pixels 0.02 · t(3): heavy-tailed, but narrow enough that a +0.5 shift stands well clear of
    // the sampling noise of the extreme quantiles (with unit-scale t(3) pixels the top order
    // statistics of 2000 images vary by more than 0.5 and the comparison is a coin toss). Over
    // 100 seeds of this set-up the shifted set's RMSQE was ≥ 1.5× and its LOADER ≥ 2× the
    // independent draw's.
    run_python(&[
        "-c",
        &format!(
            r#"{METRICS}
rng = np.random.default_rng(3)
draw = lambda: 0.02 * rng.standard_t(3, size=(2000, 1, 4, 4))
write({reference:?}, draw())
write({independent:?}, draw())
write({shifted:?}, draw() + 0.5)
"#,
            reference = path_str(&reference),
            independent = path_str(&independent),
            shifted = path_str(&shifted),
        ),
    ]);
    let fair = tail(&independent, &reference, &[]);
    let off = tail(&shifted, &reference, &[]);
    for key in ["rmsqe", "loader"] {
        assert!(
            metric(&off, key) > metric(&fair, key),
            "{key}: shifted {off} vs independent {fair}"
        );
    }
}

#[test]
fn tail_rejects_bad_input_with_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let [good, no_samples, constant, with_nan] =
        ["good.h5", "no_samples.h5", "constant.h5", "with_nan.h5"].map(|f| dir.path().join(f));
    run_python(&[
        "-c",
        &format!(
            r#"{METRICS}
images = np.random.default_rng(1).normal(size=(200, 1, 4, 4))
write({good:?}, images)
write({no_samples:?}, images, dataset="images")
write({constant:?}, np.full((200, 1, 4, 4), 0.25))
images[3, 0, 1, 2] = np.nan
write({with_nan:?}, images)
"#,
            good = path_str(&good),
            no_samples = path_str(&no_samples),
            constant = path_str(&constant),
            with_nan = path_str(&with_nan),
        ),
    ]);
    let run = |samples: &Path, reference: &Path| {
        let out = diffmon(&[
            "tail",
            "--samples",
            samples.to_str().unwrap(),
            "--reference",
            reference.to_str().unwrap(),
        ]);
        assert!(
            matches!(out.status.code(), Some(1 | 2)),
            "{samples:?} vs {reference:?}: exit {:?}, stdout {}",
            out.status.code(),
            stdout(&out)
        );
        let text = stdout(&out).to_lowercase();
        assert!(
            !text.contains("nan") && !text.contains("null"),
            "no metric may be printed: {text}"
        );
        stderr(&out)
    };

    let err = run(&good, &no_samples);
    assert!(
        err.contains("no_samples.h5") && err.contains("`samples`"),
        "the missing dataset's file: {err}"
    );

    // Constant images: every observable is 0.25, so there is no spread to estimate anything from.
    let err = run(&constant, &good);
    assert!(
        err.contains("samples set") && err.contains("zero variance"),
        "constant samples: {err}"
    );
    let err = run(&good, &constant);
    assert!(
        err.contains("reference set") && err.contains("zero variance"),
        "constant reference: {err}"
    );
    let err = run(&constant, &constant);
    assert!(err.contains("zero variance"), "both constant: {err}");

    // A NaN pixel: refused when the file is read, or as image 3's NaN observable; either way the
    // error names the file (the CLI puts both paths before a tail-metric error).
    let err = run(&with_nan, &good);
    assert!(
        err.contains("with_nan.h5") && err.contains("non-finite"),
        "NaN in the samples: {err}"
    );
}
