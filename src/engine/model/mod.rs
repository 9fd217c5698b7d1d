//! The model runtime: a TorchScript architecture of the model contract (docs/design.md §11) on a
//! device, checked at load time, and checkpoint weights loaded into it by name, parameters and
//! buffers alike. A `Model` owns libtorch objects and is confined to the thread that made it.

//!
//! Files: `error.rs` (why a model cannot be loaded or run), `module.rs` (the TorchScript module
//! through the C++ shim), `device.rs` (the device, and files that pin one), this file (the
//! `Model`: the contract check, weights by name, the forward in batches that fit), `gpu.rs` (the
//! GPU time and memory of the forward passes, and their limits), `compiled.rs` (the compiled
//! network: an AOTInductor package vetted, loaded and given each checkpoint's weights),
//! `note.rs` (what the exporter recorded in the architecture file), `consistency.rs` (the
//! parameterization check on a checkpoint's trained weights).

pub mod compiled;
pub mod consistency;
mod device;
mod error;
mod gpu;
mod module;
mod note;
mod raw;

pub use device::{check_pins, pinned_devices, pins_problem, select_device};
pub use error::ModelError;
pub use gpu::{GpuLimits, GpuUse};
pub use module::PinnedDevice;
pub use note::{Condition, ExportNote, Family, FlowPath, NOTE_VERSION, NetworkNote, export_note};

use crate::config::{CompiledSetting, Precision};
use crate::weights::{self, Naming, RawTensor, ReadOptions};
use module::{ForwardFailure, Module, set_tf32};
use note::{checked_note, non_persistent_buffers};
use std::collections::HashMap;
use std::path::Path;
use tch::{Device, Kind, Tensor};

/// What the load-time contract check found.
#[derive(Debug, Clone, PartialEq)]
pub struct ContractInfo {
    /// Shape of the features of one image: `[d]` or `[C',H',W']`.
    pub feature_shape: Vec<i64>,
    /// Feature dimension after mean-pooling: `d` or `C'`.
    pub feature_dim: usize,
}

/// The denoiser of the model contract with its weights.
pub struct Model {
    module: Module,
    device: Device,
    /// Parameters and buffers by name, aliasing the module's storage.
    tensors: Vec<(String, Tensor)>,
    /// How many of `tensors` (the first ones) are parameters.
    params: usize,
    index: HashMap<String, usize>,
    /// Indices of `tensors` that checkpoints do not hold: the non-persistent buffers the
    /// exporter lists in the architecture (they keep the architecture's values).
    optional: std::collections::HashSet<usize>,
    /// Names and shapes of `tensors`, for the readers' checks before reading a checkpoint.
    expected: std::sync::Arc<weights::Expected>,
    /// The most images one forward call takes (halved when memory runs out, [`Model::forward`]).
    batch_limit: std::cell::Cell<i64>,
    /// `evaluation.precision` ([`Model::set_precision`]).
    precision: Precision,
    /// `evaluation.gpu_share` and `evaluation.gpu_memory_mib` ([`Model::set_gpu_limits`]).
    gpu_limits: GpuLimits,
    /// The memory cap `batch_limit` was sized for, and whether it stopped growing under it.
    sized_for: std::cell::Cell<Option<(i64, bool)>>,
    /// The batch limit never grows past this: half of a batch that ran out of memory.
    ceiling: std::cell::Cell<i64>,
    /// GPU seconds of the forward passes since [`Model::begin_evaluation`].
    gpu_seconds: std::cell::Cell<f64>,
    /// The highest reservation seen since [`Model::begin_evaluation`] before a peak was reset.
    peak_seen: std::cell::Cell<i64>,
    /// The compiled package that runs the forward passes in its precision
    /// ([`Model::use_compiled`]); TorchScript when `None`.
    compiled: Option<compiled::Package>,
    /// Which format runs and why.
    format: String,
}

