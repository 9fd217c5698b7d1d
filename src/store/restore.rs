//! Putting a kept checkpoint back (docs/design.md §9, "Resume"): [`restore`] makes a copy of
//! the checkpoint `early_stop.keep_best` kept (`crate::store::keep_best`) at the path the training
//! job resumes from, and [`is_copy_of_kept`] tells the watcher that a checkpoint is such a copy
//! (restored by `diffmon resume`, or by hand), so that it is not evaluated again.

use crate::store::keep_best::{
    KEPT_DIR, KeepBestError, Kept, copy_tree, io_error, is_temp_name_of, kept_name, link_or_copy,
    remove_entry, summary, temp_name,
};
use crate::store::safe_fs::sync_dir;
use std::fs::{self, OpenOptions};
use std::io;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

/// Makes the new path `to` a copy of the kept checkpoint `kept` (`diffmon resume` restores it
/// where the training job expects it): its files hard-linked, or copied with their times where a
/// link is not possible; bounded and following no link, as [`keep`]. Built under a temporary
/// name beside `to` and renamed into place, so `to` is never seen half made; whatever is at `to`
/// is never replaced.
pub fn restore(kept: &Path, to: &Path) -> Result<Kept, KeepBestError> {
    let meta = fs::symlink_metadata(kept).map_err(io_error(kept))?;
    let name = to.file_name().ok_or_else(|| KeepBestError::NoName {
        path: to.to_path_buf(),
    })?;
    let tmp = temp_name(crate::store::safe_fs::parent(to), name);
    let mut done = Kept {
        path: to.to_path_buf(),
        linked: 0,
        copied: 0,
    };
    let link = |a: &Path, b: &Path| fs::hard_link(a, b);
    // A folder is made through its descriptor (`copy_tree`); its device and inode tell whether
    // what was renamed into place is that folder (`tmp` is in a folder others may write).
    let built = if meta.file_type().is_symlink() {
        Err(KeepBestError::Link {
            path: kept.to_path_buf(),
        })
    } else if meta.is_dir() {
        copy_tree(kept, &meta, &tmp, &link, true, &mut done).map(Some)
    } else if meta.is_file() {
        link_or_copy(kept, &tmp, &link, true, &mut done).map(|()| None)
    } else {
        Err(KeepBestError::NotRegular {
            path: kept.to_path_buf(),
        })
    };
    let made = match built {
        Ok(made) => made,
        // What is at the temporary name now is not what diffmon made: not removed.
        Err(e @ KeepBestError::Replaced { .. }) => return Err(e),
        Err(e) => {
            remove_entry(&tmp);
            return Err(e);
        }
    };
    if let Err(e) = crate::store::safe_fs::rename_noreplace(&tmp, to) {
        remove_entry(&tmp);
        return Err(io_error(to)(e));
    }
    let there = fs::symlink_metadata(to).map(|m| (m.dev(), m.ino()));
    if made.is_some_and(|made| there.ok() != Some(made)) {
        return Err(KeepBestError::Replaced {
            path: to.to_path_buf(),
        });
    }
    sync_dir(crate::store::safe_fs::parent(to));
    Ok(done)
}

/// Removes what a [`restore`] to `to` that was killed left beside it: entries named as its
/// temporary copies are ([`is_temp_name_of`]), files or folders, no link followed. Returns how
/// many are gone.
pub fn remove_leftovers(to: &Path) -> usize {
    let Some(name) = to.file_name().and_then(|n| n.to_str()) else {
        return 0;
    };
    let mut removed = 0;
    for entry in fs::read_dir(crate::store::safe_fs::parent(to))
        .into_iter()
        .flatten()
        .flatten()
    {
        if entry
            .file_name()
            .to_str()
            .is_some_and(|e| is_temp_name_of(e, name))
        {
            remove_entry(&entry.path());
            removed += usize::from(fs::symlink_metadata(entry.path()).is_err());
        }
    }
    removed
}

/// Is the checkpoint unit `unit` a copy of the one kept in `<state_dir>/best/` under its name:
/// the same regular files, of the same sizes and bytes (times aside: `cp -r` changes them)?
/// Files that are links to each other are not read. The watcher asks it of a checkpoint it
/// has not evaluated that bears the kept one's name, so the kept best restored by hand or by
/// `diffmon resume` is not evaluated again.
pub fn is_copy_of_kept(state_dir: &Path, unit: &Path) -> bool {
    let Ok(name) = kept_name(unit) else {
        return false;
    };
    let kept = state_dir.join(KEPT_DIR).join(name);
    let (Some(a), Some(b)) = (summary(&kept), summary(unit)) else {
        return false;
    };
    let shape = |files: &[(PathBuf, u64, i128)]| -> Vec<(PathBuf, u64)> {
        files
            .iter()
            .map(|(p, size, _)| (p.clone(), *size))
            .collect()
    };
    if a.is_empty() || shape(&a) != shape(&b) {
        return false;
    }
    let file = |root: &Path, rel: &Path| {
        if rel.as_os_str().is_empty() {
            root.to_path_buf()
        } else {
            root.join(rel)
        }
    };
    a.iter()
        .all(|(rel, _, _)| same_bytes(&file(&kept, rel), &file(unit, rel)).unwrap_or(false))
}

