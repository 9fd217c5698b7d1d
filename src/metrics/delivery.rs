//! Alert deliveries by receiver and outcome (`diffmon_webhook_deliveries_total`).

use super::registry::Metrics;
use crate::alerts::{DeliveryOutcome, Receiver};

impl Metrics {
    /// Counts one delivery outcome of a receiver.
    pub fn delivery(&self, receiver: Receiver, outcome: DeliveryOutcome) {
        self.webhook_deliveries
            .get_or_create(&self.outcome_labels(receiver, outcome))
            .inc();
    }
}
