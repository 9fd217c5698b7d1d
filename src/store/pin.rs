//! Pins (docs/design.md §10, "Rotation takes nothing mid-evaluation"): a checkpoint the watcher
//! has found complete is *pinned* — made a hard-linked copy in `<state_dir>/pins/<id>/<name>`,
//! one folder per pinned version (a checkpoint saved again under its name while the old version
//! is still pinned gets a folder of its own) — until
//! its outcome is recorded, so that the training job's rotation (`checkpoints_total_limit`,
//! `save_top_k`, `keep_latest_k`) cannot delete it while it waits for its turn or is evaluated:
//! the evaluator reads the pin, the record names the checkpoint. (A Slurm job reads the
//! checkpoint in place: it may outlive the daemon that submitted it, and its pins.)
//!
//! - **Links only.** Every regular file of the unit is hard-linked ([`keep_best::link_unit`]:
//!   bounded, no link followed), or with `early_stop.keep_best: false` only a folder's weights
//!   file ([`Pins::only_weights`]: the optimizer state beside it is never needed); nothing is
//!   copied. A pin costs no disk while the original
//!   exists, and the checkpoint's size once rotation deleted it, until its record. Where links
//!   are not possible (the state folder on another file system) nothing is pinned, and one
//!   warning says so: a checkpoint deleted before its turn is then counted as `rotated`.
//! - **Bounded.** At most [`MAX_PINS`] pins per run at once (the queue of a run that falls
//!   behind); beyond, checkpoints wait unpinned, as they did before pins.
//! - **Released by dropping.** A [`Pin`] is shared (`Arc`) by the work item and whoever still
//!   needs its files (the keeper of the best checkpoint); the last one to drop it removes it.
//! - **Restarts.** Beside each pin, `<id>/key.json` records the checkpoint's key and step. A daemon
//!   that stops leaves the pins of the checkpoints still waiting ([`Pin::leave_on_disk`]), as
//!   does one that dies. At start, [`Pins::leftovers`] lists them: a checkpoint that rotation
//!   has deleted since is evaluated from its pin; any other leftover is removed.
//! - **Authenticated.** `key.json` carries an HMAC-SHA256 of the record under the state folder's
//!   own random key (`<state_dir>/pins.key`, 0600): a pin the daemon did not make (planted in
//!   its state folder) is removed at start, never evaluated and journalled as the checkpoint.

use crate::config::WeightsFile;
use crate::store::history::CheckpointKey;
use crate::store::keep_best::{self, KeepBestError};
use crate::store::safe_fs::untrusted;
use std::ffi::OsStr;
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

/// The folder of `state_dir` that holds the pins.
pub const PINS_DIR: &str = "pins";
/// The file of `state_dir` with the key that authenticates the pins' records.
pub const PINS_KEY: &str = "pins.key";
/// The most checkpoints one run keeps pinned at once.
pub const MAX_PINS: usize = 16;

/// A pinned checkpoint: removed when the last holder drops it.
#[derive(Debug)]
pub struct Pin {
    /// `<state_dir>/pins/<id>`, removed with the pin.
    folder: PathBuf,
    /// `<folder>/<name>`: the checkpoint's files.
    path: PathBuf,
    /// The pin's own key when it was made (its folders are new, so not the checkpoint's).
    key: CheckpointKey,
    live: Arc<AtomicUsize>,
    /// Left on disk when dropped: the daemon stops with this checkpoint still waiting.
    kept_on_disk: AtomicBool,
}

impl Pin {
    /// Leaves the pin on disk when it is dropped (the daemon stops before its outcome is
    /// recorded): the next start finds it ([`Pins::leftovers`]).
    pub fn leave_on_disk(&self) {
        self.kept_on_disk.store(true, Ordering::SeqCst);
    }

    /// Where the pinned files are, for this process.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Are the pinned files still those pinned? Links share the files with the original: a
    /// checkpoint rewritten in place changes its pin too, and is not what was found complete.
    pub fn unchanged(&self) -> bool {
        crate::store::unit::key(&self.path).ok().as_ref() == Some(&self.key)
    }
}

