//! The daemon's own folder, `state_dir` (docs/design.md §10): opened once, without following a
//! link, and used through that handle.
//!
//! Whoever can write `run.dir` can replace `<run.dir>/.diffmon` by a link to another folder, or
//! plant a folder of their own there. So the daemon:
//!
//! - **opens it without following links**: the components below `run.dir` are walked one by one
//!   with `O_NOFOLLOW | O_DIRECTORY` (and made with `mkdirat`, mode 0700); a link among them is
//!   refused at start, naming it;
//! - **refuses a folder that is not its own**: not owned by the daemon's user, or writable by
//!   group or others (someone else could plant files in it), with the reason and the fix; a
//!   folder of its own with other bits (0755, as earlier versions made it) is tightened to
//!   0700;
//! - **uses it through the handle**: every path the daemon writes is under [`StateDir::path`],
//!   `/proc/self/fd/<n>`, which the kernel resolves to the folder that was opened, wherever it is
//!   now and whatever has been put at its old name since (no path re-resolution). Without
//!   `/proc` the configured path is used, with a warning;
//! - **follows its folder** ([`StateDir::follow`]): when the run folder was replaced under it
//!   (`mv run run.old; mkdir run`), the state folder is moved back into the new run folder, so the
//!   journal, the lock and the outbox stay where the next start looks; when it was deleted, it is
//!   made again at its name (with the same checks) once there is something to write (not while
//!   someone may still be deleting it), and the handle switched to it in place, so the history is
//!   re-created in it from memory. When neither can be done, it says why, once.
//!
//! Child processes (Slurm jobs) cannot use `/proc/self/fd/<n>` of this process: they are given
//! [`StateDir::shown`], the configured path.

use std::ffi::OsString;
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Component, Path, PathBuf};
use std::sync::Mutex;

#[derive(Debug, thiserror::Error)]
pub enum StateDirError {
    #[error(
        "{path}: the state folder is a symbolic link; refusing to follow it (someone who can write the run folder may have planted it): remove the link, or set state_dir to a real folder"
    )]
    Link { path: PathBuf },
    #[error(
        "{path}: the state folder is owned by uid {owner}, not by this daemon's user (uid {me}): another user made it; check its contents, then remove it or give it to uid {me}, or set state_dir elsewhere"
    )]
    NotOwned { path: PathBuf, owner: u32, me: u32 },
    #[error(
        "{path}: the state folder is writable by {who} (mode {mode:04o}): others could plant files the daemon would trust; check its contents, then `chmod 700` it"
    )]
    Writable {
        path: PathBuf,
        mode: u32,
        who: &'static str,
    },
    #[error("{path}: state_dir must be a plain path below its parent (no `..`)")]
    BadPath { path: PathBuf },
    #[error("{path}: cannot open the state folder: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
}

/// Called when the state folder was made again after it was deleted.
pub type OnRemade = Box<dyn Fn() + Send + Sync>;

/// The state folder, held open (module docs).
pub struct StateDir {
    /// The configured path (absolute where it could be made so).
    real: PathBuf,
    /// Where the walk without links starts: `run.dir` when the state folder is inside it, else
    /// the state folder's parent.
    base: PathBuf,
    /// The components below `base`.
    below: Vec<OsString>,
    /// The open folder; its number never changes (a re-made folder is put in its place with
    /// `dup3`), so paths made from [`StateDir::path`] stay valid.
    fd: OwnedFd,
    /// `/proc/self/fd/<n>`, or the configured path without `/proc`.
    path: PathBuf,
    /// What [`StateDir::follow`] said last, so it says it once.
    said: Mutex<Option<String>>,
    /// What to do after the folder was made again ([`StateDir::on_remade`]).
    remade: Mutex<Vec<OnRemade>>,
}

impl std::fmt::Debug for StateDir {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StateDir")
            .field("real", &self.real)
            .field("path", &self.path)
            .finish()
    }
}

/// What [`StateDir::follow`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Followed {
    /// The folder is where it was.
    InPlace,
    /// The run folder was replaced: the state folder was moved back from `from` into it.
    MovedBack { from: PathBuf },
    /// The folder was deleted, and it was not asked to make it again.
    Deleted,
    /// The folder had been deleted: made again at its name, empty.
    Remade,
    /// It could not be put back (the message says why); the daemon goes on in the folder it holds.
    Elsewhere(String),
}

