//! `torch.save` zip archives: layout, state-dict selection and tensor materialization.

use std::collections::HashMap;
use std::io::{Read, Seek};
use std::path::Path;

use zip::ZipArchive;
use zip::result::ZipError;

use super::error::WeightsError;
use super::messages::quote;
use super::pickle::{self, ElemType, Pickle, PickleError, StorageKind, TensorMeta, Value};
use super::select::{self, MAX_MODULE_DEPTH, MAX_MODULE_VISITS, same_obj};
use super::types::{CheckpointFormat, DType, Naming, RawTensor, ReadOptions, StateDict};

/// Opens the zip's central directory.
pub(crate) fn open<R: Read + Seek>(r: R, path: &Path) -> Result<ZipArchive<R>, WeightsError> {
    ZipArchive::new(r).map_err(|e| corrupt(path, e.to_string()))
}

fn corrupt(path: &Path, detail: String) -> WeightsError {
    WeightsError::CorruptZip {
        path: path.to_path_buf(),
        detail,
    }
}

/// The archive folder (`"name/"`, as a prefix of every entry) and whether this is a
/// `torch.save` archive or a TorchScript one.
pub(crate) fn layout<R: Read + Seek>(
    archive: &ZipArchive<R>,
    path: &Path,
) -> Result<(String, CheckpointFormat), WeightsError> {
    let prefix = archive.file_names().find_map(|name| {
        if name == "data.pkl" {
            return Some(String::new());
        }
        let dir = name.strip_suffix("/data.pkl")?;
        (!dir.contains('/')).then(|| format!("{dir}/"))
    });
    let is_ts = |p: &str| {
        archive.file_names().any(|n| {
            n.strip_prefix(p)
                .is_some_and(|rest| rest == "constants.pkl" || rest.starts_with("code/"))
        })
    };
    match prefix {
        Some(p) if is_ts(&p) => Ok((p, CheckpointFormat::TorchScript)),
        Some(p) => Ok((p, CheckpointFormat::TorchZip)),
        None => {
            // A TorchScript archive without data.pkl is still TorchScript (constants only).
            let ts = archive.file_names().any(|n| {
                n.ends_with("/constants.pkl") && n.matches('/').count() == 1
                    || n.split('/').nth(1) == Some("code")
            });
            if ts {
                let p = archive
                    .file_names()
                    .find_map(|n| n.split_once('/').map(|(d, _)| format!("{d}/")))
                    .unwrap_or_default();
                return Ok((p, CheckpointFormat::TorchScript));
            }
            Err(WeightsError::MissingEntry {
                path: path.to_path_buf(),
                entry: "<archive>/data.pkl".to_string(),
                context: String::new(),
            })
        }
    }
}

/// How large an entry may inflate to, and why (for the message).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Limit {
    pub(crate) bytes: u64,
    pub(crate) why: &'static str,
}

impl Limit {
    /// The smaller of what the content declares and the configured ceiling
    /// (`checkpoints.max_entry_mib`).
    fn declared(declared: Option<u64>, ceiling: u64) -> Limit {
        match declared {
            Some(d) if d <= ceiling => Limit {
                bytes: d,
                why: "what its tensors declare",
            },
            _ => Limit {
                bytes: ceiling,
                why: "checkpoints.max_entry_mib",
            },
        }
    }
}

