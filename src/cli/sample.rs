//! `diffmon sample`: the PF-ODE map of a model or of the empirical flow.

use super::args::SampleArgs;
use crate::engine::model::Model;
use crate::engine::pfd;
use crate::engine::sampler::{self, EmpiricalDenoiser, ModelDenoiser, Schedule};
use crate::weights::ReadOptions;
use anyhow::{Context, Result};

/// `diffmon sample`: the PF-ODE map of a model (or of the empirical flow) over given latents.
pub fn sample(a: SampleArgs) -> Result<()> {
    let device = crate::engine::model::select_device(a.device)?;
    let latents = pfd::read_latents(&a.latents, None)?;
    let shape = latents.size()[1..].to_vec();
    let schedule = Schedule {
        steps: a.steps,
        sigma_min: a.sigma_min,
        sigma_max: a.sigma_max,
        rho: a.rho,
    };
    if a.steps < 2 || a.sigma_min <= 0.0 || a.sigma_max <= a.sigma_min || a.rho <= 0.0 {
        anyhow::bail!(
            "sampler settings: need --steps ≥ 2 and 0 < --sigma-min < --sigma-max, --rho > 0"
        );
    }
    let model;
    let images;
    let mut empirical;
    let mut network;
    let denoiser: &mut dyn sampler::Denoiser = if a.model == "empirical" {
        let data = a
            .data
            .as_ref()
            .context("--model empirical needs --data (the training images)")?;
        let set = crate::engine::data::ImageSet::open(data, &a.dataset)?;
        let image_shape: Vec<i64> = set.image_shape().iter().map(|&d| d as i64).collect();
        if image_shape != shape {
            anyhow::bail!(
                "{}: images of shape {image_shape:?}, but {} holds latents of shape {shape:?}",
                data.display(),
                a.latents.display()
            );
        }
        images = set.read_all()?.to_device(device);
        empirical = EmpiricalDenoiser::new(&images, &data.display().to_string());
        &mut empirical
    } else {
        let mut m = Model::load(std::path::Path::new(&a.model), device)?;
        m.check_contract(&shape)?;
        if let Some(checkpoint) = &a.checkpoint {
            let opts = ReadOptions {
                weights_key: a.weights_key.clone(),
                strip_prefix: a.strip_prefix.clone(),
                ..ReadOptions::default()
            };
            m.load_weights(checkpoint, &opts)?;
        }
        model = m;
        network = ModelDenoiser::new(&model);
        &mut network
    };
    let m = latents.size()[0];
    let mut progress = crate::engine::progress::Progress::new(
        "sampling",
        sampler::evaluations_for(m, a.batch_size.max(1), &schedule),
    );
    let mut out = Vec::new();
    sampler::integrate_all(
        denoiser,
        &latents,
        &schedule,
        a.batch_size.max(1),
        Some(&mut progress),
        &mut |_, x| {
            out.push(x.to_device(tch::Device::Cpu));
            Ok::<_, sampler::SamplerError>(())
        },
    )?;
    progress.finish();
    pfd::write_samples(&a.out, &tch::Tensor::cat(&out, 0))?;
    Ok(())
}