impl Model {
    /// Loads the architecture on `device` (its own initial weights stay until a checkpoint is loaded).
    ///
    /// A file whose graph pins another device than `device` is refused
    /// ([`ModelError::PinnedDevice`]); one that pins `device` itself is loaded, with a warning.
    pub fn load(path: &Path, device: Device) -> Result<Model, ModelError> {
        let note = checked_note(path)?;
        let module = Module::load(path, device)?;
        check_pins(path, &module.device_constants()?, device)?;
        if device == Device::Cpu {
            // Not on a GPU: there it did not pay (BENCHMARKS.md, "GPU").
            let changed = module
                .use_channels_last()
                .map_err(|message| ModelError::Load {
                    path: path.to_path_buf(),
                    message: format!(
                        "its weights cannot be put in the channels-last layout: {message}"
                    ),
                })?;
            tracing::debug!(architecture = %path.display(), weights = changed, "channels-last layout");
        }
        let (tensors, params) = module.named_tensors()?;
        let index: HashMap<String, usize> = tensors
            .iter()
            .enumerate()
            .map(|(i, (n, _))| (n.clone(), i))
            .collect();
        let optional = non_persistent_buffers(note.as_ref())
            .iter()
            .filter_map(|n| index.get(n).copied())
            .filter(|&i| i >= params)
            .collect();
        let expected = std::sync::Arc::new(weights::Expected::new(
            tensors.iter().map(|(n, t)| {
                let shape = t.size().iter().map(|&d| d.max(0) as u64).collect();
                (n.clone(), shape, t.kind().elt_size_in_bytes() as u64)
            }),
            params,
        ));
        Ok(Model {
            module,
            device,
            tensors,
            params,
            index,
            optional,
            expected,
            batch_limit: std::cell::Cell::new(i64::MAX),
            precision: Precision::Fp32,
            gpu_limits: GpuLimits::default(),
            sized_for: std::cell::Cell::new(None),
            ceiling: std::cell::Cell::new(i64::MAX),
            gpu_seconds: std::cell::Cell::new(0.0),
            peak_seen: std::cell::Cell::new(0),
            compiled: None,
            format: "TorchScript".into(),
        })
    }

    /// Runs the compiled package `model.compiled` gives for this device and the current
    /// precision ([`compiled::decide`]) from now on, the architecture's current weights copied
    /// into it; returns which format runs and why. A package that fits neither this machine nor
    /// the architecture is an error under a path and a warning (TorchScript runs) under `auto`.
    /// Loaded once: a second call with the same package keeps it.
    pub fn use_compiled(&mut self, setting: &CompiledSetting) -> Result<&str, ModelError> {
        let decision = compiled::decide(setting, self.path(), self.device, self.precision)?;
        let Some((path, vetted)) = decision.package else {
            if decision.fell_back {
                tracing::warn!("{}", decision.why);
            }
            self.compiled = None;
            self.format = decision.why;
            return Ok(&self.format);
        };
        if self.compiled.as_ref().is_some_and(|c| c.path == path) {
            return Ok(&self.format);
        }
        // On trial from before libtorch opens it until it has run an evaluation through
        // (`crate::store::package_trial`): a package that crashes the process is not loaded
        // at every start.
        let rebuild = vetted.sidecar.rebuild.clone();
        let refuse = |reason: String| compiled::Refusal {
            package: path.clone(),
            reason,
            rebuild: rebuild.clone(),
        };
        let loaded = crate::store::package_trial::begin(&path)
            .map_err(refuse)
            .and_then(|()| compiled::Package::load(&path, vetted, self.device))
            .and_then(|p| self.push_weights(&p).map_err(refuse).map(|()| p));
        if loaded.is_err() {
            crate::store::package_trial::end(); // refused, not crashed
        }
        match loaded {
            Ok(p) => {
                self.compiled = Some(p);
                self.format = decision.why;
            }
            Err(refusal) if matches!(setting, CompiledSetting::Path(_)) => {
                return Err(ModelError::Compiled {
                    path,
                    message: refusal.to_string(),
                });
            }
            Err(refusal) => {
                self.compiled = None;
                self.format = format!("TorchScript (model.compiled: auto; {refusal})");
                tracing::warn!("{}", self.format);
            }
        }
        Ok(&self.format)
    }

