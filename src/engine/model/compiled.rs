//! The compiled network (docs/design.md §11, "The compiled network"): an AOTInductor package
//! (`.pt2`, written by `diffmon-export --compile`) of the same architecture as the TorchScript
//! file. `model.compiled` chooses it ([`decide`]); before libtorch loads it (a package holds a
//! shared object: native code) it is vetted ([`vet`]): its owner and mode (trusted like the
//! architecture file, never like a checkpoint), then its sidecar (`model.pt2.json`): the torch
//! release, the device kind, the CPU's instruction-set flags, the precision and the SHA-256 of
//! the architecture it was compiled from. Loaded through the C++ shim's
//! `AOTIModelPackageLoader` ([`Package`]), it gets each checkpoint's weights by name
//! (`load_constants`: no recompilation, no reload). The raw handle is not `Send`.

mod files;

use super::error::ModelError;
use super::module::{ForwardFailure, is_out_of_memory, shorten, take_error, take_full_error};
use crate::config::{CompiledSetting, Precision};
use crate::store::safe_fs::untrusted_text;
use files::{CONSTANTS_ARE, PACKAGE_IS, SIDECAR_IS, check_archive, open_trusted, remove_unpacked};
use serde::Deserialize;
use std::ffi::{CStr, CString, c_char, c_int, c_void};
use std::fmt;
use std::fs::File;
use std::io::{Read, Seek};
use std::path::{Path, PathBuf};
use tch::{Device, Tensor};

/// The sidecar's `format`.
pub const FORMAT: &str = "diffmon-aoti/1";
/// The largest sidecar read (it names a few hundred weights).
const SIDECAR_MAX_BYTES: u64 = 4 << 20;

type NameCb = unsafe extern "C" fn(*mut c_void, *const c_char);

unsafe extern "C" {
    fn dm_torch_version() -> *const c_char;
    fn dm_package_load(
        path: *const c_char,
        device_index: c_int,
        err: *mut *mut c_char,
    ) -> *mut c_void;
    fn dm_package_free(package: *mut c_void);
    fn dm_package_weight_names(
        package: *mut c_void,
        data: *mut c_void,
        cb: NameCb,
        err: *mut *mut c_char,
    ) -> c_int;
    fn dm_package_load_weights(
        package: *mut c_void,
        n: c_int,
        names: *const *const c_char,
        tensors: *const *const c_void,
        err: *mut *mut c_char,
    ) -> c_int;
    fn dm_package_forward(
        package: *mut c_void,
        x: *const c_void,
        sigma: *const c_void,
        denoised: *mut *mut c_void,
        features: *mut *mut c_void,
        err: *mut *mut c_char,
    ) -> c_int;
}

/// The libtorch release diffmon runs on (`2.13.0`).
pub fn torch_version() -> String {
    unsafe { CStr::from_ptr(dm_torch_version()) }
        .to_string_lossy()
        .into_owned()
}

/// What `diffmon-export --compile` records beside the package (`model.pt2.json`).
#[derive(Debug, Clone, Deserialize)]
pub struct Sidecar {
    pub format: String,
    /// The torch release that compiled it, without a local suffix (`2.13.0`).
    pub torch: String,
    /// `cpu` or `cuda`.
    pub device: String,
    /// `x86_64`, `aarch64` (CPU); `sm_90` (CUDA).
    #[serde(default)]
    pub arch: String,
    /// The compiling CPU's instruction-set flags (`avx2`, `fma`, ...): Inductor compiles with
    /// `-march=native`, so each must be on the CPU that runs it.
    #[serde(default)]
    pub cpu_flags: Vec<String>,
    /// `fp32` or `bf16` (autocast compiled in).
    pub precision: String,
    /// The batch range of the dynamic batch dimension.
    pub min_batch: i64,
    pub max_batch: i64,
    /// The weights the package takes, by their names in the architecture.
    pub weights: Vec<String>,
    /// Whether the package's shared object holds its weights (packages before the kernels-only
    /// ones): `false`, it reads memory never written until it is given every tensor it takes,
    /// so it is loaded only where the weights and the constants file give them all.
    #[serde(default = "yes")]
    pub weights_inside: bool,
    /// The graph's own constants (a VP schedule's table, a condition), in the file beside the
    /// package ([`constants_path`]), where the package does not hold them.
    #[serde(default)]
    pub constants: Option<Constants>,
    #[serde(default)]
    pub architecture_sha256: String,
    /// The command that rebuilds it.
    #[serde(default)]
    pub rebuild: String,
}

fn yes() -> bool {
    true
}

