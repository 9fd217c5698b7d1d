//! The daemon's HTTP endpoints (docs/design.md §16): `GET /metrics` (Prometheus), `GET /healthz`,
//! `GET /v1/early-stop` (the detector's status as JSON), and `GET /`, the live page: the plots
//! of `diffmon report` drawn from the daemon's in-memory history, reloading itself.
//!
//! [`serve`] runs them under bounds (`http.*` of the config): a request's headers must arrive
//! within `header_timeout_secs` of its first byte, a connection with no request in flight is
//! closed after `idle_timeout_secs`, and at most `max_connections` are open at once. When the
//! cap is full, a new connection closes the one that has waited longest without a request in
//! flight (idle, or trickling its head) and takes its place, so a liveness probe or a
//! Prometheus scrape is answered while slow clients hold every place; only when every open
//! connection has a request in flight is the new one closed at once (the kernel's backlog would
//! otherwise hold it). A flood of slow or idle clients costs bounded memory and file
//! descriptors.

use crate::alerts::Event;
use crate::config::HttpConfig;
use crate::metrics::{self, Metrics};
use crate::report::{self, Format, Snapshot};
use axum::Router;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use hyper_util::rt::TokioIo;
use hyper_util::service::TowerToHyperService;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};

pub fn router(
    metrics: Arc<Metrics>,
    status: Arc<Mutex<EarlyStopStatus>>,
    snapshot: Arc<Mutex<Snapshot>>,
) -> Router {
    Router::new()
        .route(
            "/",
            get(move || {
                // A copy of plain data, taken under the lock; drawn outside it.
                let snapshot = snapshot.lock().unwrap_or_else(|e| e.into_inner()).clone();
                async move {
                    let format = Format::Html {
                        refresh_secs: Some(report::LIVE_REFRESH_SECS),
                    };
                    match report::render(&snapshot, format) {
                        Ok(page) => (
                            [
                                (header::CONTENT_TYPE, "text/html; charset=utf-8"),
                                (header::CACHE_CONTROL, "no-store"),
                            ],
                            page,
                        )
                            .into_response(),
                        Err(e) => {
                            (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response()
                        }
                    }
                }
            }),
        )
        .route(
            "/metrics",
            get(move |headers: HeaderMap| {
                let metrics = metrics.clone();
                async move {
                    let accept = headers.get(header::ACCEPT).and_then(|v| v.to_str().ok());
                    let format = metrics::Format::negotiate(accept);
                    (
                        [(header::CONTENT_TYPE, format.content_type())],
                        metrics.encode_as(format),
                    )
                }
            }),
        )
        .route("/healthz", get(|| async { "ok\n" }))
        .route(
            "/v1/early-stop",
            get(move || {
                let status = status.lock().unwrap_or_else(|e| e.into_inner()).clone();
                async move { axum::Json(status).into_response() }
            }),
        )
}

/// One run of a sweep as the HTTP endpoints see it.
#[derive(Clone)]
pub struct RunView {
    pub name: String,
    pub metrics: Arc<Metrics>,
    pub status: Arc<Mutex<EarlyStopStatus>>,
    pub snapshot: Arc<Mutex<Snapshot>>,
}

/// The runs of a sweep as the HTTP endpoints see them: a list that grows while the daemon runs
/// (`runs_glob`), and the sweep's own metrics. Each request works on a snapshot of it.
#[derive(Clone, Default)]
pub struct RunList(Arc<std::sync::RwLock<Vec<RunView>>>, metrics::SweepMetrics);

impl RunList {
    /// The sweep's own metrics (shared with every clone of the list).
    pub fn sweep_metrics(&self) -> &metrics::SweepMetrics {
        &self.1
    }

    pub fn push(&self, run: RunView) {
        self.0.write().unwrap_or_else(|e| e.into_inner()).push(run);
    }

    /// The runs now.
    pub fn snapshot(&self) -> Vec<RunView> {
        self.0.read().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

/// The endpoints of a sweep (docs/design.md §19): `/metrics` with every run's series (each
/// under its `run` label), `/healthz`, `/v1/early-stop` (an object: run name → that run's
/// status), `/v1/runs/{run}/early-stop`, `/` (the list of runs, with their state and a link to
/// each live page) and `/runs/{run}` (a run's live page). Run names are checked by the config
/// (letters, digits, `.`, `_`, `-`), so they are safe in a path and in HTML.
pub fn sweep_router(runs: RunList) -> Router {
    let find = |runs: &[RunView], name: &str| runs.iter().find(|r| r.name == name).cloned();
    let (r1, r2, r3, r4, r5) = (
        runs.clone(),
        runs.clone(),
        runs.clone(),
        runs.clone(),
        runs.clone(),
    );
    Router::new()
        .route(
            "/",
            get(move || {
                let page = runs_page(&r1.snapshot());
                async move {
                    (
                        [
                            (header::CONTENT_TYPE, "text/html; charset=utf-8"),
                            (header::CACHE_CONTROL, "no-store"),
                        ],
                        page,
                    )
                }
            }),
        )
        .route(
            "/runs/{run}",
            get(
                move |axum::extract::Path(name): axum::extract::Path<String>| {
                    let run = find(&r2.snapshot(), &name);
                    async move {
                        let Some(run) = run else {
                            return (StatusCode::NOT_FOUND, "no such run\n").into_response();
                        };
                        let snapshot = run
                            .snapshot
                            .lock()
                            .unwrap_or_else(|e| e.into_inner())
                            .clone();
                        live_page(&snapshot)
                    }
                },
            ),
        )
        .route(
            "/metrics",
            get(move |headers: HeaderMap| {
                let metrics: Vec<Arc<Metrics>> =
                    r3.snapshot().iter().map(|r| r.metrics.clone()).collect();
                let sweep = r3.sweep_metrics().clone();
                async move {
                    let accept = headers.get(header::ACCEPT).and_then(|v| v.to_str().ok());
                    let format = metrics::Format::negotiate(accept);
                    (
                        [(header::CONTENT_TYPE, format.content_type())],
                        Metrics::encode_sweep_as(&metrics, &sweep, format),
                    )
                }
            }),
        )
        .route("/healthz", get(|| async { "ok\n" }))
        .route(
            "/v1/early-stop",
            get(move || {
                let all: serde_json::Map<String, serde_json::Value> = r4
                    .snapshot()
                    .iter()
                    .map(|r| {
                        let status = r.status.lock().unwrap_or_else(|e| e.into_inner()).clone();
                        (
                            r.name.clone(),
                            serde_json::to_value(status).unwrap_or_default(),
                        )
                    })
                    .collect();
                async move { axum::Json(all).into_response() }
            }),
        )
        .route(
            "/v1/runs/{run}/early-stop",
            get(
                move |axum::extract::Path(name): axum::extract::Path<String>| {
                    let status = find(&r5.snapshot(), &name)
                        .map(|r| r.status.lock().unwrap_or_else(|e| e.into_inner()).clone());
                    async move {
                        match status {
                            Some(status) => axum::Json(status).into_response(),
                            None => (StatusCode::NOT_FOUND, "no such run\n").into_response(),
                        }
                    }
                },
            ),
        )
}

/// A run's live page.
fn live_page(snapshot: &Snapshot) -> axum::response::Response {
    let format = Format::Html {
        refresh_secs: Some(report::LIVE_REFRESH_SECS),
    };
    match report::render(snapshot, format) {
        Ok(page) => (
            [
                (header::CONTENT_TYPE, "text/html; charset=utf-8"),
                (header::CACHE_CONTROL, "no-store"),
            ],
            page,
        )
            .into_response(),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response(),
    }
}

/// The sweep's front page: the index of the runs (their early-stop state), each linking its
/// live page; the index `diffmon report` writes for a sweep, reloading itself.
fn runs_page(runs: &[RunView]) -> String {
    let rows: Vec<report::IndexRow> = runs
        .iter()
        .map(|r| {
            let s = r.status.lock().unwrap_or_else(|e| e.into_inner());
            report::IndexRow {
                name: r.name.clone(),
                href: Some(format!("runs/{}", r.name)),
                last_step: s.last_step,
                best_step: s.best_step,
                fired: s.fired,
            }
        })
        .collect();
    report::index_page(&rows, Some(report::LIVE_REFRESH_SECS))
}

/// What `/v1/early-stop` answers.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct EarlyStopStatus {
    pub fired: bool,
    pub best_step: Option<i64>,
    pub best_checkpoint: Option<String>,
    pub best_value: Option<f64>,
    pub last_step: Option<i64>,
    pub last_value: Option<f64>,
    pub event: Option<Event>,
    /// The history segment the detector follows (1 until the first `diffmon resume`).
    pub segment: u32,
}

/// The bounds of [`serve`], from `http.*` of the config.
#[derive(Clone, Debug)]
pub struct Limits {
    pub header_timeout: Duration,
    pub idle_timeout: Duration,
    pub max_connections: usize,
    /// `http.allowed_hosts` (see [`host_allowed`]).
    pub allowed_hosts: Arc<[String]>,
}

/// Is `host` (a request's `Host` header) one the server answers? An IP address (IPv4, or IPv6
/// in brackets), `localhost`, or a name of `allowed` (lower case), with or without a port; a
/// request without the header is answered. A page of another site that rebinds its own name to
/// 127.0.0.1 reaches the server under that name, which is none of these, so it cannot read
/// `/v1/early-stop` from the user's browser.
pub fn host_allowed(host: Option<&str>, allowed: &[String]) -> bool {
    let Some(host) = host else {
        return true;
    };
    let host = host.trim();
    if let Some(rest) = host.strip_prefix('[') {
        return rest.split_once(']').is_some_and(|(ip, port)| {
            ip.parse::<std::net::Ipv6Addr>().is_ok()
                && (port.is_empty() || port.strip_prefix(':').is_some_and(is_port))
        });
    }
    let name = match host.rsplit_once(':') {
        Some((name, port)) if is_port(port) => name,
        Some(_) => return false,
        None => host,
    };
    let name = name.trim_end_matches('.').to_ascii_lowercase();
    name.parse::<std::net::Ipv4Addr>().is_ok() || name == "localhost" || allowed.contains(&name)
}

fn is_port(s: &str) -> bool {
    !s.is_empty() && s.len() <= 5 && s.bytes().all(|b| b.is_ascii_digit())
}

/// Why a request is refused before it reaches a route, if it is: more than one `Host` header
/// or a request line in absolute form (`GET http://name/ HTTP/1.1`: a proxy's form, whose name
/// would stand beside the `Host` header's) are 400; a `Host` that is not one of
/// [`host_allowed`]'s is 403.
fn refusal(
    headers: &header::HeaderMap,
    uri: &axum::http::Uri,
    allowed: &[String],
) -> Option<(StatusCode, &'static str)> {
    if headers.get_all(header::HOST).iter().count() > 1 {
        return Some((StatusCode::BAD_REQUEST, "more than one Host header\n"));
    }
    if uri.scheme().is_some() || uri.authority().is_some() {
        return Some((
            StatusCode::BAD_REQUEST,
            "a request line in absolute form is not answered: ask for the path alone\n",
        ));
    }
    let host = headers
        .get(header::HOST)
        .map(|h| h.to_str().unwrap_or("\u{0}"));
    (!host_allowed(host, allowed)).then_some((
        StatusCode::FORBIDDEN,
        "host not allowed: add its name to http.allowed_hosts (docs/guide/monitoring.md)\n",
    ))
}

impl Limits {
    /// The bounds `http.*` set.
    pub fn of(c: &HttpConfig) -> Limits {
        Limits {
            header_timeout: c.header_timeout,
            idle_timeout: c.idle_timeout,
            max_connections: c.max_connections.get(),
            allowed_hosts: c.allowed_hosts.clone().into(),
        }
    }
}

/// Serves `app` on `listener` until the task is dropped, under `limits`.
pub async fn serve(listener: TcpListener, app: Router, limits: Limits) {
    let allowed = limits.allowed_hosts.clone();
    let app = app.layer(axum::middleware::from_fn(
        move |req: axum::extract::Request, next: axum::middleware::Next| {
            let allowed = allowed.clone();
            async move {
                match refusal(req.headers(), req.uri(), &allowed) {
                    None => next.run(req).await,
                    Some(refused) => refused.into_response(),
                }
            }
        },
    ));
    let connections: Open = Arc::default();
    let mut next_id = 0u64;
    // Log the first connection at the cap of a burst, not every one.
    let mut refusing = false;
    loop {
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            Err(e) => {
                // Out of file descriptors, or a connection reset before it was accepted: go on
                // after a pause rather than spin.
                tracing::warn!("cannot accept an HTTP connection: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let full =
            connections.lock().unwrap_or_else(|e| e.into_inner()).len() >= limits.max_connections;
        if full {
            let evicted = evict_longest_waiting(&connections);
            if !refusing {
                if evicted {
                    tracing::warn!(
                        max_connections = limits.max_connections,
                        "HTTP connections at the cap (http.max_connections): each new one closes the one that has waited longest without a request"
                    );
                } else {
                    tracing::warn!(
                        max_connections = limits.max_connections,
                        "HTTP connections at the cap (http.max_connections), every one with a request in flight: new ones are closed at once"
                    );
                }
                refusing = true;
            }
            if !evicted {
                drop(stream);
                continue;
            }
        } else {
            refusing = false;
        }
        next_id += 1;
        let activity = Arc::new(Activity::new());
        let slot = Slot {
            open: connections.clone(),
            id: next_id,
        };
        connections
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(next_id, activity.clone());
        let app = app.clone();
        let limits = limits.clone();
        tokio::spawn(async move {
            let _slot = slot;
            serve_connection(stream, app, limits, activity).await;
        });
    }
}

/// One place of `max_connections`, freed when the connection's task ends. An evicted
/// connection keeps its place until its task has ended (at its next poll), so the places in use
/// exceed the cap only by the evictions still under way.
struct Slot {
    open: Open,
    id: u64,
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.open
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&self.id);
    }
}

/// What a connection's watchdog reads: milliseconds since `origin` of the last byte moved, of
/// the first byte of a request head still being read (0: none), and the requests in flight.
struct Activity {
    origin: Instant,
    last_ms: AtomicU64,
    head_since_ms: AtomicU64,
    in_flight: AtomicUsize,
    /// Wakes the watchdog: a request head started or a request ended (its deadline changed).
    changed: tokio::sync::Notify,
    /// Set (and the watchdog woken) when a new connection takes this one's place.
    evicted: std::sync::atomic::AtomicBool,
}

impl Activity {
    fn new() -> Activity {
        let a = Activity {
            origin: Instant::now(),
            last_ms: AtomicU64::new(0),
            head_since_ms: AtomicU64::new(0),
            in_flight: AtomicUsize::new(0),
            changed: tokio::sync::Notify::new(),
            evicted: std::sync::atomic::AtomicBool::new(false),
        };
        a.last_ms.store(a.now_ms(), Ordering::Release);
        a
    }

    fn now_ms(&self) -> u64 {
        // +1: 0 means "none" for head_since_ms.
        self.origin.elapsed().as_millis() as u64 + 1
    }

    /// Since when it has waited without a request in flight (its head's first byte, or its
    /// last byte when idle); None while a request is in flight or once evicted.
    fn waiting_since(&self) -> Option<Instant> {
        if self.in_flight.load(Ordering::Acquire) > 0 || self.evicted.load(Ordering::Acquire) {
            return None;
        }
        let head = self.head_since_ms.load(Ordering::Acquire);
        let ms = if head != 0 {
            head
        } else {
            self.last_ms.load(Ordering::Acquire)
        };
        Some(self.origin + Duration::from_millis(ms.saturating_sub(1)))
    }
}

/// The open connections' activity, by connection number: what the cap chooses from.
type Open = Arc<Mutex<std::collections::HashMap<u64, Arc<Activity>>>>;

/// Closes the open connection that has waited longest without a request in flight; false when
/// every one has a request in flight.
fn evict_longest_waiting(open: &Open) -> bool {
    let open = open.lock().unwrap_or_else(|e| e.into_inner());
    let Some(a) = open
        .values()
        .filter_map(|a| a.waiting_since().map(|t| (t, a)))
        .min_by_key(|(t, _)| *t)
        .map(|(_, a)| a)
    else {
        return false;
    };
    a.evicted.store(true, Ordering::Release);
    a.changed.notify_one();
    true
}

/// The connection's socket, noting when bytes move and when a request head starts.
struct Tracked {
    inner: TcpStream,
    activity: Arc<Activity>,
}

impl AsyncRead for Tracked {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let r = Pin::new(&mut self.inner).poll_read(cx, buf);
        if matches!(r, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            let a = &self.activity;
            let now = a.now_ms();
            a.last_ms.store(now, Ordering::Release);
            if a.in_flight.load(Ordering::Acquire) == 0
                && a.head_since_ms
                    .compare_exchange(0, now, Ordering::AcqRel, Ordering::Acquire)
                    .is_ok()
            {
                // The watchdog sleeps for the idle deadline: the header deadline is shorter.
                a.changed.notify_one();
            }
        }
        r
    }
}

impl AsyncWrite for Tracked {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write(cx, buf);
        if matches!(r, Poll::Ready(Ok(n)) if n > 0) {
            let now = self.activity.now_ms();
            self.activity.last_ms.store(now, Ordering::Release);
        }
        r
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// Counts a request in flight from its head's end to its response's start.
struct InFlight(Arc<Activity>);

impl InFlight {
    fn start(a: &Arc<Activity>) -> InFlight {
        a.in_flight.fetch_add(1, Ordering::AcqRel);
        a.head_since_ms.store(0, Ordering::Release);
        InFlight(a.clone())
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        let a = &self.0;
        a.last_ms.store(a.now_ms(), Ordering::Release);
        a.in_flight.fetch_sub(1, Ordering::AcqRel);
        a.changed.notify_one();
    }
}

/// Serves one connection (HTTP/1.1, keep-alive) until the client closes it, its request head
/// takes longer than `header_timeout`, or it stays idle for `idle_timeout`.
async fn serve_connection(stream: TcpStream, app: Router, limits: Limits, activity: Arc<Activity>) {
    let io = TokioIo::new(Tracked {
        inner: stream,
        activity: activity.clone(),
    });
    let tower = TowerToHyperService::new(app);
    let tracker = activity.clone();
    let service = hyper::service::service_fn(move |req| {
        let guard = InFlight::start(&tracker);
        let fut = hyper::service::Service::call(&tower, req);
        async move {
            let response = fut.await;
            drop(guard);
            response
        }
    });
    let conn = hyper::server::conn::http1::Builder::new()
        .keep_alive(true)
        // Our own watchdog below times the head from its first byte; hyper's would also close
        // a connection idle between two requests after the same time.
        .header_read_timeout(None)
        .serve_connection(io, service);
    tokio::pin!(conn);
    let header_ms = limits.header_timeout.as_millis() as u64;
    let idle_ms = limits.idle_timeout.as_millis() as u64;
    loop {
        if activity.evicted.load(Ordering::Acquire) {
            tracing::debug!(
                "HTTP connection closed: a new one took its place (http.max_connections)"
            );
            return;
        }
        let now = activity.now_ms();
        let head = activity.head_since_ms.load(Ordering::Acquire);
        let busy = activity.in_flight.load(Ordering::Acquire) > 0;
        let last = activity.last_ms.load(Ordering::Acquire);
        let wait_ms = if head != 0 {
            if now >= head + header_ms {
                tracing::debug!(
                    "HTTP request headers not received in time (http.header_timeout_secs); connection closed"
                );
                return; // dropping the connection closes the socket
            }
            (head + header_ms - now).min(idle_ms.max(1))
        } else if busy {
            idle_ms.max(1)
        } else {
            if now >= last + idle_ms {
                break;
            }
            last + idle_ms - now
        };
        tokio::select! {
            r = conn.as_mut() => {
                if let Err(e) = r {
                    tracing::debug!("HTTP connection ended: {e}");
                }
                return;
            }
            _ = tokio::time::sleep(Duration::from_millis(wait_ms)) => {}
            _ = activity.changed.notified() => {}
        }
    }
    // Idle: close it the polite way (a response being written is finished), within bounds.
    conn.as_mut().graceful_shutdown();
    let _ = tokio::time::timeout(limits.idle_timeout, conn.as_mut()).await;
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{ConfigFile, HttpConfig};

    const MINIMAL: &str = "run: {dir: r}\nmodel: {architecture: m.ts}\ndata: {path: d.h5}\n";

    /// The `http.*` bounds: documented defaults, and values out of range refused by key.
    #[test]
    fn http_bounds_have_defaults_and_ranges() {
        let l = Limits::of(&HttpConfig::default());
        assert_eq!(l.header_timeout, Duration::from_secs(10));
        assert_eq!(l.idle_timeout, Duration::from_secs(60));
        assert_eq!(l.max_connections, 256);
        let c = ConfigFile::parse(MINIMAL, "t.yaml").unwrap();
        let http_problems = |c: &ConfigFile| -> Vec<String> {
            let problems = c.validate();
            problems
                .iter()
                .filter(|p| p.key.starts_with("http."))
                .map(|p| format!("{}: {}", p.key, p.message))
                .collect()
        };
        assert!(http_problems(&c).is_empty(), "{:?}", http_problems(&c));
        for (yaml, key) in [
            ("header_timeout_secs: 0", "http.header_timeout_secs"),
            ("header_timeout_secs: .nan", "http.header_timeout_secs"),
            ("header_timeout_secs: 1e20", "http.header_timeout_secs"),
            ("idle_timeout_secs: .inf", "http.idle_timeout_secs"),
            ("idle_timeout_secs: 0.01", "http.idle_timeout_secs"),
            ("max_connections: 0", "http.max_connections"),
            ("max_connections: 1000000", "http.max_connections"),
            ("allowed_hosts: [\"evil.com:80\"]", "http.allowed_hosts[0]"),
            ("allowed_hosts: [\"\"]", "http.allowed_hosts[0]"),
        ] {
            let text = format!("{MINIMAL}http: {{{yaml}}}\n");
            let c = ConfigFile::parse(&text, "t.yaml").unwrap();
            let problems = http_problems(&c);
            assert!(
                problems.len() == 1 && problems[0].starts_with(&format!("{key}: ")),
                "{yaml}: {problems:?}"
            );
        }
    }

    /// Two `Host` headers, or a request line in absolute form, are refused with 400 whatever
    /// they name (they were answered); one allowed `Host` with a path goes through.
    #[test]
    fn duplicate_hosts_and_absolute_request_lines_are_refused() {
        let allowed: [String; 0] = [];
        let headers = |hosts: &[&str]| {
            let mut h = header::HeaderMap::new();
            for host in hosts {
                h.append(header::HOST, host.parse().unwrap());
            }
            h
        };
        let path: axum::http::Uri = "/metrics".parse().unwrap();
        let absolute: axum::http::Uri = "http://127.0.0.1:9464/metrics".parse().unwrap();
        assert_eq!(
            refusal(&headers(&["127.0.0.1:9464"]), &path, &allowed),
            None
        );
        let two = refusal(
            &headers(&["127.0.0.1", "attacker.example"]),
            &path,
            &allowed,
        );
        assert_eq!(two.map(|r| r.0), Some(StatusCode::BAD_REQUEST));
        let abs = refusal(&headers(&["127.0.0.1"]), &absolute, &allowed);
        assert_eq!(abs.map(|r| r.0), Some(StatusCode::BAD_REQUEST));
        let foreign = refusal(&headers(&["attacker.example"]), &path, &allowed);
        assert_eq!(foreign.map(|r| r.0), Some(StatusCode::FORBIDDEN));
    }

    /// The `Host` header (issue #45: a DNS-rebinding page could read `/v1/early-stop`): IP
    /// addresses, `localhost` and the configured names are answered, with or without a port;
    /// any other name is not.
    #[test]
    fn only_addresses_localhost_and_configured_names_are_answered() {
        let allowed = ["metrics.lab.example".to_string()];
        for host in [
            None,
            Some("127.0.0.1:9464"),
            Some("127.0.0.1"),
            Some("10.1.2.3:80"),
            Some("[::1]:9464"),
            Some("[::1]"),
            Some("localhost:9464"),
            Some("LOCALHOST"),
            Some("metrics.lab.example:9464"),
            Some("Metrics.Lab.Example."),
        ] {
            assert!(host_allowed(host, &allowed), "{host:?}");
        }
        for host in [
            Some("attacker.example:9464"),
            Some("attacker.example"),
            Some("localhost.attacker.example"),
            Some("127.0.0.1.attacker.example"),
            Some("[::1]x"),
            Some("metrics.lab.example:port"),
            Some(""),
        ] {
            assert!(!host_allowed(host, &allowed), "{host:?}");
        }
    }
}