    /// Which format runs the forward passes, and why ([`Model::use_compiled`]).
    pub fn format(&self) -> &str {
        &self.format
    }

    /// The compiled package that runs the forward passes, `None` for TorchScript.
    pub fn compiled_path(&self) -> Option<&Path> {
        self.compiled.as_ref().map(|c| c.path.as_path())
    }

    /// Copies the architecture's current weights into `package`: every weight it takes must be
    /// a parameter or buffer of the architecture (else it was compiled from another network).
    fn push_weights(&self, package: &compiled::Package) -> Result<(), String> {
        let mut weights = Vec::with_capacity(package.names.len());
        for name in &package.names {
            let Some(&i) = self.index.get(name) else {
                return Err(format!(
                    "it takes the weight `{}`, which the architecture {} does not have",
                    weights::quote(name),
                    self.path().display()
                ));
            };
            // Contiguous: the package copies the bytes it is given with their strides, and its
            // kernels read the layout they were compiled for.
            weights.push((name.as_str(), self.tensors[i].1.contiguous()));
        }
        let weights: Vec<(&str, &Tensor)> = weights.iter().map(|(n, t)| (*n, t)).collect();
        package
            .load_weights(&weights)
            .map_err(|e| format!("its weights cannot be replaced: {e}"))
    }

    /// One forward call of the format that runs: the compiled package where it serves the
    /// precision, else the TorchScript module.
    fn run(&self, x: &Tensor, sigma: &Tensor) -> Result<(Tensor, Tensor), ForwardFailure> {
        match &self.compiled {
            Some(p) if p.serves(self.precision) => p.forward(x, sigma),
            _ => self.module.forward(x, sigma, self.bf16()),
        }
    }

    /// The arithmetic of the forward passes from now on (`evaluation.precision`): bf16 runs
    /// them under bfloat16 autocast; tf32 allows TF32 in cuDNN and cuBLAS, a process-wide
    /// setting of libtorch's (fp32, the default, keeps it off: `select_device`).
    pub fn set_precision(&mut self, precision: Precision) {
        set_tf32(precision == Precision::Tf32);
        self.precision = precision;
    }

    pub fn precision(&self) -> Precision {
        self.precision
    }

    /// The share of the GPU's time and the memory the forward passes may take from now on
    /// (CUDA only: on the CPU they are not used). A new memory cap sizes the batches anew at the
    /// next forward.
    pub fn set_gpu_limits(&mut self, limits: GpuLimits) {
        self.gpu_limits = limits;
    }

    /// The CUDA device's index, `None` on the CPU.
    fn cuda(&self) -> Option<usize> {
        match self.device {
            Device::Cuda(i) => Some(i),
            _ => None,
        }
    }

    /// Starts counting an evaluation's GPU time and memory peak (nothing on the CPU).
    pub fn begin_evaluation(&self) {
        if let Some(i) = self.cuda() {
            self.gpu_seconds.set(0.0);
            self.peak_seen.set(0);
            if let Err(e) = gpu::reset_peak(i) {
                tracing::warn!("cannot reset CUDA's memory peak: {e}");
            }
        }
    }

    /// What the evaluation since [`Model::begin_evaluation`] took of the GPU (`None` on the
    /// CPU); the allocator's cache is given back to the GPU, for the training to use until the
    /// next evaluation.
    pub fn end_evaluation(&self) -> Option<GpuUse> {
        let i = self.cuda()?;
        let peak = gpu::memory(i).map(|m| m.reserved_peak.max(self.peak_seen.get()));
        if let Err(e) = gpu::release_cached() {
            tracing::warn!("cannot give CUDA's cached memory back: {e}");
        }
        Some(GpuUse {
            seconds: self.gpu_seconds.get(),
            memory_peak_bytes: peak
                .inspect_err(|e| tracing::warn!("cannot read CUDA's memory peak: {e}"))
                .unwrap_or(0),
        })
    }

