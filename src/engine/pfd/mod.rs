//! PF-ODE metrics of a checkpoint (docs/design.md §4–§7): the probability flow distance to the
//! teacher (E_gen) and to the training set's empirical flow (E_mem), the memorization ratio and
//! the tail metrics, all from one integration of the student from fixed latents.
//!
//! What does not change between checkpoints is computed once and cached on disk under
//! `<state_dir>/cache/`: the seeded latents, and the teacher's and the empirical flow's outputs
//! `Φ` with their descriptors `Ψ(Φ)`. Each cache file records the key it was built for (file
//! hashes, latents, sampler settings, descriptor, shapes); a file whose key differs, or that
//! cannot be read, is rebuilt. Files are written to a temporary name and renamed into place, so
//! a half-written cache is never read. The `PfdProbe` owns libtorch objects: one thread.
//!
//! Files: `error.rs`, `files.rs` (the cache, latents and samples on disk), `flow.rs` (latents,
//! descriptors, the reference flows), `bias_variance.rs`, this file (the probe of a checkpoint).

mod bias_variance;
mod error;
mod files;
mod flow;

pub use bias_variance::{BiasVariance, StudentError, bias_variance};
pub use error::PfdError;
pub use files::{Cache, file_sha256, read_latents, write_samples};
pub use flow::{Descriptor, Flow};

use flow::{compute_flow, describe, latents, reference_flow};

use crate::config::{Config, MemorizationConfig, MemorizationCriterion, TailConfig, TailReference};
use crate::engine::model::Model;
use crate::engine::sampler::{
    EmpiricalDenoiser, ModelDenoiser, SamplerError, Schedule, integrate_all,
};
use crate::engine::tail::{self, TailMetrics};

use serde_json::json;
use tch::{Device, Kind, Tensor};

/// PF-ODE metrics of one checkpoint.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PfdResult {
    pub generalization: Option<f64>,
    pub memorization: Option<f64>,
    pub memorization_ratio: Option<f64>,
    pub tail: Option<TailMetrics>,
}

/// The memorization test on student samples.
enum Memorization {
    /// `d1/d2 < threshold` against the training images (pixel space), queried through the
    /// training set's empirical denoiser.
    NnRatio(f64, EmpiricalDenoiser),
    /// Best cosine similarity above `threshold`, against the training images' descriptors
    /// (l2-normalized, `[N,k]`).
    Cosine(f64, Tensor),
}

/// The fixed inputs of the PF-ODE metrics, prepared once per run.
pub struct PfdProbe {
    schedule: Schedule,
    batch: usize,
    latents: Tensor,
    descriptor: Option<Descriptor>,
    teacher: Option<Flow>,
    /// The empirical flow (absent for a teacher-only probe).
    empirical: Option<Flow>,
    memorization: Option<Memorization>,
    tail: Option<(TailConfig, Vec<f64>)>,
    /// Teacher network evaluations this probe made (0 when the teacher flow came from the cache).
    pub teacher_calls: u64,
    /// Empirical-denoiser evaluations this probe made (0 when taken from the cache).
    pub empirical_calls: u64,
}

/// The cache key parts every flow shares.
fn flow_key(
    source: serde_json::Value,
    latents: &serde_json::Value,
    schedule: &Schedule,
    descriptor: &serde_json::Value,
    shape: [usize; 3],
) -> serde_json::Value {
    json!({
        "version": 1,
        "source": source,
        "latents": latents,
        "sampler": schedule,
        "descriptor": descriptor,
        "shape": shape,
    })
}

impl PfdProbe {
    /// Prepares latents, the descriptor, the teacher flow (when `pfd.teacher` is set) and the
    /// empirical flow of the training set `train` (`[N,C,H,W]` f32 on `device`: the images, or
    /// a latent model's training latents), which `train_id` identifies in the cache keys.
    pub fn new(
        config: &Config,
        train: &Tensor,
        train_id: serde_json::Value,
        device: Device,
    ) -> Result<PfdProbe, PfdError> {
        Self::build(config, train, Some(train_id), device)
    }

    /// Latents, descriptor and teacher flow only (for the offline bias–variance decomposition).
    pub fn teacher_only(
        config: &Config,
        train: &Tensor,
        device: Device,
    ) -> Result<PfdProbe, PfdError> {
        Self::build(config, train, None, device)
    }

