//! Checkpoints stored in several files, named by one of them:
//!
//! - a **sharded safetensors index** (`*.safetensors.index.json`, as `save_pretrained` with
//!   `max_shard_size` writes it): JSON `{"metadata": ..., "weight_map": {tensor: shard}}`. Every
//!   shard is a plain file name in the index's folder (no `/`, no `..`) and is read with the
//!   safetensors reader; only the tensors the map assigns to it are kept, and every mapped
//!   tensor must be there. Tensors come out sorted by name.
//! - a **PyTorch Distributed Checkpoint** (`torch.distributed.checkpoint.save`, as FSDP,
//!   torchtitan and Lightning's FSDP strategy write it), named by its `.metadata` file. That
//!   file is a pickle of the `Metadata` dataclass, run in inert mode (every class a placeholder,
//!   nothing called). It lists each tensor's size and chunks, and where each chunk is stored:
//!   a `torch.save` archive of the chunk at an offset and length of a `.distcp` file of the
//!   folder, read through a window of that file with the zip reader. Chunks are checked to lie
//!   within the tensor and to cover it exactly once. Non-tensor items (pickled bytes) are never
//!   read; storage transforms (compression, extensions) are refused.
//!
//! Both are bounded like single files: the index and the metadata at most
//! [`pickle::MAX_PICKLE_BYTES`], each tensor at most `checkpoints.max_entry_mib`.

use super::error::WeightsError;
use super::file::open;
use super::pickle::{self, Classes, Obj, Pickle, Value};
use super::torchzip;
use super::types::{DType, RawTensor, ReadOptions, StateDict};
use std::collections::{BTreeMap, HashMap};
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

/// What a file that names a multi-file checkpoint is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    ShardedSafeTensors,
    Dcp,
}

/// Whether `head` (the first bytes of a file) starts a multi-file checkpoint's index.
pub(crate) fn kind(head: &[u8]) -> Option<Kind> {
    let text = head.iter().find(|b| !b.is_ascii_whitespace());
    if text == Some(&b'{') && head.windows(10).any(|w| w == b"weight_map") {
        return Some(Kind::ShardedSafeTensors);
    }
    if head.first() == Some(&0x80)
        && head
            .windows(29)
            .any(|w| w == b"torch.distributed.checkpoint.")
    {
        return Some(Kind::Dcp);
    }
    None
}

/// The first `n` bytes of `path` (fewer if it is shorter).
pub(crate) fn head(path: &Path, n: usize) -> Result<Vec<u8>, WeightsError> {
    let (r, _) = open(path)?;
    let mut buf = Vec::with_capacity(n);
    r.take(n as u64)
        .read_to_end(&mut buf)
        .map_err(|source| WeightsError::Io {
            path: path.to_path_buf(),
            source,
        })?;
    Ok(buf)
}

fn bad_index(path: &Path, detail: impl Into<String>) -> WeightsError {
    WeightsError::BadIndex {
        path: path.to_path_buf(),
        detail: detail.into(),
    }
}

fn bad_dcp(path: &Path, detail: impl Into<String>) -> WeightsError {
    WeightsError::BadDistributed {
        path: path.to_path_buf(),
        detail: detail.into(),
    }
}

/// The whole of a small file (at most `limit` bytes).
fn read_small(path: &Path, limit: u64) -> Result<Vec<u8>, WeightsError> {
    let (r, len) = open(path)?;
    if len > limit {
        return Err(WeightsError::EntryTooLarge {
            path: path.to_path_buf(),
            entry: String::new(),
            limit,
            why: "the index of a multi-file checkpoint",
        });
    }
    let mut buf = Vec::with_capacity(len as usize);
    r.take(limit + 1)
        .read_to_end(&mut buf)
        .map_err(|source| WeightsError::Io {
            path: path.to_path_buf(),
            source,
        })?;
    Ok(buf)
}

