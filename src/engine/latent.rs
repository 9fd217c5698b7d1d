//! Latent models (docs/design.md §20): the network denoises the latents of an autoencoder (a
//! VAE), not the images. The training images stay images (`data.path`); the autoencoder's
//! `encode` (pixels in [-1, 1] to scaled latents, the posterior mean, as `diffmon-export --vae`
//! writes it) turns them into the network's inputs:
//!
//! - ICR augments each image in pixel space and encodes each view, then adds the noise in latent
//!   space ([`crate::engine::icr::ViewProbe::latent`]);
//! - the denoising gap encodes its training and held-out images;
//! - PFD, E_mem, the memorization ratio and the tail metrics run against the training set's
//!   latents ([`training_set`]): read from `data.latents_path`, or encoded once and cached under
//!   `<state_dir>/cache/` keyed by the data file's and the autoencoder's SHA-256.
//!
//! The autoencoder is a `tch::CModule`: it stays on the thread that loaded it.

use crate::config::Config;
use crate::engine::data::{DataError, ImageSet};
use crate::engine::pfd::{Cache, PfdError, file_sha256};
use serde_json::json;
use std::path::{Path, PathBuf};
use tch::{Device, Kind, Tensor};

#[derive(Debug, thiserror::Error)]
pub enum LatentError {
    #[error("{path}: autoencoder (model.vae): {what}: {source}")]
    Torch {
        path: PathBuf,
        what: String,
        #[source]
        source: tch::TchError,
    },
    #[error("{path}: autoencoder (model.vae): {message}")]
    Vae { path: PathBuf, message: String },
    #[error("{path}: {message}")]
    Latents { path: PathBuf, message: String },
    #[error(transparent)]
    Data(#[from] DataError),
    #[error(transparent)]
    Pfd(#[from] PfdError),
    #[error(transparent)]
    Model(#[from] crate::engine::model::ModelError),
}

/// A latent model's autoencoder: `encode(x: [B,C,H,W] in [-1, 1]) → [B,c,h,w]`, the scaled
/// latents the network was trained on.
pub struct Vae {
    module: tch::CModule,
    path: PathBuf,
    device: Device,
    /// Images per `encode` call.
    batch: i64,
}

impl Vae {
    /// Loads the autoencoder at `path` on `device`; `batch` images go through `encode` at once.
    pub fn load(path: &Path, device: Device, batch: usize) -> Result<Vae, LatentError> {
        let module =
            tch::CModule::load_on_device(path, device).map_err(|source| LatentError::Torch {
                path: path.to_path_buf(),
                what: "cannot load the TorchScript module".into(),
                source,
            })?;
        crate::engine::model::check_pins(
            path,
            &crate::engine::model::pinned_devices(path)?,
            device,
        )?;
        Ok(Vae {
            module,
            path: path.to_path_buf(),
            device,
            batch: batch.max(1) as i64,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The latents of `x` (`[B,C,H,W]`, any device), on the autoencoder's device, float32.
    pub fn encode(&self, x: &Tensor) -> Result<Tensor, LatentError> {
        let n = x.size()[0];
        let mut parts = Vec::new();
        let mut start = 0;
        while start < n {
            let len = self.batch.min(n - start);
            let input = x
                .narrow(0, start, len)
                .to_device(self.device)
                .to_kind(Kind::Float);
            let z =
                tch::no_grad(|| self.module.method_ts("encode", &[input])).map_err(|source| {
                    LatentError::Torch {
                        path: self.path.clone(),
                        what: "encode failed (the file must have an `encode` method, as \
                           `diffmon-export --vae` writes it)"
                            .into(),
                        source,
                    }
                })?;
            let size = z.size();
            if size.len() != 4 || size[0] != len {
                return Err(LatentError::Vae {
                    path: self.path.clone(),
                    message: format!(
                        "encode returned shape {size:?} for {len} images; expected [B,c,h,w]"
                    ),
                });
            }
            parts.push(z.to_kind(Kind::Float));
            start += len;
        }
        if parts.is_empty() {
            return Err(LatentError::Vae {
                path: self.path.clone(),
                message: "nothing to encode".into(),
            });
        }
        let z = Tensor::cat(&parts, 0);
        if z.isfinite().all().int64_value(&[]) != 1 {
            return Err(LatentError::Vae {
                path: self.path.clone(),
                message: "encode returned non-finite latents".into(),
            });
        }
        Ok(z)
    }

    /// The latent shape `[c,h,w]` of images of `image_shape` `[C,H,W]`.
    pub fn latent_shape(&self, image_shape: [usize; 3]) -> Result<[usize; 3], LatentError> {
        let [c, h, w] = image_shape.map(|d| d as i64);
        let z = self.encode(&Tensor::zeros([1, c, h, w], (Kind::Float, Device::Cpu)))?;
        let s = z.size();
        Ok([s[1] as usize, s[2] as usize, s[3] as usize])
    }
}

/// The training set as the network sees it, for the PF-ODE metrics: the images, or their
/// latents.
pub struct TrainingSet {
    /// `[N,C,H,W]` (or `[N,c,h,w]`) float32 on the evaluation device.
    pub tensor: Tensor,
    /// What identifies it in the PFD cache keys (the files' hashes).
    pub id: serde_json::Value,
}

/// The shape `[C,H,W]` of the network's input: the images', or their latents' (from the
/// autoencoder, or from `data.latents_path` when there is none).
pub fn input_shape(
    config: &Config,
    vae: Option<&Vae>,
    images: &ImageSet,
) -> Result<[usize; 3], LatentError> {
    let data = &config.data;
    let from_vae = match vae {
        Some(v) => Some(v.latent_shape(images.image_shape())?),
        None => None,
    };
    if let Some(path) = &data.latents_path {
        let latents = ImageSet::open_samples(path, &data.latents_dataset)?;
        let shape = latents.image_shape();
        if let Some(v) = from_vae
            && v != shape
        {
            return Err(LatentError::Latents {
                path: path.clone(),
                message: format!(
                    "dataset `{}` holds latents of shape {shape:?}, but model.vae encodes the \
                     images to {v:?}",
                    data.latents_dataset
                ),
            });
        }
        return Ok(shape);
    }
    Ok(from_vae.unwrap_or(images.image_shape()))
}

/// The training set for PFD: the images of `data.path` (pixel models); `data.latents_path`
/// (latent models that name precomputed latents); or the images encoded by `vae`, computed once
/// and cached in `<state_dir>/cache/` under the data file's and the autoencoder's SHA-256.
pub fn training_set(
    config: &Config,
    vae: Option<&Vae>,
    images: &ImageSet,
    device: Device,
) -> Result<TrainingSet, LatentError> {
    let data = &config.data;
    if let Some(path) = &data.latents_path {
        let set = ImageSet::open_samples(path, &data.latents_dataset)?;
        return Ok(TrainingSet {
            tensor: set.read_all()?.to_device(device),
            id: json!({
                "latents_sha256": file_sha256(path)?,
                "latents_dataset": data.latents_dataset,
            }),
        });
    }
    let pixels = json!({
        "data_sha256": file_sha256(&data.path)?,
        "dataset": data.dataset,
    });
    let Some(vae) = vae else {
        return Ok(TrainingSet {
            tensor: images.read_all()?.to_device(device),
            id: pixels,
        });
    };
    let id = json!({"encoded": pixels, "vae_sha256": file_sha256(vae.path())?});
    let cache = Cache {
        dir: config.state_dir().join("cache"),
    };
    let key = json!({"version": 1, "latents_of": id});
    if let Some(mut t) = cache.load("latents-train", &key, &["latents"]) {
        return Ok(TrainingSet {
            tensor: t.remove(0).to_kind(Kind::Float).to_device(device),
            id,
        });
    }
    let started = std::time::Instant::now();
    let mut parts = Vec::new();
    let chunk = 4096;
    let mut start = 0;
    while start < images.len() {
        let end = (start + chunk).min(images.len());
        parts.push(vae.encode(&images.read(start, end)?)?);
        start = end;
    }
    let tensor = Tensor::cat(&parts, 0);
    tracing::info!(
        images = images.len(),
        latent_shape = ?&tensor.size()[1..],
        seconds = started.elapsed().as_secs_f64(),
        "training images encoded by model.vae"
    );
    cache.store("latents-train", &key, &[("latents", &tensor)])?;
    Ok(TrainingSet { tensor, id })
}
