//! Delivery: destinations, one HTTP attempt, retry policy and the per-destination worker task.

use super::event::{Event, EventKind, event_id};
use super::format;
use super::outcome::{DeliveryOutcome, OutcomeHook, Receiver};
use super::store::{Entry, Ledger, Outbox, delivery_key};
use crate::config::WebhookFormat;
use crate::sign::{Secret, signature};
use rand::Rng;
use reqwest::header::{CONTENT_TYPE, HeaderMap, RETRY_AFTER};
use reqwest::{StatusCode, Url};
use std::collections::{HashSet, VecDeque};
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;

/// Retry and timing knobs. [`Default`] is what the daemon uses; tests shrink the delays.
#[derive(Clone, Debug, PartialEq)]
pub struct DeliveryPolicy {
    /// First backoff ceiling; doubles with every consecutive failure of a destination.
    pub base_delay: Duration,
    /// Largest backoff ceiling. The actual delay is drawn uniformly in `[0, ceiling]` (full jitter).
    pub max_delay: Duration,
    /// Largest wait honoured from a `Retry-After: <seconds>` header on 429 or 503.
    pub max_retry_after: Duration,
    /// Timeout of one HTTP request (connect + send + response).
    pub request_timeout: Duration,
    /// After this many consecutive failures of one destination, log once at ERROR (a person
    /// should look at the receiver); before that each failure is a WARN.
    pub escalate_after: u32,
    /// Re-post the active firing alert to Alertmanager this often, so that Alertmanager, which
    /// resolves alerts not re-sent within its `resolve_timeout` (default 5 min), keeps it active.
    /// `None` disables re-posting.
    pub alertmanager_refresh: Option<Duration>,
}

impl Default for DeliveryPolicy {
    fn default() -> Self {
        DeliveryPolicy {
            base_delay: Duration::from_millis(500),
            max_delay: Duration::from_secs(60),
            max_retry_after: Duration::from_secs(60),
            request_timeout: Duration::from_secs(10),
            escalate_after: 10,
            alertmanager_refresh: Some(Duration::from_secs(60)),
        }
    }
}

impl DeliveryPolicy {
    /// Backoff ceiling after `failures` consecutive failures (1-based):
    /// `min(max_delay, base_delay · 2^(failures−1))`.
    pub fn backoff_ceiling(&self, failures: u32) -> Duration {
        let exp = failures.saturating_sub(1).min(30);
        self.base_delay
            .saturating_mul(1u32 << exp)
            .min(self.max_delay)
    }

    /// A delay drawn uniformly in `[0, backoff_ceiling(failures)]` (full jitter).
    pub fn backoff(&self, failures: u32) -> Duration {
        let ceiling = self.backoff_ceiling(failures);
        let nanos = ceiling.as_nanos().min(u128::from(u64::MAX)) as u64;
        Duration::from_nanos(rand::thread_rng().gen_range(0..=nanos))
    }

    /// The wait before the next attempt: the server's `Retry-After` (capped) when it gave one,
    /// else the jittered backoff.
    pub fn next_delay(&self, failures: u32, retry_after: Option<Duration>) -> Duration {
        match retry_after {
            Some(d) => d.min(self.max_retry_after),
            None => self.backoff(failures),
        }
    }
}

/// How a destination is addressed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DestinationKind {
    Webhook(WebhookFormat),
    /// `POST {url}/api/v2/alerts`.
    Alertmanager,
}

impl DestinationKind {
    /// The `receiver` label of the delivery counter.
    pub fn receiver(&self) -> Receiver {
        match self {
            DestinationKind::Webhook(_) => Receiver::Webhook,
            DestinationKind::Alertmanager => Receiver::Alertmanager,
        }
    }
}

