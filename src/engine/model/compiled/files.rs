//! The files of a compiled package (docs/design.md §11, "The compiled network"), checked before
//! libtorch opens them: each is the user's own, checked as it is opened ([`open_trusted`]), and
//! the archive holds only what libtorch may unpack ([`check_archive`]); and the unpacked copy a
//! failed load leaves behind, removed ([`remove_unpacked`]).

use std::fs::File;
use std::io::Read;
use std::path::Path;

/// Why each file of the compiled network is trusted only as the user's own, for the messages
/// of [`open_trusted`].
pub(super) const PACKAGE_IS: &str = "a package is native code that diffmon would run";
pub(super) const SIDECAR_IS: &str = "a sidecar says what memory the package is given";
pub(super) const CONSTANTS_ARE: &str = "a constants file holds what the package's kernels read";

/// Opens `path` to read it as a file of the compiled network, refusing one that another user
/// owns (root aside) or that group or others may write, as OpenSSH refuses a private key others
/// can read. The checks are of the open file, so what is checked is what is read, and what
/// libtorch loads ([`super::Package::load`]); no wait on a FIFO. `is` says why the file is
/// trusted that way, for the message.
pub(super) fn open_trusted(path: &Path, is: &str) -> Result<File, String> {
    use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(path)
        .map_err(|e| format!("cannot read it: {e}"))?;
    let meta = file
        .metadata()
        .map_err(|e| format!("cannot read it: {e}"))?;
    if !meta.is_file() {
        return Err("not a regular file".into());
    }
    let me = unsafe { libc::geteuid() };
    if meta.uid() != me && meta.uid() != 0 {
        return Err(format!(
            "owned by user {}, not by this user ({me}) or root: {is}, so only a file of yours is \
             loaded",
            meta.uid()
        ));
    }
    if meta.mode() & 0o022 != 0 {
        return Err(format!(
            "writable by {} (mode {:o}): {is}, so a file others can change is not loaded \
             (chmod go-w {})",
            if meta.mode() & 0o002 != 0 {
                "others"
            } else {
                "its group"
            },
            meta.mode() & 0o777,
            path.display()
        ));
    }
    Ok(file)
}

/// The most entries a package's archive may hold, and how many times its size it may unpack to
/// (torch writes its entries stored, about once its size): libtorch unpacks every entry of
/// its model into a temporary folder before it loads one.
const ARCHIVE_MAX_ENTRIES: usize = 100_000;
const ARCHIVE_MAX_EXPANSION: u64 = 8;
/// Where in the archive the model's files are, the shared object among them.
const MODEL_FOLDER: &[u8] = b"data/aotinductor/model/";
/// The files from which libtorch would compile a package without a shared object, running the
/// compiler they name (`package_cpp_only` packages; diffmon-export never writes one).
const BUILD_FILES: [&[u8]; 2] = [b"_compile_flags.json", b"_linker_flags.json"];
/// The Info-ZIP Unicode Path extra field: a second name for an entry, which Rust's `zip` reads
/// in place of the name and libtorch's zip reader (miniz) ignores.
const UNICODE_PATH_FIELD: u16 = 0x7075;

