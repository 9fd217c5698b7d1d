//! A sweep's own metrics, without a `run` label.

use super::names::RUNS_IGNORED;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

/// The metrics of a sweep as a whole, beside its runs' [`Metrics`](super::Metrics); without a `run` label, since
/// they concern no one run. Clones share the values.
#[derive(Clone, Debug, Default)]
pub struct SweepMetrics {
    /// Run folders `runs_glob` matches that are not watched: the sweep is at `max_runs`.
    runs_ignored: Gauge,
}

impl SweepMetrics {
    pub fn set_runs_ignored(&self, n: usize) {
        self.runs_ignored.set(n as i64);
    }

    /// The OpenMetrics families, without the closing `# EOF`.
    pub(super) fn encode(&self) -> String {
        let mut registry = Registry::default();
        registry.register(
            RUNS_IGNORED,
            "Run folders runs_glob matches that are not watched because the sweep is at max_runs",
            self.runs_ignored.clone(),
        );
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &registry)
            .expect("writing to a String");
        out.strip_suffix("# EOF\n").unwrap_or(&out).to_string()
    }
}
