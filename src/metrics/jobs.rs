//! A jobs executor's jobs (`daemon/jobs/`): submitted, running, failed by reason, and their
//! queue and run times. Exported under the executor's names, `diffmon_slurm_*` on Slurm (the
//! one scheduler so far), only with that executor.

use super::labels::ReasonLabels;
use super::registry::Metrics;

impl Metrics {
    /// Counts one job submitted.
    pub fn job_submitted(&self) {
        self.slurm_jobs_submitted.get_or_create(&self.label()).inc();
    }

    pub fn set_jobs_running(&self, n: usize) {
        self.slurm_jobs_running
            .get_or_create(&self.label())
            .set(n as i64);
    }

    /// Counts one job that ended without a result; `reason` is one of
    /// [`SLURM_JOB_FAILURES`](super::names::SLURM_JOB_FAILURES).
    pub fn job_failed(&self, reason: &str) {
        self.slurm_jobs_failed
            .get_or_create(&ReasonLabels {
                run: self.run.clone(),
                reason: reason.into(),
            })
            .inc();
    }

    pub fn job_queue_wait(&self, seconds: f64) {
        self.slurm_queue_wait
            .get_or_create(&self.label())
            .observe(seconds);
    }

    pub fn job_run(&self, seconds: f64) {
        self.slurm_run.get_or_create(&self.label()).observe(seconds);
    }
}