/// What libtorch will unpack, checked before it does, by the names libtorch reads: every name
/// stays inside its folder, no entry carries a second name, the whole is bounded, the model's
/// shared object is there and every shared object is an ELF file for this machine, and nothing
/// is there to compile one from (libtorch would run the compiler its files name: diffmon runs
/// no compiler). Returns the model's shared object's entry name.
pub(super) fn check_archive(file: &File) -> Result<String, String> {
    let len = file
        .metadata()
        .map_err(|e| format!("cannot read it: {e}"))?
        .len();
    let mut zip = zip::ZipArchive::new(file)
        .map_err(|e| format!("not a compiled package (a zip archive): {e}"))?;
    if zip.len() > ARCHIVE_MAX_ENTRIES {
        return Err(format!(
            "it holds {} entries, over {ARCHIVE_MAX_ENTRIES}",
            zip.len()
        ));
    }
    let shown = |name: &[u8]| crate::weights::quote(&String::from_utf8_lossy(name));
    let (mut total, mut objects, mut model) = (0u64, Vec::new(), None);
    let mut seen = std::collections::HashSet::new();
    for i in 0..zip.len() {
        let entry = zip
            .by_index_raw(i)
            .map_err(|e| format!("its entry {i} cannot be read: {e}"))?;
        let name = entry.name_raw();
        if has_field(entry.extra_data().unwrap_or_default(), UNICODE_PATH_FIELD) {
            return Err(format!(
                "its entry `{}` carries a second name (a Unicode Path field), which libtorch \
                 would not read",
                shown(name)
            ));
        }
        let outside = name.first() == Some(&b'/')
            || name.contains(&b'\\')
            || name.contains(&0)
            || name.split(|&b| b == b'/').any(|part| part == b"..");
        if outside {
            return Err(format!(
                "its entry `{}` would be unpacked outside libtorch's folder",
                shown(name)
            ));
        }
        // libtorch finds an entry by its name regardless of case.
        if !seen.insert(name.to_ascii_lowercase()) {
            return Err(format!(
                "its entry `{}` is there twice (as libtorch compares names)",
                shown(name)
            ));
        }
        if BUILD_FILES.iter().any(|b| name.ends_with(b)) {
            return Err(format!(
                "it holds `{}`, from which libtorch would compile it, running the compiler \
                 that file names: diffmon loads only a package's compiled shared object",
                shown(name)
            ));
        }
        total = total.saturating_add(entry.size());
        if name.to_ascii_lowercase().ends_with(b".so") {
            objects.push(i);
            if name.windows(MODEL_FOLDER.len()).any(|w| w == MODEL_FOLDER) {
                model = Some(String::from_utf8_lossy(name).into_owned());
            }
        }
    }
    if total > len.saturating_mul(ARCHIVE_MAX_EXPANSION) {
        return Err(format!(
            "it unpacks to {} MiB, over {ARCHIVE_MAX_EXPANSION} times its {} MiB",
            total >> 20,
            len >> 20
        ));
    }
    let Some(model) = model else {
        return Err(
            "it holds no compiled shared object (data/aotinductor/model/*.so): libtorch \
             would compile its C++ source, which diffmon does not do"
                .into(),
        );
    };
    let machine: Option<u16> = match std::env::consts::ARCH {
        "x86_64" => Some(62),
        "aarch64" => Some(183),
        _ => None,
    };
    for i in objects {
        let mut head = [0u8; 20];
        let read = zip
            .by_index(i)
            .map_err(|e| e.to_string())
            .and_then(|mut e| e.read_exact(&mut head).map_err(|e| e.to_string()));
        let elf = read.is_ok()
            && head[..4] == *b"\x7fELF"
            && head[4] == 2
            && machine.is_none_or(|m| u16::from_le_bytes([head[18], head[19]]) == m);
        if !elf {
            return Err(format!(
                "its shared object is not a 64-bit ELF file for {}",
                std::env::consts::ARCH
            ));
        }
    }
    Ok(model)
}

/// Whether a zip entry's extra field (blocks of a 2-byte id, a 2-byte length, the data) holds
/// a block `id`.
fn has_field(extra: &[u8], id: u16) -> bool {
    let mut rest = extra;
    while rest.len() >= 4 {
        if u16::from_le_bytes([rest[0], rest[1]]) == id {
            return true;
        }
        let len = u16::from_le_bytes([rest[2], rest[3]]) as usize;
        rest = rest.get(4 + len..).unwrap_or_default();
    }
    false
}

/// libtorch unpacks a package into a folder `<temp>/aotinductor_*` of its own and removes it
/// when the package is freed, but not when its loader fails after unpacking (a shared object
/// it cannot load): this removes such folders of this user, changed since `since`, that hold
/// the entry `object` (the package's shared object, named by its hash). Nothing is followed.
pub(super) fn remove_unpacked(temp: &Path, object: &str, since: std::time::SystemTime) {
    use std::os::unix::fs::MetadataExt;
    let Ok(entries) = std::fs::read_dir(temp) else {
        return;
    };
    let me = unsafe { libc::geteuid() };
    let since = since - std::time::Duration::from_secs(2);
    for entry in entries.flatten() {
        let dir = entry.path();
        let ours = entry
            .file_name()
            .as_encoded_bytes()
            .starts_with(b"aotinductor_")
            && std::fs::symlink_metadata(&dir).is_ok_and(|m| {
                m.is_dir() && m.uid() == me && m.modified().is_ok_and(|t| t >= since)
            })
            && std::fs::symlink_metadata(dir.join(object)).is_ok_and(|m| m.is_file());
        if ours {
            let _ = std::fs::remove_dir_all(&dir);
        }
    }
}

/// Packages for tests: a zip of given entries, the header of a shared object for this machine.
#[cfg(test)]
pub(super) mod fake {
    use std::os::unix::fs::PermissionsExt;
    use std::path::Path;

