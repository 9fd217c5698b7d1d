//! Alert delivery: the early-stop signal (docs/design.md §17).
//!
//! [`Alerter::send`] turns one [`Event`] into
//! - the stop file `<run.dir>/<alerts.stop_file>` (written atomically with the event JSON for
//!   `early_stop`, removed for `resolved`), which training loops poll;
//! - one delivery per destination: every `alerts.webhooks[]` entry (formats `json`, `slack`,
//!   `alertmanager` = Alertmanager's v4 webhook payload) and `alerts.alertmanager.url`
//!   (`POST {url}/api/v2/alerts`, alert `DiffusionEarlyStop` with labels `run`, `metric`,
//!   `severity`).
//!
//! Guarantees:
//! - **The stop file is retried until written.** When it cannot be written (or removed), the
//!   failure is logged at WARN and retried with the webhooks' backoff ([`DeliveryPolicy`]) until it
//!   succeeds (INFO then); a later event supersedes a pending one. Across a restart the history
//!   replay sends the events again, which writes it again. Its temporary file is created
//!   exclusively under a random name (never through a planted link, see `crate::store::safe_fs`).
//! - **Durable before the first attempt.** Each (event, destination) is written to
//!   `<state_dir>/outbox/<event id>.<destination key>.json` (tmp + fsync + rename) before it is
//!   sent, and removed once the receiver accepted it. Entries left by a previous run are
//!   delivered right after [`Alerter::start`]. A half-written or unreadable entry is logged and
//!   renamed to `*.corrupt`; it never stops start-up. Each entry carries an HMAC-SHA256 under a
//!   key only the daemon holds (derived from the state folder's random `alerts.key` and, for a
//!   signed destination, its secret): an entry that does not verify (planted in the state
//!   folder, or from an earlier version) is never delivered: renamed `*.unauthenticated`, logged
//!   and counted ([`DeliveryOutcome::Unauthenticated`]).
//! - **At most one accepted delivery per (event id, destination)** as far as diffmon can tell:
//!   accepted deliveries are recorded in `<state_dir>/alerts_delivered.json` (the last 1000), and
//!   sending an event whose id is recorded or still pending is a no-op for that destination. The
//!   event id is stable ([`event_id`]), so a restart that re-derives the same event does not
//!   deliver it again. (A crash between the receiver's answer and the ledger write delivers once
//!   more: receivers deduplicate on `webhook-id`.)
//! - **Order per destination.** Each destination has one tokio task that delivers its entries
//!   oldest first, so a `resolved` never overtakes its `early_stop`.
//! - **Retries.** Timeouts, connection errors, 408, 429 (honouring `Retry-After: <seconds>`,
//!   capped) and 5xx are retried forever while the process runs, with exponential backoff and full
//!   jitter ([`DeliveryPolicy`]: base 0.5 s, ×2, ceiling 60 s), WARN per failure and one ERROR
//!   after 10 consecutive failures of a destination. Other answers (4xx, redirects: they are not
//!   followed) are *rejected*: logged at WARN with the status and the start of the body, counted,
//!   and removed from the outbox (retrying would get the same answer). A rejected delivery is not
//!   put in the ledger, so sending the same event again (e.g. after fixing the receiver and
//!   restarting) tries again.
//! - **Signing.** With `secret_env`, requests carry Standard-Webhooks headers `webhook-id` (the
//!   event id), `webhook-timestamp` (unix seconds) and
//!   `webhook-signature: v1,<base64 HMAC-SHA256(key, "{id}.{timestamp}.{body}")>`. The secret is
//!   the key in base64, with or without a `whsec_` prefix and padding, decoded as the official
//!   `standardwebhooks` library decodes it ([`crate::sign::Secret::parse`]); any other value is refused
//!   by the config (`watch` and `check-config`). The secret is read once, when the config is
//!   loaded, and never printed.
//! - **Alertmanager stays firing.** Alertmanager resolves an alert that is not re-sent within its
//!   `resolve_timeout`; while an `early_stop` is active the firing alert is re-posted every
//!   [`DeliveryPolicy::alertmanager_refresh`] (60 s). After a restart the active alert is taken
//!   from the stop file. A `resolved` event posts the same labels with `endsAt`.
//!
//! Threads: [`Alerter::start`] must run inside a tokio runtime (it spawns one task per
//! destination); [`Alerter::send`] is synchronous, needs no runtime and may be called from any
//! thread (e.g. the evaluator's, through an `Arc<Alerter>`). Dropping the `Alerter` without
//! [`Alerter::shutdown`] also stops the tasks, at their next wait.
//!
//! Outcomes reported to the [`OutcomeHook`], with the [`Receiver`] (the labels of
//! `diffmon_webhook_deliveries_total{receiver,outcome}`): [`DeliveryOutcome::Delivered`]
//! (accepted), [`DeliveryOutcome::Retried`] (one failed attempt that will be retried),
//! [`DeliveryOutcome::Rejected`] (given up: non-retryable answer, dropped from the outbox). There is no give-up on retryable failures
//! while the process lives; undelivered entries stay on disk across restarts. Alertmanager
//! re-posts are not counted.
//!
//! Files: `mod.rs` the [`Alerter`] (start, send, the stop file and its retries, the
//! destinations from the config); `event.rs` the [`Event`] and its stable id; `format.rs` the
//! request bodies; `deliver.rs` one destination's delivery (HTTP attempts, retry policy, the
//! worker task); `store.rs` what survives a restart (outbox, delivered-ledger, atomic writes);
//! `outcome.rs` the [`Receiver`] and [`DeliveryOutcome`] labels and the [`OutcomeHook`].