impl PartialEq for Pin {
    fn eq(&self, other: &Pin) -> bool {
        self.path == other.path
    }
}

impl Drop for Pin {
    fn drop(&mut self) {
        if !self.kept_on_disk.load(Ordering::SeqCst) {
            remove(&self.folder);
        }
        self.live.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A pin a previous daemon left whose checkpoint is gone: what it recorded.
#[derive(Debug)]
pub struct Leftover {
    pub pin: Arc<Pin>,
    /// The checkpoint's key when it was pinned.
    pub key: CheckpointKey,
    pub step: i64,
}

/// The pins of one run.
pub struct Pins {
    dir: PathBuf,
    /// Authenticates the records (`key.json`): [`PINS_KEY`].
    mac_key: [u8; 32],
    live: Arc<AtomicUsize>,
    /// Linking failed once (another file system): no more tries, one warning.
    unavailable: AtomicBool,
    /// [`Pins::only_weights`]: the weights files a folder's evaluation reads.
    only_weights: Option<Vec<WeightsFile>>,
}

impl Pins {
    /// The pins of the run whose state folder is `state_dir` (the folder is made, mode 0700).
    pub fn open(state_dir: &Path) -> std::io::Result<Pins> {
        let dir = state_dir.join(PINS_DIR);
        crate::store::safe_fs::create_private_dir(&dir)?;
        crate::store::safe_fs::remove_leftover_temps(state_dir, PINS_KEY);
        let mac_key = crate::store::safe_fs::private_key(
            &state_dir.join(PINS_KEY),
            "the pins' key",
            "pins left under the old one are removed, and their checkpoints, if rotation has \
             deleted them, are counted as `rotated`",
        )?;
        Ok(Pins {
            dir,
            mac_key,
            live: Arc::new(AtomicUsize::new(0)),
            unavailable: AtomicBool::new(false),
            only_weights: None,
        })
    }

    /// Pins of checkpoint folders hold only the file their evaluation reads, the first of
    /// `weights_files` found in them (`early_stop.keep_best: false`: nothing else of them is
    /// ever kept), not the optimizer state and the rest a training stack saves beside it. A
    /// sharded or distributed checkpoint's files, and a folder whose weights cannot be found,
    /// are pinned whole.
    pub fn only_weights(mut self, weights_files: Vec<WeightsFile>) -> Pins {
        self.only_weights = Some(weights_files);
        self
    }

    /// With [`Pins::only_weights`]: the weights file of the folder `unit`, relative to it, when
    /// it is one file that names no others.
    fn weights_in(&self, unit: &Path) -> Option<PathBuf> {
        let files = self.only_weights.as_ref()?;
        if !fs::symlink_metadata(unit).ok()?.is_dir() {
            return None;
        }
        let weights = crate::store::unit::find_weights(unit, files).ok()?;
        if crate::weights::names_other_files(&weights) {
            return None;
        }
        weights.strip_prefix(unit).ok().map(Path::to_path_buf)
    }

    /// Pins the checkpoint unit `unit` (found complete with key `key` at `step`); `None` when it
    /// cannot be (links not possible, [`MAX_PINS`] reached, a name that cannot be pinned).
    pub fn pin(&self, unit: &Path, key: &CheckpointKey, step: i64) -> Option<Arc<Pin>> {
        if self.unavailable.load(Ordering::SeqCst) || self.live.load(Ordering::SeqCst) >= MAX_PINS {
            return None;
        }
        let name = unit.file_name()?;
        if name.as_encoded_bytes().starts_with(b".") {
            return None;
        }
        // A link the user placed in the run folder is followed to be evaluated, but never
        // pinned (pins follow no link): that checkpoint's matter, not the pins'.
        if fs::symlink_metadata(unit).is_ok_and(|m| m.file_type().is_symlink()) {
            tracing::info!(checkpoint = %untrusted(unit),
                "a symbolic link: evaluated where it points, not pinned (should rotation delete \
                 it before its turn, it is counted as `rotated`)");
            return None;
        }
        let folder = self.new_folder()?;
        let target = folder.join(name);
        let made = match self.weights_in(unit) {
            Some(weights) => link_file_of(unit, &weights, &target),
            None => keep_best::link_unit(unit, &target),
        }
        .map_err(|e| {
            let refused = matches!(&e, keep_best::KeepBestError::Io { source, .. }
                    if matches!(source.raw_os_error(),
                        Some(libc::EXDEV | libc::EPERM | libc::EMLINK | libc::EOPNOTSUPP)));
            (e.to_string(), refused)
        })
        .and_then(|()| crate::store::unit::key(&target).map_err(|e| (e.to_string(), false)));
        let pin_key = match made {
            Ok(k) => k,
            Err((e, refused)) => {
                remove(&folder);
                let e = crate::store::safe_fs::untrusted_text(&e);
                // Only a link the file system refuses says pins cannot work here; anything else
                // (a link or a special file inside, rotated meanwhile, unreadable) is this
                // checkpoint's, which waits unpinned.
                if !refused {
                    tracing::info!(checkpoint = %untrusted(unit),
                        "not pinned ({e}): evaluated in place; should rotation delete it before \
                         its turn, it is counted as `rotated`");
                } else if !self.unavailable.swap(true, Ordering::SeqCst) {
                    tracing::warn!(checkpoint = %untrusted(unit), pins = %self.dir.display(),
                        "cannot pin checkpoints ({e}): the state folder must be on the run \
                         folder's file system for hard links; checkpoints are evaluated in \
                         place, and one that rotation deletes before its turn is counted as \
                         `rotated`");
                }
                return None;
            }
        };
        let mac = self.mac(key, step);
        let note = serde_json::json!({"key": key, "step": step, "mac": mac}).to_string();
        if let Err(e) = crate::store::safe_fs::atomic_write(&folder.join(KEY_FILE), note.as_bytes())
        {
            tracing::debug!("cannot record the pin's key: {e}");
        }
        self.live.fetch_add(1, Ordering::SeqCst);
        Some(Arc::new(Pin {
            folder,
            path: target,
            key: pin_key,
            live: self.live.clone(),
            kept_on_disk: AtomicBool::new(false),
        }))
    }

    /// The disk the pins alone hold: the bytes of pinned files that have no other link (the
    /// training job's rotation deleted the original, and no kept copy shares them). A walk of
    /// `pins/` without following links, bounded as a checkpoint's walk is
    /// ([`crate::store::unit::MAX_ENTRIES`] entries, [`crate::store::unit::MAX_DEPTH`] levels);
    /// what lies beyond is not counted.
    pub fn held_bytes(&self) -> u64 {
        use std::os::unix::fs::MetadataExt;
        let mut bytes = 0u64;
        let mut entries = 0usize;
        let mut stack = vec![(self.dir.clone(), 0usize)];
        while let Some((dir, depth)) = stack.pop() {
            let Ok(listing) = fs::read_dir(&dir) else {
                continue;
            };
            for entry in listing.flatten() {
                entries += 1;
                if entries > crate::store::unit::MAX_ENTRIES {
                    return bytes;
                }
                let Ok(meta) = fs::symlink_metadata(entry.path()) else {
                    continue;
                };
                if meta.is_dir() && depth + 1 < crate::store::unit::MAX_DEPTH {
                    stack.push((entry.path(), depth + 1));
                } else if meta.is_file()
                    && meta.nlink() == 1
                    && !(depth == 1 && entry.file_name() == KEY_FILE)
                {
                    bytes += meta.len();
                }
            }
        }
        bytes
    }

    /// The authentication of a pin's record: HMAC-SHA256 under [`PINS_KEY`] of the checkpoint's
    /// key and step, hex.
    fn mac(&self, key: &CheckpointKey, step: i64) -> String {
        use hmac::Mac;
        let mut mac = hmac::Hmac::<sha2::Sha256>::new_from_slice(&self.mac_key)
            .expect("HMAC accepts keys of any length");
        let record = serde_json::json!({"key": key, "step": step}).to_string();
        mac.update(record.as_bytes());
        mac.finalize()
            .into_bytes()
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    }

    /// A new, empty folder `pins/<id>` (mode 0700) for one pin.
    fn new_folder(&self) -> Option<PathBuf> {
        use rand::Rng;
        use std::os::unix::fs::DirBuilderExt;
        for _ in 0..16 {
            let id: String = (0..12)
                .map(|_| char::from(b'a' + rand::thread_rng().gen_range(0..26u8)))
                .collect();
            let folder = self.dir.join(id);
            match fs::DirBuilder::new().mode(0o700).create(&folder) {
                Ok(()) => return Some(folder),
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
                Err(e) => {
                    tracing::debug!(pins = %self.dir.display(), "cannot make a pin folder: {e}");
                    return None;
                }
            }
        }
        None
    }

    /// The pins a previous daemon left whose checkpoint is gone from `run_dir` (deleted since:
    /// evaluated from the pin, which the returned [`Pin`] owns); every other leftover (its
    /// checkpoint still there, or no readable record) is removed.
    pub fn leftovers(&self, run_dir: &Path) -> Vec<Leftover> {
        let Ok(entries) = fs::read_dir(&self.dir) else {
            return Vec::new();
        };
        let mut found = Vec::new();
        let mut read = 0usize;
        let mut beyond = 0usize;
        for entry in entries.flatten().take(crate::store::unit::MAX_ENTRIES) {
            let folder = entry.path();
            // Bounded: a daemon leaves at most MAX_PINS per run; planted thousands would add
            // tens of seconds to every start.
            if read >= MAX_LEFTOVERS {
                beyond += 1;
                continue;
            }
            read += 1;
            if !entry.file_type().is_ok_and(|t| t.is_dir()) {
                remove(&folder);
                continue;
            }
            // Read bounded, never through a link, never waiting on a FIFO: a record longer than
            // 64 KiB is not one of ours.
            let recorded = crate::store::safe_fs::read_bounded(&folder.join(KEY_FILE), 64 << 10)
                .ok()
                .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
                .and_then(|v| {
                    let key: CheckpointKey = serde_json::from_value(v.get("key")?.clone()).ok()?;
                    let mac = v.get("mac")?.as_str()?.to_owned();
                    Some((key, v.get("step")?.as_i64()?, mac))
                });
            let Some((key, step, mac)) = recorded else {
                remove(&folder);
                continue;
            };
            let expected = self.mac(&key, step);
            let differ = mac.len() != expected.len()
                || mac
                    .bytes()
                    .zip(expected.bytes())
                    .fold(0u8, |d, (a, b)| d | (a ^ b))
                    != 0;
            if differ {
                tracing::warn!(pin = %untrusted(&folder), checkpoint = %untrusted(Path::new(&key.path)),
                    "a pin this daemon did not make (its record is not authenticated by \
                     pins.key): removed, not evaluated");
                remove(&folder);
                continue;
            }
            let original = PathBuf::from(&key.path);
            let name = original.file_name().map(|n| n.to_owned());
            let in_run = original.parent() == Some(run_dir);
            let gone = matches!(fs::symlink_metadata(&original),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound);
            let path = name.as_ref().map(|n| folder.join(n));
            let pin_key = path.as_ref().and_then(|p| crate::store::unit::key(p).ok());
            match (name, path, pin_key) {
                (Some(_), Some(path), Some(pin_key)) if in_run && gone => {
                    self.live.fetch_add(1, Ordering::SeqCst);
                    found.push(Leftover {
                        pin: Arc::new(Pin {
                            folder,
                            path,
                            key: pin_key,
                            live: self.live.clone(),
                            kept_on_disk: AtomicBool::new(false),
                        }),
                        key,
                        step,
                    });
                }
                _ => remove(&folder),
            }
        }
        if beyond > 0 {
            tracing::warn!(pins = %self.dir.display(), read = MAX_LEFTOVERS, beyond,
                "more leftover pins than a daemon leaves: those beyond were not read (not one of \
                 ours: remove them)");
        }
        found
    }
}

/// The most leftover pin folders a start reads.
pub const MAX_LEFTOVERS: usize = 4 * MAX_PINS;

/// The record in a pin's folder: the checkpoint's key and step.
const KEY_FILE: &str = "key.json";

/// [`Pins::only_weights`]: hard-links only the file `relative` of the folder `unit` (its
/// weights) to the same place under the new folder `to`: the folders on the way are opened
/// through their parent's descriptor, none followed if it is a link (a link anywhere is
/// [`KeepBestError::Link`]); their copies under `to` (a new folder of the pin's) are made 0700.
fn link_file_of(unit: &Path, relative: &Path, to: &Path) -> Result<(), KeepBestError> {
    let names: Option<Vec<&OsStr>> = relative
        .components()
        .map(|c| match c {
            std::path::Component::Normal(name) => Some(name),
            _ => None,
        })
        .collect();
    let Some((file, folders)) = names.as_deref().and_then(<[&OsStr]>::split_last) else {
        return Err(KeepBestError::NotRegular {
            path: unit.join(relative),
        });
    };
    let mut dir = keep_best::open_dir(unit).map_err(|e| keep_best::link_or_io(unit, e))?;
    let mut from = unit.to_path_buf();
    for name in folders {
        from.push(name);
        dir = keep_best::open_dir(&keep_best::under(&dir, name))
            .map_err(|e| keep_best::link_or_io(&from, e))?;
    }
    let dst = folders
        .iter()
        .fold(to.to_path_buf(), |p, name| p.join(name));
    crate::store::safe_fs::create_private_dir(&dst).map_err(keep_best::io_error(&dst))?;
    let mut kept = keep_best::Kept {
        path: to.to_path_buf(),
        linked: 0,
        copied: 0,
    };
    let link = |a: &Path, b: &Path| fs::hard_link(a, b);
    keep_best::link_or_copy(
        &keep_best::under(&dir, file),
        &dst.join(file),
        &link,
        false,
        &mut kept,
    )
}

/// Removes `path` without following links: a folder with its tree.
fn remove(path: &Path) {
    let removed = match fs::symlink_metadata(path) {
        Ok(m) if m.is_dir() => fs::remove_dir_all(path),
        Ok(_) => fs::remove_file(path),
        Err(_) => return,
    };
    if let Err(e) = removed {
        tracing::warn!(path = %untrusted(path), "cannot remove a pin: {e}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key_of(p: &Path) -> CheckpointKey {
        crate::store::unit::key(p).unwrap()
    }

    /// A pinned folder survives the deletion of its original, shares its files (links), is
    /// removed when dropped, and a restart finds it again only while the original is gone.
    #[test]
    fn a_pin_outlives_rotation_and_goes_when_dropped() {
        let run = tempfile::tempdir().unwrap();
        let state = tempfile::tempdir().unwrap();
        let ck = run.path().join("checkpoint-500");
        fs::create_dir_all(ck.join("unet")).unwrap();
        fs::write(ck.join("unet/model.safetensors"), b"weights").unwrap();
        let key = key_of(&ck);
        let pins = Pins::open(state.path()).unwrap();
        let pin = pins.pin(&ck, &key, 500).unwrap();
        let linked = pin.path().join("unet/model.safetensors");
        use std::os::unix::fs::MetadataExt;
        assert_eq!(
            fs::metadata(&linked).unwrap().ino(),
            fs::metadata(ck.join("unet/model.safetensors"))
                .unwrap()
                .ino()
        );
        fs::remove_dir_all(&ck).unwrap(); // rotation
        assert_eq!(fs::read(&linked).unwrap(), b"weights");
        assert!(pin.unchanged());

        // A restart: the checkpoint is gone, the pin is what is left of it.
        let again = Pins::open(state.path()).unwrap();
        let left = again.leftovers(run.path());
        assert_eq!(left.len(), 1);
        assert_eq!((left[0].key.clone(), left[0].step), (key, 500));
        drop(left);
        drop(pin);
        assert!(
            fs::read_dir(state.path().join(PINS_DIR))
                .unwrap()
                .next()
                .is_none()
        );
    }

    /// A pin of a checkpoint that is still there is removed at the restart (it is pinned again
    /// when found); a file rewritten in place changes its pin too.
    #[test]
    fn leftovers_of_present_checkpoints_are_removed_and_rewrites_show() {
        let run = tempfile::tempdir().unwrap();
        let state = tempfile::tempdir().unwrap();
        let ck = run.path().join("ckpt_10.pt");
        fs::write(&ck, b"weights").unwrap();
        let pins = Pins::open(state.path()).unwrap();
        let pin = pins.pin(&ck, &key_of(&ck), 10).unwrap();
        pin.leave_on_disk(); // a daemon that stopped holding it
        drop(pin);
        assert!(
            Pins::open(state.path())
                .unwrap()
                .leftovers(run.path())
                .is_empty()
        );
        assert!(
            fs::read_dir(state.path().join(PINS_DIR))
                .unwrap()
                .next()
                .is_none()
        );

        let pin = pins.pin(&ck, &key_of(&ck), 10).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(20));
        fs::write(&ck, b"other weights").unwrap(); // in place: the same inode
        assert!(!pin.unchanged());
    }

    /// A checkpoint saved again under its name while its old version is pinned: each version
    /// has its own pin, and dropping the old one leaves the new one whole.
    #[test]
    fn two_versions_of_one_name_have_pins_of_their_own() {
        let run = tempfile::tempdir().unwrap();
        let state = tempfile::tempdir().unwrap();
        let ck = run.path().join("ckpt_1.pt");
        fs::write(&ck, b"old").unwrap();
        let pins = Pins::open(state.path()).unwrap();
        let old = pins.pin(&ck, &key_of(&ck), 1).unwrap();
        let tmp = run.path().join("ckpt_1.pt.tmp");
        fs::write(&tmp, b"new weights").unwrap();
        fs::rename(&tmp, &ck).unwrap(); // renamed over: another inode
        let new = pins.pin(&ck, &key_of(&ck), 1).unwrap();
        assert_ne!(old.path(), new.path());
        assert_eq!(old.path().file_name(), new.path().file_name());
        drop(old);
        assert!(new.unchanged());
        assert_eq!(fs::read(new.path()).unwrap(), b"new weights");
    }

    /// Without `keep_best` a folder's pin holds only the weights file its evaluation reads (at
    /// the same place, so the evaluation finds it there), not the optimizer state beside it; a
    /// sharded checkpoint's index names other files, and its folder is pinned whole.
    #[test]
    fn only_the_weights_are_pinned_when_nothing_is_kept() {
        let run = tempfile::tempdir().unwrap();
        let state = tempfile::tempdir().unwrap();
        let files = crate::store::unit::default_weights_files(true);
        let pins = Pins::open(state.path())
            .unwrap()
            .only_weights(files.clone());
        let ck = run.path().join("checkpoint-10");
        fs::create_dir_all(ck.join("unet_ema")).unwrap();
        fs::create_dir_all(ck.join("unet")).unwrap();
        let ema = "unet_ema/diffusion_pytorch_model.safetensors";
        fs::write(ck.join(ema), vec![1u8; 1000]).unwrap();
        fs::write(
            ck.join("unet/diffusion_pytorch_model.safetensors"),
            vec![4u8; 900],
        )
        .unwrap();
        fs::write(ck.join("optimizer.bin"), vec![2u8; 2000]).unwrap();
        let pin = pins.pin(&ck, &key_of(&ck), 10).unwrap();
        fs::remove_dir_all(&ck).unwrap();
        assert_eq!(pins.held_bytes(), 1000);
        let found = crate::store::unit::find_weights(pin.path(), &files).unwrap();
        assert_eq!(found, pin.path().join(ema));
        assert!(!pin.path().join("optimizer.bin").exists());
        assert!(!pin.path().join("unet").exists());
        assert!(pin.unchanged());
        drop(pin);

        let sharded = run.path().join("checkpoint-20");
        fs::create_dir_all(&sharded).unwrap();
        let index = r#"{"metadata": {}, "weight_map": {"w": "model-00001-of-00001.safetensors"}}"#;
        fs::write(sharded.join("model.safetensors.index.json"), index).unwrap();
        fs::write(
            sharded.join("model-00001-of-00001.safetensors"),
            vec![3u8; 500],
        )
        .unwrap();
        let pin = pins.pin(&sharded, &key_of(&sharded), 20).unwrap();
        assert!(pin.path().join("model-00001-of-00001.safetensors").exists());

        // With keep_best (the default) every file is pinned: the kept best is made from it.
        let whole = Pins::open(state.path()).unwrap();
        let ck = run.path().join("checkpoint-30");
        fs::create_dir_all(ck.join("unet")).unwrap();
        fs::write(ck.join("unet/diffusion_pytorch_model.safetensors"), b"w").unwrap();
        fs::write(ck.join("optimizer.bin"), b"o").unwrap();
        let pin = whole.pin(&ck, &key_of(&ck), 30).unwrap();
        assert!(pin.path().join("optimizer.bin").exists());
    }

    /// The pins' own disk use counts only the files rotation deleted: nothing while the
    /// originals exist, their size once they are gone.
    #[test]
    fn held_bytes_count_what_only_the_pins_hold() {
        let run = tempfile::tempdir().unwrap();
        let state = tempfile::tempdir().unwrap();
        let pins = Pins::open(state.path()).unwrap();
        let ck = run.path().join("checkpoint-10");
        fs::create_dir_all(ck.join("unet")).unwrap();
        fs::write(ck.join("unet/model.safetensors"), vec![1u8; 1000]).unwrap();
        fs::write(ck.join("optimizer.bin"), vec![2u8; 300]).unwrap();
        let other = run.path().join("ckpt_20.pt");
        fs::write(&other, vec![3u8; 50]).unwrap();
        let held = [
            pins.pin(&ck, &key_of(&ck), 10).unwrap(),
            pins.pin(&other, &key_of(&other), 20).unwrap(),
        ];
        assert_eq!(pins.held_bytes(), 0);
        fs::remove_dir_all(&ck).unwrap();
        assert_eq!(pins.held_bytes(), 1300);
        fs::remove_file(&other).unwrap();
        assert_eq!(pins.held_bytes(), 1350);
        drop(held);
        assert_eq!(pins.held_bytes(), 0);
    }

    /// A checkpoint that is a symbolic link (placed by the user) is not pinned, and pinning
    /// goes on for every other checkpoint (issue #45: one link turned pins off for good).
    #[test]
    fn a_linked_checkpoint_is_not_pinned_and_pins_go_on() {
        let run = tempfile::tempdir().unwrap();
        let state = tempfile::tempdir().unwrap();
        let elsewhere = tempfile::tempdir().unwrap();
        let good = elsewhere.path().join("good.pt");
        fs::write(&good, b"weights").unwrap();
        let linked = run.path().join("ckpt_000010.pt");
        std::os::unix::fs::symlink(&good, &linked).unwrap();
        let pins = Pins::open(state.path()).unwrap();
        assert!(pins.pin(&linked, &key_of(&linked), 10).is_none());
        // A folder with a link inside is pinned without it.
        let ck = run.path().join("checkpoint-30");
        fs::create_dir(&ck).unwrap();
        fs::write(ck.join("model.safetensors"), b"w").unwrap();
        std::os::unix::fs::symlink(&good, ck.join("extra.bin")).unwrap();
        let folder = pins.pin(&ck, &key_of(&ck), 30).expect("pinned");
        assert!(!folder.path().join("extra.bin").exists());
        for step in [50, 60, 70] {
            let ck = run.path().join(format!("ckpt_0000{step}.pt"));
            fs::write(&ck, b"w").unwrap();
            let pin = pins
                .pin(&ck, &key_of(&ck), step)
                .expect("pins go on after a link");
            fs::remove_file(&ck).unwrap(); // rotation
            assert!(pin.path().is_file());
        }
        assert_eq!(fs::read(&good).unwrap(), b"weights");
    }

    /// Planted leftovers (issue #45): a FIFO as a pin's record is not waited on (the start
    /// hung before HTTP), and a start reads at most MAX_LEFTOVERS pin folders.
    #[test]
    fn planted_leftovers_neither_hang_nor_slow_a_start() {
        let run = tempfile::tempdir().unwrap();
        let state = tempfile::tempdir().unwrap();
        let pins = Pins::open(state.path()).unwrap();
        let fifo = state.path().join(PINS_DIR).join("fifo");
        fs::create_dir(&fifo).unwrap();
        let c = std::ffi::CString::new(fifo.join(KEY_FILE).to_str().unwrap()).unwrap();
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let (tx, rx) = std::sync::mpsc::channel();
        let dir = run.path().to_path_buf();
        std::thread::spawn(move || tx.send(pins.leftovers(&dir).len()).unwrap());
        let found = rx
            .recv_timeout(std::time::Duration::from_secs(20))
            .expect("the start hung on a FIFO");
        assert_eq!(found, 0);
        assert!(!fifo.exists(), "not one of ours: removed");
        for i in 0..MAX_LEFTOVERS + 20 {
            fs::create_dir(state.path().join(PINS_DIR).join(format!("planted{i}"))).unwrap();
        }
        let pins = Pins::open(state.path()).unwrap();
        assert!(pins.leftovers(run.path()).is_empty());
        let left = fs::read_dir(state.path().join(PINS_DIR)).unwrap().count();
        assert_eq!(left, 20, "read (and removed) only MAX_LEFTOVERS");
    }

    /// A pin planted in the state folder, with a record that names a deleted checkpoint of the
    /// run but not authenticated by `pins.key` (none, a forged one, or one of another state
    /// folder's key), is removed at start, never offered for evaluation; the daemon's own is.
    #[test]
    fn forged_pins_are_removed_not_evaluated() {
        let run = tempfile::tempdir().unwrap();
        let state = tempfile::tempdir().unwrap();
        let other_state = tempfile::tempdir().unwrap();
        let ck = run.path().join("ckpt_000999.pt");
        fs::write(&ck, b"weights").unwrap();
        let key = key_of(&ck);
        let own = Pins::open(state.path())
            .unwrap()
            .pin(&ck, &key, 999)
            .unwrap();
        own.leave_on_disk();
        let other = Pins::open(other_state.path()).unwrap();
        let record = |mac: Option<String>| {
            let mut v = serde_json::json!({"key": key, "step": 999});
            if let Some(mac) = mac {
                v["mac"] = mac.into();
            }
            v.to_string()
        };
        let planted = [
            record(None),
            record(Some("00".repeat(32))),
            record(Some(other.mac(&key, 999))),
        ];
        for (i, text) in planted.iter().enumerate() {
            let folder = state.path().join(PINS_DIR).join(format!("planted{i}"));
            fs::create_dir(&folder).unwrap();
            fs::write(folder.join("ckpt_000999.pt"), b"attacker's weights").unwrap();
            fs::write(folder.join(KEY_FILE), text).unwrap();
        }
        drop(own);
        fs::remove_file(&ck).unwrap(); // rotation
        let left = Pins::open(state.path()).unwrap().leftovers(run.path());
        assert_eq!(left.len(), 1, "only the daemon's own pin");
        assert_eq!(fs::read(left[0].pin.path()).unwrap(), b"weights");
        let names: Vec<_> = fs::read_dir(state.path().join(PINS_DIR))
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        assert!(names.iter().all(|n| !n.starts_with("planted")), "{names:?}");
    }

    /// At most MAX_PINS at once; a dropped pin frees its place.
    #[test]
    fn pins_are_bounded() {
        let run = tempfile::tempdir().unwrap();
        let state = tempfile::tempdir().unwrap();
        let pins = Pins::open(state.path()).unwrap();
        let mut held = Vec::new();
        for i in 0..=MAX_PINS {
            let ck = run.path().join(format!("ckpt_{i}.pt"));
            fs::write(&ck, b"w").unwrap();
            held.push(pins.pin(&ck, &key_of(&ck), i as i64));
        }
        assert!(held[..MAX_PINS].iter().all(Option::is_some));
        assert!(held[MAX_PINS].is_none());
        held.remove(0);
        let ck = run.path().join(format!("ckpt_{MAX_PINS}.pt"));
        assert!(pins.pin(&ck, &key_of(&ck), MAX_PINS as i64).is_some());
    }
}