    pub fn device(&self) -> Device {
        self.device
    }

    fn bf16(&self) -> bool {
        self.precision == Precision::Bf16
    }

    pub fn path(&self) -> &Path {
        &self.module.path
    }

    /// The current value of a parameter or buffer (sharing its storage), by name.
    pub fn tensor(&self, name: &str) -> Option<Tensor> {
        self.index
            .get(name)
            .map(|&i| self.tensors[i].1.shallow_clone())
    }

    /// Names and shapes of the parameters and buffers, in module order.
    pub fn state_shapes(&self) -> Vec<(String, Vec<i64>)> {
        self.tensors
            .iter()
            .map(|(n, t)| (n.clone(), t.size()))
            .collect()
    }

    /// `D(x; sigma)` and the features, for `x: [B,C,H,W]` f32 and `sigma: [B]` f32 on the model's device.
    ///
    /// When memory runs out (a batch too large for the GPU), the batch is split in halves, and
    /// again, down to one image; the limit found holds for every later call of this model, and
    /// a warning says so. The inputs, and so the numbers, stay those of the whole batch: only
    /// how many images go through the network at once changes.
    ///
    /// Under a memory cap (`evaluation.gpu_memory_mib`, CUDA), the batch starts small and grows
    /// while it fits ([`Model::forward_once`]); a forward that reserved more than the cap is done
    /// again in halves, as when memory runs out.
    pub fn forward(&self, x: &Tensor, sigma: &Tensor) -> Result<(Tensor, Tensor), ModelError> {
        let n = x.size().first().copied().unwrap_or(0);
        self.size_for_cap();
        loop {
            match self.forward_in_chunks(x, sigma, n) {
                Ok(out) => return Ok(out),
                Err(f) if f.out_of_memory && f.images > 1 => {
                    let (chunk, smaller) = (f.images, f.images / 2);
                    let why = if f.over_cap {
                        format!("{} in a forward of {chunk} images", f.message)
                    } else {
                        format!("out of memory in a forward of {chunk} images")
                    };
                    tracing::warn!(
                        file = %self.module.path.display(),
                        batch = chunk,
                        smaller,
                        "{why}: forwarding at most {smaller} at a time from now on (a smaller \
                         batch; the same numbers)"
                    );
                    self.batch_limit.set(smaller);
                    self.ceiling.set(smaller);
                }
                Err(f) => {
                    return Err(ModelError::Forward {
                        path: self.module.path.clone(),
                        message: f.message,
                    });
                }
            }
        }
    }

    /// The forward of `x` (`n` images) in chunks of at most the batch limit (read before each
    /// chunk: it may grow under a memory cap), concatenated.
    fn forward_in_chunks(
        &self,
        x: &Tensor,
        sigma: &Tensor,
        n: i64,
    ) -> Result<(Tensor, Tensor), ForwardFailure> {
        if self.batch_limit.get() >= n {
            return self.forward_once(x, sigma);
        }
        let (mut denoised, mut features) = (Vec::new(), Vec::new());
        let mut start = 0;
        while start < n {
            let len = self.batch_limit.get().min(n - start);
            let (d, f) =
                self.forward_once(&x.narrow(0, start, len), &sigma.narrow(0, start, len))?;
            denoised.push(d);
            features.push(f);
            start += len;
        }
        Ok((Tensor::cat(&denoised, 0), Tensor::cat(&features, 0)))
    }