/// What the sidecar says of the constants file: its SHA-256 and each tensor's dtype and shape
/// (by its name in the package), which the reader checks before it reads a byte.
#[derive(Debug, Clone, Deserialize)]
pub struct Constants {
    pub sha256: String,
    pub tensors: std::collections::BTreeMap<String, ConstantSpec>,
}

/// One constant's dtype (torch's name: `float64`) and shape.
#[derive(Debug, Clone, Deserialize)]
pub struct ConstantSpec {
    pub dtype: String,
    pub shape: Vec<u64>,
}

/// Why a package is not used: what is wrong with it, and how to rebuild it.
#[derive(Debug, Clone)]
pub struct Refusal {
    pub package: PathBuf,
    pub reason: String,
    pub rebuild: String,
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let rebuild = if self.rebuild.is_empty() {
            "the architecture's diffmon-export command with --compile"
        } else {
            &self.rebuild
        };
        // A sidecar's words (its rebuild command, names, versions) are shown escaped.
        write!(
            f,
            "{}: {}. Rebuild it on the machine that evaluates: {}",
            self.package.display(),
            untrusted_text(&self.reason),
            untrusted_text(rebuild)
        )
    }
}

/// The package `auto` looks for: the architecture's name with `.pt2` (`model.ts` → `model.pt2`).
pub fn beside(architecture: &Path) -> PathBuf {
    architecture.with_extension("pt2")
}

/// The sidecar of `package`: `model.pt2.json`.
pub fn sidecar_path(package: &Path) -> PathBuf {
    let mut s = package.as_os_str().to_owned();
    s.push(".json");
    PathBuf::from(s)
}

/// The graph's constants beside `package`: `model.pt2.constants`.
pub fn constants_path(package: &Path) -> PathBuf {
    let mut s = package.as_os_str().to_owned();
    s.push(".constants");
    PathBuf::from(s)
}

/// This CPU's instruction-set flags (Linux's `/proc/cpuinfo`, `flags` or `Features`).
fn cpu_flags() -> &'static std::collections::HashSet<String> {
    static FLAGS: std::sync::OnceLock<std::collections::HashSet<String>> =
        std::sync::OnceLock::new();
    FLAGS.get_or_init(|| {
        let text = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        text.lines()
            .find_map(|l| {
                let (k, v) = l.split_once(':')?;
                matches!(k.trim(), "flags" | "Features").then_some(v)
            })
            .map(|v| v.split_whitespace().map(String::from).collect())
            .unwrap_or_default()
    })
}

fn sha256_of(path: &Path) -> std::io::Result<String> {
    sha256_read(File::open(path)?)
}

fn sha256_read(mut from: impl Read) -> std::io::Result<String> {
    use sha2::Digest;
    let mut hash = sha2::Sha256::new();
    std::io::copy(&mut from, &mut hash)?;
    Ok(format!("{:x}", hash.finalize()))
}

/// The largest `min_batch` a sidecar may name: each forward below it is padded to it.
const MAX_MIN_BATCH: i64 = 4096;

/// Reads the sidecar (trusted like the package, bounded), refusing what is not one.
fn read_sidecar(package: &Path) -> Result<Sidecar, String> {
    let path = sidecar_path(package);
    let file = open_trusted(&path, SIDECAR_IS).map_err(|r| {
        let hint = if std::fs::symlink_metadata(&path).is_err() {
            "; diffmon-export --compile writes both"
        } else {
            ""
        };
        format!("its sidecar {}: {r}{hint}", path.display())
    })?;
    let mut text = String::new();
    file.take(SIDECAR_MAX_BYTES + 1)
        .read_to_string(&mut text)
        .map_err(|e| format!("its sidecar {} cannot be read: {e}", path.display()))?;
    if text.len() as u64 > SIDECAR_MAX_BYTES {
        return Err(format!(
            "its sidecar {} is over {} MiB",
            path.display(),
            SIDECAR_MAX_BYTES >> 20
        ));
    }
    let sidecar: Sidecar = serde_json::from_str(&text)
        .map_err(|e| format!("its sidecar {} is not one: {e}", path.display()))?;
    if sidecar.format != FORMAT {
        return Err(format!(
            "its sidecar {} has format `{}`, this diffmon reads `{FORMAT}`",
            path.display(),
            sidecar.format
        ));
    }
    if !(1..=sidecar.max_batch.min(MAX_MIN_BATCH)).contains(&sidecar.min_batch) {
        return Err(format!(
            "its sidecar {} names the batch range {}..{} (the smallest batch must be 1 to \
             {MAX_MIN_BATCH}, and at most the largest)",
            path.display(),
            sidecar.min_batch,
            sidecar.max_batch
        ));
    }
    Ok(sidecar)
}

