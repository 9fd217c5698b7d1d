//! Filesystem notifications (inotify) that wake a watcher early: a run's own instance, or a
//! watch in the one instance a sweep's runs share; why they could not be had.

use crossbeam_channel::Sender;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Events of filesystem notifications, as a watcher receives them.
pub(super) type Events = Sender<notify::Result<notify::Event>>;

/// One inotify instance (and one event-loop thread) for the run folders of a sweep, instead of
/// one per run: the kernel allows 128 instances per user by default, and a sweep of more runs
/// polled the others. Each folder is one watch; an event goes to the watcher of the folder its
/// path is in (or is). Clones share the instance.
#[derive(Clone)]
pub struct SharedNotifications {
    routes: Arc<std::sync::Mutex<HashMap<PathBuf, Events>>>,
    watcher: Arc<std::sync::Mutex<notify::RecommendedWatcher>>,
}

impl SharedNotifications {
    pub fn new() -> notify::Result<SharedNotifications> {
        let routes: Arc<std::sync::Mutex<HashMap<PathBuf, Events>>> = Arc::default();
        let to = routes.clone();
        let watcher = notify::recommended_watcher(move |event: notify::Result<notify::Event>| {
            let routes = to.lock().unwrap_or_else(|e| e.into_inner());
            match event {
                Ok(e) => {
                    let run = e.paths.iter().find_map(|p| {
                        routes
                            .get(p)
                            .or_else(|| p.parent().and_then(|d| routes.get(d)))
                    });
                    if let Some(tx) = run {
                        let _ = tx.send(Ok(e));
                    }
                }
                // An error concerns every folder (each rescans).
                Err(e) => {
                    for tx in routes.values() {
                        let _ = tx.send(Err(notify::Error::generic(&e.to_string())));
                    }
                }
            }
        })?;
        Ok(SharedNotifications {
            routes,
            watcher: Arc::new(std::sync::Mutex::new(watcher)),
        })
    }

    /// Watches `dir` until the returned guard is dropped, its events sent on `tx`.
    pub(super) fn watch(&self, dir: &Path, tx: Events) -> notify::Result<SharedWatch> {
        use notify::Watcher as _;
        self.routes
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(dir.to_path_buf(), tx);
        let watched = self
            .watcher
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .watch(dir, notify::RecursiveMode::NonRecursive);
        match watched {
            Ok(()) => Ok(SharedWatch {
                dir: dir.to_path_buf(),
                shared: self.clone(),
            }),
            Err(e) => {
                self.routes
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .remove(dir);
                Err(e)
            }
        }
    }
}

/// A run folder's watch in a [`SharedNotifications`]; removed when dropped.
pub(super) struct SharedWatch {
    dir: PathBuf,
    shared: SharedNotifications,
}

impl Drop for SharedWatch {
    fn drop(&mut self) {
        use notify::Watcher as _;
        // The watch is gone already if the folder was deleted.
        let _ = self
            .shared
            .watcher
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .unwatch(&self.dir);
        self.shared
            .routes
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&self.dir);
    }
}

/// A run folder's notifications: an inotify instance of its own, or a watch in a sweep's.
pub(super) enum Notifications {
    Own(#[allow(dead_code)] notify::RecommendedWatcher),
    Shared(#[allow(dead_code)] SharedWatch),
}

/// Why notifications failed, naming the kernel limit when one is the cause.
pub(super) fn notifications_failure(e: &notify::Error) -> String {
    let limit = match &e.kind {
        notify::ErrorKind::MaxFilesWatch => Some("fs.inotify.max_user_watches"),
        notify::ErrorKind::Io(io) if io.raw_os_error() == Some(libc::EMFILE) => {
            Some("fs.inotify.max_user_instances (or the open files limit)")
        }
        _ => None,
    };
    match limit {
        Some(limit) => format!("{e}: the limit {limit} is reached"),
        None => e.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Out of inotify watches (ENOSPC) or instances (EMFILE), the warning names the limit to
    /// raise.
    #[test]
    fn running_out_of_notifications_names_the_limit() {
        let watches = notify::Error::new(notify::ErrorKind::MaxFilesWatch);
        assert!(notifications_failure(&watches).contains("fs.inotify.max_user_watches"));
        let instances = notify::Error::io(std::io::Error::from_raw_os_error(libc::EMFILE));
        assert!(notifications_failure(&instances).contains("fs.inotify.max_user_instances"));
        let other = notify::Error::generic("boom");
        assert!(!notifications_failure(&other).contains("fs.inotify"));
    }
}
