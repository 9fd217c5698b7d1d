//! `diffmon watch` on a sweep (`runs` in the config; docs/design.md §19): per run, the pipeline
//! of one daemon (its state lock, recorder, run state, sinks with its own alerter, stop file
//! and webhooks, and watcher); shared, one evaluator thread fed round-robin
//! ([`executor::start_shared`]) or, on Slurm, one runner per run sharing the in-flight cap
//! ([`super::slurm::SlurmPool`]), one HTTP server (every run's metrics under its `run` label)
//! and one tokio runtime. A run's outcomes go to its own recorder only.

use super::executor::{self, Lane, Outcome};
use super::sinks::Sinks;
use super::{OUTCOMES_BOUND, shutdown};
use crate::config::{Config, ExecutorKind};
use crate::lock::StateLock;
use crate::watcher::{Watcher, work_channel};
use anyhow::{Context, Result};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

/// Runs the daemon on every run of `config.runs()` until a signal.
pub fn run(config: Config) -> Result<()> {
    let runs = config.runs();
    shutdown::exit_on_panic();
    let listen: SocketAddr = config.http.listen;
    let listener = std::net::TcpListener::bind(listen).with_context(|| {
        format!("cannot listen on {listen} (http.listen): is another process using the port?")
    })?;
    listener.set_nonblocking(true)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("diffmon-io")
        .enable_all()
        .build()?;

    let mut locks = Vec::new();
    let mut lanes = Vec::new();
    let mut views = Vec::new();
    let mut pipelines = Vec::new();
    let mut lane_metrics = Vec::new();
    for config in &runs {
        let run = config.run_name();
        let state_dir = config.state_dir();
        let opened = StateLock::acquire(&state_dir)
            .map_err(anyhow::Error::from)
            .and_then(|lock| {
                locks.push(lock);
                super::open(config, &runtime)
            })
            .with_context(|| format!("run `{run}` ({})", config.run.dir.display()))?;
        let super::Opened {
            recorder,
            published,
            view,
            evaluated_before,
        } = opened;
        let metrics = view.metrics.clone();
        lane_metrics.push(metrics.clone());
        views.push(view);
        let (work_tx, work_rx) = work_channel();
        let (outcome_tx, outcome_rx) = crossbeam_channel::bounded::<Outcome>(OUTCOMES_BOUND);
        lanes.push(Lane {
            config: config.clone(),
            evaluated_before,
            work: work_rx,
            outcomes: outcome_tx,
        });
        pipelines.push((config, recorder, published, metrics, work_tx, outcome_rx));
    }
    let executor = match config.evaluation.executor {
        ExecutorKind::Local => executor::start_shared(lanes)?,
        // A runner per run, sharing `evaluation.max_in_flight` (docs/design.md §18).
        ExecutorKind::Slurm => {
            let pool = super::slurm::SlurmPool::new(config.evaluation.max_in_flight);
            let runners = lanes
                .into_iter()
                .zip(lane_metrics)
                .map(|(lane, metrics)| pool.start_lane(lane, metrics))
                .collect::<Result<Vec<_>, _>>()?;
            std::thread::Builder::new()
                .name("diffmon-slurm".into())
                .spawn(move || {
                    for r in runners {
                        let _ = r.join();
                    }
                })?
        }
    };

    let (stop, stopped) = shutdown::stop_channel();
    let mut watchers = Vec::new();
    let mut recorders = Vec::new();
    for (config, recorder, mut published, metrics, work_tx, outcome_rx) in pipelines {
        let done = recorder.entries().iter().map(|e| e.key().clone()).collect();
        let watcher = Watcher::new(&config.run.dir, &config.checkpoints, done, metrics)
            .with_excluded(config.named_files());
        let stopped = stopped.clone();
        watchers.push(
            std::thread::Builder::new()
                .name("diffmon-watch".into())
                .spawn(move || watcher.run(work_tx, stopped))?,
        );
        recorders.push(
            std::thread::Builder::new()
                .name("diffmon-record".into())
                .spawn(move || {
                    recorder.run(outcome_rx, |outcome, at| published.recorded(outcome, at));
                    published.sinks
                })?,
        );
    }
    drop(stopped);
    // The shutdown waits on one watcher and one recorder: these join every run's.
    let watcher = std::thread::Builder::new()
        .name("diffmon-watch".into())
        .spawn(move || {
            for w in watchers {
                let _ = w.join();
            }
        })?;
    let recorder = std::thread::Builder::new()
        .name("diffmon-record".into())
        .spawn(move || {
            recorders
                .into_iter()
                .filter_map(|r| r.join().ok())
                .collect::<Vec<Sinks>>()
        })?;

    let names: Vec<String> = views.iter().map(|v| v.name.clone()).collect();
    let app = crate::http::sweep_router(Arc::new(views));
    let limits = crate::http::Limits::of(&config.http);
    let server = runtime.spawn(async move {
        let listener =
            tokio::net::TcpListener::from_std(listener).expect("a non-blocking std listener");
        crate::http::serve(listener, app, limits).await;
    });
    tracing::info!(
        runs = %names.join(", "),
        metrics = %format!("http://{listen}/metrics"),
        "watching a sweep for checkpoints"
    );
    tracing::info!("{}", config.cost_summary());

    let drain = config.shutdown_drain;
    let (signalled, sinks) = shutdown::until_stopped(&runtime, stop, watcher, recorder, drain)?;
    let _ = executor.join();
    for sinks in sinks {
        sinks.close(&runtime);
    }
    server.abort();
    runtime.shutdown_timeout(Duration::from_secs(1));
    drop(locks);
    tracing::info!("stopped");
    if !signalled {
        anyhow::bail!("the evaluator stopped unexpectedly");
    }
    Ok(())
}
