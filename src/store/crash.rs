//! What makes the process die, recorded so that a restart does not repeat it (docs/design.md §10:
//! a malformed file is a recorded failure, never a crash loop).
//!
//! - **Crash marker.** Before the evaluator starts on a checkpoint it tells [`evaluating`] which
//!   one (its key and step, serialized into a preallocated static slot). A fatal signal
//!   (SIGSEGV, SIGBUS, SIGILL, SIGFPE, SIGABRT) runs an async-signal-safe handler that writes
//!   that checkpoint and the signal to `<state_dir>/crash` through a descriptor opened by [`arm`],
//!   then lets the previous handler run (Rust's stack-overflow report stays) and dies of the
//!   signal with its default action. A panic of the evaluator thread writes the same marker. The
//!   next start reads it ([`read_marker`]) and records the checkpoint as a failure with reason
//!   [`crate::record::FailureReason::Crashed`], so it is counted and never evaluated again.
//! - **The watcher's structure checks are guarded the same way.** The watcher opens a file for a
//!   checkpoint (to tell whether it is complete) before it is ever evaluated; a file that kills
//!   the process there would otherwise blame nothing and kill every restart. A watcher thread
//!   holds a [`ThreadMarker`] (`<state_dir>/crash-scan`, its own slot) and names the unit it is
//!   checking ([`ThreadMarker::checking`]); a fatal signal or a panic on that thread writes that
//!   unit to its marker, which [`read_marker`] reads like the evaluator's. The handler blames the
//!   checkpoint of the thread that died; a signal on a thread with nothing in flight (a libtorch
//!   worker, a `kill`) blames the evaluator's checkpoint, as before.
//! - **Deaths without a marker while a checkpoint is read are counted.** A SIGKILL (the kernel's
//!   out-of-memory killer, a service manager's timeout) runs no handler. While the evaluator
//!   reads a checkpoint's weights (the one phase whose memory the checkpoint decides: after
//!   it, what an evaluation takes depends on the architecture and the config only), that
//!   checkpoint is also kept in `<state_dir>/crash-in-flight` with the number of process starts
//!   that began reading it ([`evaluating`]; emptied by [`weights_read`] once the read ends, when
//!   the evaluation is done, and by [`disarm`] on a shutdown that leaves it behind). One such
//!   death is an interrupted evaluation, evaluated again; after [`MAX_DEATHS_IN_FLIGHT`] deaths
//!   with the same checkpoint being read, [`read_marker`] reports it as a crash, so a checkpoint
//!   that gets the process killed for memory is recorded as a `crashed` failure instead of being
//!   retried forever. A kill during the rest of an evaluation (an operator, a crash-loop test)
//!   is not counted.
//! - **Supervision.** [`on_panic`] makes a panic in any thread of the process (watcher,
//!   evaluator, recorder, tokio tasks) fatal: logged with the thread's name, then the process
//!   exits with status 1 ([`exit_now`]), so a service manager's `Restart=on-failure` restarts it.

use crate::store::history::CheckpointKey;
use serde::{Deserialize, Serialize};
use std::io::Read;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::os::unix::io::{FromRawFd, IntoRawFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU8, AtomicUsize, Ordering};

/// The marker's file name inside the state folder.
pub const MARKER_FILE: &str = "crash";
/// The marker of the watcher's structure checks ([`ThreadMarker`]).
pub const SCAN_MARKER_FILE: &str = "crash-scan";
/// The evaluator's checkpoint in flight and how many process starts began it.
pub const IN_FLIGHT_FILE: &str = "crash-in-flight";

/// Process deaths without a marker (SIGKILL: out of memory, ...) while the same checkpoint's
/// weights were being read, after which it is recorded as `crashed` instead of evaluated again.
pub const MAX_DEATHS_IN_FLIGHT: u64 = 3;

const HEADER: &[u8] = b"diffmon crash marker v1\n";
const IN_FLIGHT_HEADER: &[u8] = b"diffmon in flight v1\n";

/// Room for the serialized checkpoint in flight (a path of `PATH_MAX` bytes escaped as JSON).
const CAPACITY: usize = 64 * 1024;

/// The most of a marker file that is read back.
const MAX_MARKER: u64 = 2 * CAPACITY as u64;

/// The fatal signals that leave a marker.
const SIGNALS: [libc::c_int; 5] = [
    libc::SIGSEGV,
    libc::SIGBUS,
    libc::SIGILL,
    libc::SIGFPE,
    libc::SIGABRT,
];

