//! What makes the process die, recorded so that a restart does not repeat it (docs/design.md §10:
//! a malformed file is a recorded failure, never a crash loop).
//!
//! - **Crash marker.** Before the evaluator starts on a checkpoint it tells [`evaluating`] which
//!   one (its key and step, serialized into a preallocated static buffer). A fatal signal
//!   (SIGSEGV, SIGBUS, SIGILL, SIGFPE, SIGABRT) runs an async-signal-safe handler that writes
//!   that checkpoint and the signal to `<state_dir>/crash` through a descriptor opened by [`arm`],
//!   then lets the previous handler run (Rust's stack-overflow report stays) and dies of the
//!   signal with its default action. A panic of the evaluator thread writes the same marker. The
//!   next start reads it ([`read_marker`]) and records the checkpoint as a failure with reason
//!   [`crate::record::FailureReason::Crashed`], so it is counted and never evaluated again. A SIGKILL leaves no marker: the
//!   checkpoint in flight is evaluated again.
//! - **Supervision.** [`on_panic`] makes a panic in any thread of the process (watcher,
//!   evaluator, recorder, tokio tasks) fatal: logged with the thread's name, then the process
//!   exits with status 1 ([`exit_now`]), so a service manager's `Restart=on-failure` restarts it.

use crate::history::CheckpointKey;
use serde::{Deserialize, Serialize};
use std::io::Read;
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::io::IntoRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU8, AtomicUsize, Ordering};

/// The marker's file name inside the state folder.
pub const MARKER_FILE: &str = "crash";

const HEADER: &[u8] = b"diffmon crash marker v1\n";

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

static IN_FLIGHT: [AtomicU8; CAPACITY] = [const { AtomicU8::new(0) }; CAPACITY];
/// Bytes of `IN_FLIGHT` that hold the checkpoint being evaluated; 0 when none.
static IN_FLIGHT_LEN: AtomicUsize = AtomicUsize::new(0);
/// The marker's descriptor, or -1 when unarmed.
static MARKER_FD: AtomicI32 = AtomicI32::new(-1);
/// The marker was written (a crash writes it once, whatever follows).
static WRITTEN: AtomicBool = AtomicBool::new(false);
static HANDLERS_INSTALLED: AtomicBool = AtomicBool::new(false);
/// The handlers the fatal-signal handler found (`sa_sigaction`, `sa_flags`), run after it.
static PREVIOUS: [(AtomicUsize, AtomicI32); 5] =
    [const { (AtomicUsize::new(libc::SIG_DFL), AtomicI32::new(0)) }; 5];

/// The checkpoint being evaluated, as the marker names it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct InFlight {
    pub key: CheckpointKey,
    pub step: i64,
}

