//! The daemon's HTTP endpoints (DESIGN.md §2.6): `GET /metrics` (Prometheus), `GET /healthz`,
//! and `GET /v1/early-stop` (the detector's status as JSON).

use crate::daemon::EarlyStopStatus;
use crate::metrics::Metrics;
use axum::Router;
use axum::http::header;
use axum::response::IntoResponse;
use axum::routing::get;
use std::sync::{Arc, Mutex};

/// OpenMetrics text, the format `prometheus-client` writes.
const METRICS_CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

pub fn router(metrics: Arc<Metrics>, status: Arc<Mutex<EarlyStopStatus>>) -> Router {
    Router::new()
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
