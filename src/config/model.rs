//! The `model` and `data` sections and the top-level `device` key: the TorchScript model, the
//! training (and held-out) images and where the network runs, read as written; their files are
//! checked to exist.

use super::validate::Validator;
use serde::{Deserialize, Serialize};
use std::fmt;
use std::path::PathBuf;

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    /// TorchScript file of the model contract (docs/design.md §11).
    pub architecture: PathBuf,
    /// A latent model's autoencoder: a TorchScript file with `encode(x) → z` (pixels in
    /// [-1, 1] to scaled latents) as `diffmon-export --vae` writes it. With it the network
    /// works on latents: ICR encodes its augmented views, the gap and PFD the images.
    #[serde(default)]
    pub vae: Option<PathBuf>,
    /// The compiled network (`auto`, `off` or the path of a `.pt2` package): an AOTInductor
    /// package of the same architecture, run instead of the TorchScript file where it fits
    /// (docs/design.md §11, "The compiled network").
    #[serde(default)]
    pub compiled: CompiledSetting,
}

/// `model.compiled`: `auto` (the package beside the architecture, `model.pt2` for `model.ts`,
/// when there is one that fits this machine; TorchScript, with a warning, when it does not),
/// `off` (TorchScript), or a package's path (that package, or an error).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum CompiledSetting {
    #[default]
    Auto,
    Off,
    Path(PathBuf),
}

impl<'de> Deserialize<'de> for CompiledSetting {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        match s.as_str() {
            "auto" => Ok(CompiledSetting::Auto),
            "off" => Ok(CompiledSetting::Off),
            "" => Err(serde::de::Error::custom(
                "must be auto, off or the path of a .pt2 package, got an empty string",
            )),
            _ => Ok(CompiledSetting::Path(PathBuf::from(s))),
        }
    }
}

impl Serialize for CompiledSetting {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            CompiledSetting::Auto => s.serialize_str("auto"),
            CompiledSetting::Off => s.serialize_str("off"),
            CompiledSetting::Path(p) => s.collect_str(&p.display()),
        }
    }
}

/// `auto` (CUDA when available), `cpu`, `cuda` (device 0) or `cuda:N`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DeviceSpec {
    #[default]
    Auto,
    Cpu,
    Cuda(usize),
}

impl std::str::FromStr for DeviceSpec {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(DeviceSpec::Auto),
            "cpu" => Ok(DeviceSpec::Cpu),
            "cuda" => Ok(DeviceSpec::Cuda(0)),
            _ => s
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(DeviceSpec::Cuda)
                .ok_or_else(|| format!("must be auto, cpu, cuda or cuda:N, got `{s}`")),
        }
    }
}

impl fmt::Display for DeviceSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DeviceSpec::Auto => write!(f, "auto"),
            DeviceSpec::Cpu => write!(f, "cpu"),
            DeviceSpec::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

impl<'de> Deserialize<'de> for DeviceSpec {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

impl Serialize for DeviceSpec {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct DataConfig {
    /// HDF5 file of training images (docs/design.md §12).
    pub path: PathBuf,
    #[serde(default = "default_dataset")]
    pub dataset: String,
    /// Held-out images for the denoising generalization gap (docs/design.md §8).
    #[serde(default)]
    pub heldout_path: Option<PathBuf>,
    #[serde(default = "default_dataset")]
    pub heldout_dataset: String,
    /// Precomputed latents of the training images `[N,c,h,w]` (a latent model), used by PFD,
    /// E_mem, the memorization ratio and the tail metrics instead of encoding `path` with the
    /// VAE.
    #[serde(default)]
    pub latents_path: Option<PathBuf>,
    #[serde(default = "default_latents_dataset")]
    pub latents_dataset: String,
}

fn default_dataset() -> String {
    "images".into()
}

fn default_latents_dataset() -> String {
    "latents".into()
}

impl DataConfig {
    /// Whether the network works on latents rather than on the images themselves.
    pub fn is_latent(&self, model: &ModelConfig) -> bool {
        model.vae.is_some() || self.latents_path.is_some()
    }
}

/// The `model` and `data` sections' values: their files exist and the dataset is named (the
/// problems are in `v`).
pub(super) fn check_model_data(
    v: &mut Validator,
    model: &ModelConfig,
    data: &DataConfig,
    icr_enabled: bool,
) {
    v.file("model.architecture", &model.architecture);
    if let CompiledSetting::Path(p) = &model.compiled {
        v.file("model.compiled", p);
    }
    if let Some(p) = &model.vae {
        v.file("model.vae", p);
    }
    if let Some(p) = &data.latents_path {
        v.file("data.latents_path", p);
        v.check(
            !data.latents_dataset.is_empty(),
            "data.latents_dataset",
            "must not be empty",
        );
        // The latents stand in for the encoder only where no view is augmented.
        v.check(
            model.vae.is_some() || !icr_enabled,
            "data.latents_path",
            "ICR augments the images and encodes each view, so it needs model.vae too \
             (or icr.enabled: false)",
        );
        v.check(
            model.vae.is_some() || data.heldout_path.is_none(),
            "data.heldout_path",
            "the held-out images of a latent model are encoded with model.vae: set it",
        );
    }
    v.file("data.path", &data.path);
    v.check(
        !data.dataset.is_empty(),
        "data.dataset",
        "must not be empty",
    );
    if let Some(p) = &data.heldout_path {
        v.file("data.heldout_path", p);
    }
}

#[cfg(test)]
mod tests {
    use super::super::pfd::Observable;
    use super::*;

