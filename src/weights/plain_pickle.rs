//! Plain pickle files (`pickle.dump(obj, f)`, not `torch.save`): EDM/EDM2 network snapshots
//! (`network-snapshot-*.pkl`, `dict(ema=net, loss_fn=..., augment_pipe=..., ...)`).
//!
//! The whole stream runs in inert mode ([`pickle::Classes::Inert`]): every class is a
//! placeholder and nothing is called. Tensors are `_rebuild_tensor_v2` calls whose storage is
//! `torch.storage._load_from_bytes(<bytes>)`, a legacy `torch.save` stream of one storage held in
//! the pickle itself, which [`pickle::legacy_storage`] parses as data. The weights are then chosen
//! by the same rules as for `torch.save` archives ([`select::select`]).
//!
//! This reader is a function of its own so that other bare pickles (a DCP checkpoint's
//! `.metadata`) can be routed elsewhere by their content.

use std::io::{Read, Seek, SeekFrom};
use std::path::Path;

use zip::ZipArchive;

use super::error::WeightsError;
use super::pickle;
use super::select;
use super::torchzip::{materialize_all, pickle_error};
use super::types::{Naming, ReadOptions, StateDict};

/// Name used for the stream in messages (a bare pickle has no entries).
const ENTRY: &str = "<pickle>";

/// Reads the selected weights of a bare pickle file, `len` bytes long. The file is read whole,
/// at most [`ReadOptions::max_entry_bytes`] (`checkpoints.max_entry_mib`) and
/// [`ReadOptions::max_total_bytes`]: it holds the tensor bytes itself.
pub(crate) fn read_bare_pickle<R: Read + Seek>(
    mut r: R,
    len: u64,
    path: &Path,
    opts: &ReadOptions,
) -> Result<(StateDict, Naming), WeightsError> {
    if len > opts.max_entry_bytes {
        return Err(WeightsError::EntryTooLarge {
            path: path.to_path_buf(),
            entry: ENTRY.to_string(),
            limit: opts.max_entry_bytes,
            why: "checkpoints.max_entry_mib",
        });
    }
    // The file holds its tensors' bytes: it is read whole only within the total bound.
    super::check::check_total(opts, path, len)?;
    let io = |source| WeightsError::Io {
        path: path.to_path_buf(),
        source,
    };
    r.seek(SeekFrom::Start(0)).map_err(io)?;
    let mut data = Vec::new();
    usize::try_from(len)
        .ok()
        .and_then(|n| data.try_reserve_exact(n).ok())
        .ok_or_else(|| {
            io(std::io::Error::other(format!(
                "cannot allocate {len} bytes for the pickle"
            )))
        })?;
    // One byte past the length: a file that grew while being read is not trusted.
    r.take(len.saturating_add(1))
        .read_to_end(&mut data)
        .map_err(io)?;
    if data.len() as u64 != len {
        return Err(WeightsError::TruncatedPickle {
            path: path.to_path_buf(),
        });
    }
    let p =
        pickle::parse(&data, pickle::Classes::Inert).map_err(|e| pickle_error(e, path, ENTRY))?;
    drop(data);
    let bad = |detail: String| WeightsError::Pickle {
        path: path.to_path_buf(),
        entry: ENTRY.to_string(),
        offset: 0,
        detail,
    };
    let sel = select::select(&p, opts, path, &bad)?;
    let tensors = materialize_all(
        None::<&mut ZipArchive<std::io::Cursor<Vec<u8>>>>,
        "",
        len,
        path,
        opts,
        sel.tensors,
        Some(sel.naming),
    )?;
    Ok((StateDict { tensors }, sel.naming))
}

/// Cheap completeness check: a pickle stream ends with its STOP opcode (`.`). A file cut off
/// while being written almost never does.
pub(crate) fn validate<R: Read + Seek>(
    mut r: R,
    len: u64,
    path: &Path,
) -> Result<(), WeightsError> {
    let io = |source| WeightsError::Io {
        path: path.to_path_buf(),
        source,
    };
    r.seek(SeekFrom::Start(len.saturating_sub(1))).map_err(io)?;
    let mut last = [0u8; 1];
    r.read_exact(&mut last).map_err(io)?;
    if last != [b'.'] {
        return Err(WeightsError::TruncatedPickle {
            path: path.to_path_buf(),
        });
    }
    Ok(())
}
