//! The watcher's and the evaluator's counts of checkpoints: failures by reason, pending, ignored
//! and skipped.

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