/// One thread's checkpoint in flight. Slot 0 is the evaluator's (written to the marker [`arm`]
/// opened); the others are claimed by [`ThreadMarker`]s, each with its own marker file.
struct Slot {
    /// The thread (`gettid`) whose checkpoint this is; 0 when free.
    owner: AtomicI32,
    /// The marker's descriptor for this slot; -1: the evaluator's ([`MARKER_FD`]).
    fd: AtomicI32,
    /// Bytes of `bytes` that hold the checkpoint in flight; 0 when none.
    len: AtomicUsize,
    bytes: [AtomicU8; CAPACITY],
}

impl Slot {
    const fn new() -> Slot {
        Slot {
            owner: AtomicI32::new(0),
            fd: AtomicI32::new(-1),
            len: AtomicUsize::new(0),
            bytes: [const { AtomicU8::new(0) }; CAPACITY],
        }
    }

    /// Names `what` (not for signal handlers: it allocates).
    fn set(&self, what: Option<&InFlight>) -> bool {
        self.len.store(0, Ordering::Release);
        let Some(what) = what else { return true };
        let json = serde_json::to_vec(what).expect("keys serialize");
        if json.len() > CAPACITY {
            return false;
        }
        for (slot, &b) in self.bytes.iter().zip(&json) {
            slot.store(b, Ordering::Relaxed);
        }
        self.len.store(json.len(), Ordering::Release);
        true
    }
}

/// The evaluator's slot and one per watcher thread (a sweep has one watcher per run; a watcher
/// beyond these checks without a guard, with a warning).
const SLOTS: usize = 16;
static SLOT: [Slot; SLOTS] = [const { Slot::new() }; SLOTS];
/// The marker's descriptor, or -1 when unarmed.
static MARKER_FD: AtomicI32 = AtomicI32::new(-1);
/// The in-flight file's descriptor (see [`evaluating`]), or -1.
static IN_FLIGHT_FD: AtomicI32 = AtomicI32::new(-1);
/// The marker was written (a crash writes it once, whatever follows).
static WRITTEN: AtomicBool = AtomicBool::new(false);
static HANDLERS_INSTALLED: AtomicBool = AtomicBool::new(false);
/// The handlers the fatal-signal handler found (`sa_sigaction`, `sa_flags`), run after it.
static PREVIOUS: [(AtomicUsize, AtomicI32); 5] =
    [const { (AtomicUsize::new(libc::SIG_DFL), AtomicI32::new(0)) }; 5];

/// The calling thread's id; async-signal-safe.
fn tid() -> i32 {
    // SAFETY: gettid takes no arguments and cannot fail.
    unsafe { libc::syscall(libc::SYS_gettid) as i32 }
}

/// The checkpoint being evaluated, as the marker names it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct InFlight {
    pub key: CheckpointKey,
    pub step: i64,
    /// The compiled package on trial that runs this evaluation ([`crate::store::package_trial`]):
    /// a fatal signal is then the package's, not the checkpoint's ([`Crash::package_blamed`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub package_on_trial: Option<String>,
}

/// What a marker says: how the process died, and what it was evaluating.
#[derive(Debug, Clone, PartialEq)]
pub struct Crash {
    /// `SIGSEGV`, `SIGABRT`, ... or `a panic: <message>`.
    pub cause: String,
    /// It died of a fatal signal (native code: libtorch, a compiled package), not of a panic
    /// of diffmon's own code nor of kills counted without a marker.
    pub signal: bool,
    pub checkpoint: Option<InFlight>,
}