    /// The full probe with `train_id`, the teacher-only one without.
    fn build(
        config: &Config,
        train: &Tensor,
        train_id: Option<serde_json::Value>,
        device: Device,
    ) -> Result<PfdProbe, PfdError> {
        let full = train_id.is_some();
        let pfd = &config.pfd;
        let size = train.size();
        let shape = [size[1] as usize, size[2] as usize, size[3] as usize];
        let cache = Cache {
            dir: config.state_dir().join("cache"),
        };
        let schedule = Schedule::of(pfd);
        let (latents, latents_id) = latents(pfd, shape, &cache)?;
        let descriptor = match &pfd.descriptor {
            Some(p) => Some(Descriptor::load(p, device)?),
            None => None,
        };
        let identity = descriptor.is_none();
        let descriptor_id = match &pfd.descriptor {
            Some(p) => json!({"file_sha256": file_sha256(p)?}),
            None => json!("identity"),
        };
        let mut teacher_calls = 0;
        let teacher = match &pfd.teacher {
            Some(path) => {
                let source = json!({"teacher_sha256": file_sha256(path)?});
                let key = flow_key(source, &latents_id, &schedule, &descriptor_id, shape);
                Some(reference_flow(
                    "teacher",
                    key,
                    &cache,
                    device,
                    identity,
                    || {
                        let model = Model::load(path, device)?;
                        model.check_contract(&size[1..])?;
                        let mut den = ModelDenoiser::new(&model);
                        let flow = compute_flow(
                            "teacher flow",
                            &mut den,
                            &latents,
                            &schedule,
                            pfd.batch_size,
                            descriptor.as_ref(),
                        );
                        teacher_calls = den.calls;
                        flow
                    },
                )?)
            }
            None => None,
        };
        let data = &config.data;
        let mut empirical_calls = 0;
        // The training set as a denoiser (the empirical flow) and for nearest-neighbour queries.
        let mut train_set = EmpiricalDenoiser::new(train, &data.path.display().to_string());
        let empirical = if let Some(source) = train_id {
            let key = flow_key(source, &latents_id, &schedule, &descriptor_id, shape);
            Some(reference_flow(
                "empirical",
                key,
                &cache,
                device,
                identity,
                || {
                    let flow = compute_flow(
                        "empirical flow",
                        &mut train_set,
                        &latents,
                        &schedule,
                        pfd.batch_size,
                        descriptor.as_ref(),
                    );
                    empirical_calls = train_set.calls;
                    flow
                },
            )?)
        } else {
            None
        };
        let memorization = if full && config.memorization.enabled {
            Some(memorization_test(
                &config.memorization,
                train,
                train_set,
                descriptor.as_ref(),
                pfd.batch_size,
            )?)
        } else {
            None
        };
        let tail = if full && config.tail.enabled {
            let t = &config.tail;
            let reference = match t.reference {
                TailReference::Teacher => match &teacher {
                    Some(flow) => &flow.samples,
                    None => {
                        return Err(PfdError::Invalid(
                            "tail.reference: `teacher` needs pfd.teacher".into(),
                        ));
                    }
                },
                TailReference::Training => train,
            };
            let obs = tail::observables(reference, t.observable, t.scale, t.offset);
            Some((t.clone(), obs))
        } else {
            None
        };
        Ok(PfdProbe {
            schedule,
            batch: pfd.batch_size,
            latents,
            descriptor,
            teacher,
            empirical,
            memorization,
            tail,
            teacher_calls,
            empirical_calls,
        })
    }

    /// Number of latents (M).
    pub fn samples(&self) -> i64 {
        self.latents.size()[0]
    }

    /// Integrates `model` from the latents and computes every enabled PF-ODE metric; `what`
    /// names the checkpoint in errors.
    pub fn run(&self, model: &Model, what: &str) -> Result<PfdResult, PfdError> {
        let device = model.device();
        let zero = || Tensor::zeros([], (Kind::Double, device));
        let (mut gen_sq, mut mem_sq, mut memorized) = (zero(), zero(), zero());
        let mut observables = Vec::new();
        self.integrate_student(model, what, &mut |start, x, f| {
            let len = x.size()[0];
            let sq = |flow: &Flow| {
                (f - flow.features.narrow(0, start, len))
                    .square()
                    .sum(Kind::Double)
            };
            if let Some(t) = &self.teacher {
                gen_sq += sq(t);
            }
            if let Some(e) = &self.empirical {
                mem_sq += sq(e);
            }
            if let Some(m) = &self.memorization {
                memorized += self.memorized(m, x, f).sum(Kind::Double);
            }
            if let Some((t, _)) = &self.tail {
                observables.extend(tail::observables(x, t.observable, t.scale, t.offset));
            }
            Ok(())
        })?;
        let m = self.samples() as f64;
        let tail = match &self.tail {
            Some((t, reference)) => Some(tail::tail_metrics(&observables, reference, t.eta)?),
            None => None,
        };
        Ok(PfdResult {
            generalization: self
                .teacher
                .as_ref()
                .map(|_| (gen_sq.double_value(&[]) / m).sqrt()),
            memorization: self
                .empirical
                .as_ref()
                .map(|_| (mem_sq.double_value(&[]) / m).sqrt()),
            memorization_ratio: self
                .memorization
                .as_ref()
                .map(|_| memorized.double_value(&[]) / m),
            tail,
        })
    }

