//! Errors of the `weights` module. Every variant names the checkpoint file.
//!
//! No message quotes the content of a file: a checkpoint path may be a symlink to any file the
//! daemon can read, and messages reach the journal and the logs. Messages carry sizes, offsets
//! and kinds; a name taken from inside a file (a tensor name, a zip entry, a pickle global) is
//! quoted through [`quote`](super::messages::quote): control characters escaped, length capped.

use std::path::PathBuf;

use super::messages::quote;

/// Why a checkpoint could not be detected, validated or read.
///
/// Every message starts with the file's path and says what to do where something can be done.
#[derive(Debug, thiserror::Error)]
pub enum WeightsError {
    /// The file could not be opened or read (permissions, vanished, I/O error).
    #[error("{}: cannot read file: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    /// Not a regular file (a FIFO, a device, a socket, a folder): never opened for reading.
    #[error(
        "{}: is a {kind}, not a regular file; a checkpoint must be a regular file (it is not \
         read)",
        path.display()
    )]
    NotRegularFile { path: PathBuf, kind: &'static str },

    /// A zip entry would inflate to more than it may hold (a "zip bomb", or a storage larger
    /// than its tensors declare). Refused before anything beyond the bound is allocated.
    #[error(
        "{}: zip entry `{}` holds more than {limit} bytes, the most it may hold ({why}); \
         refused without reading further",
        path.display(),
        quote(entry)
    )]
    EntryTooLarge {
        path: PathBuf,
        entry: String,
        limit: u64,
        why: &'static str,
    },

    /// The file has zero bytes (typically a checkpoint that is still being written).
    #[error("{}: empty file", path.display())]
    EmptyFile { path: PathBuf },

    /// Shorter than any checkpoint's fixed header (typically still being written).
    #[error(
        "{}: file is only {len} bytes, too short for any checkpoint format (still being written?)",
        path.display()
    )]
    TooShort { path: PathBuf, len: u64 },

    /// Neither a zip archive nor a safetensors file.
    #[error(
        "{}: not a checkpoint diffmon can read ({detail}); expected a torch.save zip archive, \
         a safetensors file or a TorchScript archive",
        path.display()
    )]
    UnknownFormat { path: PathBuf, detail: String },

    /// The zip container is damaged or incomplete (e.g. still being written).
    #[error("{}: truncated or corrupt zip archive: {detail}", path.display())]
    CorruptZip { path: PathBuf, detail: String },

    /// A bare pickle file (EDM network snapshot) that does not end with its STOP opcode, or
    /// that changed length while being read: typically still being written.
    #[error(
        "{}: pickle stream is incomplete (it does not end where a pickle ends; still being \
         written?)",
        path.display()
    )]
    TruncatedPickle { path: PathBuf },

    /// The safetensors header is invalid or does not match the file length.
    #[error("{}: truncated or corrupt safetensors file: {detail}", path.display())]
    CorruptSafeTensors { path: PathBuf, detail: String },

    /// A zip archive that lacks an entry torch.save always writes, or that a tensor refers to.
    #[error(
        "{}: zip archive has no entry `{}`{context}; the file is incomplete or was not \
         written by torch.save",
        path.display(),
        quote(entry)
    )]
    MissingEntry {
        path: PathBuf,
        entry: String,
        /// Extra context such as " (storage of tensor `w`)"; may be empty.
        context: String,
    },

    /// The pickle names a Python global outside the allow-list. Nothing is executed; reading
    /// stops at the first such global.
    #[error(
        "{}: pickle refers to global `{}`, which diffmon does not load (only tensors, \
         storages and plain containers are read; no code from a checkpoint is ever executed)",
        path.display(),
        quote(global)
    )]
    ForbiddenGlobal { path: PathBuf, global: String },

    /// An opcode outside the subset torch.save uses.
    #[error(
        "{}: unsupported pickle opcode {name} (0x{code:02x}) at byte {offset} of `{}`; \
         diffmon reads only the pickle subset that torch.save writes",
        path.display(),
        quote(entry)
    )]
    UnsupportedOpcode {
        path: PathBuf,
        entry: String,
        offset: usize,
        code: u8,
        name: &'static str,
    },

    /// The pickle stream is malformed, truncated, or exceeds a resource limit.
    #[error(
        "{}: malformed pickle `{}` at byte {offset}: {detail}",
        path.display(),
        quote(entry)
    )]
    Pickle {
        path: PathBuf,
        entry: String,
        offset: usize,
        detail: String,
    },

    /// The archive's `byteorder` entry is not `little`.
    #[error(
        "{}: checkpoint byte order is `{}`; diffmon reads only little-endian checkpoints \
         (load and re-save it with torch on a little-endian machine)",
        path.display(),
        quote(order)
    )]
    ByteOrder { path: PathBuf, order: String },

    /// A tensor's shape, strides or offset do not fit its storage, or its sizes overflow.
    #[error("{}: tensor `{}`: {detail}", path.display(), quote(name))]
    BadTensor {
        path: PathBuf,
        name: String,
        detail: String,
    },

    /// A selected tensor has a dtype outside [`super::types::DType`].
    #[error(
        "{}: tensor `{}` has dtype {}, which diffmon does not read (supported: bool, \
         uint8, int8, int16, int32, int64, float16, bfloat16, float32, float64)",
        path.display(),
        quote(name),
        quote(dtype)
    )]
    UnsupportedDtype {
        path: PathBuf,
        name: String,
        dtype: String,
    },

    /// `weights_key` names no entry of the checkpoint.
    #[error("{}: no state dict under key `{key}` (top-level keys: {keys})", path.display())]
    NoStateDict {
        path: PathBuf,
        key: String,
        keys: String,
    },

    /// The selected object is not a dict holding tensors.
    #[error("{}: {what}, not a dict of tensors", path.display())]
    NotAStateDict { path: PathBuf, what: String },

    #[error("{}: sharded safetensors index: {detail}", path.display())]
    BadIndex { path: PathBuf, detail: String },

    #[error("{}: distributed checkpoint metadata: {detail}", path.display())]
    BadDistributed { path: PathBuf, detail: String },

    /// The selected tensors do not fit the architecture ([`super::types::ReadOptions::expected`]):
    /// found from the checkpoint's metadata, before any tensor byte was read.
    #[error("{}: does not fit the architecture: {details}", path.display())]
    Mismatch { path: PathBuf, details: String },

    /// The selected tensors would take more memory in all than one checkpoint may.
    #[error(
        "{}: the selected tensors would take {bytes} bytes in memory, more than the {limit} \
         bytes one checkpoint may take (checkpoints.max_total_mib, by default 4 times the \
         architecture's size); refused before reading them",
        path.display()
    )]
    TooLargeInAll {
        path: PathBuf,
        bytes: u64,
        limit: u64,
    },

    /// No `weights_key` given, and the top-level dict does not contain exactly one state dict.
    #[error(
        "{}: cannot tell which entry holds the weights: {reason} (top-level keys: {keys}); \
         set `checkpoints.weights_key` to the entry to use",
        path.display()
    )]
    AmbiguousStateDict {
        path: PathBuf,
        reason: String,
        keys: String,
    },
}

