//! The flows PFD compares: the seeded latents, a descriptor `Ψ`, and the outputs of a flow (the
//! teacher's, the empirical one's) over all latents, computed or read from the cache.

use super::error::PfdError;
use super::files::{Cache, file_sha256, read_latents};

use crate::config::PfdConfig;
use crate::engine::progress::Progress;
use crate::engine::sampler::{self, Denoiser, Schedule, integrate_all};
use serde_json::json;
use std::path::{Path, PathBuf};
use tch::{Device, Kind, Tensor};

/// A TorchScript image descriptor `Ψ: [B,C,H,W] → [B,k]`; `None` stands for the identity.
pub struct Descriptor {
    module: tch::CModule,
    path: PathBuf,
}

impl Descriptor {
    pub fn load(path: &Path, device: Device) -> Result<Descriptor, PfdError> {
        let module = tch::CModule::load_on_device(path, device).map_err(|source| {
            PfdError::DescriptorTorch {
                path: path.to_path_buf(),
                what: "cannot load the TorchScript module",
                source,
            }
        })?;
        crate::engine::model::check_pins(
            path,
            &crate::engine::model::pinned_devices(path)?,
            device,
        )?;
        Ok(Descriptor {
            module,
            path: path.to_path_buf(),
        })
    }

    pub(super) fn apply(&self, x: &Tensor) -> Result<Tensor, PfdError> {
        let b = x.size()[0];
        let out = tch::no_grad(|| self.module.forward_ts(&[x.to_kind(Kind::Float)])).map_err(
            |source| PfdError::DescriptorTorch {
                path: self.path.clone(),
                what: "forward failed",
                source,
            },
        )?;
        let size = out.size();
        if size.len() != 2 || size[0] != b {
            return Err(PfdError::Descriptor {
                path: self.path.clone(),
                message: format!("returned shape {size:?}, expected [B,k] with B = {b}"),
            });
        }
        Ok(out.to_kind(Kind::Double))
    }
}

/// `Ψ(x)` in float64 `[B,k]`: the descriptor's output, or the flattened pixels.
pub(super) fn describe(descriptor: Option<&Descriptor>, x: &Tensor) -> Result<Tensor, PfdError> {
    match descriptor {
        Some(d) => d.apply(x),
        None => Ok(x.flatten(1, -1).to_kind(Kind::Double)),
    }
}

/// A flow's outputs over all latents: samples `[M,C,H,W]` and descriptors `[M,k]`, float64.
pub struct Flow {
    pub samples: Tensor,
    pub features: Tensor,
}

impl Flow {
    /// Descriptors that are the flattened samples (a view, no copy).
    pub(super) fn identity(samples: Tensor) -> Flow {
        let features = samples.flatten(1, -1);
        Flow { samples, features }
    }
}

/// The fixed latents and their identity in cache keys: `pfd.latents`'s content, or `pfd.samples`
/// standard normals from `pfd.seed` (generated on the CPU so every device sees the same ones).
pub(super) fn latents(
    pfd: &PfdConfig,
    shape: [usize; 3],
    cache: &Cache,
) -> Result<(Tensor, serde_json::Value), PfdError> {
    if let Some(path) = &pfd.latents {
        let id = json!({"file_sha256": file_sha256(path)?});
        return Ok((read_latents(path, Some(shape))?, id));
    }
    let id = json!({"seed": pfd.seed, "samples": pfd.samples, "shape": shape});
    if let Some(mut t) = cache.load("latents", &id, &["latents"]) {
        return Ok((t.remove(0), id));
    }
    tch::manual_seed(pfd.seed as i64);
    let dims = [
        pfd.samples as i64,
        shape[0] as i64,
        shape[1] as i64,
        shape[2] as i64,
    ];
    let z = Tensor::randn(dims, (Kind::Float, Device::Cpu));
    cache.store("latents", &id, &[("latents", &z)])?;
    Ok((z, id))
}

/// Integrates `denoiser` over all latents, with a progress bar, returning its flow on `device`.
pub(super) fn compute_flow(
    what: &str,
    denoiser: &mut dyn Denoiser,
    latents: &Tensor,
    schedule: &Schedule,
    batch: usize,
    descriptor: Option<&Descriptor>,
) -> Result<Flow, PfdError> {
    let total = sampler::evaluations_for(latents.size()[0], batch, schedule);
    let mut progress = Progress::new(what, total);
    let mut samples = Vec::new();
    let mut features = Vec::new();
    integrate_all(
        denoiser,
        latents,
        schedule,
        batch,
        Some(&mut progress),
        &mut |_, x| {
            if let Some(d) = descriptor {
                features.push(d.apply(&x)?);
            }
            samples.push(x);
            Ok::<_, PfdError>(())
        },
    )?;
    progress.finish();
    let samples = Tensor::cat(&samples, 0);
    Ok(match descriptor {
        Some(_) => Flow {
            samples,
            features: Tensor::cat(&features, 0),
        },
        None => Flow::identity(samples),
    })
}

/// A reference flow (teacher or empirical) from the cache, or computed and cached.
pub(super) fn reference_flow(
    kind: &str,
    key: serde_json::Value,
    cache: &Cache,
    device: Device,
    identity: bool,
    compute: impl FnOnce() -> Result<Flow, PfdError>,
) -> Result<Flow, PfdError> {
    let names: &[&str] = if identity {
        &["samples"]
    } else {
        &["samples", "features"]
    };
    if let Some(t) = cache.load(kind, &key, names) {
        let samples = t[0].to_device(device);
        return Ok(match t.get(1) {
            Some(f) => Flow {
                samples,
                features: f.to_device(device),
            },
            None => Flow::identity(samples),
        });
    }
    let flow = compute()?;
    let mut data = vec![("samples", &flow.samples)];
    if !identity {
        data.push(("features", &flow.features));
    }
    cache.store(kind, &key, &data)?;
    Ok(flow)
}