impl StateDir {
    /// Opens (making what is missing) the state folder `state_dir` of the run in `run_dir`, with
    /// the checks of the module docs.
    pub fn open(state_dir: &Path, run_dir: &Path) -> Result<StateDir, StateDirError> {
        let real = std::path::absolute(state_dir).unwrap_or_else(|_| state_dir.to_path_buf());
        let run_dir = std::path::absolute(run_dir).unwrap_or_else(|_| run_dir.to_path_buf());
        let (base, rest) = match real.strip_prefix(&run_dir) {
            Ok(rest) if !rest.as_os_str().is_empty() => (run_dir.clone(), rest.to_path_buf()),
            _ => match (real.parent(), real.file_name()) {
                (Some(p), Some(n)) => (p.to_path_buf(), PathBuf::from(n)),
                _ => return Err(StateDirError::BadPath { path: real }),
            },
        };
        let mut below = Vec::new();
        for c in rest.components() {
            match c {
                Component::Normal(n) => below.push(n.to_os_string()),
                Component::CurDir => {}
                _ => return Err(StateDirError::BadPath { path: real }),
            }
        }
        // The base is the user's own choice (links there are theirs); made at start as before.
        std::fs::create_dir_all(&base).map_err(|source| StateDirError::Io {
            path: base.clone(),
            source,
        })?;
        let fd = walk(&real, &base, &below)?;
        let path = handle_path(&fd).unwrap_or_else(|| {
            tracing::warn!(state = %crate::store::safe_fs::untrusted(&real), "/proc/self/fd is not available: the state folder is used by its path, which someone who can write the run folder could replace while the daemon runs");
            real.clone()
        });
        Ok(StateDir {
            real,
            base,
            below,
            fd,
            path,
            said: Mutex::new(None),
            remade: Mutex::new(Vec::new()),
        })
    }

    /// Runs `f` each time the folder is made again after it was deleted (the files other stages
    /// keep in memory are written there again: the alerter's key and ledger). The history
    /// re-creates its journal itself, at its next write.
    pub fn on_remade(&self, f: OnRemade) {
        self.remade
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(f);
    }

    /// The path every write to the state folder goes through (module docs).
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The configured path, for messages and child processes.
    pub fn shown(&self) -> &Path {
        &self.real
    }

    /// Puts the state folder back at its configured place when the run folder was replaced,
    /// and (with `remake`) makes it again when it was deleted (module docs); says what it did
    /// once, at WARN. Cheap when nothing changed (two `stat`s). The watcher calls it at each
    /// scan without `remake` (a folder being deleted is not fought over); the recorder with
    /// `remake`, when it has something to write.
    pub fn follow(&self, remake: bool) -> Followed {
        let mut said = self.said.lock().unwrap_or_else(|e| e.into_inner());
        let followed = self.try_follow(remake);
        let shown = crate::store::safe_fs::untrusted(&self.real);
        match &followed {
            Followed::InPlace => *said = None,
            Followed::Deleted => {}
            Followed::MovedBack { from } => tracing::warn!(
                state = %shown,
                from = %crate::store::safe_fs::untrusted(from),
                "the run folder was replaced while the daemon ran: its state folder (history, lock, outbox) was moved back into the new one"
            ),
            Followed::Remade => {
                tracing::warn!(
                    state = %shown,
                    "the state folder was deleted while the daemon ran: made again; the history is re-created in it from memory"
                );
                for f in self.remade.lock().unwrap_or_else(|e| e.into_inner()).iter() {
                    f();
                }
            }
            Followed::Elsewhere(why) => {
                if said.as_deref() != Some(why.as_str()) {
                    tracing::warn!(state = %shown, "{why}");
                    *said = Some(why.clone());
                }
            }
        }
        followed
    }