/// One configured receiver.
pub struct Destination {
    /// Stable across restarts and config reorderings: `webhook-<hash>` / `alertmanager-<hash>`
    /// of the URL, format and secret variable name. Used in outbox file names and the ledger.
    pub key: String,
    /// For logs: the config key and the URL reduced to scheme, host and port (paths of webhook
    /// URLs often hold tokens, e.g. Slack's).
    pub label: String,
    pub url: Url,
    pub kind: DestinationKind,
    pub secret: Option<Secret>,
}

impl fmt::Debug for Destination {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Destination")
            .field("key", &self.key)
            .field("label", &self.label)
            .field("kind", &self.kind)
            .field("signed", &self.secret.is_some())
            .finish()
    }
}

/// `scheme://host[:port]`, plus `/…` when the URL has a path, query or user info.
pub fn redact_url(url: &Url) -> String {
    let mut s = format!("{}://{}", url.scheme(), url.host_str().unwrap_or(""));
    if let Some(port) = url.port() {
        s.push_str(&format!(":{port}"));
    }
    if url.path() != "/" || url.query().is_some() || !url.username().is_empty() {
        s.push_str("/…");
    }
    s
}

/// The result of one HTTP attempt.
#[derive(Debug)]
pub enum Attempt {
    Delivered(StatusCode),
    /// Timeouts, connection errors, 408, 429 and 5xx.
    Retry {
        reason: String,
        retry_after: Option<Duration>,
    },
    /// Any other answer (4xx, an unfollowed redirect) or a request that cannot be built.
    Rejected {
        reason: String,
    },
}

/// One POST of `event` to `dest`, signed when the destination has a secret.
pub async fn attempt(
    client: &reqwest::Client,
    dest: &Destination,
    policy: &DeliveryPolicy,
    event: &Event,
) -> Attempt {
    let body = match dest.kind {
        DestinationKind::Webhook(fmt) => format::webhook_body(fmt, event),
        DestinationKind::Alertmanager => format::alertmanager_api_body(event),
    };
    let mut req = client
        .post(dest.url.clone())
        .timeout(policy.request_timeout)
        .header(CONTENT_TYPE, "application/json");
    if let Some(secret) = &dest.secret {
        let ts = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs() as i64)
            .unwrap_or(0);
        req = req
            .header("webhook-id", event.id.as_str())
            .header("webhook-timestamp", ts.to_string())
            .header("webhook-signature", signature(secret, &event.id, ts, &body));
    }
    let mut resp = match req.body(body).send().await {
        Ok(r) => r,
        Err(e) => {
            let builder = e.is_builder();
            let reason = error_chain(&e.without_url());
            return if builder {
                Attempt::Rejected { reason }
            } else {
                Attempt::Retry {
                    reason,
                    retry_after: None,
                }
            };
        }
    };
    let status = resp.status();
    if status.is_success() {
        return Attempt::Delivered(status);
    }
    let retry_after = parse_retry_after(resp.headers());
    let text = read_snippet(&mut resp).await;
    let reason = if text.is_empty() {
        format!("HTTP {status}")
    } else {
        format!("HTTP {status}: {text}")
    };
    if status == StatusCode::TOO_MANY_REQUESTS
        || status == StatusCode::REQUEST_TIMEOUT
        || status.is_server_error()
    {
        Attempt::Retry {
            reason,
            retry_after,
        }
    } else {
        Attempt::Rejected { reason }
    }
}

fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(src) = cur {
        let part = src.to_string();
        if !s.contains(&part) {
            s.push_str(": ");
            s.push_str(&part);
        }
        cur = src.source();
    }
    s
}

/// `Retry-After: <seconds>`; the HTTP-date form is ignored (the backoff applies).
pub fn parse_retry_after(headers: &HeaderMap) -> Option<Duration> {
    let v = headers.get(RETRY_AFTER)?.to_str().ok()?.trim();
    v.parse::<u64>().ok().map(Duration::from_secs)
}

