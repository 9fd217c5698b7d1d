//! `watch --until-pid PID` and `--until-file FILE`: the training job's end, as the daemon sees it
//! (docs/guide/watching.md, "Ending with the training job"). The watcher asks [`Finish`] at each
//! turn of its loop; once the job has ended it scans the run folder once more (what the job
//! wrote last), hands over every checkpoint that is ready or still settling, then ends its
//! thread. The executor finishes the item in flight, the recorder records every outcome, and
//! `watch` exits 0, or 3 when the early stop has fired (`cli::Exit::EarlyStopped`).
//!
//! - A process has ended when `/proc/<pid>/stat` is gone, names a zombie (ended, its parent has
//!   not collected its status yet: a training job started with `&` by a shell that is itself
//!   busy), or names a process started at another time (the PID was reused).
//! - A marker file has ended the job once it exists (any kind of file; it is never read).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// How often the watcher looks at the process or the marker.
pub const CHECK_EVERY: Duration = Duration::from_millis(250);

/// What ends the daemon: a process that ends, a file that appears, or whichever comes first.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Until {
    pub pid: Option<u32>,
    pub file: Option<PathBuf>,
}

impl Until {
    pub fn is_set(&self) -> bool {
        self.pid.is_some() || self.file.is_some()
    }
}

/// A process as `/proc/<pid>/stat` shows it: its state letter and its start time (clock ticks
/// after boot).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct ProcStat {
    state: char,
    start: u64,
}

