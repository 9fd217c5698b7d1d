//! `early_stop.keep_best` (docs/design.md §9): the current best checkpoint is kept in
//! `<state_dir>/best/`, so that the training job's rotation (`checkpoints_total_limit`,
//! `save_top_k`, `keep_latest_k`) cannot delete it.
//!
//! [`keep`] is the one entry point: it makes `<state_dir>/best/<name>` a complete copy of the
//! checkpoint unit (a file, or a folder and its tree), each regular file hard-linked, or copied
//! when a link is not possible (another file system, or one that refuses links). Then it removes
//! every other entry of `best/`: one kept checkpoint at a time, and the previous one is removed
//! only once the new one is complete.
//!
//! - **Bounded.** A folder is walked at most [`MAX_DEPTH`] levels and [`MAX_ENTRIES`] entries
//!   deep, as the watcher walks it. The disk use is one checkpoint: nothing while the training
//!   job still has the original (links share its blocks), its size once rotation deletes it, and
//!   twice that for a moment when the next best is copied across file systems.
//! - **What was evaluated.** With the unit's key at its evaluation, a copy that differs (a file
//!   of another size or time; a folder holding a newer file) is refused and the one kept before
//!   stays: the training job rewrote it since.
//! - **No links followed.** A checkpoint that is a symbolic link is not kept; links inside a
//!   checkpoint folder are skipped, as are FIFOs, sockets and devices. Folders are opened with
//!   `O_NOFOLLOW` and read through their descriptors, so one swapped for a link while it is
//!   copied is not walked into. A source file is opened
//!   with `O_NOFOLLOW`, and everything in `best/` is created exclusively (`O_CREAT|O_EXCL`,
//!   `mkdir`), in a folder of mode 0700 under a temporary name, then renamed into place.
//! - **Restarts.** What is kept is read from the folder, never remembered: a copy cut short by a
//!   crash is a temporary name, removed at the next call; a complete one is recognized by its
//!   files' names, sizes and modification times (copies keep the original's).
//!
//! [`keeper::Keeper`] runs [`keep`] on a thread of its own (`diffmon-keep`), the newest request
//! replacing any waiting one: a copy across file systems can take minutes for a large
//! checkpoint, and the recorder thread, which journals every outcome before anything acts on it,
//! must not wait for it.

use crate::store::history::CheckpointKey;
use crate::store::safe_fs::{TEMP_SUFFIX, is_temp_name, sync_dir, untrusted};
use crate::store::unit::{MAX_DEPTH, MAX_ENTRIES};
use std::ffi::OsStr;
use std::fs::{self, OpenOptions};
use std::io;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

pub mod keeper;

/// The folder of `state_dir` that holds the kept checkpoint.
pub const KEPT_DIR: &str = "best";

/// What every output says beside the best checkpoint when no copy of it is kept
/// (`early_stop.keep_best` off, or keeping it failed); with a copy they say `kept as <path>`
/// (docs/design.md §17).
pub const NOT_KEPT: &str = "not kept: the original is the only copy";

#[derive(Debug, thiserror::Error)]
pub enum KeepBestError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("{path}: a symbolic link: not kept (links are never followed)")]
    Link { path: PathBuf },
    #[error("{path}: neither a regular file nor a folder: not kept")]
    NotRegular { path: PathBuf },
    #[error(
        "{folder}: more than {MAX_ENTRIES} entries, or deeper than {MAX_DEPTH} levels: not kept"
    )]
    TooLarge { folder: PathBuf },
    #[error("{path}: no name to keep it under")]
    NoName { path: PathBuf },
    #[error("{path}: exists and is not a folder (or is a link): the best checkpoint is not kept")]
    BadFolder { path: PathBuf },
    #[error(
        "{path}: changed since it was evaluated (not the files that were measured): not kept; the checkpoint kept before stays"
    )]
    Changed { path: PathBuf },
    #[error(
        "{path}: replaced while it was being made (someone else can write its folder): what is there now is not the restored copy, and nothing was written through it"
    )]
    Replaced { path: PathBuf },
}

pub(super) fn io_error(path: &Path) -> impl FnOnce(io::Error) -> KeepBestError + '_ {
    move |source| KeepBestError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// A kept checkpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Kept {
    /// `<state_dir>/best/<name>`.
    pub path: PathBuf,
    /// Files linked and files copied (a link was not possible) by this call; both 0 when the
    /// checkpoint was kept already.
    pub linked: usize,
    pub copied: usize,
}

/// Makes `<state_dir>/best/<name of checkpoint>` a complete copy of the checkpoint unit and
/// removes every other kept checkpoint (module docs). With `evaluated` (the unit's key when it
/// was evaluated), a checkpoint that changed since is refused, and the one kept before stays.
pub fn keep(
    state_dir: &Path,
    checkpoint: &Path,
    evaluated: Option<&CheckpointKey>,
) -> Result<Kept, KeepBestError> {
    keep_from(state_dir, checkpoint, checkpoint, evaluated)
}

