//! What an alert delivery came to, as the metrics count it: the [`Receiver`] (the kind of
//! destination) and the [`DeliveryOutcome`], the labels of
//! `diffmon_webhook_deliveries_total{receiver,outcome}`, and the [`OutcomeHook`] that reports
//! them.

use std::sync::Arc;

/// Called once per delivery outcome; the metrics module counts them in
/// `diffmon_webhook_deliveries_total{receiver,outcome}`. Must be cheap and must not block.
pub type OutcomeHook = Arc<dyn Fn(Receiver, DeliveryOutcome) + Send + Sync>;

label_enum! {
    /// The kind of destination: the `receiver` label of `diffmon_webhook_deliveries_total`.
    pub enum Receiver {
        /// A webhook (`alerts.webhooks`, any format).
        Webhook => "webhook",
        /// Alertmanager's API (`alerts.alertmanager`).
        Alertmanager => "alertmanager",
    }
}

label_enum! {
    /// What one delivery attempt came to: the `outcome` label of
    /// `diffmon_webhook_deliveries_total`.
    pub enum DeliveryOutcome {
        /// The receiver accepted the delivery (2xx).
        Delivered => "delivered",
        /// An attempt failed (timeout, connection error, 408, 429, 5xx) and will be retried.
        Retried => "retried",
        /// The receiver answered with a non-retryable status (4xx other than 408/429, 3xx):
        /// given up, removed from the outbox.
        Rejected => "rejected",
        /// An outbox entry found at start whose MAC does not verify under the daemon's key
        /// (planted in the state folder, or written by an earlier version): not delivered, set
        /// aside.
        Unauthenticated => "unauthenticated",
    }
}