/// A file name inside the checkpoint's folder, as an index names it: one plain component.
fn sibling(index: &Path, name: &str) -> Option<PathBuf> {
    let plain = !name.is_empty()
        && name != "."
        && name != ".."
        && !name.contains('/')
        && !name.contains('\0');
    plain.then(|| index.with_file_name(name))
}

/// Whether `file` (a sibling of `index`) stays inside the index's folder once links are
/// resolved: a shard or `.distcp` file that is a link to a file elsewhere (`/etc/shadow`) is
/// refused like a `../` path, before it is opened. A file that does not exist (yet) passes: its
/// open reports it.
pub(crate) fn stays_in_folder(index: &Path, file: &Path) -> bool {
    let Ok(target) = std::fs::canonicalize(file) else {
        return true;
    };
    let folder = index
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    std::fs::canonicalize(folder).is_ok_and(|f| target.starts_with(f))
}

/// The shards of a sharded safetensors index, in order of first appearance, each with the
/// tensors the map assigns to it.
fn shards(index: &Path) -> Result<Vec<(PathBuf, Vec<String>)>, WeightsError> {
    let data = read_small(index, pickle::MAX_PICKLE_BYTES)?;
    // Only the position of a JSON error is reported, never the text it may quote.
    let json: serde_json::Value = serde_json::from_slice(&data).map_err(|e| {
        bad_index(
            index,
            format!(
                "not valid JSON (at line {}, column {})",
                e.line(),
                e.column()
            ),
        )
    })?;
    let map = json
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| bad_index(index, "no `weight_map` object"))?;
    let mut order: Vec<(PathBuf, Vec<String>)> = Vec::new();
    let mut at: HashMap<String, usize> = HashMap::new();
    for (tensor, shard) in map {
        let shard = shard.as_str().ok_or_else(|| {
            bad_index(
                index,
                format!("`{}` maps to a non-string", super::messages::quote(tensor)),
            )
        })?;
        let path = sibling(index, shard).ok_or_else(|| {
            bad_index(
                index,
                format!(
                    "shard `{}` is not a file name in the index's folder",
                    super::messages::quote(shard)
                ),
            )
        })?;
        if path == index {
            return Err(bad_index(index, "the index names itself as a shard"));
        }
        if !stays_in_folder(index, &path) {
            return Err(bad_index(
                index,
                format!(
                    "shard `{}` is a link to a file outside the index's folder (not read)",
                    super::messages::quote(shard)
                ),
            ));
        }
        let i = *at.entry(shard.to_string()).or_insert_with(|| {
            order.push((path, Vec::new()));
            order.len() - 1
        });
        order[i].1.push(tensor.clone());
    }
    if order.is_empty() {
        return Err(bad_index(index, "the weight map is empty"));
    }
    Ok(order)
}

/// Every shard of the index exists and is a complete safetensors file. A shard is read as a
/// single safetensors file only, never as another index: an index naming itself or another
/// index is an error at depth one, whatever the files say (no recursion on file content).
pub(crate) fn validate_sharded(index: &Path) -> Result<(), WeightsError> {
    for (shard, _) in shards(index)? {
        let (mut r, len) = open(&shard)?;
        let header = super::safetensors_file::read_header(&mut r, len, &shard)?;
        super::safetensors_file::check_length(&header, len, &shard)?;
    }
    Ok(())
}