    fn try_follow(&self, remake: bool) -> Followed {
        let Ok(ours) = fstat(&self.fd) else {
            return Followed::InPlace;
        };
        let there = std::fs::symlink_metadata(&self.real);
        if let Ok(m) = &there
            && (m.dev(), m.ino()) == (ours.st_dev, ours.st_ino)
        {
            return Followed::InPlace;
        }
        if self.path == self.real {
            return Followed::Elsewhere(
                "the state folder is not the one the daemon opened, and without /proc it cannot be followed".into(),
            );
        }
        if ours.st_nlink == 0 && !remake {
            return Followed::Deleted;
        }
        let parent = crate::store::safe_fs::parent(&self.real);
        if !parent.is_dir() {
            return Followed::Elsewhere(format!(
                "the state folder's parent {} is gone; waiting for it to come back",
                crate::store::safe_fs::untrusted(parent)
            ));
        }
        match there {
            Ok(_) => Followed::Elsewhere(format!(
                "something else is now at the state folder's name (another daemon's folder, or one planted): this daemon keeps its state in the folder it opened, now at {}; stop the other one, then restart this one",
                self.current().map_or("an unknown place".into(), |p| {
                    crate::store::safe_fs::untrusted(&p)
                })
            )),
            Err(e) if e.kind() != io::ErrorKind::NotFound => {
                Followed::Elsewhere(format!("cannot look at the state folder: {e}"))
            }
            // Deleted: made again, and put in the place of the old handle.
            Err(_) if ours.st_nlink == 0 => match walk(&self.real, &self.base, &self.below) {
                Ok(fresh) => {
                    // SAFETY: both descriptors are open and owned here; dup3 atomically makes
                    // the held number refer to the fresh folder, then the spare is closed.
                    let r = unsafe {
                        libc::dup3(fresh.as_raw_fd(), self.fd.as_raw_fd(), libc::O_CLOEXEC)
                    };
                    if r < 0 {
                        return Followed::Elsewhere(format!(
                            "cannot use the re-made state folder: {}",
                            io::Error::last_os_error()
                        ));
                    }
                    Followed::Remade
                }
                Err(e) => Followed::Elsewhere(format!("cannot make the state folder again: {e}")),
            },
            // Moved away with its run folder: moved back, never over anything.
            Err(_) => {
                let Some(from) = self.current() else {
                    return Followed::Elsewhere("cannot tell where the state folder went".into());
                };
                match rename_noreplace(&from, &self.real) {
                    Ok(()) => {
                        crate::store::safe_fs::sync_dir(parent);
                        Followed::MovedBack { from }
                    }
                    Err(e) => Followed::Elsewhere(format!(
                        "the run folder was replaced while the daemon ran, and its state folder cannot be moved back from {} ({e}): the daemon goes on writing there; move it back by hand while the daemon is stopped",
                        crate::store::safe_fs::untrusted(&from)
                    )),
                }
            }
        }
    }

    /// Where the held folder is now, as the kernel names it.
    fn current(&self) -> Option<PathBuf> {
        std::fs::read_link(&self.path)
            .ok()
            .filter(|p| p.is_absolute())
    }
}

/// Opens `base` (following links: the user's choice), then each of `below` without following
/// links, making the missing ones (0700), and checks the last one is the daemon's own.
fn walk(real: &Path, base: &Path, below: &[OsString]) -> Result<OwnedFd, StateDirError> {
    let io_at = |path: &Path| {
        let path = path.to_path_buf();
        move |source: io::Error| StateDirError::Io { path, source }
    };
    let mut dir: OwnedFd = File::open(base).map_err(io_at(base))?.into();
    let mut at = base.to_path_buf();
    for name in below {
        at.push(name);
        let c = std::ffi::CString::new(name.as_bytes()).map_err(|_| StateDirError::BadPath {
            path: real.to_path_buf(),
        })?;
        // SAFETY: a valid descriptor and a NUL-terminated name.
        if unsafe { libc::mkdirat(dir.as_raw_fd(), c.as_ptr(), 0o700) } != 0 {
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::AlreadyExists {
                return Err(io_at(&at)(e));
            }
        }
        let flags = libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC;
        // SAFETY: as above; the result is checked before it is owned.
        let fd = unsafe { libc::openat(dir.as_raw_fd(), c.as_ptr(), flags) };
        if fd < 0 {
            let e = io::Error::last_os_error();
            let is_link = std::fs::symlink_metadata(&at).is_ok_and(|m| m.file_type().is_symlink());
            return Err(if is_link {
                StateDirError::Link { path: at }
            } else {
                io_at(&at)(e)
            });
        }
        // SAFETY: a descriptor just opened, owned by nobody else.
        dir = unsafe { OwnedFd::from_raw_fd(fd) };
    }
    check_own(&dir, &at)?;
    Ok(dir)
}

