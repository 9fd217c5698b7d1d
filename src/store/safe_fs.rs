//! Files the daemon writes where others may write too (`run.dir`, the state folder), and names it
//! did not choose (docs/design.md §10).
//!
//! - Temporary files are created exclusively (`O_CREAT|O_EXCL|O_NOFOLLOW`, mode 0600) under an
//!   unpredictable name `.<final name>.<random>.tmp` in the destination's folder, then renamed
//!   into place: a symlink planted at any name, guessed or not, is never followed (the open
//!   fails with `EEXIST` and another random name is drawn).
//! - The state folder is created with mode 0700.
//! - [`untrusted`] displays a file name from `run.dir` with its control characters escaped, so a
//!   name holding a newline cannot forge a log line.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

/// Suffix of every temporary file made by [`temp_file`].
pub const TEMP_SUFFIX: &str = ".tmp";

/// Is `name` a temporary file of [`temp_file`] for the file named `target` (or, with `None`,
/// for any file)? Also recognises the fixed and pid-based names of earlier versions
/// (`history.h5.tmp`, `.EARLY_STOP.tmp.<pid>.<n>`, `*.h5.tmp-<pid>`), so leftovers of either are
/// cleaned up.
pub fn is_temp_name(name: &str, target: Option<&str>) -> bool {
    match target {
        Some(t) => {
            let new = name
                .strip_prefix(&format!(".{t}."))
                .is_some_and(|rest| rest.ends_with(TEMP_SUFFIX));
            // `history.h5.tmp`, `<cache>.h5.tmp-<pid>`, `.EARLY_STOP.tmp.<pid>.<n>`.
            let old =
                name.starts_with(&format!("{t}.tmp")) || name.starts_with(&format!(".{t}.tmp."));
            new || old
        }
        None => name.starts_with('.') && (name.ends_with(TEMP_SUFFIX) || name.contains(".tmp.")),
    }
}

/// A new, empty temporary file for `path`, created exclusively (see the module docs) in
/// `path`'s folder. The caller renames it into place with [`persist`] or removes it.
pub fn temp_file(path: &Path) -> io::Result<(File, PathBuf)> {
    let dir = parent(path);
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = tempfile::Builder::new()
        .prefix(&format!(".{name}."))
        .suffix(TEMP_SUFFIX)
        .rand_bytes(12)
        .make_in(dir, |p| {
            OpenOptions::new()
                .write(true)
                .read(true)
                .create_new(true)
                .mode(0o600)
                .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
                .open(p)
        })?;
    // Keep the file: the caller decides between rename and removal.
    let (file, temp_path) = tmp.into_parts();
    let path = temp_path.keep().map_err(|e| e.error)?;
    Ok((file, path))
}

/// Renames the temporary file `tmp` (open as `file`) over `path` after `fsync`, and syncs the
/// folder. Fails, leaving `path` alone, when `tmp` is no longer the file that was created (it
/// was replaced in between).
pub fn persist(file: &File, tmp: &Path, path: &Path) -> io::Result<()> {
    file.sync_all()?;
    let mine = file.metadata()?;
    let there = fs::symlink_metadata(tmp)?;
    if (mine.dev(), mine.ino()) != (there.dev(), there.ino()) {
        return Err(io::Error::other(format!(
            "{} was replaced while it was written",
            tmp.display()
        )));
    }
    fs::rename(tmp, path)?;
    sync_dir(parent(path));
    Ok(())
}

/// Writes `bytes` to `path` atomically through an exclusive temporary file: readers see the old
/// content or the new one, never a part, and no planted link is followed.
pub fn atomic_write(path: &Path, bytes: &[u8]) -> io::Result<()> {
    let (mut file, tmp) = temp_file(path)?;
    let result = file
        .write_all(bytes)
        .and_then(|_| persist(&file, &tmp, path));
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result
}

/// Opens the file `path` to read it as a file of the state folder (or another file others may
/// plant): no link followed (`O_NOFOLLOW`), no wait on a FIFO (`O_NONBLOCK`), and a regular
/// file once open, else `InvalidData` naming what it is.
pub fn open_regular(path: &Path) -> io::Result<File> {
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(path)
        .map_err(|e| match e.raw_os_error() {
            Some(libc::ELOOP) => {
                io::Error::new(io::ErrorKind::InvalidData, "a symbolic link: not followed")
            }
            _ => e,
        })?;
    if !file.metadata()?.is_file() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "not a regular file (a FIFO, device or folder): not read",
        ));
    }
    Ok(file)
}

/// Reads the whole of `path`, opened by [`open_regular`], if it holds at most `max` bytes;
/// `InvalidData` when it holds more (nothing beyond `max + 1` bytes is read).
pub fn read_bounded(path: &Path, max: u64) -> io::Result<Vec<u8>> {
    use std::io::Read;
    let file = open_regular(path)?;
    let mut bytes = Vec::new();
    file.take(max.saturating_add(1)).read_to_end(&mut bytes)?;
    if bytes.len() as u64 > max {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("larger than {max} bytes: not read"),
        ));
    }
    Ok(bytes)
}