/// Reads one zip entry completely (CRC-checked), refusing entries larger than `limit`. The
/// directory's sizes are not trusted: the entry is read through `take(limit + 1)`, so a
/// compressed entry never inflates to more than `limit + 1` bytes, and at most a few times the
/// file's length is reserved up front.
fn read_entry<R: Read + Seek>(
    archive: &mut ZipArchive<R>,
    name: &str,
    limit: Limit,
    file_len: u64,
    path: &Path,
    context: &str,
) -> Result<Vec<u8>, WeightsError> {
    let mut entry = match archive.by_name(name) {
        Ok(e) => e,
        Err(ZipError::FileNotFound) => {
            return Err(WeightsError::MissingEntry {
                path: path.to_path_buf(),
                entry: name.to_string(),
                context: context.to_string(),
            });
        }
        Err(e) => return Err(corrupt(path, format!("entry `{}`: {e}", quote(name)))),
    };
    let too_large = || WeightsError::EntryTooLarge {
        path: path.to_path_buf(),
        entry: name.to_string(),
        limit: limit.bytes,
        why: limit.why,
    };
    let size = entry.size();
    if size > limit.bytes {
        return Err(too_large());
    }
    // Stored entries (what torch writes) cannot be larger than the file; for compressed ones
    // reserve at most a few times the file size up front and let the buffer grow.
    let stored = entry.compression() == zip::CompressionMethod::Stored;
    if stored && size > file_len {
        return Err(corrupt(
            path,
            format!(
                "entry `{}` claims {size} bytes, more than the whole file",
                quote(name)
            ),
        ));
    }
    let reserve = if stored {
        size
    } else {
        size.min(file_len.saturating_mul(4))
    };
    let mut buf = Vec::new();
    usize::try_from(reserve)
        .ok()
        .and_then(|n| buf.try_reserve_exact(n).ok())
        .ok_or_else(|| {
            corrupt(
                path,
                format!("cannot allocate {size} bytes for `{}`", quote(name)),
            )
        })?;
    // Read one byte past the bound: the zip reader checks the CRC when it reaches the end of the
    // entry, and an entry longer than its directory says (or than the limit) is detected.
    entry
        .by_ref()
        .take(size.min(limit.bytes).saturating_add(1))
        .read_to_end(&mut buf)
        .map_err(|e| corrupt(path, format!("reading `{}`: {e}", quote(name))))?;
    if buf.len() as u64 > limit.bytes {
        return Err(too_large());
    }
    if buf.len() as u64 != size {
        return Err(corrupt(
            path,
            format!(
                "entry `{}` holds {} bytes, its directory entry says {size}",
                quote(name),
                buf.len()
            ),
        ));
    }
    Ok(buf)
}

pub(crate) fn pickle_error(e: PickleError, path: &Path, entry: &str) -> WeightsError {
    let path = path.to_path_buf();
    match e {
        PickleError::Forbidden(global) => WeightsError::ForbiddenGlobal { path, global },
        PickleError::Opcode { offset, code } => WeightsError::UnsupportedOpcode {
            path,
            entry: entry.to_string(),
            offset,
            code,
            name: pickle::opcode_name(code),
        },
        PickleError::Malformed { offset, detail } => WeightsError::Pickle {
            path,
            entry: entry.to_string(),
            offset,
            detail,
        },
    }
}

/// Refuses archives whose `byteorder` entry is not `little`.
fn check_byteorder<R: Read + Seek>(
    archive: &mut ZipArchive<R>,
    prefix: &str,
    file_len: u64,
    path: &Path,
) -> Result<(), WeightsError> {
    let byteorder = format!("{prefix}byteorder");
    if archive.index_for_name(&byteorder).is_some() {
        let limit = Limit {
            bytes: 64,
            why: "a byte order name",
        };
        let bytes = read_entry(archive, &byteorder, limit, file_len, path, "")?;
        let order = String::from_utf8_lossy(&bytes);
        let order = order.trim();
        if order != "little" {
            return Err(WeightsError::ByteOrder {
                path: path.to_path_buf(),
                order: order.to_string(),
            });
        }
    }
    Ok(())
}

/// Runs the archive's `data.pkl` under the `classes` policy.
pub(crate) fn read_pickle<R: Read + Seek>(
    archive: &mut ZipArchive<R>,
    prefix: &str,
    file_len: u64,
    path: &Path,
    opts: &ReadOptions,
    classes: pickle::Classes,
) -> Result<Pickle, WeightsError> {
    check_byteorder(archive, prefix, file_len, path)?;
    let pkl = format!("{prefix}data.pkl");
    let limit = Limit::declared(Some(pickle::MAX_PICKLE_BYTES), opts.max_entry_bytes);
    let data = read_entry(archive, &pkl, limit, file_len, path, "")?;
    pickle::parse(&data, classes).map_err(|e| pickle_error(e, path, &pkl))
}

