//! `diffmon watch` on a sweep (`runs` or `runs_glob` in the config; docs/design.md §19): per
//! run, the pipeline of one daemon (its state lock, recorder, run state, outputs with its own
//! alerter, stop file and webhooks, and watcher); shared, the executor ([`Shared`]: one
//! evaluator thread fed round-robin, or on Slurm one jobs runner per run sharing the in-flight
//! cap), one HTTP server (every run's metrics under its `run` label) and one tokio
//! runtime. A run's outcomes go to its own recorder only. With `runs_glob`, a
//! thread looks for new run folders every `checkpoints.poll_secs` and adds each as a run.

use super::choice::{Shared, lane_config};
use super::executor::{Lane, Outcome};
use super::outputs::{Console, RunOutputs};
use super::pipeline::{self, OUTCOMES_BOUND, Published};
use super::recorder::Recorder;
use super::shutdown;
use crate::config::Config;
use crate::daemon::http::{RunList, RunView};
use crate::daemon::watcher::{SharedNotifications, Watcher, WorkItem, work_channel};
use crate::store::lock::StateLock;
use anyhow::{Context, Result};
use crossbeam_channel::{Receiver, Sender};
use std::collections::{HashMap, HashSet};
use std::thread::JoinHandle;
use std::time::Duration;

/// Runs the daemon on every run of `config.runs()` (and, with `runs_glob`, on every run that
/// appears) until a signal.
pub fn run(config: Config) -> Result<()> {
    shutdown::exit_on_panic();
    let listen = config.http.listen;
    let (listener, runtime) = pipeline::bind(&config)?;

    let mut pipelines = Vec::new();
    let mut lanes = Vec::new();
    for config in config.runs() {
        let (pipeline, lane) = Pipeline::open(config, runtime.handle(), true)?;
        lanes.push((lane, pipeline.view.metrics.clone()));
        pipelines.push(pipeline);
    }
    let (shared, executor) = Shared::start(&config, lanes)?;

    let (stop, stopped) = shutdown::stop_channel();
    let views = RunList::default();
    let mut started = Started {
        notifications: shared_notifications(&config),
        ..Started::default()
    };
    for pipeline in pipelines {
        started.start(pipeline, &views, &stopped)?;
    }
    let names: Vec<String> = views.snapshot().into_iter().map(|v| v.name).collect();
    // With `runs_glob`, the finder adds runs until the stop; it hands what it started to the
    // threads the shutdown waits on.
    let finder = match &config.runs_glob {
        Some(glob) => {
            tracing::info!(glob = %glob.pattern.display(), "new run folders join the sweep as they appear");
            let finder = Finder {
                notifications: started.notifications.clone(),
                config: config.clone(),
                runtime: runtime.handle().clone(),
                known: names.iter().cloned().collect(),
                refused: HashMap::new(),
                left_out: Vec::new(),
                left_out_warned: None,
                shared,
                views: views.clone(),
                stopped: stopped.clone(),
            };
            Some(
                std::thread::Builder::new()
                    .name("diffmon-runs".into())
                    .spawn(move || finder.run())?,
            )
        }
        None => {
            drop(shared);
            None
        }
    };
    drop(stopped);
    let Started {
        locks,
        watchers,
        recorders,
        runners: _,
        notifications: _,
    } = started;
    let (more_watchers, found_watchers) = crossbeam_channel::bounded::<Vec<JoinHandle<()>>>(1);
    // The shutdown waits on one recorder thread and one watcher thread: these join every run's.
    let recorder = std::thread::Builder::new()
        .name("diffmon-record".into())
        .spawn(move || {
            let mut recorders = recorders;
            let mut locks = locks;
            let mut runners = Vec::new();
            if let Some(found) = finder.and_then(|f| f.join().ok()) {
                let _ = more_watchers.send(found.watchers);
                recorders.extend(found.recorders);
                locks.extend(found.locks);
                runners = found.runners;
            }
            drop(more_watchers);
            let outputs: Vec<RunOutputs> = recorders
                .into_iter()
                .filter_map(|r| r.join().ok())
                .collect();
            for r in runners {
                let _ = r.join();
            }
            (outputs, locks)
        })?;
    let watcher = std::thread::Builder::new()
        .name("diffmon-watch".into())
        .spawn(move || {
            for w in watchers.into_iter().chain(found_watchers.iter().flatten()) {
                let _ = w.join();
            }
        })?;

    let app = crate::daemon::http::sweep_router(views);
    let server = pipeline::serve(&runtime, listener, app, &config);
    tracing::info!(
        runs = %names.join(", "),
        metrics = %format!("http://{listen}/metrics"),
        "watching a sweep for checkpoints"
    );
    tracing::info!("{}", config.cost_summary());

    let drain = config.shutdown_drain;
    let (stopped, (outputs, locks)) =
        shutdown::until_stopped(&runtime, stop, watcher, recorder, drain, None)?;
    let _ = executor.join();
    for outputs in outputs {
        outputs.close(&runtime);
    }
    server.abort();
    runtime.shutdown_timeout(Duration::from_secs(1));
    drop(locks);
    tracing::info!("stopped");
    if stopped != shutdown::Stopped::Signal {
        anyhow::bail!("the evaluator stopped unexpectedly");
    }
    Ok(())
}