    /// A zip holding `entries` (stored, or deflated where `deflate`).
    pub fn zip_of(path: &Path, entries: &[(&str, &[u8])], deflate: bool) {
        use std::io::Write;
        let mut zip = zip::ZipWriter::new(std::fs::File::create(path).unwrap());
        let method = if deflate {
            zip::CompressionMethod::Deflated
        } else {
            zip::CompressionMethod::Stored
        };
        let options = zip::write::SimpleFileOptions::default().compression_method(method);
        for (name, bytes) in entries {
            zip.start_file(*name, options).unwrap();
            zip.write_all(bytes).unwrap();
        }
        zip.finish().unwrap();
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o644)).unwrap();
    }

    /// The first bytes of a shared object for this machine (what the archive check reads).
    pub fn elf() -> Vec<u8> {
        let machine: u16 = if std::env::consts::ARCH == "aarch64" {
            183
        } else {
            62
        };
        let mut head = b"\x7fELF\x02\x01\x01".to_vec();
        head.resize(18, 0);
        head.extend(machine.to_le_bytes());
        head.resize(64, 0);
        head
    }

    pub const SO: &str = "m/data/aotinductor/model/c1.wrapper.so";
}

#[cfg(test)]
mod tests {
    use super::fake::{SO, elf, zip_of};
    use super::*;

    /// CRC-32 (IEEE), as a zip's Unicode Path field carries it of the entry's name.
    fn crc32(bytes: &[u8]) -> u32 {
        let mut c = !0u32;
        for &b in bytes {
            c ^= b as u32;
            for _ in 0..8 {
                c = if c & 1 != 0 {
                    (c >> 1) ^ 0xEDB8_8320
                } else {
                    c >> 1
                };
            }
        }
        !c
    }

    /// A zip, written by hand (Rust's `zip` writes no Unicode Path field with a valid CRC),
    /// of the model's shared object and an entry `name`, as libtorch reads it, that carries
    /// `alias` in a Unicode Path field (which Rust's `zip` reads in its place).
    fn zip_with_alias(path: &Path, name: &str, alias: &str) {
        let mut field = UNICODE_PATH_FIELD.to_le_bytes().to_vec();
        field.extend(((5 + alias.len()) as u16).to_le_bytes());
        field.push(1);
        field.extend(crc32(name.as_bytes()).to_le_bytes());
        field.extend(alias.as_bytes());
        let entries: [(&str, Vec<u8>, Vec<u8>); 2] =
            [(SO, elf(), Vec::new()), (name, b"escaped".to_vec(), field)];
        let (mut out, mut central) = (Vec::new(), Vec::new());
        let u16le = |v: usize| (v as u16).to_le_bytes();
        let u32le = |v: usize| (v as u32).to_le_bytes();
        for (name, data, extra) in &entries {
            let (crc, offset) = (crc32(data), out.len());
            // Version 20, no flags, stored, no time or date: then the CRC, both sizes and the
            // name's.
            let common = [
                &u16le(20)[..],
                &[0; 8],
                &crc.to_le_bytes(),
                &u32le(data.len()),
                &u32le(data.len()),
                &u16le(name.len()),
            ]
            .concat();
            out.extend([&0x0403_4b50u32.to_le_bytes()[..], &common, &[0, 0]].concat());
            out.extend(name.as_bytes());
            out.extend(data);
            central.extend([&0x0201_4b50u32.to_le_bytes()[..], &u16le(20), &common].concat());
            // The extra field's size; no comment, disk 0, no attributes; the local header's offset.
            central.extend([&u16le(extra.len())[..], &[0; 10], &u32le(offset)].concat());
            central.extend(name.as_bytes());
            central.extend(extra);
        }
        let (at, size) = (out.len(), central.len());
        out.extend(central);
        out.extend(
            [
                &0x0605_4b50u32.to_le_bytes()[..],
                &[0; 4],
                &u16le(2),
                &u16le(2),
            ]
            .concat(),
        );
        out.extend([&u32le(size)[..], &u32le(at), &[0, 0]].concat());
        std::fs::write(path, out).unwrap();
    }

