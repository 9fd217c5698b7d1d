//! Reading checkpoint weights without Python and without libtorch.
//!
//! diffmon evaluates checkpoints that a training job writes. A checkpoint is one of:
//!
//! - a **`torch.save` zip archive** holding a state dict (`torch.save(model.state_dict())`), a
//!   dict nesting one under a key (`{"ema": ..., "model": ..., "step": 7}`, Lightning `.ckpt`),
//!   a whole pickled module (`torch.save(model)`, EDM's `training-state-*.pt`), or diffusers'
//!   `EMAModel.state_dict()` (an ordered `shadow_params` list);
//! - a **plain pickle** (`pickle.dump`, EDM/EDM2 `network-snapshot-*.pkl`), read as data;
//! - a **safetensors** file;
//! - a **TorchScript** archive (`torch.jit.save`), read here as data like the others: libtorch
//!   never loads a checkpoint (its loader would run the archive's code, e.g. a module's
//!   `__setstate__`). See "TorchScript archives" below.
//!
//! The format is detected from the content (zip magic and archive layout, a pickle protocol
//! header (2 to 5) for plain pickles, or the safetensors
//! length-prefixed JSON header), never from the file name. [`validate_structure`] is the cheap
//! check the watcher uses to decide that a file is completely written; [`read_checkpoint`]
//! returns the tensors, in file order, as contiguous little-endian bytes ([`RawTensor`]).
//!
//! # Safety model: a checkpoint is data, never code
//!
//! A `torch.save` file stores its object tree as a Python pickle (`<archive>/data.pkl`) next to
//! raw storage bytes (`<archive>/data/<key>`). A pickle is a small program that may call any
//! Python function it names; `torch.load(weights_only=False)` therefore executes whatever a
//! malicious checkpoint asks for. diffmon never does. It runs the pickle in its own interpreter
//! (`pickle.rs`), which
//!
//! - implements only the opcodes `torch.save` emits (protocol 2, plus the framing and
//!   string/memo opcodes of protocols 4–5); any other opcode stops the read with an error naming
//!   it;
//! - resolves globals against a fixed allow-list: `collections.OrderedDict`,
//!   `torch._utils._rebuild_tensor_v2` / `_rebuild_tensor_v3` / `_rebuild_parameter` /
//!   `_rebuild_parameter_with_state`, the `torch.*Storage` types, `torch.storage.UntypedStorage`,
//!   torch dtype names, and `_codecs.encode` (how protocol 2 spells a `bytes` literal). Any
//!   other global (`os.system`, `builtins.eval`, a pickled `nn.Module` class, ...) stops the read
//!   with [`WeightsError::ForbiddenGlobal`] as soon as it is read, before anything else runs;
//! - never calls anything: "calling" an allowed global builds plain data (a dict, a description
//!   of a tensor as a strided view of a named storage). Storages are only named by the pickle
//!   (persistent ids); their bytes are read afterwards from the zip, only for the tensors of the
//!   selected state dict, each storage entry once;
//! - **inert fallback**: a `torch.save` archive whose strict read stops at a foreign global is
//!   read a second time, under the same bounds, with every global outside the allow-list an
//!   inert placeholder (`pickle::Classes::Inert`): calling one (REDUCE, NEWOBJ) records its name
//!   and arguments, BUILD records its state, `copyreg._reconstructor` / `__newobj__` instantiate
//!   the placeholder class they name; no constructor, `__setstate__`, `__reduce__` callable or
//!   any other code is looked up or run. That result is used only if the selection rules below
//!   find weights in it (a module tree, a state dict, a `shadow_params` list); otherwise the
//!   original [`WeightsError::ForbiddenGlobal`] is returned. Plain pickle files are read in
//!   inert mode directly; there a tensor's storage is `torch.storage._load_from_bytes(<bytes>)`,
//!   a legacy (pre-zip) `torch.save` stream of one storage that is parsed as data (magic
//!   number, protocol version 1001, little-endian system info, the storage's persistent id,
//!   its key list, an 8-byte element count and the raw bytes, all checked against the bytes
//!   given). A plain pickle is read whole, at most `checkpoints.max_entry_mib`;
//! - bounds every resource that grows with the input (pickle size, stack, MARK nesting, memo,
//!   objects, container items), keeps objects in a flat arena (so self-referencing or deeply
//!   nested input cannot overflow the Rust stack, not even when dropped), and checks every size
//!   computation (`numel * elem_size`, the last element a shape/stride/offset reaches) against
//!   the storage length with checked arithmetic. Views that repeat storage bytes (tied weights,
//!   stride-0 broadcasts) may add at most the file's length plus 512 MiB to what is read, so a
//!   tiny file cannot ask for terabytes. Hostile input yields an error, never a panic.
//!
//! safetensors files are parsed with the `safetensors` crate (JSON header, validated offsets);
//! tensor bytes are read straight from the file into their final buffers. The header is parsed
//! once per read ([`detect_format`] only sniffs it).
//!
//! # Reading is bounded, and only regular files are read
//!
//! Every checkpoint is opened through one function that opens it non-blocking, checks with
//! `fstat` on the handle that it is a regular file (a FIFO, device or socket named like a
//! checkpoint is refused with [`WeightsError::NotRegularFile`] instead of blocking or reading
//! forever) and only then reads it. A zip entry is read through a bound, never trusting the sizes
//! in the zip directory: `data.pkl` at most 128 MiB, a storage at most the bytes its tensors
//! declare, and any entry at most [`ReadOptions::max_entry_bytes`] (config key
//! `checkpoints.max_entry_mib`); a compressed entry that inflates beyond its bound ("zip bomb")
//! stops the read with [`WeightsError::EntryTooLarge`] after at most bound + 1 bytes.
//!
//! # Bounded memory for a whole checkpoint
//!
//! Besides each entry's bound, the selected tensors of one checkpoint together may take at most
//! [`ReadOptions::max_total_bytes`] (config key `checkpoints.max_total_mib`; by default 4 times
//! the architecture's parameter and buffer bytes, at least 64 MiB: [`default_max_total_bytes`]).
//! Only the selected tensors count (EMA and raw weights and optimizer state in one file are not
//! all read). With [`ReadOptions::expected`] (the architecture's names and shapes, which
//! `Model::load_weights` always gives), every reader checks the selected tensors' names and
//! shapes, taken from the checkpoint's metadata (the pickle, the safetensors header, the index,
//! the DCP metadata), before it reads a byte of them: a tensor the architecture does not have,
//! or of another shape, is a [`WeightsError::Mismatch`] and no storage is inflated; a
//! TorchScript archive's other tensor attributes are skipped unread. The total (storages as
//! declared, plus what views repeat) is then checked against the bound, still before reading.
//! So memory is bounded by the architecture's size, the same in `watch` and `eval`.
//!
//! # No recursion on the file's structure
//!
//! Module trees are walked with explicit stacks, bounded in depth and visits and skipping
//! cycles; pickles are run by a flat interpreter; `copyreg` helpers naming each other are
//! followed at most 64 times; a sharded index's shards are read as single safetensors files
//! only (an index naming itself, or another index, is an error at depth one). A shard or
//! `.distcp` file that is a link to a file outside its checkpoint's folder is refused before it
//! is opened, like a `../` path.
//!
//! # TorchScript archives
//!
//! A `torch.jit.save` archive has the same layout as a `torch.save` one (`data.pkl` +
//! `data/<key>`) plus the compiled code (`code/`, `constants.pkl`), which is never read. Its
//! `data.pkl` pickles the module tree as objects of `__torch__.<...>` classes; the interpreter
//! runs it with those classes as inert placeholders (their BUILD state, the attribute dict, is
//! kept as data; no `__setstate__` or any other code runs) and the `torch.jit._pickle` list
//! helpers as identities; every other global is refused as for `torch.save` files. The tensors
//! are every tensor attribute reachable through the modules' attribute dicts, named by dotted
//! attribute path (`down.0.conv.weight`), in pickle order. Parameters, buffers and plain tensor
//! attributes look alike there, so the caller matches them to the architecture leniently
//! (`Model::load_weights`: every parameter and buffer of the architecture must be found with its
//! shape; other tensor attributes of the archive are ignored). `weights_key` and `strip_prefix`
//! do not apply to TorchScript archives (they never did).
//!
//! # Pickled modules
//!
//! A module object (`torch.save(model)`: a placeholder whose BUILD state has `_parameters` and
//! `_modules`; or an EDM-style persistent object: a placeholder call whose one dict argument has
//! a `state` entry that is such an attribute dict, whose `module_src` is never looked at) is
//! read with exactly `module.state_dict()`'s names and order: per module its non-None
//! parameters, its non-None buffers except those in `_non_persistent_buffers_set`, then its
//! children with `name.` prefixes. A module met again on its own path (a cycle) is skipped;
//! depth (256) and entries visited (2^22) are bounded.
//!
//! # Selecting the weights
//!
//! - A pickled module at the root is used as a whole.
//! - With [`ReadOptions::weights_key`] set, that entry of the top-level dict is used; a dotted
//!   path (`state.ema`) walks nested dicts (a key containing dots literally is tried first). It
//!   may hold a state dict (entries that are not tensors are skipped), a module, or a list of
//!   tensors (`shadow_params`, matched by order).
//! - Without it, a top-level dict whose values are all tensors is the state dict. Otherwise the
//!   candidates are the entries holding a non-empty dict of tensors or a module with tensors;
//!   one candidate is used. Among several, with [`ReadOptions::prefer_ema`] `state_dict` when
//!   `current_model_state` is also one (Lightning's weight averaging keeps the averaged weights
//!   in `state_dict`), else the first of `ema`, `ema_model`, `model_ema`, `ema_state_dict`;
//!   then (and always without `prefer_ema`) the first of `current_model_state`, `state_dict`,
//!   `model_state_dict`, `model`, `net`, `module`. Candidates under none of these names are an
//!   error listing the top-level keys. With no candidate, a `shadow_params` list of tensors
//!   (diffusers' `EMAModel.state_dict()`) is used, matched by order ([`Naming::Ordered`]);
//!   otherwise the error lists the top-level keys.
//! - [`ReadOptions::strip_prefix`] (e.g. `module.`) is removed from every name that starts with
//!   it (not from ordered lists). `Model::load_weights` also removes a prefix common to every
//!   name by itself when that makes the names match the architecture.
//! - safetensors files are flat: there `weights_key = k` keeps only the tensors named `k.*` and
//!   removes that `k.` prefix, *if any tensor has it*; otherwise `weights_key` is ignored, so one
//!   configuration serves both `.pt` checkpoints with an `ema` entry and plain safetensors.
//!
//! Supported dtypes are those of [`DType`]; a selected tensor of another dtype (complex,
//! uint16, float8, quantized) is an error naming it, while such tensors elsewhere in the file
//! (e.g. optimizer state) do not matter. Checkpoints written on big-endian machines are refused.
//!
//! [`Checkpoint::naming`] says how names are matched to the architecture: by name (state dicts,
//! safetensors, module trees), leniently by attribute path (TorchScript), or by position
//! (`shadow_params`).