    /// A new memory cap (CUDA) starts the batch limit at [`gpu::CAPPED_START`], from where it
    /// grows; a cap removed gives the limit back to what memory allows (the ceiling found when
    /// it ran out, or none).
    fn size_for_cap(&self) {
        let cap = self.gpu_limits.memory_cap.filter(|_| self.cuda().is_some());
        match (cap, self.sized_for.get()) {
            (Some(cap), Some((sized, _))) if sized == cap => {}
            (Some(cap), _) => {
                let start = gpu::CAPPED_START.min(self.ceiling.get());
                self.batch_limit.set(start);
                self.sized_for.set(Some((cap, false)));
            }
            (None, Some(_)) => {
                self.batch_limit.set(self.ceiling.get());
                self.sized_for.set(None);
            }
            (None, None) => {}
        }
    }

    /// [`gpu::reset_peak`], the evaluation's peak so far kept.
    fn reset_peak(&self, i: usize) -> Result<(), String> {
        let peak = gpu::memory(i)?.reserved_peak;
        self.peak_seen.set(self.peak_seen.get().max(peak));
        gpu::reset_peak(i)
    }

    /// One forward call. On CUDA it is synchronized at both ends and timed: its time counts as
    /// GPU time, and is followed by the pause `evaluation.gpu_share` asks for. Under a memory
    /// cap, the memory it took is measured: above the cap it fails as `over_cap` (done again in
    /// halves); after a full batch, the limit doubles while twice its memory fits
    /// ([`gpu::grown_batch`]), and stays once it does not.
    fn forward_once(&self, x: &Tensor, sigma: &Tensor) -> Result<(Tensor, Tensor), ForwardFailure> {
        let Some(i) = self.cuda() else {
            return self.run(x, sigma);
        };
        let images = x.size().first().copied().unwrap_or(0);
        let cap = self.gpu_limits.memory_cap;
        tch::Cuda::synchronize(i as i64);
        let before = match cap {
            Some(_) => self.reset_peak(i).and_then(|()| gpu::memory(i)).ok(),
            None => None,
        };
        let started = std::time::Instant::now();
        let out = self.run(x, sigma)?;
        tch::Cuda::synchronize(i as i64);
        let busy = started.elapsed();
        self.gpu_seconds
            .set(self.gpu_seconds.get() + busy.as_secs_f64());
        std::thread::sleep(gpu::pause_after(busy, self.gpu_limits.share));
        let (Some(cap), Some(before), Ok(after)) = (cap, before, gpu::memory(i)) else {
            return Ok(out);
        };
        if after.reserved_peak > cap && images > 1 {
            // Given back, so the smaller batches start under the cap.
            drop(out);
            let _ = gpu::release_cached();
            return Err(ForwardFailure {
                message: format!(
                    "{} MiB reserved, over evaluation.gpu_memory_mib ({} MiB)",
                    after.reserved_peak >> 20,
                    cap >> 20
                ),
                out_of_memory: true,
                over_cap: true,
                images,
            });
        }
        let took = after.allocated_peak - before.allocated;
        let settled = self.sized_for.get().is_none_or(|(_, settled)| settled);
        if images == self.batch_limit.get() && images < self.ceiling.get() && !settled {
            match gpu::grown_batch(images, before.allocated, took, cap) {
                Some(grown) => self.batch_limit.set(grown.min(self.ceiling.get())),
                None => {
                    self.sized_for.set(Some((cap, true)));
                    tracing::info!(
                        file = %self.module.path.display(),
                        cap_mib = cap >> 20,
                        allocated_mib = before.allocated >> 20,
                        took_mib = took >> 20,
                        "evaluation.gpu_memory_mib: forwarding at most {images} images at a time"
                    );
                }
            }
        }
        Ok(out)
    }

