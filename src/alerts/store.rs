//! What survives a restart: atomic file writes, the outbox (one JSON file per pending
//! (event, destination)) and the delivered-ledger.

use super::event::Event;
use crate::sign::Secret;
use serde::{Deserialize, Serialize};
use std::collections::{HashMap, HashSet, VecDeque};
use std::fmt;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

/// Writes `bytes` to `path` atomically: an exclusive temporary file with a random name in the
/// same folder (never through a planted link), fsync, rename over `path`, fsync of the folder.
/// Readers see the old content or the new one, never a part.
pub fn atomic_write(path: &Path, bytes: &[u8]) -> io::Result<()> {
    crate::store::safe_fs::atomic_write(path, bytes)
}

/// Removes `path` (absent is fine) and syncs its folder. Returns whether it existed.
pub fn remove_durably(path: &Path) -> io::Result<bool> {
    match fs::remove_file(path) {
        Ok(()) => {
            sync_dir(parent(path));
            Ok(true)
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(e),
    }
}

use crate::store::safe_fs::{parent, sync_dir};

/// A temporary file of [`atomic_write`], or of the versions before it (`.<name>.tmp.<pid>.<n>`).
fn is_temp_name(name: &str) -> bool {
    crate::store::safe_fs::is_temp_name(name, None)
}

/// A monotonic sequence number (unix nanoseconds at creation, strictly increasing in this
/// process) that orders entries of one destination across restarts.
pub fn next_seq() -> u64 {
    static LAST: AtomicU64 = AtomicU64::new(0);
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    let mut prev = LAST.load(Ordering::Relaxed);
    loop {
        let next = now.max(prev + 1);
        match LAST.compare_exchange_weak(prev, next, Ordering::Relaxed, Ordering::Relaxed) {
            Ok(_) => return next,
            Err(p) => prev = p,
        }
    }
}

/// One pending delivery of one event to one destination.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Entry {
    pub version: u32,
    /// The destination's key (see `Destination::key`).
    pub dest: String,
    /// Creation order, see [`next_seq`].
    pub seq: u64,
    pub event: Event,
}

impl Entry {
    pub fn new(dest: &str, event: &Event) -> Entry {
        Entry {
            version: 1,
            dest: dest.to_string(),
            seq: next_seq(),
            event: event.clone(),
        }
    }

    pub fn key(&self) -> String {
        delivery_key(&self.event.id, &self.dest)
    }
}

/// `"{event id}/{destination key}"`: the unit of idempotency.
pub fn delivery_key(id: &str, dest: &str) -> String {
    format!("{id}/{dest}")
}

/// The first line of an outbox entry: this tag, a space and the hex HMAC-SHA256 of the JSON that
/// follows, under its destination's [`entry_key`].
const ENTRY_TAG: &str = "diffmon-outbox-v2";
/// The most of an outbox file that is read: entries are a few hundred bytes.
const MAX_ENTRY_BYTES: u64 = 1 << 20;

/// The state folder's own random key for the outbox (32 bytes in `path`, mode 0600), made at the
/// first start (again when it is unreadable or not 32 bytes: entries written under the old one
/// are then refused, and the history's replay sends again what was not delivered).
pub fn state_key(path: &Path) -> io::Result<[u8; 32]> {
    crate::store::safe_fs::private_key(
        path,
        "the outbox key",
        "pending alerts written under the old one are refused, and the history's replay sends \
         again what was not delivered",
    )
}

/// The key that authenticates the outbox entries of destination `dest`: derived from the state
/// folder's key and, for a signed destination, its secret too, so that an entry that would be
/// delivered with a valid signature cannot be made without the secret.
pub fn entry_key(state_key: &[u8; 32], dest: &str, secret: Option<&Secret>) -> [u8; 32] {
    let context = format!("{ENTRY_TAG}\n{dest}\n");
    let own = hmac(state_key, context.as_bytes());
    match secret {
        Some(secret) => hmac(&secret.derive(context.as_bytes()), &own),
        None => own,
    }
}

fn hmac(key: &[u8], message: &[u8]) -> [u8; 32] {
    use hmac::Mac;
    let Ok(mut mac) = hmac::Hmac::<sha2::Sha256>::new_from_slice(key) else {
        unreachable!("HMAC accepts keys of any length")
    };
    mac.update(message);
    mac.finalize().into_bytes().into()
}

