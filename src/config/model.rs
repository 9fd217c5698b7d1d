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
}

fn default_dataset() -> String {
    "images".into()
}

/// The `model` and `data` sections' values: their files exist and the dataset is named (the
/// problems are in `v`).
pub(super) fn check_model_data(v: &mut Validator, model: &ModelConfig, data: &DataConfig) {
    v.file("model.architecture", &model.architecture);
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