/// A private random key of the state folder (32 bytes in `path`, mode 0600; `what` names it in
/// messages): read, or made at the first start, and again when it is unreadable or not 32 bytes
/// (`lost` says what that costs). One that others can read (made so by hand, or copied) is made
/// private, as the state folder is, before it is used.
pub fn private_key(path: &Path, what: &str, lost: &str) -> io::Result<[u8; 32]> {
    use std::io::Read;
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let read = open_regular(path).and_then(|f| {
        let mode = f.metadata()?.mode() & 0o777;
        if mode & 0o077 != 0 {
            f.set_permissions(std::fs::Permissions::from_mode(0o600))?;
            tracing::warn!(path = %untrusted(path),
                "{what} was readable by others (mode {mode:04o}): made 0600");
        }
        let mut bytes = Vec::new();
        f.take(64).read_to_end(&mut bytes)?;
        Ok(bytes)
    });
    match read.map(<[u8; 32]>::try_from) {
        Ok(Ok(key)) => return Ok(key),
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        other => tracing::warn!(path = %untrusted(path),
            "{what} is unreadable or not 32 bytes ({}); making a new one: {lost}",
            match other { Err(e) => e.to_string(), _ => "wrong length".into() }),
    }
    let key: [u8; 32] = rand::random();
    atomic_write(path, &key)?;
    Ok(key)
}