mod error;
mod multifile;
mod pickle;
mod plain_pickle;
mod safetensors_file;
mod select;
#[cfg(test)]
mod tests;
mod torchzip;

use std::fmt;
use std::fs::File;
use std::io::{BufReader, Read, Seek, SeekFrom};
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::os::unix::io::AsRawFd;
use std::path::Path;

pub use error::WeightsError;

/// Element type of a tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    Bool,
    U8,
    I8,
    I16,
    I32,
    I64,
    F16,
    BF16,
    F32,
    F64,
}

impl DType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::Bool | DType::U8 | DType::I8 => 1,
            DType::I16 | DType::F16 | DType::BF16 => 2,
            DType::I32 | DType::F32 => 4,
            DType::I64 | DType::F64 => 8,
        }
    }

    /// The torch name (`float32`, `bfloat16`, ...).
    pub fn name(self) -> &'static str {
        match self {
            DType::Bool => "bool",
            DType::U8 => "uint8",
            DType::I8 => "int8",
            DType::I16 => "int16",
            DType::I32 => "int32",
            DType::I64 => "int64",
            DType::F16 => "float16",
            DType::BF16 => "bfloat16",
            DType::F32 => "float32",
            DType::F64 => "float64",
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A tensor's bytes: contiguous, row-major, little-endian, exactly `numel * dtype.size()` bytes
/// (a 0-d tensor has an empty `shape` and one element).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RawTensor {
    pub dtype: DType,
    pub shape: Vec<usize>,
    pub data: Vec<u8>,
}