/// Why an outbox file was not taken.
enum Unread {
    /// Not an entry (half-written, not JSON): renamed to `*.corrupt`.
    Corrupt(String),
    /// An entry for a configured destination whose MAC does not verify (planted, or written by
    /// a version without MACs): renamed to `*.unauthenticated`, counted.
    Unauthenticated { dest: String, reason: &'static str },
}

/// What [`Outbox::load`] found.
#[derive(Debug, Default)]
pub struct Loaded {
    /// Readable, authenticated entries (or entries for destinations no longer configured, which
    /// cannot be checked and are not delivered), oldest first.
    pub entries: Vec<Entry>,
    /// The destination keys of the entries refused as unauthenticated.
    pub refused: Vec<String>,
}

/// `<state_dir>/outbox/`: one `<event id>.<destination key>.json` per pending delivery, each
/// authenticated by a MAC under its destination's key ([`entry_key`]).
pub struct Outbox {
    dir: PathBuf,
    /// Per destination key.
    keys: HashMap<String, [u8; 32]>,
}

impl fmt::Debug for Outbox {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Outbox").field("dir", &self.dir).finish()
    }
}

impl Outbox {
    /// The outbox in `dir` for the destinations of `keys` (destination key → [`entry_key`]).
    pub fn open(dir: PathBuf, keys: HashMap<String, [u8; 32]>) -> io::Result<Outbox> {
        crate::store::safe_fs::create_private_dir(&dir)?;
        Ok(Outbox { dir, keys })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn path(&self, id: &str, dest: &str) -> PathBuf {
        // Ids are hex digests made here, destination keys are [a-z0-9-]: safe file names. An id
        // from elsewhere is reduced to safe characters.
        let safe: String = id
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                    c
                } else {
                    '_'
                }
            })
            .collect();
        self.dir.join(format!("{safe}.{dest}.json"))
    }

    pub fn put(&self, entry: &Entry) -> io::Result<PathBuf> {
        let path = self.path(&entry.event.id, &entry.dest);
        let json = serde_json::to_vec_pretty(entry).map_err(io::Error::other)?;
        let key = self.keys.get(&entry.dest).ok_or_else(|| {
            io::Error::other(format!("no outbox key for destination {}", entry.dest))
        })?;
        let mut bytes =
            format!("{ENTRY_TAG} {}\n", super::event::hex(&hmac(key, &json))).into_bytes();
        bytes.extend_from_slice(&json);
        match atomic_write(&path, &bytes) {
            // The state folder was deleted under the daemon: re-created (its parent must exist).
            Err(e) if e.kind() == io::ErrorKind::NotFound && parent(&self.dir).is_dir() => {
                crate::store::safe_fs::create_private_dir(&self.dir)?;
                atomic_write(&path, &bytes)?;
            }
            other => other?,
        }
        Ok(path)
    }

    pub fn remove(&self, id: &str, dest: &str) -> io::Result<bool> {
        remove_durably(&self.path(id, dest))
    }

    /// Every readable entry, oldest first. Leftover temporary files (a crash mid-write) are
    /// removed; unreadable entries are logged and renamed to `*.corrupt`, and entries for a
    /// configured destination whose MAC does not verify to `*.unauthenticated` (listed in
    /// [`Loaded::refused`]), so that they neither break start-up, nor get delivered, nor get
    /// logged again.
    pub fn load(&self) -> io::Result<Loaded> {
        let mut loaded = Loaded::default();
        for item in fs::read_dir(&self.dir)? {
            let item = item?;
            let path = item.path();
            let name = item.file_name().to_string_lossy().into_owned();
            if is_temp_name(&name) {
                let _ = fs::remove_file(&path);
                continue;
            }
            if !name.ends_with(".json") || !item.file_type().map(|t| t.is_file()).unwrap_or(false) {
                continue;
            }
            let (aside, reason) = match self.read(&path) {
                Ok(entry) => {
                    loaded.entries.push(entry);
                    continue;
                }
                Err(Unread::Corrupt(reason)) => (path.with_extension("json.corrupt"), reason),
                Err(Unread::Unauthenticated { dest, reason }) => {
                    loaded.refused.push(dest);
                    (
                        path.with_extension("json.unauthenticated"),
                        reason.to_string(),
                    )
                }
            };
            let moved = fs::rename(&path, &aside).is_ok();
            tracing::warn!(
                path = %crate::store::safe_fs::untrusted(&path),
                %reason,
                moved_to = %if moved { crate::store::safe_fs::untrusted(&aside) } else { "-".into() },
                "skipping an outbox entry: not delivered"
            );
        }
        loaded.entries.sort_by_key(|e| e.seq);
        Ok(loaded)
    }

    /// One entry file, bounded, not through a link, checked against its destination's key.
    fn read(&self, path: &Path) -> Result<Entry, Unread> {
        use std::io::Read;
        use std::os::unix::fs::OpenOptionsExt;
        let mut bytes = Vec::new();
        fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC | libc::O_NONBLOCK)
            .open(path)
            .and_then(|f| f.take(MAX_ENTRY_BYTES + 1).read_to_end(&mut bytes))
            .map_err(|e| Unread::Corrupt(e.to_string()))?;
        if bytes.len() as u64 > MAX_ENTRY_BYTES {
            return Err(Unread::Corrupt(format!(
                "larger than {MAX_ENTRY_BYTES} bytes"
            )));
        }
        let (mac, json) = match bytes.iter().position(|&b| b == b'\n') {
            Some(n) if bytes.starts_with(ENTRY_TAG.as_bytes()) => {
                let mac = std::str::from_utf8(&bytes[ENTRY_TAG.len()..n])
                    .ok()
                    .map(|m| m.trim().to_string());
                (mac, &bytes[n + 1..])
            }
            _ => (None, &bytes[..]),
        };
        let entry: Entry =
            serde_json::from_slice(json).map_err(|e| Unread::Corrupt(e.to_string()))?;
        let Some(key) = self.keys.get(&entry.dest) else {
            // Not configured any more: kept on disk and not delivered (the caller says so).
            return Ok(entry);
        };
        let refuse = |reason| Unread::Unauthenticated {
            dest: entry.dest.clone(),
            reason,
        };
        let Some(mac) = mac else {
            return Err(refuse(
                "no MAC (planted, or written by an earlier version: the history's replay sends again what was not delivered)",
            ));
        };
        let expected = super::event::hex(&hmac(key, json));
        if !constant_time_eq(mac.as_bytes(), expected.as_bytes()) {
            return Err(refuse(
                "its MAC does not verify under the daemon's key: not written by this daemon",
            ));
        }
        Ok(entry)
    }
}