    /// Runs the model on two noisy images of `image_shape` `[C,H,W]` and checks the outputs'
    /// shapes against the contract.
    pub fn check_contract(&self, image_shape: &[i64]) -> Result<ContractInfo, ModelError> {
        let contract = |message: String| ModelError::Contract {
            path: self.module.path.clone(),
            message,
        };
        let mut shape = vec![2];
        shape.extend_from_slice(image_shape);
        let x = Tensor::zeros(shape.as_slice(), (Kind::Float, self.device));
        let sigma = Tensor::ones([2], (Kind::Float, self.device));
        let (denoised, features) = self.run(&x, &sigma).map_err(|f| {
            // TorchScript's message is a traceback through the traced code: the reason is its
            // last line; the whole of it goes to the debug log.
            tracing::debug!(architecture = %self.module.path.display(), "forward failed: {}", f.message);
            let exported = note::input_shape(&self.module.path)
                .map(|s| format!(" (it was exported for inputs of shape {s:?})"))
                .unwrap_or_default();
            contract(format!(
                "forward(x: {shape:?} f32, sigma: [2] f32) failed{exported}: {}",
                last_line(&f.message)
            ))
        })?;
        if denoised.size() != shape {
            return Err(contract(format!(
                "denoised output has shape {:?}, expected the input's shape {shape:?}",
                denoised.size()
            )));
        }
        let fs = features.size();
        let ok_rank = fs.len() == 2 || fs.len() == 4;
        if !ok_rank || fs[0] != 2 || fs[1] < 1 {
            return Err(contract(format!(
                "features output has shape {fs:?}, expected [B,d] or [B,C',H',W'] with B = 2"
            )));
        }
        for (what, t) in [("denoised", &denoised), ("features", &features)] {
            if !t.is_floating_point() {
                return Err(contract(format!(
                    "{what} output has dtype {:?}, expected a float type",
                    t.kind()
                )));
            }
        }
        Ok(ContractInfo {
            feature_shape: fs[1..].to_vec(),
            feature_dim: fs[1] as usize,
        })
    }

