//! What the checkpoint targets share.

use std::io::Cursor;
use std::path::Path;

use diffmon::weights::{self, ReadOptions};

/// Runs every entry point of the checkpoint readers on `file` (with the default options and with
/// a dotted `weights_key` and a `strip_prefix`). Errors are expected; a tensor that is read must
/// hold exactly `numel * dtype.size()` bytes.
pub fn check_readers(file: &[u8]) {
    let path = Path::new("fuzz.pt");
    let len = file.len() as u64;
    if let Err(e) = weights::detect_format_from(Cursor::new(file), len, path) {
        let _ = e.to_string();
    }
    let _ = weights::validate_structure_from(Cursor::new(file), len, path);
    let options = [
        ReadOptions::default(),
        ReadOptions {
            weights_key: Some("state.ema".to_string()),
            strip_prefix: Some("module.".to_string()),
            ..ReadOptions::default()
        },
    ];
    for opts in &options {
        match weights::read_checkpoint_from(Cursor::new(file), len, path, opts) {
            Ok(sd) => {
                for (name, t) in &sd.tensors {
                    let nbytes = t
                        .shape
                        .iter()
                        .try_fold(1usize, |n, &s| n.checked_mul(s))
                        .and_then(|n| n.checked_mul(t.dtype.size()));
                    assert_eq!(
                        nbytes,
                        Some(t.data.len()),
                        "tensor `{name}`: {:?} {:?}",
                        t.dtype,
                        t.shape
                    );
                }
            }
            Err(e) => {
                let _ = e.to_string();
            }
        }
    }
}
