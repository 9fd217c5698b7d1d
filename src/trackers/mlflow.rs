//! `trackers.mlflow`: a run's evaluations and early-stop events logged to an MLflow tracking
//! server over its REST API (docs/design.md §21), into the training job's run or into a run
//! diffmon makes in a named experiment.
//!
//! Every item of the run's [`Timeline`] is sent, in order, by one task on the daemon's tokio
//! runtime: an evaluation as one metric per scalar (`diffmon/<field>`, the checkpoint's step,
//! the checkpoint's modification time in milliseconds), an early stop or resolution as the
//! metric `diffmon/early_stop` (1, 0) at its step and the tags `diffmon.early_stop*`. Items go
//! in `runs/log-batch` requests (at most [`MAX_METRICS`] metrics and [`MAX_TAGS`] tags each).
//!
//! Nothing is lost and nothing is sent twice. The journal is the outbox: the items are made
//! from it at every start, and `<state_dir>/trackers/mlflow.json` counts how many of them the
//! server has accepted (with the run they went to), written after every accepted batch; a start
//! sends the rest. Between an accepted batch and that write a kill resends one batch, with the
//! same keys, steps, timestamps and values, which the server's SQL store keeps once. Timeouts,
//! connection errors, 408, 429 and 5xx are retried with the alerts' backoff (0.5 s, ×2, up to
//! 60 s, full jitter); other refusals (a wrong run id, a token refused) are a WARN naming the key
//! and are tried again every 60 s. Evaluations never wait for the server: the items wait in
//! memory (as many as the history holds), counted while a request is out, and a WARN says when
//! [`BEHIND`] of them wait (again at each tenfold), an INFO when the tracker has caught up. A
//! request may take [`REQUEST_TIMEOUT`]: nothing waits on it, and a large batch to a loaded
//! server can take longer than an alert's 10 s.

use super::timeline::{EARLY_STOP_TAG, Item, Timeline};
use crate::alerts::{DeliveryPolicy, Event as StopEvent};
use crate::config::{EarlyStopSettings, MlflowConfig, MlflowRun};
use crate::engine::detector::DetectorState;
use crate::record::Evaluation;
use crate::store::history::{CheckpointKey, Entry};
use crate::store::safe_fs::{self, untrusted_text};
use reqwest::{StatusCode, Url};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::time::Duration;
use tokio::sync::mpsc;

/// MLflow's limits on one `log-batch` request.
pub const MAX_METRICS: usize = 1000;
pub const MAX_TAGS: usize = 100;
/// MLflow's longest tag value.
const MAX_TAG_VALUE: usize = 5000;
/// Items waiting before the tracker says it falls behind (and again at each tenfold): ten
/// evaluations, where a server that keeps up has a batch out and a few waiting at most.
const BEHIND: usize = 10;
/// How long one request may take.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);
/// How long the daemon's stop waits for the items still waiting.
const SHUTDOWN: Duration = Duration::from_secs(5);
/// The longest cursor file read.
const MAX_CURSOR_BYTES: u64 = 64 << 10;

/// What the server has accepted: `<state_dir>/trackers/mlflow.json`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
struct Cursor {
    /// The run the items went to (diffmon's own, in experiment mode, is kept here).
    run_id: Option<String>,
    /// The experiment the run was made in, in experiment mode.
    #[serde(default)]
    experiment: Option<String>,
    /// How many items of the run's timeline the server accepted, in order.
    delivered: u64,
}

fn cursor_path(state_dir: &Path) -> PathBuf {
    state_dir.join("trackers").join("mlflow.json")
}