impl WeightsError {
    /// The checkpoint file the error is about.
    pub fn path(&self) -> &std::path::Path {
        match self {
            WeightsError::Io { path, .. }
            | WeightsError::NotRegularFile { path, .. }
            | WeightsError::EntryTooLarge { path, .. }
            | WeightsError::EmptyFile { path }
            | WeightsError::TooShort { path, .. }
            | WeightsError::UnknownFormat { path, .. }
            | WeightsError::CorruptZip { path, .. }
            | WeightsError::CorruptSafeTensors { path, .. }
            | WeightsError::TruncatedPickle { path }
            | WeightsError::MissingEntry { path, .. }
            | WeightsError::ForbiddenGlobal { path, .. }
            | WeightsError::UnsupportedOpcode { path, .. }
            | WeightsError::Pickle { path, .. }
            | WeightsError::ByteOrder { path, .. }
            | WeightsError::BadTensor { path, .. }
            | WeightsError::UnsupportedDtype { path, .. }
            | WeightsError::NoStateDict { path, .. }
            | WeightsError::NotAStateDict { path, .. }
            | WeightsError::AmbiguousStateDict { path, .. }
            | WeightsError::BadIndex { path, .. }
            | WeightsError::BadDistributed { path, .. }
            | WeightsError::Mismatch { path, .. }
            | WeightsError::TooLargeInAll { path, .. } => path,
        }
    }

    /// True for errors that typically mean the file is still being written (or was cut off):
    /// empty or too short, a zip without a readable central directory (written last), a
    /// safetensors file shorter than its header says. The caller may retry later instead of
    /// counting a failure. (A zip whose directory is readable is complete; a missing entry there
    /// is not "incomplete".)
    pub fn is_incomplete(&self) -> bool {
        matches!(
            self,
            WeightsError::EmptyFile { .. }
                | WeightsError::TooShort { .. }
                | WeightsError::CorruptZip { .. }
                | WeightsError::CorruptSafeTensors { .. }
                | WeightsError::TruncatedPickle { .. }
        )
    }
}