/// What a marker says: how the process died, and what it was evaluating.
#[derive(Debug, Clone, PartialEq)]
pub struct Crash {
    /// `SIGSEGV`, `SIGABRT`, ... or `a panic: <message>`.
    pub cause: String,
    pub checkpoint: Option<InFlight>,
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

/// Names the checkpoint the evaluator starts on (`None` once it is done with it). Not for signal
/// handlers: it allocates.
pub fn evaluating(what: Option<&InFlight>) {
    IN_FLIGHT_LEN.store(0, Ordering::Release);
    let Some(what) = what else { return };
    let json = serde_json::to_vec(what).expect("keys serialize");
    if json.len() > CAPACITY {
        tracing::warn!(
            checkpoint = %what.key.path,
            "the checkpoint's path is too long for the crash marker: a crash while evaluating it would not be recorded"
        );
        return;
    }
    for (slot, &b) in IN_FLIGHT.iter().zip(&json) {
        slot.store(b, Ordering::Relaxed);
    }
    IN_FLIGHT_LEN.store(json.len(), Ordering::Release);
}

/// Opens a fresh, empty marker in `state_dir` (removing the last one: read it first) and installs
/// the fatal-signal handlers, once per process.
pub fn arm(state_dir: &Path) -> Result<(), CrashError> {
    let path = state_dir.join(MARKER_FILE);
    let err = |source: std::io::Error| CrashError::Io {
        path: path.clone(),
        action: "create",
        source,
    };
    match std::fs::remove_file(&path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(err(e)),
        _ => {}
    }
    let file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(&path)
        .map_err(err)?;
    let old = MARKER_FD.swap(file.into_raw_fd(), Ordering::AcqRel);
    if old >= 0 {
        // SAFETY: the descriptor was this module's own, no longer published.
        unsafe { libc::close(old) };
    }
    WRITTEN.store(false, Ordering::Release);
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
    Ok(())
}

/// Stops recording crashes (a shutdown that leaves the evaluator behind: whatever happens then
/// is not the checkpoint's doing).
pub fn disarm() {
    MARKER_FD.store(-1, Ordering::Release);
}

/// Reads the marker a crashed process left in `state_dir`: `None` when there is none (or it is
/// empty: the last process did not crash). The marker is bounded and parsed as data.
pub fn read_marker(state_dir: &Path) -> Result<Option<Crash>, CrashError> {
    let path = state_dir.join(MARKER_FILE);
    let bad = |message: String| CrashError::Marker {
        path: path.clone(),
        message,
    };
    let unreadable = |source: std::io::Error| CrashError::Io {
        path: path.clone(),
        action: "read",
        source,
    };
    let file = match std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(&path)
    {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(unreadable(e)),
    };
    let meta = file.metadata().map_err(unreadable)?;
    if !meta.is_file() {
        return Err(bad("the crash marker is not a regular file".into()));
    }
    let mut bytes = Vec::new();
    file.take(MAX_MARKER)
        .read_to_end(&mut bytes)
        .map_err(unreadable)?;
    if bytes.is_empty() {
        return Ok(None);
    }
    parse_marker(&bytes).map(Some).map_err(bad)
}

fn parse_marker(bytes: &[u8]) -> Result<Crash, String> {
    let rest = bytes
        .strip_prefix(HEADER)
        .ok_or("not a crash marker (unknown header)")?;
    let text = std::str::from_utf8(rest).map_err(|_| "not UTF-8")?;
    let mut lines = text.lines();
    let cause = lines.next().unwrap_or_default();
    let cause = if let Some(n) = cause.strip_prefix("signal ") {
        let n: i32 = n.parse().map_err(|_| format!("bad signal `{n}`"))?;
        signal_name(n)
    } else if cause == "panic" {
        "a panic".to_string()
    } else {
        return Err("no cause".into());
    };
    let mut crash = Crash {
        cause,
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
/// and `message` (a JSON string line) if not empty. Async-signal-safe.
fn write_marker(cause: &[u8], signal: Option<libc::c_int>, message: &[u8]) {
    let fd = MARKER_FD.load(Ordering::Acquire);
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
    let len = IN_FLIGHT_LEN.load(Ordering::Acquire).min(CAPACITY);
    // SAFETY: `AtomicU8` has the layout of `u8`; the kernel only reads the bytes.
    let in_flight = unsafe { std::slice::from_raw_parts(IN_FLIGHT.as_ptr().cast::<u8>(), len) };
    write_all(fd, in_flight);
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
    write_marker(b"signal ", Some(sig), b"");
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
/// [`exit_now`]. A panic of the evaluator thread while it evaluates a checkpoint also writes the
/// crash marker.
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
        if name == EVALUATOR_THREAD && IN_FLIGHT_LEN.load(Ordering::Acquire) > 0 {
            let json = serde_json::to_vec(&message).unwrap_or_default();
            write_marker(b"panic", None, &json);
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

        // A path with a newline and quotes stays one JSON line.
        let what = InFlight {
            key: key("/run/ckpt_\"5\"\n.pt"),
            step: 5,
        };
        evaluating(Some(&what));
        write_marker(b"signal ", Some(libc::SIGSEGV), b"");
        write_marker(b"signal ", Some(libc::SIGABRT), b""); // only the first is kept
        let crash = read_marker(dir.path()).unwrap().unwrap();
        assert_eq!(crash.cause, "SIGSEGV");
        assert_eq!(crash.checkpoint, Some(what));

        arm(dir.path()).unwrap();
        assert_eq!(
            read_marker(dir.path()).unwrap(),
            None,
            "re-arming removes it"
        );
        evaluating(None);
        write_marker(b"panic", None, b"\"boom\"");
        let crash = read_marker(dir.path()).unwrap().unwrap();
        assert_eq!(crash.cause, "a panic: boom");
        assert_eq!(crash.checkpoint, None, "nothing was in flight");
        disarm();
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
            message.starts_with("the watcher met 1e20 at src/crash.rs:"),
            "{message}"
        );
    }
}