/// [`keep`], with the files read from `source`, a copy of `checkpoint` (its pin,
/// [`crate::store::pin`]: links to the same files, there after rotation deleted the original).
pub fn keep_from(
    state_dir: &Path,
    checkpoint: &Path,
    source: &Path,
    evaluated: Option<&CheckpointKey>,
) -> Result<Kept, KeepBestError> {
    keep_with(state_dir, checkpoint, source, evaluated, &|from, to| {
        fs::hard_link(from, to)
    })
}

/// Makes the new path `to` a copy of the checkpoint unit `from` whose regular files are all
/// hard links (never copies: a link is refused, e.g. across file systems, and it fails), bounded
/// and following no link as [`keep`] does. Links share the files' blocks and times.
pub fn link_unit(from: &Path, to: &Path) -> Result<(), KeepBestError> {
    let meta = fs::symlink_metadata(from).map_err(io_error(from))?;
    let mut kept = Kept {
        path: to.to_path_buf(),
        linked: 0,
        copied: 0,
    };
    let link = |a: &Path, b: &Path| fs::hard_link(a, b);
    if meta.file_type().is_symlink() {
        Err(KeepBestError::Link {
            path: from.to_path_buf(),
        })
    } else if meta.is_dir() {
        copy_tree(from, &meta, to, &link, false, &mut kept).map(|_| ())
    } else if meta.is_file() {
        link_or_copy(from, to, &link, false, &mut kept)
    } else {
        Err(KeepBestError::NotRegular {
            path: from.to_path_buf(),
        })
    }
}

/// The kept copy of `checkpoint`, if `<state_dir>/best/` holds a complete one: the same files,
/// or, once rotation has deleted the checkpoint, whatever is kept under its name (only complete
/// copies are renamed to it).
pub fn lookup(state_dir: &Path, checkpoint: &Path) -> Option<PathBuf> {
    let name = kept_name(checkpoint).ok()?;
    let path = state_dir.join(KEPT_DIR).join(name);
    (same(&path, checkpoint) || (gone(checkpoint) && is_kept(&path))).then_some(path)
}

/// Has `path` been deleted?
fn gone(path: &Path) -> bool {
    matches!(fs::symlink_metadata(path), Err(e) if e.kind() == io::ErrorKind::NotFound)
}

/// Is there a kept checkpoint at `path` (a regular file or a folder, not a link)?
fn is_kept(path: &Path) -> bool {
    fs::symlink_metadata(path).is_ok_and(|m| m.is_file() || m.is_dir())
}

/// [`keep`] with the function that makes a hard link (tests make it fail).
fn keep_with(
    state_dir: &Path,
    checkpoint: &Path,
    source: &Path,
    evaluated: Option<&CheckpointKey>,
    link: &dyn Fn(&Path, &Path) -> io::Result<()>,
) -> Result<Kept, KeepBestError> {
    let dir = state_dir.join(KEPT_DIR);
    prepare(&dir)?;
    let name = kept_name(checkpoint)?;
    let target = dir.join(name);
    let mut kept = Kept {
        path: target.clone(),
        linked: 0,
        copied: 0,
    };
    // Deleted by rotation after it was kept (a restart): the kept copy is what is left of it.
    let meta = match fs::symlink_metadata(source) {
        Err(e) if e.kind() == io::ErrorKind::NotFound && is_kept(&target) => None,
        other => Some(other.map_err(io_error(source))?),
    };
    if let Some(meta) = meta.filter(|_| !same(&target, source)) {
        let tmp = temp_name(&dir, name);
        let built = if meta.file_type().is_symlink() {
            Err(KeepBestError::Link {
                path: source.to_path_buf(),
            })
        } else if meta.is_dir() {
            copy_tree(source, &meta, &tmp, link, true, &mut kept).map(|_| ())
        } else if meta.is_file() {
            link_or_copy(source, &tmp, link, true, &mut kept)
        } else {
            Err(KeepBestError::NotRegular {
                path: source.to_path_buf(),
            })
        }
        .and_then(|()| match evaluated {
            Some(key) if !is_what_was_evaluated(&tmp, key) => Err(KeepBestError::Changed {
                path: checkpoint.to_path_buf(),
            }),
            _ => Ok(()),
        });
        if let Err(e) = built {
            remove_entry(&tmp);
            return Err(e);
        }
        // An older version under the same name moves aside first (a folder cannot be renamed
        // over), and goes with the other kept checkpoints below.
        if fs::symlink_metadata(&target).is_ok() {
            let aside = temp_name(&dir, name);
            fs::rename(&target, &aside).map_err(io_error(&target))?;
        }
        fs::rename(&tmp, &target).map_err(io_error(&target))?;
    }
    for entry in fs::read_dir(&dir).map_err(io_error(&dir))?.flatten() {
        if entry.file_name() != name {
            remove_entry(&entry.path());
        }
    }
    sync_dir(&dir);
    Ok(kept)
}