/// The first 200 characters of the response body, on one line, for logs.
async fn read_snippet(resp: &mut reqwest::Response) -> String {
    let mut buf = Vec::new();
    while buf.len() < 1024 {
        match resp.chunk().await {
            Ok(Some(chunk)) => buf.extend_from_slice(&chunk),
            _ => break,
        }
    }
    let text = String::from_utf8_lossy(&buf);
    let one_line: String = text
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    let trimmed = one_line.trim();
    let mut out: String = trimmed.chars().take(200).collect();
    if trimmed.chars().count() > 200 {
        out.push('…');
    }
    out
}

/// What the workers and `Alerter::send` share.
pub struct Shared {
    pub outbox: Outbox,
    /// The state folder's key file and key (`store::state_key`), to write again into a
    /// re-made state folder.
    pub key: (std::path::PathBuf, [u8; 32]),
    pub book: Mutex<Book>,
    pub on_outcome: OutcomeHook,
    pub client: reqwest::Client,
    pub policy: DeliveryPolicy,
}

/// Delivered-ledger and the delivery keys currently queued, under one lock so that `send` and
/// the workers agree on what is pending.
pub struct Book {
    pub ledger: Ledger,
    pub pending: HashSet<String>,
}

impl Shared {
    pub fn book(&self) -> MutexGuard<'_, Book> {
        // A panic while holding the lock leaves consistent data (plain inserts/removes).
        self.book.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn finish(&self, entry: &Entry, delivered: bool, dest: &Destination) {
        let key = entry.key();
        let mut book = self.book();
        if delivered && let Err(e) = book.ledger.insert(key.clone()) {
            tracing::warn!(
                path = %book.ledger.path().display(),
                error = %e,
                "cannot record a delivery in the delivered-ledger; a re-sent event may be delivered again"
            );
        }
        book.pending.remove(&key);
        if let Err(e) = self.outbox.remove(&entry.event.id, &dest.key) {
            tracing::warn!(
                path = %self.outbox.path(&entry.event.id, &dest.key).display(),
                error = %e,
                "cannot remove a finished outbox entry"
            );
        }
    }
}

/// The task that delivers one destination's entries in order (so a `resolved` never overtakes
/// its `early_stop`), retrying the head entry until it is accepted or rejected.
pub struct Worker {
    pub dest: Arc<Destination>,
    pub shared: Arc<Shared>,
    pub rx: mpsc::UnboundedReceiver<Entry>,
    pub rx_open: bool,
    pub queue: VecDeque<Entry>,
    pub shutdown: watch::Receiver<bool>,
    /// Alertmanager only: the firing alert to re-post, and when.
    pub active: Option<Event>,
    pub next_refresh: Instant,
    pub failures: u32,
    pub escalated: bool,
}

impl Worker {
    pub fn new(
        dest: Arc<Destination>,
        shared: Arc<Shared>,
        rx: mpsc::UnboundedReceiver<Entry>,
        queue: VecDeque<Entry>,
        shutdown: watch::Receiver<bool>,
        active: Option<Event>,
    ) -> Worker {
        Worker {
            dest,
            shared,
            rx,
            rx_open: true,
            queue,
            shutdown,
            active,
            next_refresh: Instant::now(),
            failures: 0,
            escalated: false,
        }
    }

    fn stopping(&self) -> bool {
        *self.shutdown.borrow()
    }

    fn refresh_interval(&self) -> Option<Duration> {
        match self.dest.kind {
            DestinationKind::Alertmanager if self.active.is_some() => {
                self.shared.policy.alertmanager_refresh
            }
            _ => None,
        }
    }

    pub async fn run(mut self) {
        loop {
            if self.stopping() {
                return;
            }
            while let Ok(e) = self.rx.try_recv() {
                self.queue.push_back(e);
            }
            if let Some(entry) = self.queue.front().cloned() {
                if !self.deliver(&entry).await {
                    return;
                }
                self.queue.pop_front();
                continue;
            }
            // Idle: wait for an entry, the next Alertmanager refresh, or shutdown.
            let refresh = self.refresh_interval().is_some();
            tokio::select! {
                _ = self.shutdown.changed() => return,
                msg = self.rx.recv(), if self.rx_open => match msg {
                    Some(e) => self.queue.push_back(e),
                    None => self.rx_open = false,
                },
                _ = tokio::time::sleep_until(self.next_refresh), if refresh => self.refresh().await,
            }
        }
    }