/// The tensors of a sharded safetensors checkpoint, sorted by name. Every shard's header is
/// read first; the mapped tensors are checked against the architecture and the total bound;
/// then only the mapped tensors are read.
pub(crate) fn read_sharded(index: &Path, opts: &ReadOptions) -> Result<StateDict, WeightsError> {
    let shards = shards(index)?;
    let mut headers = Vec::with_capacity(shards.len());
    // (final name, shape, bytes) of every mapped tensor, for the checks before reading.
    let mut plan: Vec<(String, Vec<u64>, u64)> = Vec::new();
    for (shard, names) in &shards {
        let (mut r, len) = open(shard)?;
        let h = super::safetensors_file::read_header(&mut r, len, shard)?;
        super::safetensors_file::check_length(&h, len, shard)?;
        let found = super::safetensors_file::planned(&h, names);
        if found.len() != names.len() {
            let missing = names
                .iter()
                .find(|n| super::safetensors_file::planned(&h, std::slice::from_ref(*n)).is_empty())
                .map(String::as_str)
                .unwrap_or_default();
            return Err(bad_index(
                index,
                format!(
                    "tensor `{}` is mapped to {} but not in it",
                    super::messages::quote(missing),
                    shard.display()
                ),
            ));
        }
        for (name, (shape, bytes)) in names.iter().zip(found) {
            plan.push((name.clone(), shape, bytes));
        }
        headers.push((r, h));
    }
    // As for one safetensors file: `weights_key = k` keeps `k.*` (prefix removed) if any has it.
    let prefix = opts.weights_key.as_deref().map(|k| format!("{k}."));
    let filter = prefix
        .as_deref()
        .filter(|p| plan.iter().any(|(n, _, _)| n.starts_with(p)));
    let rename = |n: &str| -> Option<String> {
        match filter {
            Some(p) => n.strip_prefix(p).map(str::to_string),
            None => Some(n.to_string()),
        }
    };
    let kept: Vec<(String, &[u64], u64)> = plan
        .iter()
        .filter_map(|(n, shape, b)| rename(n).map(|short| (short, shape.as_slice(), *b)))
        .collect();
    let shapes: Vec<(&str, &[u64])> = kept.iter().map(|(n, s, _)| (n.as_str(), *s)).collect();
    super::check::check_selected(opts, index, super::types::Naming::ByName, &shapes)?;
    let total = kept.iter().fold(0u64, |a, (_, _, b)| a.saturating_add(*b));
    super::check::check_total(opts, index, total)?;
    let mut out: BTreeMap<String, RawTensor> = BTreeMap::new();
    for ((shard, names), (mut r, h)) in shards.iter().zip(headers) {
        let selected: Vec<(String, String)> = names
            .iter()
            .filter_map(|n| rename(n).map(|short| (n.clone(), short)))
            .collect();
        let sd = super::safetensors_file::read_tensors(&mut r, &h, shard, selected)?;
        out.extend(sd.tensors);
    }
    Ok(StateDict {
        tensors: out.into_iter().collect(),
    })
}

/// A window `[start, start + len)` of a file, seekable as a file of its own.
struct Window<R> {
    inner: R,
    start: u64,
    len: u64,
    pos: u64,
}

impl<R: Read + Seek> Read for Window<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let left = self.len.saturating_sub(self.pos);
        if left == 0 {
            return Ok(0);
        }
        let n = (buf.len() as u64).min(left) as usize;
        self.inner.seek(SeekFrom::Start(self.start + self.pos))?;
        let k = self.inner.read(&mut buf[..n])?;
        self.pos += k as u64;
        Ok(k)
    }
}

impl<R: Read + Seek> Seek for Window<R> {
    fn seek(&mut self, to: SeekFrom) -> std::io::Result<u64> {
        let pos = match to {
            SeekFrom::Start(p) => Some(p),
            SeekFrom::End(d) => self.len.checked_add_signed(d),
            SeekFrom::Current(d) => self.pos.checked_add_signed(d),
        };
        let pos = pos.ok_or_else(|| std::io::Error::other("seek before the start"))?;
        self.pos = pos;
        Ok(pos)
    }
}

/// Where a chunk of a tensor is stored.
#[derive(Debug, Clone)]
struct Stored {
    file: String,
    offset: u64,
    length: u64,
}

/// A tensor of the checkpoint: its full size and chunks (offsets, sizes).
struct Planned {
    fqn: String,
    size: Vec<u64>,
    chunks: Vec<(Vec<u64>, Vec<u64>)>,
}

fn state<'p>(p: &'p Pickle, v: &Value) -> Option<&'p pickle::Dict> {
    p.dict(p.instance(v)?.state.as_ref()?)
}