/// Renames `from` to `to` unless `to` exists (`renameat2(RENAME_NOREPLACE)`): never replaces
/// a file or folder, not even an empty folder; fails with `AlreadyExists` then.
pub fn rename_noreplace(from: &Path, to: &Path) -> io::Result<()> {
    use std::ffi::CString;
    use std::os::unix::ffi::OsStrExt;
    let c = |p: &Path| {
        CString::new(p.as_os_str().as_bytes()).map_err(|_| io::Error::other("a NUL in the path"))
    };
    let (a, b) = (c(from)?, c(to)?);
    // SAFETY: both are valid NUL-terminated strings that outlive the call.
    let rc = unsafe {
        libc::renameat2(
            libc::AT_FDCWD,
            a.as_ptr(),
            libc::AT_FDCWD,
            b.as_ptr(),
            libc::RENAME_NOREPLACE,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Opens `path` to append, creating it with mode 0600: never through a link (`O_NOFOLLOW`),
/// never waiting on a FIFO (`O_NONBLOCK`). The journals and the files lines are set aside in.
pub fn open_private_append(path: &Path) -> io::Result<File> {
    fs::OpenOptions::new()
        .create(true)
        .append(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(path)
}

/// Creates `dir` (and missing parents) with mode 0700; an existing folder is left as it is.
pub fn create_private_dir(dir: &Path) -> io::Result<()> {
    fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
}

/// The folder of `path` (`.` for a bare name).
pub fn parent(path: &Path) -> &Path {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    }
}

/// Best effort: makes a rename or removal durable on filesystems that support syncing folders.
pub fn sync_dir(dir: &Path) {
    if let Ok(d) = File::open(dir) {
        let _ = d.sync_all();
    }
}

/// Removes the leftover temporary files for `target` in `dir` (a crash mid-write); returns how
/// many. A leftover that is a symlink is removed as a link: its target is never touched.
pub fn remove_leftover_temps(dir: &Path, target: &str) -> usize {
    let Ok(entries) = fs::read_dir(dir) else {
        return 0;
    };
    let mut removed = 0;
    for e in entries.flatten() {
        let name = e.file_name();
        if is_temp_name(&name.to_string_lossy(), Some(target)) && fs::remove_file(e.path()).is_ok()
        {
            removed += 1;
        }
    }
    removed
}

/// `text` with each `/proc/self/fd/<n>` (the daemon's held state folder, `crate::store::state_dir`)
/// replaced by where that folder is now, so messages name a path a person can use.
pub fn unproc(text: &str) -> String {
    const PREFIX: &str = "/proc/self/fd/";
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(i) = rest.find(PREFIX) {
        out.push_str(&rest[..i]);
        let after = &rest[i + PREFIX.len()..];
        let digits = after.len() - after.trim_start_matches(|c: char| c.is_ascii_digit()).len();
        let held = &rest[i..i + PREFIX.len() + digits];
        match fs::read_link(held) {
            Ok(real) if digits > 0 && real.is_absolute() => out.push_str(&real.to_string_lossy()),
            _ => out.push_str(held),
        }
        rest = &after[digits..];
    }
    out.push_str(rest);
    out
}

/// `path` for logs, with control characters (newline, escape, ...) escaped as `\n`, `\u{1b}`,
/// and bytes that are not UTF-8 shown as `\xNN`: names in `run.dir` are chosen by whoever
/// writes there. A path in the held state folder is shown where the folder is ([`unproc`]).
pub fn untrusted(path: &Path) -> String {
    use std::os::unix::ffi::OsStrExt;
    let shown;
    let path = match path.to_str() {
        Some(p) if p.starts_with("/proc/self/fd/") => {
            shown = PathBuf::from(unproc(p));
            &shown
        }
        _ => path,
    };
    let bytes = path.as_os_str().as_bytes();
    let mut out = String::with_capacity(bytes.len());
    for chunk in bytes.utf8_chunks() {
        for c in chunk.valid().chars() {
            if c.is_control() {
                out.extend(c.escape_default());
            } else {
                out.push(c);
            }
        }
        for b in chunk.invalid() {
            out.push_str(&format!("\\x{b:02x}"));
        }
    }
    out
}

/// [`untrusted`] for a message that may quote such names (an error naming the file).
pub fn untrusted_text(text: &str) -> String {
    unproc(text)
        .chars()
        .flat_map(|c| {
            let escaped: Vec<char> = if c.is_control() {
                c.escape_default().collect()
            } else {
                vec![c]
            };
            escaped
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn temp_files_are_exclusive_random_and_never_follow_links() {
        let dir = tempfile::tempdir().unwrap();
        let victim = dir.path().join("victim");
        fs::write(&victim, "precious").unwrap();
        let target = dir.path().join("out.json");
        // Links at the old predictable names.
        for old in [
            "out.json.tmp",
            ".out.json.tmp.0.0",
            &format!(".out.json.tmp.{}.0", std::process::id()),
        ] {
            std::os::unix::fs::symlink(&victim, dir.path().join(old)).unwrap();
        }
        let (a, pa) = temp_file(&target).unwrap();
        let (_b, pb) = temp_file(&target).unwrap();
        assert_ne!(pa, pb, "temporary names repeat");
        let name = pa.file_name().unwrap().to_str().unwrap();
        assert!(is_temp_name(name, Some("out.json")), "{name}");
        assert!(is_temp_name(name, None), "{name}");
        assert_eq!(
            a.metadata().unwrap().mode() & 0o777,
            0o600,
            "temporary file readable by others"
        );
        // A link planted at a name the helper then draws is refused, not followed: simulate by
        // opening the same way at a link.
        let planted = dir.path().join(".out.json.guess.tmp");
        std::os::unix::fs::symlink(&victim, &planted).unwrap();
        let err = OpenOptions::new()
            .write(true)
            .create_new(true)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&planted)
            .unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::AlreadyExists);
        atomic_write(&target, b"new").unwrap();
        assert_eq!(fs::read(&target).unwrap(), b"new");
        assert_eq!(fs::read_to_string(&victim).unwrap(), "precious");
        // Leftovers (ours and the old names) are removed as links, the victim stays.
        let _ = fs::remove_file(&pa);
        assert!(remove_leftover_temps(dir.path(), "out.json") >= 4);
        assert_eq!(fs::read_to_string(&victim).unwrap(), "precious");
        assert!(target.exists());
    }

    #[test]
    fn persist_refuses_a_swapped_temporary_file() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("h.h5");
        let (file, tmp) = temp_file(&target).unwrap();
        fs::remove_file(&tmp).unwrap();
        fs::write(&tmp, "swapped").unwrap();
        assert!(persist(&file, &tmp, &target).is_err());
        assert!(!target.exists());
    }

    #[test]
    fn private_dir_is_0700() {
        let dir = tempfile::tempdir().unwrap();
        let state = dir.path().join("a/.diffmon");
        create_private_dir(&state).unwrap();
        assert_eq!(fs::metadata(&state).unwrap().mode() & 0o777, 0o700);
    }

    #[test]
    fn paths_in_a_held_folder_are_shown_where_the_folder_is() {
        let dir = tempfile::tempdir().unwrap();
        let held = File::open(dir.path()).unwrap();
        use std::os::fd::AsRawFd;
        let at = format!("/proc/self/fd/{}", held.as_raw_fd());
        let real = dir.path().canonicalize().unwrap();
        assert_eq!(
            unproc(&format!("{at}/history.jsonl: no space")),
            format!("{}/history.jsonl: no space", real.display())
        );
        assert_eq!(
            untrusted(&Path::new(&at).join("lock")),
            real.join("lock").display().to_string()
        );
        assert_eq!(
            unproc("/proc/self/fd/x and /proc/self/fd/"),
            "/proc/self/fd/x and /proc/self/fd/"
        );
    }

    #[test]
    fn untrusted_names_are_escaped() {
        use std::os::unix::ffi::OsStrExt;
        let p = Path::new("/r/ckpt_7\nERROR forged\x1b[31m.pt");
        let shown = untrusted(p);
        assert_eq!(shown, "/r/ckpt_7\\nERROR forged\\u{1b}[31m.pt");
        assert!(!shown.chars().any(char::is_control));
        let bad = Path::new(std::ffi::OsStr::from_bytes(b"/r/a\xffb.pt"));
        assert_eq!(untrusted(bad), "/r/a\\xffb.pt");
    }
}