/// Whether a package of `precision` (the sidecar's) serves `evaluation.precision`.
fn serves(package_precision: &str, precision: Precision) -> bool {
    match precision {
        Precision::Bf16 => package_precision == "bf16",
        Precision::Fp32 | Precision::Tf32 => package_precision == "fp32",
    }
}

/// A package that passed [`vet`]: its sidecar, and its files, open, as they were checked.
pub struct Vetted {
    pub sidecar: Sidecar,
    package: File,
    /// The archive's entry of the model's shared object ([`check_archive`]).
    object: String,
    constants: Option<File>,
}

/// Everything checked before libtorch opens the package: trust (the sidecar's, then the
/// package's), the sidecar against this machine, the device, the precision and the
/// architecture, then the archive and the constants file.
pub fn vet(
    package: &Path,
    architecture: &Path,
    device: Device,
    precision: Precision,
) -> Result<Vetted, Refusal> {
    let refuse = |reason: String, rebuild: &str| Refusal {
        package: package.to_path_buf(),
        reason,
        rebuild: rebuild.to_string(),
    };
    // A trusted sidecar's rebuild command goes in every refusal, the package's trust check's
    // first.
    let side = read_sidecar(package);
    let rebuild = side.as_ref().map(|s| s.rebuild.clone()).unwrap_or_default();
    let file = open_trusted(package, PACKAGE_IS).map_err(|r| refuse(r, &rebuild))?;
    let side = side.map_err(|r| refuse(r, ""))?;
    let rebuild = side.rebuild.as_str();
    let torch = torch_version();
    if side.torch != torch {
        return Err(refuse(
            format!(
                "compiled by torch {}, and diffmon runs on libtorch {torch}",
                side.torch
            ),
            rebuild,
        ));
    }
    let kind = if device.is_cuda() { "cuda" } else { "cpu" };
    if side.device != kind {
        return Err(refuse(
            format!(
                "compiled for the {} and this evaluation runs on the {kind}",
                side.device
            ),
            rebuild,
        ));
    }
    if kind == "cpu" {
        if side.arch != std::env::consts::ARCH {
            return Err(refuse(
                format!(
                    "compiled for {} and this CPU is {}",
                    side.arch,
                    std::env::consts::ARCH
                ),
                rebuild,
            ));
        }
        let have = cpu_flags();
        let missing: Vec<&str> = side
            .cpu_flags
            .iter()
            .filter(|f| !have.contains(*f))
            .map(String::as_str)
            .collect();
        if !missing.is_empty() {
            return Err(refuse(
                format!(
                    "compiled on a CPU with instructions this one lacks ({}): its code could \
                     stop on an illegal instruction",
                    missing.join(", ")
                ),
                rebuild,
            ));
        }
    }
    if !serves(&side.precision, precision) {
        return Err(refuse(
            format!(
                "compiled in {} and evaluation.precision is {}",
                side.precision,
                precision.as_str()
            ),
            rebuild,
        ));
    }
    let sha = sha256_of(architecture).map_err(|e| {
        refuse(
            format!(
                "the architecture {} cannot be read: {e}",
                architecture.display()
            ),
            rebuild,
        )
    })?;
    if side.architecture_sha256 != sha {
        return Err(refuse(
            format!(
                "compiled beside another architecture file than {} (its SHA-256 differs)",
                architecture.display()
            ),
            rebuild,
        ));
    }
    let object = check_archive(&file).map_err(|r| refuse(r, rebuild))?;
    let constants = match &side.constants {
        Some(constants) => {
            let path = constants_path(package);
            Some(open_constants(&path, &constants.sha256).map_err(|r| {
                refuse(
                    format!("its constants file {}: {r}", path.display()),
                    rebuild,
                )
            })?)
        }
        None => None,
    };
    Ok(Vetted {
        sidecar: side,
        package: file,
        object,
        constants,
    })
}

/// The constants file's tensors go where the package's kernels read: it is trusted like the
/// package ([`open_trusted`]), and only the very file its sidecar was written with is read
/// (returned open, at its start).
fn open_constants(path: &Path, sha256: &str) -> Result<File, String> {
    let mut file = open_trusted(path, CONSTANTS_ARE)?;
    let sha = sha256_read(&file).map_err(|e| format!("cannot read it: {e}"))?;
    if sha != sha256 {
        return Err("it is not the file its sidecar was written with (its SHA-256 differs)".into());
    }
    file.rewind().map_err(|e| format!("cannot read it: {e}"))?;
    Ok(file)
}