/// A `torch.Size` (a placeholder called with one tuple of ints) or a plain tuple of ints.
fn ints(p: &Pickle, v: &Value) -> Option<Vec<u64>> {
    let items = match p.obj(v)? {
        Obj::Tuple(t) | Obj::List(t) => t,
        Obj::Instance(i) => match i.args.first().and_then(|a| p.obj(a))? {
            Obj::Tuple(t) | Obj::List(t) => t,
            _ => return None,
        },
        _ => return None,
    };
    items
        .iter()
        .map(|x| match x {
            Value::Int(i) => u64::try_from(*i).ok(),
            _ => None,
        })
        .collect()
}

fn str_of(v: Option<&Value>) -> Option<&str> {
    match v? {
        Value::Str(s) => Some(s),
        _ => None,
    }
}

fn int_of(v: Option<&Value>) -> Option<u64> {
    match v? {
        Value::Int(i) => u64::try_from(*i).ok(),
        _ => None,
    }
}

/// The parsed `.metadata`: tensors (in file order), where their chunks are, and the nested key
/// path of each name (`planner_data`).
struct Metadata {
    tensors: Vec<Planned>,
    stored: HashMap<(String, Vec<u64>), Stored>,
    groups: HashMap<String, String>,
}

fn metadata(path: &Path) -> Result<Metadata, WeightsError> {
    let data = read_small(path, pickle::MAX_PICKLE_BYTES)?;
    let p = pickle::parse(&data, Classes::Inert)
        .map_err(|e| torchzip::pickle_error(e, path, ".metadata"))?;
    let bad = |d: &str| bad_dcp(path, d.to_string());
    let root = state(&p, &p.root).ok_or_else(|| bad("not a Metadata object"))?;
    let sdm = root
        .get_str("state_dict_metadata")
        .and_then(|v| p.dict(v))
        .ok_or_else(|| bad("no state_dict_metadata"))?;
    let mut tensors = Vec::new();
    for (k, v) in sdm.items() {
        let Value::Str(fqn) = k else { continue };
        let Some(inst) = p.instance(v) else { continue };
        if !inst.class.ends_with("TensorStorageMetadata") {
            continue; // bytes items: never read
        }
        let st = state(&p, v).ok_or_else(|| bad("a tensor entry without fields"))?;
        let size = st
            .get_str("size")
            .and_then(|s| ints(&p, s))
            .ok_or_else(|| bad("a tensor without a size"))?;
        let Some(Obj::List(chunks)) = st.get_str("chunks").and_then(|c| p.obj(c)) else {
            return Err(bad("a tensor without chunks"));
        };
        let mut planned = Vec::new();
        for c in chunks {
            let cs = state(&p, c).ok_or_else(|| bad("a chunk without fields"))?;
            let offsets = cs.get_str("offsets").and_then(|o| ints(&p, o));
            let sizes = cs.get_str("sizes").and_then(|o| ints(&p, o));
            let (Some(o), Some(s)) = (offsets, sizes) else {
                return Err(bad("a chunk without offsets or sizes"));
            };
            planned.push((o, s));
        }
        tensors.push(Planned {
            fqn: fqn.to_string(),
            size,
            chunks: planned,
        });
    }
    let storage = root
        .get_str("storage_data")
        .and_then(|v| p.dict(v))
        .ok_or_else(|| bad("no storage_data"))?;
    let mut stored = HashMap::new();
    for (k, v) in storage.items() {
        let (Some(ks), Some(vs)) = (state(&p, k), state(&p, v)) else {
            return Err(bad("a storage entry without fields"));
        };
        let Some(fqn) = str_of(ks.get_str("fqn")) else {
            return Err(bad("a storage entry without a name"));
        };
        let offsets = ks
            .get_str("offset")
            .and_then(|o| ints(&p, o))
            .unwrap_or_default();
        if !matches!(
            vs.get_str("transform_descriptors"),
            None | Some(Value::None)
        ) {
            return Err(bad_dcp(
                path,
                format!(
                    "`{}` is stored with transforms (compression or extensions), which diffmon does not read",
                    super::messages::quote(fqn)
                ),
            ));
        }
        let (Some(file), Some(offset), Some(length)) = (
            str_of(vs.get_str("relative_path")),
            int_of(vs.get_str("offset")),
            int_of(vs.get_str("length")),
        ) else {
            return Err(bad("a storage entry without file, offset or length"));
        };
        stored.insert(
            (fqn.to_string(), offsets),
            Stored {
                file: file.to_string(),
                offset,
                length,
            },
        );
    }
    let mut groups = HashMap::new();
    if let Some(pd) = root.get_str("planner_data").and_then(|v| p.dict(v)) {
        for (k, v) in pd.items() {
            let (Value::Str(fqn), Some(Obj::Tuple(path) | Obj::List(path))) = (k, p.obj(v)) else {
                continue;
            };
            if path.len() > 1
                && let Some(Value::Str(first)) = path.first()
            {
                groups.insert(fqn.to_string(), first.to_string());
            }
        }
    }
    Ok(Metadata {
        tensors,
        stored,
        groups,
    })
}