/// Reads the selected weights of a `torch.save` archive whose entries start with `prefix`.
///
/// `data.pkl` runs under the strict allow-list first. Only when that stops at a foreign global
/// ([`WeightsError::ForbiddenGlobal`]: a pickled module, Lightning's hyper-parameters, ...) is it
/// run again, under the same bounds, in inert mode ([`pickle::Classes::Inert`]); that result is
/// used if the selection rules find weights in it (a module tree, a state dict, a
/// `shadow_params` list). Otherwise the strict error is returned unchanged.
pub(crate) fn read<R: Read + Seek>(
    archive: &mut ZipArchive<R>,
    prefix: &str,
    file_len: u64,
    path: &Path,
    opts: &ReadOptions,
) -> Result<(StateDict, Naming), WeightsError> {
    let pkl = format!("{prefix}data.pkl");
    let bad = |detail: String| WeightsError::Pickle {
        path: path.to_path_buf(),
        entry: pkl.clone(),
        offset: 0,
        detail,
    };
    // Read strictly first; on a foreign global, again with every class an inert placeholder,
    // keeping the strict error for when that finds no weights either.
    let (pickle, strict) =
        match read_pickle(archive, prefix, file_len, path, opts, pickle::Classes::None) {
            Ok(p) => (p, None),
            Err(strict @ WeightsError::ForbiddenGlobal { .. }) => {
                let classes = pickle::Classes::Inert;
                match read_pickle(archive, prefix, file_len, path, opts, classes) {
                    Ok(inert) => (inert, Some(strict)),
                    Err(_) => return Err(strict),
                }
            }
            Err(e) => return Err(e),
        };
    let sel = match (select::select(&pickle, opts, path, &bad), strict) {
        (Ok(sel), None) => sel,
        (Ok(sel), Some(_)) if !sel.tensors.is_empty() => sel,
        (Err(e), None) => return Err(e),
        (_, Some(strict)) => return Err(strict),
    };
    let tensors = materialize_all(
        Some(archive),
        prefix,
        file_len,
        path,
        opts,
        sel.tensors,
        Some(sel.naming),
    )?;
    Ok((StateDict { tensors }, sel.naming))
}

/// Reads every tensor attribute of a TorchScript archive's module tree, named by its dotted
/// attribute path (`down.0.conv.weight`), in pickle order. The archive's `data.pkl` runs with
/// `__torch__.*` classes as inert placeholders ([`pickle::Classes::TorchScript`]); the `code/`
/// folder and `constants.pkl` (the compiled code and its constants) are never read. Tensors are
/// found in the attribute dicts that BUILD gave the module objects; a module whose state is not
/// a dict (a custom `__getstate__`) contributes no names.
pub(crate) fn read_torchscript<R: Read + Seek>(
    archive: &mut ZipArchive<R>,
    prefix: &str,
    file_len: u64,
    path: &Path,
    opts: &ReadOptions,
) -> Result<StateDict, WeightsError> {
    let pkl = format!("{prefix}data.pkl");
    let pickle = read_pickle(
        archive,
        prefix,
        file_len,
        path,
        opts,
        pickle::Classes::TorchScript,
    )?;
    let malformed = |detail: String| WeightsError::Pickle {
        path: path.to_path_buf(),
        entry: pkl.clone(),
        offset: 0,
        detail,
    };
    if pickle.instance(&pickle.root).is_none() {
        return Err(malformed(format!(
            "the archive's root is {}, not a module",
            pickle.describe(&pickle.root)
        )));
    }
    let mut selected = Vec::new();
    let mut on_path = Vec::new();
    let mut visits = 0usize;
    collect_attributes(
        &pickle,
        &pickle.root,
        "",
        &mut on_path,
        &mut visits,
        &mut selected,
    )
    .map_err(malformed)?;
    let tensors = materialize_all(
        Some(archive),
        prefix,
        file_len,
        path,
        opts,
        selected,
        Some(Naming::AttributePaths),
    )?;
    Ok(StateDict { tensors })
}