mod deliver;
mod event;
mod format;
mod outcome;
mod store;

#[cfg(test)]
mod tests;

pub use deliver::{DeliveryPolicy, redact_url};
pub use event::{Event, EventKind, event_id, run_instance};
pub use format::{ALERT_NAME, summary};
pub use outcome::{DeliveryOutcome, OutcomeHook, Receiver};

use crate::config::{AlertsConfig, SecretEnv, WebhookFormat};
use deliver::{Book, Destination, DestinationKind, Shared, Worker, restored_active};
use sha2::{Digest, Sha256};
use std::collections::{HashMap, HashSet, VecDeque};
use std::fmt;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use store::{Entry, Ledger, Outbox, atomic_write, remove_durably};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;

/// File name of the delivered-ledger inside `state_dir`.
pub const LEDGER_FILE: &str = "alerts_delivered.json";
/// Folder of pending deliveries inside `state_dir`.
pub const OUTBOX_DIR: &str = "outbox";
/// File name of the state folder's own key, which authenticates outbox entries.
pub const KEY_FILE: &str = "alerts.key";

#[derive(Debug, thiserror::Error)]
pub enum AlertError {
    #[error(
        "{key} names the environment variable {var}, whose secret was not read (the config was loaded for a command that sends nothing)"
    )]
    SecretNotRead { key: String, var: String },
    #[error("{}: cannot {action}: {source}", path.display())]
    Io {
        path: PathBuf,
        action: &'static str,
        source: io::Error,
    },
    #[error("cannot build the HTTP client: {0}")]
    Client(#[source] reqwest::Error),
    #[error("the alerter must be started inside a tokio runtime")]
    NoRuntime,
}

/// Delivers early-stop events; see the module docs.
pub struct Alerter {
    shared: Arc<Shared>,
    dests: Vec<Arc<Destination>>,
    senders: Vec<mpsc::UnboundedSender<Entry>>,
    stop_path: PathBuf,
    stop: Arc<StopFile>,
    shutdown_tx: watch::Sender<bool>,
    tasks: Vec<JoinHandle<()>>,
}

impl fmt::Debug for Alerter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Alerter")
            .field("destinations", &self.dests)
            .field("stop_file", &self.stop_path)
            .field("outbox", &self.shared.outbox.dir())
            .field("policy", &self.shared.policy)
            .finish()
    }
}