/// What `model.compiled` gives on this machine, before anything is loaded.
pub struct Decision {
    /// The package to load, vetted.
    pub package: Option<(PathBuf, Vetted)>,
    /// Which format runs and why, for check-config and the start log.
    pub why: String,
    /// A package was there but does not fit (`auto`): TorchScript runs, with a warning.
    pub fell_back: bool,
}

/// [`vet`] under `model.compiled`: `off` and a missing package under `auto` give TorchScript,
/// a package that does not fit gives TorchScript with a warning under `auto` and an error
/// under a path.
pub fn decide(
    setting: &CompiledSetting,
    architecture: &Path,
    device: Device,
    precision: Precision,
) -> Result<Decision, ModelError> {
    let (package, explicit) = match setting {
        CompiledSetting::Off => {
            return Ok(Decision {
                package: None,
                why: "TorchScript (model.compiled: off)".into(),
                fell_back: false,
            });
        }
        CompiledSetting::Auto => (beside(architecture), false),
        CompiledSetting::Path(p) => (p.clone(), true),
    };
    if !explicit && std::fs::symlink_metadata(&package).is_err() {
        return Ok(Decision {
            package: None,
            why: format!(
                "TorchScript (model.compiled: auto; no compiled package at {})",
                package.display()
            ),
            fell_back: false,
        });
    }
    match vet(&package, architecture, device, precision) {
        Ok(vetted) => Ok(Decision {
            why: untrusted_text(&format!(
                "compiled package {} ({}, {} {}, torch {}; model.compiled: {})",
                package.display(),
                vetted.sidecar.precision,
                vetted.sidecar.device,
                vetted.sidecar.arch,
                vetted.sidecar.torch,
                if explicit { "a path" } else { "auto" }
            )),
            package: Some((package, vetted)),
            fell_back: false,
        }),
        Err(refusal) if explicit => Err(ModelError::Compiled {
            path: package,
            message: refusal.to_string(),
        }),
        Err(refusal) => Ok(Decision {
            package: None,
            why: format!("TorchScript (model.compiled: auto; {refusal})"),
            fell_back: true,
        }),
    }
}

unsafe extern "C" fn collect_name(data: *mut c_void, name: *const c_char) {
    let out = unsafe { &mut *(data as *mut Vec<String>) };
    out.push(
        unsafe { CStr::from_ptr(name) }
            .to_string_lossy()
            .into_owned(),
    );
}

/// A loaded package (raw handle; not `Send`, so it stays on its thread).
pub(super) struct Package {
    ptr: *mut c_void,
    pub(super) path: PathBuf,
    pub(super) sidecar: Sidecar,
    /// The weights each checkpoint gives it, by name: the sidecar's, each among its constants.
    pub(super) names: Vec<String>,
}

impl Drop for Package {
    fn drop(&mut self) {
        unsafe { dm_package_free(self.ptr) }
    }
}

impl Package {
    /// Loads a vetted package on `device`, through the very file [`vet`] checked (its
    /// `/proc/self/fd` name: the path may name another file by now); a file libtorch cannot
    /// load (corrupt, truncated, another format) is a refusal, never a crash.
    pub(super) fn load(path: &Path, vetted: Vetted, device: Device) -> Result<Package, Refusal> {
        use std::os::fd::AsRawFd;
        let Vetted {
            sidecar,
            package: file,
            object,
            constants,
        } = vetted;
        let rebuild = sidecar.rebuild.clone();
        let refuse = |reason: String| Refusal {
            package: path.to_path_buf(),
            reason,
            rebuild: rebuild.clone(),
        };
        let held = PathBuf::from(format!("/proc/self/fd/{}", file.as_raw_fd()));
        if std::fs::metadata(&held).is_err() {
            return Err(refuse(
                "/proc/self/fd is not available here, and diffmon loads a package only through \
                 the file it checked"
                    .into(),
            ));
        }
        let c_path = CString::new(held.as_os_str().as_encoded_bytes())
            .map_err(|_| refuse("the path contains a NUL byte".into()))?;
        let index = match device {
            Device::Cuda(n) => n as c_int,
            _ => -1,
        };
        let mut err = std::ptr::null_mut();
        let started = std::time::SystemTime::now();
        let ptr = unsafe { dm_package_load(c_path.as_ptr(), index, &mut err) };
        if ptr.is_null() {
            // Its message names the held file: shown as its path while it is held.
            let message = crate::store::safe_fs::unproc(&take_error(err));
            remove_unpacked(&std::env::temp_dir(), &object, started);
            return Err(refuse(format!(
                "libtorch cannot load it as a compiled package: {message}"
            )));
        }
        drop(file);
        let mut package = Package {
            ptr,
            path: path.to_path_buf(),
            sidecar,
            names: Vec::new(),
        };
        let mut names: Vec<String> = Vec::new();
        let mut err = std::ptr::null_mut();
        let rc = unsafe {
            dm_package_weight_names(
                package.ptr,
                &mut names as *mut _ as *mut c_void,
                collect_name,
                &mut err,
            )
        };
        if rc < 0 {
            return Err(refuse(format!(
                "its weight names cannot be read: {}",
                take_error(err)
            )));
        }
        if let Some(w) = package.sidecar.weights.iter().find(|w| !names.contains(w)) {
            return Err(refuse(format!(
                "its sidecar names the weight `{w}`, which the package does not take"
            )));
        }
        // Its other constants (tensors the forward creates, a VP schedule's table, which
        // torch.export lifts as `_tensor_constant<N>`) are no checkpoint's: they keep their
        // compiled values, or, where the package holds none, come from the constants file
        // before anything runs.
        if !package.sidecar.weights_inside {
            let given = |n: &String| {
                package.sidecar.weights.contains(n)
                    || package
                        .sidecar
                        .constants
                        .as_ref()
                        .is_some_and(|c| c.tensors.contains_key(n))
            };
            if let Some(n) = names.iter().find(|n| !given(n)) {
                return Err(refuse(format!(
                    "it takes `{n}`, which neither its weights nor its constants file give \
                     (it holds no tensor of its own)"
                )));
            }
            package.load_constants(constants, device).map_err(refuse)?;
        }
        package.names = package.sidecar.weights.clone();
        Ok(package)
    }