/// Equal bytes, compared in time independent of where they differ.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[derive(Serialize, Deserialize)]
struct LedgerFile {
    version: u32,
    delivered: Vec<String>,
}

/// The delivered-ledger: the most recent [`Ledger::CAPACITY`] delivery keys
/// (`"{event id}/{destination key}"`) that were accepted, in `<state_dir>/alerts_delivered.json`.
/// Sending an event whose key is here again is a no-op.
#[derive(Debug)]
pub struct Ledger {
    path: PathBuf,
    order: VecDeque<String>,
    set: HashSet<String>,
}

impl Ledger {
    pub const CAPACITY: usize = 1000;

    /// Loads the ledger; a missing file is empty, an unreadable one is logged and treated as
    /// empty (at worst an old event is delivered once more).
    pub fn load(path: PathBuf) -> Ledger {
        let mut ledger = Ledger {
            path,
            order: VecDeque::new(),
            set: HashSet::new(),
        };
        // No link followed, no FIFO waited on, bounded: a full ledger is some 100 KB.
        match crate::store::safe_fs::read_bounded(&ledger.path, 4 << 20) {
            Ok(bytes) => match serde_json::from_slice::<LedgerFile>(&bytes) {
                Ok(file) => {
                    for key in file.delivered {
                        ledger.remember(key);
                    }
                }
                Err(e) => tracing::warn!(
                    path = %ledger.path.display(),
                    reason = %e,
                    "the delivered-ledger is unreadable; starting with an empty one"
                ),
            },
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => tracing::warn!(
                path = %ledger.path.display(),
                reason = %e,
                "cannot read the delivered-ledger; starting with an empty one"
            ),
        }
        ledger
    }

    pub fn contains(&self, key: &str) -> bool {
        self.set.contains(key)
    }

    fn remember(&mut self, key: String) {
        if self.set.insert(key.clone()) {
            self.order.push_back(key);
        }
        while self.order.len() > Self::CAPACITY {
            if let Some(old) = self.order.pop_front() {
                self.set.remove(&old);
            }
        }
    }

    /// Records a delivery and writes the ledger atomically.
    pub fn insert(&mut self, key: String) -> io::Result<()> {
        self.remember(key);
        self.write()
    }