/// The name the checkpoint is kept under: its own (a name in `run.dir`, never hidden there).
pub(super) fn kept_name(checkpoint: &Path) -> Result<&OsStr, KeepBestError> {
    match checkpoint.file_name() {
        Some(n) if !n.as_encoded_bytes().starts_with(b".") => Ok(n),
        _ => Err(KeepBestError::NoName {
            path: checkpoint.to_path_buf(),
        }),
    }
}

/// Creates `best/` (mode 0700) in the state folder, which must exist (a deleted state folder is
/// the daemon's to notice and re-create, not this), or checks it is a real folder; removes what
/// a keep cut short left there.
fn prepare(dir: &Path) -> Result<(), KeepBestError> {
    match fs::symlink_metadata(dir) {
        Ok(m) if m.is_dir() => {}
        Ok(_) => {
            return Err(KeepBestError::BadFolder {
                path: dir.to_path_buf(),
            });
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            use std::os::unix::fs::DirBuilderExt;
            fs::DirBuilder::new()
                .mode(0o700)
                .create(dir)
                .map_err(io_error(dir))?;
        }
        Err(e) => return Err(io_error(dir)(e)),
    }
    for entry in fs::read_dir(dir).map_err(io_error(dir))?.flatten() {
        if is_temp_name(&entry.file_name().to_string_lossy(), None) {
            remove_entry(&entry.path());
        }
    }
    Ok(())
}

/// An unused temporary name for `name` in `dir`: `.<name>.<random>.tmp`.
pub(super) fn temp_name(dir: &Path, name: &OsStr) -> PathBuf {
    use rand::Rng;
    let mut rng = rand::thread_rng();
    loop {
        let suffix: String = (0..12)
            .map(|_| char::from(b'a' + rng.gen_range(0..26u8)))
            .collect();
        let mut n = std::ffi::OsString::from(".");
        n.push(name);
        n.push(format!(".{suffix}{TEMP_SUFFIX}"));
        let p = dir.join(n);
        if fs::symlink_metadata(&p).is_err() {
            return p;
        }
    }
}

/// Is `entry` a name [`temp_name`] makes for `name` (`.<name>.<12 lowercase letters>.tmp`)?
pub(super) fn is_temp_name_of(entry: &str, name: &str) -> bool {
    entry
        .strip_prefix(&format!(".{name}."))
        .and_then(|rest| rest.strip_suffix(TEMP_SUFFIX))
        .is_some_and(|r| r.len() == 12 && r.bytes().all(|b| b.is_ascii_lowercase()))
}

/// Removes `path` without following links: a link is removed as a link, a folder with its tree.
pub(super) fn remove_entry(path: &Path) {
    let removed = match fs::symlink_metadata(path) {
        Ok(m) if m.is_dir() => fs::remove_dir_all(path),
        Ok(_) => fs::remove_file(path),
        Err(_) => return,
    };
    if let Err(e) = removed {
        tracing::warn!(path = %untrusted(path), "cannot remove an old kept checkpoint or a partial copy: {e}");
    }
}

/// Links the regular file `from` at the new name `to`, or, with `copy`, copies it when a link is
/// not possible.
pub(super) fn link_or_copy(
    from: &Path,
    to: &Path,
    link: &dyn Fn(&Path, &Path) -> io::Result<()>,
    copy: bool,
    kept: &mut Kept,
) -> Result<(), KeepBestError> {
    match link(from, to) {
        Ok(()) => {
            // `link` does not follow a link at `from`; had one replaced the file since it was
            // looked at, the new entry is that link, and it goes.
            let m = fs::symlink_metadata(to).map_err(io_error(to))?;
            if !m.is_file() {
                remove_entry(to);
                return Err(KeepBestError::Link {
                    path: from.to_path_buf(),
                });
            }
            kept.linked += 1;
            Ok(())
        }
        // Another file system, a file system without links, or links refused (Linux's
        // protected_hardlinks, for a file of another user): a copy.
        Err(e)
            if copy
                && matches!(
                    e.raw_os_error(),
                    Some(libc::EXDEV | libc::EPERM | libc::EMLINK | libc::EOPNOTSUPP)
                ) =>
        {
            copy_file(from, to)?;
            kept.copied += 1;
            Ok(())
        }
        Err(e) => Err(io_error(from)(e)),
    }
}

/// Copies the regular file `from` (not through a link) to the new file `to` (made 0600, then
/// given `from`'s permission bits: a restored copy has the training job's mode, and a kept one
/// is inside the 0700 `best/`), with `from`'s modification time, and syncs it.
fn copy_file(from: &Path, to: &Path) -> Result<(), KeepBestError> {
    let mut src = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(from)
        .map_err(|e| match e.raw_os_error() {
            Some(libc::ELOOP) => KeepBestError::Link {
                path: from.to_path_buf(),
            },
            _ => io_error(from)(e),
        })?;
    let meta = src.metadata().map_err(io_error(from))?;
    if !meta.is_file() {
        return Err(KeepBestError::NotRegular {
            path: from.to_path_buf(),
        });
    }
    let mut dst = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(to)
        .map_err(io_error(to))?;
    io::copy(&mut src, &mut dst).map_err(io_error(to))?;
    if let Ok(modified) = meta.modified() {
        dst.set_modified(modified).map_err(io_error(to))?;
    }
    dst.set_permissions(fs::Permissions::from_mode(meta.mode() & 0o777))
        .map_err(io_error(to))?;
    dst.sync_all().map_err(io_error(to))
}