    /// Reads the constants file, as [`vet`] opened it (bounded: the names, dtypes and shapes
    /// the sidecar gives, checked before a byte is read), and copies its tensors into the
    /// package on `device`.
    fn load_constants(&self, file: Option<File>, device: Device) -> Result<(), String> {
        let (Some(constants), Some(file)) = (&self.sidecar.constants, file) else {
            return Ok(());
        };
        let path = constants_path(&self.path);
        let what = |e: String| format!("its constants file {}: {e}", path.display());
        let mut specs = Vec::with_capacity(constants.tensors.len());
        for (name, spec) in &constants.tensors {
            let dtype = crate::weights::DType::from_name(&spec.dtype)
                .ok_or_else(|| what(format!("`{name}` has the unknown dtype `{}`", spec.dtype)))?;
            specs.push((name.clone(), spec.shape.clone(), dtype));
        }
        let expected = crate::weights::Expected::new(
            specs
                .iter()
                .map(|(n, shape, d)| (n.clone(), shape.clone(), d.size() as u64)),
            0,
        );
        let opts = crate::weights::ReadOptions {
            max_total_bytes: Some(expected.bytes()),
            expected: Some(std::sync::Arc::new(expected)),
            ..Default::default()
        };
        let len = file
            .metadata()
            .map_err(|e| what(format!("cannot read it: {e}")))?
            .len();
        let read =
            crate::weights::read_checkpoint_from(std::io::BufReader::new(file), len, &path, &opts)
                .map_err(|e| what(e.to_string()))?;
        let mut tensors = Vec::with_capacity(specs.len());
        for (name, _, dtype) in &specs {
            let raw = read
                .get(name)
                .ok_or_else(|| what(format!("it lacks `{name}`")))?;
            if raw.dtype != *dtype {
                return Err(what(format!(
                    "`{name}` is {}, its sidecar says {dtype}",
                    raw.dtype
                )));
            }
            tensors.push((name.as_str(), super::raw::view(raw).to_device(device)));
        }
        if read.len() != specs.len() {
            return Err(what(format!(
                "it holds {} tensors, its sidecar names {}",
                read.len(),
                specs.len()
            )));
        }
        let refs: Vec<(&str, &Tensor)> = tensors.iter().map(|(n, t)| (*n, t)).collect();
        self.load_weights(&refs)
            .map_err(|e| what(format!("its tensors cannot be given to the package: {e}")))
    }

    /// Copies `weights` (name, tensor on the package's device) into the package's weights.
    pub(super) fn load_weights(&self, weights: &[(&str, &Tensor)]) -> Result<(), String> {
        let names: Vec<CString> = weights
            .iter()
            .map(|(n, _)| CString::new(*n).map_err(|_| format!("weight name `{n}` has a NUL")))
            .collect::<Result<_, _>>()?;
        let name_ptrs: Vec<*const c_char> = names.iter().map(|n| n.as_ptr()).collect();
        let tensor_ptrs: Vec<*const c_void> = weights
            .iter()
            .map(|(_, t)| t.as_ptr() as *const c_void)
            .collect();
        let mut err = std::ptr::null_mut();
        let rc = unsafe {
            dm_package_load_weights(
                self.ptr,
                names.len() as c_int,
                name_ptrs.as_ptr(),
                tensor_ptrs.as_ptr(),
                &mut err,
            )
        };
        if rc != 0 {
            return Err(take_error(err));
        }
        Ok(())
    }

