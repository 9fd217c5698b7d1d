//! What survives a restart: atomic file writes, the outbox (one JSON file per pending
//! (event, destination)) and the delivered-ledger.

use super::event::Event;
use serde::{Deserialize, Serialize};
use std::collections::{HashSet, VecDeque};
use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

/// Writes `bytes` to `path` atomically: an exclusive temporary file with a random name in the
/// same folder (never through a planted link), fsync, rename over `path`, fsync of the folder.
/// Readers see the old content or the new one, never a part.
pub fn atomic_write(path: &Path, bytes: &[u8]) -> io::Result<()> {
    crate::safe_fs::atomic_write(path, bytes)
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

use crate::safe_fs::{parent, sync_dir};

/// A temporary file of [`atomic_write`], or of the versions before it (`.<name>.tmp.<pid>.<n>`).
fn is_temp_name(name: &str) -> bool {
    crate::safe_fs::is_temp_name(name, None)
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

/// `<state_dir>/outbox/`: one `<event id>.<destination key>.json` per pending delivery.
#[derive(Debug)]
pub struct Outbox {
    dir: PathBuf,
}

impl Outbox {
    pub fn open(dir: PathBuf) -> io::Result<Outbox> {
        crate::safe_fs::create_private_dir(&dir)?;
        Ok(Outbox { dir })
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
        let bytes = serde_json::to_vec_pretty(entry).map_err(io::Error::other)?;
        match atomic_write(&path, &bytes) {
            // The state folder was deleted under the daemon: re-created (its parent must exist).
            Err(e) if e.kind() == io::ErrorKind::NotFound && parent(&self.dir).is_dir() => {
                crate::safe_fs::create_private_dir(&self.dir)?;
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
    /// removed; unreadable entries are logged and renamed to `*.corrupt` so that they neither
    /// break start-up nor get logged again.
    pub fn load(&self) -> io::Result<Vec<Entry>> {
        let mut entries = Vec::new();
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
            let parsed = fs::read(&path)
                .map_err(|e| e.to_string())
                .and_then(|b| serde_json::from_slice::<Entry>(&b).map_err(|e| e.to_string()));
            match parsed {
                Ok(entry) => entries.push(entry),
                Err(reason) => {
                    let aside = path.with_extension("json.corrupt");
                    let moved = fs::rename(&path, &aside).is_ok();
                    tracing::warn!(
                        path = %path.display(),
                        %reason,
                        moved_to = %if moved { aside.display().to_string() } else { "-".into() },
                        "skipping an unreadable outbox entry"
                    );
                }
            }
        }
        entries.sort_by_key(|e| e.seq);
        Ok(entries)
    }
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
        match fs::read(&ledger.path) {
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
        let ob = Outbox::open(dir.path().join("outbox")).unwrap();
        let a = Entry::new("webhook-1", &event(2));
        let b = Entry::new("webhook-1", &event(3));
        ob.put(&b).unwrap();
        ob.put(&a).unwrap();
        // A crash mid-write: a truncated entry and a leftover temporary file.
        let full = serde_json::to_string(&Entry::new("webhook-1", &event(4))).unwrap();
        fs::write(ob.dir().join("x.webhook-1.json"), &full[..full.len() / 2]).unwrap();
        fs::write(ob.dir().join(".y.json.tmp.1.2"), "{").unwrap();
        fs::write(ob.dir().join("empty.webhook-1.json"), "").unwrap();
        let loaded = ob.load().unwrap();
        assert_eq!(
            loaded,
            vec![a.clone(), b.clone()],
            "oldest first, corrupt skipped"
        );
        assert!(ob.dir().join("x.webhook-1.json.corrupt").exists());
        assert!(!ob.dir().join(".y.json.tmp.1.2").exists());
        // Loading again does not see the corrupt files any more.
        assert_eq!(ob.load().unwrap().len(), 2);
        assert!(ob.remove(&a.event.id, "webhook-1").unwrap());
        assert_eq!(ob.load().unwrap(), vec![b]);
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
        let ob = Outbox::open(dir.path().join("outbox")).unwrap();
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
        assert_eq!(ob.load().unwrap(), vec![e]);
        assert_eq!(fs::read_to_string(&victim).unwrap(), "precious");
        let mode = fs::metadata(ob.dir()).unwrap().permissions();
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(mode.mode() & 0o777, 0o700);
    }
}
