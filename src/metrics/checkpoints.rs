//! The watcher's and the evaluator's counts of checkpoints: failures by reason, pending, ignored
//! and skipped; and the interval between checkpoints.

use super::registry::Metrics;
use crate::record::FailureReason;

impl Metrics {
    /// Counts one failure.
    pub fn failure(&self, reason: FailureReason) {
        self.checkpoint_failures
            .get_or_create(&self.reason_labels(reason))
            .inc();
    }

    pub fn set_pending(&self, n: usize) {
        self.checkpoints_pending
            .get_or_create(&self.label())
            .set(n as i64);
    }

    /// Complete checkpoints waiting for evaluation, as last set.
    pub fn pending(&self) -> i64 {
        self.checkpoints_pending.get_or_create(&self.label()).get()
    }

    /// The interval between the run's checkpoints (`daemon/pace.rs`).
    pub fn set_checkpoint_interval(&self, seconds: f64) {
        self.checkpoint_interval
            .get_or_create(&self.label())
            .set(seconds);
    }

    /// The bytes only the pins hold (`store::pin::Pins::held_bytes`).
    pub fn set_pinned_bytes(&self, bytes: u64) {
        self.pinned_bytes
            .get_or_create(&self.label())
            .set(i64::try_from(bytes).unwrap_or(i64::MAX));
    }

    /// The bytes only the pins hold, as last set.
    pub fn pinned_bytes(&self) -> u64 {
        self.pinned_bytes.get_or_create(&self.label()).get().max(0) as u64
    }

    pub fn set_ignored(&self, n: usize) {
        self.checkpoints_ignored
            .get_or_create(&self.label())
            .set(n as i64);
    }

    pub fn skipped(&self, n: usize) {
        self.checkpoints_skipped
            .get_or_create(&self.label())
            .inc_by(n as u64);
    }
}