    /// Whether it serves `evaluation.precision` (a sweep's runs share the model).
    pub(super) fn serves(&self, precision: Precision) -> bool {
        serves(&self.sidecar.precision, precision)
    }

    /// `forward(x, sigma)`: a batch below the package's smallest is padded with copies of its
    /// last image (their outputs dropped), one above its largest goes in parts; every image's
    /// own input is unchanged.
    pub(super) fn forward(
        &self,
        x: &Tensor,
        sigma: &Tensor,
    ) -> Result<(Tensor, Tensor), ForwardFailure> {
        let n = x.size().first().copied().unwrap_or(0);
        let (min, max) = (self.sidecar.min_batch, self.sidecar.max_batch);
        // Padding and joining allocate: a failure is this batch's, never a panic.
        let failed = |e: tch::TchError| {
            let message = e.to_string();
            ForwardFailure {
                out_of_memory: is_out_of_memory(&message),
                message: shorten(&message),
                over_cap: false,
                images: n,
            }
        };
        if n > max {
            let (mut d, mut f) = (Vec::new(), Vec::new());
            let mut start = 0;
            while start < n {
                let len = max.min(n - start);
                let (a, b) =
                    self.forward(&x.narrow(0, start, len), &sigma.narrow(0, start, len))?;
                d.push(a);
                f.push(b);
                start += len;
            }
            return Ok((
                Tensor::f_cat(&d, 0).map_err(failed)?,
                Tensor::f_cat(&f, 0).map_err(failed)?,
            ));
        }
        if n >= 1 && n < min {
            let pad = min - n;
            let mut reps = vec![1i64; x.dim()];
            reps[0] = pad;
            let padded = |t: &Tensor, reps: &[i64]| -> Result<Tensor, tch::TchError> {
                let copies = t.narrow(0, n - 1, 1).f_repeat(reps)?;
                Tensor::f_cat(&[t.shallow_clone(), copies], 0)
            };
            let xp = padded(x, &reps).map_err(failed)?;
            let sp = padded(sigma, &[pad]).map_err(failed)?;
            let (d, f) = self.run(&xp, &sp, n)?;
            return Ok((
                d.f_narrow(0, 0, n).map_err(failed)?,
                f.f_narrow(0, 0, n).map_err(failed)?,
            ));
        }
        self.run(x, sigma, n)
    }