impl RawTensor {
    /// Number of elements (product of `shape`; 1 for a 0-d tensor).
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// Named tensors in file order.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StateDict {
    pub tensors: Vec<(String, RawTensor)>,
}

impl StateDict {
    /// The tensor called `name`, if any.
    pub fn get(&self, name: &str) -> Option<&RawTensor> {
        self.tensors.iter().find(|(n, _)| n == name).map(|(_, t)| t)
    }

    pub fn len(&self) -> usize {
        self.tensors.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tensors.is_empty()
    }

    /// Tensor names in file order.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.tensors.iter().map(|(n, _)| n.as_str())
    }
}

/// Container format of a checkpoint file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CheckpointFormat {
    /// A `torch.save` zip archive (`<archive>/data.pkl` + `<archive>/data/<key>`).
    TorchZip,
    /// A safetensors file.
    SafeTensors,
    /// A TorchScript archive (`torch.jit.save`): also a zip, with `constants.pkl` / `code/`.
    TorchScript,
    /// A plain pickle stream (`pickle.dump`, e.g. an EDM `network-snapshot-*.pkl`).
    Pickle,
    /// A sharded safetensors checkpoint, named by its `*.safetensors.index.json`.
    ShardedSafeTensors,
    /// A PyTorch Distributed Checkpoint folder, named by its `.metadata` file.
    Distributed,
}

