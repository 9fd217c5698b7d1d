//! What `check-config` says of the model files: the exporter's notes (`diffmon.json`) of the
//! architecture and of a latent model's autoencoder, so that the condition a conditional
//! network is held at, and the latent space, are visible before a run starts.

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

/// Images read for [`noise_summary`]'s standard deviation (pixel space) and encoded for it
/// (latent space, on the CPU).
const PIXEL_IMAGES: usize = 256;
const ENCODED_IMAGES: usize = 8;

/// `check-config`'s line on `icr.sigma` against the data the network sees: the training
/// images' standard deviation (pixel space), or their latents' (a latent model: the first
/// images encoded by `model.vae`, since the noise is added in latent units), and the
/// signal-to-noise ratio std / σ, beside what EDM's σ_data = 0.5 gives at this σ. `None` when
/// ICR is off or has no images (a latent model without an autoencoder).
pub fn noise_summary(config: &Config) -> Option<String> {
    if !config.icr.enabled || (config.model.vae.is_none() && config.data.latents_path.is_some()) {
        return None;
    }
    let sigma = config.icr.sigma;
    Some(match data_std(config) {
        Ok((std, n, what)) => format!(
            "icr.sigma {sigma} against a standard deviation of {std:.3} of {what} ({n} images): a signal-to-noise ratio of {:.2} (std / σ; in pixel space EDM's σ_data = 0.5 gives {:.2})",
            std / sigma,
            0.5 / sigma
        ),
        Err(e) => format!("icr.sigma {sigma}: its signal-to-noise ratio is not known ({e})"),
    })
}

/// The standard deviation of the values the ICR noise is added to, the images it is from, and
/// what they are.
fn data_std(config: &Config) -> Result<(f64, usize, &'static str), String> {
    let images = crate::engine::data::ImageSet::open(&config.data.path, &config.data.dataset)
        .map_err(|e| e.to_string())?;
    let std = |t: &tch::Tensor| t.to_kind(tch::Kind::Double).std(true).double_value(&[]);
    match &config.model.vae {
        None => {
            let n = images.len().min(PIXEL_IMAGES);
            let x = images.read(0, n).map_err(|e| e.to_string())?;
            Ok((std(&x), n, "the training images"))
        }
        Some(vae) => {
            let n = images.len().min(ENCODED_IMAGES);
            let x = images.read(0, n).map_err(|e| e.to_string())?;
            let vae = crate::engine::latent::Vae::load(vae, tch::Device::Cpu, n.max(1))
                .map_err(|e| e.to_string())?;
            let z = vae.encode(&x).map_err(|e| e.to_string())?;
            Ok((std(&z), n, "their latents (model.vae)"))
        }
    }
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

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// Pixel space: the training images' standard deviation against `icr.sigma`, as numpy's
    /// `x.std(ddof=1)` gives it for 128 values of ±0.5 (0.5 · sqrt(128/127) = 0.50197).
    #[test]
    fn the_signal_to_noise_ratio_of_icr_sigma_is_said_for_the_data() {
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().join("d.h5");
        let values: Vec<f32> = (0..128)
            .map(|i| if i % 2 == 0 { 0.5 } else { -0.5 })
            .collect();
        let a = ndarray::Array4::from_shape_vec((8, 1, 4, 4), values).unwrap();
        let file = hdf5::File::create(&data).unwrap();
        file.new_dataset_builder()
            .with_data(&a)
            .create("images")
            .unwrap();
        drop(file);
        std::fs::write(dir.path().join("m.ts"), b"").unwrap();
        let text = format!(
            "run: {{dir: r}}\nmodel: {{architecture: {}}}\ndata: {{path: {}}}\nicr: {{sigma: 0.25}}\n",
            dir.path().join("m.ts").display(),
            data.display()
        );
        let config = crate::config::ConfigFile::parse(&text, "t.yaml")
            .unwrap()
            .settings(false)
            .unwrap();
        let line = noise_summary(&config).unwrap();
        let want = "icr.sigma 0.25 against a standard deviation of 0.502 of the training images \
                    (8 images): a signal-to-noise ratio of 2.01 (std / σ; in pixel space EDM's \
                    σ_data = 0.5 gives 2.00)";
        assert_eq!(line, want);
    }

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