/// Appends the tensors reachable from the module `v` through attribute dicts, as
/// `(prefix + dotted path, tensor)`, in attribute order. `on_path` holds the objects being
/// walked (a cycle is skipped); depth and the number of visits are bounded. Walked with an
/// explicit stack: no recursion on the file's structure.
fn collect_attributes<'p>(
    p: &'p Pickle,
    v: &'p Value,
    prefix: &str,
    on_path: &mut Vec<&'p Value>,
    visits: &mut usize,
    out: &mut Vec<(String, &'p TensorMeta)>,
) -> Result<(), String> {
    /// A module being walked: its attributes and the next one to visit.
    struct Frame<'p> {
        prefix: String,
        attrs: &'p [(Value, Value)],
        next: usize,
    }
    let attrs_of = |v: &'p Value| {
        p.instance(v)
            .and_then(|i| i.state.as_ref())
            .and_then(|s| p.dict(s))
            .map(|d| d.items())
    };
    let base = on_path.len();
    let mut stack: Vec<Frame<'p>> = Vec::new();
    let enter = |v: &'p Value,
                 prefix: String,
                 on_path: &mut Vec<&'p Value>,
                 stack: &mut Vec<Frame<'p>>|
     -> Result<(), String> {
        let Some(attrs) = attrs_of(v) else {
            return Ok(());
        };
        if on_path.len() >= MAX_MODULE_DEPTH {
            return Err(format!(
                "modules nested deeper than {MAX_MODULE_DEPTH} levels"
            ));
        }
        on_path.push(v);
        stack.push(Frame {
            prefix,
            attrs,
            next: 0,
        });
        Ok(())
    };
    enter(v, prefix.to_string(), on_path, &mut stack)?;
    while let Some(top) = stack.last_mut() {
        let Some((k, value)) = top.attrs.get(top.next) else {
            stack.pop();
            on_path.pop();
            continue;
        };
        top.next += 1;
        let Value::Str(name) = k else { continue };
        *visits += 1;
        if *visits > MAX_MODULE_VISITS {
            return Err(format!(
                "more than {MAX_MODULE_VISITS} module attributes (modules shared under many names?)"
            ));
        }
        let full = format!("{}{name}", top.prefix);
        if let Some(t) = p.tensor(value) {
            out.push((full, t));
        } else if p.instance(value).is_some() && !on_path.iter().any(|o| same_obj(o, value)) {
            enter(value, format!("{full}."), on_path, &mut stack)?;
        }
    }
    on_path.truncate(base);
    Ok(())
}

/// How many bytes the selected tensors may hold beyond their storages' bytes, on top of the
/// file's length. Views can repeat storage bytes: tied weights share one storage, and a stride-0
/// (`expand`ed) view repeats elements, so that a tensor of a few hundred bytes in the file could
/// otherwise ask for terabytes. Shared storages up to the file's length in all, and broadcasts
/// of this size, are far more than real checkpoints hold.
const MAX_REPEATED_BYTES: u64 = 512 << 20;

/// Bytes of `t` once contiguous (`None` on overflow, which [`materialize`] reports).
fn view_bytes(t: &TensorMeta, dtype: DType) -> Option<u64> {
    t.size
        .iter()
        .try_fold(dtype.size() as u64, |n, &s| n.checked_mul(s))
}

/// The bound of a storage entry: what its tensors declare (as its type says), at most the
/// configured ceiling.
fn storage_limit(t: &TensorMeta, opts: &ReadOptions) -> (Option<u64>, Limit) {
    let declared = match t.storage.kind {
        StorageKind::Typed(ElemType::Known(d)) => t.storage.numel.checked_mul(d.size() as u64),
        StorageKind::Typed(ElemType::Other(_)) => None,
        StorageKind::Untyped => Some(t.storage.numel),
    };
    (declared, Limit::declared(declared, opts.max_entry_bytes))
}

/// What reading `selected` takes in memory at most, from the metadata alone: each storage's
/// bound once, plus what views add beyond their storage.
fn planned_bytes(selected: &[(String, &TensorMeta)], opts: &ReadOptions) -> u64 {
    let mut storages: HashMap<&str, u64> = HashMap::new();
    let mut views: HashMap<&str, u64> = HashMap::new();
    for (_, t) in selected {
        let key: &str = &t.storage.key;
        let bound = match &t.storage.inline {
            Some(inline) => inline.len() as u64,
            None => storage_limit(t, opts).1.bytes,
        };
        storages.entry(key).or_insert(bound);
        if let ElemType::Known(d) = t.dtype {
            let n = view_bytes(t, d).unwrap_or(u64::MAX);
            let v = views.entry(key).or_default();
            *v = v.saturating_add(n);
        }
    }
    let mut total = 0u64;
    for (key, bound) in &storages {
        let repeated = views.get(key).map_or(0, |v| v.saturating_sub(*bound));
        total = total.saturating_add(*bound).saturating_add(repeated);
    }
    total
}