impl fmt::Display for CheckpointFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            CheckpointFormat::TorchZip => "torch.save zip",
            CheckpointFormat::SafeTensors => "safetensors",
            CheckpointFormat::TorchScript => "TorchScript",
            CheckpointFormat::Pickle => "pickle",
            CheckpointFormat::ShardedSafeTensors => "sharded safetensors",
            CheckpointFormat::Distributed => "distributed checkpoint",
        })
    }
}

/// How to pick the weights out of a checkpoint (config keys `checkpoints.weights_key`,
/// `checkpoints.strip_prefix` and `checkpoints.max_entry_mib`). See the module docs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReadOptions {
    /// Entry of the top-level dict holding the state dict (`ema`, `model`, `state.ema`).
    pub weights_key: Option<String>,
    /// Prefix removed from every tensor name that has it (`module.`).
    pub strip_prefix: Option<String>,
    /// The most bytes any one zip entry of a checkpoint may inflate to.
    pub max_entry_bytes: u64,
    /// Where a checkpoint holds both EMA and raw weights (an `ema` entry beside the model's,
    /// Lightning's weight averaging, diffusers' `unet_ema/` folder), take the EMA ones
    /// (config key `checkpoints.prefer_ema`).
    pub prefer_ema: bool,
    /// The most bytes the selected tensors of one checkpoint may take in memory in all, checked
    /// from the checkpoint's metadata before any tensor byte is read (config key
    /// `checkpoints.max_total_mib`). `None`: no total bound here; `Model::load_weights` then
    /// uses [`default_max_total_bytes`] of the architecture.
    pub max_total_bytes: Option<u64>,
    /// The architecture's parameters and buffers: with it, the selected tensors' names and
    /// shapes are checked before any of their bytes is read (see "Bounded memory").
    pub expected: Option<std::sync::Arc<Expected>>,
}

/// The names and shapes a checkpoint's tensors must have: the architecture's parameters and
/// buffers (and the parameters in order, for an ordered `shadow_params` list).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Expected {
    shapes: std::collections::HashMap<String, Vec<u64>>,
    /// The parameters in order: name and shape.
    params: Vec<(String, Vec<u64>)>,
    bytes: u64,
}

impl Expected {
    /// `tensors`: (name, shape, bytes per element) of every parameter and buffer, the first
    /// `params` of them the parameters in order.
    pub fn new(tensors: impl IntoIterator<Item = (String, Vec<u64>, u64)>, params: usize) -> Self {
        let mut e = Expected::default();
        for (i, (name, shape, elem)) in tensors.into_iter().enumerate() {
            let numel = shape.iter().fold(1u64, |a, &d| a.saturating_mul(d));
            e.bytes = e.bytes.saturating_add(numel.saturating_mul(elem));
            if i < params {
                e.params.push((name.clone(), shape.clone()));
            }
            e.shapes.insert(name, shape);
        }
        e
    }

    /// Bytes the architecture's parameters and buffers take.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// The architecture's shape for a checkpoint name: the name itself, or what follows one of
    /// its dots (a prefix such as `module.` or `model.`, which `Model::load_weights` removes),
    /// preferring one of the same shape.
    fn shape_for(&self, name: &str, shape: &[u64]) -> Option<(&str, &[u64])> {
        let mut found: Option<(&str, &[u64])> = None;
        let tails =
            std::iter::once(name).chain(name.match_indices('.').map(|(i, _)| &name[i + 1..]));
        for tail in tails {
            if let Some((k, want)) = self.shapes.get_key_value(tail) {
                if want.as_slice() == shape {
                    return Some((k, want));
                }
                found.get_or_insert((k, want));
            }
        }
        found
    }
}