    /// Writes the ledger atomically (again, after the state folder was made anew).
    pub fn write(&self) -> io::Result<()> {
        let file = LedgerFile {
            version: 1,
            delivered: self.order.iter().cloned().collect(),
        };
        let bytes = serde_json::to_vec_pretty(&file).map_err(io::Error::other)?;
        atomic_write(&self.path, &bytes)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::alerts::event::EventKind;

    fn event(step: i64) -> Event {
        Event::new(EventKind::EarlyStop, "r", "icr", 1, "c", 0.1, step, 0.2)
    }

    fn keys() -> HashMap<String, [u8; 32]> {
        HashMap::from([(
            "webhook-1".to_string(),
            entry_key(&[7; 32], "webhook-1", None),
        )])
    }

    #[test]
    fn atomic_write_replaces_and_leaves_no_temp() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("f.json");
        atomic_write(&p, b"one").unwrap();
        atomic_write(&p, b"two").unwrap();
        assert_eq!(fs::read(&p).unwrap(), b"two");
        let names: Vec<_> = fs::read_dir(dir.path()).unwrap().collect();
        assert_eq!(names.len(), 1);
        assert!(remove_durably(&p).unwrap());
        assert!(!remove_durably(&p).unwrap());
    }

    #[test]
    fn outbox_round_trip_skips_half_written_files() {
        let dir = tempfile::tempdir().unwrap();
        let ob = Outbox::open(dir.path().join("outbox"), keys()).unwrap();
        let a = Entry::new("webhook-1", &event(2));
        let b = Entry::new("webhook-1", &event(3));
        ob.put(&b).unwrap();
        ob.put(&a).unwrap();
        // A crash mid-write: a truncated entry and a leftover temporary file.
        let full = serde_json::to_string(&Entry::new("webhook-1", &event(4))).unwrap();
        fs::write(ob.dir().join("x.webhook-1.json"), &full[..full.len() / 2]).unwrap();
        fs::write(ob.dir().join(".y.json.tmp.1.2"), "{").unwrap();
        fs::write(ob.dir().join("empty.webhook-1.json"), "").unwrap();
        let loaded = ob.load().unwrap().entries;
        assert_eq!(
            loaded,
            vec![a.clone(), b.clone()],
            "oldest first, corrupt skipped"
        );
        assert!(ob.dir().join("x.webhook-1.json.corrupt").exists());
        assert!(!ob.dir().join(".y.json.tmp.1.2").exists());
        // Loading again does not see the corrupt files any more.
        assert_eq!(ob.load().unwrap().entries.len(), 2);
        assert!(ob.remove(&a.event.id, "webhook-1").unwrap());
        assert_eq!(ob.load().unwrap().entries, vec![b]);
    }

    #[test]
    fn entries_not_written_under_the_daemons_key_are_refused_and_set_aside() {
        let dir = tempfile::tempdir().unwrap();
        let ob = Outbox::open(dir.path().join("outbox"), keys()).unwrap();
        let genuine = Entry::new("webhook-1", &event(2));
        ob.put(&genuine).unwrap();
        let mut forged = Entry::new("webhook-1", &event(3));
        forged.event.best_checkpoint = "FORGED: rm -rf checkpoints/".into();
        let json = serde_json::to_vec_pretty(&forged).unwrap();
        // Plain JSON (the format before MACs), a MAC under another key, a genuine MAC over
        // other content.
        fs::write(ob.dir().join("a.webhook-1.json"), &json).unwrap();
        let other = hmac(&entry_key(&[8; 32], "webhook-1", None), &json);
        let mut under_other =
            format!("{ENTRY_TAG} {}\n", super::super::event::hex(&other)).into_bytes();
        under_other.extend_from_slice(&json);
        fs::write(ob.dir().join("b.webhook-1.json"), &under_other).unwrap();
        let real = fs::read(ob.path(&genuine.event.id, "webhook-1")).unwrap();
        let n = real.iter().position(|&b| b == b'\n').unwrap();
        let mut swapped = real[..=n].to_vec();
        swapped.extend_from_slice(&json);
        fs::write(ob.dir().join("c.webhook-1.json"), &swapped).unwrap();
        let loaded = ob.load().unwrap();
        assert_eq!(loaded.entries, vec![genuine]);
        assert_eq!(loaded.refused.len(), 3);
        for f in ["a", "b", "c"] {
            assert!(
                ob.dir()
                    .join(format!("{f}.webhook-1.json.unauthenticated"))
                    .exists()
            );
        }
        assert!(ob.load().unwrap().refused.is_empty(), "set aside once");
        // A signed destination's key needs its secret.
        let secret = crate::sign::Secret::parse("whsec_c2VjcmV0LWtleS1ieXRlcw==").unwrap();
        assert_ne!(
            entry_key(&[7; 32], "webhook-1", Some(&secret)),
            entry_key(&[7; 32], "webhook-1", None)
        );
    }

