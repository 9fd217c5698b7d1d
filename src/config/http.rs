//! The `http` section: the metrics server's address, timeouts and connection bound; as written
//! ([`Http`]) and as settings ([`HttpConfig`], the address parsed and the seconds made
//! durations), built and checked by [`http`].

use super::validate::Validator;
use serde::Deserialize;
use std::net::SocketAddr;
use std::num::NonZeroUsize;
use std::time::Duration;

/// `http`: the metrics server's address and bounds.
#[derive(Debug, Clone)]
pub struct HttpConfig {
    pub listen: SocketAddr,
    /// `http.allowed_hosts`: host names the server answers besides IP addresses and
    /// `localhost` (the `Host` header is checked against DNS rebinding), lower case.
    pub allowed_hosts: Vec<String>,
    /// `http.header_timeout_secs`: a request's headers must arrive within this time after its
    /// first byte, else the connection is closed.
    pub header_timeout: Duration,
    /// `http.idle_timeout_secs`: a connection without a request in flight is closed after this.
    pub idle_timeout: Duration,
    /// Connections open at once; at the cap, a new one closes the one that has waited longest
    /// without a request (closed at once itself when every one has a request in flight).
    pub max_connections: NonZeroUsize,
}

impl Default for HttpConfig {
    fn default() -> Self {
        http(&mut Validator::default(), &Http::default())
            .expect("the default http section is valid")
    }
}

/// `http`, as written.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct Http {
    #[serde(default = "default_listen")]
    pub(super) listen: String,
    /// A request's headers must arrive within this time after its first byte, else the
    /// connection is closed. Range 0.1 to 3600.
    #[serde(default = "default_header_timeout_secs")]
    pub(super) header_timeout_secs: f64,
    /// A connection without a request in flight is closed after this time. Range 0.1 to 86400.
    #[serde(default = "default_idle_timeout_secs")]
    pub(super) idle_timeout_secs: f64,
    /// Connections open at once; at the cap, a new one closes the one that has waited longest
    /// without a request. Range 1 to 65536.
    #[serde(default = "default_max_connections")]
    pub(super) max_connections: u32,
    /// Host names the server answers besides IP addresses and `localhost` (the names
    /// Prometheus or a browser reach it by, when not an address). At most 64.
    #[serde(default)]
    pub(super) allowed_hosts: Vec<String>,
}

fn default_listen() -> String {
    "127.0.0.1:9464".into()
}

fn default_header_timeout_secs() -> f64 {
    10.0
}

fn default_idle_timeout_secs() -> f64 {
    60.0
}

fn default_max_connections() -> u32 {
    256
}

impl Default for Http {
    fn default() -> Self {
        Http {
            listen: default_listen(),
            header_timeout_secs: default_header_timeout_secs(),
            idle_timeout_secs: default_idle_timeout_secs(),
            max_connections: default_max_connections(),
            allowed_hosts: Vec::new(),
        }
    }
}

/// The `http` section's settings; `None` when a value is refused (the problem is in `v`).
pub(super) fn http(v: &mut Validator, h: &Http) -> Option<HttpConfig> {
    let listen = v.parse(
        "http.listen",
        h.listen.parse::<SocketAddr>().map_err(|e| {
            format!(
                "must be an address:port such as 127.0.0.1:9464 ({e}), got `{}`",
                h.listen
            )
        }),
    );
    let mut timeout = |key: &str, x: f64, max: f64| {
        let ok = (0.1..=max).contains(&x);
        v.check(ok, key, format!("must be between 0.1 and {max}, got {x}"));
        ok.then(|| Duration::from_secs_f64(x))
    };
    let header_timeout = timeout("http.header_timeout_secs", h.header_timeout_secs, 3600.0);
    let idle_timeout = timeout("http.idle_timeout_secs", h.idle_timeout_secs, 86400.0);
    let max_connections = usize::try_from(h.max_connections)
        .ok()
        .filter(|n| *n <= 65536)
        .and_then(NonZeroUsize::new);
    v.check(
        max_connections.is_some(),
        "http.max_connections",
        format!("must be between 1 and 65536, got {}", h.max_connections),
    );
    v.check(
        h.allowed_hosts.len() <= 64,
        "http.allowed_hosts",
        format!("at most 64 names, got {}", h.allowed_hosts.len()),
    );
    for (i, name) in h.allowed_hosts.iter().enumerate() {
        let ok = !name.is_empty()
            && name.len() <= 253
            && name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || ".-_".contains(c));
        v.check(
            ok,
            &format!("http.allowed_hosts[{i}]"),
            format!(
                "must be a host name (letters, digits, `.`, `-`, `_`; no port), got `{}`",
                name.escape_debug()
            ),
        );
    }
    Some(HttpConfig {
        listen: listen?,
        allowed_hosts: h
            .allowed_hosts
            .iter()
            .map(|n| n.trim_end_matches('.').to_ascii_lowercase())
            .collect(),
        header_timeout: header_timeout?,
        idle_timeout: idle_timeout?,
        max_connections: max_connections?,
    })
}