/// Default of the total bound when `checkpoints.max_total_mib` is not set: 4 times what the
/// architecture's parameters and buffers take (a checkpoint in float64 for a float32 model,
/// with room for storages its tensors share), and at least 64 MiB.
pub fn default_max_total_bytes(expected: &Expected) -> u64 {
    expected.bytes().saturating_mul(4).max(64 << 20)
}

/// Default of `checkpoints.max_entry_mib`: 16 GiB, more than any one storage of real models.
pub const DEFAULT_MAX_ENTRY_MIB: u64 = 16 << 10;

impl Default for ReadOptions {
    fn default() -> Self {
        ReadOptions {
            weights_key: None,
            strip_prefix: None,
            max_entry_bytes: DEFAULT_MAX_ENTRY_MIB << 20,
            prefer_ema: true,
            max_total_bytes: None,
            expected: None,
        }
    }
}

/// How a checkpoint's tensor names are to be matched to the architecture's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Naming {
    /// `state_dict()` names (a state dict, safetensors, a pickled module tree): exactly the
    /// architecture's parameters and buffers.
    ByName,
    /// Attribute paths of a TorchScript archive: every parameter and buffer of the architecture
    /// must be found; other tensor attributes are ignored.
    AttributePaths,
    /// A list in `model.parameters()` order (diffusers' `EMAModel` `shadow_params`); the names
    /// are `<key>.<index>` and only say where a tensor came from. Mapped onto the
    /// architecture's parameters by position.
    Ordered,
}

/// A checkpoint's tensors, its format and how its names are matched.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Checkpoint {
    pub format: CheckpointFormat,
    pub state: StateDict,
    pub naming: Naming,
}

/// Detects the format by content (zip magic + archive layout; safetensors 8-byte header length
/// + JSON), never by extension.
pub fn detect_format(path: &Path) -> Result<CheckpointFormat, WeightsError> {
    if let Some(kind) = multifile::kind(&multifile::head(path, 256)?) {
        return Ok(multifile_format(kind));
    }
    let (file, len) = open(path)?;
    detect_format_from(file, len, path)
}

fn multifile_format(kind: multifile::Kind) -> CheckpointFormat {
    match kind {
        multifile::Kind::ShardedSafeTensors => CheckpointFormat::ShardedSafeTensors,
        multifile::Kind::Dcp => CheckpointFormat::Distributed,
    }
}

/// Reads the named tensors of a checkpoint (torch.save zip, safetensors or TorchScript archive;
/// see the module docs for how each is named).
pub fn read_checkpoint(path: &Path, opts: &ReadOptions) -> Result<StateDict, WeightsError> {
    Ok(read_weights(path, opts)?.state)
}

/// [`read_checkpoint`] that also says which format the file had (one open, one parse).
pub fn read_weights(path: &Path, opts: &ReadOptions) -> Result<Checkpoint, WeightsError> {
    if let Some(kind) = multifile::kind(&multifile::head(path, 256)?) {
        let mut state = match kind {
            multifile::Kind::ShardedSafeTensors => multifile::read_sharded(path, opts)?,
            multifile::Kind::Dcp => multifile::read_dcp(path, opts)?,
        };
        strip_prefix(&mut state, opts);
        return Ok(Checkpoint {
            format: multifile_format(kind),
            state,
            naming: Naming::ByName,
        });
    }
    let (file, len) = open(path)?;
    read_weights_from(file, len, path, opts)
}

/// Removes `opts.strip_prefix` from every name that has it.
fn strip_prefix(sd: &mut StateDict, opts: &ReadOptions) {
    if let Some(prefix) = opts.strip_prefix.as_deref().filter(|p| !p.is_empty()) {
        for (name, _) in &mut sd.tensors {
            if let Some(rest) = name.strip_prefix(prefix) {
                *name = rest.to_string();
            }
        }
    }
}

/// Cheap structural validity check used to decide a file is complete (zip central directory
/// readable and data.pkl present / safetensors header parses and file length matches the
/// header's offsets). Reads no tensor data.
pub fn validate_structure(path: &Path) -> Result<CheckpointFormat, WeightsError> {
    if let Some(kind) = multifile::kind(&multifile::head(path, 256)?) {
        match kind {
            multifile::Kind::ShardedSafeTensors => multifile::validate_sharded(path)?,
            multifile::Kind::Dcp => multifile::validate_dcp(path)?,
        }
        return Ok(multifile_format(kind));
    }
    let (file, len) = open(path)?;
    validate_structure_from(file, len, path)
}

