//! The one shutdown path (ARCHITECTURE.md, "Shutdown"). [`until_stopped`] is the one place that
//! decides to stop: on the first SIGINT/SIGTERM, or when the pipeline ends by itself: the
//! training job ended and the watcher handed everything over (`watch --until-pid`, `until.rs`),
//! or the executor stopped. The stages see it one way: their input channel closes. The stop channel
//! ([`stop_channel`]) closes first; the watcher sees it and drops the work channel, the
//! executor finishes the item in flight and drops the outcome channel, the recorder records
//! what is left and ends. That drain is bounded by `shutdown_drain_secs`; past it, or on a
//! second signal, or when a thread panics, the process exits at once with a fixed status: 0 or
//! 1 past the drain (as the stop was a signal or not), 130 on a second signal, 1 on a panic.

use crossbeam_channel::{Receiver, Sender};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

/// Why the daemon stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stopped {
    /// SIGINT or SIGTERM.
    Signal,
    /// The training job ended (`--until-pid`, `--until-file`) and every checkpoint it left was
    /// evaluated and recorded.
    JobEnded,
    /// The executor stopped by itself (an error).
    Failed,
}

/// Closes the stop channel when dropped.
pub struct Stop {
    _sender: Sender<()>,
}

/// The stop channel: nothing is ever sent on it; its receivers see it close when the [`Stop`]
/// is dropped.
pub fn stop_channel() -> (Stop, Receiver<()>) {
    let (tx, rx) = crossbeam_channel::bounded(0);
    (Stop { _sender: tx }, rx)
}

/// Makes a panic in any thread end the process with status 1, for a service manager to
/// restart it.
pub fn exit_on_panic() {
    crate::store::crash::on_panic(|thread, message| {
        tracing::error!(
            thread,
            "a thread of the daemon panicked ({message}); exiting with status 1"
        );
        crate::store::crash::exit_now(1);
    });
}

/// Waits for the first SIGINT/SIGTERM or the end of the recorder thread (which ends only once
/// the executor has ended), whichever comes first, then stops the pipeline (drops `stop`) and
/// waits for the watcher and the recorder to end, at most `drain` in all. Returns why it
/// stopped (the recorder's end is the job's end when `finished` was set by the watcher, else a
/// failure), and what the recorder thread returned. Past `drain` it exits the process
/// (status 0 after a signal, else 1): the evaluation in flight is not waited for, and the crash
/// marker is disarmed first, so that checkpoint is not blamed. From the stop on, a signal
/// exits the process at once with status 130.
pub fn until_stopped<T: Send + 'static>(
    runtime: &tokio::runtime::Runtime,
    stop: Stop,
    watcher: JoinHandle<()>,
    recorder: JoinHandle<T>,
    drain: Duration,
    finished: Option<Arc<AtomicBool>>,
) -> std::io::Result<(Stopped, T)> {
    let mut signals = {
        let _guard = runtime.enter();
        Signals::install()?
    };
    let mut recorded = runtime.spawn_blocking(move || recorder.join());
    let (stopped, early) = runtime.block_on(async {
        let stopped = tokio::select! {
            _ = signals.next() => {
                tracing::info!("draining: the evaluation in flight finishes (signal again to exit now)");
                (Stopped::Signal, None)
            }
            ended = &mut recorded => {
                if finished.as_ref().is_some_and(|f| f.load(Ordering::SeqCst)) {
                    tracing::info!("every checkpoint the training job left is evaluated and recorded");
                    (Stopped::JobEnded, Some(ended))
                } else {
                    tracing::error!("the evaluator stopped unexpectedly");
                    (Stopped::Failed, Some(ended))
                }
            }
        };
        drop(stop);
        // From now on a signal ends the process in its handler, whatever is blocked; one that
        // came before the handler was in place is still queued here.
        exit_on_next_signal();
        tokio::spawn(async move {
            signals.next().await;
            second_signal();
        });
        stopped
    });
    // Everything that waits for the evaluation in flight is bounded by one timeout.
    let drained = runtime.block_on(async move {
        tokio::time::timeout(drain, async move {
            let ended = match early {
                Some(ended) => ended,
                None => recorded.await,
            };
            let _ = tokio::task::spawn_blocking(move || watcher.join()).await;
            ended
        })
        .await
    });
    let Ok(Ok(Ok(value))) = drained else {
        // The evaluator is still busy (or blocked): nothing waits for it, and nothing it does
        // from now on is the checkpoint's fault, nor a compiled package's on trial.
        crate::store::crash::disarm();
        crate::store::package_trial::pause();
        tracing::warn!(
            "the evaluation in flight did not finish within {drain:?} (shutdown_drain_secs); it will be evaluated again after a restart"
        );
        tracing::info!("stopped");
        crate::store::crash::exit_now(if stopped == Stopped::Signal { 0 } else { 1 });
    };
    Ok((stopped, value))
}