/// Copies the folder `from` (looked at as `meta`) to the new folder `to`: its folders made (0700
/// while they are filled, then with their source's permission bits, so that a restored folder
/// has the training job's modes; a kept or pinned one is inside a 0700 folder of diffmon's), its
/// regular files linked or copied, links and special files skipped; bounded like the watcher's
/// walk. Each folder is opened without following a link and read through its descriptor
/// (`/proc/self/fd/<n>/<name>`), so a folder swapped for a link while it is copied is never
/// walked into: the link is skipped, or the whole copy refused when it is `from` itself; `to`
/// is filled through its descriptor too. Returns the device and inode of the folder made, for
/// a caller that renames it to check that what it renamed was that folder.
pub(super) fn copy_tree(
    from: &Path,
    meta: &fs::Metadata,
    to: &Path,
    link: &dyn Fn(&Path, &Path) -> io::Result<()>,
    copy: bool,
    kept: &mut Kept,
) -> Result<(u64, u64), KeepBestError> {
    let mkdir = |p: &Path| {
        use std::os::unix::fs::DirBuilderExt;
        fs::DirBuilder::new()
            .mode(0o700)
            .create(p)
            .map_err(io_error(p))
    };
    let top = open_dir(from).map_err(|e| link_or_io(from, e))?;
    let now = top.metadata().map_err(io_error(from))?;
    if (now.dev(), now.ino()) != (meta.dev(), meta.ino()) {
        // Swapped between the look and the open.
        return Err(KeepBestError::Link {
            path: from.to_path_buf(),
        });
    }
    mkdir(to)?;
    // `to` may be in a folder others can write (a restore into the run folder): it is filled
    // through its descriptor, so that `to` swapped for a link never has diffmon make, link or
    // chmod anything elsewhere; what is inside it is this user's 0700 folder's.
    let held = open_dir(to).map_err(|e| link_or_io(to, e))?;
    let made = held.metadata().map_err(io_error(to))?;
    if made.uid() != unsafe { libc::geteuid() } {
        return Err(KeepBestError::Replaced {
            path: to.to_path_buf(),
        });
    }
    let to = &fd_path(&held);
    // Each folder made and its source's permission bits, set once it is filled.
    let mut modes: Vec<(PathBuf, u32)> = vec![(to.to_path_buf(), now.mode() & 0o777)];
    let too_large = || KeepBestError::TooLarge {
        folder: from.to_path_buf(),
    };
    let mut entries = 0usize;
    let mut skipped = 0usize;
    // Folders to copy: opened when their turn comes, through their parent's descriptor. Pending
    // entries belong to the folders on the current path, so few descriptors are open at once.
    let mut stack: Vec<(
        std::rc::Rc<fs::File>,
        Option<std::ffi::OsString>,
        PathBuf,
        usize,
    )> = vec![(std::rc::Rc::new(top), None, to.to_path_buf(), 0)];
    while let Some((parent, name, dst, depth)) = stack.pop() {
        let dir = match name {
            None => parent,
            Some(name) => {
                let at = under(&parent, &name);
                match open_dir(&at) {
                    Ok(d) => {
                        let mode = d.metadata().map_err(io_error(&from.join(&name)))?.mode();
                        modes.push((dst.clone(), mode & 0o777));
                        std::rc::Rc::new(d)
                    }
                    // A link now: not walked into.
                    Err(e) if matches!(e.raw_os_error(), Some(libc::ELOOP | libc::ENOTDIR)) => {
                        let _ = fs::remove_dir(&dst);
                        skipped += 1;
                        continue;
                    }
                    Err(e) => return Err(io_error(&from.join(&name))(e)),
                }
            }
        };
        let listing = fd_path(&dir);
        for entry in fs::read_dir(&listing).map_err(io_error(from))? {
            let entry = entry.map_err(io_error(from))?;
            entries += 1;
            if entries > MAX_ENTRIES {
                return Err(too_large());
            }
            let (s, d) = (under(&dir, &entry.file_name()), dst.join(entry.file_name()));
            let ft = entry.file_type().map_err(io_error(&s))?;
            if ft.is_dir() {
                if depth + 1 >= MAX_DEPTH {
                    return Err(too_large());
                }
                mkdir(&d)?;
                stack.push((dir.clone(), Some(entry.file_name()), d, depth + 1));
            } else if ft.is_file() {
                link_or_copy(&s, &d, link, copy, kept)?;
            } else {
                skipped += 1;
            }
        }
    }
    // Innermost first: a folder whose mode forbids writing is set after what is inside it.
    for (folder, mode) in modes.iter().rev() {
        fs::set_permissions(folder, fs::Permissions::from_mode(*mode)).map_err(io_error(folder))?;
    }
    if skipped > 0 {
        tracing::info!(
            checkpoint = %untrusted(from),
            skipped,
            "links and special files of the best checkpoint are not kept"
        );
    }
    Ok((made.dev(), made.ino()))
}

