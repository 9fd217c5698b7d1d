//! The compiled network (docs/design.md §11, "The compiled network"): an AOTInductor package
//! (`.pt2`, written by `diffmon-export --compile`) of the same architecture as the TorchScript
//! file. `model.compiled` chooses it ([`decide`]); before libtorch loads it (a package holds a
//! shared object: native code) it is vetted ([`vet`]): its owner and mode (trusted like the
//! architecture file, never like a checkpoint), then its sidecar (`model.pt2.json`): the torch
//! release, the device kind, the CPU's instruction-set flags, the precision and the SHA-256 of
//! the architecture it was compiled from. Loaded through the C++ shim's
//! `AOTIModelPackageLoader` ([`Package`]), it gets each checkpoint's weights by name
//! (`load_constants`: no recompilation, no reload). The raw handle is not `Send`.

use super::error::ModelError;
use super::module::{ForwardFailure, is_out_of_memory, shorten, take_error, take_full_error};
use crate::config::{CompiledSetting, Precision};
use serde::Deserialize;
use std::ffi::{CStr, CString, c_char, c_int, c_void};
use std::fmt;
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
        write!(
            f,
            "{}: {}. Rebuild it on the machine that evaluates: {rebuild}",
            self.package.display(),
            self.reason
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

/// Why a package is trusted only as the user's own file, for [`check_trust`]'s messages.
const PACKAGE_IS: &str = "a package is native code that diffmon would run";
/// The same for the constants file beside it.
const CONSTANTS_ARE: &str = "a constants file holds what the package's kernels read";

/// Refuses a package that another user owns (root aside) or that group or others may write: it
/// is native code diffmon would run, as OpenSSH refuses a private key others can read. `is`
/// says why the file is trusted that way, for the message.
pub fn check_trust(package: &Path, is: &str) -> Result<(), String> {
    use std::os::unix::fs::MetadataExt;
    let meta = std::fs::metadata(package).map_err(|e| format!("cannot read it: {e}"))?;
    if !meta.is_file() {
        return Err("not a regular file".into());
    }
    let me = unsafe { libc::geteuid() };
    if meta.uid() != me && meta.uid() != 0 {
        return Err(format!(
            "owned by user {}, not by this user ({me}) or root: {is}, so only a file of yours is \
             loaded",
            meta.uid()
        ));
    }
    if meta.mode() & 0o022 != 0 {
        return Err(format!(
            "writable by {} (mode {:o}): {is}, so a file others can change is not loaded \
             (chmod go-w {})",
            if meta.mode() & 0o002 != 0 {
                "others"
            } else {
                "its group"
            },
            meta.mode() & 0o777,
            package.display()
        ));
    }
    Ok(())
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
    use sha2::Digest;
    let mut file = std::fs::File::open(path)?;
    let mut hash = sha2::Sha256::new();
    std::io::copy(&mut file, &mut hash)?;
    Ok(format!("{:x}", hash.finalize()))
}

/// Reads the sidecar (bounded), refusing what is not one.
fn read_sidecar(package: &Path) -> Result<Sidecar, String> {
    use std::io::Read;
    let path = sidecar_path(package);
    let file = std::fs::File::open(&path).map_err(|e| {
        format!(
            "its sidecar {} cannot be read ({e}); diffmon-export --compile writes both",
            path.display()
        )
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
    if !(1..=sidecar.max_batch).contains(&sidecar.min_batch) {
        return Err(format!(
            "its sidecar {} names the batch range {}..{}",
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

/// Everything checked before libtorch opens the package: trust, then the sidecar against this
/// machine, the device, the precision and the architecture.
pub fn vet(
    package: &Path,
    architecture: &Path,
    device: Device,
    precision: Precision,
) -> Result<Sidecar, Refusal> {
    let refuse = |reason: String, rebuild: &str| Refusal {
        package: package.to_path_buf(),
        reason,
        rebuild: rebuild.to_string(),
    };
    // The sidecar only decides whether to load the package; its rebuild command goes in every
    // refusal, the trust check's first.
    let side = read_sidecar(package);
    let rebuild = side.as_ref().map(|s| s.rebuild.clone()).unwrap_or_default();
    check_trust(package, PACKAGE_IS).map_err(|r| refuse(r, &rebuild))?;
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
    if let Some(constants) = &side.constants {
        let path = constants_path(package);
        check_constants(&path, &constants.sha256).map_err(|r| {
            refuse(
                format!("its constants file {}: {r}", path.display()),
                rebuild,
            )
        })?;
    }
    Ok(side)
}

/// The constants file's tensors go where the package's kernels read: it is trusted like the
/// package ([`check_trust`]), and only the very file its sidecar was written with is read.
fn check_constants(path: &Path, sha256: &str) -> Result<(), String> {
    check_trust(path, CONSTANTS_ARE)?;
    let sha = sha256_of(path).map_err(|e| format!("cannot read it: {e}"))?;
    if sha != sha256 {
        return Err("it is not the file its sidecar was written with (its SHA-256 differs)".into());
    }
    Ok(())
}

/// What `model.compiled` gives on this machine, before anything is loaded.
pub struct Decision {
    /// The package to load, vetted.
    pub package: Option<(PathBuf, Sidecar)>,
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
        Ok(side) => Ok(Decision {
            why: format!(
                "compiled package {} ({}, {} {}, torch {}; model.compiled: {})",
                package.display(),
                side.precision,
                side.device,
                side.arch,
                side.torch,
                if explicit { "a path" } else { "auto" }
            ),
            package: Some((package, side)),
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
    /// Loads a vetted package on `device`; a file libtorch cannot load (corrupt, truncated,
    /// another format) is a refusal, never a crash.
    pub(super) fn load(path: &Path, sidecar: Sidecar, device: Device) -> Result<Package, Refusal> {
        let rebuild = sidecar.rebuild.clone();
        let refuse = |reason: String| Refusal {
            package: path.to_path_buf(),
            reason,
            rebuild: rebuild.clone(),
        };
        let c_path = CString::new(path.as_os_str().as_encoded_bytes())
            .map_err(|_| refuse("the path contains a NUL byte".into()))?;
        let index = match device {
            Device::Cuda(n) => n as c_int,
            _ => -1,
        };
        let mut err = std::ptr::null_mut();
        let ptr = unsafe { dm_package_load(c_path.as_ptr(), index, &mut err) };
        if ptr.is_null() {
            return Err(refuse(format!(
                "libtorch cannot load it as a compiled package: {}",
                take_error(err)
            )));
        }
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
            package.load_constants(device).map_err(refuse)?;
        }
        package.names = package.sidecar.weights.clone();
        Ok(package)
    }

    /// Reads the constants file (bounded: the names, dtypes and shapes the sidecar gives,
    /// checked before a byte is read) and copies its tensors into the package on `device`.
    fn load_constants(&self, device: Device) -> Result<(), String> {
        let Some(constants) = &self.sidecar.constants else {
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
        let read =
            crate::weights::read_checkpoint(&path, &opts).map_err(|e| what(e.to_string()))?;
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
            return Ok((Tensor::cat(&d, 0), Tensor::cat(&f, 0)));
        }
        if n >= 1 && n < min {
            let pad = min - n;
            let mut reps = vec![1i64; x.dim()];
            reps[0] = pad;
            let xp = Tensor::cat(&[x.shallow_clone(), x.narrow(0, n - 1, 1).repeat(&reps)], 0);
            let sp = Tensor::cat(
                &[
                    sigma.shallow_clone(),
                    sigma.narrow(0, n - 1, 1).repeat([pad]),
                ],
                0,
            );
            let (d, f) = self.run(&xp, &sp, n)?;
            return Ok((d.narrow(0, 0, n), f.narrow(0, 0, n)));
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
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn write(path: &Path, text: &str, mode: u32) {
        std::fs::write(path, text).unwrap();
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
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
    /// rebuild command; nothing is loaded (the packages here are not even zips).
    #[test]
    fn packages_are_vetted_before_loading() {
        let dir = tempfile::tempdir().unwrap();
        let arch = dir.path().join("m.ts");
        write(&arch, "architecture", 0o644);
        let sha = sha256_of(&arch).unwrap();
        let pkg = dir.path().join("m.pt2");
        write(&pkg, "not a zip", 0o644);
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
