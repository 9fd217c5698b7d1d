//! safetensors files, through the `safetensors` crate's header type (which validates that the
//! tensors' byte ranges are contiguous and match their shapes).

use std::io::{Read, Seek, SeekFrom};
use std::path::Path;

use safetensors::Dtype;
use safetensors::tensor::Metadata;

use super::error::WeightsError;
use super::file::MAX_SAFETENSORS_HEADER;
use super::types::{DType, RawTensor, ReadOptions, StateDict};

pub(crate) struct Header {
    /// File offset of the data section.
    data_start: u64,
    meta: Metadata,
}

fn corrupt(path: &Path, detail: String) -> WeightsError {
    WeightsError::CorruptSafeTensors {
        path: path.to_path_buf(),
        detail,
    }
}

fn io(path: &Path) -> impl Fn(std::io::Error) -> WeightsError + '_ {
    move |source| {
        if source.kind() == std::io::ErrorKind::UnexpectedEof {
            corrupt(path, "file ends early".to_string())
        } else {
            WeightsError::Io {
                path: path.to_path_buf(),
                source,
            }
        }
    }
}

#[cfg(test)]
thread_local! {
    /// How many headers this thread parsed (the tests check that a read parses once).
    pub(crate) static HEADER_PARSES: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// Reads and validates the JSON header.
pub(crate) fn read_header<R: Read + Seek>(
    r: &mut R,
    len: u64,
    path: &Path,
) -> Result<Header, WeightsError> {
    #[cfg(test)]
    HEADER_PARSES.with(|n| n.set(n.get() + 1));
    if len < 8 {
        return Err(corrupt(path, format!("file is only {len} bytes")));
    }
    r.seek(SeekFrom::Start(0)).map_err(io(path))?;
    let mut n8 = [0u8; 8];
    r.read_exact(&mut n8).map_err(io(path))?;
    // The length is the file's first 8 bytes, whatever the file is (a link to a secret file):
    // never quoted, only judged against the file's size.
    let n = u64::from_le_bytes(n8);
    if n > MAX_SAFETENSORS_HEADER {
        return Err(corrupt(
            path,
            format!("the safetensors header length is implausible for a file of {len} bytes"),
        ));
    }
    let data_start = 8 + n;
    if data_start > len {
        return Err(corrupt(
            path,
            format!(
                "the safetensors header length runs past the end of the file ({len} bytes; \
                 still being written?)"
            ),
        ));
    }
    let mut header = vec![0u8; n as usize]; // n <= 100 MB, checked above
    r.read_exact(&mut header).map_err(io(path))?;
    // serde's messages may quote the header's text (`unknown variant `...``); only the kind of
    // error and its position are reported, never the file's content.
    let meta: Metadata = serde_json::from_slice(&header).map_err(|e| {
        let kind = match e.classify() {
            serde_json::error::Category::Io => "unreadable",
            serde_json::error::Category::Syntax => "not valid JSON",
            serde_json::error::Category::Data => "not a safetensors header",
            serde_json::error::Category::Eof => "cut off",
        };
        corrupt(
            path,
            format!(
                "invalid header ({kind} at line {}, column {})",
                e.line(),
                e.column()
            ),
        )
    })?;
    Ok(Header { data_start, meta })
}

/// The file is exactly as long as the header says.
pub(crate) fn check_length(h: &Header, len: u64, path: &Path) -> Result<(), WeightsError> {
    let expected = u64::try_from(h.meta.data_len())
        .ok()
        .and_then(|d| h.data_start.checked_add(d));
    if expected != Some(len) {
        let what = expected.map_or_else(
            || "an impossible size".to_string(),
            |e| format!("{e} bytes"),
        );
        return Err(corrupt(
            path,
            format!("the header describes {what} but the file has {len} bytes"),
        ));
    }
    Ok(())
}

fn map_dtype(d: Dtype) -> Result<DType, String> {
    Ok(match d {
        Dtype::BOOL => DType::Bool,
        Dtype::U8 => DType::U8,
        Dtype::I8 => DType::I8,
        Dtype::I16 => DType::I16,
        Dtype::I32 => DType::I32,
        Dtype::I64 => DType::I64,
        Dtype::F16 => DType::F16,
        Dtype::BF16 => DType::BF16,
        Dtype::F32 => DType::F32,
        Dtype::F64 => DType::F64,
        other => return Err(format!("{other:?}")),
    })
}

/// The shapes and byte counts of the tensors `names` (from the header alone).
pub(crate) fn planned(h: &Header, names: &[String]) -> Vec<(Vec<u64>, u64)> {
    names
        .iter()
        .filter_map(|n| h.meta.info(n))
        .map(|info| {
            (
                info.shape.iter().map(|&d| d as u64).collect(),
                (info.data_offsets.1 - info.data_offsets.0) as u64,
            )
        })
        .collect()
}

/// Reads the tensors in data-offset (file) order; see the module docs for `weights_key`. The
/// selected tensors are checked against the architecture and the total bound from the header
/// before any is read.
pub(crate) fn read<R: Read + Seek>(
    mut r: R,
    len: u64,
    path: &Path,
    opts: &ReadOptions,
) -> Result<StateDict, WeightsError> {
    let h = read_header(&mut r, len, path)?;
    check_length(&h, len, path)?;
    let names = h.meta.offset_keys();
    let filter = opts
        .weights_key
        .as_deref()
        .map(|k| format!("{k}."))
        .filter(|p| names.iter().any(|n| n.starts_with(p.as_str())));
    let selected: Vec<(String, String)> = names
        .into_iter()
        .filter(|n| h.meta.info(n).is_some())
        .filter_map(|name| match &filter {
            Some(p) => name
                .strip_prefix(p.as_str())
                .map(|rest| (name.clone(), rest.to_string())),
            None => Some((name.clone(), name)),
        })
        .collect();
    let full: Vec<String> = selected.iter().map(|(n, _)| n.clone()).collect();
    let plan = planned(&h, &full);
    let shapes: Vec<(&str, &[u64])> = selected
        .iter()
        .zip(&plan)
        .map(|((_, short), (shape, _))| (short.as_str(), shape.as_slice()))
        .collect();
    super::check::check_selected(opts, path, super::types::Naming::ByName, &shapes)?;
    let total = plan.iter().fold(0u64, |a, (_, b)| a.saturating_add(*b));
    super::check::check_total(opts, path, total)?;
    read_tensors(&mut r, &h, path, selected)
}

/// Reads the tensors `selected` (header name, name to give it), in that order, from the data
/// section.
pub(crate) fn read_tensors<R: Read + Seek>(
    r: &mut R,
    h: &Header,
    path: &Path,
    selected: Vec<(String, String)>,
) -> Result<StateDict, WeightsError> {
    let mut tensors = Vec::with_capacity(selected.len());
    let mut pos: Option<u64> = None; // current read position, relative to data_start
    for (name, short) in selected {
        let Some(info) = h.meta.info(&name) else {
            continue;
        };
        let dtype = map_dtype(info.dtype).map_err(|dtype| WeightsError::UnsupportedDtype {
            path: path.to_path_buf(),
            name: name.clone(),
            dtype,
        })?;
        let (s, e) = (info.data_offsets.0 as u64, info.data_offsets.1 as u64);
        if pos != Some(s) {
            r.seek(SeekFrom::Start(h.data_start + s))
                .map_err(io(path))?;
        }
        let n = e - s; // the header validation guarantees e >= s and the file length
        let mut data = Vec::new();
        usize::try_from(n)
            .ok()
            .and_then(|n| data.try_reserve_exact(n).ok())
            .ok_or_else(|| {
                corrupt(
                    path,
                    format!(
                        "cannot allocate {n} bytes for `{}`",
                        super::messages::quote(&name)
                    ),
                )
            })?;
        r.by_ref()
            .take(n)
            .read_to_end(&mut data)
            .map_err(io(path))?;
        if data.len() as u64 != n {
            return Err(corrupt(path, "file ends early".to_string()));
        }
        pos = Some(e);
        tensors.push((
            short,
            RawTensor {
                dtype,
                shape: info.shape.clone(),
                data,
            },
        ));
    }
    Ok(StateDict { tensors })
}