    /// 1.0 for each sample of the batch that counts as memorized, else 0.0 (`[B]` f64).
    fn memorized(&self, m: &Memorization, x: &Tensor, features: &Tensor) -> Tensor {
        match m {
            Memorization::NnRatio(threshold, train) => {
                let (d1, d2) = train.nearest_two(x);
                d1.lt_tensor(&(d2 * *threshold)).to_kind(Kind::Double)
            }
            Memorization::Cosine(threshold, train) => {
                let f = normalize(features);
                let best = f.mm(&train.tr()).amax(1, false);
                best.gt(*threshold).to_kind(Kind::Double)
            }
        }
    }

    /// `Ψ(Φ_student)` for all latents, `[M,k]` float64 on the CPU (for bias–variance); `what`
    /// names the checkpoint in errors.
    pub fn student_features(&self, model: &Model, what: &str) -> Result<Tensor, PfdError> {
        let mut features = Vec::new();
        self.integrate_student(model, what, &mut |_, _, f| {
            features.push(f.to_device(Device::Cpu));
            Ok(())
        })?;
        Ok(Tensor::cat(&features, 0))
    }

    /// Integrates `model` from the latents in batches, handing `sink` each batch's first index,
    /// its samples `Φ` and their descriptors `Ψ(Φ)` (on the model's device). A non-finite
    /// result is an error naming `what`.
    fn integrate_student(
        &self,
        model: &Model,
        what: &str,
        sink: &mut dyn FnMut(i64, &Tensor, &Tensor) -> Result<(), PfdError>,
    ) -> Result<(), PfdError> {
        let mut den = ModelDenoiser::new(model);
        integrate_all(
            &mut den,
            &self.latents,
            &self.schedule,
            self.batch,
            None,
            &mut |start, x| {
                let f = describe(self.descriptor.as_ref(), &x)?;
                sink(start, &x, &f)
            },
        )
        .map_err(|e| match e {
            PfdError::Sampler(SamplerError::NonFinite { .. }) => {
                PfdError::NonFinite(what.to_string())
            }
            e => e,
        })
    }

    /// The teacher's `Ψ(Φ)`, `[M,k]`, when a teacher is configured.
    pub fn teacher_features(&self) -> Option<&Tensor> {
        self.teacher.as_ref().map(|t| &t.features)
    }
}

fn normalize(f: &Tensor) -> Tensor {
    let norms = f
        .square()
        .sum_dim_intlist(1, true, Kind::Double)
        .sqrt()
        .clamp_min(1e-12);
    f / norms
}

fn memorization_test(
    config: &MemorizationConfig,
    train: &Tensor,
    nearest: EmpiricalDenoiser,
    descriptor: Option<&Descriptor>,
    batch: usize,
) -> Result<Memorization, PfdError> {
    let threshold = config.threshold();
    match config.criterion {
        MemorizationCriterion::NnRatio => Ok(Memorization::NnRatio(threshold, nearest)),
        MemorizationCriterion::Cosine => {
            let Some(descriptor) = descriptor else {
                return Err(PfdError::Invalid(
                    "memorization.criterion: `cosine` needs pfd.descriptor".into(),
                ));
            };
            let n = train.size()[0];
            let mut parts = Vec::new();
            let mut start = 0;
            while start < n {
                let len = (batch as i64).min(n - start);
                parts.push(normalize(&descriptor.apply(&train.narrow(0, start, len))?));
                start += len;
            }
            Ok(Memorization::Cosine(threshold, Tensor::cat(&parts, 0)))
        }
    }
}
