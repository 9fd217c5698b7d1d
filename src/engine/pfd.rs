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

use crate::config::{
    Config, MemorizationConfig, MemorizationCriterion, PfdConfig, TailConfig, TailReference,
};
use crate::engine::data::{DataError, ImageSet};
use crate::engine::model::{Model, ModelError};
use crate::engine::progress::Progress;
use crate::engine::sampler::{
    self, Denoiser, EmpiricalDenoiser, ModelDenoiser, SamplerError, Schedule, integrate_all,
};
use crate::engine::tail::{self, TailError, TailMetrics};
use serde_json::json;
use sha2::{Digest, Sha256};
use std::io::Read;
use std::path::{Path, PathBuf};
use tch::{Device, Kind, Tensor};

#[derive(Debug, thiserror::Error)]
pub enum PfdError {
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error(transparent)]
    Data(#[from] DataError),
    #[error(transparent)]
    Sampler(#[from] SamplerError),
    #[error(transparent)]
    Tail(#[from] TailError),
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: {source}")]
    Hdf5 {
        path: PathBuf,
        #[source]
        source: hdf5::Error,
    },
    #[error("{path}: {message}")]
    File { path: PathBuf, message: String },
    #[error("{path}: descriptor: {what}: {source}")]
    DescriptorTorch {
        path: PathBuf,
        what: &'static str,
        #[source]
        source: tch::TchError,
    },
    #[error("{path}: descriptor: {message}")]
    Descriptor { path: PathBuf, message: String },
    #[error("{0}")]
    Invalid(String),
    #[error("{0}: the student's PF-ODE produced non-finite values: the weights are broken")]
    NonFinite(String),
}

impl PfdError {
    /// The model error inside, when there is one (the teacher's).
    pub fn model(&self) -> Option<&ModelError> {
        match self {
            PfdError::Model(e) => Some(e),
            _ => None,
        }
    }
}

fn io_error(path: &Path) -> impl FnOnce(std::io::Error) -> PfdError {
    let path = path.to_path_buf();
    move |source| PfdError::Io { path, source }
}

/// Hex SHA-256 of a file's content.
pub fn file_sha256(path: &Path) -> Result<String, PfdError> {
    let mut file = std::fs::File::open(path).map_err(io_error(path))?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file.read(&mut buf).map_err(io_error(path))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(hex(&hasher.finalize()))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

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

    fn apply(&self, x: &Tensor) -> Result<Tensor, PfdError> {
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
fn describe(descriptor: Option<&Descriptor>, x: &Tensor) -> Result<Tensor, PfdError> {
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
    fn identity(samples: Tensor) -> Flow {
        let features = samples.flatten(1, -1);
        Flow { samples, features }
    }
}

/// Where cached flows and latents live: `<state_dir>/cache`.
struct Cache {
    dir: PathBuf,
}

impl Cache {
    fn path(&self, kind: &str, key: &serde_json::Value) -> PathBuf {
        let digest = hex(&Sha256::digest(key.to_string().as_bytes()));
        self.dir.join(format!("{kind}-{}.h5", &digest[..16]))
    }

    /// The datasets of a cache file whose recorded key is `key`; `None` (with a log line) when
    /// the file is absent, unreadable, or was built for another key.
    fn load(&self, kind: &str, key: &serde_json::Value, names: &[&str]) -> Option<Vec<Tensor>> {
        let path = self.path(kind, key);
        if !path.exists() {
            return None;
        }
        match read_cache(&path, key, names) {
            Ok(tensors) => {
                tracing::info!(cache = %path.display(), "{kind}: reusing the cache");
                Some(tensors)
            }
            Err(message) => {
                tracing::warn!(cache = %path.display(), "{kind}: cache unusable, rebuilding: {message}");
                None
            }
        }
    }

    /// Writes datasets atomically (temporary file, fsync, rename).
    fn store(
        &self,
        kind: &str,
        key: &serde_json::Value,
        data: &[(&str, &Tensor)],
    ) -> Result<(), PfdError> {
        crate::store::safe_fs::create_private_dir(&self.dir).map_err(io_error(&self.dir))?;
        let path = self.path(kind, key);
        if let Some(name) = path.file_name() {
            // Leftovers of a crash mid-write (and links planted at those names).
            crate::store::safe_fs::remove_leftover_temps(&self.dir, &name.to_string_lossy());
        }
        write_h5_atomically(&path, |tmp| write_cache(tmp, Some(key), data))?;
        tracing::info!(cache = %path.display(), "{kind}: cached");
        Ok(())
    }
}

/// Writes `data` as datasets of a new HDF5 file, with the cache `key` as an attribute when given.
fn write_cache(
    path: &Path,
    key: Option<&serde_json::Value>,
    data: &[(&str, &Tensor)],
) -> hdf5::Result<()> {
    let file = hdf5::File::create(path)?;
    if let Some(key) = key {
        let key: hdf5::types::VarLenUnicode =
            key.to_string().parse().expect("JSON has no NUL byte");
        file.new_attr::<hdf5::types::VarLenUnicode>()
            .create("key")?
            .write_scalar(&key)?;
    }
    for (name, t) in data {
        let shape: Vec<usize> = t.size().iter().map(|&d| d as usize).collect();
        let t = t.to_device(Device::Cpu).contiguous();
        match t.kind() {
            Kind::Float => {
                let v = Vec::<f32>::try_from(t.flatten(0, -1)).expect("f32 tensor");
                let a = ndarray::ArrayD::from_shape_vec(shape, v).expect("shape");
                file.new_dataset_builder().with_data(&a).create(*name)?;
            }
            _ => {
                let v = Vec::<f64>::try_from(t.to_kind(Kind::Double).flatten(0, -1))
                    .expect("f64 tensor");
                let a = ndarray::ArrayD::from_shape_vec(shape, v).expect("shape");
                file.new_dataset_builder().with_data(&a).create(*name)?;
            }
        }
    }
    file.close()
}

fn read_cache(path: &Path, key: &serde_json::Value, names: &[&str]) -> Result<Vec<Tensor>, String> {
    let file = hdf5::File::open(path).map_err(|e| e.to_string())?;
    let stored: hdf5::types::VarLenUnicode = file
        .attr("key")
        .and_then(|a| a.read_scalar())
        .map_err(|e| format!("no key: {e}"))?;
    if stored.as_str() != key.to_string().as_str() {
        return Err("built for other inputs".into());
    }
    names
        .iter()
        .map(|name| {
            let ds = file.dataset(name).map_err(|e| format!("`{name}`: {e}"))?;
            let shape: Vec<i64> = ds.shape().iter().map(|&d| d as i64).collect();
            let t = match ds.dtype().map_err(|e| e.to_string())?.size() {
                4 => Tensor::from_slice(&ds.read_raw::<f32>().map_err(|e| e.to_string())?),
                _ => Tensor::from_slice(&ds.read_raw::<f64>().map_err(|e| e.to_string())?),
            };
            Ok(t.view(shape.as_slice()))
        })
        .collect()
}

/// Reads `/latents` `[M,C,H,W]` (float) from `path`, checked against the image shape.
pub fn read_latents(path: &Path, image_shape: Option<[usize; 3]>) -> Result<Tensor, PfdError> {
    let set = ImageSet::open_samples(path, "latents")?;
    if let Some(shape) = image_shape
        && set.image_shape() != shape
    {
        return Err(PfdError::File {
            path: path.to_path_buf(),
            message: format!(
                "/latents hold images of shape {:?}, the model's images are {shape:?}",
                set.image_shape()
            ),
        });
    }
    Ok(set.read_all()?)
}

/// Writes samples `[M,C,H,W]` as float32 `/samples` (temporary file, then rename).
pub fn write_samples(path: &Path, samples: &Tensor) -> Result<(), PfdError> {
    let t = samples.to_kind(Kind::Float);
    write_h5_atomically(path, |tmp| write_cache(tmp, None, &[("samples", &t)]))
}

/// Writes an HDF5 file at `path` through `write` on a temporary file, then renames it into
/// place. The temporary file is created exclusively (O_EXCL|O_NOFOLLOW) under a random name
/// before HDF5 opens it again by path: that path cannot be swapped for a link in between, its
/// name being unpredictable, and `persist` checks that the file renamed is the one created.
fn write_h5_atomically(
    path: &Path,
    write: impl FnOnce(&Path) -> hdf5::Result<()>,
) -> Result<(), PfdError> {
    let (file, tmp) = crate::store::safe_fs::temp_file(path).map_err(io_error(path))?;
    let result = write(&tmp)
        .map_err(|source| PfdError::Hdf5 {
            path: tmp.clone(),
            source,
        })
        .and_then(|_| crate::store::safe_fs::persist(&file, &tmp, path).map_err(io_error(path)));
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

/// The fixed latents and their identity in cache keys: `pfd.latents`'s content, or `pfd.samples`
/// standard normals from `pfd.seed` (generated on the CPU so every device sees the same ones).
fn latents(
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
fn compute_flow(
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
fn reference_flow(
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
    /// empirical flow of the training images `train` (`[N,C,H,W]` f32 on `device`).
    pub fn new(config: &Config, train: &Tensor, device: Device) -> Result<PfdProbe, PfdError> {
        Self::build(config, train, device, true)
    }

    /// Latents, descriptor and teacher flow only (for the offline bias–variance decomposition).
    pub fn teacher_only(
        config: &Config,
        train: &Tensor,
        device: Device,
    ) -> Result<PfdProbe, PfdError> {
        Self::build(config, train, device, false)
    }

    fn build(
        config: &Config,
        train: &Tensor,
        device: Device,
        full: bool,
    ) -> Result<PfdProbe, PfdError> {
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
        let empirical = if full {
            let source = json!({
                "data_sha256": file_sha256(&data.path)?,
                "dataset": data.dataset,
            });
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

/// The offline bias–variance decomposition of E_gen over students trained on independent data
/// (docs/design.md §5, PFD paper App. B.3).
#[derive(Debug, Clone, serde::Serialize)]
pub struct BiasVariance {
    pub students: Vec<StudentError>,
    pub e_bias: f64,
    pub e_var: f64,
    /// `mean_k E_gen,k²`, which equals `E_bias² + E_var`.
    pub mean_e_gen_squared: f64,
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct StudentError {
    pub checkpoint: String,
    pub e_gen: f64,
}

/// `t`: teacher descriptors `[M,k]`; `students`: each student's `[M,k]` (float64, CPU).
pub fn bias_variance(t: &Tensor, students: &[(String, Tensor)]) -> Result<BiasVariance, PfdError> {
    if students.len() < 2 {
        return Err(PfdError::Invalid(
            "bias-variance needs at least two students".into(),
        ));
    }
    let m = t.size()[0] as f64;
    let k = students.len() as f64;
    let stacked = Tensor::stack(
        &students
            .iter()
            .map(|(_, f)| f.shallow_clone())
            .collect::<Vec<_>>(),
        0,
    );
    let mean = stacked.mean_dim(0, false, Kind::Double);
    let rows = students
        .iter()
        .map(|(name, f)| StudentError {
            checkpoint: name.clone(),
            e_gen: ((f - t).square().sum(Kind::Double).double_value(&[]) / m).sqrt(),
        })
        .collect::<Vec<_>>();
    let e_bias = ((t - &mean).square().sum(Kind::Double).double_value(&[]) / m).sqrt();
    let e_var = (stacked - mean.unsqueeze(0))
        .square()
        .sum(Kind::Double)
        .double_value(&[])
        / (m * k);
    let mean_e_gen_squared = rows.iter().map(|r| r.e_gen * r.e_gen).sum::<f64>() / k;
    Ok(BiasVariance {
        students: rows,
        e_bias,
        e_var,
        mean_e_gen_squared,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bias_variance_identity_holds_on_random_features() {
        tch::manual_seed(1);
        let t = Tensor::randn([50, 7], (Kind::Double, Device::Cpu));
        let students: Vec<(String, Tensor)> = (0..4)
            .map(|k| {
                let f = &t + Tensor::randn([50, 7], (Kind::Double, Device::Cpu)) * 0.3 + 0.1;
                (format!("s{k}"), f)
            })
            .collect();
        let bv = bias_variance(&t, &students).unwrap();
        let rhs = bv.e_bias * bv.e_bias + bv.e_var;
        assert!(
            (bv.mean_e_gen_squared - rhs).abs() <= 1e-12 * rhs,
            "{} vs {rhs}",
            bv.mean_e_gen_squared
        );
    }

    #[test]
    fn cache_round_trips_and_rejects_another_key() {
        let dir = tempfile::tempdir().unwrap();
        let cache = Cache {
            dir: dir.path().join("cache"),
        };
        let key = json!({"a": 1});
        let t = Tensor::from_slice(&[1.0f64, 2.0, 3.0, 4.0]).view([2, 2]);
        cache.store("flow", &key, &[("features", &t)]).unwrap();
        let back = cache.load("flow", &key, &["features"]).unwrap();
        assert_eq!(back[0], t);
        // Same file name, other content of the key: refused.
        let path = cache.path("flow", &key);
        let other = json!({"a": 2});
        assert!(read_cache(&path, &other, &["features"]).is_err());
        // A truncated file is refused, not used.
        let len = std::fs::metadata(&path).unwrap().len();
        let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        f.set_len(len / 2).unwrap();
        assert!(cache.load("flow", &key, &["features"]).is_none());
    }

    #[test]
    fn cache_and_sample_writes_never_follow_links_at_temporary_names() {
        let dir = tempfile::tempdir().unwrap();
        let victim = dir.path().join("victim");
        std::fs::write(&victim, "precious").unwrap();
        let cache = Cache {
            dir: dir.path().join("cache"),
        };
        std::fs::create_dir(&cache.dir).unwrap();
        let key = json!({"a": 1});
        let path = cache.path("flow", &key);
        let name = path.file_name().unwrap().to_str().unwrap().to_string();
        // The old names: `<cache>.h5.tmp-<pid>` and, for samples, `<file>.h5.tmp`.
        let link = |at: PathBuf| std::os::unix::fs::symlink(&victim, at).unwrap();
        link(
            cache
                .dir
                .join(format!("{}.tmp-{}", name, std::process::id())),
        );
        let t = Tensor::from_slice(&[1.0f64, 2.0]);
        cache.store("flow", &key, &[("features", &t)]).unwrap();
        assert_eq!(cache.load("flow", &key, &["features"]).unwrap()[0], t);
        let samples = dir.path().join("samples.h5");
        link(dir.path().join("samples.h5.tmp"));
        write_samples(
            &samples,
            &Tensor::zeros([1, 1, 2, 2], (Kind::Float, Device::Cpu)),
        )
        .unwrap();
        assert!(samples.is_file());
        assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious");
    }
}
