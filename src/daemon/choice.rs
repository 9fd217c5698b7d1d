//! Which executor evaluates: the one place an executor is chosen (`evaluation.executor`; the
//! metrics take the kind to export its series, `Metrics::of_run`). It starts a run's
//! executor ([`start`]) or a sweep's ([`Shared::start`]), gives the config the evaluations read
//! ([`lane_config`]), and says how many evaluations run at once and what else the executor
//! could do when evaluation falls behind ([`capacity`], for the run's pace). The local executor is
//! `local.rs`; the jobs executors are the jobs layer (`jobs/`) on a scheduler (`slurm/`).

use super::executor::{Executor, ExecutorError, Lane, Outcome};
use super::jobs::{Jobs, Pool};
use super::local::{self, Local};
use super::pace::Capacity;
use super::slurm::Slurm;
use super::watcher::WorkItem;
use crate::config::{Config, ExecutorKind};
use crate::metrics::Metrics;
use crossbeam_channel::{Receiver, Sender};
use std::path::Path;
use std::sync::Arc;
use std::thread::JoinHandle;

/// The config a run's evaluations read, its state folder locked at `state`: the local
/// evaluator writes its caches and crash marker through the daemon's held handle; a job is
/// another process, given the configured path.
pub(super) fn lane_config(config: &Config, state: &Path) -> Config {
    match config.evaluation.executor {
        ExecutorKind::Local => config.writing_state_through(state),
        ExecutorKind::Slurm => config.clone(),
    }
}

/// Starts the executor of a single run, whose state folder is locked at `state`: it takes
/// items from `work` and sends their outcomes to `outcomes` (`Executor::start`).
pub(super) fn start(
    config: &Config,
    state: &Path,
    metrics: Arc<Metrics>,
    evaluated_before: usize,
    work: Receiver<WorkItem>,
    outcomes: Sender<Outcome>,
) -> Result<JoinHandle<()>, ExecutorError> {
    let config = lane_config(config, state);
    match config.evaluation.executor {
        ExecutorKind::Local => Local {
            config,
            evaluated_before,
        }
        .start(work, outcomes),
        ExecutorKind::Slurm => Jobs {
            scheduler: Slurm(config.evaluation.slurm.clone()),
            config,
            metrics,
            evaluated_before,
        }
        .start(work, outcomes),
    }
}

/// For the run's pace: how many evaluations run at once (one on the local evaluator, up to
/// `evaluation.max_in_flight` jobs), and what the executor could do when evaluation falls
/// behind (one of the pace warning's remedies).
pub(super) fn capacity(config: &Config) -> Capacity {
    match config.evaluation.executor {
        ExecutorKind::Local => Capacity {
            parallel: 1,
            remedy: "evaluate on Slurm (evaluation.executor: slurm)".into(),
        },
        ExecutorKind::Slurm => Capacity {
            parallel: config.evaluation.max_in_flight.max(1),
            remedy: format!(
                "raise evaluation.max_in_flight (now {})",
                config.evaluation.max_in_flight
            ),
        },
    }
}

/// A sweep's one executor, which every run's lane joins.
pub(super) enum Shared {
    /// The evaluator thread: runs added later come to it over this channel.
    Local(Sender<Lane>),
    /// A jobs runner per run on Slurm, sharing `evaluation.max_in_flight` (docs/design.md §18).
    Slurm(Pool),
}

impl Shared {
    /// Starts the executor on the runs at start (each lane with its run's metrics), with the
    /// thread the shutdown joins (the evaluator, or one joining the runs' job runners).
    pub(super) fn start(
        config: &Config,
        lanes: Vec<(Lane, Arc<Metrics>)>,
    ) -> Result<(Shared, JoinHandle<()>), ExecutorError> {
        Ok(match config.evaluation.executor {
            ExecutorKind::Local => {
                let (add, added) = crossbeam_channel::unbounded::<Lane>();
                let lanes = lanes.into_iter().map(|(lane, _)| lane).collect();
                (Shared::Local(add), local::start_shared(lanes, added)?)
            }
            ExecutorKind::Slurm => {
                let shared = Shared::Slurm(Pool::new(config.evaluation.max_in_flight));
                let runners = lanes
                    .into_iter()
                    .map(|(lane, metrics)| shared.add(lane, metrics))
                    .collect::<Result<Vec<_>, _>>()?;
                let joined = std::thread::Builder::new()
                    .name("diffmon-slurm".into())
                    .spawn(move || {
                        for r in runners.into_iter().flatten() {
                            let _ = r.join();
                        }
                    })
                    .map_err(ExecutorError::Spawn)?;
                (shared, joined)
            }
        })
    }

    /// Adds a run's lane; with jobs, returns its runner's thread.
    pub(super) fn add(
        &self,
        lane: Lane,
        metrics: Arc<Metrics>,
    ) -> Result<Option<JoinHandle<()>>, ExecutorError> {
        match self {
            Shared::Local(add) => {
                add.send(lane).map_err(|_| ExecutorError::Stopped)?;
                Ok(None)
            }
            Shared::Slurm(pool) => {
                let slurm = Slurm(lane.config.evaluation.slurm.clone());
                Ok(Some(pool.start_lane(slurm, lane, metrics)?))
            }
        }
    }
}