    fn run(
        &self,
        x: &Tensor,
        sigma: &Tensor,
        images: i64,
    ) -> Result<(Tensor, Tensor), ForwardFailure> {
        let (x, sigma) = (x.contiguous(), sigma.contiguous());
        let mut denoised = std::ptr::null_mut();
        let mut features = std::ptr::null_mut();
        let mut err = std::ptr::null_mut();
        let rc = unsafe {
            dm_package_forward(
                self.ptr,
                x.as_ptr() as *const c_void,
                sigma.as_ptr() as *const c_void,
                &mut denoised,
                &mut features,
                &mut err,
            )
        };
        if rc != 0 {
            let message = take_full_error(err);
            return Err(ForwardFailure {
                out_of_memory: is_out_of_memory(&message),
                message: shorten(&message),
                over_cap: false,
                images,
            });
        }
        unsafe {
            Ok((
                Tensor::from_ptr(denoised as *mut _),
                Tensor::from_ptr(features as *mut _),
            ))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::files::fake::{SO, elf, zip_of};
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn write(path: &Path, text: &str, mode: u32) {
        std::fs::write(path, text).unwrap();
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
    }

    /// A folder with an architecture file (and its SHA-256) and a package of it that holds a
    /// shared object's header and no sidecar yet.
    fn package_beside_architecture() -> (tempfile::TempDir, PathBuf, String, PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let arch = dir.path().join("m.ts");
        write(&arch, "architecture", 0o644);
        let sha = sha256_of(&arch).unwrap();
        let pkg = dir.path().join("m.pt2");
        zip_of(&pkg, &[(SO, &elf())], false);
        (dir, arch, sha, pkg)
    }

    fn sidecar(torch: &str, precision: &str, sha: &str, flags: &[&str]) -> String {
        serde_json::json!({
            "format": FORMAT, "torch": torch, "device": "cpu", "arch": std::env::consts::ARCH,
            "cpu_flags": flags, "precision": precision, "min_batch": 2, "max_batch": 64,
            "weights": ["w"], "architecture_sha256": sha,
            "rebuild": "diffmon-export --factory m:f --out m.ts --compile",
        })
        .to_string()
    }

    /// Every check before libtorch opens a package refuses with the file, the reason and the
    /// rebuild command; nothing is loaded (the package here holds no working code).
    #[test]
    fn packages_are_vetted_before_loading() {
        let (_dir, arch, sha, pkg) = package_beside_architecture();
        let cpu = Device::Cpu;
        let fp32 = Precision::Fp32;
        let refusal = |side: Option<String>, mode: u32| {
            std::fs::set_permissions(&pkg, std::fs::Permissions::from_mode(mode)).unwrap();
            match side {
                Some(s) => write(&sidecar_path(&pkg), &s, 0o644),
                None => {
                    let _ = std::fs::remove_file(sidecar_path(&pkg));
                }
            }
            vet(&pkg, &arch, cpu, fp32)
                .map(|_| ())
                .unwrap_err()
                .to_string()
        };
        let torch = torch_version();
        let ok = sidecar(&torch, "fp32", &sha, &[]);
        assert!(vet(&pkg, &arch, cpu, fp32).is_err());
        write(&sidecar_path(&pkg), &ok, 0o644);
        vet(&pkg, &arch, cpu, fp32).unwrap();
        for (side, mode, says) in [
            (Some(ok.clone()), 0o664, "writable by its group"),
            (Some(ok.clone()), 0o646, "writable by others"),
            (None, 0o644, "sidecar"),
            (Some("{".into()), 0o644, "is not one"),
            (
                Some(
                    ok.replace("\"min_batch\":2", "\"min_batch\":8192")
                        .replace("\"max_batch\":64", "\"max_batch\":100000"),
                ),
                0o644,
                "the batch range 8192..100000",
            ),
            (
                Some(sidecar("1.0.0", "fp32", &sha, &[])),
                0o644,
                "compiled by torch 1.0.0",
            ),
            (
                Some(sidecar(&torch, "bf16", &sha, &[])),
                0o644,
                "compiled in bf16",
            ),
            (
                Some(sidecar(&torch, "fp32", "00", &[])),
                0o644,
                "another architecture",
            ),
            (
                Some(sidecar(&torch, "fp32", &sha, &["no_such_isa"])),
                0o644,
                "lacks (no_such_isa)",
            ),
        ] {
            let got = refusal(side, mode);
            assert!(got.contains(says), "{says}: {got}");
            assert!(got.starts_with(&pkg.display().to_string()), "{got}");
            assert!(got.contains("Rebuild it"), "{got}");
        }
        let wrong_torch = refusal(Some(sidecar("1.0.0", "fp32", &sha, &[])), 0o644);
        assert!(wrong_torch.contains("--compile"), "{wrong_torch}");
        // Another user's file (chown needs root: where the tests run as a user, the mode
        // checks above stand for the rule).
        if unsafe { libc::geteuid() } == 0 {
            write(&sidecar_path(&pkg), &ok, 0o644);
            std::os::unix::fs::chown(&pkg, Some(4242), None).unwrap();
            let other = vet(&pkg, &arch, cpu, fp32).map(|_| ()).unwrap_err();
            assert!(other.to_string().contains("owned by user 4242"), "{other}");
            std::os::unix::fs::chown(&pkg, Some(0), None).unwrap();
        }
        // The device kind too.
        write(&sidecar_path(&pkg), &ok, 0o644);
        let cuda = vet(&pkg, &arch, Device::Cuda(0), fp32)
            .map(|_| ())
            .unwrap_err();
        assert!(cuda.to_string().contains("runs on the cuda"), "{cuda}");
    }

    /// The sidecar decides what the package is given, so it is trusted like the package: one
    /// others can write is refused, and its words (the rebuild command) are not shown; a FIFO
    /// in its place is refused at once, not waited on; a trusted sidecar's words are shown
    /// escaped.
    #[test]
    fn the_sidecar_is_trusted_like_the_package() {
        let (_dir, arch, sha, pkg) = package_beside_architecture();
        let side = sidecar(&torch_version(), "fp32", &sha, &[]).replace(
            "diffmon-export --factory m:f --out m.ts --compile",
            "evil \\u001b[2J| sh",
        );
        write(&sidecar_path(&pkg), &side, 0o666);
        let vetted = |pkg: &Path| {
            vet(pkg, &arch, Device::Cpu, Precision::Fp32)
                .map(|_| ())
                .unwrap_err()
                .to_string()
        };
        let got = vetted(&pkg);
        assert!(
            got.contains("its sidecar") && got.contains("writable by others"),
            "{got}"
        );
        assert!(got.contains("what memory the package is given"), "{got}");
        assert!(
            !got.contains("evil"),
            "an untrusted sidecar's command was shown: {got}"
        );
        // Trusted, with a control character in its words: shown escaped. The package is
        // group-writable so that the refusal carries the command.
        write(&sidecar_path(&pkg), &side, 0o644);
        std::fs::set_permissions(&pkg, std::fs::Permissions::from_mode(0o664)).unwrap();
        let got = vetted(&pkg);
        assert!(got.contains("evil \\u{1b}[2J| sh"), "{got}");
        assert!(!got.contains('\u{1b}'), "{got:?}");
        std::fs::set_permissions(&pkg, std::fs::Permissions::from_mode(0o644)).unwrap();
        // A FIFO: refused, not waited on (a wait would hang this test).
        std::fs::remove_file(sidecar_path(&pkg)).unwrap();
        let fifo =
            std::ffi::CString::new(sidecar_path(&pkg).as_os_str().as_encoded_bytes()).unwrap();
        assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o644) }, 0);
        let got = vetted(&pkg);
        assert!(
            got.contains("its sidecar") && got.contains("not a regular file"),
            "{got}"
        );
    }

    /// libtorch loads the very file that was vetted, not what its path names by then; and a
    /// shared object it cannot load leaves no unpacked copy behind.
    #[test]
    fn the_vetted_file_is_the_one_loaded() {
        let (_dir, arch, sha, pkg) = package_beside_architecture();
        // An entry name of this test's own, to find libtorch's copy by.
        let prefix = format!("vetted{}", std::process::id());
        let object = format!("{prefix}/data/aotinductor/model/c1.wrapper.so");
        let metadata = format!("{prefix}/data/aotinductor/model/c1.wrapper_metadata.json");
        let format = format!("{prefix}/archive_format");
        let device = br#"{"AOTI_DEVICE_KEY": "cpu"}"#;
        let entries: [(&str, &[u8]); 3] =
            [(&object, &elf()), (&metadata, device), (&format, b"pt2")];
        zip_of(&pkg, &entries, false);
        let side = sidecar(&torch_version(), "fp32", &sha, &[]);
        write(&sidecar_path(&pkg), &side, 0o644);
        let vetted = vet(&pkg, &arch, Device::Cpu, Precision::Fp32).unwrap();
        // Replaced after the check: by its path libtorch would read no zip at all.
        let swap = pkg.with_extension("swap");
        write(&swap, "not a zip", 0o644);
        std::fs::rename(&swap, &pkg).unwrap();
        let e = Package::load(&pkg, vetted, Device::Cpu)
            .map(|_| ())
            .unwrap_err()
            .to_string();
        // It unpacked the vetted zip and failed at the shared object (an ELF header only).
        assert!(e.contains("libtorch cannot load it"), "{e}");
        assert!(
            !e.contains("zip archive"),
            "the replaced file was read: {e}"
        );
        let left = std::fs::read_dir(std::env::temp_dir())
            .unwrap()
            .flatten()
            .filter(|d| d.path().join(&object).exists())
            .count();
        assert_eq!(left, 0, "libtorch's unpacked copy was left behind");
    }

    /// `auto` falls back to TorchScript (with the reason) where a path is an error; `off` and a
    /// missing package are TorchScript without a warning.
    #[test]
    fn the_setting_decides_between_fallback_and_error() {
        let dir = tempfile::tempdir().unwrap();
        let arch = dir.path().join("m.ts");
        write(&arch, "architecture", 0o644);
        let d = |s: &CompiledSetting| decide(s, &arch, Device::Cpu, Precision::Fp32);
        let none = d(&CompiledSetting::Auto).unwrap();
        assert!(none.package.is_none() && !none.fell_back, "{}", none.why);
        assert!(none.why.contains("no compiled package"), "{}", none.why);
        assert!(d(&CompiledSetting::Off).unwrap().why.contains("off"));
        write(&beside(&arch), "junk", 0o666);
        let auto = d(&CompiledSetting::Auto).unwrap();
        assert!(auto.package.is_none() && auto.fell_back, "{}", auto.why);
        assert!(auto.why.contains("writable by others"), "{}", auto.why);
        let err = d(&CompiledSetting::Path(beside(&arch))).err().unwrap();
        assert!(err.to_string().contains("writable by others"), "{err}");
        assert!(err.is_usage());
    }
}