/// Reads the storages of `selected` (each once, dropped after its last tensor) and turns every
/// tensor into contiguous bytes, refusing views that repeat storage bytes beyond
/// [`MAX_REPEATED_BYTES`] plus the file's length in all. With `naming`, the selection is first
/// checked against the architecture ([`super::check::check_selected`]: unwanted TorchScript attributes
/// dropped, a mismatch refused) and the whole is bounded by `checkpoints.max_total_mib`, before
/// any storage is inflated. `None` for a piece of a tensor (a DCP chunk), checked by its caller.
pub(crate) fn materialize_all<R: Read + Seek>(
    mut archive: Option<&mut ZipArchive<R>>,
    prefix: &str,
    file_len: u64,
    path: &Path,
    opts: &ReadOptions,
    selected: Vec<(String, &TensorMeta)>,
    naming: Option<Naming>,
) -> Result<Vec<(String, RawTensor)>, WeightsError> {
    let selected = match naming {
        Some(naming) => {
            let keep = {
                let shapes: Vec<(&str, &[u64])> = selected
                    .iter()
                    .map(|(n, t)| (n.as_str(), t.size.as_slice()))
                    .collect();
                super::check::check_selected(opts, path, naming, &shapes)?
            };
            let kept: Vec<(String, &TensorMeta)> = selected
                .into_iter()
                .zip(keep)
                .filter_map(|(s, k)| k.then_some(s))
                .collect();
            super::check::check_total(opts, path, planned_bytes(&kept, opts))?;
            kept
        }
        None => selected,
    };
    let mut uses: HashMap<&str, usize> = HashMap::new();
    for (_, t) in &selected {
        *uses.entry(&*t.storage.key).or_default() += 1;
    }
    let mut loaded: HashMap<&str, Vec<u8>> = HashMap::new();
    // Bytes of the tensors read from each storage, and how many more than the storages hold.
    let mut viewed: HashMap<&str, u64> = HashMap::new();
    let mut repeated = 0u64;
    let repeat_budget = file_len.saturating_add(MAX_REPEATED_BYTES);
    let mut out = Vec::with_capacity(selected.len());
    for (name, t) in selected {
        let bad = |detail: String| WeightsError::BadTensor {
            path: path.to_path_buf(),
            name: name.clone(),
            detail,
        };
        let dtype = match t.dtype {
            ElemType::Known(d) => d,
            ElemType::Other(other) => {
                return Err(WeightsError::UnsupportedDtype {
                    path: path.to_path_buf(),
                    name,
                    dtype: other.to_string(),
                });
            }
        };
        let key: &str = &t.storage.key;
        if !loaded.contains_key(key) {
            let entry = format!("{prefix}data/{key}");
            let context = format!(" (storage of tensor `{}`)", quote(&name));
            // The entry may hold what its tensors declare, and never more than the ceiling.
            let (declared, limit) = storage_limit(t, opts);
            let bytes = match (&t.storage.inline, archive.as_deref_mut()) {
                // A plain pickle's storage: its bytes were read (bounded) with the pickle.
                (Some(inline), _) => inline.to_vec(),
                (None, Some(archive)) => {
                    read_entry(archive, &entry, limit, file_len, path, &context)?
                }
                (None, None) => {
                    return Err(bad(format!(
                        "storage `{}` is not in the file (a persistent id outside a zip archive)",
                        quote(key)
                    )));
                }
            };
            if let Some(declared) = declared.filter(|&d| d > bytes.len() as u64) {
                return Err(bad(format!(
                    "storage `{}` holds {} bytes but the checkpoint declares {declared} \
                     (truncated or corrupt file)",
                    quote(key),
                    bytes.len()
                )));
            }
            loaded.insert(key, bytes);
        }
        // Tensors may view the same storage bytes more than once (tied weights, a stride-0
        // broadcast), so together they can be much larger than the file: bound what they add.
        let storage_len = loaded.get(key).map_or(0, |b| b.len() as u64);
        if let Some(n) = view_bytes(t, dtype) {
            let seen = viewed.entry(key).or_default();
            let before = seen.saturating_sub(storage_len);
            *seen = seen.saturating_add(n);
            repeated = repeated.saturating_add(seen.saturating_sub(storage_len) - before);
            if repeated > repeat_budget {
                return Err(bad(format!(
                    "shape {:?} with stride {:?}: the selected tensors would repeat storage \
                     bytes into {repeated} bytes more than their storages hold; at most \
                     {repeat_budget} (the file's length plus {MAX_REPEATED_BYTES}) are read \
                     (storage `{}`)",
                    t.size,
                    t.stride,
                    quote(key)
                )));
            }
        }
        let remaining = uses.get_mut(key).map(|n| {
            *n -= 1;
            *n
        });
        let raw = if remaining == Some(0) {
            let storage = loaded.remove(key).unwrap_or_default();
            materialize(Storage::Owned(storage), t, dtype)
        } else {
            let storage = loaded.get(key).map(Vec::as_slice).unwrap_or_default();
            materialize(Storage::Borrowed(storage), t, dtype)
        }
        .map_err(|detail| bad(format!("{detail} (storage `{}`)", quote(key))))?;
        out.push((name, raw));
    }
    Ok(out)
}