/// One run's pipeline, opened (its state folder locked, its history replayed) but not started.
struct Pipeline {
    config: Config,
    lock: StateLock,
    recorder: Recorder,
    published: Published,
    view: RunView,
    work: Sender<WorkItem>,
    outcomes: Receiver<Outcome>,
}

impl Pipeline {
    /// Opens `config`'s run, and its lane for the shared evaluator. `arm`: see [`pipeline::open`].
    fn open(
        config: Config,
        runtime: &tokio::runtime::Handle,
        arm: bool,
    ) -> Result<(Pipeline, Lane)> {
        let run = config.run_name();
        let opened = StateLock::acquire(&config.state_dir(), &config.run.dir)
            .map_err(anyhow::Error::from)
            .and_then(|lock| {
                let opened =
                    pipeline::open(&config, &lock, runtime, arm, Console::of_sweep_run(&run))?;
                Ok((lock, opened))
            })
            .with_context(|| format!("run `{run}` ({})", config.run.dir.display()))?;
        let (lock, opened) = opened;
        let (work_tx, work_rx) = work_channel();
        let (outcome_tx, outcome_rx) = crossbeam_channel::bounded::<Outcome>(OUTCOMES_BOUND);
        let lane = Lane {
            config: lane_config(&config, lock.state().path()),
            evaluated_before: opened.evaluated_before,
            work: work_rx,
            outcomes: outcome_tx,
        };
        let pipeline = Pipeline {
            config,
            lock,
            recorder: opened.recorder,
            published: opened.published,
            view: opened.view,
            work: work_tx,
            outcomes: outcome_rx,
        };
        Ok((pipeline, lane))
    }
}

/// The runs' threads and locks, as they are started.
#[derive(Default)]
struct Started {
    locks: Vec<StateLock>,
    watchers: Vec<JoinHandle<()>>,
    recorders: Vec<JoinHandle<RunOutputs>>,
    /// The job runners of runs added while the daemon runs (those of the runs at start are the
    /// executor's).
    runners: Vec<JoinHandle<()>>,
    /// The sweep's one inotify instance, which every run's watcher joins.
    notifications: Option<SharedNotifications>,
}

/// With `checkpoints.inotify`, one inotify instance for all the runs' folders (one watch each);
/// if it cannot be made, each run tries one of its own (and polls when that fails too).
fn shared_notifications(config: &Config) -> Option<SharedNotifications> {
    if !config.checkpoints.inotify {
        return None;
    }
    SharedNotifications::new()
        .map_err(|e| {
            tracing::warn!(
                "cannot start the sweep's filesystem notifications ({e}); each run tries its own"
            )
        })
        .ok()
}

impl Started {
    /// Starts a run's watcher and recorder, and lists it for the HTTP server.
    fn start(
        &mut self,
        pipeline: Pipeline,
        views: &RunList,
        stopped: &Receiver<()>,
    ) -> std::io::Result<()> {
        let Pipeline {
            config,
            lock,
            recorder,
            mut published,
            view,
            work,
            outcomes,
        } = pipeline;
        let done = recorder
            .entries()
            .iter()
            .filter_map(|e| e.done().cloned())
            .collect();
        let watcher = Watcher::new(
            &config.run.dir,
            &config.checkpoints,
            done,
            view.metrics.clone(),
        )
        .pacing(published.pace.clone())
        .with_excluded(config.named_files())
        .with_notifications(self.notifications.clone())
        .with_crash_marker(lock.state().path())
        .with_pins(lock.state().path(), config.early_stop.keep_best)
        .recognizing_kept(lock.state().path())
        .following(lock.state().clone());
        let stopped = stopped.clone();
        self.watchers.push(
            std::thread::Builder::new()
                .name("diffmon-watch".into())
                .spawn(move || watcher.run(work, stopped))?,
        );
        self.recorders.push(
            std::thread::Builder::new()
                .name("diffmon-record".into())
                .spawn(move || {
                    recorder.run(outcomes, |outcome, at| published.recorded(outcome, at));
                    published.outputs
                })?,
        );
        self.locks.push(lock);
        views.push(view);
        Ok(())
    }
}

/// How often, at most, the run folders left out at `max_runs` are logged again as they change.
const LEFT_OUT_WARNING_EVERY: Duration = Duration::from_secs(60);