fn outside(path: &Path, file: &str) -> WeightsError {
    bad_dcp(
        path,
        format!(
            "`{}` is a link to a file outside the checkpoint's folder (not read)",
            super::messages::quote(file)
        ),
    )
}

/// Every `.distcp` file the metadata names exists and holds the ranges it names.
pub(crate) fn validate_dcp(path: &Path) -> Result<(), WeightsError> {
    let md = metadata(path)?;
    let mut lens: HashMap<&str, u64> = HashMap::new();
    for s in md.stored.values() {
        if !lens.contains_key(s.file.as_str()) {
            let file = sibling(path, &s.file).ok_or_else(|| {
                bad_dcp(
                    path,
                    format!(
                        "`{}` is not a file name in the folder",
                        super::messages::quote(&s.file)
                    ),
                )
            })?;
            if !stays_in_folder(path, &file) {
                return Err(outside(path, &s.file));
            }
            let (_, len) = open(&file)?;
            lens.insert(&s.file, len);
        }
        if s.offset
            .checked_add(s.length)
            .is_none_or(|end| end > lens[s.file.as_str()])
        {
            return Err(WeightsError::TruncatedPickle {
                path: path.with_file_name(&s.file),
            });
        }
    }
    Ok(())
}

/// Which tensors to read: by `weights_key`, else the `ema` group (with `prefer_ema`), else
/// `model`, else the only group, else everything; with the group's prefix removed.
fn choose(
    md: &Metadata,
    path: &Path,
    opts: &ReadOptions,
) -> Result<(Option<String>, Vec<usize>), WeightsError> {
    let group_of = |t: &Planned| md.groups.get(&t.fqn).cloned();
    let mut names: Vec<String> = md.tensors.iter().filter_map(group_of).collect();
    names.sort();
    names.dedup();
    let pick = if let Some(k) = opts.weights_key.as_deref() {
        if !names.iter().any(|n| n == k) {
            return Err(WeightsError::NoStateDict {
                path: path.to_path_buf(),
                key: k.to_string(),
                keys: names.join(", "),
            });
        }
        Some(k.to_string())
    } else if opts.prefer_ema && names.iter().any(|n| n == "ema") {
        Some("ema".to_string())
    } else if names.iter().any(|n| n == "model") {
        Some("model".to_string())
    } else if names.len() == 1 {
        names.first().cloned()
    } else if names.is_empty() {
        None
    } else {
        return Err(WeightsError::AmbiguousStateDict {
            path: path.to_path_buf(),
            reason: "several top-level entries hold tensors".into(),
            keys: names.join(", "),
        });
    };
    let idx = md
        .tensors
        .iter()
        .enumerate()
        .filter(|(_, t)| pick.is_none() || group_of(t) == pick)
        .map(|(i, _)| i)
        .collect();
    Ok((pick, idx))
}

