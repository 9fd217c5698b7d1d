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
use crate::store::safe_fs::untrusted_text;
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

/// Why each file of the compiled network is trusted only as the user's own, for the messages
/// of [`open_trusted`].
const PACKAGE_IS: &str = "a package is native code that diffmon would run";
const SIDECAR_IS: &str = "a sidecar says what memory the package is given";
const CONSTANTS_ARE: &str = "a constants file holds what the package's kernels read";

/// Opens `path` to read it as a file of the compiled network, refusing one that another user
/// owns (root aside) or that group or others may write, as OpenSSH refuses a private key others
/// can read. The checks are of the open file, so what is checked is what is read, and what
/// libtorch loads ([`Package::load`]); no wait on a FIFO. `is` says why the file is trusted that
/// way, for the message.
fn open_trusted(path: &Path, is: &str) -> Result<File, String> {
    use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(path)
        .map_err(|e| format!("cannot read it: {e}"))?;
    let meta = file
        .metadata()
        .map_err(|e| format!("cannot read it: {e}"))?;
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
            path.display()
        ));
    }
    Ok(file)
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

/// The most entries a package's archive may hold, and how many times its size it may unpack to
/// (torch writes its entries stored, about once its size): libtorch unpacks every entry of
/// its model into a temporary folder before it loads one.
const ARCHIVE_MAX_ENTRIES: usize = 100_000;
const ARCHIVE_MAX_EXPANSION: u64 = 8;
/// Where in the archive the model's files are, the shared object among them.
const MODEL_FOLDER: &[u8] = b"data/aotinductor/model/";
/// The files from which libtorch would compile a package without a shared object, running the
/// compiler they name (`package_cpp_only` packages; diffmon-export never writes one).
const BUILD_FILES: [&[u8]; 2] = [b"_compile_flags.json", b"_linker_flags.json"];
/// The Info-ZIP Unicode Path extra field: a second name for an entry, which Rust's `zip` reads
/// in place of the name and libtorch's zip reader (miniz) ignores.
const UNICODE_PATH_FIELD: u16 = 0x7075;

/// What libtorch will unpack, checked before it does, by the names libtorch reads: every name
/// stays inside its folder, no entry carries a second name, the whole is bounded, the model's
/// shared object is there and every shared object is an ELF file for this machine, and nothing
/// is there to compile one from (libtorch would run the compiler its files name: diffmon runs
/// no compiler). Returns the model's shared object's entry name.
fn check_archive(file: &File) -> Result<String, String> {
    let len = file
        .metadata()
        .map_err(|e| format!("cannot read it: {e}"))?
        .len();
    let mut zip = zip::ZipArchive::new(file)
        .map_err(|e| format!("not a compiled package (a zip archive): {e}"))?;
    if zip.len() > ARCHIVE_MAX_ENTRIES {
        return Err(format!(
            "it holds {} entries, over {ARCHIVE_MAX_ENTRIES}",
            zip.len()
        ));
    }
    let shown = |name: &[u8]| crate::weights::quote(&String::from_utf8_lossy(name));
    let (mut total, mut objects, mut model) = (0u64, Vec::new(), None);
    let mut seen = std::collections::HashSet::new();
    for i in 0..zip.len() {
        let entry = zip
            .by_index_raw(i)
            .map_err(|e| format!("its entry {i} cannot be read: {e}"))?;
        let name = entry.name_raw();
        if has_field(entry.extra_data().unwrap_or_default(), UNICODE_PATH_FIELD) {
            return Err(format!(
                "its entry `{}` carries a second name (a Unicode Path field), which libtorch \
                 would not read",
                shown(name)
            ));
        }
        let outside = name.first() == Some(&b'/')
            || name.contains(&b'\\')
            || name.contains(&0)
            || name.split(|&b| b == b'/').any(|part| part == b"..");
        if outside {
            return Err(format!(
                "its entry `{}` would be unpacked outside libtorch's folder",
                shown(name)
            ));
        }
        // libtorch finds an entry by its name regardless of case.
        if !seen.insert(name.to_ascii_lowercase()) {
            return Err(format!(
                "its entry `{}` is there twice (as libtorch compares names)",
                shown(name)
            ));
        }
        if BUILD_FILES.iter().any(|b| name.ends_with(b)) {
            return Err(format!(
                "it holds `{}`, from which libtorch would compile it, running the compiler \
                 that file names: diffmon loads only a package's compiled shared object",
                shown(name)
            ));
        }
        total = total.saturating_add(entry.size());
        if name.to_ascii_lowercase().ends_with(b".so") {
            objects.push(i);
            if name.windows(MODEL_FOLDER.len()).any(|w| w == MODEL_FOLDER) {
                model = Some(String::from_utf8_lossy(name).into_owned());
            }
        }
    }
    if total > len.saturating_mul(ARCHIVE_MAX_EXPANSION) {
        return Err(format!(
            "it unpacks to {} MiB, over {ARCHIVE_MAX_EXPANSION} times its {} MiB",
            total >> 20,
            len >> 20
        ));
    }
    let Some(model) = model else {
        return Err(
            "it holds no compiled shared object (data/aotinductor/model/*.so): libtorch \
             would compile its C++ source, which diffmon does not do"
                .into(),
        );
    };
    let machine: Option<u16> = match std::env::consts::ARCH {
        "x86_64" => Some(62),
        "aarch64" => Some(183),
        _ => None,
    };
    for i in objects {
        let mut head = [0u8; 20];
        let read = zip
            .by_index(i)
            .map_err(|e| e.to_string())
            .and_then(|mut e| e.read_exact(&mut head).map_err(|e| e.to_string()));
        let elf = read.is_ok()
            && head[..4] == *b"\x7fELF"
            && head[4] == 2
            && machine.is_none_or(|m| u16::from_le_bytes([head[18], head[19]]) == m);
        if !elf {
            return Err(format!(
                "its shared object is not a 64-bit ELF file for {}",
                std::env::consts::ARCH
            ));
        }
    }
    Ok(model)
}