impl Alerter {
    /// Takes the destinations as the config parsed them (URLs, and the secrets read from the
    /// variables `secret_env` names: a config loaded without them is refused), loads the outbox
    /// from `<state_dir>/outbox/`, and spawns delivery on the current tokio runtime;
    /// deliveries left pending by a previous run are retried at once.
    ///
    /// `instance` is the run's [`run_instance`], with which its event ids were made.
    pub fn start(
        config: &AlertsConfig,
        run_dir: &Path,
        state_dir: &Path,
        instance: &str,
        on_outcome: OutcomeHook,
    ) -> Result<Alerter, AlertError> {
        Self::start_with(
            config,
            run_dir,
            state_dir,
            instance,
            on_outcome,
            DeliveryPolicy::default(),
        )
    }

    /// [`Alerter::start`] with an explicit policy, for tests and embedding.
    pub fn start_with(
        config: &AlertsConfig,
        run_dir: &Path,
        state_dir: &Path,
        instance: &str,
        on_outcome: OutcomeHook,
        policy: DeliveryPolicy,
    ) -> Result<Alerter, AlertError> {
        let handle = tokio::runtime::Handle::try_current().map_err(|_| AlertError::NoRuntime)?;
        let dests = destinations(config)?;

        let key_path = state_dir.join(KEY_FILE);
        crate::store::safe_fs::remove_leftover_temps(state_dir, KEY_FILE);
        let state_key = store::state_key(&key_path).map_err(|source| AlertError::Io {
            path: key_path.clone(),
            action: "make the outbox key",
            source,
        })?;
        let keys = dests
            .iter()
            .map(|d| {
                let key = store::entry_key(&state_key, &d.key, d.secret.as_ref());
                (d.key.clone(), key)
            })
            .collect();
        let outbox_dir = state_dir.join(OUTBOX_DIR);
        let outbox = Outbox::open(outbox_dir.clone(), keys).map_err(|source| AlertError::Io {
            path: outbox_dir.clone(),
            action: "create the outbox folder",
            source,
        })?;
        crate::store::safe_fs::remove_leftover_temps(state_dir, LEDGER_FILE);
        let ledger = Ledger::load(state_dir.join(LEDGER_FILE));
        let store::Loaded {
            entries: loaded,
            refused,
        } = outbox.load().map_err(|source| AlertError::Io {
            path: outbox_dir.clone(),
            action: "read the outbox folder",
            source,
        })?;
        for dest in refused {
            if let Some(d) = dests.iter().find(|d| d.key == dest) {
                on_outcome(d.kind.receiver(), DeliveryOutcome::Unauthenticated);
            }
        }

        // Sort loaded entries to their destinations; drop those already delivered.
        let mut queues: HashMap<String, VecDeque<Entry>> = HashMap::new();
        let mut pending = HashSet::new();
        for entry in loaded {
            let key = entry.key();
            if ledger.contains(&key) {
                let _ = outbox.remove(&entry.event.id, &entry.dest);
                continue;
            }
            if !dests.iter().any(|d| d.key == entry.dest) {
                tracing::warn!(
                    path = %outbox.path(&entry.event.id, &entry.dest).display(),
                    destination = %entry.dest,
                    "outbox entry for a destination that is no longer configured; kept on disk, not delivered"
                );
                continue;
            }
            if pending.insert(key) {
                queues
                    .entry(entry.dest.clone())
                    .or_default()
                    .push_back(entry);
            }
        }
        let restored = pending.len();

        let client = reqwest::Client::builder()
            .redirect(reqwest::redirect::Policy::none())
            .connect_timeout(policy.request_timeout)
            .user_agent(concat!("diffmon/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(AlertError::Client)?;

        let stop_path = run_dir.join(&config.stop_file);
        if let Some(name) = stop_path.file_name() {
            crate::store::safe_fs::remove_leftover_temps(
                crate::store::safe_fs::parent(&stop_path),
                &name.to_string_lossy(),
            );
        }
        let stop_event = crate::store::safe_fs::read_bounded(&stop_path, 1 << 20)
            .ok()
            .and_then(|b| serde_json::from_slice::<Event>(&b).ok());
        let actives: Vec<Option<Event>> = dests
            .iter()
            .map(|d| restored_active(stop_event.as_ref(), instance, d, &ledger))
            .collect();

        let shared = Arc::new(Shared {
            outbox,
            key: (key_path, state_key),
            book: Mutex::new(Book { ledger, pending }),
            on_outcome,
            client,
            policy,
        });
        let (shutdown_tx, shutdown_rx) = watch::channel(false);
        let mut senders = Vec::new();
        let mut tasks = Vec::new();
        for (dest, active) in dests.iter().zip(actives) {
            let (tx, rx) = mpsc::unbounded_channel();
            let queue = queues.remove(&dest.key).unwrap_or_default();
            let worker = Worker::new(
                dest.clone(),
                shared.clone(),
                rx,
                queue,
                shutdown_rx.clone(),
                active,
            );
            senders.push(tx);
            tasks.push(handle.spawn(worker.run()));
        }
        let stop = Arc::new(StopFile {
            path: stop_path.clone(),
            pending: Mutex::new(None),
            wake: tokio::sync::Notify::new(),
        });
        tasks.push(handle.spawn(retry_stop_file(
            stop.clone(),
            shared.policy.clone(),
            shutdown_rx.clone(),
        )));
        tracing::info!(
            destinations = dests.len(),
            pending = restored,
            stop_file = %stop_path.display(),
            "alerter started"
        );
        Ok(Alerter {
            shared,
            dests,
            senders,
            stop_path,
            stop,
            shutdown_tx,
            tasks,
        })
    }

    /// Fires an event: for `early_stop` writes the stop file atomically with the event JSON, for
    /// `resolved` removes it; then records one outbox entry per destination durably and hands it
    /// to that destination's task. Idempotent per (event id, destination). Does a little
    /// blocking file I/O (a few small files) and never waits for the network.
    ///
    /// Every destination is attempted even if the stop file or an outbox write fails; the first
    /// such error is returned (an entry that could not be persisted is still delivered while the
    /// process runs).
    pub fn send(&self, event: &Event) -> Result<(), AlertError> {
        self.send_touching_stop_file(event, true)
    }

    /// Sends again the events a replay of the history found, oldest first: each to every
    /// destination not yet delivered, and the stop file made what the last one wants, once (an
    /// `early_stop` followed by its `resolved` never writes it for a moment). The first error is
    /// returned, after every event was attempted.
    pub fn send_replayed(&self, events: &[Event]) -> Result<(), AlertError> {
        let mut first_error = None;
        for (k, event) in events.iter().enumerate() {
            if let Err(e) = self.send_touching_stop_file(event, k + 1 == events.len()) {
                first_error.get_or_insert(e);
            }
        }
        first_error.map_or(Ok(()), Err)
    }

    fn send_touching_stop_file(&self, event: &Event, stop_file: bool) -> Result<(), AlertError> {
        let mut first_error = None;
        let action = match event.event {
            EventKind::EarlyStop => match serde_json::to_vec_pretty(event) {
                Ok(bytes) => StopAction::Write(bytes),
                Err(e) => unreachable!("events serialize: {e}"),
            },
            EventKind::Resolved => StopAction::Remove,
        };
        if stop_file && let Err(e) = self.stop.set(action, &event.id) {
            tracing::warn!(error = %e, event_id = %event.id, "cannot update the stop file; retrying with backoff until it is done");
            first_error = Some(e);
        }

        for (dest, tx) in self.dests.iter().zip(&self.senders) {
            let entry = Entry::new(&dest.key, event);
            let key = entry.key();
            let mut book = self.shared.book();
            if book.ledger.contains(&key) || book.pending.contains(&key) {
                tracing::debug!(
                    destination = %dest.label,
                    event_id = %event.id,
                    "event already delivered or pending for this destination; not sending again"
                );
                continue;
            }
            if let Err(source) = self.shared.outbox.put(&entry) {
                let e = AlertError::Io {
                    path: self.shared.outbox.path(&event.id, &dest.key),
                    action: "write the outbox entry",
                    source,
                };
                tracing::warn!(error = %e, destination = %dest.label, "alert not persisted; delivering it from memory");
                first_error.get_or_insert(e);
            }
            book.pending.insert(key);
            drop(book);
            if tx.send(entry).is_err() {
                tracing::warn!(destination = %dest.label, event_id = %event.id, "delivery task has stopped; the alert stays in the outbox");
            }
        }
        match first_error {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// What to do when the state folder was deleted under the daemon and made anew
    /// (`crate::store::state_dir::StateDir::on_remade`): write the outbox key and the delivered-ledger
    /// there again from memory, so that entries written from now on verify after a restart and
    /// delivered events are not delivered again.
    pub fn on_state_remade(&self) -> impl Fn() + Send + Sync + 'static {
        let shared = self.shared.clone();
        move || {
            let (path, key) = &shared.key;
            let written = crate::store::safe_fs::create_private_dir(shared.outbox.dir())
                .and_then(|()| atomic_write(path, key))
                .and_then(|()| shared.book().ledger.write());
            if let Err(e) = written {
                tracing::warn!(error = %e, "cannot write the outbox key and the delivered-ledger into the re-made state folder");
            }
        }
    }

    /// Path of the stop file (`<run_dir>/<alerts.stop_file>`).
    pub fn stop_file(&self) -> &Path {
        &self.stop_path
    }

    /// Number of deliveries queued or in flight.
    pub fn pending(&self) -> usize {
        self.shared.book().pending.len()
    }

    /// Stops the delivery tasks: tasks waiting (idle or between retries) stop at once, an attempt
    /// in flight gets up to `timeout` to finish. Undelivered entries stay on disk for the next
    /// start.
    pub async fn shutdown(self, timeout: Duration) {
        let _ = self.shutdown_tx.send(true);
        drop(self.senders);
        let deadline = tokio::time::Instant::now() + timeout;
        for mut task in self.tasks {
            if tokio::time::timeout_at(deadline, &mut task).await.is_err() {
                task.abort();
            }
        }
        let left = self.shared.book().pending.len();
        if let Some((action, id)) = lock(&self.stop.pending).as_ref() {
            tracing::error!(stop_file = %crate::store::safe_fs::untrusted(&self.stop.path), event_id = %id, action = action.verb(), "the stop file could not be updated before stopping; the next start does it again (history replay)");
        }
        tracing::info!(pending = left, "alerter stopped");
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// What the stop file must become.
enum StopAction {
    /// Written atomically with these bytes (the event JSON).
    Write(Vec<u8>),
    Remove,
}

impl StopAction {
    fn verb(&self) -> &'static str {
        match self {
            StopAction::Write(_) => "write",
            StopAction::Remove => "remove",
        }
    }
}

/// The stop file and the update still to be made to it, when the last attempt failed.
struct StopFile {
    path: PathBuf,
    /// (update, event id) to retry; `None` when the file is as the last event wants it.
    pending: Mutex<Option<(StopAction, String)>>,
    wake: tokio::sync::Notify,
}

impl StopFile {
    fn apply(&self, action: &StopAction) -> io::Result<()> {
        match action {
            StopAction::Write(bytes) => atomic_write(&self.path, bytes),
            StopAction::Remove => remove_durably(&self.path).map(|_| ()),
        }
    }

    /// Makes the stop file what `action` says now, or leaves the update to the retry task. A
    /// newer update replaces one still pending.
    fn set(&self, action: StopAction, id: &str) -> Result<(), AlertError> {
        let mut pending = lock(&self.pending);
        match self.apply(&action) {
            Ok(()) => {
                *pending = None;
                Ok(())
            }
            Err(source) => {
                let verb = action.verb();
                *pending = Some((action, id.to_string()));
                self.wake.notify_one();
                Err(AlertError::Io {
                    path: self.path.clone(),
                    action: if verb == "write" {
                        "write the stop file"
                    } else {
                        "remove the stop file"
                    },
                    source,
                })
            }
        }
    }
}

/// Retries a pending stop-file update with the webhooks' backoff until it succeeds; WARN per
/// failed attempt, INFO when done.
async fn retry_stop_file(
    stop: Arc<StopFile>,
    policy: DeliveryPolicy,
    mut shutdown: watch::Receiver<bool>,
) {
    let mut failures = 0u32;
    loop {
        if *shutdown.borrow() {
            return;
        }
        if lock(&stop.pending).is_none() {
            failures = 0;
            tokio::select! {
                _ = stop.wake.notified() => {}
                r = shutdown.changed() => if r.is_err() { return },
            }
            continue;
        }
        failures += 1;
        let delay = policy.backoff(failures);
        tokio::select! {
            _ = tokio::time::sleep(delay) => {}
            r = shutdown.changed() => if r.is_err() { return },
        }
        let mut pending = lock(&stop.pending);
        let Some((action, id)) = pending.as_ref() else {
            continue;
        };
        let path = crate::store::safe_fs::untrusted(&stop.path);
        match stop.apply(action) {
            Ok(()) => {
                tracing::info!(stop_file = %path, event_id = %id, action = action.verb(), attempts = failures + 1, "stop file updated after failed attempts");
                *pending = None;
            }
            Err(e) => {
                tracing::warn!(stop_file = %path, event_id = %id, action = action.verb(), attempts = failures + 1, "cannot update the stop file ({e}); retrying");
            }
        }
    }
}

/// Builds the destinations from the config: webhooks in order, then Alertmanager.
fn destinations(config: &AlertsConfig) -> Result<Vec<Arc<Destination>>, AlertError> {
    let mut out: Vec<Arc<Destination>> = Vec::new();
    for (i, w) in config.webhooks.iter().enumerate() {
        let secret = match &w.secret {
            None => None,
            Some(SecretEnv {
                secret: Some(secret),
                ..
            }) => Some(secret.clone()),
            Some(SecretEnv { var, secret: None }) => {
                return Err(AlertError::SecretNotRead {
                    key: format!("alerts.webhooks[{i}].secret_env"),
                    var: var.clone(),
                });
            }
        };
        let format_name = match w.format {
            WebhookFormat::Json => "json",
            WebhookFormat::Slack => "slack",
            WebhookFormat::Alertmanager => "alertmanager",
        };
        let key = format!(
            "webhook-{}",
            short_hash(&[
                w.url.as_str(),
                format_name,
                w.secret.as_ref().map_or("", |s| s.var.as_str())
            ])
        );
        if out.iter().any(|d| d.key == key) {
            tracing::warn!(
                key = %format!("alerts.webhooks[{i}]"),
                "duplicate webhook (same url, format and secret_env); ignored"
            );
            continue;
        }
        out.push(Arc::new(Destination {
            key,
            label: format!("alerts.webhooks[{i}] {}", redact_url(&w.url)),
            url: w.url.clone(),
            kind: DestinationKind::Webhook(w.format),
            secret,
        }));
    }
    if let Some(am) = &config.alertmanager {
        let base = &am.url;
        let mut url = base.clone();
        url.set_path(&format!(
            "{}/api/v2/alerts",
            base.path().trim_end_matches('/')
        ));
        out.push(Arc::new(Destination {
            key: format!("alertmanager-{}", short_hash(&[base.as_str()])),
            label: format!("alerts.alertmanager {}", redact_url(base)),
            url,
            kind: DestinationKind::Alertmanager,
            secret: None,
        }));
    }
    Ok(out)
}

fn short_hash(parts: &[&str]) -> String {
    let mut h = Sha256::new();
    for p in parts {
        h.update(p.as_bytes());
        h.update([0u8]);
    }
    event::hex(&h.finalize()[..6])
}
