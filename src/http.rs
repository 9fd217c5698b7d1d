//! The daemon's HTTP endpoints (DESIGN.md §2.6): `GET /metrics` (Prometheus), `GET /healthz`,
//! `GET /v1/early-stop` (the detector's status as JSON), and `GET /`, the live page: the plots
//! of `diffmon report` drawn from the daemon's in-memory history, reloading itself.

use crate::daemon::EarlyStopStatus;
use crate::metrics::Metrics;
use crate::report::{self, Format, Snapshot};
use axum::Router;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use std::sync::{Arc, Mutex};

/// OpenMetrics text, the format `prometheus-client` writes.
const METRICS_CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

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
            get(move || {
                let metrics = metrics.clone();
                async move {
                    (
                        [(header::CONTENT_TYPE, METRICS_CONTENT_TYPE)],
                        metrics.encode(),
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