/// Whether a zip entry's extra field (blocks of a 2-byte id, a 2-byte length, the data) holds
/// a block `id`.
fn has_field(extra: &[u8], id: u16) -> bool {
    let mut rest = extra;
    while rest.len() >= 4 {
        if u16::from_le_bytes([rest[0], rest[1]]) == id {
            return true;
        }
        let len = u16::from_le_bytes([rest[2], rest[3]]) as usize;
        rest = rest.get(4 + len..).unwrap_or_default();
    }
    false
}

/// libtorch unpacks a package into a folder `<temp>/aotinductor_*` of its own and removes it
/// when the package is freed, but not when its loader fails after unpacking (a shared object
/// it cannot load): this removes such folders of this user, changed since `since`, that hold
/// the entry `object` (the package's shared object, named by its hash). Nothing is followed.
fn remove_unpacked(temp: &Path, object: &str, since: std::time::SystemTime) {
    use std::os::unix::fs::MetadataExt;
    let Ok(entries) = std::fs::read_dir(temp) else {
        return;
    };
    let me = unsafe { libc::geteuid() };
    let since = since - std::time::Duration::from_secs(2);
    for entry in entries.flatten() {
        let dir = entry.path();
        let ours = entry
            .file_name()
            .as_encoded_bytes()
            .starts_with(b"aotinductor_")
            && std::fs::symlink_metadata(&dir).is_ok_and(|m| {
                m.is_dir() && m.uid() == me && m.modified().is_ok_and(|t| t >= since)
            })
            && std::fs::symlink_metadata(dir.join(object)).is_ok_and(|m| m.is_file());
        if ours {
            let _ = std::fs::remove_dir_all(&dir);
        }
    }
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
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn write(path: &Path, text: &str, mode: u32) {
        std::fs::write(path, text).unwrap();
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
    }

    /// CRC-32 (IEEE), as a zip's Unicode Path field carries it of the entry's name.
    fn crc32(bytes: &[u8]) -> u32 {
        let mut c = !0u32;
        for &b in bytes {
            c ^= b as u32;
            for _ in 0..8 {
                c = if c & 1 != 0 {
                    (c >> 1) ^ 0xEDB8_8320
                } else {
                    c >> 1
                };
            }
        }
        !c
    }

    /// A zip, written by hand (Rust's `zip` writes no Unicode Path field with a valid CRC),
    /// of the model's shared object and an entry `name`, as libtorch reads it, that carries
    /// `alias` in a Unicode Path field (which Rust's `zip` reads in its place).
    fn zip_with_alias(path: &Path, name: &str, alias: &str) {
        let mut field = UNICODE_PATH_FIELD.to_le_bytes().to_vec();
        field.extend(((5 + alias.len()) as u16).to_le_bytes());
        field.push(1);
        field.extend(crc32(name.as_bytes()).to_le_bytes());
        field.extend(alias.as_bytes());
        let entries: [(&str, Vec<u8>, Vec<u8>); 2] =
            [(SO, elf(), Vec::new()), (name, b"escaped".to_vec(), field)];
        let (mut out, mut central) = (Vec::new(), Vec::new());
        let u16le = |v: usize| (v as u16).to_le_bytes();
        let u32le = |v: usize| (v as u32).to_le_bytes();
        for (name, data, extra) in &entries {
            let (crc, offset) = (crc32(data), out.len());
            // Version 20, no flags, stored, no time or date: then the CRC, both sizes and the
            // name's.
            let common = [
                &u16le(20)[..],
                &[0; 8],
                &crc.to_le_bytes(),
                &u32le(data.len()),
                &u32le(data.len()),
                &u16le(name.len()),
            ]
            .concat();
            out.extend([&0x0403_4b50u32.to_le_bytes()[..], &common, &[0, 0]].concat());
            out.extend(name.as_bytes());
            out.extend(data);
            central.extend([&0x0201_4b50u32.to_le_bytes()[..], &u16le(20), &common].concat());
            // The extra field's size; no comment, disk 0, no attributes; the local header's offset.
            central.extend([&u16le(extra.len())[..], &[0; 10], &u32le(offset)].concat());
            central.extend(name.as_bytes());
            central.extend(extra);
        }
        let (at, size) = (out.len(), central.len());
        out.extend(central);
        out.extend(
            [
                &0x0605_4b50u32.to_le_bytes()[..],
                &[0; 4],
                &u16le(2),
                &u16le(2),
            ]
            .concat(),
        );
        out.extend([&u32le(size)[..], &u32le(at), &[0, 0]].concat());
        std::fs::write(path, out).unwrap();
    }

    /// A zip holding `entries` (stored, or deflated where `deflate`).
    fn zip_of(path: &Path, entries: &[(&str, &[u8])], deflate: bool) {
        use std::io::Write;
        let mut zip = zip::ZipWriter::new(std::fs::File::create(path).unwrap());
        let method = if deflate {
            zip::CompressionMethod::Deflated
        } else {
            zip::CompressionMethod::Stored
        };
        let options = zip::write::SimpleFileOptions::default().compression_method(method);
        for (name, bytes) in entries {
            zip.start_file(*name, options).unwrap();
            zip.write_all(bytes).unwrap();
        }
        zip.finish().unwrap();
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o644)).unwrap();
    }

    /// The first bytes of a shared object for this machine (what the archive check reads).
    fn elf() -> Vec<u8> {
        let machine: u16 = if std::env::consts::ARCH == "aarch64" {
            183
        } else {
            62
        };
        let mut head = b"\x7fELF\x02\x01\x01".to_vec();
        head.resize(18, 0);
        head.extend(machine.to_le_bytes());
        head.resize(64, 0);
        head
    }

    const SO: &str = "m/data/aotinductor/model/c1.wrapper.so";

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

    /// What libtorch would unpack is checked first: a name that leaves its folder, an archive
    /// that unpacks to many times its size, one without the compiled shared object (libtorch
    /// would run a compiler), a shared object that is no ELF file for this machine, and a file
    /// that is no zip are each refused; a package as torch writes it passes.
    #[test]
    fn archives_are_checked_before_libtorch_unpacks_them() {
        let dir = tempfile::tempdir().unwrap();
        let pkg = dir.path().join("m.pt2");
        let zeros = vec![0u8; 64 << 20];
        let mut other_machine = elf();
        other_machine[18] ^= 0x40;
        type Entries<'a> = &'a [(&'a str, &'a [u8])];
        let cases: [(Entries, bool, &str); 11] = [
            (
                &[
                    (SO, &elf()),
                    ("m/data/aotinductor/model/c1_metadata.json", b"{}"),
                ],
                false,
                "",
            ),
            (
                &[
                    (SO, &elf()),
                    ("m/data/aotinductor/model/../../../../x.txt", b"x"),
                ],
                false,
                "would be unpacked outside",
            ),
            (
                &[(SO, &elf()), ("m/data/aotinductor/model/w.bin", &zeros)],
                true,
                "unpacks to 64 MiB",
            ),
            (
                &[("m/data/aotinductor/model/c1.wrapper.cpp", b"int x;")],
                false,
                "no compiled shared object",
            ),
            (
                &[(SO, b"not an ELF file at all, but long enough")],
                false,
                "not a 64-bit ELF",
            ),
            (&[(SO, &other_machine)], false, "not a 64-bit ELF"),
            (
                &[("m/data/aotinductor/model/x.so", &elf()[..8])],
                false,
                "not a 64-bit ELF",
            ),
            // Whichever shared object libtorch would pick, each is checked.
            (
                &[(SO, &elf()), ("m/data/constants/z.SO", b"no ELF file")],
                false,
                "not a 64-bit ELF",
            ),
            // A decoy shared object outside the model's folder, and what libtorch would compile
            // the model from, with a compiler of the package's choosing.
            (
                &[
                    ("p/x/data/aotinductor/model/decoy.so", &elf()),
                    ("m/data/aotinductor/model/c.wrapper.cpp", b"int x;"),
                    (
                        "m/data/aotinductor/model/c.wrapper_compile_flags.json",
                        b"{}",
                    ),
                ],
                false,
                "running the compiler",
            ),
            (
                &[
                    (SO, &elf()),
                    ("m/data/aotinductor/model/c_linker_flags.json", b"{}"),
                ],
                false,
                "compile",
            ),
            (
                &[
                    (SO, &elf()),
                    ("m/data/aotinductor/model/C1.wrapper.so", &elf()),
                ],
                false,
                "there twice",
            ),
        ];
        for (entries, deflate, says) in cases {
            zip_of(&pkg, entries, deflate);
            let got = check_archive(&File::open(&pkg).unwrap());
            match says {
                "" => assert_eq!(got.unwrap(), SO),
                _ => {
                    let e = got.unwrap_err();
                    assert!(e.contains(says), "{says}: {e}");
                }
            }
        }
        write(&pkg, "not a zip", 0o644);
        let e = check_archive(&File::open(&pkg).unwrap()).unwrap_err();
        assert!(e.contains("not a compiled package"), "{e}");
        // A second name that Rust's zip reads in place of the one libtorch unpacks to.
        zip_with_alias(
            &pkg,
            "m/data/aotinductor/model/../../../../x.txt",
            "m/data/aotinductor/model/notes.txt",
        );
        let e = check_archive(&File::open(&pkg).unwrap()).unwrap_err();
        assert!(e.contains("carries a second name"), "{e}");
    }

    /// Only this user's libtorch folders that hold the package's shared object and changed
    /// since the load began are removed; links are not followed.
    #[test]
    fn a_failed_loads_unpacked_copy_is_removed_and_nothing_else() {
        let temp = tempfile::tempdir().unwrap();
        let object = "m/data/aotinductor/model/c1.wrapper.so";
        let unpacked = |name: &str, object: &str| {
            let dir = temp.path().join(name);
            let file = dir.join(object);
            std::fs::create_dir_all(file.parent().unwrap()).unwrap();
            std::fs::write(file, b"x").unwrap();
            dir
        };
        let since = std::time::SystemTime::now();
        let failed = unpacked("aotinductor_a1", object);
        let other_package = unpacked("aotinductor_b2", "m/data/aotinductor/model/c2.wrapper.so");
        let not_libtorchs = unpacked("mine_c3", object);
        let elsewhere = tempfile::tempdir().unwrap();
        let target = elsewhere.path().join("t");
        std::fs::create_dir_all(target.join("m/data/aotinductor/model")).unwrap();
        std::fs::write(target.join(object), b"x").unwrap();
        std::os::unix::fs::symlink(&target, temp.path().join("aotinductor_link")).unwrap();
        remove_unpacked(temp.path(), object, since);
        assert!(!failed.exists());
        assert!(other_package.exists() && not_libtorchs.exists());
        assert!(target.join(object).exists(), "a link was followed");
        // One from before the load began is not this load's.
        let older = unpacked("aotinductor_d4", object);
        let later = std::time::SystemTime::now() + std::time::Duration::from_secs(60);
        remove_unpacked(temp.path(), object, later);
        assert!(older.exists());
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