enum Storage<'a> {
    /// The last tensor using this storage: its buffer may be taken over.
    Owned(Vec<u8>),
    Borrowed(&'a [u8]),
}

/// A strided view of a storage, as contiguous bytes. Errors are details for
/// [`WeightsError::BadTensor`].
fn materialize(storage: Storage<'_>, t: &TensorMeta, dtype: DType) -> Result<RawTensor, String> {
    let e = dtype.size();
    let too_big = || format!("shape {:?} is too large", t.size);
    let to_usize = |v: &[u64]| -> Result<Vec<usize>, String> {
        v.iter()
            .map(|&x| usize::try_from(x).map_err(|_| too_big()))
            .collect()
    };
    let size = to_usize(&t.size)?;
    let stride = to_usize(&t.stride)?;
    let offset = usize::try_from(t.offset).map_err(|_| too_big())?;
    let numel = size
        .iter()
        .try_fold(1usize, |a, &s| a.checked_mul(s))
        .ok_or_else(too_big)?;
    let nbytes = numel.checked_mul(e).ok_or_else(too_big)?;
    let bytes: &[u8] = match &storage {
        Storage::Owned(v) => v,
        Storage::Borrowed(s) => s,
    };
    let raw = |data| RawTensor {
        dtype,
        shape: size.clone(),
        data,
    };
    if numel == 0 {
        return Ok(raw(Vec::new()));
    }
    // Index of the last element the view reaches; every element read lies in [offset, last].
    let mut last = offset;
    for (&s, &st) in size.iter().zip(&stride) {
        last = (s - 1)
            .checked_mul(st)
            .and_then(|x| last.checked_add(x))
            .ok_or_else(too_big)?;
    }
    let end = last.checked_add(1).and_then(|x| x.checked_mul(e));
    if end.is_none_or(|end| end > bytes.len()) {
        return Err(format!(
            "shape {size:?} with stride {stride:?} at storage offset {offset} reads element \
             {last}, but the storage holds {} {dtype} elements",
            bytes.len() / e
        ));
    }
    let start = offset * e; // offset <= last, so no overflow
    if is_contiguous(&size, &stride) {
        // One copy of the slice, or none when this view is the whole (last-used) storage.
        let slice = |s: &[u8]| s.get(start..start + nbytes).map(<[u8]>::to_vec);
        let data = match storage {
            Storage::Owned(v) if start == 0 && nbytes == v.len() => Some(v),
            Storage::Owned(v) => slice(&v),
            Storage::Borrowed(s) => slice(s),
        };
        return data
            .map(raw)
            .ok_or_else(|| "internal error: slice outside storage".to_string());
    }
    let mut out = Vec::new();
    out.try_reserve_exact(nbytes)
        .map_err(|_| format!("cannot allocate {nbytes} bytes"))?;
    gather(bytes, &size, &stride, offset, e, &mut out)?;
    Ok(raw(out))
}

/// Row-major contiguity (dimensions of size 1 may have any stride, as in torch).
fn is_contiguous(size: &[usize], stride: &[usize]) -> bool {
    let mut expected = 1usize;
    for (&s, &st) in size.iter().zip(stride).rev() {
        if s != 1 {
            if st != expected {
                return false;
            }
            expected = expected.saturating_mul(s);
        }
    }
    true
}