/// The cursor in the state folder; a missing one is zero, an unreadable one a WARN and zero
/// (everything is sent again, which the server keeps once).
fn read_cursor(path: &Path) -> Cursor {
    match safe_fs::read_bounded(path, MAX_CURSOR_BYTES) {
        Ok(bytes) => serde_json::from_slice(&bytes).unwrap_or_else(|e| {
            tracing::warn!(file = %safe_fs::untrusted(path), "trackers.mlflow: the cursor is not readable ({e}); sending the whole history again");
            Cursor::default()
        }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Cursor::default(),
        Err(e) => {
            tracing::warn!(file = %safe_fs::untrusted(path), "trackers.mlflow: cannot read the cursor ({e}); sending the whole history again");
            Cursor::default()
        }
    }
}

fn write_cursor(path: &Path, cursor: &Cursor) -> std::io::Result<()> {
    safe_fs::create_private_dir(safe_fs::parent(path))?;
    let bytes = serde_json::to_vec(cursor).expect("a cursor serializes");
    safe_fs::atomic_write(path, &bytes)
}

/// The tracker of one run: the timeline, and the channel to its delivery task.
pub struct Mlflow {
    timeline: Timeline,
    tx: Option<mpsc::UnboundedSender<Vec<Item>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Mlflow {
    /// The tracker of run `run` (state folder `state_dir`), its task started on `runtime`; the
    /// history's items (`entries`, replayed with `early_stop`) are sent once the replayed
    /// events are placed among them ([`Mlflow::replayed`]).
    pub fn open(
        config: &MlflowConfig,
        run: &str,
        state_dir: &Path,
        entries: &[Entry],
        early_stop: EarlyStopSettings,
        runtime: &tokio::runtime::Handle,
    ) -> Mlflow {
        let (tx, rx) = mpsc::unbounded_channel();
        let worker = Worker::new(config, run, state_dir);
        Mlflow {
            timeline: Timeline::of_history(entries, early_stop),
            tx: Some(tx),
            task: runtime.spawn(worker.run(rx)),
        }
    }

    fn send(&self, items: Vec<Item>) {
        if let Some(tx) = &self.tx {
            // The task ends only once the channel is closed.
            let _ = tx.send(items);
        }
    }
}

impl super::tracker::Tracker for Mlflow {
    /// The replay's events, placed; then the history is sent.
    fn replayed(&mut self, events: &[StopEvent]) {
        let items = self.timeline.place(events);
        self.send(items);
    }

    fn evaluation(&mut self, record: &Evaluation, key: &CheckpointKey, state: &DetectorState) {
        let item = self.timeline.live(record, key, state);
        self.send(vec![item]);
    }

    fn event(&mut self, event: &StopEvent) {
        self.send(vec![super::timeline::stop(event)]);
    }

    /// The daemon stops: what waits gets [`SHUTDOWN`]; the rest is sent after the next start.
    fn close(self: Box<Self>, runtime: &tokio::runtime::Runtime) {
        let mut this = *self;
        this.tx = None;
        let task = this.task;
        runtime.block_on(async move {
            let abort = task.abort_handle();
            if tokio::time::timeout(SHUTDOWN, task).await.is_err() {
                abort.abort();
                tracing::warn!("trackers.mlflow: stopped with items not sent; they are sent after the next start");
            }
        });
    }
}

/// Why a request did not go through.
#[derive(Debug)]
enum Failure {
    /// Worth trying again soon: no answer, 408, 429, 5xx.
    Retry(String),
    /// Refused: tried again at the slowest pace, said with the key it is about.
    Refused(String),
}

/// The delivery task's state.
struct Worker {
    client: reqwest::Client,
    api: Url,
    shown: String,
    token: Option<String>,
    target: MlflowRun,
    run_name: String,
    cursor_path: PathBuf,
    cursor: Cursor,
    /// Items received from the timeline so far (their index in it), and those not accepted yet.
    received: u64,
    pending: VecDeque<Item>,
    policy: DeliveryPolicy,
    failures: u32,
    failing: Option<String>,
    behind: usize,
}

impl Worker {
    fn new(config: &MlflowConfig, run: &str, state_dir: &Path) -> Worker {
        let policy = DeliveryPolicy::default();
        let client = reqwest::Client::builder()
            .redirect(reqwest::redirect::Policy::none())
            .connect_timeout(policy.request_timeout)
            .timeout(REQUEST_TIMEOUT)
            .user_agent(concat!("diffmon/", env!("CARGO_PKG_VERSION")))
            .build()
            .expect("an HTTP client without TLS options builds");
        let mut api = config.uri.clone();
        let path = format!("{}/api/2.0/mlflow/", api.path().trim_end_matches('/'));
        api.set_path(&path);
        let cursor_path = cursor_path(state_dir);
        let mut cursor = read_cursor(&cursor_path);
        let same_target = match &config.run {
            MlflowRun::Id(id) => cursor.run_id.as_deref() == Some(id.as_str()),
            MlflowRun::Experiment(e) => {
                cursor.experiment.as_deref() == Some(e.as_str()) && cursor.run_id.is_some()
            }
        };
        if !same_target {
            cursor = Cursor {
                run_id: match &config.run {
                    MlflowRun::Id(id) => Some(id.clone()),
                    MlflowRun::Experiment(_) => None,
                },
                experiment: match &config.run {
                    MlflowRun::Id(_) => None,
                    MlflowRun::Experiment(e) => Some(e.clone()),
                },
                delivered: 0,
            };
        }
        Worker {
            client,
            shown: crate::alerts::redact_url(&config.uri),
            api,
            token: config.token.as_ref().map(|t| t.value.clone()),
            target: config.run.clone(),
            run_name: run.to_string(),
            cursor_path,
            cursor,
            received: 0,
            pending: VecDeque::new(),
            policy,
            failures: 0,
            failing: None,
            behind: BEHIND,
        }
    }

    /// Takes the items sent, skipping those the server accepted before.
    fn take(&mut self, items: Vec<Item>) {
        for item in items {
            if self.received >= self.cursor.delivered {
                self.pending.push_back(item);
            }
            self.received += 1;
        }
        self.behind = falling_behind(&self.shown, self.pending.len(), self.behind);
    }

    /// Delivers what waits until the channel closes and nothing waits.
    async fn run(mut self, mut rx: mpsc::UnboundedReceiver<Vec<Item>>) {
        loop {
            if self.pending.is_empty() {
                match rx.recv().await {
                    Some(items) => self.take(items),
                    None => return,
                }
            }
            while let Ok(items) = rx.try_recv() {
                self.take(items);
            }
            // While a request is out, what arrives is counted (a server that hangs shows as
            // falling behind at once) and taken after it.
            let (waiting, mut behind) = (self.pending.len(), self.behind);
            let to_skip = self.cursor.delivered.saturating_sub(self.received) as usize;
            let shown = self.shown.clone();
            let mut arrived: Vec<Item> = Vec::new();
            let mut open = true;
            let outcome = {
                let delivery = self.deliver();
                tokio::pin!(delivery);
                loop {
                    tokio::select! {
                        outcome = &mut delivery => break outcome,
                        items = rx.recv(), if open => match items {
                            Some(items) => {
                                arrived.extend(items);
                                let new = arrived.len().saturating_sub(to_skip);
                                behind = falling_behind(&shown, waiting + new, behind);
                            }
                            None => open = false,
                        },
                    }
                }
            };
            self.behind = behind;
            self.take(arrived);
            match outcome {
                Ok(()) => {
                    self.failures = 0;
                    if self.failing.take().is_some() {
                        tracing::info!(server = %self.shown, "trackers.mlflow: delivering again");
                    }
                    if self.pending.is_empty() && self.behind > BEHIND {
                        tracing::info!(server = %self.shown, "trackers.mlflow: caught up; nothing waits");
                        self.behind = BEHIND;
                    }
                }
                Err(failure) => {
                    self.failures += 1;
                    let (message, delay) = match failure {
                        Failure::Retry(m) => (m, self.policy.backoff(self.failures)),
                        Failure::Refused(m) => (m, self.policy.max_delay),
                    };
                    if self.failing.as_deref() != Some(message.as_str()) {
                        tracing::warn!(server = %self.shown, waiting = self.pending.len(),
                            "{message}; the items wait and are sent again");
                        self.failing = Some(message);
                    }
                    tokio::time::sleep(delay).await;
                }
            }
        }
    }

    /// Sends the next batch of what waits (making diffmon's run first, in experiment mode).
    async fn deliver(&mut self) -> Result<(), Failure> {
        let run_id = match self.cursor.run_id.clone() {
            Some(id) => id,
            None => self.make_run().await?,
        };
        let (n, body) = batch(&run_id, &self.pending);
        if n == 0 {
            return Ok(());
        }
        if body["metrics"].as_array().is_some_and(|m| !m.is_empty())
            || body["tags"].as_array().is_some_and(|t| !t.is_empty())
        {
            self.post("runs/log-batch", &body, "trackers.mlflow.run_id")
                .await?;
        }
        self.pending.drain(..n);
        self.cursor.delivered += n as u64;
        if let Err(e) = write_cursor(&self.cursor_path, &self.cursor) {
            tracing::warn!(file = %safe_fs::untrusted(&self.cursor_path), "trackers.mlflow: cannot write the cursor ({e}); after a restart these items are sent again");
        }
        Ok(())
    }

    /// Experiment mode: the experiment (made if absent) and a run of diffmon's own in it,
    /// kept in the cursor.
    async fn make_run(&mut self) -> Result<String, Failure> {
        let MlflowRun::Experiment(name) = self.target.clone() else {
            return Err(Failure::Refused("trackers.mlflow: no run id".into()));
        };
        let key = "trackers.mlflow.experiment";
        let found = self
            .request(
                reqwest::Method::GET,
                "experiments/get-by-name",
                &[("experiment_name", name.as_str())],
                None,
                key,
            )
            .await;
        let experiment = match found {
            Ok(v) => v["experiment"]["experiment_id"]
                .as_str()
                .map(str::to_string),
            Err(Failure::Refused(m)) if m.contains("RESOURCE_DOES_NOT_EXIST") => None,
            Err(e) => return Err(e),
        };
        let experiment = match experiment {
            Some(id) => id,
            None => {
                let made = self
                    .post("experiments/create", &json!({ "name": name }), key)
                    .await?;
                made["experiment_id"]
                    .as_str()
                    .ok_or_else(|| Failure::Retry("experiments/create: no experiment_id".into()))?
                    .to_string()
            }
        };
        let start = (super::timeline::now() * 1000.0) as i64;
        let made = self
            .post(
                "runs/create",
                &json!({
                    "experiment_id": experiment,
                    "run_name": self.run_name,
                    "start_time": start,
                    "tags": [{"key": "diffmon.run", "value": self.run_name}],
                }),
                key,
            )
            .await?;
        let id = made["run"]["info"]["run_id"]
            .as_str()
            .ok_or_else(|| Failure::Retry("runs/create: no run_id".into()))?
            .to_string();
        tracing::info!(server = %self.shown, run_id = %id, experiment = %untrusted_text(&name), "trackers.mlflow: made diffmon's run");
        self.cursor.run_id = Some(id.clone());
        if let Err(e) = write_cursor(&self.cursor_path, &self.cursor) {
            tracing::warn!(file = %safe_fs::untrusted(&self.cursor_path), "trackers.mlflow: cannot keep the run id ({e}); a restart makes another run");
        }
        Ok(id)
    }

    async fn post(&self, endpoint: &str, body: &Value, key: &str) -> Result<Value, Failure> {
        self.request(reqwest::Method::POST, endpoint, &[], Some(body), key)
            .await
    }

    /// One request to `{uri}/api/2.0/mlflow/<endpoint>`; its JSON answer, or why not (`key`:
    /// the config key a refusal is about). The token goes in the header and nowhere else.
    async fn request(
        &self,
        method: reqwest::Method,
        endpoint: &str,
        query: &[(&str, &str)],
        body: Option<&Value>,
        key: &str,
    ) -> Result<Value, Failure> {
        let mut url = self.api.join(endpoint).expect("a relative endpoint joins");
        if !query.is_empty() {
            url.query_pairs_mut().extend_pairs(query);
        }
        let mut request = self.client.request(method, url);
        if let Some(body) = body {
            request = request
                .header(reqwest::header::CONTENT_TYPE, "application/json")
                .body(body.to_string());
        }
        if let Some(token) = &self.token {
            request = request.bearer_auth(token);
        }
        let answer = request.send().await.map_err(|e| {
            Failure::Retry(format!(
                "trackers.mlflow: {endpoint}: no answer from the server ({})",
                e.without_url()
            ))
        })?;
        let status = answer.status();
        let text = answer.text().await.unwrap_or_default();
        if status.is_success() {
            return Ok(serde_json::from_str(&text).unwrap_or(Value::Null));
        }
        let said = serde_json::from_str::<Value>(&text)
            .ok()
            .map(|v| {
                format!(
                    "{}: {}",
                    v["error_code"].as_str().unwrap_or("?"),
                    v["message"].as_str().unwrap_or("")
                )
            })
            .unwrap_or_else(|| text.chars().take(200).collect());
        let message = format!(
            "{key}: {endpoint} answered {status} ({})",
            untrusted_text(&said)
        );
        let retry = status == StatusCode::REQUEST_TIMEOUT
            || status == StatusCode::TOO_MANY_REQUESTS
            || status.is_server_error();
        Err(if retry {
            Failure::Retry(message)
        } else {
            Failure::Refused(message)
        })
    }
}

/// The WARN when `waiting` items reach `behind`; the next level to say it at.
fn falling_behind(server: &str, waiting: usize, behind: usize) -> usize {
    if waiting < behind {
        return behind;
    }
    tracing::warn!(server = %server, waiting,
        "trackers.mlflow: the tracker falls behind; the evaluations go on and the items wait");
    behind.saturating_mul(10)
}

/// The `log-batch` body of the first items of `pending` that fit in one request, and how many
/// items that is (at least one: an item holds at most a few dozen metrics and tags).
fn batch(run_id: &str, pending: &VecDeque<Item>) -> (usize, Value) {
    let (mut metrics, mut tags) = (Vec::new(), Vec::new());
    let mut n = 0;
    for item in pending {
        let (m, t) = mlflow_rows(item);
        if n > 0 && (metrics.len() + m.len() > MAX_METRICS || tags.len() + t.len() > MAX_TAGS) {
            break;
        }
        metrics.extend(m);
        tags.extend(t);
        n += 1;
    }
    (
        n,
        json!({ "run_id": run_id, "metrics": metrics, "tags": tags }),
    )
}

/// An item's metrics and tags. Non-finite values are left out (JSON has no NaN).
fn mlflow_rows(item: &Item) -> (Vec<Value>, Vec<Value>) {
    let ms = (item.wall_time() * 1000.0).round() as i64;
    let metric = |key: &str, value: f64| json!({ "key": key, "value": value, "timestamp": ms, "step": item.step() });
    match item {
        Item::Point { values, .. } => (
            values
                .iter()
                .filter(|(_, v)| v.is_finite())
                .map(|(k, v)| metric(k, *v))
                .collect(),
            Vec::new(),
        ),
        Item::Stop { event, text, .. } => {
            let tag = |key: &str, value: String| {
                let value: String = value.chars().take(MAX_TAG_VALUE).collect();
                json!({ "key": key, "value": value })
            };
            let kept = event
                .best_checkpoint_kept
                .clone()
                .unwrap_or_else(|| event.best_checkpoint.clone());
            (
                vec![metric(EARLY_STOP_TAG, Item::marker(event))],
                vec![
                    tag("diffmon.early_stop", event.event.to_string()),
                    tag("diffmon.early_stop.step", event.current_step.to_string()),
                    tag("diffmon.early_stop.trigger", event.trigger.as_str().into()),
                    tag("diffmon.early_stop.best_step", event.best_step.to_string()),
                    tag(
                        "diffmon.early_stop.best_checkpoint",
                        event.best_checkpoint.clone(),
                    ),
                    tag("diffmon.early_stop.kept_copy", kept),
                    tag("diffmon.early_stop.event_id", event.id.clone()),
                    tag("diffmon.early_stop.summary", text.clone()),
                ],
            )
        }
        Item::Start { .. } => (Vec::new(), Vec::new()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trackers::timeline::{stop, tests::event};

    fn point(step: i64, n: usize) -> Item {
        Item::Point {
            step,
            wall_time: 1.0005,
            values: (0..n)
                .map(|i| (format!("diffmon/m{i}"), i as f64))
                .collect(),
        }
    }

    /// Batches stop before MLflow's limits, never split an item, and carry the step, the
    /// wall time in milliseconds and the value of each metric.
    #[test]
    fn batches_fit_mlflows_limits_and_keep_items_whole() {
        let pending: VecDeque<Item> = (0..100).map(|s| point(s, 30)).collect();
        let (n, body) = batch("r", &pending);
        assert_eq!(n, MAX_METRICS / 30);
        assert_eq!(body["metrics"].as_array().unwrap().len(), n * 30);
        assert_eq!(
            body["metrics"][31],
            json!({"key": "diffmon/m1", "value": 1.0, "timestamp": 1001, "step": 1})
        );
        let stops: VecDeque<Item> = (0..20)
            .map(|s| stop(&event(s, "2026-01-01T00:00:02.000Z")))
            .collect();
        let (n, body) = batch("r", &stops);
        assert_eq!(n, MAX_TAGS / 8, "{body}");
        assert_eq!(
            body["tags"][0],
            json!({"key": "diffmon.early_stop", "value": "early_stop"})
        );
        assert_eq!(body["metrics"][0]["key"], EARLY_STOP_TAG);
        assert_eq!(body["metrics"][0]["timestamp"], 1_767_225_602_000i64);
        // NaN has no JSON: left out.
        let nan = Item::Point {
            step: 1,
            wall_time: 0.0,
            values: vec![("a".into(), f64::NAN), ("b".into(), 2.0)],
        };
        let (_, body) = batch("r", &VecDeque::from([nan]));
        assert_eq!(body["metrics"].as_array().unwrap().len(), 1);
    }

    /// The cursor survives a round trip; a corrupt one counts as nothing delivered.
    #[test]
    fn the_cursor_is_kept_in_the_state_folder() {
        let tmp = tempfile::tempdir().unwrap();
        let path = cursor_path(tmp.path());
        assert_eq!(read_cursor(&path), Cursor::default());
        let c = Cursor {
            run_id: Some("abc".into()),
            experiment: None,
            delivered: 7,
        };
        write_cursor(&path, &c).unwrap();
        assert_eq!(read_cursor(&path), c);
        std::fs::write(&path, b"{not json").unwrap();
        assert_eq!(read_cursor(&path), Cursor::default());
    }
}
