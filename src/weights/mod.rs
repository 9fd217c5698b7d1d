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
//!
//! # Files
//!
//! `mod.rs` detects, validates and reads a checkpoint, dispatching on its container;
//! `types.rs` the shared types ([`StateDict`], [`RawTensor`], [`DType`], [`ReadOptions`],
//! [`Expected`], [`Naming`], [`Checkpoint`], [`CheckpointFormat`]); `error.rs` the
//! [`WeightsError`]; `messages.rs` how names from inside a file are quoted in messages;
//! `file.rs` opening a file (regular files only) and sniffing its container; `check.rs` the
//! checks of names, shapes and total size before any tensor is read; `torchzip.rs`
//! `torch.save` and TorchScript zip archives; `plain_pickle.rs` plain pickle files;
//! `safetensors_file.rs` safetensors files; `multifile.rs` sharded safetensors and distributed
//! checkpoints; `pickle.rs` the pickle interpreter; `select.rs` choosing the weights in an
//! unpickled object tree.

mod check;
mod error;
mod file;
mod messages;
mod multifile;
mod pickle;
mod plain_pickle;
mod safetensors_file;
mod select;
#[cfg(test)]
mod tests;
mod torchzip;
mod types;

use file::{Container, open, sniff};
use std::io::{Read, Seek};
use std::path::Path;

pub use error::WeightsError;
pub use messages::mismatch_parts;
pub(crate) use messages::quote;
pub use types::{
    Checkpoint, CheckpointFormat, DEFAULT_MAX_ENTRY_MIB, DType, Expected, Naming, RawTensor,
    ReadOptions, StateDict, default_max_total_bytes,
};

/// Detects the format by content (zip magic + archive layout; safetensors 8-byte header length
/// + JSON), never by extension.
pub fn detect_format(path: &Path) -> Result<CheckpointFormat, WeightsError> {
    if let Some(kind) = multifile_kind(path)? {
        return Ok(multifile_format(kind));
    }
    let (file, len) = open(path)?;
    detect_format_from(file, len, path)
}

/// Does the file `path` name other files that hold its tensors (a sharded safetensors index, a
/// distributed checkpoint's `.metadata`)? Reads its first bytes only; `false` when unreadable.
pub fn names_other_files(path: &Path) -> bool {
    multifile_kind(path).is_ok_and(|kind| kind.is_some())
}

/// The kind of multi-file checkpoint whose index or metadata `path` is, told by its first bytes.
fn multifile_kind(path: &Path) -> Result<Option<multifile::Kind>, WeightsError> {
    Ok(multifile::kind(&multifile::head(path, 256)?))
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
    if let Some(kind) = multifile_kind(path)? {
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
    if let Some(kind) = multifile_kind(path)? {
        match kind {
            multifile::Kind::ShardedSafeTensors => multifile::validate_sharded(path)?,
            multifile::Kind::Dcp => multifile::validate_dcp(path)?,
        }
        return Ok(multifile_format(kind));
    }
    let (file, len) = open(path)?;
    validate_structure_from(file, len, path)
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