    /// Delivers one entry until it is accepted or rejected. Returns false on shutdown (the entry
    /// stays in the outbox).
    async fn deliver(&mut self, entry: &Entry) -> bool {
        let dest = self.dest.clone();
        let id = entry.event.id.as_str();
        let mut attempts = 0u32;
        loop {
            if self.stopping() {
                return false;
            }
            attempts += 1;
            let result = attempt(
                &self.shared.client,
                &dest,
                &self.shared.policy,
                &entry.event,
            )
            .await;
            match result {
                Attempt::Delivered(status) => {
                    self.shared.finish(entry, true, &dest);
                    (self.shared.on_outcome)(dest.kind.receiver(), DeliveryOutcome::Delivered);
                    tracing::info!(
                        destination = %dest.label,
                        event_id = %id,
                        event = %entry.event.event,
                        run = %entry.event.run,
                        status = status.as_u16(),
                        attempts,
                        "alert delivered"
                    );
                    if self.escalated {
                        tracing::info!(destination = %dest.label, "destination is accepting alerts again");
                    }
                    self.failures = 0;
                    self.escalated = false;
                    self.after_delivery(&entry.event);
                    return true;
                }
                Attempt::Rejected { reason } => {
                    self.shared.finish(entry, false, &dest);
                    (self.shared.on_outcome)(dest.kind.receiver(), DeliveryOutcome::Rejected);
                    tracing::warn!(
                        destination = %dest.label,
                        event_id = %id,
                        event = %entry.event.event,
                        attempts,
                        %reason,
                        "alert rejected by the receiver; not retrying, removed from the outbox"
                    );
                    return true;
                }
                Attempt::Retry {
                    reason,
                    retry_after,
                } => {
                    self.failures += 1;
                    (self.shared.on_outcome)(dest.kind.receiver(), DeliveryOutcome::Retried);
                    let delay = self.shared.policy.next_delay(self.failures, retry_after);
                    let delay_ms = delay.as_millis() as u64;
                    if !self.escalated && self.failures >= self.shared.policy.escalate_after {
                        self.escalated = true;
                        tracing::error!(
                            destination = %dest.label,
                            event_id = %id,
                            attempts,
                            consecutive_failures = self.failures,
                            %reason,
                            "alert delivery keeps failing; check the receiver (still retrying, the alert is kept on disk)"
                        );
                    } else {
                        tracing::warn!(
                            destination = %dest.label,
                            event_id = %id,
                            attempts,
                            retry_in_ms = delay_ms,
                            %reason,
                            "alert delivery failed; will retry"
                        );
                    }
                    if !self.pause(delay).await {
                        return false;
                    }
                }
            }
        }
    }

    /// Sleeps while still accepting new entries. Returns false on shutdown.
    async fn pause(&mut self, delay: Duration) -> bool {
        let deadline = Instant::now() + delay;
        loop {
            tokio::select! {
                _ = tokio::time::sleep_until(deadline) => return true,
                _ = self.shutdown.changed() => return false,
                msg = self.rx.recv(), if self.rx_open => match msg {
                    Some(e) => self.queue.push_back(e),
                    None => self.rx_open = false,
                },
            }
        }
    }

    fn after_delivery(&mut self, event: &Event) {
        if self.dest.kind != DestinationKind::Alertmanager {
            return;
        }
        match event.event {
            EventKind::EarlyStop => {
                self.active = Some(event.clone());
                if let Some(every) = self.shared.policy.alertmanager_refresh {
                    self.next_refresh = Instant::now() + every;
                }
            }
            EventKind::Resolved => {
                if self.active.as_ref().is_some_and(|a| a.run == event.run) {
                    self.active = None;
                }
            }
        }
    }