/// Refuses a folder that is not the daemon's own; tightens one of its own to 0700.
fn check_own(dir: &OwnedFd, path: &Path) -> Result<(), StateDirError> {
    let st = fstat(dir).map_err(|source| StateDirError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    // SAFETY: geteuid cannot fail.
    let me = unsafe { libc::geteuid() };
    if st.st_uid != me {
        return Err(StateDirError::NotOwned {
            path: path.to_path_buf(),
            owner: st.st_uid,
            me,
        });
    }
    let mode = st.st_mode & 0o7777;
    if mode & 0o022 != 0 {
        return Err(StateDirError::Writable {
            path: path.to_path_buf(),
            mode,
            who: if mode & 0o002 != 0 {
                "anyone"
            } else {
                "its group"
            },
        });
    }
    if mode & 0o077 != 0 {
        let file = File::from(dir.try_clone().map_err(|source| StateDirError::Io {
            path: path.to_path_buf(),
            source,
        })?);
        file.set_permissions(std::fs::Permissions::from_mode(0o700))
            .map_err(|source| StateDirError::Io {
                path: path.to_path_buf(),
                source,
            })?;
        tracing::info!(state = %crate::store::safe_fs::untrusted(path), "the state folder was readable by others (mode {mode:04o}): made 0700");
    }
    Ok(())
}

fn fstat(fd: &OwnedFd) -> io::Result<libc::stat> {
    // SAFETY: a zeroed stat is a valid out-buffer; the descriptor is open.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(st)
}

/// `/proc/self/fd/<n>`, when it resolves to the held folder.
fn handle_path(fd: &OwnedFd) -> Option<PathBuf> {
    let raw: RawFd = fd.as_raw_fd();
    let path = PathBuf::from(format!("/proc/self/fd/{raw}"));
    let st = fstat(fd).ok()?;
    let m = std::fs::metadata(&path).ok()?;
    ((m.dev(), m.ino()) == (st.st_dev, st.st_ino)).then_some(path)
}

/// `rename(from, to)` that fails rather than replace anything at `to`.
fn rename_noreplace(from: &Path, to: &Path) -> io::Result<()> {
    let c = |p: &Path| {
        std::ffi::CString::new(p.as_os_str().as_bytes())
            .map_err(|_| io::Error::other("a NUL in the path"))
    };
    let (from, to) = (c(from)?, c(to)?);
    // SAFETY: NUL-terminated paths; AT_FDCWD.
    let r = unsafe {
        libc::renameat2(
            libc::AT_FDCWD,
            from.as_ptr(),
            libc::AT_FDCWD,
            to.as_ptr(),
            libc::RENAME_NOREPLACE,
        )
    };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;

    fn mode(p: &Path) -> u32 {
        fs::metadata(p).unwrap().mode() & 0o777
    }

    #[test]
    fn a_linked_state_folder_is_refused_and_its_target_untouched() {
        let d = tempfile::tempdir().unwrap();
        let (run, victim) = (d.path().join("run"), d.path().join("victim"));
        fs::create_dir_all(victim.join("best")).unwrap();
        fs::write(victim.join("best/keep"), "precious").unwrap();
        fs::create_dir(&run).unwrap();
        std::os::unix::fs::symlink(&victim, run.join(".diffmon")).unwrap();
        let e = StateDir::open(&run.join(".diffmon"), &run).unwrap_err();
        assert!(matches!(e, StateDirError::Link { .. }), "{e}");
        assert!(e.to_string().contains("symbolic link"), "{e}");
        // A link among the components below the run folder too.
        std::os::unix::fs::symlink(&victim, run.join("sub")).unwrap();
        let e = StateDir::open(&run.join("sub/state"), &run).unwrap_err();
        assert!(matches!(e, StateDirError::Link { .. }), "{e}");
        assert!(!victim.join("state").exists());
        assert_eq!(
            fs::read_to_string(victim.join("best/keep")).unwrap(),
            "precious"
        );
    }

    #[test]
    fn the_folder_is_made_0700_an_old_0755_one_is_tightened_a_writable_one_refused() {
        let d = tempfile::tempdir().unwrap();
        let run = d.path().join("run");
        let s = StateDir::open(&run.join(".diffmon"), &run).unwrap();
        assert_eq!(mode(&run.join(".diffmon")), 0o700);
        assert!(
            s.path().starts_with("/proc/self/fd/"),
            "{}",
            s.path().display()
        );
        drop(s);
        fs::set_permissions(run.join(".diffmon"), fs::Permissions::from_mode(0o755)).unwrap();
        StateDir::open(&run.join(".diffmon"), &run).unwrap();
        assert_eq!(mode(&run.join(".diffmon")), 0o700);
        for (m, who) in [(0o777, "anyone"), (0o770, "its group")] {
            fs::set_permissions(run.join(".diffmon"), fs::Permissions::from_mode(m)).unwrap();
            let e = StateDir::open(&run.join(".diffmon"), &run)
                .unwrap_err()
                .to_string();
            assert!(
                e.contains(&format!("writable by {who}")) && e.contains("chmod 700"),
                "{e}"
            );
        }
    }

    #[test]
    fn a_folder_of_another_user_is_refused() {
        // SAFETY: geteuid cannot fail.
        if unsafe { libc::geteuid() } != 0 {
            return; // only root can give a folder away
        }
        let d = tempfile::tempdir().unwrap();
        let run = d.path().join("run");
        fs::create_dir_all(run.join(".diffmon")).unwrap();
        std::os::unix::fs::chown(run.join(".diffmon"), Some(65534), Some(65534)).unwrap();
        let e = StateDir::open(&run.join(".diffmon"), &run)
            .unwrap_err()
            .to_string();
        assert!(e.contains("owned by uid 65534"), "{e}");
    }

    #[test]
    fn writes_go_to_the_opened_folder_whatever_is_put_at_its_name() {
        let d = tempfile::tempdir().unwrap();
        let run = d.path().join("run");
        let victim = d.path().join("victim");
        fs::create_dir(&victim).unwrap();
        let s = StateDir::open(&run.join(".diffmon"), &run).unwrap();
        // Swapped for a link while running.
        fs::rename(run.join(".diffmon"), d.path().join("aside")).unwrap();
        std::os::unix::fs::symlink(&victim, run.join(".diffmon")).unwrap();
        fs::write(s.path().join("history.jsonl"), "x").unwrap();
        assert!(d.path().join("aside/history.jsonl").exists());
        assert_eq!(fs::read_dir(&victim).unwrap().count(), 0);
        assert!(matches!(s.follow(true), Followed::Elsewhere(_)));
    }

    #[test]
    fn a_replaced_run_folder_gets_its_state_folder_back_and_a_deleted_one_is_remade() {
        let d = tempfile::tempdir().unwrap();
        let run = d.path().join("run");
        let s = StateDir::open(&run.join(".diffmon"), &run).unwrap();
        fs::write(s.path().join("lock"), "held").unwrap();
        assert_eq!(s.follow(true), Followed::InPlace);
        fs::rename(&run, d.path().join("run.old")).unwrap();
        fs::create_dir(&run).unwrap();
        let from = d.path().join("run.old/.diffmon").canonicalize().unwrap();
        assert_eq!(s.follow(true), Followed::MovedBack { from });
        assert_eq!(
            fs::read_to_string(run.join(".diffmon/lock")).unwrap(),
            "held"
        );
        assert!(!d.path().join("run.old/.diffmon").exists());
        // Deleted with its run folder, then the run folder is back: made again (when there is
        // something to write), same handle; a scan alone leaves it deleted.
        fs::remove_dir_all(&run).unwrap();
        assert!(
            matches!(s.follow(true), Followed::Elsewhere(_)),
            "no parent yet"
        );
        fs::create_dir(&run).unwrap();
        assert_eq!(s.follow(false), Followed::Deleted);
        assert!(!run.join(".diffmon").exists());
        assert_eq!(s.follow(true), Followed::Remade);
        fs::write(s.path().join("history.jsonl"), "again").unwrap();
        assert_eq!(
            fs::read_to_string(run.join(".diffmon/history.jsonl")).unwrap(),
            "again"
        );
        assert_eq!(mode(&run.join(".diffmon")), 0o700);
        assert_eq!(s.follow(true), Followed::InPlace);
        // A folder someone else put at the name is never replaced.
        fs::rename(&run, d.path().join("run.2")).unwrap();
        fs::create_dir_all(run.join(".diffmon")).unwrap();
        assert!(matches!(s.follow(true), Followed::Elsewhere(m) if m.contains("something else")));
        assert!(d.path().join("run.2/.diffmon/history.jsonl").exists());
    }
}