/// Opens the folder `path` without following a link at its last component.
pub(super) fn open_dir(path: &Path) -> io::Result<fs::File> {
    OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)
}

/// The path through which the kernel reaches the open folder `dir`.
fn fd_path(dir: &fs::File) -> PathBuf {
    use std::os::fd::AsRawFd;
    PathBuf::from(format!("/proc/self/fd/{}", dir.as_raw_fd()))
}

/// `name` inside the open folder `dir`, resolved through its descriptor.
pub(super) fn under(dir: &fs::File, name: &OsStr) -> PathBuf {
    fd_path(dir).join(name)
}

/// An error opening the folder `path` without following links: a link (Linux says ENOTDIR for
/// a link opened with `O_DIRECTORY|O_NOFOLLOW`), or another I/O error.
pub(super) fn link_or_io(path: &Path, e: io::Error) -> KeepBestError {
    match e.raw_os_error() {
        Some(libc::ELOOP | libc::ENOTDIR) => KeepBestError::Link {
            path: path.to_path_buf(),
        },
        _ => io_error(path)(e),
    }
}

/// Is the kept copy `copy` what was evaluated (`evaluated`, the unit's key then)? A file: the
/// same size and modification time (links and copies keep both). A folder: no file in it newer
/// than the newest time the key saw.
fn is_what_was_evaluated(copy: &Path, evaluated: &CheckpointKey) -> bool {
    let Some(files) = summary(copy) else {
        return false;
    };
    let newest = i128::from(evaluated.mtime_ns);
    if fs::symlink_metadata(copy).is_ok_and(|m| m.is_file()) {
        return files
            .iter()
            .all(|(_, size, mtime)| *size == evaluated.size && *mtime == newest);
    }
    files.iter().all(|(_, _, mtime)| *mtime <= newest)
}

/// The regular files of a tree (links not followed): (relative path, size, mtime in ns), or
/// `None` when it is not a regular file or folder or cannot be walked within the bounds.
pub(super) fn summary(path: &Path) -> Option<Vec<(PathBuf, u64, i128)>> {
    let stamp =
        |m: &fs::Metadata| i128::from(m.mtime()) * 1_000_000_000 + i128::from(m.mtime_nsec());
    let meta = fs::symlink_metadata(path).ok()?;
    if meta.is_file() {
        return Some(vec![(PathBuf::new(), meta.len(), stamp(&meta))]);
    }
    if !meta.is_dir() {
        return None;
    }
    let mut files = Vec::new();
    let mut entries = 0usize;
    let mut stack = vec![(path.to_path_buf(), PathBuf::new(), 0usize)];
    while let Some((dir, rel, depth)) = stack.pop() {
        for entry in fs::read_dir(&dir).ok()? {
            let entry = entry.ok()?;
            entries += 1;
            if entries > MAX_ENTRIES {
                return None;
            }
            let ft = entry.file_type().ok()?;
            let relative = rel.join(entry.file_name());
            if ft.is_dir() {
                if depth + 1 >= MAX_DEPTH {
                    return None;
                }
                stack.push((entry.path(), relative, depth + 1));
            } else if ft.is_file() {
                let m = entry.metadata().ok()?;
                files.push((relative, m.len(), stamp(&m)));
            }
        }
    }
    files.sort();
    Some(files)
}