/// Copies a strided view element by element (or innermost run by run) in row-major order.
/// The caller has checked that every index lies inside `src`.
fn gather(
    src: &[u8],
    size: &[usize],
    stride: &[usize],
    offset: usize,
    e: usize,
    out: &mut Vec<u8>,
) -> Result<(), String> {
    let nd = size.len();
    let (run, outer) = match (size.last(), stride.last()) {
        (Some(&s), Some(1)) => (s, nd - 1),
        _ => (1, nd),
    };
    let run_bytes = run * e;
    let mut idx = vec![0usize; outer];
    loop {
        let pos = offset
            + idx
                .iter()
                .zip(stride)
                .map(|(&i, &st)| i * st)
                .sum::<usize>();
        let b = pos * e;
        let chunk = src
            .get(b..b + run_bytes)
            .ok_or_else(|| "internal error: index outside storage".to_string())?;
        out.extend_from_slice(chunk);
        let mut d = outer;
        loop {
            if d == 0 {
                return Ok(());
            }
            d -= 1;
            idx[d] += 1;
            if idx[d] < size[d] {
                break;
            }
            idx[d] = 0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pickle::StorageRef;
    use std::rc::Rc;

    fn meta(dtype: DType, offset: u64, size: &[u64], stride: &[u64]) -> TensorMeta {
        TensorMeta {
            storage: StorageRef {
                key: Rc::from("0"),
                kind: StorageKind::Typed(ElemType::Known(dtype)),
                numel: 0,
                inline: None,
            },
            dtype: ElemType::Known(dtype),
            offset,
            size: size.to_vec(),
            stride: stride.to_vec(),
        }
    }

    fn u8s(v: &[u8]) -> Storage<'_> {
        Storage::Borrowed(v)
    }

    #[test]
    fn strided_views() {
        let s: Vec<u8> = (0..24).collect();
        // 2x3 row-major.
        let t = materialize(u8s(&s), &meta(DType::U8, 0, &[2, 3], &[3, 1]), DType::U8).unwrap();
        assert_eq!(t.data, [0, 1, 2, 3, 4, 5]);
        // Transposed.
        let t = materialize(u8s(&s), &meta(DType::U8, 0, &[3, 2], &[1, 3]), DType::U8).unwrap();
        assert_eq!(t.data, [0, 3, 1, 4, 2, 5]);
        // Offset and step.
        let t = materialize(u8s(&s), &meta(DType::U8, 5, &[3], &[2]), DType::U8).unwrap();
        assert_eq!(t.data, [5, 7, 9]);
        // Broadcast (stride 0) and 0-d.
        let t = materialize(u8s(&s), &meta(DType::U8, 4, &[2, 2], &[0, 1]), DType::U8).unwrap();
        assert_eq!(t.data, [4, 5, 4, 5]);
        let t = materialize(u8s(&s), &meta(DType::U8, 9, &[], &[]), DType::U8).unwrap();
        assert_eq!((t.data, t.shape), (vec![9], vec![]));
        // 2-byte elements, inner run copy with an outer stride.
        let t = materialize(u8s(&s), &meta(DType::I16, 1, &[2, 2], &[4, 1]), DType::I16).unwrap();
        assert_eq!(t.data, [2, 3, 4, 5, 10, 11, 12, 13]);
        // Size-1 dimensions with odd strides are still contiguous.
        assert!(is_contiguous(&[1, 3], &[99, 1]));
        assert!(!is_contiguous(&[2, 3], &[1, 2]));
    }

    #[test]
    fn owned_whole_storage_is_moved() {
        let v: Vec<u8> = (0..8).collect();
        let ptr = v.as_ptr();
        let t = materialize(
            Storage::Owned(v),
            &meta(DType::F32, 0, &[2], &[1]),
            DType::F32,
        )
        .unwrap();
        assert_eq!(t.data.as_ptr(), ptr);
    }

    #[test]
    fn out_of_range_views_are_errors() {
        let s = vec![0u8; 24]; // 6 f32
        for (off, size, stride) in [
            (0u64, &[7u64][..], &[1u64][..]),
            (4, &[3], &[1]),
            (0, &[2, 3], &[4, 1]),
            (0, &[2], &[u64::MAX]),
            (u64::MAX, &[1], &[1]),
            (0, &[u64::MAX, u64::MAX], &[0, 0]),
            (0, &[1 << 62], &[0]),
        ] {
            let r = materialize(u8s(&s), &meta(DType::F32, off, size, stride), DType::F32);
            assert!(r.is_err(), "{off} {size:?} {stride:?}");
        }
        // Empty tensors never read.
        let t = materialize(
            u8s(&s),
            &meta(DType::F32, 1000, &[0, 5], &[5, 1]),
            DType::F32,
        );
        assert_eq!(t.unwrap().data.len(), 0);
    }
}