impl Crash {
    /// The compiled package on trial that a fatal signal is blamed on instead of the checkpoint
    /// in flight, if any.
    pub fn package_blamed(&self) -> Option<&str> {
        self.checkpoint
            .as_ref()
            .and_then(|c| c.package_on_trial.as_deref())
            .filter(|_| self.signal)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum CrashError {
    #[error("{path}: {message}")]
    Marker { path: PathBuf, message: String },
    #[error("{path}: cannot {action} the crash marker: {source}")]
    Io {
        path: PathBuf,
        /// `create` or `read`.
        action: &'static str,
        #[source]
        source: std::io::Error,
    },
}

/// Names the checkpoint the evaluator starts on (`None` once it is done with it), in the crash
/// marker's slot and in the in-flight file (with the number of starts that began it: one more
/// than the file says when it names the same checkpoint, else 1). Not for signal handlers: it
/// allocates.
pub fn evaluating(what: Option<&InFlight>) {
    let slot = &SLOT[0];
    slot.owner.store(tid(), Ordering::Release);
    if !slot.set(what)
        && let Some(what) = what
    {
        tracing::warn!(
            checkpoint = %what.key.path,
            "the checkpoint's path is too long for the crash marker: a crash while evaluating it would not be recorded"
        );
    }
    let fd = IN_FLIGHT_FD.load(Ordering::Acquire);
    if fd < 0 {
        return;
    }
    // SAFETY: the descriptor is this module's own; the File is never closed here.
    let file = std::mem::ManuallyDrop::new(unsafe { std::fs::File::from_raw_fd(fd) });
    let written = match what {
        None => file.set_len(0),
        Some(what) => {
            let suspects = SUSPECTS.lock().unwrap_or_else(|e| e.into_inner());
            let starts = match suspects.get(&*current_dir()) {
                Some(Some((key, n))) if *key == what.key => n.saturating_add(1),
                _ => 1,
            };
            drop(suspects);
            let mut text = IN_FLIGHT_HEADER.to_vec();
            text.extend(serde_json::to_vec(what).expect("keys serialize"));
            text.extend(format!("\n{starts}\n").bytes());
            file.set_len(0).and_then(|_| file.write_all_at(&text, 0))
        }
    };
    if let Err(e) = written {
        tracing::warn!(
            "cannot write {IN_FLIGHT_FILE} in the state folder ({e}): a checkpoint that gets the process killed may be retried forever"
        );
    }
}

/// Per state folder (as first armed in this process): the checkpoint the last process died
/// with in flight (no marker) and how many starts began it. Kept for the whole process, so that
/// evaluating other checkpoints first does not reset the count.
static SUSPECTS: std::sync::Mutex<
    std::collections::BTreeMap<PathBuf, Option<(CheckpointKey, u64)>>,
> = std::sync::Mutex::new(std::collections::BTreeMap::new());
/// The state folder [`arm`] armed last.
static ARMED_DIR: std::sync::Mutex<Option<PathBuf>> = std::sync::Mutex::new(None);

/// The state folder [`arm`] armed last (empty before).
fn current_dir() -> PathBuf {
    ARMED_DIR
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .clone()
        .unwrap_or_default()
}

/// The in-flight file's checkpoint and its count of starts (`None` when empty or unreadable).
fn read_in_flight(file: &std::fs::File) -> Option<(InFlight, u64)> {
    let mut bytes = vec![0u8; MAX_MARKER as usize];
    let mut n = 0;
    while n < bytes.len() {
        match file.read_at(&mut bytes[n..], n as u64) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(_) => return None,
        }
    }
    let text = std::str::from_utf8(bytes[..n].strip_prefix(IN_FLIGHT_HEADER)?).ok()?;
    let mut lines = text.lines();
    let what: InFlight = serde_json::from_str(lines.next()?).ok()?;
    let starts: u64 = lines.next()?.parse().ok()?;
    Some((what, starts))
}

/// The evaluator is done reading the weights of the checkpoint in flight (successfully or
/// not): a death from now on is not counted against it, and the deaths counted so far are
/// forgotten (see the module docs).
pub fn weights_read() {
    let fd = IN_FLIGHT_FD.load(Ordering::Acquire);
    if fd < 0 {
        return;
    }
    // SAFETY: the descriptor is this module's own; the File is never closed here.
    let file = std::mem::ManuallyDrop::new(unsafe { std::fs::File::from_raw_fd(fd) });
    if let Some((what, _)) = read_in_flight(&file) {
        let mut suspects = SUSPECTS.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(entry) = suspects.get_mut(&*current_dir())
            && entry.as_ref().is_some_and(|(key, _)| *key == what.key)
        {
            *entry = None;
        }
    }
    let _ = file.set_len(0);
}

/// Opens `<state_dir>/<name>` as a fresh, empty marker (removing the last one: read it first).
fn fresh_marker(state_dir: &Path, name: &str) -> Result<std::fs::File, CrashError> {
    let path = state_dir.join(name);
    let err = |source: std::io::Error| CrashError::Io {
        path: path.clone(),
        action: "create",
        source,
    };
    match std::fs::remove_file(&path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(err(e)),
        _ => {}
    }
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(&path)
        .map_err(err)
}

/// Installs the fatal-signal handlers, once per process.
fn install_handlers() {
    if !HANDLERS_INSTALLED.swap(true, Ordering::AcqRel) {
        for (k, &sig) in SIGNALS.iter().enumerate() {
            // SAFETY: a zeroed sigaction is valid; the handler is async-signal-safe.
            unsafe {
                let mut action: libc::sigaction = std::mem::zeroed();
                action.sa_sigaction = on_fatal_signal as *const () as usize;
                action.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK;
                libc::sigemptyset(&mut action.sa_mask);
                let mut previous: libc::sigaction = std::mem::zeroed();
                if libc::sigaction(sig, &action, &mut previous) == 0 {
                    PREVIOUS[k]
                        .0
                        .store(previous.sa_sigaction, Ordering::Release);
                    PREVIOUS[k].1.store(previous.sa_flags, Ordering::Release);
                }
            }
        }
    }
}

/// A crash marker of its own for a thread other than the evaluator: the watcher, whose
/// structure checks open checkpoints before they are evaluated. Made on that thread (the slot
/// belongs to the thread that arms it); dropping it frees the slot.
pub struct ThreadMarker {
    slot: usize,
}

impl ThreadMarker {
    /// Opens a fresh `<state_dir>/crash-scan` (read the last one first: [`read_marker`] does) and
    /// claims a slot for the calling thread. `Ok(None)` when every slot is taken.
    pub fn arm(state_dir: &Path) -> Result<Option<ThreadMarker>, CrashError> {
        let file = fresh_marker(state_dir, SCAN_MARKER_FILE)?;
        let me = tid();
        let Some(slot) = (1..SLOTS).find(|&k| {
            SLOT[k]
                .owner
                .compare_exchange(0, me, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
        }) else {
            return Ok(None);
        };
        SLOT[slot].len.store(0, Ordering::Release);
        SLOT[slot].fd.store(file.into_raw_fd(), Ordering::Release);
        install_handlers();
        Ok(Some(ThreadMarker { slot }))
    }

    /// Names the unit this thread is about to open (`None` once it is done with it): a fatal
    /// signal or a panic of this thread until then writes it to this marker.
    pub fn checking(&self, what: Option<&InFlight>) {
        let slot = &SLOT[self.slot];
        if slot.owner.load(Ordering::Acquire) != tid() {
            return; // not on the thread that armed it: no guard
        }
        slot.set(what);
    }
}

impl Drop for ThreadMarker {
    fn drop(&mut self) {
        let slot = &SLOT[self.slot];
        slot.len.store(0, Ordering::Release);
        let fd = slot.fd.swap(-1, Ordering::AcqRel);
        if fd >= 0 {
            // SAFETY: the descriptor was this marker's own, no longer published.
            unsafe { libc::close(fd) };
        }
        slot.owner.store(0, Ordering::Release);
    }
}

/// Opens a fresh, empty marker in `state_dir` (removing the last one: read it first) and the
/// in-flight file (kept: it counts deaths across starts; emptied if it already reached
/// [`MAX_DEATHS_IN_FLIGHT`], which [`read_marker`] reported), and installs the fatal-signal
/// handlers, once per process.
pub fn arm(state_dir: &Path) -> Result<(), CrashError> {
    let file = fresh_marker(state_dir, MARKER_FILE)?;
    let old = MARKER_FD.swap(file.into_raw_fd(), Ordering::AcqRel);
    if old >= 0 {
        // SAFETY: the descriptor was this module's own, no longer published.
        unsafe { libc::close(old) };
    }
    let path = state_dir.join(IN_FLIGHT_FILE);
    let opened = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(&path)
        .and_then(|f| {
            if f.metadata()?.is_file() {
                Ok(f)
            } else {
                Err(std::io::Error::other("not a regular file"))
            }
        })
        .map_err(|source| CrashError::Io {
            path: path.clone(),
            action: "create",
            source,
        });
    // Not fatal: without it, deaths without a marker are retried as before.
    let in_flight = match opened {
        Ok(f) => f,
        Err(e) => {
            tracing::warn!(
                "{e}; a checkpoint that gets the process killed (out of memory) would be retried at every start"
            );
            let old = IN_FLIGHT_FD.swap(-1, Ordering::AcqRel);
            if old >= 0 {
                // SAFETY: the descriptor was this module's own, no longer published.
                unsafe { libc::close(old) };
            }
            WRITTEN.store(false, Ordering::Release);
            install_handlers();
            return Ok(());
        }
    };
    let last = read_in_flight(&in_flight);
    if last
        .as_ref()
        .is_some_and(|(_, n)| *n >= MAX_DEATHS_IN_FLIGHT)
    {
        let _ = in_flight.set_len(0);
    }
    SUSPECTS
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .entry(state_dir.to_path_buf())
        .or_insert_with(|| {
            last.filter(|(_, n)| *n < MAX_DEATHS_IN_FLIGHT)
                .map(|(what, n)| (what.key, n))
        });
    *ARMED_DIR.lock().unwrap_or_else(|e| e.into_inner()) = Some(state_dir.to_path_buf());
    let old = IN_FLIGHT_FD.swap(in_flight.into_raw_fd(), Ordering::AcqRel);
    if old >= 0 {
        // SAFETY: the descriptor was this module's own, no longer published.
        unsafe { libc::close(old) };
    }
    WRITTEN.store(false, Ordering::Release);
    install_handlers();
    Ok(())
}

/// Stops recording crashes (a shutdown that leaves the evaluator behind: whatever happens then
/// is not the checkpoint's doing), and empties the in-flight file: this death is not the
/// checkpoint's either.
pub fn disarm() {
    MARKER_FD.store(-1, Ordering::Release);
    let fd = IN_FLIGHT_FD.swap(-1, Ordering::AcqRel);
    if fd >= 0 {
        // SAFETY: ftruncate on a descriptor this module owned, no longer published.
        unsafe { libc::ftruncate(fd, 0) };
    }
}

/// Reads what a process that died left in `state_dir`: the evaluator's marker, else the
/// watcher's ([`ThreadMarker`]), else a checkpoint whose weights were being read at
/// [`MAX_DEATHS_IN_FLIGHT`] deaths without a marker. `None` when there is none (or they are
/// empty: the last process did not crash). Markers are bounded and parsed as data.
pub fn read_marker(state_dir: &Path) -> Result<Option<Crash>, CrashError> {
    if let Some(crash) = read_one(&state_dir.join(MARKER_FILE))? {
        return Ok(Some(crash));
    }
    if let Some(mut crash) = read_one(&state_dir.join(SCAN_MARKER_FILE))? {
        crash.cause = format!("{}, in the watcher's structure check", crash.cause);
        return Ok(Some(crash));
    }
    let path = state_dir.join(IN_FLIGHT_FILE);
    let Some(file) = open_marker(&path)? else {
        return Ok(None);
    };
    Ok(read_in_flight(&file)
        .filter(|(_, n)| *n >= MAX_DEATHS_IN_FLIGHT)
        .map(|(what, n)| Crash {
            cause: format!(
                "its weights were being read at {n} process deaths without a crash marker: \
                 killed (SIGKILL), e.g. for memory"
            ),
            signal: false,
            checkpoint: Some(what),
        }))
}

/// Opens a marker for reading without following a link or blocking on a FIFO; `None` if absent.
fn open_marker(path: &Path) -> Result<Option<std::fs::File>, CrashError> {
    let unreadable = |source: std::io::Error| CrashError::Io {
        path: path.to_path_buf(),
        action: "read",
        source,
    };
    let file = match std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(path)
    {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(unreadable(e)),
    };
    let meta = file.metadata().map_err(unreadable)?;
    if !meta.is_file() {
        return Err(CrashError::Marker {
            path: path.to_path_buf(),
            message: "the crash marker is not a regular file".into(),
        });
    }
    Ok(Some(file))
}

fn read_one(path: &Path) -> Result<Option<Crash>, CrashError> {
    let Some(file) = open_marker(path)? else {
        return Ok(None);
    };
    let mut bytes = Vec::new();
    file.take(MAX_MARKER)
        .read_to_end(&mut bytes)
        .map_err(|source| CrashError::Io {
            path: path.to_path_buf(),
            action: "read",
            source,
        })?;
    if bytes.is_empty() {
        return Ok(None);
    }
    parse_marker(&bytes)
        .map(Some)
        .map_err(|message| CrashError::Marker {
            path: path.to_path_buf(),
            message,
        })
}

fn parse_marker(bytes: &[u8]) -> Result<Crash, String> {
    let rest = bytes
        .strip_prefix(HEADER)
        .ok_or("not a crash marker (unknown header)")?;
    let text = std::str::from_utf8(rest).map_err(|_| "not UTF-8")?;
    let mut lines = text.lines();
    let cause = lines.next().unwrap_or_default();
    let (cause, signal) = if let Some(n) = cause.strip_prefix("signal ") {
        let n: i32 = n.parse().map_err(|_| format!("bad signal `{n}`"))?;
        (signal_name(n), true)
    } else if cause == "panic" {
        ("a panic".to_string(), false)
    } else {
        return Err("no cause".into());
    };
    let mut crash = Crash {
        cause,
        signal,
        checkpoint: None,
    };
    if let Some(line) = lines.next().filter(|l| !l.is_empty()) {
        crash.checkpoint = Some(
            serde_json::from_str(line)
                .map_err(|e| format!("the checkpoint in flight is unreadable: {e}"))?,
        );
    }
    if let Some(message) = lines
        .next()
        .and_then(|l| serde_json::from_str::<String>(l).ok())
    {
        crash.cause = format!("{}: {message}", crash.cause);
    }
    Ok(crash)
}

fn signal_name(n: i32) -> String {
    match n {
        libc::SIGSEGV => "SIGSEGV".into(),
        libc::SIGBUS => "SIGBUS".into(),
        libc::SIGILL => "SIGILL".into(),
        libc::SIGFPE => "SIGFPE".into(),
        libc::SIGABRT => "SIGABRT".into(),
        n => format!("signal {n}"),
    }
}

/// Writes `bytes` whole to `fd`; async-signal-safe.
fn write_all(fd: libc::c_int, mut bytes: &[u8]) {
    while !bytes.is_empty() {
        // SAFETY: the pointer and length come from a live slice.
        let n = unsafe { libc::write(fd, bytes.as_ptr().cast(), bytes.len()) };
        if n <= 0 {
            if n < 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::EINTR) {
                continue;
            }
            return;
        }
        bytes = &bytes[n as usize..];
    }
}

/// Writes the marker once: `cause` (`signal N` or `panic`), the checkpoint in flight if any,
/// and `message` (a JSON string line) if not empty. The checkpoint is the calling thread's (the
/// evaluator's, or a watcher's structure check, each to its own marker); with `fallback` (a
/// signal), a thread with none blames the evaluator's. Async-signal-safe.
fn write_marker(cause: &[u8], signal: Option<libc::c_int>, message: &[u8], fallback: bool) {
    let me = tid();
    let busy = |s: &Slot| s.len.load(Ordering::Acquire) > 0;
    let own = SLOT
        .iter()
        .position(|s| s.owner.load(Ordering::Acquire) == me && busy(s));
    let slot = match own {
        Some(k) => Some(k),
        None if fallback && busy(&SLOT[0]) => Some(0),
        None => None,
    };
    let fd = match slot {
        Some(k) if k > 0 => SLOT[k].fd.load(Ordering::Acquire),
        _ => MARKER_FD.load(Ordering::Acquire),
    };
    if fd < 0 || WRITTEN.swap(true, Ordering::AcqRel) {
        return;
    }
    write_all(fd, HEADER);
    write_all(fd, cause);
    if let Some(mut n) = signal.map(|n| n.unsigned_abs()) {
        let mut digits = [0u8; 12];
        let mut at = digits.len();
        loop {
            at -= 1;
            digits[at] = b'0' + (n % 10) as u8;
            n /= 10;
            if n == 0 {
                break;
            }
        }
        write_all(fd, &digits[at..]);
    }
    write_all(fd, b"\n");
    if let Some(k) = slot {
        let s = &SLOT[k];
        let len = s.len.load(Ordering::Acquire).min(CAPACITY);
        // SAFETY: `AtomicU8` has the layout of `u8`; the kernel only reads the bytes.
        let in_flight = unsafe { std::slice::from_raw_parts(s.bytes.as_ptr().cast::<u8>(), len) };
        write_all(fd, in_flight);
    }
    write_all(fd, b"\n");
    if !message.is_empty() {
        write_all(fd, message);
        write_all(fd, b"\n");
    }
    // SAFETY: fsync on a descriptor this module owns.
    unsafe { libc::fsync(fd) };
}

extern "C" fn on_fatal_signal(
    sig: libc::c_int,
    info: *mut libc::siginfo_t,
    ctx: *mut libc::c_void,
) {
    write_marker(b"signal ", Some(sig), b"", true);
    if let Some(k) = SIGNALS.iter().position(|&s| s == sig) {
        let previous = PREVIOUS[k].0.load(Ordering::Acquire);
        let flags = PREVIOUS[k].1.load(Ordering::Acquire);
        if previous != libc::SIG_DFL && previous != libc::SIG_IGN {
            // SAFETY: `previous` is the handler that was installed for this signal, called the
            // way its flags say (Rust's own reports a stack overflow and aborts, or returns).
            unsafe {
                if flags & libc::SA_SIGINFO != 0 {
                    let f: extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void) =
                        std::mem::transmute(previous);
                    f(sig, info, ctx);
                } else {
                    let f: extern "C" fn(libc::c_int) = std::mem::transmute(previous);
                    f(sig);
                }
            }
        }
    }
    // Die of the signal: with the default action back, the signal raised here (blocked while
    // this handler runs) is delivered as soon as it returns; a fault also recurs.
    // SAFETY: sigaction and raise are async-signal-safe.
    unsafe {
        let mut action: libc::sigaction = std::mem::zeroed();
        action.sa_sigaction = libc::SIG_DFL;
        libc::sigemptyset(&mut action.sa_mask);
        libc::sigaction(sig, &action, std::ptr::null_mut());
        libc::raise(sig);
    }
}