/// Is `kept` a complete copy of `checkpoint`: the same regular files, sizes and modification
/// times (links are never part of either)?
fn same(kept: &Path, checkpoint: &Path) -> bool {
    match (summary(kept), summary(checkpoint)) {
        (Some(a), Some(b)) => a == b && !a.is_empty(),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::keeper::Keeper;
    use super::*;
    use std::os::unix::fs::PermissionsExt;
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    fn write(path: &Path, bytes: &[u8]) {
        fs::create_dir_all(path.parent().unwrap()).unwrap();
        fs::write(path, bytes).unwrap();
    }

    /// A state folder in `dir`, as the daemon creates it.
    fn state_in(dir: &Path) -> PathBuf {
        let state = dir.join("state");
        fs::create_dir(&state).unwrap();
        state
    }

    fn kept_names(state: &Path) -> Vec<String> {
        let mut names: Vec<String> = fs::read_dir(state.join(KEPT_DIR))
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        names.sort();
        names
    }

    /// A file checkpoint is hard-linked (the same inode: no extra space), survives the
    /// deletion of the original, and a new best replaces it: one kept checkpoint at a time.
    #[test]
    fn a_file_is_linked_survives_rotation_and_is_replaced_by_the_next_best() {
        let run = tempfile::tempdir().unwrap();
        let state = run.path().join(".diffmon");
        fs::create_dir(&state).unwrap();
        let a = run.path().join("ckpt_100.pt");
        let b = run.path().join("ckpt_200.pt");
        write(&a, b"weights of 100");
        write(&b, b"weights of 200");
        let kept = keep(&state, &a, None).unwrap();
        assert_eq!(kept.path, state.join("best/ckpt_100.pt"));
        assert_eq!((kept.linked, kept.copied), (1, 0));
        assert_eq!(
            fs::metadata(&kept.path).unwrap().ino(),
            fs::metadata(&a).unwrap().ino()
        );
        let mode = fs::metadata(state.join(KEPT_DIR))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o700);
        // Rotation deletes the original; the kept one stays.
        fs::remove_file(&a).unwrap();
        assert_eq!(fs::read(&kept.path).unwrap(), b"weights of 100");
        // Asking again for the same checkpoint (a restart) changes nothing.
        write(&b, b"weights of 200");
        let again = keep(&state, &b, None).unwrap();
        assert_eq!(kept_names(&state), ["ckpt_200.pt"]);
        let same = keep(&state, &b, None).unwrap();
        assert_eq!((same.linked, same.copied), (0, 0));
        assert_eq!(same.path, again.path);
        assert_eq!(lookup(&state, &b), Some(again.path));
        assert_eq!(lookup(&state, &a), None);
    }

    /// A folder checkpoint (accelerate, diffusers) is kept with its tree; links inside it are
    /// not followed, and a checkpoint that is itself a link is not kept, leaving the previous
    /// kept one in place.
    #[test]
    fn a_folder_is_kept_with_its_tree_and_links_are_never_followed() {
        let run = tempfile::tempdir().unwrap();
        let state = state_in(run.path());
        let outside = tempfile::tempdir().unwrap();
        let secret = outside.path().join("secret");
        write(&secret, b"not yours");
        let ck = run.path().join("checkpoint-300");
        write(&ck.join("model.safetensors"), b"model");
        write(
            &ck.join("unet_ema/diffusion_pytorch_model.safetensors"),
            b"ema",
        );
        std::os::unix::fs::symlink(&secret, ck.join("linked_file")).unwrap();
        std::os::unix::fs::symlink(outside.path(), ck.join("linked_dir")).unwrap();
        let kept = keep(&state, &ck, None).unwrap();
        assert_eq!(kept.linked, 2);
        let k = state.join("best/checkpoint-300");
        assert_eq!(fs::read(k.join("model.safetensors")).unwrap(), b"model");
        assert_eq!(
            fs::read(k.join("unet_ema/diffusion_pytorch_model.safetensors")).unwrap(),
            b"ema"
        );
        assert!(fs::symlink_metadata(k.join("linked_file")).is_err());
        assert!(fs::symlink_metadata(k.join("linked_dir")).is_err());
        assert_eq!(lookup(&state, &ck), Some(k.clone()));
        // Rotation deletes the whole folder; asked again (a restart), the kept copy stands.
        fs::remove_dir_all(&ck).unwrap();
        assert_eq!(fs::read(k.join("model.safetensors")).unwrap(), b"model");
        let again = keep(&state, &ck, None).unwrap();
        assert_eq!(
            (again.path.clone(), again.linked, again.copied),
            (k.clone(), 0, 0)
        );
        assert_eq!(lookup(&state, &ck), Some(k.clone()));
        // A checkpoint deleted before it was ever kept is an error, and changes nothing.
        let never = run.path().join("checkpoint-350");
        assert!(keep(&state, &never, None).is_err());
        assert_eq!(lookup(&state, &never), None);
        // A best that is a link to a file elsewhere is not followed.
        let link = run.path().join("ckpt_400.pt");
        std::os::unix::fs::symlink(&secret, &link).unwrap();
        let e = keep(&state, &link, None).unwrap_err();
        assert!(matches!(e, KeepBestError::Link { .. }), "{e}");
        assert_eq!(kept_names(&state), ["checkpoint-300"]);
        assert_eq!(fs::read(&secret).unwrap(), b"not yours");
    }

    /// When a link is not possible (another file system: EXDEV), files are copied, with the
    /// original's modification time, so that the copy is recognized after a restart.
    #[test]
    fn without_links_the_files_are_copied() {
        let run = tempfile::tempdir().unwrap();
        let state = state_in(run.path());
        let ck = run.path().join("checkpoint-500");
        write(&ck.join("a/b/weights.bin"), &vec![7u8; 100_000]);
        write(&ck.join("optimizer.bin"), b"opt");
        fs::set_permissions(
            ck.join("a/b/weights.bin"),
            fs::Permissions::from_mode(0o640),
        )
        .unwrap();
        let exdev = |_: &Path, _: &Path| Err(io::Error::from_raw_os_error(libc::EXDEV));
        let kept = keep_with(&state, &ck, &ck, None, &exdev).unwrap();
        assert_eq!((kept.linked, kept.copied), (0, 2));
        let copy = state.join("best/checkpoint-500/a/b/weights.bin");
        assert_eq!(fs::read(&copy).unwrap(), vec![7u8; 100_000]);
        assert_ne!(
            fs::metadata(&copy).unwrap().ino(),
            fs::metadata(ck.join("a/b/weights.bin")).unwrap().ino()
        );
        // The original's mode (a restored copy has the training job's), inside the 0700 best/.
        assert_eq!(
            fs::metadata(&copy).unwrap().permissions().mode() & 0o777,
            0o640
        );
        // Recognized as complete: a second call copies nothing.
        let again = keep_with(&state, &ck, &ck, None, &exdev).unwrap();
        assert_eq!((again.linked, again.copied), (0, 0));
        // Any other error of the link is an error, and leaves nothing behind.
        let denied = |_: &Path, _: &Path| Err(io::Error::from_raw_os_error(libc::EIO));
        let other = run.path().join("ckpt_600.pt");
        write(&other, b"x");
        assert!(keep_with(&state, &other, &other, None, &denied).is_err());
        assert_eq!(kept_names(&state), ["checkpoint-500"]);
    }

    /// What a crash left (a temporary copy) is removed; a link planted under the kept name or
    /// as the kept folder is never written through.
    #[test]
    fn leftovers_are_removed_and_planted_links_are_not_followed() {
        let run = tempfile::tempdir().unwrap();
        let state = state_in(run.path());
        let victim = run.path().join("victim");
        write(&victim, b"precious");
        let ck = run.path().join("ckpt_700.pt");
        write(&ck, b"seven hundred");
        fs::create_dir_all(state.join(KEPT_DIR)).unwrap();
        write(
            &state.join("best/.ckpt_650.pt.abcdefabcdef.tmp"),
            b"half a copy",
        );
        fs::create_dir(state.join("best/.checkpoint-9.qwertyuiopas.tmp")).unwrap();
        std::os::unix::fs::symlink(&victim, state.join("best/ckpt_700.pt")).unwrap();
        let kept = keep(&state, &ck, None).unwrap();
        assert_eq!(kept_names(&state), ["ckpt_700.pt"]);
        assert_eq!(fs::read(&kept.path).unwrap(), b"seven hundred");
        assert!(
            !fs::symlink_metadata(&kept.path)
                .unwrap()
                .file_type()
                .is_symlink()
        );
        assert_eq!(fs::read(&victim).unwrap(), b"precious");
        // A state folder that is gone is not re-created here (the daemon notices, and says so).
        fs::remove_dir_all(&state).unwrap();
        assert!(keep(&state, &ck, None).is_err());
        assert!(!state.exists());
        // The kept folder itself a link: refused.
        let other = tempfile::tempdir().unwrap();
        let state2 = other.path().join("state");
        fs::create_dir(&state2).unwrap();
        std::os::unix::fs::symlink(run.path(), state2.join(KEPT_DIR)).unwrap();
        let e = keep(&state2, &ck, None).unwrap_err();
        assert!(matches!(e, KeepBestError::BadFolder { .. }), "{e}");
    }

    /// The keeper's thread keeps the newest request; `kept` waits for a keep in progress.
    #[test]
    fn the_keeper_keeps_the_newest_request_on_its_thread() {
        let run = tempfile::tempdir().unwrap();
        let state = state_in(run.path());
        let paths: Vec<PathBuf> = (1..=5)
            .map(|i| {
                let p = run.path().join(format!("ckpt_{i}00.pt"));
                write(&p, format!("weights {i}").as_bytes());
                p
            })
            .collect();
        let keeper = Keeper::new(&state);
        assert_eq!(keeper.kept(&paths[0]), None);
        for p in &paths {
            keeper.keep(p, None, None);
        }
        let kept = keeper.kept(&paths[4]).unwrap();
        assert_eq!(kept, state.join("best/ckpt_500.pt"));
        assert_eq!(kept_names(&state), ["ckpt_500.pt"]);
        assert_eq!(keeper.kept(&paths[1]), None);
        // A new keeper (a restart) finds it in the folder.
        drop(keeper);
        assert_eq!(Keeper::new(&state).kept(&paths[4]), Some(kept));
    }

    /// A keeper dropped right after a request (a run that ends, `watch --until-file`) keeps that
    /// checkpoint first: its folder of 3000 files is kept whole, and nothing is left half made.
    #[test]
    fn a_keeper_dropped_keeps_the_last_request_first() {
        let run = tempfile::tempdir().unwrap();
        let state = state_in(run.path());
        let ck = run.path().join("checkpoint-180");
        for i in 0..3000 {
            write(&ck.join(format!("shard-{i}")), b"w");
        }
        let keeper = Keeper::new(&state);
        keeper.keep(&ck, None, None);
        drop(keeper);
        assert_eq!(kept_names(&state), ["checkpoint-180"]);
        let kept = state.join("best/checkpoint-180");
        assert_eq!(fs::read_dir(&kept).unwrap().count(), 3000);
    }

    /// The hook hears how each keep ended, with the kept copy named under the shown state
    /// folder, and `None` for one that failed (what the live page shows).
    #[test]
    fn the_keeper_tells_its_hook_how_each_keep_ended() {
        let run = tempfile::tempdir().unwrap();
        let state = state_in(run.path());
        let a = run.path().join("ckpt_100.pt");
        write(&a, b"weights");
        let heard = Arc::new(Mutex::new(Vec::new()));
        let h = heard.clone();
        let keeper = Keeper::new(&state)
            .showing(Path::new("shown/state"))
            .on_kept(Arc::new(move |c: &Path, k: Option<&Path>| {
                h.lock()
                    .unwrap()
                    .push((c.to_path_buf(), k.map(Path::to_path_buf)));
            }));
        let wait_for = |n: usize| {
            let start = std::time::Instant::now();
            while heard.lock().unwrap().len() < n {
                assert!(start.elapsed() < Duration::from_secs(10), "no call");
                std::thread::sleep(Duration::from_millis(5));
            }
        };
        keeper.keep(&a, None, None);
        assert_eq!(
            keeper.kept(&a),
            Some(PathBuf::from("shown/state/best/ckpt_100.pt"))
        );
        wait_for(1);
        let missing = run.path().join("ckpt_200.pt");
        keeper.keep(&missing, None, None);
        assert_eq!(keeper.kept(&missing), None);
        wait_for(2);
        assert_eq!(
            *heard.lock().unwrap(),
            [
                (a, Some(PathBuf::from("shown/state/best/ckpt_100.pt"))),
                (missing, None)
            ]
        );
    }

    #[test]
    fn a_checkpoint_changed_since_its_evaluation_is_not_kept_and_the_old_copy_stays() {
        let run = tempfile::tempdir().unwrap();
        let state = state_in(run.path());
        let a = run.path().join("ckpt_100.pt");
        write(&a, b"evaluated weights");
        let key_a = crate::store::history::CheckpointKey::of(&a).unwrap();
        keep(&state, &a, Some(&key_a)).unwrap();
        // ckpt_200.pt was evaluated, then rewritten before the keeper got to it.
        let b = run.path().join("ckpt_200.pt");
        write(&b, b"evaluated");
        let key_b = crate::store::history::CheckpointKey::of(&b).unwrap();
        std::thread::sleep(Duration::from_millis(20));
        write(&b, b"something else entirely");
        let e = keep(&state, &b, Some(&key_b)).unwrap_err();
        assert!(matches!(e, KeepBestError::Changed { .. }), "{e}");
        assert_eq!(kept_names(&state), ["ckpt_100.pt"]);
        // A folder with a file newer than its key.
        let f = run.path().join("checkpoint-300");
        write(&f.join("model.safetensors"), b"w");
        let key_f = crate::store::unit::key(&f).unwrap();
        std::thread::sleep(Duration::from_millis(20));
        write(&f.join("model.safetensors"), b"replaced");
        assert!(matches!(
            keep(&state, &f, Some(&key_f)),
            Err(KeepBestError::Changed { .. })
        ));
        assert_eq!(kept_names(&state), ["ckpt_100.pt"]);
        // Unchanged: kept.
        let key_f = crate::store::unit::key(&f).unwrap();
        keep(&state, &f, Some(&key_f)).unwrap();
        assert_eq!(kept_names(&state), ["checkpoint-300"]);
    }

    #[test]
    fn a_folder_swapped_for_a_link_is_never_walked_into() {
        let run = tempfile::tempdir().unwrap();
        let state = state_in(run.path());
        let secret = run.path().join("secret");
        write(&secret.join("id_rsa"), b"private key");
        let ck = run.path().join("checkpoint-100");
        write(&ck.join("model.safetensors"), b"w");
        // Looked at as a folder, then swapped for a link before the walk opens it.
        let meta = fs::symlink_metadata(&ck).unwrap();
        fs::rename(&ck, run.path().join("aside")).unwrap();
        std::os::unix::fs::symlink(&secret, &ck).unwrap();
        let mut kept = Kept {
            path: PathBuf::new(),
            linked: 0,
            copied: 0,
        };
        let to = state.join("copy");
        let e = copy_tree(
            &ck,
            &meta,
            &to,
            &|f, t| fs::hard_link(f, t),
            true,
            &mut kept,
        )
        .unwrap_err();
        assert!(matches!(e, KeepBestError::Link { .. }), "{e}");
        assert!(!to.join("id_rsa").exists());
        // A subfolder that is a link is skipped, not walked into.
        fs::remove_file(&ck).unwrap();
        fs::rename(run.path().join("aside"), &ck).unwrap();
        fs::create_dir(ck.join("sub")).unwrap();
        let meta = fs::symlink_metadata(&ck).unwrap();
        fs::remove_dir(ck.join("sub")).unwrap();
        std::os::unix::fs::symlink(&secret, ck.join("sub")).unwrap();
        let to = state.join("copy2");
        copy_tree(
            &ck,
            &meta,
            &to,
            &|f, t| fs::hard_link(f, t),
            true,
            &mut kept,
        )
        .unwrap();
        assert!(to.join("model.safetensors").is_file());
        assert!(!to.join("sub").exists(), "the linked folder was copied");
    }
}
