//! Standard output when its reader goes away (`diffmon check-config F | head -1`): a one-shot
//! command ends quietly with status 0, and `watch` runs on with its console lines dropped.
//!
//! Rust ignores SIGPIPE, so writing to a pipe whose reader has gone fails with EPIPE, and
//! `println!` panics on that error. The commands of `cli` write through [`stdout`] instead
//! (`clippy::print_stdout` is denied there), which reports that failure as [`StdoutClosed`];
//! [`is_stdout_closed`] tells `cli::main` to end with status 0 and print nothing. Restoring
//! SIGPIPE's default action would end the process with status 141 instead.
//!
//! `watch` prints its console lines with `println!` from the daemon's threads, where a panic
//! ends the daemon (status 1). [`BestEffort`] puts a pipe of its own, drained by a thread, in
//! place of a standard output that is a pipe or a socket: the thread forwards what comes until
//! the reader has gone, then drops it, so the daemon's writes never fail.

use std::io::{self, Write};

/// Standard output was closed by its reader: the command stops, with status 0.
#[derive(Debug, thiserror::Error)]
#[error("standard output was closed by its reader")]
pub struct StdoutClosed;

/// Standard output, locked, whose failure for want of a reader is a [`StdoutClosed`]. Writes of
/// whole lines reach the file descriptor at once (a failure shows at the write that meets it);
/// [`Write::flush`] sends a last partial line.
pub struct Stdout(io::StdoutLock<'static>);

/// Standard output for a command's results.
pub fn stdout() -> Stdout {
    Stdout(io::stdout().lock())
}

/// Writes `line` and a newline to standard output ([`stdout`]).
pub fn line(line: impl std::fmt::Display) -> io::Result<()> {
    let mut out = stdout();
    writeln!(out, "{line}")?;
    out.flush()
}

/// `e`, or a [`StdoutClosed`] inside an error of the same kind when `e` says the reader is gone.
fn closed(e: io::Error) -> io::Error {
    if e.kind() == io::ErrorKind::BrokenPipe {
        io::Error::new(io::ErrorKind::BrokenPipe, StdoutClosed)
    } else {
        e
    }
}

impl Write for Stdout {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.0.write(buf).map_err(closed)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.0.flush().map_err(closed)
    }
}

/// Did the command stop because its standard output was closed ([`StdoutClosed`] anywhere in the
/// chain, also inside an `io::Error`)?
pub fn is_stdout_closed(e: &anyhow::Error) -> bool {
    e.chain().any(|cause| {
        cause.is::<StdoutClosed>()
            || cause
                .downcast_ref::<io::Error>()
                .and_then(io::Error::get_ref)
                .is_some_and(|inner| inner.is::<StdoutClosed>())
    })
}

/// `watch`'s standard output made best effort (module docs): while it lives, file descriptor 1
/// is a pipe whose reader is a thread of this process, forwarding to the standard output the
/// process was given until a write there fails, and then dropping what comes. Dropping it puts
/// the given standard output back and waits (at most [`DRAIN`]) for the thread to forward what
/// is left. A line written just before the process ends at once (`_exit`: a panic, a second
/// signal) may be lost.
pub struct BestEffort {
    /// The standard output the process was given.
    given: std::os::fd::OwnedFd,
    /// Closed when the forwarding thread has read the end of its pipe.
    done: crossbeam_channel::Receiver<()>,
}

/// How long dropping a [`BestEffort`] waits for its thread. The thread ends as soon as every
/// copy of the pipe's writing end is closed; a child process that inherited one would keep it
/// open.
pub const DRAIN: std::time::Duration = std::time::Duration::from_secs(2);

impl BestEffort {
    /// Makes standard output best effort when it is a pipe or a socket (the only kinds whose
    /// writes fail with EPIPE); `None` for anything else (a file, a terminal, `/dev/null`, no
    /// standard output at all), which is left as it is.
    pub fn install() -> io::Result<Option<BestEffort>> {
        use std::os::fd::AsRawFd;
        // SAFETY: fstat only writes the struct it is given; an all-zero `stat` is valid.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        if unsafe { libc::fstat(libc::STDOUT_FILENO, &mut st) } != 0 {
            return Ok(None);
        }
        let kind = st.st_mode & libc::S_IFMT;
        if kind != libc::S_IFIFO && kind != libc::S_IFSOCK {
            return Ok(None);
        }
        io::stdout().flush()?;
        let given = std::os::fd::AsFd::as_fd(&io::stdout()).try_clone_to_owned()?;
        let forward_to = std::fs::File::from(given.try_clone()?);
        let (reader, writer) = io::pipe()?;
        let (finished, done) = crossbeam_channel::bounded::<()>(0);
        std::thread::Builder::new()
            .name("diffmon-stdout".into())
            .spawn(move || {
                forward(reader, forward_to);
                drop(finished);
            })?;
        // SAFETY: dup2 on two open descriptors; fd 1 now refers to the pipe (the descriptor
        // number stays the one `std::io::stdout` writes to).
        if unsafe { libc::dup2(writer.as_raw_fd(), libc::STDOUT_FILENO) } < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(Some(BestEffort { given, done }))
    }
}

/// Copies `from` to `to` until `from` ends; after the first failed write, reads and drops.
fn forward(mut from: io::PipeReader, mut to: std::fs::File) {
    use std::io::Read;
    let mut buf = [0u8; 8192];
    let mut open = true;
    loop {
        match from.read(&mut buf) {
            Ok(0) => return,
            Ok(n) => open = open && to.write_all(&buf[..n]).is_ok(),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => return,
        }
    }
}

impl Drop for BestEffort {
    fn drop(&mut self) {
        use std::os::fd::AsRawFd;
        let _ = io::stdout().flush();
        // SAFETY: dup2 on two open descriptors; closing fd 1's pipe end lets the thread see
        // the end of its pipe.
        unsafe { libc::dup2(self.given.as_raw_fd(), libc::STDOUT_FILENO) };
        let _ = self.done.recv_timeout(DRAIN);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A write that fails for want of a reader is a [`StdoutClosed`], found through `anyhow`
    /// and its context; another failure is not.
    #[test]
    fn a_broken_pipe_is_stdout_closed() {
        let broken = closed(io::Error::from(io::ErrorKind::BrokenPipe));
        let e = anyhow::Error::from(broken).context("writing the table");
        assert!(is_stdout_closed(&e));
        let full = closed(io::Error::from(io::ErrorKind::StorageFull));
        assert!(!is_stdout_closed(&anyhow::Error::from(full)));
        assert!(!is_stdout_closed(&anyhow::anyhow!("a checkpoint failed")));
    }

    /// The forwarding thread copies while the reader reads, and goes on reading (so the
    /// writers never block or fail) once it has gone.
    #[test]
    fn forwarding_drops_what_comes_after_the_reader_has_gone() {
        use std::io::Read;
        let (from, mut into) = io::pipe().unwrap();
        let (mut reader, out) = io::pipe().unwrap();
        let out = std::fs::File::from(std::os::fd::OwnedFd::from(out));
        let thread = std::thread::spawn(move || forward(from, out));
        into.write_all(b"first\n").unwrap();
        let mut line = [0u8; 6];
        reader.read_exact(&mut line).unwrap();
        assert_eq!(&line, b"first\n");
        drop(reader);
        // More than a pipe holds: it would block for good if the thread stopped reading.
        for _ in 0..64 {
            into.write_all(&[b'x'; 8192]).unwrap();
        }
        drop(into);
        thread.join().unwrap();
    }
}