    /// A latent model's keys: the files must exist, and precomputed latents without the
    /// autoencoder cannot feed ICR (its views are augmented images) or the held-out gap.
    #[test]
    fn latent_keys_need_their_files_and_the_autoencoder_where_images_are_encoded() {
        use super::super::file::ConfigFile;
        use super::super::test_support::MINIMAL;
        let dir = tempfile::tempdir().unwrap();
        for f in ["m.ts", "d.h5", "h.h5", "vae.ts", "lat.h5"] {
            std::fs::write(dir.path().join(f), b"").unwrap();
        }
        let problems = |extra: &str, data: &str| -> Vec<String> {
            let text = MINIMAL.replace("{path: d.h5}", data).replace(
                "{architecture: m.ts}",
                &format!("{{architecture: m.ts{extra}}}"),
            );
            let mut file = ConfigFile::parse(&text, "c.yaml").unwrap();
            file.resolve_paths(dir.path());
            file.validate().into_iter().map(|p| p.to_string()).collect()
        };
        assert!(problems(", vae: vae.ts", "{path: d.h5, latents_path: lat.h5}").is_empty());
        let missing = problems(", vae: nope.ts", "{path: d.h5}");
        assert!(
            missing.iter().any(|p| p.starts_with("model.vae names")),
            "{missing:?}"
        );
        let no_vae = problems("", "{path: d.h5, latents_path: lat.h5, heldout_path: h.h5}");
        assert!(
            no_vae
                .iter()
                .any(|p| p.starts_with("data.latents_path") && p.contains("model.vae")),
            "{no_vae:?}"
        );
        assert!(
            no_vae.iter().any(|p| p.starts_with("data.heldout_path")),
            "{no_vae:?}"
        );
        let text = format!(
            "{MINIMAL}icr: {{enabled: false}}\npfd: {{enabled: true, teacher: m.ts}}\nearly_stop: {{metric: pfd_generalization}}\n"
        )
            .replace("{path: d.h5}", "{path: d.h5, latents_path: lat.h5}");
        let mut file = ConfigFile::parse(&text, "c.yaml").unwrap();
        file.resolve_paths(dir.path());
        let c = file.settings(false).unwrap();
        assert!(c.data.is_latent(&c.model));
        assert_eq!(c.data.latents_dataset, "latents");
    }

    /// `model.compiled`: `auto` by default, `off`, or a path resolved against the config's
    /// folder and checked to exist; an empty value is an error naming the key.
    #[test]
    fn the_compiled_setting_parses_and_its_path_is_resolved_and_checked() {
        use super::super::file::ConfigFile;
        use super::super::test_support::MINIMAL;
        let dir = tempfile::tempdir().unwrap();
        for f in ["m.ts", "d.h5", "m.pt2"] {
            std::fs::write(dir.path().join(f), b"").unwrap();
        }
        let parse = |extra: &str| {
            let text = MINIMAL.replace(
                "{architecture: m.ts}",
                &format!("{{architecture: m.ts{extra}}}"),
            );
            let mut file = ConfigFile::parse(&text, "c.yaml").map_err(|e| e.to_string())?;
            file.resolve_paths(dir.path());
            let problems: Vec<String> =
                file.validate().into_iter().map(|p| p.to_string()).collect();
            file.settings(false)
                .map(|c| (c.model.compiled, problems))
                .map_err(|e| format!("{e:?}"))
        };
        assert_eq!(parse("").unwrap().0, CompiledSetting::Auto);
        assert_eq!(parse(", compiled: off").unwrap().0, CompiledSetting::Off);
        let (path, problems) = parse(", compiled: m.pt2").unwrap();
        assert_eq!(path, CompiledSetting::Path(dir.path().join("m.pt2")));
        assert!(problems.is_empty(), "{problems:?}");
        let missing = parse(", compiled: nope.pt2").unwrap_err();
        assert!(
            missing.contains("model.compiled") && missing.contains("does not exist"),
            "{missing}"
        );
        let empty = parse(", compiled: ''").unwrap_err();
        assert!(
            empty.contains("model.compiled") && empty.contains("auto, off or the path"),
            "{empty}"
        );
    }

    #[test]
    fn observables_and_devices_parse() {
        assert_eq!(
            "quantile:0.99".parse::<Observable>(),
            Ok(Observable::Quantile(0.99))
        );
        assert!("quantile:2".parse::<Observable>().is_err());
        assert_eq!("cuda:1".parse::<DeviceSpec>(), Ok(DeviceSpec::Cuda(1)));
        assert_eq!("cuda".parse::<DeviceSpec>(), Ok(DeviceSpec::Cuda(0)));
    }
}