/// Opens a checkpoint for reading: the one place the readers open files. Opens non-blocking (a
/// FIFO would otherwise block the open until a writer comes) and close-on-exec, refuses anything
/// that `fstat` on the handle does not call a regular file, then clears `O_NONBLOCK`.
fn open(path: &Path) -> Result<(BufReader<File>, u64), WeightsError> {
    let io = |source| WeightsError::Io {
        path: path.to_path_buf(),
        source,
    };
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(path)
        .map_err(io)?;
    let meta = file.metadata().map_err(io)?;
    let ft = meta.file_type();
    if !ft.is_file() {
        let kind = if ft.is_fifo() {
            "FIFO (named pipe)"
        } else if ft.is_socket() {
            "socket"
        } else if ft.is_block_device() {
            "block device"
        } else if ft.is_char_device() {
            "character device"
        } else if ft.is_dir() {
            "directory"
        } else {
            "special file"
        };
        return Err(WeightsError::NotRegularFile {
            path: path.to_path_buf(),
            kind,
        });
    }
    let fd = file.as_raw_fd();
    // SAFETY: fcntl on a descriptor this function owns, with integer flags only.
    let cleared = unsafe {
        let flags = libc::fcntl(fd, libc::F_GETFL);
        flags >= 0 && libc::fcntl(fd, libc::F_SETFL, flags & !libc::O_NONBLOCK) == 0
    };
    if !cleared {
        return Err(io(std::io::Error::last_os_error()));
    }
    Ok((BufReader::with_capacity(64 << 10, file), meta.len()))
}

/// A name taken from inside a file (tensor name, zip entry, pickle global, ...), made safe to
/// quote in a message: control characters escaped (`\n`, `\u{1b}`), at most 120 characters.
pub(crate) fn quote(s: &str) -> String {
    const MAX: usize = 120;
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i == MAX {
            out.push('…');
            break;
        }
        if c.is_control() {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    out
}

/// The container, from the first bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Container {
    Zip,
    SafeTensors,
    /// A pickle stream (protocol 2 to 5) that is not a legacy `torch.save` file.
    Pickle,
}

/// Longest safetensors header accepted (the `safetensors` crate's own limit).
const MAX_SAFETENSORS_HEADER: u64 = 100_000_000;