/// One chunk's tensor: the `torch.save` archive at its range of its `.distcp` file.
fn read_chunk(
    path: &Path,
    fqn: &str,
    s: &Stored,
    opts: &ReadOptions,
) -> Result<RawTensor, WeightsError> {
    let file = sibling(path, &s.file).ok_or_else(|| {
        bad_dcp(
            path,
            format!(
                "`{}` is not a file name in the folder",
                super::messages::quote(&s.file)
            ),
        )
    })?;
    if !stays_in_folder(path, &file) {
        return Err(outside(path, &s.file));
    }
    let (r, len) = open(&file)?;
    if s.offset.checked_add(s.length).is_none_or(|end| end > len) {
        return Err(WeightsError::TruncatedPickle { path: file });
    }
    let window = Window {
        inner: r,
        start: s.offset,
        len: s.length,
        pos: 0,
    };
    let mut archive = torchzip::open(window, &file)?;
    let (prefix, _) = torchzip::layout(&archive, &file)?;
    let p = torchzip::read_pickle(&mut archive, &prefix, s.length, &file, opts, Classes::None)?;
    let Some(meta) = p.tensor(&p.root) else {
        return Err(bad_dcp(
            path,
            format!(
                "the item of `{}` is {}, not a tensor",
                super::messages::quote(fqn),
                p.describe(&p.root)
            ),
        ));
    };
    let mut t = torchzip::materialize_all(
        Some(&mut archive),
        &prefix,
        s.length,
        &file,
        opts,
        vec![(fqn.to_string(), meta)],
        None,
    )?;
    Ok(t.pop().expect("one tensor").1)
}

/// The tensors of a distributed checkpoint, in the metadata's order.
pub(crate) fn read_dcp(path: &Path, opts: &ReadOptions) -> Result<StateDict, WeightsError> {
    let md = metadata(path)?;
    let (group, idx) = choose(&md, path, opts)?;
    // Names and sizes from the metadata are checked before any chunk is read; a tensor's bytes
    // are bounded by 8 per element (the widest dtype read).
    let short = |t: &Planned| -> String {
        match &group {
            Some(g) => t
                .fqn
                .strip_prefix(&format!("{g}."))
                .unwrap_or(&t.fqn)
                .to_string(),
            None => t.fqn.clone(),
        }
    };
    let names: Vec<String> = idx.iter().map(|&i| short(&md.tensors[i])).collect();
    let shapes: Vec<(&str, &[u64])> = idx
        .iter()
        .zip(&names)
        .map(|(&i, n)| (n.as_str(), md.tensors[i].size.as_slice()))
        .collect();
    super::check::check_selected(opts, path, super::types::Naming::ByName, &shapes)?;
    let total = idx.iter().fold(0u64, |a, &i| {
        let numel = md.tensors[i]
            .size
            .iter()
            .fold(1u64, |n, &d| n.saturating_mul(d));
        a.saturating_add(numel.saturating_mul(8))
    });
    super::check::check_total(opts, path, total)?;
    let mut tensors = Vec::with_capacity(idx.len());
    for (i, name) in idx.into_iter().zip(names) {
        tensors.push((name, assemble(path, &md.tensors[i], &md, opts)?));
    }
    Ok(StateDict { tensors })
}