    /// Re-posts the active firing alert once (no retry: the next refresh is the retry).
    async fn refresh(&mut self) {
        let Some(event) = self.active.clone() else {
            return;
        };
        let every = self
            .shared
            .policy
            .alertmanager_refresh
            .unwrap_or(Duration::from_secs(60));
        self.next_refresh = Instant::now() + every;
        match attempt(&self.shared.client, &self.dest, &self.shared.policy, &event).await {
            Attempt::Delivered(_) => tracing::debug!(
                destination = %self.dest.label,
                event_id = %event.id,
                "re-posted the active early-stop alert"
            ),
            Attempt::Retry { reason, .. } | Attempt::Rejected { reason } => tracing::warn!(
                destination = %self.dest.label,
                event_id = %event.id,
                %reason,
                "cannot re-post the active early-stop alert; Alertmanager may resolve it after its resolve_timeout"
            ),
        }
    }
}

/// The firing event recorded in an existing stop file, when its Alertmanager delivery is in the
/// ledger: it becomes the worker's active alert after a restart.
pub fn restored_active(
    stop_event: Option<&Event>,
    instance: &str,
    dest: &Destination,
    ledger: &Ledger,
) -> Option<Event> {
    let e = stop_event?;
    (dest.kind == DestinationKind::Alertmanager
        && e.event == EventKind::EarlyStop
        && e.id == event_id(&e.run, instance, e.event, e.best_step, e.current_step)
        && ledger.contains(&delivery_key(&e.id, &dest.key)))
    .then(|| e.clone())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_bounds() {
        let p = DeliveryPolicy::default();
        assert_eq!(p.backoff_ceiling(1), Duration::from_millis(500));
        assert_eq!(p.backoff_ceiling(2), Duration::from_secs(1));
        assert_eq!(p.backoff_ceiling(3), Duration::from_secs(2));
        assert_eq!(p.backoff_ceiling(8), Duration::from_secs(60));
        assert_eq!(p.backoff_ceiling(1000), Duration::from_secs(60));
        for failures in 1..40 {
            let ceiling = p.backoff_ceiling(failures);
            for _ in 0..50 {
                assert!(p.backoff(failures) <= ceiling);
            }
        }
        // Full jitter: draws spread over the interval, not stuck at the ceiling.
        let draws: Vec<_> = (0..200).map(|_| p.backoff(8)).collect();
        assert!(draws.iter().any(|d| *d < Duration::from_secs(30)));
        assert!(draws.iter().any(|d| *d > Duration::from_secs(30)));
    }

    #[test]
    fn retry_after_is_honoured_and_capped() {
        let p = DeliveryPolicy::default();
        assert_eq!(
            p.next_delay(1, Some(Duration::from_secs(7))),
            Duration::from_secs(7)
        );
        assert_eq!(
            p.next_delay(1, Some(Duration::from_secs(3600))),
            Duration::from_secs(60)
        );
        assert!(p.next_delay(1, None) <= Duration::from_millis(500));
        let mut h = HeaderMap::new();
        h.insert(RETRY_AFTER, "12".parse().unwrap());
        assert_eq!(parse_retry_after(&h), Some(Duration::from_secs(12)));
        h.insert(
            RETRY_AFTER,
            "Wed, 21 Oct 2015 07:28:00 GMT".parse().unwrap(),
        );
        assert_eq!(parse_retry_after(&h), None);
    }

    #[test]
    fn urls_are_redacted_for_logs() {
        let u = Url::parse("https://hooks.slack.com/services/T000/B000/XXXXSECRET").unwrap();
        assert_eq!(redact_url(&u), "https://hooks.slack.com/…");
        let u = Url::parse("http://127.0.0.1:9093").unwrap();
        assert_eq!(redact_url(&u), "http://127.0.0.1:9093");
        let u = Url::parse("http://user:pw@host/").unwrap();
        assert_eq!(redact_url(&u), "http://host/…");
    }
}
