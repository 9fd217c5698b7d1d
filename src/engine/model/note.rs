//! The exporter's note inside a TorchScript architecture file (`extra/diffmon.json`: what
//! `diffmon-export` recorded, e.g. the condition held fixed, the non-persistent buffers), read
//! bounded, and the checks `Model::load` makes of it.

use super::error::ModelError;
use std::path::Path;

/// The exporter's note inside the architecture archive (`extra/diffmon.json`).
const EXPORT_NOTE: &str = "extra/diffmon.json";

/// The exporter's note of a TorchScript file (`diffmon.json`: what `diffmon-export` recorded,
/// e.g. the condition held fixed), `None` for a file made otherwise. The file is trusted, but
/// the note is still read bounded (1 MiB).
pub fn export_note(path: &Path) -> Option<serde_json::Value> {
    let mut zip = zip::ZipArchive::new(std::fs::File::open(path).ok()?).ok()?;
    let name = zip
        .file_names()
        .find(|n| n.ends_with(EXPORT_NOTE))?
        .to_string();
    let entry = zip.by_name(&name).ok()?;
    let mut text = String::new();
    std::io::Read::read_to_string(&mut std::io::Read::take(entry, 1 << 20), &mut text).ok()?;
    serde_json::from_str(&text).ok()
}

/// The input shape `[C,H,W]` the exporter traced the network with (the note's `input_shape`,
/// absent from files of older exporters), for messages: a network may run at other shapes too.
pub(super) fn input_shape(path: &Path) -> Option<Vec<i64>> {
    let note = export_note(path)?;
    let shape: Vec<i64> = note
        .get("input_shape")?
        .as_array()?
        .iter()
        .map(|d| d.as_i64())
        .collect::<Option<_>>()?;
    (shape.len() == 3).then_some(shape)
}

/// Refuses a file whose exporter's note records a fixed condition embedding with a zero-sized
/// dimension (an older exporter accepted `[1,0,8]`): every forward would condition on nothing.
pub(super) fn check_condition(path: &Path) -> Result<(), ModelError> {
    let Some(note) = export_note(path) else {
        return Ok(());
    };
    let condition = &note["condition"];
    if condition["kind"] != "embedding" {
        return Ok(());
    }
    let shape: Vec<i64> = condition["shape"]
        .as_array()
        .map(|s| s.iter().filter_map(serde_json::Value::as_i64).collect())
        .unwrap_or_default();
    if shape.len() != 3 || shape.iter().any(|d| *d <= 0) {
        return Err(ModelError::Contract {
            path: path.to_path_buf(),
            message: format!(
                "its fixed condition embedding has shape {shape:?}: a zero-sized dimension (or \
                 not [1,L,D]); re-export it with an embedding of values"
            ),
        });
    }
    Ok(())
}

/// The names of the non-persistent buffers the exporter listed in the architecture file (none
/// for a file made otherwise).
pub(super) fn non_persistent_buffers(path: &Path) -> Vec<String> {
    export_note(path)
        .and_then(|v| {
            Some(
                v.get("non_persistent_buffers")?
                    .as_array()?
                    .iter()
                    .filter_map(|n| n.as_str().map(String::from))
                    .collect(),
            )
        })
        .unwrap_or_default()
}