/// The second signal: exits at once, with status 130 (`cli::Exit::Interrupted`).
fn second_signal() -> ! {
    tracing::warn!("second signal: exiting now");
    crate::store::package_trial::pause(); // an exit asked for: not a compiled package's crash
    crate::store::crash::exit_now(130);
}

/// Makes SIGINT and SIGTERM end the process in the signal handler itself, so that no blocked
/// thread or runtime can hold it up.
fn exit_on_next_signal() {
    extern "C" fn on_signal(_: libc::c_int) {
        const MESSAGE: &[u8] = b"second signal: exiting now\n";
        // SAFETY: write and _exit are async-signal-safe.
        unsafe {
            libc::write(2, MESSAGE.as_ptr().cast(), MESSAGE.len());
            libc::_exit(130);
        }
    }
    for sig in [libc::SIGINT, libc::SIGTERM] {
        // SAFETY: a zeroed sigaction with an async-signal-safe handler.
        unsafe {
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = on_signal as extern "C" fn(libc::c_int) as usize;
            libc::sigemptyset(&mut action.sa_mask);
            libc::sigaction(sig, &action, std::ptr::null_mut());
        }
    }
}

/// SIGINT and SIGTERM, installed once so that a second signal is told from the first.
struct Signals {
    interrupt: tokio::signal::unix::Signal,
    terminate: tokio::signal::unix::Signal,
}

impl Signals {
    fn install() -> std::io::Result<Signals> {
        use tokio::signal::unix::{SignalKind, signal};
        Ok(Signals {
            interrupt: signal(SignalKind::interrupt())?,
            terminate: signal(SignalKind::terminate())?,
        })
    }

    async fn next(&mut self) {
        tokio::select! {
            _ = self.interrupt.recv() => {}
            _ = self.terminate.recv() => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crossbeam_channel::TryRecvError;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};

    #[test]
    fn the_stop_channel_closes_when_the_stop_is_dropped() {
        let (stop, stopped) = stop_channel();
        assert_eq!(stopped.try_recv(), Err(TryRecvError::Empty));
        drop(stop);
        assert_eq!(stopped.try_recv(), Err(TryRecvError::Disconnected));
    }

    /// The recorder ends by itself (the executor stopped): the pipeline is stopped (the watcher
    /// sees the stop channel close and ends), and what the recorder returned comes back with
    /// "not signalled". (This installs the daemon's signal handlers in the test process.)
    #[test]
    fn an_ended_pipeline_stops_the_watcher_and_returns_the_recorders_value() {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let (stop, stopped) = stop_channel();
        let saw_stop = Arc::new(AtomicBool::new(false));
        let watcher = {
            let saw_stop = saw_stop.clone();
            std::thread::spawn(move || {
                assert!(
                    stopped.recv().is_err(),
                    "nothing is sent on the stop channel"
                );
                saw_stop.store(true, Ordering::SeqCst);
            })
        };
        let recorder = std::thread::spawn(|| 42);
        let drain = Duration::from_secs(60);
        let (stopped, value) =
            until_stopped(&runtime, stop, watcher, recorder, drain, None).unwrap();
        assert_eq!((stopped, value), (Stopped::Failed, 42));
        assert!(saw_stop.load(Ordering::SeqCst));
    }
}
