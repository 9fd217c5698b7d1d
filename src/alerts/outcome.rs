//! What an alert delivery came to, as the metrics count it: the [`Receiver`] (the kind of
//! destination) and the [`DeliveryOutcome`], the labels of
//! `diffmon_webhook_deliveries_total{receiver,outcome}`, and the [`OutcomeHook`] that reports
//! them.

use std::fmt;
use std::sync::Arc;

/// Called once per delivery outcome; the metrics module counts them in
/// `diffmon_webhook_deliveries_total{receiver,outcome}`. Must be cheap and must not block.
pub type OutcomeHook = Arc<dyn Fn(Receiver, DeliveryOutcome) + Send + Sync>;

/// The kind of destination: the `receiver` label of `diffmon_webhook_deliveries_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Receiver {
    /// A webhook (`alerts.webhooks`, any format).
    Webhook,
    /// Alertmanager's API (`alerts.alertmanager`).
    Alertmanager,
}

impl Receiver {
    /// Every receiver, for pre-creating the metric's series at 0.
    pub const ALL: [Receiver; 2] = [Receiver::Webhook, Receiver::Alertmanager];

    /// The label value.
    pub const fn as_str(self) -> &'static str {
        match self {
            Receiver::Webhook => "webhook",
            Receiver::Alertmanager => "alertmanager",
        }
    }
}

impl fmt::Display for Receiver {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What one delivery attempt came to: the `outcome` label of `diffmon_webhook_deliveries_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DeliveryOutcome {
    /// The receiver accepted the delivery (2xx).
    Delivered,
    /// An attempt failed (timeout, connection error, 408, 429, 5xx) and will be retried.
    Retried,
    /// The receiver answered with a non-retryable status (4xx other than 408/429, 3xx): given
    /// up, removed from the outbox.
    Rejected,
    /// An outbox entry found at start whose MAC does not verify under the daemon's key (planted
    /// in the state folder, or written by an earlier version): not delivered, set aside.
    Unauthenticated,
}

impl DeliveryOutcome {
    /// Every outcome, for pre-creating the metric's series at 0.
    pub const ALL: [DeliveryOutcome; 4] = [
        DeliveryOutcome::Delivered,
        DeliveryOutcome::Retried,
        DeliveryOutcome::Rejected,
        DeliveryOutcome::Unauthenticated,
    ];

    /// The label value.
    pub const fn as_str(self) -> &'static str {
        match self {
            DeliveryOutcome::Delivered => "delivered",
            DeliveryOutcome::Retried => "retried",
            DeliveryOutcome::Rejected => "rejected",
            DeliveryOutcome::Unauthenticated => "unauthenticated",
        }
    }
}

impl fmt::Display for DeliveryOutcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}