    /// What libtorch would unpack is checked first: a name that leaves its folder, an archive
    /// that unpacks to many times its size, one without the compiled shared object (libtorch
    /// would run a compiler), a shared object that is no ELF file for this machine, and a file
    /// that is no zip are each refused; a package as torch writes it passes.
    #[test]
    fn archives_are_checked_before_libtorch_unpacks_them() {
        let dir = tempfile::tempdir().unwrap();
        let pkg = dir.path().join("m.pt2");
        let zeros = vec![0u8; 64 << 20];
        let mut other_machine = elf();
        other_machine[18] ^= 0x40;
        type Entries<'a> = &'a [(&'a str, &'a [u8])];
        let cases: [(Entries, bool, &str); 11] = [
            (
                &[
                    (SO, &elf()),
                    ("m/data/aotinductor/model/c1_metadata.json", b"{}"),
                ],
                false,
                "",
            ),
            (
                &[
                    (SO, &elf()),
                    ("m/data/aotinductor/model/../../../../x.txt", b"x"),
                ],
                false,
                "would be unpacked outside",
            ),
            (
                &[(SO, &elf()), ("m/data/aotinductor/model/w.bin", &zeros)],
                true,
                "unpacks to 64 MiB",
            ),
            (
                &[("m/data/aotinductor/model/c1.wrapper.cpp", b"int x;")],
                false,
                "no compiled shared object",
            ),
            (
                &[(SO, b"not an ELF file at all, but long enough")],
                false,
                "not a 64-bit ELF",
            ),
            (&[(SO, &other_machine)], false, "not a 64-bit ELF"),
            (
                &[("m/data/aotinductor/model/x.so", &elf()[..8])],
                false,
                "not a 64-bit ELF",
            ),
            // Whichever shared object libtorch would pick, each is checked.
            (
                &[(SO, &elf()), ("m/data/constants/z.SO", b"no ELF file")],
                false,
                "not a 64-bit ELF",
            ),
            // A decoy shared object outside the model's folder, and what libtorch would compile
            // the model from, with a compiler of the package's choosing.
            (
                &[
                    ("p/x/data/aotinductor/model/decoy.so", &elf()),
                    ("m/data/aotinductor/model/c.wrapper.cpp", b"int x;"),
                    (
                        "m/data/aotinductor/model/c.wrapper_compile_flags.json",
                        b"{}",
                    ),
                ],
                false,
                "running the compiler",
            ),
            (
                &[
                    (SO, &elf()),
                    ("m/data/aotinductor/model/c_linker_flags.json", b"{}"),
                ],
                false,
                "compile",
            ),
            (
                &[
                    (SO, &elf()),
                    ("m/data/aotinductor/model/C1.wrapper.so", &elf()),
                ],
                false,
                "there twice",
            ),
        ];
        for (entries, deflate, says) in cases {
            zip_of(&pkg, entries, deflate);
            let got = check_archive(&File::open(&pkg).unwrap());
            match says {
                "" => assert_eq!(got.unwrap(), SO),
                _ => {
                    let e = got.unwrap_err();
                    assert!(e.contains(says), "{says}: {e}");
                }
            }
        }
        std::fs::write(&pkg, "not a zip").unwrap();
        let e = check_archive(&File::open(&pkg).unwrap()).unwrap_err();
        assert!(e.contains("not a compiled package"), "{e}");
        // A second name that Rust's zip reads in place of the one libtorch unpacks to.
        zip_with_alias(
            &pkg,
            "m/data/aotinductor/model/../../../../x.txt",
            "m/data/aotinductor/model/notes.txt",
        );
        let e = check_archive(&File::open(&pkg).unwrap()).unwrap_err();
        assert!(e.contains("carries a second name"), "{e}");
    }

    /// Only this user's libtorch folders that hold the package's shared object and changed
    /// since the load began are removed; links are not followed.
    #[test]
    fn a_failed_loads_unpacked_copy_is_removed_and_nothing_else() {
        let temp = tempfile::tempdir().unwrap();
        let object = "m/data/aotinductor/model/c1.wrapper.so";
        let unpacked = |name: &str, object: &str| {
            let dir = temp.path().join(name);
            let file = dir.join(object);
            std::fs::create_dir_all(file.parent().unwrap()).unwrap();
            std::fs::write(file, b"x").unwrap();
            dir
        };
        let since = std::time::SystemTime::now();
        let failed = unpacked("aotinductor_a1", object);
        let other_package = unpacked("aotinductor_b2", "m/data/aotinductor/model/c2.wrapper.so");
        let not_libtorchs = unpacked("mine_c3", object);
        let elsewhere = tempfile::tempdir().unwrap();
        let target = elsewhere.path().join("t");
        std::fs::create_dir_all(target.join("m/data/aotinductor/model")).unwrap();
        std::fs::write(target.join(object), b"x").unwrap();
        std::os::unix::fs::symlink(&target, temp.path().join("aotinductor_link")).unwrap();
        remove_unpacked(temp.path(), object, since);
        assert!(!failed.exists());
        assert!(other_package.exists() && not_libtorchs.exists());
        assert!(target.join(object).exists(), "a link was followed");
        // One from before the load began is not this load's.
        let older = unpacked("aotinductor_d4", object);
        let later = std::time::SystemTime::now() + std::time::Duration::from_secs(60);
        remove_unpacked(temp.path(), object, later);
        assert!(older.exists());
    }
}