/// Parses `/proc/<pid>/stat`: `pid (comm) S ppid ...`, the start time the 22nd field. The
/// command name may hold spaces and parentheses: the fields start after the last `)`.
fn parse_stat(text: &str) -> Option<ProcStat> {
    let rest = &text[text.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // After the name: field 3 (state) is fields[0], field 22 (starttime) is fields[19].
    Some(ProcStat {
        state: fields.first()?.chars().next()?,
        start: fields.get(19)?.parse().ok()?,
    })
}

fn proc_stat(pid: u32) -> Option<ProcStat> {
    parse_stat(&std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?)
}

/// Whether a process seen as `now` is the one first seen as `first` and still running.
fn still_running(first: Option<ProcStat>, now: Option<ProcStat>) -> bool {
    match (first, now) {
        (_, None) => false,
        (_, Some(now)) if matches!(now.state, 'Z' | 'X' | 'x') => false,
        (Some(first), Some(now)) => first.start == now.start,
        (None, Some(_)) => false,
    }
}

/// The watcher's view of [`Until`]: checks it at most every [`CHECK_EVERY`], and says when the
/// run is finished (the job ended, and everything the watcher found was handed over).
pub struct Finish {
    until: Until,
    /// The process as first seen (None: not running at the start).
    first: Option<ProcStat>,
    /// Why the job has ended, once it has.
    ended: Option<String>,
    /// A scan of the run folder has run since the end.
    scanned_since: bool,
    checked_at: Option<Instant>,
    finished: Arc<AtomicBool>,
}

impl Finish {
    /// Starts following `until`; says at once when the job has already ended.
    pub fn new(until: Until) -> Finish {
        let first = until.pid.and_then(proc_stat);
        let mut finish = Finish {
            until,
            first: first.filter(|s| !matches!(s.state, 'Z' | 'X' | 'x')),
            ended: None,
            scanned_since: false,
            checked_at: None,
            finished: Arc::new(AtomicBool::new(false)),
        };
        if let Some(pid) = finish.until.pid {
            tracing::info!(
                pid,
                "the daemon ends once process {pid} has ended and every checkpoint is evaluated (--until-pid)"
            );
        }
        if let Some(file) = &finish.until.file {
            tracing::info!(file = %file.display(),
                "the daemon ends once {} exists and every checkpoint is evaluated (--until-file)", file.display());
        }
        finish.check();
        finish
    }

    /// Set once the watcher has handed over everything after the job's end (shutdown reads it).
    pub fn flag(&self) -> Arc<AtomicBool> {
        self.finished.clone()
    }

    fn why_ended(&self) -> Option<String> {
        if let Some(pid) = self.until.pid
            && !still_running(self.first, proc_stat(pid))
        {
            return Some(if self.first.is_none() {
                format!("process {pid} was not running at the start")
            } else {
                format!("process {pid} ended")
            });
        }
        if let Some(file) = &self.until.file
            && std::fs::symlink_metadata(file).is_ok()
        {
            return Some(format!("{} exists", file.display()));
        }
        None
    }

    /// Looks at the process and the file (at most every [`CHECK_EVERY`]); true the one time the
    /// job is found ended, after logging it.
    pub fn check(&mut self) -> bool {
        if self.ended.is_some() || self.checked_at.is_some_and(|t| t.elapsed() < CHECK_EVERY) {
            return false;
        }
        self.checked_at = Some(Instant::now());
        let Some(why) = self.why_ended() else {
            return false;
        };
        tracing::info!(
            "the training job has ended ({why}): evaluating the checkpoints left, then stopping"
        );
        self.ended = Some(why);
        true
    }

    /// The watcher scanned the run folder.
    pub fn scanned(&mut self) {
        if self.ended.is_some() {
            self.scanned_since = true;
        }
    }

    /// Whether the watcher may end: the job has ended, a scan ran since, and nothing is left
    /// (`left`: checkpoints ready or settling that can still be handed over).
    pub fn done(&self, left: usize) -> bool {
        self.ended.is_some() && self.scanned_since && left == 0
    }

    /// Marks the run finished: the watcher ends next.
    pub fn finish(&self) {
        tracing::info!("every checkpoint of the run has been handed over for evaluation");
        self.finished.store(true, Ordering::SeqCst);
    }

    /// The marker file, to be kept out of the checkpoints.
    pub fn file(&self) -> Option<&Path> {
        self.until.file.as_deref()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The state and the start time, whatever the command's name holds.
    #[test]
    fn proc_stat_is_read_after_the_last_parenthesis() {
        let tail = "S 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 987654 20 21";
        let stat = parse_stat(&format!("42 (py (train) x) {tail}")).unwrap();
        assert_eq!(
            stat,
            ProcStat {
                state: 'S',
                start: 987654
            }
        );
        assert_eq!(parse_stat("42 (x) S 1"), None, "too few fields");
        assert_eq!(parse_stat("garbage"), None);
    }

    /// Running only while the same process (same start time) is there and not a zombie.
    #[test]
    fn a_zombie_a_reused_pid_and_a_gone_process_have_ended() {
        let at = |state, start| Some(ProcStat { state, start });
        assert!(still_running(at('S', 5), at('R', 5)));
        assert!(!still_running(at('S', 5), at('Z', 5)), "a zombie");
        assert!(!still_running(at('S', 5), at('S', 9)), "the PID reused");
        assert!(!still_running(at('S', 5), None), "gone");
        assert!(!still_running(None, at('S', 5)), "not running at the start");
    }

    /// This test's own process runs; a child that exited (a zombie until waited for) has
    /// ended; a marker file ends the job once it exists.
    #[test]
    fn a_real_child_and_a_marker_file() {
        let me = Finish::new(Until {
            pid: Some(std::process::id()),
            file: None,
        });
        assert!(me.ended.is_none());
        let mut child = std::process::Command::new("sleep")
            .arg("0.5")
            .spawn()
            .unwrap();
        let pid = child.id();
        let mut f = Finish::new(Until {
            pid: Some(pid),
            file: None,
        });
        let start = Instant::now();
        while f.ended.is_none() && start.elapsed() < Duration::from_secs(10) {
            std::thread::sleep(CHECK_EVERY);
            f.check();
        }
        assert!(f.ended.is_some(), "the exited child (a zombie) has ended");
        child.wait().unwrap();

        let dir = tempfile::tempdir().unwrap();
        let marker = dir.path().join("DONE");
        let mut f = Finish::new(Until {
            pid: None,
            file: Some(marker.clone()),
        });
        assert!(!f.check() && f.ended.is_none());
        std::fs::write(&marker, b"").unwrap();
        std::thread::sleep(CHECK_EVERY);
        assert!(f.check(), "found ended once");
        assert!(!f.check(), "and said once");
        assert!(!f.done(0), "no scan since the end");
        f.scanned();
        assert!(!f.done(1), "a checkpoint left");
        assert!(f.done(0));
        assert!(!f.flag().load(Ordering::SeqCst));
        f.finish();
        assert!(f.flag().load(Ordering::SeqCst));
    }

    /// A marker that is a link (dangling, or to a FIFO that would block a reader) ends the job
    /// as any file does, and is neither followed nor read; a PID of a process started before
    /// the daemon, by another user's shell or by init, runs until it ends.
    #[test]
    fn a_linked_marker_ends_the_job_unread_and_an_old_process_runs() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("fifo");
        let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        for (name, target) in [("DANGLING", dir.path().join("nothing")), ("TO_FIFO", fifo)] {
            let marker = dir.path().join(name);
            let mut f = Finish::new(Until {
                pid: None,
                file: Some(marker.clone()),
            });
            assert!(f.ended.is_none());
            std::os::unix::fs::symlink(&target, &marker).unwrap();
            std::thread::sleep(CHECK_EVERY);
            assert!(f.check(), "{name}: a link as the marker ends the job");
        }
        let init = Finish::new(Until {
            pid: Some(1),
            file: None,
        });
        assert!(init.ended.is_none(), "process 1 runs");
    }
}
