//! One daemon per state folder (docs/design.md §10): `diffmon watch` holds an exclusive `flock` on
//! `<state_dir>/lock` for as long as it runs. The file holds the holder's pid, host and start
//! time, so a second daemon refuses to start naming them. The kernel releases the lock when the
//! process ends, however it ends (a SIGKILL included), so a lock is never stale; the file itself
//! stays. Readers of the state (`diffmon report`) take no lock.
//!
//! On network file systems `flock` is only as good as the mount: NFS emulates it with POSIX
//! byte-range locks through the server (mounted with `nolock` it is local to one machine), and
//! Lustre refuses it unless mounted with `flock`; a file system that refuses locks stops the start
//! with a message that names it (point `state_dir` at a local disk).
//!
//! Taking the lock opens the state folder ([`crate::store::state_dir::StateDir`]: no link followed, the
//! daemon's own, used through its handle); the lock holds it for the daemon.

use std::fs::File;
use std::io::{Read, Seek, Write};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use crate::store::state_dir::{StateDir, StateDirError};

/// The lock file's name inside the state folder.
pub const LOCK_FILE: &str = "lock";

/// The most of a lock file that is read to name its holder.
const MAX_HOLDER: u64 = 4096;

#[derive(Debug, thiserror::Error)]
pub enum LockError {
    #[error(
        "{path}: the state folder is in use by another diffmon ({holder}); one daemon per state folder: stop it, or give this run another state_dir"
    )]
    Held { path: PathBuf, holder: String },
    #[error("{path}: cannot lock the state folder: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "{path}: cannot lock the state folder: {source}: the file system does not support locks (NFS mounted with `nolock`, Lustre without `flock`?); put state_dir on a local disk"
    )]
    NoLocks {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    State(#[from] StateDirError),
    #[error("{path}: cannot lock the state folder: {message}")]
    NotAFile {
        path: PathBuf,
        message: &'static str,
    },
}

/// The lock on a state folder, released when dropped (or when the process ends).
#[derive(Debug)]
pub struct StateLock {
    file: File,
    path: PathBuf,
    state: Arc<StateDir>,
    /// The lock of the state folder made again after it was deleted, if it was.
    relocked: Arc<Mutex<Option<File>>>,
}

impl StateLock {
    /// Opens the state folder `state_dir` of the run in `run_dir` (creating it) and takes its
    /// lock, or says who holds it. A state folder made again after it was deleted under the
    /// daemon (`StateDir::follow`) is locked again.
    pub fn acquire(state_dir: &Path, run_dir: &Path) -> Result<StateLock, LockError> {
        let state = Arc::new(StateDir::open(state_dir, run_dir)?);
        let path = state.shown().join(LOCK_FILE);
        let file = lock_in(state.path(), &path)?;
        let relocked = Arc::new(Mutex::new(None));
        let (at, shown, held) = (state.path().to_path_buf(), path.clone(), relocked.clone());
        state.on_remade(Box::new(move || match lock_in(&at, &shown) {
            Ok(f) => *held.lock().unwrap_or_else(|e| e.into_inner()) = Some(f),
            Err(e) => tracing::warn!("{e}; the re-made state folder is not locked"),
        }));
        Ok(StateLock {
            file,
            path,
            state,
            relocked,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The state folder the lock holds.
    pub fn state(&self) -> &Arc<StateDir> {
        &self.state
    }
}

impl Drop for StateLock {
    fn drop(&mut self) {
        // The lock goes with the descriptor; emptying the file says nobody holds it.
        let _ = self.file.set_len(0);
        if let Some(f) = &*self.relocked.lock().unwrap_or_else(|e| e.into_inner()) {
            let _ = f.set_len(0);
        }
    }
}

/// Opens (creating) and locks the lock file in the folder `dir` (shown as `path`), and writes
/// the holder into it.
fn lock_in(dir: &Path, path: &Path) -> Result<File, LockError> {
    let io = |source: std::io::Error| LockError::Io {
        path: path.to_path_buf(),
        source,
    };
    // O_CLOEXEC is std's default: no child process inherits (and holds) the lock.
    let mut file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(dir.join(LOCK_FILE))
        .map_err(|e| match e.raw_os_error() {
            Some(libc::ELOOP) => LockError::NotAFile {
                path: path.to_path_buf(),
                message: "is a symbolic link; refusing to follow it",
            },
            _ => io(e),
        })?;
    let meta = file.metadata().map_err(io)?;
    if !meta.is_file() {
        return Err(LockError::NotAFile {
            path: path.to_path_buf(),
            message: "is not a regular file",
        });
    }
    if meta.mode() & 0o077 != 0 {
        // Made 0644 by earlier versions.
        use std::os::unix::fs::PermissionsExt;
        file.set_permissions(std::fs::Permissions::from_mode(0o600))
            .map_err(io)?;
    }
    // SAFETY: flock on a file descriptor this function owns.
    if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        let e = std::io::Error::last_os_error();
        return Err(match e.raw_os_error() {
            Some(libc::EWOULDBLOCK) => LockError::Held {
                holder: holder_of(&mut file),
                path: path.to_path_buf(),
            },
            Some(libc::ENOLCK | libc::ENOSYS | libc::EOPNOTSUPP | libc::EINVAL) => {
                LockError::NoLocks {
                    path: path.to_path_buf(),
                    source: e,
                }
            }
            _ => io(e),
        });
    }
    let holder = format!(
        "pid {} on host {} since {}\n",
        std::process::id(),
        hostname(),
        crate::record::rfc3339_utc(std::time::SystemTime::now())
    );
    file.set_len(0)
        .and_then(|_| file.rewind())
        .and_then(|_| file.write_all(holder.as_bytes()))
        .map_err(io)?;
    Ok(file)
}

/// Who holds the lock, from the lock file (bounded, control characters escaped).
fn holder_of(file: &mut File) -> String {
    let mut bytes = Vec::new();
    let read = file
        .rewind()
        .and_then(|_| file.take(MAX_HOLDER).read_to_end(&mut bytes));
    let text = String::from_utf8_lossy(&bytes);
    let text = text.trim();
    if read.is_err() || text.is_empty() {
        return "holder unknown: it is starting, or did not write its name".into();
    }
    text.chars().flat_map(char::escape_debug).collect()
}

/// This machine's host name, or `unknown`.
pub fn hostname() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: the buffer is valid for its length; gethostname NUL-terminates within it or
    // truncates (the last byte stays 0).
    if unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len() - 1) } != 0 {
        return "unknown".into();
    }
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..end]).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_lock_is_refused_naming_the_holder_and_free_once_dropped() {
        let dir = tempfile::tempdir().unwrap();
        let state = dir.path().join("state");
        let first = StateLock::acquire(&state, dir.path()).unwrap();
        // flock locks belong to the open file description: a second open in the same process
        // conflicts like another process would.
        let e = StateLock::acquire(&state, dir.path())
            .unwrap_err()
            .to_string();
        assert!(
            e.contains(&state.join(LOCK_FILE).display().to_string()),
            "{e}"
        );
        assert!(
            e.contains(&format!("pid {} on host ", std::process::id())),
            "{e}"
        );
        assert!(e.contains(" since "), "{e}");
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(state.join(LOCK_FILE))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600, "the lock file is private");
        drop(first);
        StateLock::acquire(&state, dir.path()).unwrap();
    }

    #[test]
    fn a_symlink_as_the_lock_file_is_refused_and_not_followed() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("precious");
        std::fs::write(&target, "keep me").unwrap();
        std::os::unix::fs::symlink(&target, dir.path().join(LOCK_FILE)).unwrap();
        let e = StateLock::acquire(dir.path(), dir.path())
            .unwrap_err()
            .to_string();
        assert!(e.contains("symbolic link"), "{e}");
        assert_eq!(std::fs::read_to_string(&target).unwrap(), "keep me");
    }

    #[test]
    fn a_hostile_lock_file_is_named_bounded_and_escaped() {
        let dir = tempfile::tempdir().unwrap();
        let mut held = StateLock::acquire(dir.path(), dir.path()).unwrap();
        held.file.set_len(0).unwrap();
        held.file.rewind().unwrap();
        held.file
            .write_all(&[b"\x1b[31mevil\nline".as_slice(), &[b'x'; 100_000]].concat())
            .unwrap();
        let e = StateLock::acquire(dir.path(), dir.path())
            .unwrap_err()
            .to_string();
        assert!(e.contains("\\u{1b}[31mevil\\nline"), "{e}");
        assert!(e.len() < 2 * MAX_HOLDER as usize, "{} bytes", e.len());
    }
}