/// The thread that evaluates checkpoints (a panic there is the checkpoint's doing).
pub const EVALUATOR_THREAD: &str = "diffmon-eval";

/// Makes a panic in any thread fatal: the default report (message and location) goes to stderr,
/// then `fatal(thread, message)` runs; the daemon's logs the thread at ERROR and calls
/// [`exit_now`]. A panic of a thread while it has a checkpoint in flight (the evaluator's, a
/// watcher's structure check) also writes the crash marker.
pub fn on_panic(fatal: impl Fn(&str, &str) + Send + Sync + 'static) {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        default(info);
        let thread = std::thread::current();
        let name = thread.name().unwrap_or("unnamed");
        let message = info
            .payload()
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| info.payload().downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "(no message)".into());
        let message = match info.location() {
            Some(at) => format!("{message} at {at}"),
            None => message,
        };
        // A thread with a checkpoint in flight (the evaluator's, a watcher's structure check).
        let me = tid();
        if SLOT
            .iter()
            .any(|s| s.owner.load(Ordering::Acquire) == me && s.len.load(Ordering::Acquire) > 0)
        {
            let json = serde_json::to_vec(&message).unwrap_or_default();
            write_marker(b"panic", None, &json, false);
        }
        fatal(name, &message);
    }));
}

/// Ends the process now with `code`, running no destructors and waiting for no thread (one may
/// be blocked for good). Whatever was logged is already written.
pub fn exit_now(code: i32) -> ! {
    // SAFETY: _exit is always safe to call; it does not return.
    unsafe { libc::_exit(code) }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(path: &str) -> CheckpointKey {
        CheckpointKey {
            path: path.into(),
            size: 12,
            mtime_ns: 34,
        }
    }

    /// One test for the process-wide marker state (tests run in parallel).
    #[test]
    fn a_marker_names_the_checkpoint_in_flight_and_the_signal_and_arming_removes_it() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(read_marker(dir.path()).unwrap(), None);
        arm(dir.path()).unwrap();
        assert_eq!(read_marker(dir.path()).unwrap(), None, "armed is empty");

        // A path with a newline and quotes stays one JSON line. A compiled package on trial
        // runs the evaluation: a fatal signal is blamed on it.
        let what = InFlight {
            key: key("/run/ckpt_\"5\"\n.pt"),
            step: 5,
            package_on_trial: Some("/models/net.pt2".into()),
        };
        evaluating(Some(&what));
        write_marker(b"signal ", Some(libc::SIGSEGV), b"", true);
        write_marker(b"signal ", Some(libc::SIGABRT), b"", true); // only the first is kept
        let crash = read_marker(dir.path()).unwrap().unwrap();
        assert_eq!(crash.cause, "SIGSEGV");
        assert_eq!(crash.checkpoint, Some(what.clone()));
        assert_eq!(crash.package_blamed(), Some("/models/net.pt2"));

        arm(dir.path()).unwrap();
        assert_eq!(
            read_marker(dir.path()).unwrap(),
            None,
            "re-arming removes it"
        );
        evaluating(None);
        write_marker(b"panic", None, b"\"boom\"", false);
        let crash = read_marker(dir.path()).unwrap().unwrap();
        assert_eq!(crash.cause, "a panic: boom");
        assert_eq!(crash.checkpoint, None, "nothing was in flight");
        // A panic is diffmon's own code: never the package's.
        arm(dir.path()).unwrap();
        evaluating(Some(&what));
        write_marker(b"panic", None, b"\"boom\"", false);
        let crash = read_marker(dir.path()).unwrap().unwrap();
        assert_eq!(crash.checkpoint, Some(what));
        assert_eq!(crash.package_blamed(), None);

        // A watcher's structure check: a signal on its thread blames the unit it checks, in
        // its own marker, even while the evaluator has another checkpoint in flight.
        arm(dir.path()).unwrap();
        let evaluated = InFlight {
            key: key("/run/ckpt_1.pt"),
            step: 1,
            package_on_trial: None,
        };
        evaluating(Some(&evaluated));
        let scanned = InFlight {
            key: key("/run/ckpt_100.pt"),
            step: 100,
            package_on_trial: None,
        };
        let (state, what) = (dir.path().to_path_buf(), scanned.clone());
        std::thread::spawn(move || {
            let marker = ThreadMarker::arm(&state).unwrap().unwrap();
            marker.checking(Some(&what));
            write_marker(b"signal ", Some(libc::SIGSEGV), b"", true);
            marker.checking(None);
        })
        .join()
        .unwrap();
        let crash = read_marker(dir.path()).unwrap().unwrap();
        assert_eq!(crash.cause, "SIGSEGV, in the watcher's structure check");
        assert_eq!(crash.checkpoint, Some(scanned));
        // A thread with nothing in flight (a kill, a libtorch worker) blames the evaluator's.
        arm(dir.path()).unwrap();
        std::fs::remove_file(dir.path().join(SCAN_MARKER_FILE)).unwrap();
        std::thread::spawn(|| write_marker(b"signal ", Some(libc::SIGBUS), b"", true))
            .join()
            .unwrap();
        let crash = read_marker(dir.path()).unwrap().unwrap();
        assert_eq!(crash.checkpoint, Some(evaluated.clone()));

        // Deaths without a marker (SIGKILL: arm, evaluate, never finish) are counted per
        // checkpoint in flight: retried twice, then reported as a crash, then forgotten.
        evaluating(None);
        arm(dir.path()).unwrap(); // (the last marker was read)
        // Its weights being read is the checkpoint's risk, even with a compiled package on trial.
        let killer = InFlight {
            key: key("/run/ckpt_7.pt"),
            step: 7,
            package_on_trial: Some("/models/net.pt2".into()),
        };
        for start in 1..=MAX_DEATHS_IN_FLIGHT {
            new_process();
            assert_eq!(read_marker(dir.path()).unwrap(), None, "start {start}");
            arm(dir.path()).unwrap();
            // Other checkpoints evaluated first do not reset the count.
            evaluating(Some(&evaluated));
            evaluating(None);
            evaluating(Some(&killer));
            let count = std::fs::read_to_string(dir.path().join(IN_FLIGHT_FILE)).unwrap();
            assert!(count.ends_with(&format!("\n{start}\n")), "{count}");
        }
        new_process();
        let crash = read_marker(dir.path()).unwrap().unwrap();
        assert!(
            crash
                .cause
                .contains("being read at 3 process deaths without a crash marker"),
            "{}",
            crash.cause
        );
        assert_eq!(crash.checkpoint, Some(killer.clone()));
        assert_eq!(crash.package_blamed(), None);
        arm(dir.path()).unwrap();
        assert_eq!(read_marker(dir.path()).unwrap(), None, "reported once");
        // Once its weights are read, a death is not counted against it, and the count is gone.
        new_process();
        arm(dir.path()).unwrap();
        evaluating(Some(&killer));
        weights_read();
        assert_eq!(read_marker(dir.path()).unwrap(), None);
        new_process();
        arm(dir.path()).unwrap();
        evaluating(Some(&killer));
        let count = std::fs::read_to_string(dir.path().join(IN_FLIGHT_FILE)).unwrap();
        assert!(count.ends_with("\n1\n"), "{count}");
        // A shutdown that leaves an evaluation behind is not the checkpoint's doing.
        evaluating(Some(&evaluated));
        disarm();
        assert_eq!(
            std::fs::metadata(dir.path().join(IN_FLIGHT_FILE))
                .unwrap()
                .len(),
            0
        );
        evaluating(None);
    }

    /// What a new process starts from: no state folder armed yet.
    fn new_process() {
        SUSPECTS.lock().unwrap().clear();
    }

    #[test]
    fn hostile_markers_are_errors_naming_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(MARKER_FILE);
        for bytes in [
            b"garbage".to_vec(),
            [HEADER, b"signal x\n"].concat(),
            [HEADER, b"signal 11\n{not json\n"].concat(),
            [HEADER, b"\xff\xfe\n"].concat(),
        ] {
            std::fs::write(&path, &bytes).unwrap();
            let e = read_marker(dir.path()).unwrap_err().to_string();
            assert!(e.starts_with(&path.display().to_string()), "{e}");
        }
        // Huge: read bounded, then refused as unparsable.
        std::fs::write(
            &path,
            [HEADER, b"signal 11\n", &vec![b'x'; 10 << 20]].concat(),
        )
        .unwrap();
        assert!(read_marker(dir.path()).is_err());
        // A symlink is not followed, nor is a FIFO opened for reading (it would block).
        std::fs::remove_file(&path).unwrap();
        let target = dir.path().join("precious");
        std::fs::write(&target, [HEADER, b"signal 11\n"].concat()).unwrap();
        std::os::unix::fs::symlink(&target, &path).unwrap();
        let e = read_marker(dir.path()).unwrap_err().to_string();
        assert!(e.contains("crash marker"), "{e}");
        let fifo = dir.path().join("fifo");
        let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        std::fs::rename(&fifo, &path).unwrap();
        let e = read_marker(dir.path()).unwrap_err().to_string();
        assert!(e.contains("not a regular file"), "{e}");
        assert_eq!(
            std::fs::read(&target).unwrap(),
            [HEADER, b"signal 11\n"].concat()
        );
    }

    #[test]
    fn a_panicking_thread_is_reported_by_name_with_its_message() {
        let (tx, rx) = std::sync::mpsc::channel();
        let tx = std::sync::Mutex::new(tx);
        on_panic(move |thread, message| {
            if thread == "supervised-test-thread" {
                let _ = tx
                    .lock()
                    .unwrap()
                    .send((thread.to_string(), message.to_string()));
            }
        });
        let t = std::thread::Builder::new()
            .name("supervised-test-thread".into())
            .spawn(|| panic!("the watcher met 1e20"))
            .unwrap();
        assert!(t.join().is_err());
        let (thread, message) = rx.recv().unwrap();
        assert_eq!(thread, "supervised-test-thread");
        assert!(
            message.starts_with("the watcher met 1e20 at src/store/crash.rs:"),
            "{message}"
        );
    }
}
