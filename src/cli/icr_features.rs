//! `diffmon icr-features`: ICR from precomputed feature pairs.

use anyhow::{Context, Result};
use std::path::Path;

/// `diffmon icr-features`: ICR of the feature pairs `/h1`, `/h2` of an HDF5 file.
pub fn icr_features(input: &Path, ridge: f64) -> Result<()> {
    let file = hdf5::File::open(input)
        .with_context(|| format!("{}: cannot open HDF5 file", input.display()))?;
    let read = |name: &str| -> Result<tch::Tensor> {
        let ds = file.dataset(name).with_context(|| {
            format!(
                "{}: no dataset `{name}` (expected /h1 and /h2, [n,d])",
                input.display()
            )
        })?;
        let shape = ds.shape();
        if shape.len() != 2 {
            anyhow::bail!(
                "{}: dataset `{name}` has shape {shape:?}, expected [n,d]",
                input.display()
            );
        }
        let values: Vec<f64> = ds.read_raw().with_context(|| {
            format!(
                "{}: dataset `{name}` is not float32/float64",
                input.display()
            )
        })?;
        Ok(tch::Tensor::from_slice(&values).view([shape[0] as i64, shape[1] as i64]))
    };
    let (h1, h2) = (read("h1")?, read("h2")?);
    if h1.size() != h2.size() {
        anyhow::bail!(
            "{}: /h1 {:?} and /h2 {:?} differ in shape",
            input.display(),
            h1.size(),
            h2.size()
        );
    }
    let started = std::time::Instant::now();
    let r = crate::engine::icr::icr_of_features(&h1, &h2, ridge, &input.display().to_string())?;
    let json = serde_json::json!({
        "icr": r.icr,
        "stderr": r.stderr,
        "invariant_trace": r.invariant_trace,
        "residual_trace": r.residual_trace,
        "eigenvalues": r.eigenvalues,
        // The moments and the linear algebra, without reading the file.
        "seconds": started.elapsed().as_secs_f64(),
    });
    super::output::line(json)?;
    Ok(())
}