/// Do the regular files `a` and `b` hold the same bytes? Each is opened without following a
/// link and without blocking (one swapped for a FIFO since it was listed must not hang the
/// watcher), and must still be a regular file once open.
fn same_bytes(a: &Path, b: &Path) -> io::Result<bool> {
    use std::io::Read;
    let open = |p: &Path| {
        OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC | libc::O_NONBLOCK)
            .open(p)
    };
    let (mut fa, mut fb) = (open(a)?, open(b)?);
    let (ma, mb) = (fa.metadata()?, fb.metadata()?);
    if !(ma.is_file() && mb.is_file()) {
        return Ok(false);
    }
    if (ma.dev(), ma.ino()) == (mb.dev(), mb.ino()) {
        return Ok(true);
    }
    if ma.len() != mb.len() {
        return Ok(false);
    }
    let (mut ba, mut bb) = (vec![0u8; 1 << 20], vec![0u8; 1 << 20]);
    loop {
        let n = fa.read(&mut ba)?;
        if n == 0 {
            return Ok(fb.read(&mut bb[..1])? == 0);
        }
        fb.read_exact(&mut bb[..n])?;
        if ba[..n] != bb[..n] {
            return Ok(false);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::keep_best::{keep, lookup};
    use crate::store::safe_fs::TEMP_SUFFIX;

    fn write(path: &Path, bytes: &[u8]) {
        fs::create_dir_all(path.parent().unwrap()).unwrap();
        fs::write(path, bytes).unwrap();
    }

    /// `diffmon resume` puts a kept folder back where rotation deleted it (its files linked to
    /// the kept ones) and never over anything; the watcher recognizes it, and a `cp -r` of it
    /// (new times), as the kept checkpoint, but not a folder whose bytes differ.
    #[test]
    fn a_kept_folder_is_restored_and_its_copies_are_recognized_by_content() {
        let run = tempfile::tempdir().unwrap();
        let state = run.path().join("state");
        fs::create_dir(&state).unwrap();
        let ck = run.path().join("checkpoint-300");
        write(&ck.join("model.safetensors"), b"model");
        write(&ck.join("optimizer.bin"), b"adam");
        keep(&state, &ck, None).unwrap();
        assert!(!is_copy_of_kept(&state, &run.path().join("checkpoint-301")));
        fs::remove_dir_all(&ck).unwrap();
        let kept = lookup(&state, &ck).unwrap();
        let done = restore(&kept, &ck).unwrap();
        assert_eq!((done.linked, done.copied), (2, 0));
        assert_eq!(
            fs::metadata(ck.join("model.safetensors")).unwrap().ino(),
            fs::metadata(kept.join("model.safetensors")).unwrap().ino()
        );
        assert!(is_copy_of_kept(&state, &ck));
        // Never over what is there (even an empty folder), and nothing left behind.
        let e = restore(&kept, &ck).unwrap_err();
        assert!(
            matches!(&e, KeepBestError::Io { source, .. } if source.kind() == io::ErrorKind::AlreadyExists),
            "{e}"
        );
        let leftovers = fs::read_dir(run.path())
            .unwrap()
            .filter(|e| {
                e.as_ref()
                    .unwrap()
                    .file_name()
                    .to_string_lossy()
                    .ends_with(TEMP_SUFFIX)
            })
            .count();
        assert_eq!(leftovers, 0);
        // A copy with other times is the same checkpoint; other bytes of the same size are not.
        fs::remove_dir_all(&ck).unwrap();
        write(&ck.join("model.safetensors"), b"model");
        write(&ck.join("optimizer.bin"), b"adam");
        assert!(is_copy_of_kept(&state, &ck));
        write(&ck.join("optimizer.bin"), b"sgd!");
        assert!(!is_copy_of_kept(&state, &ck));
        write(&ck.join("optimizer.bin"), b"adam");
        write(&ck.join("extra"), b"");
        assert!(!is_copy_of_kept(&state, &ck));
    }

    /// A restore builds its copy under a temporary name in the run folder, which others may
    /// write: someone who swaps that folder for a link to a folder of theirs (atomically,
    /// `RENAME_EXCHANGE`, while it is filled) never has diffmon make, link or chmod anything in
    /// their folder, and what lands at the checkpoint's path is either the restored copy or an
    /// error saying it was replaced.
    #[test]
    fn a_restore_is_never_written_through_a_swapped_folder() {
        use std::ffi::CString;
        use std::os::unix::ffi::OsStrExt;
        use std::os::unix::fs::PermissionsExt;
        use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
        let run = tempfile::tempdir().unwrap();
        let state = run.path().join("state");
        fs::create_dir(&state).unwrap();
        let victim = tempfile::tempdir().unwrap();
        fs::set_permissions(victim.path(), fs::Permissions::from_mode(0o700)).unwrap();
        let ck = run.path().join("checkpoint-160");
        for i in 0..3000 {
            write(&ck.join(format!("shard-{i}")), b"w");
        }
        keep(&state, &ck, None).unwrap();
        let kept = lookup(&state, &ck).unwrap();
        let (stop, swaps) = (AtomicBool::new(false), AtomicUsize::new(0));
        let link = run.path().join("link");
        std::os::unix::fs::symlink(victim.path(), &link).unwrap();
        std::thread::scope(|scope| {
            scope.spawn(|| {
                while !stop.load(Ordering::Relaxed) {
                    let Ok(entries) = fs::read_dir(run.path()) else {
                        continue;
                    };
                    for e in entries.flatten() {
                        let name = e.file_name();
                        if !name.as_bytes().ends_with(TEMP_SUFFIX.as_bytes()) {
                            continue;
                        }
                        let (a, b) = (
                            CString::new(e.path().as_os_str().as_bytes()).unwrap(),
                            CString::new(link.as_os_str().as_bytes()).unwrap(),
                        );
                        // SAFETY: two NUL-terminated paths.
                        let rc = unsafe {
                            libc::renameat2(
                                libc::AT_FDCWD,
                                a.as_ptr(),
                                libc::AT_FDCWD,
                                b.as_ptr(),
                                libc::RENAME_EXCHANGE,
                            )
                        };
                        if rc == 0 {
                            swaps.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }
            });
            for _ in 0..10 {
                let _ = fs::remove_dir_all(&ck).or_else(|_| fs::remove_file(&ck));
                match restore(&kept, &ck) {
                    Ok(_) => assert!(fs::symlink_metadata(&ck).unwrap().is_dir()),
                    Err(e) => assert!(
                        matches!(
                            e,
                            KeepBestError::Replaced { .. }
                                | KeepBestError::Io { .. }
                                | KeepBestError::Link { .. }
                        ),
                        "{e}"
                    ),
                }
                if swaps.load(Ordering::Relaxed) >= 3 {
                    break;
                }
            }
            stop.store(true, Ordering::Relaxed);
        });
        assert!(
            swaps.load(Ordering::Relaxed) > 0,
            "the folder was never swapped: the test tried nothing"
        );
        let mode = fs::metadata(victim.path()).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o700, "the other folder was chmod-ed");
        assert_eq!(
            fs::read_dir(victim.path()).unwrap().count(),
            0,
            "something was made in the other folder"
        );
    }

    /// A restored folder has the modes the training job gave its folders and files, not the
    /// 0700/0600 of diffmon's own state folder (issue #45).
    #[test]
    fn a_restored_folder_has_the_training_jobs_modes() {
        use std::os::unix::fs::PermissionsExt;
        let run = tempfile::tempdir().unwrap();
        let state = run.path().join("state");
        fs::create_dir(&state).unwrap();
        let ck = run.path().join("checkpoint-40");
        write(&ck.join("unet/model.safetensors"), b"model");
        write(&ck.join("random_states_0.pkl"), b"rng");
        let set = |p: &Path, mode: u32| {
            fs::set_permissions(p, fs::Permissions::from_mode(mode)).unwrap();
        };
        set(&ck.join("unet/model.safetensors"), 0o640);
        set(&ck.join("unet"), 0o751);
        set(&ck, 0o750);
        keep(&state, &ck, None).unwrap();
        fs::remove_dir_all(&ck).unwrap();
        restore(&lookup(&state, &ck).unwrap(), &ck).unwrap();
        let mode = |p: &Path| fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&ck), 0o750);
        assert_eq!(mode(&ck.join("unet")), 0o751);
        assert_eq!(mode(&ck.join("unet/model.safetensors")), 0o640);
        // The state folder's own best/ stays private.
        assert_eq!(mode(&state.join(KEPT_DIR)), 0o700);
    }

    /// A file swapped for a FIFO between the listing and the comparison is not the same file,
    /// and opening it does not block (the watcher would hang on a FIFO nobody writes).
    #[test]
    fn a_fifo_is_never_waited_on() {
        let dir = tempfile::tempdir().unwrap();
        let (file, fifo) = (dir.path().join("f"), dir.path().join("p"));
        fs::write(&file, b"weights").unwrap();
        let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        assert!(!same_bytes(&file, &fifo).unwrap());
        assert!(same_bytes(&file, &file).unwrap());
    }
}