    #[test]
    fn the_state_key_is_made_once_private_and_remade_when_broken() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("alerts.key");
        let k = state_key(&path).unwrap();
        assert_eq!(state_key(&path).unwrap(), k);
        assert_eq!(
            fs::metadata(&path).unwrap().permissions().mode() & 0o777,
            0o600
        );
        // Found readable by others (issue #45): the same key, made private.
        fs::set_permissions(&path, fs::Permissions::from_mode(0o644)).unwrap();
        assert_eq!(state_key(&path).unwrap(), k);
        assert_eq!(
            fs::metadata(&path).unwrap().permissions().mode() & 0o777,
            0o600
        );
        fs::write(&path, "short").unwrap();
        assert_ne!(state_key(&path).unwrap(), k);
    }

    #[test]
    fn ledger_persists_and_is_bounded() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("alerts_delivered.json");
        let mut l = Ledger::load(path.clone());
        l.insert("a/x".into()).unwrap();
        l.insert("b/x".into()).unwrap();
        let l2 = Ledger::load(path.clone());
        assert!(l2.contains("a/x") && l2.contains("b/x") && !l2.contains("c/x"));
        let mut l3 = Ledger::load(path.clone());
        for i in 0..Ledger::CAPACITY {
            l3.remember(format!("k{i}"));
        }
        l3.insert("last".into()).unwrap();
        let l4 = Ledger::load(path.clone());
        assert!(!l4.contains("a/x") && !l4.contains("b/x"));
        assert!(l4.contains("last") && l4.contains("k999"));
        fs::write(&path, "{not json").unwrap();
        assert!(!Ledger::load(path.clone()).contains("last"));
        // A link to /dev/zero is not followed, a FIFO not waited on (issue #45: the ledger grew
        // to 1.2 GB before a warning), an oversized file not read: each an empty ledger.
        fs::remove_file(&path).unwrap();
        std::os::unix::fs::symlink("/dev/zero", &path).unwrap();
        assert!(!Ledger::load(path.clone()).contains("last"));
        fs::remove_file(&path).unwrap();
        let c = std::ffi::CString::new(path.to_str().unwrap()).unwrap();
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        assert!(!Ledger::load(path.clone()).contains("last"));
        fs::remove_file(&path).unwrap();
        fs::write(&path, vec![b' '; 5 << 20]).unwrap();
        assert!(!Ledger::load(path).contains("last"));
    }

    #[test]
    fn seq_is_strictly_increasing() {
        let a = next_seq();
        let b = next_seq();
        assert!(b > a);
    }

    #[test]
    fn outbox_and_ledger_writes_never_follow_links_at_temporary_names() {
        let dir = tempfile::tempdir().unwrap();
        let victim = dir.path().join("victim");
        fs::write(&victim, "precious").unwrap();
        let ob = Outbox::open(dir.path().join("outbox"), keys()).unwrap();
        let e = Entry::new("webhook-1", &event(7));
        let final_name = ob
            .path(&e.event.id, "webhook-1")
            .file_name()
            .unwrap()
            .to_string_lossy()
            .into_owned();
        // The old names `.<name>.tmp.<pid>.<n>` this process would have used.
        for n in 0..64 {
            let at = ob
                .dir()
                .join(format!(".{final_name}.tmp.{}.{n}", std::process::id()));
            std::os::unix::fs::symlink(&victim, at).unwrap();
        }
        ob.put(&e).unwrap();
        let mut l = Ledger::load(dir.path().join("alerts_delivered.json"));
        l.insert("a/x".into()).unwrap();
        assert_eq!(fs::read_to_string(&victim).unwrap(), "precious");
        // The links are cleaned up as leftovers; the victim stays.
        assert_eq!(ob.load().unwrap().entries, vec![e]);
        assert_eq!(fs::read_to_string(&victim).unwrap(), "precious");
        let mode = fs::metadata(ob.dir()).unwrap().permissions();
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(mode.mode() & 0o777, 0o700);
    }
}
