//! The checks made from a checkpoint's metadata before any tensor byte is read: the selected
//! tensors' names and shapes against the architecture, and their total size against the bound.

use super::error::WeightsError;
use super::messages::{mismatch_parts, quote};
use super::types::{Naming, ReadOptions};
use std::path::Path;

/// Checks the selected tensors (name, shape) against [`ReadOptions::expected`] before any of
/// their bytes is read, and says which to read. By name: every tensor must be one the
/// architecture has (possibly under a prefix), with its shape; by attribute path (TorchScript):
/// the tensors the architecture does not have are skipped (never read), the others must have
/// its shapes; ordered: the count and each shape must be the parameters'. Without `expected`,
/// everything is read.
pub(crate) fn check_selected(
    opts: &ReadOptions,
    path: &Path,
    naming: Naming,
    tensors: &[(&str, &[u64])],
) -> Result<Vec<bool>, WeightsError> {
    let Some(exp) = opts.expected.as_deref() else {
        return Ok(vec![true; tensors.len()]);
    };
    let mut keep = vec![true; tensors.len()];
    let mut unexpected = Vec::new();
    let mut mismatched = Vec::new();
    match naming {
        Naming::Ordered => {
            if tensors.len() != exp.params.len() {
                return Err(WeightsError::Mismatch {
                    path: path.to_path_buf(),
                    details: format!(
                        "the checkpoint lists {} tensors in parameter order, the architecture \
                         has {} parameters (found before reading them)",
                        tensors.len(),
                        exp.params.len()
                    ),
                });
            }
            // Worded as `Model::load_weights` words it, for the first that differs.
            for (i, ((_, got), (name, want))) in tensors.iter().zip(&exp.params).enumerate() {
                if *got != want.as_slice() {
                    return Err(WeightsError::Mismatch {
                        path: path.to_path_buf(),
                        details: format!(
                            "tensor {i} of the ordered list has shape {got:?}, but parameter {i} \
                             ({}) of the architecture has shape {want:?} (found before reading \
                             them)",
                            quote(name)
                        ),
                    });
                }
            }
        }
        Naming::ByName | Naming::AttributePaths => {
            for (i, (name, shape)) in tensors.iter().enumerate() {
                let found = if naming == Naming::AttributePaths {
                    exp.shapes
                        .get_key_value(*name)
                        .map(|(k, v)| (k.as_str(), v.as_slice()))
                } else {
                    exp.shape_for(name, shape)
                };
                match found {
                    Some((_, want)) if want == *shape => {}
                    Some((_, want)) => mismatched.push(format!(
                        "{}: checkpoint {shape:?}, architecture {want:?}",
                        quote(name)
                    )),
                    None if naming == Naming::AttributePaths => keep[i] = false,
                    None => unexpected.push(quote(name)),
                }
            }
        }
    }
    if unexpected.is_empty() && mismatched.is_empty() {
        return Ok(keep);
    }
    Err(WeightsError::Mismatch {
        path: path.to_path_buf(),
        details: format!(
            "{} (found from the checkpoint's metadata, before reading its tensors)",
            mismatch_parts(&[("unexpected", &unexpected), ("shape mismatch", &mismatched)])
        ),
    })
}

/// Refuses a checkpoint whose selected tensors would take more than
/// [`ReadOptions::max_total_bytes`] in memory, before any of them is read. `bytes` comes from
/// the checkpoint's metadata (declared sizes), never from raw file bytes.
pub(crate) fn check_total(opts: &ReadOptions, path: &Path, bytes: u64) -> Result<(), WeightsError> {
    match opts.max_total_bytes {
        Some(limit) if bytes > limit => Err(WeightsError::TooLargeInAll {
            path: path.to_path_buf(),
            bytes,
            limit,
        }),
        _ => Ok(()),
    }
}