/// A whole tensor from its chunks, each checked to lie inside it; together they must cover it
/// exactly once.
fn assemble(
    path: &Path,
    t: &Planned,
    md: &Metadata,
    opts: &ReadOptions,
) -> Result<RawTensor, WeightsError> {
    let bad = |d: String| bad_dcp(path, format!("`{}`: {d}", super::messages::quote(&t.fqn)));
    let numel = t
        .size
        .iter()
        .try_fold(1u64, |a, &d| a.checked_mul(d))
        .ok_or_else(|| bad("its size overflows".into()))?;
    let mut full: Option<(DType, Vec<u8>, Vec<bool>)> = None;
    let mut covered = 0u64;
    for (offsets, sizes) in &t.chunks {
        if offsets.len() != t.size.len() || sizes.len() != t.size.len() {
            return Err(bad("a chunk of another rank".into()));
        }
        if offsets
            .iter()
            .zip(sizes)
            .zip(&t.size)
            .any(|((o, s), d)| o.checked_add(*s).is_none_or(|e| e > *d))
        {
            return Err(bad(format!(
                "chunk at {offsets:?} of size {sizes:?} lies outside {:?}",
                t.size
            )));
        }
        let key = (t.fqn.clone(), offsets.clone());
        let stored = md
            .stored
            .get(&key)
            .ok_or_else(|| bad(format!("no storage for the chunk at {offsets:?}")))?;
        let chunk = read_chunk(path, &t.fqn, stored, opts)?;
        if chunk.shape.iter().map(|&d| d as u64).collect::<Vec<_>>() != *sizes {
            return Err(bad(format!(
                "the chunk at {offsets:?} holds {:?}, not {sizes:?}",
                chunk.shape
            )));
        }
        if t.chunks.len() == 1 && *sizes == t.size {
            return Ok(chunk);
        }
        let el = chunk.dtype.size() as u64;
        let bytes = numel.checked_mul(el).filter(|b| *b <= opts.max_entry_bytes);
        let Some(bytes) = bytes else {
            return Err(bad("larger than checkpoints.max_entry_mib".into()));
        };
        let (dtype, buf, seen) = full.get_or_insert_with(|| {
            (
                chunk.dtype,
                vec![0u8; bytes as usize],
                vec![false; numel as usize],
            )
        });
        if *dtype != chunk.dtype {
            return Err(bad("chunks of different dtypes".into()));
        }
        // Copy row by row (the last dimension is contiguous in both).
        let nd = t.size.len();
        let row = sizes.last().copied().unwrap_or(1);
        let rows: u64 = sizes[..nd.saturating_sub(1)].iter().product();
        let mut idx = vec![0u64; nd.saturating_sub(1)];
        for r in 0..rows {
            let mut lin = 0u64;
            for d in 0..nd {
                let i = (if d + 1 == nd { 0 } else { idx[d] }) + offsets[d];
                lin = lin * t.size[d] + i;
            }
            for e in lin..lin + row {
                if std::mem::replace(&mut seen[e as usize], true) {
                    return Err(bad("chunks overlap".into()));
                }
            }
            let src = (r * row * el) as usize..((r + 1) * row * el) as usize;
            let dst = (lin * el) as usize..((lin + row) * el) as usize;
            buf[dst].copy_from_slice(&chunk.data[src]);
            for d in (0..idx.len()).rev() {
                idx[d] += 1;
                if idx[d] < sizes[d] {
                    break;
                }
                idx[d] = 0;
            }
        }
        covered += rows * row;
    }
    match full {
        Some((dtype, data, _)) if covered == numel => Ok(RawTensor {
            dtype,
            shape: t.size.iter().map(|&d| d as usize).collect(),
            data,
        }),
        _ => Err(bad(format!(
            "its chunks cover {covered} of {numel} elements"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_are_told_by_content() {
        assert_eq!(
            kind(b"{\n  \"metadata\": {}, \"weight_map\": {"),
            Some(Kind::ShardedSafeTensors)
        );
        let mut dcp = vec![0x80, 4, 0x95, 0, 0, 0, 0, 0, 0, 0, 0, 0x8c, 37];
        dcp.extend_from_slice(b"torch.distributed.checkpoint.metadata");
        assert_eq!(kind(&dcp), Some(Kind::Dcp));
        assert_eq!(kind(b"\x80\x02}q\x00"), None);
        assert_eq!(kind(b"{\"a\": 1}"), None);
    }

    #[test]
    fn shard_names_must_stay_in_the_folder() {
        let index = Path::new("/run/ckpt/model.safetensors.index.json");
        assert!(sibling(index, "model-00001-of-00002.safetensors").is_some());
        for bad in ["", ".", "..", "../x.safetensors", "a/b", "/etc/passwd"] {
            assert!(sibling(index, bad).is_none(), "{bad}");
        }
    }
}
