//! What `check-config` says of the model files: the exporter's notes (`diffmon.json`) of the
//! architecture and of a latent model's autoencoder, so that the condition a conditional
//! network is held at, and the latent space, are visible before a run starts; and which format
//! (a compiled package or TorchScript) will run the network, and why.

use crate::config::Config;
use crate::engine::model::export_note;
use serde_json::Value;

/// One line on the model: the condition it is held at (or that it takes none), its feature
/// layer, for a latent model the autoencoder's scaling and shapes, and the forward passes'
/// precision.
pub fn model_summary(config: &Config) -> String {
    let architecture = &config.model.architecture;
    let mut parts = Vec::new();
    match export_note(architecture) {
        Some(note) => {
            parts.push(condition(note.get("condition")));
            if let Some(layer) = note.get("feature_layer").and_then(Value::as_str) {
                parts.push(format!("features of `{layer}`"));
            }
            if note.get("learned_sigma").and_then(Value::as_bool) == Some(true) {
                parts.push("learned-sigma output: the first half of its channels is used".into());
            }
        }
        None => parts.push("no exporter note (not written by diffmon-export)".into()),
    }
    match (&config.model.vae, &config.data.latents_path) {
        (Some(vae), _) => parts.push(vae_summary(vae, config)),
        (None, Some(latents)) => parts.push(format!(
            "latent model without an autoencoder: PFD against the latents of {} (no ICR, no gap)",
            latents.display()
        )),
        (None, None) => parts.push("pixel space".into()),
    }
    parts.push(precision(config.evaluation.precision).into());
    format!("model {}: {}", architecture.display(), parts.join("; "))
}

/// What `evaluation.precision` does to the forward passes.
fn precision(p: crate::config::Precision) -> &'static str {
    use crate::config::Precision;
    match p {
        Precision::Fp32 => "forward passes in float32 (evaluation.precision: fp32)",
        Precision::Tf32 => {
            "forward passes in float32 with TF32 on CUDA (evaluation.precision: tf32; float32 on the CPU)"
        }
        Precision::Bf16 => {
            "forward passes under bfloat16 autocast (evaluation.precision: bf16; docs/guide/cost-and-gpu.md says what it changes)"
        }
    }
}

/// What the note's `condition` says: `null` (none), a class index, an embedding.
fn condition(c: Option<&Value>) -> String {
    let Some(c) = c.filter(|c| !c.is_null()) else {
        return "unconditional (or its condition is not recorded)".into();
    };
    let keyword = c.get("keyword").and_then(Value::as_str).unwrap_or("?");
    match c.get("kind").and_then(Value::as_str) {
        Some("class") => {
            let label = c.get("label").map(Value::to_string).unwrap_or_default();
            if c.get("null_class").and_then(Value::as_bool) == Some(true) {
                format!("class-conditional, held at the null class {label} (`{keyword}`)")
            } else {
                format!("class-conditional, held at class {label} (`{keyword}`)")
            }
        }
        Some("embedding") => {
            let file = c.get("file").and_then(Value::as_str).unwrap_or("?");
            let shape = c.get("shape").map(Value::to_string).unwrap_or_default();
            format!("held at the embedding of {file} {shape} (`{keyword}`)")
        }
        _ => format!("condition {c}"),
    }
}

fn vae_summary(vae: &std::path::Path, config: &Config) -> String {
    let note = export_note(vae).unwrap_or(Value::Null);
    let number = |k: &str| note.get(k).and_then(Value::as_f64);
    let shape = |k: &str| note.get(k).map(Value::to_string).unwrap_or("?".into());
    let mut text = format!(
        "latent, autoencoder {} (latents {} of images {}",
        vae.display(),
        shape("latent_shape"),
        shape("image_shape")
    );
    if let Some(s) = number("scaling_factor") {
        text += &format!(", scaling factor {s}");
    }
    if let Some(s) = number("shift_factor").filter(|s| *s != 0.0) {
        text += &format!(", shift {s}");
    }
    text += ")";
    if let Some(p) = &config.data.latents_path {
        text += &format!("; PFD against the latents of {}", p.display());
    }
    text
}

/// Which format will run the network ([`crate::engine::model::compiled::decide`], nothing
/// loaded), one line per architecture, and `model.compiled` problems: a package its path names
/// that does not fit this machine.
pub fn network_format(runs: &[Config]) -> (Vec<String>, Vec<crate::config::Problem>) {
    use crate::engine::model::compiled::decide;
    let (mut lines, mut problems) = (Vec::new(), Vec::new());
    let mut seen = std::collections::HashSet::new();
    for run in runs {
        let arch = &run.model.architecture;
        if !seen.insert((arch.clone(), format!("{:?}", run.model.compiled))) {
            continue;
        }
        let device = crate::engine::model::select_device(run.device).unwrap_or(tch::Device::Cpu);
        match decide(&run.model.compiled, arch, device, run.evaluation.precision) {
            Ok(d) => lines.push(format!(
                "network {}: {}{}",
                arch.display(),
                d.why,
                if d.fell_back { " (warning)" } else { "" }
            )),
            Err(e) => problems.push(crate::config::Problem {
                key: "model.compiled".into(),
                message: match e {
                    crate::engine::model::ModelError::Compiled { message, .. } => message,
                    e => e.to_string(),
                },
            }),
        }
    }
    (lines, problems)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn conditions_are_described_as_recorded() {
        let null =
            json!({"kind": "class", "keyword": "class_labels", "label": 10, "null_class": true});
        assert_eq!(
            condition(Some(&null)),
            "class-conditional, held at the null class 10 (`class_labels`)"
        );
        let three =
            json!({"kind": "class", "keyword": "class_labels", "label": 3, "null_class": false});
        assert!(condition(Some(&three)).contains("held at class 3"));
        let emb = json!({"kind": "embedding", "keyword": "encoder_hidden_states", "file": "empty.pt", "shape": [1, 4, 8]});
        assert_eq!(
            condition(Some(&emb)),
            "held at the embedding of empty.pt [1,4,8] (`encoder_hidden_states`)"
        );
        assert!(condition(Some(&Value::Null)).starts_with("unconditional"));
        assert!(condition(None).starts_with("unconditional"));
    }
}