    /// Loads a checkpoint's weights (any format of [`weights::read_weights`]) into the
    /// architecture. All names and shapes are checked before anything is written, so a failed
    /// load leaves the previous weights in place.
    ///
    /// Every format is read as data by [`weights::read_weights`]; libtorch never loads a
    /// checkpoint (only the architecture, the trusted code named in the config). Matching, by the
    /// checkpoint's [`Naming`]:
    ///
    /// - `ByName` (state dicts, safetensors, pickled module trees): the names must be exactly the
    ///   architecture's parameters and buffers. When they are not, but all of them are after
    ///   removing one common prefix (`model.` from Lightning, `module.` from DDP, `_orig_mod.`
    ///   from `torch.compile`, `net.`, ...; the candidates are the checkpoint names' own leading
    ///   dotted components, each tested exactly), that prefix is removed (logged at debug).
    /// - `AttributePaths` (TorchScript archives): parameters, buffers and plain tensor attributes
    ///   look alike, so every parameter and buffer of the architecture must be found with its
    ///   shape and other tensors are ignored.
    /// - `Ordered` (diffusers' EMA `shadow_params`): the list is the architecture's parameters in
    ///   order; the count and every shape must match (a mismatch names the index, the parameter
    ///   and both shapes). The architecture's buffers keep their current values: such a
    ///   checkpoint holds none.
    ///
    /// Memory is bounded by the architecture: the readers get its names and shapes
    /// ([`ReadOptions::expected`]) and check the selected tensors against them before reading a
    /// byte of them (a mismatch found there is [`ModelError::Mismatch`]), and the selected
    /// tensors may take at most `opts.max_total_bytes` in all, by default
    /// [`weights::default_max_total_bytes`] of this architecture.
    pub fn load_weights(
        &mut self,
        checkpoint: &Path,
        opts: &ReadOptions,
    ) -> Result<(), ModelError> {
        let opts = ReadOptions {
            expected: Some(self.expected.clone()),
            max_total_bytes: Some(
                opts.max_total_bytes
                    .unwrap_or_else(|| weights::default_max_total_bytes(&self.expected)),
            ),
            ..opts.clone()
        };
        let read = match weights::read_weights(checkpoint, &opts) {
            Ok(read) => read,
            Err(weights::WeightsError::Mismatch { path, details }) => {
                return Err(ModelError::Mismatch {
                    checkpoint: path,
                    architecture: self.module.path.clone(),
                    details,
                });
            }
            Err(e) => return Err(e.into()),
        };
        let targets: Vec<(usize, &RawTensor)> = match read.naming {
            Naming::Ordered => self.check_ordered(checkpoint, &read.state.tensors)?,
            Naming::AttributePaths => {
                let state: Vec<&(String, RawTensor)> = read
                    .state
                    .tensors
                    .iter()
                    .filter(|(n, _)| self.index.contains_key(n))
                    .collect();
                self.check_names(
                    checkpoint,
                    state.iter().map(|(n, t)| (n.as_str(), shape_of(t))),
                )?;
                state.iter().map(|(n, t)| (self.index[n], t)).collect()
            }
            Naming::ByName => {
                let prefix = self.detect_prefix(&read.state.tensors);
                if let Some(p) = prefix {
                    tracing::debug!(
                        "{}: tensor names carry the prefix `{}`; removed",
                        checkpoint.display(),
                        weights::quote(p)
                    );
                }
                let strip = |n: &'_ str| -> String {
                    prefix
                        .and_then(|p| n.strip_prefix(p))
                        .unwrap_or(n)
                        .to_string()
                };
                let names: Vec<String> = read.state.tensors.iter().map(|(n, _)| strip(n)).collect();
                self.check_names(
                    checkpoint,
                    names
                        .iter()
                        .zip(&read.state.tensors)
                        .map(|(n, (_, t))| (n.as_str(), shape_of(t))),
                )?;
                names
                    .iter()
                    .zip(&read.state.tensors)
                    .map(|(n, (_, t))| (self.index[n], t))
                    .collect()
            }
        };
        tch::no_grad(|| {
            for (i, raw) in targets {
                let src = raw::view(raw);
                self.tensors[i].1.copy_(&src);
            }
        });
        if let Some(package) = &self.compiled {
            // The same weights into the compiled package (no recompilation, no reload).
            self.push_weights(package)
                .map_err(|message| ModelError::Compiled {
                    path: package.path.clone(),
                    message: format!("{}: {message}", package.path.display()),
                })?;
        }
        Ok(())
    }

    /// The one prefix (ending in `.`) whose removal makes every checkpoint name an architecture
    /// name, when the names do not match as they are. Candidates are the leading dotted
    /// components of the first checkpoint name (`a.`, `a.b.`, ...); each is tested exactly.
    fn detect_prefix<'n>(&self, tensors: &'n [(String, RawTensor)]) -> Option<&'n str> {
        let all_known = |strip: &str| {
            tensors.len() == self.tensors.len() - self.optional.len()
                && tensors.iter().all(|(n, _)| {
                    n.strip_prefix(strip)
                        .is_some_and(|rest| self.index.contains_key(rest))
                })
        };
        if tensors.is_empty() || all_known("") {
            return None;
        }
        let first = &tensors[0].0;
        first
            .match_indices('.')
            .map(|(i, _)| &first[..=i])
            .find(|p| all_known(p))
    }

    /// Maps an ordered list onto the architecture's parameters, checking count and shapes.
    fn check_ordered<'r>(
        &self,
        checkpoint: &Path,
        tensors: &'r [(String, RawTensor)],
    ) -> Result<Vec<(usize, &'r RawTensor)>, ModelError> {
        let mismatch = |details: String| ModelError::Mismatch {
            checkpoint: checkpoint.to_path_buf(),
            architecture: self.module.path.clone(),
            details,
        };
        if tensors.len() != self.params {
            return Err(mismatch(format!(
                "the checkpoint lists {} tensors in parameter order, the architecture has {} \
                 parameters",
                tensors.len(),
                self.params
            )));
        }
        for (i, ((_, raw), (name, t))) in tensors.iter().zip(&self.tensors).enumerate() {
            let (got, want) = (shape_of(raw), t.size());
            if got != want {
                return Err(mismatch(format!(
                    "tensor {i} of the ordered list has shape {got:?}, but parameter {i} ({}) of \
                     the architecture has shape {want:?}",
                    weights::quote(name)
                )));
            }
        }
        Ok(tensors
            .iter()
            .enumerate()
            .map(|(i, (_, t))| (i, t))
            .collect())
    }

    /// One error listing missing, unexpected and shape-mismatched names (first few of each).
    fn check_names<'a>(
        &self,
        checkpoint: &Path,
        found: impl Iterator<Item = (&'a str, Vec<i64>)>,
    ) -> Result<(), ModelError> {
        let mut seen = vec![false; self.tensors.len()];
        let mut unexpected = Vec::new();
        let mut mismatched = Vec::new();
        for (name, shape) in found {
            match self.index.get(name) {
                Some(&i) => {
                    seen[i] = true;
                    let want = self.tensors[i].1.size();
                    if want != shape {
                        mismatched.push(format!(
                            "{}: checkpoint {shape:?}, architecture {want:?}",
                            weights::quote(name)
                        ));
                    }
                }
                None => unexpected.push(weights::quote(name)),
            }
        }
        let missing: Vec<String> = self
            .tensors
            .iter()
            .zip(&seen)
            .enumerate()
            .filter(|(i, (_, s))| !**s && !self.optional.contains(i))
            .map(|(_, ((n, _), _))| n.clone())
            .collect();
        if missing.is_empty() && unexpected.is_empty() && mismatched.is_empty() {
            return Ok(());
        }
        let parts = weights::mismatch_parts(&[
            ("missing", &missing),
            ("unexpected", &unexpected),
            ("shape mismatch", &mismatched),
        ]);
        let hint = if !unexpected.is_empty() && !missing.is_empty() {
            "; if the names differ by a prefix such as `module.`, set checkpoints.strip_prefix, \
             and if the weights sit under a key such as `ema`, set checkpoints.weights_key"
        } else {
            ""
        };
        Err(ModelError::Mismatch {
            checkpoint: checkpoint.to_path_buf(),
            architecture: self.module.path.clone(),
            details: format!("{parts}{hint}"),
        })
    }
}