/// `runs_glob`'s thread: every `checkpoints.poll_secs` until the stop, adds the run folders
/// that have appeared (docs/design.md §19).
struct Finder {
    config: Config,
    runtime: tokio::runtime::Handle,
    /// The runs of the sweep, by name.
    known: HashSet<String>,
    /// Runs that could not be opened (their state folder locked by another daemon, say), with
    /// the error last logged: tried again at each scan, logged again when the error changes.
    refused: HashMap<String, String>,
    /// The run folders the glob matches that are not runs because the sweep is at `max_runs`,
    /// as last logged.
    left_out: Vec<String>,
    /// When `left_out` was last logged.
    left_out_warned: Option<std::time::Instant>,
    shared: Shared,
    views: RunList,
    stopped: Receiver<()>,
    /// The sweep's one inotify instance.
    notifications: Option<SharedNotifications>,
}

impl Finder {
    fn run(mut self) -> Started {
        let mut started = Started {
            notifications: self.notifications.clone(),
            ..Started::default()
        };
        let mut problems_logged = None;
        let poll = self.config.checkpoints.poll;
        self.note_left_out();
        while let Err(crossbeam_channel::RecvTimeoutError::Timeout) =
            self.stopped.recv_timeout(poll)
        {
            let runs = match self.config.discover_runs() {
                Ok(runs) => runs,
                Err(problems) => {
                    let text = problems
                        .iter()
                        .map(|p| format!("{}: {}", p.key, p.message))
                        .collect::<Vec<_>>()
                        .join("; ");
                    if problems_logged.as_ref() != Some(&text) {
                        tracing::error!("cannot look for new runs: {text}");
                        problems_logged = Some(text);
                    }
                    continue;
                }
            };
            for config in runs {
                let name = config.run_name();
                // At `max_runs`, no run is added (the glob's others are noted below).
                if self.known.contains(&name) || self.known.len() >= self.config.max_runs {
                    continue;
                }
                match self.add(config, &mut started) {
                    Ok(()) => {
                        self.refused.remove(&name);
                        self.known.insert(name);
                    }
                    Err(e) => {
                        let text = format!("{e:#}");
                        if self.refused.get(&name) != Some(&text) {
                            tracing::error!("{text}; tried again at each scan");
                            self.refused.insert(name, text);
                        }
                    }
                }
            }
            self.note_left_out();
        }
        started
    }

    /// At `max_runs`: exports how many of the glob's run folders are left out, and warns,
    /// naming the first few, when they change (at most once a minute, but at once the first
    /// time).
    fn note_left_out(&mut self) {
        let Some(glob) = &self.config.runs_glob else {
            return;
        };
        let max = self.config.max_runs;
        let left_out: Vec<String> = if self.known.len() >= max {
            glob.matches()
                .into_iter()
                .map(|(name, _)| name)
                .filter(|name| !self.known.contains(name))
                .collect()
        } else {
            Vec::new()
        };
        // The metric after the warning: whoever sees the count finds the warning logged.
        let count = left_out.len();
        let due = self
            .left_out_warned
            .is_none_or(|t| t.elapsed() >= LEFT_OUT_WARNING_EVERY);
        if left_out.is_empty() || left_out == self.left_out || !due {
            if left_out.is_empty() {
                self.left_out.clear();
            }
            self.views.sweep_metrics().set_runs_ignored(count);
            return;
        }
        let named: Vec<&str> = left_out.iter().take(5).map(String::as_str).collect();
        let more = left_out.len().saturating_sub(named.len());
        let more = if more > 0 {
            format!(" and {more} more")
        } else {
            String::new()
        };
        tracing::warn!(
            glob = %glob.pattern.display(),
            "the sweep is at max_runs ({max} runs): {} run folder{} left out, not watched: {}{more}. Raise max_runs to watch them (each run costs threads and an inotify watch: docs/guide/sweeps-and-slurm.md, \"How many runs, and what each costs\")",
            left_out.len(),
            if left_out.len() == 1 { " is" } else { "s are" },
            named.join(", ")
        );
        self.left_out = left_out;
        self.left_out_warned = Some(std::time::Instant::now());
        self.views.sweep_metrics().set_runs_ignored(count);
    }

    /// Opens and starts a new run, and hands its lane to the evaluator.
    fn add(&mut self, config: Config, started: &mut Started) -> Result<()> {
        let name = config.run_name();
        let dir = config.run.dir.clone();
        let (pipeline, lane) = Pipeline::open(config, &self.runtime, false)?;
        let runner = self.shared.add(lane, pipeline.view.metrics.clone())?;
        started.runners.extend(runner);
        started.start(pipeline, &self.views, &self.stopped)?;
        tracing::info!(run = %name, dir = %dir.display(), "a new run joins the sweep");
        Ok(())
    }
}
