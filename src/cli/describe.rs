//! What `check-config` says of the model files: the exporter's notes (`diffmon.json`) of the
//! architecture and of a latent model's autoencoder, so that the condition a conditional
//! network is held at, the family and path it was exported with (with `icr.sigma` in the path's
//! time for a flow-matching network), and the latent space, are visible before a run starts; and
//! which format (a compiled package or TorchScript) will run the network, and why.

use crate::config::Config;
use crate::engine::model::{Condition, ExportNote, Family, NetworkNote, export_note};

/// One line on the model: the condition it is held at (or that it takes none), its feature
/// layer, for a latent model the autoencoder's scaling and shapes, and the forward passes'
/// precision.
pub fn model_summary(config: &Config) -> String {
    let architecture = &config.model.architecture;
    let mut parts = Vec::new();
    match export_note(architecture) {
        Ok(Some(ExportNote::Network(note))) => {
            parts.push(conversion(&note, config.icr.sigma));
            parts.push(condition(note.condition.as_ref()));
            if let Some(layer) = &note.feature_layer {
                parts.push(format!("features of `{layer}`"));
            }
            if note.learned_sigma {
                parts.push("learned-sigma output: the first half of its channels is used".into());
            }
            parts.push(match note.note_version {
                Some(v) => format!("exporter note version {v}"),
                None => "exporter note from before its versions".into(),
            });
        }
        Ok(Some(ExportNote::Vae(_))) => {
            parts.push("an autoencoder's file (diffmon-export's VAE export), not a network".into())
        }
        Ok(None) => parts.push("no exporter note (not written by diffmon-export)".into()),
        Err(e) => parts.push(e.to_string()),
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

/// The family and path the network was exported with; for a flow-matching network, `icr.sigma`
/// in the path's time and the ICR paper's SiT setting in `icr.sigma`.
fn conversion(c: &NetworkNote, icr_sigma: f64) -> String {
    let name = c.parameterization.as_deref().unwrap_or("?");
    match (c.family, c.path) {
        (Some(Family::Flow), Some(path)) => {
            let prediction = c.prediction.as_deref().unwrap_or("?");
            let scale = c.t_scale.unwrap_or(1.0);
            let time = if scale == 1.0 {
                "t".to_string()
            } else {
                format!("t·{scale}")
            };
            let t = path.time_at(icr_sigma);
            let mut text = format!(
                "exported as `{name}`: flow matching, {}, {prediction} prediction, network time {time}; \
                 icr.sigma {icr_sigma} is t = {t:.4} on this path",
                path.describe()
            );
            // The ICR paper's "t = 0.2 for SiT based models" counts t from the data (the SiT
            // paper's convention): SiT's code time 0.8.
            let paper_t = 0.2;
            let code_t = if path.data_at_one() {
                1.0 - paper_t
            } else {
                paper_t
            };
            if path.data_at_one() {
                text += &format!(
                    " ({:.4} counted from the data, the SiT paper's convention)",
                    1.0 - t
                );
            }
            text += &format!(
                "; the ICR paper's SiT setting, t = 0.2 counted from the data, is icr.sigma {:.4}",
                path.sigma_at(code_t)
            );
            text
        }
        (Some(Family::Vp), _) => format!(
            "exported as `{name}`: DDPM-style {} prediction on the `{}` VP schedule",
            c.prediction.as_deref().unwrap_or(name),
            c.schedule.as_deref().unwrap_or("?")
        ),
        (Some(Family::Edm), _) => format!("exported as `{name}`: an EDM denoiser"),
        // No arm for "any other family": a new one must say here what it is.
        (Some(Family::Flow), None) => {
            format!("exported as `{name}`: flow matching (its path is not recorded)")
        }
        // A note from before the families were recorded.
        (None, _) => format!("exported as `{name}`"),
    }
}

/// What the note's `condition` says: `null` (none), a class index, an embedding.
fn condition(c: Option<&Condition>) -> String {
    let Some(c) = c else {
        return "unconditional (or its condition is not recorded)".into();
    };
    let (main, extra) = match c {
        Condition::None { extra } => ("no condition but the extra inputs".to_string(), extra),
        Condition::Class {
            keyword,
            label,
            null_class,
            extra,
            ..
        } => {
            let class = if *null_class {
                "the null class"
            } else {
                "class"
            };
            (
                format!("class-conditional, held at {class} {label} (`{keyword}`)"),
                extra,
            )
        }
        Condition::Embedding {
            keyword,
            file,
            shape,
            extra,
            ..
        } => (
            format!(
                "held at the embedding of {} {} (`{keyword}`)",
                file.as_deref().unwrap_or("a tensor"),
                shape_text(shape)
            ),
            extra,
        ),
    };
    // Embeddings held next to the condition (an SD3-style transformer's pooled_projections).
    let extra: Vec<String> = extra
        .iter()
        .map(|e| {
            format!(
                ", and `{}` at the embedding of {} {}",
                e.keyword,
                e.file.as_deref().unwrap_or("a tensor"),
                shape_text(&e.shape)
            )
        })
        .collect();
    main + &extra.concat()
}

/// `[1,4,8]`.
fn shape_text(shape: &[i64]) -> String {
    let dims: Vec<String> = shape.iter().map(i64::to_string).collect();
    format!("[{}]", dims.join(","))
}

fn vae_summary(vae: &std::path::Path, config: &Config) -> String {
    let note = match export_note(vae) {
        Ok(Some(ExportNote::Vae(note))) => note,
        _ => Default::default(),
    };
    let shape = |s: &Option<Vec<i64>>| s.as_deref().map_or("?".into(), shape_text);
    let mut text = format!(
        "latent, autoencoder {} (latents {} of images {}",
        vae.display(),
        shape(&note.latent_shape),
        shape(&note.image_shape)
    );
    if let Some(s) = note.scaling_factor {
        text += &format!(", scaling factor {s}");
    }
    if let Some(s) = note.shift_factor.filter(|s| *s != 0.0) {
        text += &format!(", shift {s}");
    }
    text += ")";
    if let Some(p) = &config.data.latents_path {
        text += &format!("; PFD against the latents of {}", p.display());
    }
    text
}

/// The exporter's notes that break the contract (malformed, a newer version, a field this
/// version does not know), of each run's architecture and autoencoder: `Model::load` would
/// refuse them, so `check-config` does.
pub fn note_problems(runs: &[Config]) -> Vec<crate::config::Problem> {
    let mut seen = std::collections::HashSet::new();
    let files = runs.iter().flat_map(|r| {
        std::iter::once(("model.architecture", &r.model.architecture))
            .chain(r.model.vae.as_ref().map(|v| ("model.vae", v)))
    });
    files
        .filter(|(_, path)| seen.insert(path.to_path_buf()))
        .filter_map(|(key, path)| {
            let e = export_note(path).err()?;
            Some(crate::config::Problem {
                key: key.into(),
                message: e.to_string(),
            })
        })
        .collect()
}

/// Which format will run the network ([`crate::engine::model::compiled::decide`], nothing
/// loaded), one line per architecture, and `model.compiled` problems: a package its path names
/// that does not fit this machine, or that the last starts died with on trial
/// ([`crate::store::package_trial`]; under `auto` that package gives TorchScript).
pub fn network_format(runs: &[Config]) -> (Vec<String>, Vec<crate::config::Problem>) {
    use crate::config::CompiledSetting;
    use crate::engine::model::compiled::decide;
    let (mut lines, mut problems) = (Vec::new(), Vec::new());
    let mut seen = std::collections::HashSet::new();
    for run in runs {
        let arch = &run.model.architecture;
        if !seen.insert((arch.clone(), format!("{:?}", run.model.compiled))) {
            continue;
        }
        // The device line it logs names the threads the run will use.
        if let Some(n) = run.cpu_threads {
            tch::set_num_threads(n as i32);
        }
        let device = crate::engine::model::select_device(run.device).unwrap_or(tch::Device::Cpu);
        let decided = decide(&run.model.compiled, arch, device, run.evaluation.precision);
        // A package that crashed the last starts is on trial and would not be loaded.
        let on_trial = decided.as_ref().ok().and_then(|d| {
            let (package, _) = d.package.as_ref()?;
            // The daemon keeps its trials in its first run's state folder.
            let reason = crate::store::package_trial::refused(&runs[0].state_dir(), package)?;
            Some(format!("{}: {reason}", package.display()))
        });
        match (decided, on_trial) {
            (Ok(_), Some(refusal)) if matches!(run.model.compiled, CompiledSetting::Path(_)) => {
                problems.push(crate::config::Problem {
                    key: "model.compiled".into(),
                    message: refusal,
                })
            }
            (Ok(_), Some(refusal)) => lines.push(format!(
                "network {}: TorchScript (model.compiled: auto; {refusal}) (warning)",
                arch.display()
            )),
            (Ok(d), None) => lines.push(format!(
                "network {}: {}{}",
                arch.display(),
                d.why,
                if d.fell_back { " (warning)" } else { "" }
            )),
            (Err(e), _) => problems.push(crate::config::Problem {
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

    fn network(json: &str) -> NetworkNote {
        ExportNote::parse(json).unwrap().network().unwrap().clone()
    }

    fn cond(json: &str) -> String {
        condition(
            network(&format!("{{\"condition\": {json}}}"))
                .condition
                .as_ref(),
        )
    }

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
            r#"{"kind": "class", "keyword": "class_labels", "label": 10, "null_class": true}"#;
        assert_eq!(
            cond(null),
            "class-conditional, held at the null class 10 (`class_labels`)"
        );
        let three =
            r#"{"kind": "class", "keyword": "class_labels", "label": 3, "null_class": false}"#;
        assert!(cond(three).contains("held at class 3"));
        let emb = r#"{"kind": "embedding", "keyword": "encoder_hidden_states", "file": "empty.pt", "shape": [1, 4, 8]}"#;
        assert_eq!(
            cond(emb),
            "held at the embedding of empty.pt [1,4,8] (`encoder_hidden_states`)"
        );
        let sd3 = r#"{"kind": "embedding", "keyword": "encoder_hidden_states", "file": "e.pt", "shape": [1, 4, 8],
                      "extra": [{"kind": "embedding", "keyword": "pooled_projections", "file": "p.pt", "shape": [1, 8]}]}"#;
        assert_eq!(
            cond(sd3),
            "held at the embedding of e.pt [1,4,8] (`encoder_hidden_states`), and `pooled_projections` at the embedding of p.pt [1,8]"
        );
        assert!(cond("null").starts_with("unconditional"));
        assert!(condition(None).starts_with("unconditional"));
    }

    #[test]
    fn flow_notes_print_the_path_and_sigma_in_its_time() {
        let rf = network(
            r#"{"parameterization": "rectified_flow", "family": "flow", "path": "rectified_flow",
                "prediction": "velocity", "t_scale": 1000.0}"#,
        );
        let text = conversion(&rf, 0.29);
        assert!(text.contains("flow matching, rectified flow"), "{text}");
        assert!(text.contains("network time t·1000"), "{text}");
        // sigma* = 0.29 is t = 0.29 / 1.29 on the rectified-flow path; t = 0.2 is sigma 0.25.
        assert!(text.contains("icr.sigma 0.29 is t = 0.2248"), "{text}");
        assert!(text.contains("is icr.sigma 0.2500"), "{text}");
        let linear = network(
            r#"{"parameterization": "sit_linear_velocity", "family": "flow",
                "path": "sit_linear", "prediction": "velocity", "t_scale": 1.0}"#,
        );
        let text = conversion(&linear, 0.29);
        assert!(
            text.contains("is t = 0.7752 on this path (0.2248 counted from the data"),
            "{text}"
        );
        assert!(text.contains("is icr.sigma 0.2500"), "{text}");
        let gvp = network(
            r#"{"parameterization": "sit_gvp_score", "family": "flow", "path": "sit_gvp",
                "prediction": "score", "t_scale": 1.0}"#,
        );
        let text = conversion(&gvp, 0.29);
        // t = (2/π)·atan(1/0.29); the data-side t = 0.2 is σ = tan(0.1π) = 0.3249.
        assert!(text.contains("score prediction, network time t;"), "{text}");
        assert!(text.contains("is t = 0.8203"), "{text}");
        assert!(text.contains("is icr.sigma 0.3249"), "{text}");
        let eps = network(
            r#"{"parameterization": "eps", "family": "vp", "prediction": "eps", "schedule": "linear"}"#,
        );
        assert_eq!(
            conversion(&eps, 0.29),
            "exported as `eps`: DDPM-style eps prediction on the `linear` VP schedule"
        );
        // A note from before the families: the name as recorded.
        assert_eq!(
            conversion(&network(r#"{"parameterization": "x0"}"#), 0.29),
            "exported as `x0`"
        );
    }
}