fn shape_of(raw: &RawTensor) -> Vec<i64> {
    raw.shape.iter().map(|&d| d as i64).collect()
}

/// The last non-empty line of an error message (a TorchScript traceback ends with the reason).
fn last_line(message: &str) -> &str {
    message
        .lines()
        .rev()
        .map(str::trim)
        .find(|l| !l.is_empty())
        .unwrap_or(message)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    /// A file whose exporter's note records a zero-sized condition embedding is refused at load,
    /// naming the file, before libtorch reads it (issue #45).
    #[test]
    fn a_zero_sized_condition_embedding_is_refused_at_load() {
        let dir = tempfile::tempdir().unwrap();
        let note = |shape: &str| {
            let path = dir.path().join(format!("m{}.ts", shape.len()));
            let mut z = zip::ZipWriter::new(std::fs::File::create(&path).unwrap());
            z.start_file(
                "m/extra/diffmon.json",
                zip::write::SimpleFileOptions::default(),
            )
            .unwrap();
            write!(
                z,
                "{{\"condition\": {{\"kind\": \"embedding\", \"keyword\": \"e\", \"shape\": {shape}}}}}"
            )
            .unwrap();
            z.finish().unwrap();
            path
        };
        let empty = note("[1, 0, 8]");
        let e = checked_note(&empty).unwrap_err().to_string();
        assert!(e.contains(&empty.display().to_string()), "{e}");
        assert!(e.contains("zero-sized"), "{e}");
        assert!(Model::load(&empty, Device::Cpu).is_err());
        assert!(checked_note(&note("[1, 77, 768]")).is_ok());
    }
}
