//! Opening a checkpoint file (regular files only, the one place the readers open files) and
//! recognizing its container from the first bytes.

use super::error::WeightsError;
use std::fs::File;
use std::io::{BufReader, Read, Seek, SeekFrom};
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::os::unix::io::AsRawFd;
use std::path::Path;

/// Opens a checkpoint for reading: the one place the readers open files. Opens non-blocking (a
/// FIFO would otherwise block the open until a writer comes) and close-on-exec, refuses anything
/// that `fstat` on the handle does not call a regular file, then clears `O_NONBLOCK`.
pub(super) fn open(path: &Path) -> Result<(BufReader<File>, u64), WeightsError> {
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

/// The container, from the first bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Container {
    Zip,
    SafeTensors,
    /// A pickle stream (protocol 2 to 5) that is not a legacy `torch.save` file.
    Pickle,
}

/// Longest safetensors header accepted (the `safetensors` crate's own limit).
pub(super) const MAX_SAFETENSORS_HEADER: u64 = 100_000_000;

pub(super) fn sniff<R: Read + Seek>(
    r: &mut R,
    len: u64,
    path: &Path,
) -> Result<Container, WeightsError> {
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