fn sniff<R: Read + Seek>(r: &mut R, len: u64, path: &Path) -> Result<Container, WeightsError> {
    if len == 0 {
        return Err(WeightsError::EmptyFile {
            path: path.to_path_buf(),
        });
    }
    let io = |source| WeightsError::Io {
        path: path.to_path_buf(),
        source,
    };
    r.seek(SeekFrom::Start(0)).map_err(io)?;
    let mut head = [0u8; 16];
    let mut n = 0;
    while n < head.len() {
        match r.read(&mut head[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(io(e)),
        }
    }
    r.seek(SeekFrom::Start(0)).map_err(io)?;
    let head = &head[..n];
    if head.starts_with(b"PK\x03\x04") || head.starts_with(b"PK\x05\x06") {
        return Ok(Container::Zip);
    }
    if let (Some(len8), Some(b'{')) = (head.get(..8), head.get(8)) {
        let mut a = [0u8; 8];
        a.copy_from_slice(len8);
        let header_len = u64::from_le_bytes(a);
        if (2..=MAX_SAFETENSORS_HEADER).contains(&header_len) {
            return Ok(Container::SafeTensors);
        }
    }
    if n < 9 {
        return Err(WeightsError::TooShort {
            path: path.to_path_buf(),
            len,
        });
    }
    let legacy = head.starts_with(&[0x80, 0x02, 0x8a, 0x0a, 0x6c, 0xfc, 0x9c, 0x46]);
    if !legacy && head.first() == Some(&0x80) && head.get(1).is_some_and(|v| (2..=5).contains(v)) {
        return Ok(Container::Pickle);
    }
    // The content itself is never quoted (the path may be a symlink to any readable file).
    let detail = if legacy {
        "legacy torch.save format from before PyTorch 1.6; load and re-save it with a recent \
         torch"
            .to_string()
    } else if head.first() == Some(&0x80) {
        "a pickle stream of an unknown protocol".to_string()
    } else if head
        .iter()
        .all(|b| b.is_ascii_graphic() || b.is_ascii_whitespace())
    {
        format!("{len} bytes of text")
    } else {
        format!("{len} bytes, unrecognized content")
    };
    Err(WeightsError::UnknownFormat {
        path: path.to_path_buf(),
        detail,
    })
}

/// [`detect_format`] on any seekable reader: `r` holds the whole file, `len` bytes long;
/// `path` only names the file in errors.
pub fn detect_format_from<R: Read + Seek>(
    mut r: R,
    len: u64,
    path: &Path,
) -> Result<CheckpointFormat, WeightsError> {
    match sniff(&mut r, len, path)? {
        Container::Zip => {
            let archive = torchzip::open(r, path)?;
            Ok(torchzip::layout(&archive, path)?.1)
        }
        // The sniffed header length and `{` suffice; the header is parsed when read.
        Container::SafeTensors => Ok(CheckpointFormat::SafeTensors),
        Container::Pickle => Ok(CheckpointFormat::Pickle),
    }
}

/// [`validate_structure`] on any seekable reader: `r` holds the whole file, `len` bytes long;
/// `path` only names the file in errors.
pub fn validate_structure_from<R: Read + Seek>(
    mut r: R,
    len: u64,
    path: &Path,
) -> Result<CheckpointFormat, WeightsError> {
    match sniff(&mut r, len, path)? {
        Container::Zip => {
            let archive = torchzip::open(r, path)?;
            Ok(torchzip::layout(&archive, path)?.1)
        }
        Container::SafeTensors => {
            let header = safetensors_file::read_header(&mut r, len, path)?;
            safetensors_file::check_length(&header, len, path)?;
            Ok(CheckpointFormat::SafeTensors)
        }
        Container::Pickle => {
            plain_pickle::validate(r, len, path)?;
            Ok(CheckpointFormat::Pickle)
        }
    }
}

/// [`read_checkpoint`] on any seekable reader: `r` holds the whole file, `len` bytes long;
/// `path` only names the file in errors.
pub fn read_checkpoint_from<R: Read + Seek>(
    r: R,
    len: u64,
    path: &Path,
    opts: &ReadOptions,
) -> Result<StateDict, WeightsError> {
    Ok(read_weights_from(r, len, path, opts)?.state)
}

/// [`read_weights`] on any seekable reader: `r` holds the whole file, `len` bytes long; `path`
/// only names the file in errors.
pub fn read_weights_from<R: Read + Seek>(
    mut r: R,
    len: u64,
    path: &Path,
    opts: &ReadOptions,
) -> Result<Checkpoint, WeightsError> {
    let (format, (mut sd, naming)) = match sniff(&mut r, len, path)? {
        Container::Zip => {
            let mut archive = torchzip::open(r, path)?;
            match torchzip::layout(&archive, path)? {
                (prefix, CheckpointFormat::TorchScript) => {
                    let sd = torchzip::read_torchscript(&mut archive, &prefix, len, path, opts)?;
                    // Names are attribute paths; weights_key and strip_prefix do not apply.
                    return Ok(Checkpoint {
                        format: CheckpointFormat::TorchScript,
                        state: sd,
                        naming: Naming::AttributePaths,
                    });
                }
                (prefix, format) => (
                    format,
                    torchzip::read(&mut archive, &prefix, len, path, opts)?,
                ),
            }
        }
        Container::SafeTensors => (
            CheckpointFormat::SafeTensors,
            (safetensors_file::read(r, len, path, opts)?, Naming::ByName),
        ),
        Container::Pickle => (
            CheckpointFormat::Pickle,
            plain_pickle::read_bare_pickle(r, len, path, opts)?,
        ),
    };
    if naming == Naming::ByName {
        strip_prefix(&mut sd, opts);
    }
    Ok(Checkpoint {
        format,
        state: sd,
        naming,
    })
}

/// Checks the selected tensors (name, shape) against [`ReadOptions::expected`] before any of
/// their bytes is read, and says which to read. By name: every tensor must be one the
/// architecture has (possibly under a prefix), with its shape; by attribute path (TorchScript):
/// the tensors the architecture does not have are skipped (never read), the others must have
/// its shapes; ordered: the count and each shape must be the parameters'. Without `expected`,
/// everything is read.
pub(crate) fn check_selected(
    opts: &ReadOptions,
    path: &Path,
    naming: Naming,
    tensors: &[(&str, &[u64])],
) -> Result<Vec<bool>, WeightsError> {
    let Some(exp) = opts.expected.as_deref() else {
        return Ok(vec![true; tensors.len()]);
    };
    let mut keep = vec![true; tensors.len()];
    let mut unexpected = Vec::new();
    let mut mismatched = Vec::new();
    match naming {
        Naming::Ordered => {
            if tensors.len() != exp.params.len() {
                return Err(WeightsError::Mismatch {
                    path: path.to_path_buf(),
                    details: format!(
                        "the checkpoint lists {} tensors in parameter order, the architecture \
                         has {} parameters (found before reading them)",
                        tensors.len(),
                        exp.params.len()
                    ),
                });
            }
            // Worded as `Model::load_weights` words it, for the first that differs.
            for (i, ((_, got), (name, want))) in tensors.iter().zip(&exp.params).enumerate() {
                if *got != want.as_slice() {
                    return Err(WeightsError::Mismatch {
                        path: path.to_path_buf(),
                        details: format!(
                            "tensor {i} of the ordered list has shape {got:?}, but parameter {i} \
                             ({}) of the architecture has shape {want:?} (found before reading \
                             them)",
                            quote(name)
                        ),
                    });
                }
            }
        }
        Naming::ByName | Naming::AttributePaths => {
            for (i, (name, shape)) in tensors.iter().enumerate() {
                let found = if naming == Naming::AttributePaths {
                    exp.shapes
                        .get_key_value(*name)
                        .map(|(k, v)| (k.as_str(), v.as_slice()))
                } else {
                    exp.shape_for(name, shape)
                };
                match found {
                    Some((_, want)) if want == *shape => {}
                    Some((_, want)) => mismatched.push(format!(
                        "{}: checkpoint {shape:?}, architecture {want:?}",
                        quote(name)
                    )),
                    None if naming == Naming::AttributePaths => keep[i] = false,
                    None => unexpected.push(quote(name)),
                }
            }
        }
    }
    if unexpected.is_empty() && mismatched.is_empty() {
        return Ok(keep);
    }
    Err(WeightsError::Mismatch {
        path: path.to_path_buf(),
        details: format!(
            "{} (found from the checkpoint's metadata, before reading its tensors)",
            mismatch_parts(&[("unexpected", &unexpected), ("shape mismatch", &mismatched)])
        ),
    })
}

/// `"<what> (<n>): <first five>[ and <n - 5> more]"` for each non-empty list, joined by `; `:
/// how a mismatch between a checkpoint and the architecture is told, here and in `model`.
pub fn mismatch_parts(lists: &[(&str, &[String])]) -> String {
    let mut parts = Vec::new();
    for (what, list) in lists {
        if !list.is_empty() {
            let shown: Vec<&str> = list.iter().take(5).map(String::as_str).collect();
            let more = if list.len() > 5 {
                format!(" and {} more", list.len() - 5)
            } else {
                String::new()
            };
            parts.push(format!(
                "{what} ({}): {}{more}",
                list.len(),
                shown.join(", ")
            ));
        }
    }
    parts.join("; ")
}

/// Refuses a checkpoint whose selected tensors would take more than
/// [`ReadOptions::max_total_bytes`] in memory, before any of them is read. `bytes` comes from
/// the checkpoint's metadata (declared sizes), never from raw file bytes.
pub(crate) fn check_total(opts: &ReadOptions, path: &Path, bytes: u64) -> Result<(), WeightsError> {
    match opts.max_total_bytes {
        Some(limit) if bytes > limit => Err(WeightsError::TooLargeInAll {
            path: path.to_path_buf(),
            bytes,
            limit,
        }),
        _ => Ok(()),
    }
}

/// `a, b, c` (at most 20 names, then a count) for messages.
fn list_names<'a>(names: impl IntoIterator<Item = &'a str>) -> String {
    const MAX: usize = 20;
    let names: Vec<&str> = names.into_iter().collect();
    if names.is_empty() {
        return "none".to_string();
    }
    let mut out = names
        .iter()
        .take(MAX)
        .map(|n| quote(&n.chars().take(80).collect::<String>()))
        .collect::<Vec<_>>()
        .join(", ");
    if names.len() > MAX {
        out.push_str(&format!(", … ({} more)", names.len() - MAX));
    }
    out
}
