//! Evaluation of one checkpoint: loads its weights into the architecture and computes the
//! enabled metrics into an [`Evaluation`] record. The `Evaluator` owns the model and the data
//! (libtorch and HDF5 objects), so it lives on one thread.

use crate::config::{BiasCorrection, Config};
use crate::engine::data::{DataError, ImageSet};
use crate::engine::icr::{IcrError, IcrResult, ViewProbe};
use crate::engine::latent::{self, LatentError, Vae};
use crate::engine::model::{ContractInfo, GpuLimits, Model, ModelError};
use crate::engine::pfd::{PfdError, PfdProbe};
use crate::metrics;
use crate::record::{Evaluation, ParameterizationCheck, SweepPoint};
use crate::weights::ReadOptions;
use std::cell::RefCell;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::time::Instant;
use tch::{Device, Kind, Tensor};

#[derive(Debug, thiserror::Error)]
pub enum EvalError {
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error(transparent)]
    Data(#[from] DataError),
    #[error(transparent)]
    Icr(#[from] IcrError),
    #[error(transparent)]
    Pfd(#[from] PfdError),
    #[error(transparent)]
    Latent(#[from] LatentError),
    #[error("{checkpoint}: {message}")]
    Invalid {
        checkpoint: PathBuf,
        message: String,
    },
    #[error(transparent)]
    Unit(#[from] crate::store::unit::UnitError),
    #[error("{path}: image shape {data:?} of the data does not match {other_path}'s {other:?}")]
    ShapeMismatch {
        path: PathBuf,
        data: [usize; 3],
        other_path: PathBuf,
        other: [usize; 3],
    },
}

impl EvalError {
    /// The model error inside, when there is one (the evaluated model's, the teacher's).
    pub fn model(&self) -> Option<&ModelError> {
        match self {
            EvalError::Model(e) => Some(e),
            EvalError::Pfd(e) => e.model(),
            _ => None,
        }
    }
}

/// σ_data of the EDM loss weighting.
const SIGMA_DATA: f64 = 0.5;

/// Fixed, seeded inputs of the denoising loss: the same images (a latent model's: their
/// latents) and noise at every checkpoint.
struct LossProbe {
    images: Tensor,
    noise: Tensor,
}

impl LossProbe {
    /// `n` images of `set` chosen by `seed`, encoded by `vae` when there is one, with fixed
    /// noise.
    fn new(
        set: &ImageSet,
        n: usize,
        seed: u64,
        device: Device,
        vae: Option<&Vae>,
    ) -> Result<LossProbe, EvalError> {
        let images = set.gather(&seeded_subset(set.len(), n, seed))?;
        let images = match vae {
            Some(vae) => vae.encode(&images)?.to_device(Device::Cpu),
            None => images,
        };
        let noise = Tensor::randn(images.size(), (Kind::Float, Device::Cpu));
        Ok(LossProbe {
            images: images.to_device(device),
            noise: noise.to_device(device),
        })
    }

    /// Mean EDM-weighted denoising loss λ(σ)‖D(x0 + σn; σ) − x0‖²/dim (docs/design.md §8), and
    /// its standard error over the images, `sd/√n` of the per-image losses (0 for one image).
    fn loss(&self, model: &Model, sigma: f64, batch: usize) -> Result<(f64, f64), ModelError> {
        let n = self.images.size()[0];
        let weight = (sigma * sigma + SIGMA_DATA * SIGMA_DATA) / (sigma * SIGMA_DATA).powi(2);
        let mut per_image = Vec::with_capacity(n as usize);
        let mut start = 0;
        while start < n {
            let len = (batch as i64).min(n - start);
            let x0 = self.images.narrow(0, start, len);
            let x = &x0 + self.noise.narrow(0, start, len) * sigma;
            let s = Tensor::full([len], sigma, (Kind::Float, model.device()));
            let (d, _) = model.forward(&x, &s)?;
            let err = (d.to_kind(Kind::Double) - x0.to_kind(Kind::Double)).square();
            // The per-image mean over dimensions.
            let losses = err.flatten(1, -1).mean_dim(1, false, Kind::Double);
            per_image.extend(
                Vec::<f64>::try_from(losses.to_device(Device::Cpu)).expect("float64 losses"),
            );
            start += len;
        }
        Ok(mean_and_stderr(&per_image, weight))
    }
}

/// `weight ×` the mean of `values` and its standard error `sd/√n` (sample SD, divisor n − 1;
/// 0 for a single value).
fn mean_and_stderr(values: &[f64], weight: f64) -> (f64, f64) {
    let n = values.len() as f64;
    let mean = values.iter().sum::<f64>() / n;
    if values.len() < 2 {
        return (weight * mean, 0.0);
    }
    let var = values.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / (n - 1.0);
    (weight * mean, weight * (var / n).sqrt())
}

/// The ICR a record carries: the estimate itself, or its jackknife bias correction
/// (`icr.bias_correction`, docs/design.md §2), which needs the jackknife.
fn reported(
    r: &IcrResult,
    correction: BiasCorrection,
    checkpoint: &Path,
) -> Result<f64, EvalError> {
    match correction {
        BiasCorrection::None => Ok(r.icr),
        BiasCorrection::Jackknife => r.jackknife_corrected().ok_or_else(|| EvalError::Invalid {
            checkpoint: checkpoint.to_path_buf(),
            message: "icr.bias_correction is jackknife, but ICR has no jackknife (too few view \
                      pairs, or a leave-out solve failed: see the warning above)"
                .into(),
        }),
    }
}

/// `min(n, len)` distinct indices of `0..len` chosen by `seed`, in ascending order.
fn seeded_subset(len: usize, n: usize, seed: u64) -> Vec<usize> {
    tch::manual_seed(seed as i64);
    let perm = Tensor::randperm(len as i64, (Kind::Int64, Device::Cpu));
    let mut idx: Vec<usize> = Vec::<i64>::try_from(perm.narrow(0, 0, n.min(len) as i64))
        .expect("int64 indices")
        .into_iter()
        .map(|i| i as usize)
        .collect();
    idx.sort_unstable();
    idx
}

/// The architectures loaded on one thread, each once per file and device, for the evaluators
/// that name it (a sweep's runs): their evaluations take turns on that thread, and each loads
/// all of its checkpoint's weights into the module before it uses it. A file is the same while
/// its device, inode, size and modification time are.
#[derive(Default)]
pub struct Architectures(HashMap<(String, [i64; 5]), Rc<RefCell<Model>>>);

impl Architectures {
    /// The architecture at `path` on `device`, loaded now or shared with an earlier evaluator;
    /// whether it was shared.
    fn get(
        &mut self,
        path: &Path,
        device: Device,
    ) -> Result<(Rc<RefCell<Model>>, bool), ModelError> {
        use std::os::unix::fs::MetadataExt;
        let key = std::fs::metadata(path).ok().map(|m| {
            let id = [m.dev(), m.ino(), m.size()].map(|v| v as i64);
            (
                format!("{device:?}"),
                [id[0], id[1], id[2], m.mtime(), m.mtime_nsec()],
            )
        });
        if let Some(model) = key.as_ref().and_then(|k| self.0.get(k)) {
            return Ok((model.clone(), true));
        }
        let model = Rc::new(RefCell::new(Model::load(path, device)?));
        if let Some(key) = key {
            self.0.insert(key, model.clone());
        }
        Ok((model, false))
    }
}

/// Evaluates checkpoints against one architecture and data set.
pub struct Evaluator {
    config: Config,
    /// Shared with the other evaluators of this thread that load the same file
    /// ([`Architectures`]).
    model: Rc<RefCell<Model>>,
    contract: ContractInfo,
    views: Option<ViewProbe>,
    train_probe: Option<LossProbe>,
    heldout_probe: Option<LossProbe>,
    pfd: Option<PfdProbe>,
    /// Checkpoints evaluated so far (for `pfd.every`).
    evaluated: usize,
    /// The network's input shape `[C, H, W]` (the latents' for a latent model).
    input_shape: Vec<i64>,
    /// The parameterization the exporter's note states, for the check's warning, and the
    /// check's noise level (`None`: the check cannot be made).
    parameterization: Option<String>,
    check_sigma: Option<f64>,
    /// The parameterization check ([`crate::engine::model::consistency`]): run on the first
    /// checkpoint and, after a warning, on each one until it passes.
    checked: Check,
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Check {
    NotYet,
    Warned,
    Passed,
}

impl Evaluator {
    /// Loads the architecture on the configured device, checks it against the data's image
    /// shape, and prepares the fixed inputs of every metric.
    pub fn new(config: &Config) -> Result<Evaluator, EvalError> {
        Evaluator::sharing(config, &mut Architectures::default())
    }

    /// [`Evaluator::new`], with the architecture taken from `architectures` when an evaluator
    /// of this thread loaded the same file before (a sweep's runs), else loaded and kept there.
    pub fn sharing(
        config: &Config,
        architectures: &mut Architectures,
    ) -> Result<Evaluator, EvalError> {
        if let Some(n) = config.cpu_threads {
            tch::set_num_threads(n as i32);
        }
        let device = crate::engine::model::select_device(config.device)?;
        let train = ImageSet::open(&config.data.path, &config.data.dataset)?;
        let (model, shared) = architectures.get(&config.model.architecture, device)?;
        model
            .borrow_mut()
            .set_precision(config.evaluation.precision);
        let format = model
            .borrow_mut()
            .use_compiled(&config.model.compiled)?
            .to_string();
        let vae = match &config.model.vae {
            Some(path) => Some(Vae::load(path, device, config.icr.batch_size)?),
            None => None,
        };
        let input_shape = latent::input_shape(config, vae.as_ref(), &train)?;
        let shape: Vec<i64> = input_shape.iter().map(|&d| d as i64).collect();
        let contract = model.borrow().check_contract(&shape).map_err(|e| {
            // Precomputed latents set the network's input shape: name their file.
            match (&config.data.latents_path, e) {
                (
                    Some(path),
                    ModelError::Contract {
                        path: model,
                        message,
                    },
                ) => EvalError::Latent(LatentError::Latents {
                    path: path.clone(),
                    message: format!(
                        "dataset `{}` holds latents of shape {input_shape:?}, on which \
                             {} fails: {message}",
                        config.data.latents_dataset,
                        model.display()
                    ),
                }),
                (_, e) => e.into(),
            }
        })?;
        // The contract check ran the network: a compiled package on trial has passed its load;
        // it runs again, on trial, in its first evaluation.
        crate::store::package_trial::pause();
        tracing::info!(
            architecture = %config.model.architecture.display(),
            ?device,
            images = train.len(),
            image_shape = ?train.image_shape(),
            latent_shape = ?config.data.is_latent(&config.model).then_some(input_shape),
            feature_shape = ?contract.feature_shape,
            precision = config.evaluation.precision.as_str(),
            network = %format,
            "{}",
            if shared { "model shared with an earlier run" } else { "model loaded" }
        );
        let views = if config.icr.enabled {
            let n = config.icr.samples;
            let images = train.gather(&seeded_subset(train.len(), n, config.icr.seed))?;
            if n < 2 * contract.feature_dim {
                tracing::warn!(
                    samples = n,
                    feature_dim = contract.feature_dim,
                    "icr.samples is below twice the feature dimension: the ICR estimate is dominated by the ridge"
                );
            }
            if config.icr.bias_correction == BiasCorrection::Jackknife
                && n < 8 * contract.feature_dim
            {
                tracing::warn!(
                    samples = n,
                    feature_dim = contract.feature_dim,
                    "icr.samples is below 8 times the feature dimension: the jackknife's bias correction may overshoot there (docs/design.md §2)"
                );
            }
            let images = images.to_device(device);
            Some(match &vae {
                Some(vae) => ViewProbe::latent(images, &config.icr, vae)?,
                None => ViewProbe::new(images, &config.icr),
            })
        } else {
            None
        };
        let (train_probe, heldout_probe) = match &config.data.heldout_path {
            Some(path) => {
                let heldout = ImageSet::open(path, &config.data.heldout_dataset)?;
                if heldout.image_shape() != train.image_shape() {
                    return Err(EvalError::ShapeMismatch {
                        path: path.clone(),
                        data: heldout.image_shape(),
                        other_path: config.data.path.clone(),
                        other: train.image_shape(),
                    });
                }
                let n = config.icr.samples.min(train.len()).min(heldout.len());
                let seed = config.icr.seed;
                let vae = vae.as_ref();
                (
                    Some(LossProbe::new(&train, n, seed, device, vae)?),
                    Some(LossProbe::new(
                        &heldout,
                        n,
                        seed.wrapping_add(1),
                        device,
                        vae,
                    )?),
                )
            }
            None => (None, None),
        };
        let pfd = if config.pfd.enabled {
            let set = latent::training_set(config, vae.as_ref(), &train, device)?;
            Some(PfdProbe::new(config, &set.tensor, set.id, device)?)
        } else {
            None
        };
        let note = match crate::engine::model::export_note(&config.model.architecture) {
            Ok(Some(crate::engine::model::ExportNote::Network(n))) => Some(n),
            _ => None,
        };
        let check_sigma = crate::engine::model::consistency::check_sigma(note.as_ref());
        Ok(Evaluator {
            config: config.clone(),
            model,
            contract,
            views,
            train_probe,
            heldout_probe,
            pfd,
            evaluated: 0,
            parameterization: note.as_ref().and_then(|n| n.parameterization.clone()),
            check_sigma,
            input_shape: shape,
            checked: if check_sigma.is_some() {
                Check::NotYet
            } else {
                Check::Passed
            },
        })
    }

    /// The PF-ODE probe, when `pfd.enabled`.
    pub fn pfd(&self) -> Option<&PfdProbe> {
        self.pfd.as_ref()
    }

    /// Tells the evaluator how many checkpoints were evaluated before (a resumed run), so
    /// `pfd.every` keeps its rhythm across restarts.
    pub fn set_evaluated(&mut self, n: usize) {
        self.evaluated = n;
    }

    /// The compiled package that runs the network, `None` for TorchScript.
    pub fn package(&self) -> Option<PathBuf> {
        self.model.borrow().compiled_path().map(Path::to_path_buf)
    }

    pub fn contract(&self) -> &ContractInfo {
        &self.contract
    }

    /// Loads the weights of `checkpoint` (a file, or a checkpoint folder: see [`crate::store::unit`])
    /// and computes the enabled metrics. The record names `checkpoint` itself.
    pub fn evaluate(&mut self, checkpoint: &Path, step: i64) -> Result<Evaluation, EvalError> {
        self.evaluate_from(checkpoint, checkpoint, step)
    }

    /// [`Evaluator::evaluate`] of `checkpoint`, its files read from `files` (its pin,
    /// [`crate::store::pin`], when rotation may delete it).
    ///
    /// On CUDA, the record has the GPU time and memory peak of the evaluation, and the memory
    /// PyTorch's allocator cached is given back to the GPU after it, evaluated or failed.
    pub fn evaluate_from(
        &mut self,
        checkpoint: &Path,
        files: &Path,
        step: i64,
    ) -> Result<Evaluation, EvalError> {
        {
            let mut model = self.model.borrow_mut();
            // This run's settings: a sweep's runs may share the model with other settings.
            model.set_precision(self.config.evaluation.precision);
            model.set_gpu_limits(GpuLimits::of(&self.config.evaluation));
            model.begin_evaluation();
        }
        let evaluated = self.run_evaluation(checkpoint, files, step);
        let gpu = self.model.borrow().end_evaluation();
        let mut record = evaluated?;
        if let Some(gpu) = gpu {
            record.gpu_seconds = Some(gpu.seconds);
            record.gpu_memory_peak_bytes = Some(gpu.memory_peak_bytes);
        }
        Ok(record)
    }

    /// The body of [`Evaluator::evaluate_from`].
    fn run_evaluation(
        &mut self,
        checkpoint: &Path,
        files: &Path,
        step: i64,
    ) -> Result<Evaluation, EvalError> {
        let started = Instant::now();
        let opts = read_options(&self.config.checkpoints);
        let weights = crate::store::unit::weights_path(files, &self.config.checkpoints)?;
        let mut model = self.model.borrow_mut();
        let loaded = model.load_weights(&weights, &opts);
        // What the checkpoint itself makes the process take is spent: a death from here on is
        // not counted against it (`crash`, deaths without a marker).
        crate::store::crash::weights_read();
        loaded?;
        let model = &*model;
        let mut record = Evaluation {
            step,
            checkpoint: checkpoint.display().to_string(),
            ..Evaluation::default()
        };
        if self.checked != Check::Passed {
            let said = check_parameterization(
                model,
                &self.input_shape,
                self.parameterization.as_deref(),
                self.check_sigma
                    .unwrap_or(crate::engine::model::consistency::SIGMA),
                self.checked,
                checkpoint,
            )?;
            self.checked = match said {
                ParameterizationCheck::Warned(_) => Check::Warned,
                _ => Check::Passed,
            };
            record.parameterization = said;
        }
        record
            .stages
            .push((metrics::STAGE_LOAD, started.elapsed().as_secs_f64()));
        let mut stage = Instant::now();
        if let Some(views) = &self.views {
            let what = checkpoint.display().to_string();
            let icr = &self.config.icr;
            let r = views.run(model, icr.sigma, icr.ridge, &what)?;
            record.icr = Some(reported(&r, icr.bias_correction, checkpoint)?);
            record.icr_stderr = r.stderr;
            record.icr_samples = Some(r.samples as i64);
            record.icr_invariant_trace = Some(r.invariant_trace);
            record.icr_residual_trace = Some(r.residual_trace);
            record.icr_invariant_trace_normalized = Some(r.invariant_trace_normalized);
            record.icr_residual_trace_normalized = Some(r.residual_trace_normalized);
            record.icr_eigenvalues = Some(r.eigenvalues);
            if let Some(sigmas) = &icr.sigmas {
                let mut sweep = Vec::with_capacity(sigmas.len());
                for &sigma in sigmas {
                    let r = views.run(model, sigma, icr.ridge, &what)?;
                    sweep.push(SweepPoint {
                        sigma,
                        icr: reported(&r, icr.bias_correction, checkpoint)?,
                        stderr: r.stderr,
                    });
                }
                record.icr_sweep = Some(sweep);
            }
            record
                .stages
                .push((metrics::STAGE_ICR, stage.elapsed().as_secs_f64()));
            stage = Instant::now();
        }
        if let (Some(train), Some(heldout)) = (&self.train_probe, &self.heldout_probe) {
            let sigma = self.config.icr.sigma;
            let batch = self.config.icr.batch_size;
            let (lt, se_t) = train.loss(model, sigma, batch)?;
            let (lh, se_h) = heldout.loss(model, sigma, batch)?;
            for (what, v) in [("training loss", lt), ("held-out loss", lh)] {
                if !v.is_finite() {
                    return Err(EvalError::Invalid {
                        checkpoint: checkpoint.to_path_buf(),
                        message: format!("{what} is {v}: the weights produce non-finite outputs"),
                    });
                }
            }
            record.loss_train = Some(lt);
            record.loss_heldout = Some(lh);
            record.generalization_gap = Some(lh - lt);
            // Two independent sets of images and noise: the variances add.
            record.generalization_gap_stderr = Some(se_t.hypot(se_h));
            record
                .stages
                .push((metrics::STAGE_LOSS, stage.elapsed().as_secs_f64()));
            stage = Instant::now();
        }
        let pfd_due = self.evaluated.is_multiple_of(self.config.pfd.every.max(1));
        if let Some(probe) = self.pfd.as_ref().filter(|_| pfd_due) {
            let r = probe.run(model, &checkpoint.display().to_string())?;
            record.pfd_generalization = r.generalization;
            record.pfd_memorization = r.memorization;
            record.memorization_ratio = r.memorization_ratio;
            record.tail_rmsqe = r.tail.map(|t| t.rmsqe);
            record.tail_loader = r.tail.map(|t| t.loader);
            record
                .stages
                .push((metrics::STAGE_PFD, stage.elapsed().as_secs_f64()));
        }
        self.evaluated += 1;
        record.seconds = started.elapsed().as_secs_f64();
        tracing::debug!(checkpoint = %crate::store::safe_fs::untrusted(checkpoint), stages = ?record.stages, "evaluated");
        Ok(record)
    }
}

/// The parameterization check on `checkpoint`'s weights (`before`: what the earlier checkpoints
/// gave), said on the console: a WARN the first time it warns, an INFO when it passes after a
/// warning (the earlier checkpoints were undertrained, or the file was exported again).
fn check_parameterization(
    model: &Model,
    input_shape: &[i64],
    parameterization: Option<&str>,
    sigma: f64,
    before: Check,
    checkpoint: &Path,
) -> Result<ParameterizationCheck, ModelError> {
    use crate::engine::model::consistency;
    let shown = crate::store::safe_fs::untrusted(checkpoint);
    let rms = consistency::pure_noise_rms(model, input_shape, sigma)?;
    Ok(match consistency::warning(rms, sigma, parameterization) {
        Some(warning) => {
            if before == Check::NotYet {
                tracing::warn!(checkpoint = %shown, "parameterization check: {warning}");
            } else {
                tracing::debug!(checkpoint = %shown, "parameterization check: {warning}");
            }
            ParameterizationCheck::Warned(warning)
        }
        None => {
            if before == Check::Warned {
                tracing::info!(checkpoint = %shown, "parameterization check: passes on this checkpoint (the earlier ones looked undertrained)");
            }
            ParameterizationCheck::Passed
        }
    })
}

/// How the checkpoint readers pick and bound the weights (`checkpoints.weights_key`,
/// `strip_prefix`, `max_entry_mib` and `max_total_mib`; without the last, the bound comes from
/// the architecture in `Model::load_weights`).
pub fn read_options(c: &crate::config::CheckpointsConfig) -> ReadOptions {
    ReadOptions {
        weights_key: c.weights_key.clone(),
        strip_prefix: c.strip_prefix.clone(),
        max_entry_bytes: c.max_entry_mib.saturating_mul(1 << 20),
        prefer_ema: c.prefer_ema,
        max_total_bytes: c.max_total_mib.map(|m| m.saturating_mul(1 << 20)),
        expected: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Against the closed form: values 1..=5 have mean 3 and sample variance 2.5, so the
    /// standard error of the mean is sqrt(2.5/5) = sqrt(0.5); the weight scales both.
    #[test]
    fn loss_mean_and_stderr_follow_the_closed_form() {
        let (mean, se) = mean_and_stderr(&[1.0, 2.0, 3.0, 4.0, 5.0], 2.0);
        assert!((mean - 6.0).abs() < 1e-12, "{mean}");
        assert!((se - 2.0 * 0.5f64.sqrt()).abs() < 1e-12, "{se}");
        assert_eq!(mean_and_stderr(&[4.0], 1.0), (4.0, 0.0));
    }
}
