//! `diffmon icr-features` against an independent numpy/scipy computation of docs/design.md §2,
//! its jackknife standard error included.

use crate::common::{diffmon, run_python, stderr, stdout};
use serde_json::Value;

#[test]
fn icr_features_matches_scipy_generalized_eigh() {
    let dir = tempfile::tempdir().unwrap();
    for dtype in ["float64", "float32"] {
        let input = dir.path().join(format!("features_{dtype}.h5"));
        let script = format!(
            r#"
import h5py, json, numpy as np, scipy.linalg
rng = np.random.default_rng(11)
n, d = 600, 12
mix = rng.normal(size=(d, d))
s = rng.normal(size=(n, d)) @ mix + 3.0
h1 = (s + 0.7 * rng.normal(size=(n, d))).astype("{dtype}")
h2 = (s + 0.7 * rng.normal(size=(n, d))).astype("{dtype}")
with h5py.File({input:?}, "w") as f:
    f["h1"], f["h2"] = h1, h2
h1, h2 = h1.astype(np.float64), h2.astype(np.float64)
t, u = (h1 + h2) / 2, h1 - h2
cov_t, cov_u = np.cov(t, rowvar=False), np.cov(u, rowvar=False)
xi, ss = cov_u / 2, cov_t - cov_u / 4
tau = 1e-4 * np.trace(xi) / d
lam = scipy.linalg.eigh(ss, xi + tau * np.eye(d), eigvals_only=True)
def icr(h1, h2):
    t, u = (h1 + h2) / 2, h1 - h2
    cov_t, cov_u = np.cov(t, rowvar=False), np.cov(u, rowvar=False)
    xi, ss = cov_u / 2, cov_t - cov_u / 4
    tau = 1e-4 * np.trace(xi) / d
    return 1 / (1 + scipy.linalg.eigh(ss, xi + tau * np.eye(d), eigvals_only=True).mean())
# Delete-group jackknife: G = 32 contiguous groups, group k = pairs [k*n//G, (k+1)*n//G).
G = 32
theta = np.array([icr(np.delete(h1, np.s_[k * n // G:(k + 1) * n // G], 0),
                      np.delete(h2, np.s_[k * n // G:(k + 1) * n // G], 0)) for k in range(G)])
stderr = np.sqrt((G - 1) / G * ((theta - theta.mean()) ** 2).sum())
print(json.dumps({{"icr": 1 / (1 + lam.mean()), "eigenvalues": lam.tolist(), "stderr": stderr,
                  "invariant_trace": np.trace(ss), "residual_trace": np.trace(xi)}}))
"#,
            input = input.display().to_string()
        );
        let reference: Value =
            serde_json::from_str(&stdout(&run_python(&["-c", &script]))).unwrap();
        let out = diffmon(&["icr-features", "--input", input.to_str().unwrap()]);
        assert!(out.status.success(), "{}", stderr(&out));
        let ours: Value = serde_json::from_str(&stdout(&out)).unwrap();
        let close = |a: f64, b: f64, what: &str| {
            // Both sides are float64 LAPACK on the same covariances: 1e-9 relative.
            assert!(
                (a - b).abs() <= 1e-9 * b.abs().max(1e-3),
                "{dtype} {what}: {a} vs {b}"
            );
        };
        for key in ["icr", "stderr", "invariant_trace", "residual_trace"] {
            close(
                ours[key].as_f64().unwrap(),
                reference[key].as_f64().unwrap(),
                key,
            );
        }
        let (a, b) = (
            ours["eigenvalues"].as_array().unwrap(),
            reference["eigenvalues"].as_array().unwrap(),
        );
        assert_eq!(a.len(), b.len());
        for (x, y) in a.iter().zip(b) {
            close(x.as_f64().unwrap(), y.as_f64().unwrap(), "eigenvalue");
        }
    }
}

#[test]
fn icr_features_names_a_missing_dataset() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("only_h1.h5");
    run_python(&[
        "-c",
        &format!(
            "import h5py, numpy as np\nh5py.File({:?}, 'w')['h1'] = np.ones((4, 2))",
            input.display().to_string()
        ),
    ]);
    let out = diffmon(&["icr-features", "--input", input.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        stderr(&out).contains("only_h1.h5: no dataset `h2`"),
        "{}",
        stderr(&out)
    );
}
