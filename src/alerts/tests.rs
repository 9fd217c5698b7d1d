//! Delivery tests against real servers on 127.0.0.1: a Python receiver (`test_receiver.py`,
//! verifying signatures with the official `standardwebhooks` library) and Debian's
//! `prometheus-alertmanager`.

use super::*;
use crate::config::{AlertmanagerConfig, AlertsConfig, SecretEnv, WebhookConfig, WebhookFormat};
use base64::Engine;
use serde_json::Value;
use std::io::Write;
use std::process::{Child, Command, Stdio};
use std::time::Instant;

const RECEIVER_PY: &str = include_str!("test_receiver.py");
const ALERTMANAGER: &str = "/usr/bin/prometheus-alertmanager";

fn python() -> PathBuf {
    let venv = Path::new(env!("CARGO_MANIFEST_DIR")).join(".venv/bin/python");
    if venv.exists() {
        venv
    } else {
        PathBuf::from("python3")
    }
}

fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().port()
}

/// Kills and reaps a subprocess when dropped, also when the test panics.
struct ChildGuard(Child);

impl Drop for ChildGuard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

async fn wait_until(what: &str, timeout: Duration, mut ok: impl FnMut() -> bool) {
    let start = Instant::now();
    while !ok() {
        assert!(start.elapsed() < timeout, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The Python receiver: every request is a JSON line in `log`.
struct Receiver {
    _child: ChildGuard,
    port: u16,
    log: PathBuf,
}

impl Receiver {
    /// `port` 0 picks a free one. `script`: statuses for the first requests (`"500,500,429"`),
    /// then `always`.
    async fn start(
        dir: &Path,
        port: u16,
        secret: Option<&str>,
        script: &str,
        always: u16,
        retry_after: &str,
    ) -> Receiver {
        let script_path = dir.join("test_receiver.py");
        std::fs::write(&script_path, RECEIVER_PY).unwrap();
        let log = dir.join(format!("receiver-{}.log", store::next_seq()));
        let port_file = dir.join(format!("receiver-{}.port", store::next_seq()));
        let mut cmd = Command::new(python());
        cmd.arg(&script_path)
            .arg("--port")
            .arg(port.to_string())
            .arg("--log")
            .arg(&log)
            .arg("--port-file")
            .arg(&port_file)
            .arg("--script")
            .arg(script)
            .arg("--always")
            .arg(always.to_string())
            .arg("--retry-after")
            .arg(retry_after)
            .stdin(Stdio::null())
            .stdout(Stdio::null());
        if let Some(s) = secret {
            // Only the child's environment: the test process never sets variables.
            cmd.env("RECEIVER_SECRET", s);
        }
        let child = ChildGuard(cmd.spawn().expect("start the Python receiver"));
        wait_until("the receiver's port file", Duration::from_secs(15), || {
            port_file.exists()
        })
        .await;
        let port = std::fs::read_to_string(&port_file)
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        Receiver {
            _child: child,
            port,
            log,
        }
    }

    fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.port)
    }

    fn lines(&self) -> Vec<Value> {
        std::fs::read_to_string(&self.log)
            .unwrap_or_default()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    }

    fn accepted(&self) -> Vec<Value> {
        self.lines()
            .into_iter()
            .filter(|l| l["status"] == 200)
            .collect()
    }
}

#[derive(Clone, Default)]
struct Outcomes(Arc<Mutex<Vec<DeliveryOutcome>>>);

impl Outcomes {
    fn hook(&self) -> OutcomeHook {
        let v = self.0.clone();
        Arc::new(move |_receiver, o| v.lock().unwrap().push(o))
    }
    fn list(&self) -> Vec<DeliveryOutcome> {
        self.0.lock().unwrap().clone()
    }
    fn count(&self, o: DeliveryOutcome) -> usize {
        self.list().iter().filter(|x| **x == o).count()
    }
}

/// Captures this thread's log output (the tests run on current-thread runtimes, so the delivery
/// tasks log on the test's thread).
#[derive(Clone, Default)]
struct Capture(Arc<Mutex<Vec<u8>>>);

impl Write for Capture {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl Capture {
    fn install(&self) -> tracing::subscriber::DefaultGuard {
        let me = self.clone();
        let sub = tracing_subscriber::fmt()
            .with_ansi(false)
            .with_max_level(tracing::Level::DEBUG)
            .with_writer(move || me.clone())
            .finish();
        tracing::subscriber::set_default(sub)
    }
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }
}

fn fast_policy() -> DeliveryPolicy {
    DeliveryPolicy {
        base_delay: Duration::from_millis(10),
        max_delay: Duration::from_millis(100),
        max_retry_after: Duration::from_secs(5),
        request_timeout: Duration::from_secs(3),
        escalate_after: 3,
        alertmanager_refresh: Some(Duration::from_millis(250)),
    }
}

/// A webhook as the config gives it; `secret`: the variable `secret_env` names and its value.
fn webhook(url: String, format: WebhookFormat, secret: Option<(&str, &str)>) -> WebhookConfig {
    WebhookConfig {
        url: url.parse().unwrap(),
        format,
        secret: secret.map(|(var, value)| SecretEnv {
            var: var.to_string(),
            secret: Some(crate::sign::Secret::parse(value).unwrap()),
        }),
    }
}

fn config(webhooks: Vec<WebhookConfig>, alertmanager: Option<String>) -> AlertsConfig {
    AlertsConfig {
        webhooks,
        alertmanager: alertmanager.map(|url| AlertmanagerConfig {
            url: url.parse().unwrap(),
        }),
        ..AlertsConfig::default()
    }
}

fn early(run: &str) -> Event {
    Event::new(
        EventKind::EarlyStop,
        run,
        "icr",
        1000,
        "ckpt-001000.pt",
        0.1234,
        3000,
        0.1302,
    )
}

fn resolved(run: &str) -> Event {
    Event::new(
        EventKind::Resolved,
        run,
        "icr",
        4000,
        "ckpt-004000.pt",
        0.1111,
        4000,
        0.1111,
    )
}

fn outbox_files(state: &Path) -> Vec<String> {
    std::fs::read_dir(state.join(OUTBOX_DIR))
        .map(|rd| {
            rd.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.ends_with(".json"))
                .collect()
        })
        .unwrap_or_default()
}

struct Dirs {
    _tmp: tempfile::TempDir,
    run: PathBuf,
    state: PathBuf,
    work: PathBuf,
}

fn dirs() -> Dirs {
    let tmp = tempfile::tempdir().unwrap();
    let run = tmp.path().join("run");
    let state = tmp.path().join("state");
    let work = tmp.path().join("work");
    for d in [&run, &state, &work] {
        std::fs::create_dir_all(d).unwrap();
    }
    Dirs {
        _tmp: tmp,
        run,
        state,
        work,
    }
}

/// A recognizable secret in the Standard-Webhooks `whsec_<base64>` form, and its decoded text.
fn planted_secret() -> (String, &'static str) {
    let raw = "diffmon-planted-secret-6a1f93c2";
    let whsec = format!(
        "whsec_{}",
        base64::engine::general_purpose::STANDARD.encode(raw)
    );
    (whsec, raw)
}

#[tokio::test]
async fn signed_deliveries_are_retried_on_5xx_and_429_and_accepted_once() {
    let logs = Capture::default();
    let _guard = logs.install();
    let d = dirs();
    let (secret, raw) = planted_secret();
    let rx = Receiver::start(&d.work, 0, Some(&secret), "500,500,429", 200, "1").await;
    let cfg = config(
        vec![
            webhook(
                rx.url("/json"),
                WebhookFormat::Json,
                Some(("DIFFMON_T1_SECRET", &secret)),
            ),
            webhook(
                rx.url("/am"),
                WebhookFormat::Alertmanager,
                Some(("DIFFMON_T1_SECRET", &secret)),
            ),
        ],
        None,
    );
    let outcomes = Outcomes::default();
    let alerter =
        Alerter::start_with(&cfg, &d.run, &d.state, "", outcomes.hook(), fast_policy()).unwrap();
    let (e, r) = (early("run-1"), resolved("run-1"));
    alerter.send(&e).unwrap();
    alerter.send(&r).unwrap();
    wait_until("4 accepted deliveries", Duration::from_secs(20), || {
        rx.accepted().len() >= 4
    })
    .await;
    wait_until("the ledger to catch up", Duration::from_secs(5), || {
        alerter.pending() == 0
    })
    .await;

    // Exactly one accepted delivery per (event, destination), all validly signed.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let accepted = rx.accepted();
    assert_eq!(accepted.len(), 4, "{accepted:#?}");
    for (id, path) in [
        (&e.id, "/json"),
        (&r.id, "/json"),
        (&e.id, "/am"),
        (&r.id, "/am"),
    ] {
        let hits: Vec<_> = accepted
            .iter()
            .filter(|l| l["id"] == id.as_str() && l["path"] == path)
            .collect();
        assert_eq!(hits.len(), 1, "{id} {path}: {accepted:#?}");
        assert_eq!(hits[0]["valid"], true, "signature rejected: {:?}", hits[0]);
    }
    for l in &accepted {
        if l["path"] == "/json" {
            let ev: Event = serde_json::from_value(l["body"].clone()).unwrap();
            assert_eq!(ev.id, l["id"].as_str().unwrap());
            assert!(ev == e || ev == r);
        } else {
            assert_eq!(l["body"]["version"], "4");
            let want = if l["id"] == e.id.as_str() {
                "firing"
            } else {
                "resolved"
            };
            assert_eq!(l["body"]["status"], want);
            assert_eq!(l["body"]["alerts"][0]["labels"]["run"], "run-1");
        }
    }
    // Order per destination: the early stop was accepted before its resolution.
    for path in ["/json", "/am"] {
        let ids: Vec<_> = accepted
            .iter()
            .filter(|l| l["path"] == path)
            .map(|l| l["id"].as_str().unwrap().to_string())
            .collect();
        assert_eq!(ids, vec![e.id.clone(), r.id.clone()], "{path}");
    }
    // The failing stage saw retries; every request, failed or not, was validly signed.
    let all = rx.lines();
    assert!(all.iter().all(|l| l["valid"] == true), "{all:#?}");
    assert_eq!(all.iter().filter(|l| l["status"] == 500).count(), 2);
    // Retry-After: 1 was honoured by the destination that got the 429.
    let t429 = all.iter().find(|l| l["status"] == 429).unwrap();
    let next = all
        .iter()
        .filter(|l| l["path"] == t429["path"] && l["n"].as_u64() > t429["n"].as_u64())
        .map(|l| l["t"].as_f64().unwrap())
        .fold(f64::INFINITY, f64::min);
    let waited = next - t429["t"].as_f64().unwrap();
    assert!(
        waited >= 0.9,
        "retried {waited:.3}s after a 429 with Retry-After: 1"
    );
    let seen = outcomes.list();
    assert_eq!(seen[0], DeliveryOutcome::Retried, "{seen:?}");
    assert_eq!(outcomes.count(DeliveryOutcome::Retried), 3, "{seen:?}");
    assert_eq!(outcomes.count(DeliveryOutcome::Delivered), 4, "{seen:?}");
    assert!(outbox_files(&d.state).is_empty());

    // Sending the same events again is a no-op, in this process and after a restart.
    alerter.send(&e).unwrap();
    alerter.send(&r).unwrap();
    assert_eq!(alerter.pending(), 0);
    alerter.shutdown(Duration::from_secs(2)).await;
    let again = Outcomes::default();
    let b = Alerter::start_with(&cfg, &d.run, &d.state, "", again.hook(), fast_policy()).unwrap();
    b.send(&e).unwrap();
    b.send(&r).unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        rx.lines().len(),
        all.len(),
        "re-sent events were delivered again"
    );
    assert!(again.list().is_empty());
    b.shutdown(Duration::from_secs(2)).await;

    // Logs said what happened, and never the secret.
    let text = logs.text();
    assert!(text.contains("will retry"), "{text}");
    assert!(text.contains("alert delivered"), "{text}");
    assert!(
        !text.contains(&secret) && !text.contains(raw),
        "secret leaked into logs"
    );
}

/// Every form of one key that the official `standardwebhooks` library accepts (the `whsec_`
/// prefix and the padding are optional there) signs requests that library verifies. The
/// receiver is given the same string as diffmon, as an operator configures both ends. Before,
/// diffmon used the unpadded and the bare forms as raw bytes: every signature failed while the
/// log said "delivered".
#[tokio::test]
async fn every_secret_form_the_official_library_accepts_verifies_there() {
    let d = dirs();
    // 23 bytes: its base64 ends in padding, so the unpadded forms differ from the padded ones.
    let b64 = base64::engine::general_purpose::STANDARD.encode(b"a-key-of-23-bytes-long!");
    let bare = b64.trim_end_matches('=').to_string();
    assert_ne!(bare, b64);
    let forms = [
        format!("whsec_{b64}"),
        format!("whsec_{bare}"),
        b64.clone(),
        bare.clone(),
    ];
    for (k, form) in forms.iter().enumerate() {
        let rx = Receiver::start(&d.work, 0, Some(form), "", 200, "").await;
        let var = "DIFFMON_T9_SECRET";
        let cfg = config(
            vec![webhook(
                rx.url("/json"),
                WebhookFormat::Json,
                Some((var, form)),
            )],
            None,
        );
        let state = d.work.join(format!("state-{k}"));
        std::fs::create_dir(&state).unwrap();
        let alerter = Alerter::start_with(
            &cfg,
            &d.run,
            &state,
            "",
            Outcomes::default().hook(),
            fast_policy(),
        )
        .unwrap();
        alerter.send(&early(&format!("run-9-{k}"))).unwrap();
        wait_until("a delivery", Duration::from_secs(20), || {
            !rx.lines().is_empty()
        })
        .await;
        let got = rx.lines();
        assert_eq!(got[0]["signed"], true, "{got:?}");
        assert_eq!(
            got[0]["valid"], true,
            "form {k}: the official library refused the signature: {got:?}"
        );
        alerter.shutdown(Duration::from_millis(200)).await;
    }
}

#[tokio::test]
async fn pending_delivery_survives_a_restart_while_the_receiver_is_down() {
    let logs = Capture::default();
    let _guard = logs.install();
    let d = dirs();
    let port = free_port();
    let cfg = config(
        vec![webhook(
            format!("http://127.0.0.1:{port}/hook"),
            WebhookFormat::Json,
            None,
        )],
        None,
    );

    // A: nobody listens; the event stays pending and is kept on disk.
    let a_out = Outcomes::default();
    let a = Alerter::start_with(&cfg, &d.run, &d.state, "", a_out.hook(), fast_policy()).unwrap();
    let e = early("run-2");
    // Sent from a plain thread, as the evaluator thread would.
    std::thread::scope(|s| s.spawn(|| a.send(&e)).join().unwrap()).unwrap();
    wait_until("a failed attempt", Duration::from_secs(10), || {
        a_out.count(DeliveryOutcome::Retried) >= 5
    })
    .await;
    // One ERROR after `escalate_after` (3) consecutive failures, not one per failure.
    let text = logs.text();
    assert_eq!(text.matches("keeps failing").count(), 1, "{text}");
    assert!(
        text.contains("ERROR") && text.contains("consecutive_failures=3"),
        "{text}"
    );
    a.shutdown(Duration::from_secs(1)).await;
    assert_eq!(a_out.count(DeliveryOutcome::Delivered), 0);
    let files = outbox_files(&d.state);
    assert_eq!(files.len(), 1, "{files:?}");
    assert!(files[0].starts_with(&e.id));
    // A crash left a half-written entry beside it: start-up must survive it.
    std::fs::write(
        d.state
            .join(OUTBOX_DIR)
            .join("deadbeef.webhook-000000000000.json"),
        "{\"version\":1,\"dest\":",
    )
    .unwrap();

    // The receiver comes up on the same port; B delivers the pending entry.
    let rx = Receiver::start(&d.work, port, None, "", 200, "").await;
    assert_eq!(rx.port, port);
    let b_out = Outcomes::default();
    let b = Alerter::start_with(&cfg, &d.run, &d.state, "", b_out.hook(), fast_policy()).unwrap();
    wait_until(
        "the delivery after restart",
        Duration::from_secs(10),
        || b_out.count(DeliveryOutcome::Delivered) == 1,
    )
    .await;
    b.send(&e).unwrap(); // the detector re-deriving the same event: no second delivery
    tokio::time::sleep(Duration::from_millis(300)).await;
    let accepted = rx.accepted();
    assert_eq!(accepted.len(), 1, "{accepted:#?}");
    assert_eq!(accepted[0]["body"]["id"], e.id.as_str());
    assert_eq!(rx.lines().len(), 1);
    assert_eq!(b_out.list(), vec![DeliveryOutcome::Delivered]);
    assert!(outbox_files(&d.state).is_empty());
    assert!(
        d.state
            .join(OUTBOX_DIR)
            .join("deadbeef.webhook-000000000000.json.corrupt")
            .exists()
    );
    b.shutdown(Duration::from_secs(1)).await;
}

#[tokio::test]
async fn client_errors_other_than_429_are_not_retried() {
    let logs = Capture::default();
    let _guard = logs.install();
    let d = dirs();
    let rx = Receiver::start(&d.work, 0, None, "", 400, "").await;
    let cfg = config(
        vec![webhook(rx.url("/slack"), WebhookFormat::Slack, None)],
        None,
    );
    let out = Outcomes::default();
    let a = Alerter::start_with(&cfg, &d.run, &d.state, "", out.hook(), fast_policy()).unwrap();
    a.send(&early("run-3")).unwrap();
    wait_until("the rejection", Duration::from_secs(10), || {
        out.count(DeliveryOutcome::Rejected) == 1
    })
    .await;
    // Backoffs are at most 100 ms here: a retry would have happened by now.
    tokio::time::sleep(Duration::from_millis(400)).await;
    let lines = rx.lines();
    assert_eq!(lines.len(), 1, "{lines:#?}");
    assert!(lines[0]["body"]["text"].as_str().unwrap().contains("run-3"));
    assert_eq!(out.list(), vec![DeliveryOutcome::Rejected]);
    assert_eq!(a.pending(), 0);
    assert!(outbox_files(&d.state).is_empty());
    let text = logs.text();
    assert!(text.contains("WARN"), "{text}");
    assert!(
        text.contains("400") && text.contains("receiver says no"),
        "{text}"
    );
    a.shutdown(Duration::from_secs(1)).await;
}

async fn get_json(client: &reqwest::Client, url: &str) -> Option<Value> {
    let resp = client.get(url).send().await.ok()?;
    if !resp.status().is_success() {
        return None;
    }
    serde_json::from_str(&resp.text().await.ok()?).ok()
}

/// The alerts Alertmanager reports for `run` (expired ones are not listed).
async fn am_alerts(client: &reqwest::Client, base: &str, run: &str) -> Vec<Value> {
    let all = get_json(client, &format!("{base}/api/v2/alerts"))
        .await
        .unwrap_or(Value::Null);
    all.as_array()
        .cloned()
        .unwrap_or_default()
        .into_iter()
        .filter(|a| a["labels"]["alertname"] == ALERT_NAME && a["labels"]["run"] == run)
        .collect()
}

async fn wait_for_repost(client: &reqwest::Client, base: &str, run: &str, before: &Value) {
    let start = Instant::now();
    loop {
        let now = am_alerts(client, base, run).await;
        if now.first().is_some_and(|a| a["updatedAt"] != *before) {
            return;
        }
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "firing alert never re-posted"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn real_alertmanager_fires_stays_active_and_resolves() {
    assert!(
        Path::new(ALERTMANAGER).exists(),
        "{ALERTMANAGER} is missing: install the Debian package prometheus-alertmanager"
    );
    let d = dirs();
    let am_cfg = d.work.join("alertmanager.yml");
    std::fs::write(
        &am_cfg,
        "route:\n  receiver: \"null\"\nreceivers:\n  - name: \"null\"\n",
    )
    .unwrap();
    let port = free_port();
    let am_log = std::fs::File::create(d.work.join("alertmanager.log")).unwrap();
    let _am = ChildGuard(
        Command::new(ALERTMANAGER)
            .arg(format!("--config.file={}", am_cfg.display()))
            .arg(format!(
                "--storage.path={}",
                d.work.join("am-data").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .arg("--cluster.listen-address=")
            .stdin(Stdio::null())
            .stdout(am_log.try_clone().unwrap())
            .stderr(am_log)
            .spawn()
            .expect("start prometheus-alertmanager"),
    );
    let base = format!("http://127.0.0.1:{port}");
    let client = reqwest::Client::new();
    let start = Instant::now();
    loop {
        let ready = client
            .get(format!("{base}/-/ready"))
            .send()
            .await
            .is_ok_and(|r| r.status().is_success());
        if ready {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "alertmanager not ready: {}",
            std::fs::read_to_string(d.work.join("alertmanager.log")).unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    let cfg = config(vec![], Some(format!("{base}/")));
    let out = Outcomes::default();
    let alerter =
        Alerter::start_with(&cfg, &d.run, &d.state, "", out.hook(), fast_policy()).unwrap();
    let run = "run-am";
    let e = early(run);
    alerter.send(&e).unwrap();
    let mut firing = None;
    let start = Instant::now();
    while firing.is_none() {
        firing = am_alerts(&client, &base, run)
            .await
            .into_iter()
            .find(|a| a["status"]["state"] == "active");
        assert!(
            start.elapsed() < Duration::from_secs(15),
            "alert never became active"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let firing = firing.unwrap();
    assert_eq!(firing["labels"]["severity"], "warning");
    assert_eq!(firing["labels"]["metric"], "icr");
    assert_eq!(firing["annotations"]["best_step"], "1000");
    assert_eq!(firing["annotations"]["best_checkpoint"], "ckpt-001000.pt");
    // Our fingerprint (used in the v4 webhook format) is Alertmanager's.
    assert_eq!(
        firing["fingerprint"],
        format::fingerprint(&format::labels(&e)).as_str()
    );
    // The firing alert is re-posted while active (refresh every 250 ms here)...
    wait_for_repost(&client, &base, run, &firing["updatedAt"]).await;
    // ...and, after a restart, by the next alerter, which takes the active alert from the stop
    // file without being sent anything.
    alerter.shutdown(Duration::from_secs(2)).await;
    let seen = am_alerts(&client, &base, run).await[0]["updatedAt"].clone();
    let alerter =
        Alerter::start_with(&cfg, &d.run, &d.state, "", out.hook(), fast_policy()).unwrap();
    wait_for_repost(&client, &base, run, &seen).await;

    alerter.send(&resolved(run)).unwrap();
    let start = Instant::now();
    loop {
        let now = crate::record::rfc3339_utc(std::time::SystemTime::now() + Duration::from_secs(1));
        let still_active = am_alerts(&client, &base, run).await.iter().any(|a| {
            a["status"]["state"] == "active" && a["endsAt"].as_str().is_none_or(|t| *t > *now)
        });
        if !still_active {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(15),
            "alert never resolved"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Re-posting stopped with the resolution: the alert does not come back.
    tokio::time::sleep(Duration::from_millis(800)).await;
    let after = am_alerts(&client, &base, run).await;
    assert!(
        after.iter().all(|a| a["endsAt"].as_str().unwrap_or("")
            <= crate::record::rfc3339_utc(std::time::SystemTime::now()).as_str()),
        "resolved alert came back: {after:#?}"
    );
    assert_eq!(out.count(DeliveryOutcome::Delivered), 2, "{:?}", out.list());
    assert_eq!(out.count(DeliveryOutcome::Rejected), 0);
    alerter.shutdown(Duration::from_secs(2)).await;
}

#[tokio::test]
async fn stop_file_is_atomic_and_secrets_stay_hidden() {
    let d = dirs();
    let (secret, raw) = planted_secret();
    let cfg = config(
        vec![webhook(
            format!("http://127.0.0.1:{}/x", free_port()),
            WebhookFormat::Json,
            Some(("DIFFMON_T5_SECRET", &secret)),
        )],
        None,
    );
    let a = Alerter::start_with(
        &cfg,
        &d.run,
        &d.state,
        "",
        Outcomes::default().hook(),
        fast_policy(),
    )
    .unwrap();

    let e = early("run-5");
    a.send(&e).unwrap();
    let stop = d.run.join("EARLY_STOP");
    assert_eq!(a.stop_file(), stop);
    let back: Event = serde_json::from_slice(&std::fs::read(&stop).unwrap()).unwrap();
    assert_eq!(back, e);
    let names: Vec<_> = std::fs::read_dir(&d.run)
        .unwrap()
        .map(|x| x.unwrap().file_name())
        .collect();
    assert_eq!(names, vec!["EARLY_STOP"], "temporary files left behind");
    a.send(&resolved("run-5")).unwrap();
    assert!(!stop.exists());
    a.send(&resolved("run-5")).unwrap(); // no stop file: still fine

    let debug = format!("{a:?} {cfg:?}");
    assert!(debug.contains("signed: true"), "{debug}");
    assert!(!debug.contains(&secret) && !debug.contains(raw), "{debug}");

    // Errors name the file or key, never the secret.
    let not_a_dir = d.work.join("plain-file");
    std::fs::write(&not_a_dir, "x").unwrap();
    let b = Alerter::start_with(
        &cfg,
        &not_a_dir,
        &d.state,
        "",
        Outcomes::default().hook(),
        fast_policy(),
    )
    .unwrap();
    let err = b.send(&early("run-5b")).unwrap_err().to_string();
    assert!(
        err.contains("EARLY_STOP") && err.contains("stop file"),
        "{err}"
    );
    assert!(!err.contains(&secret) && !err.contains(raw), "{err}");
    b.shutdown(Duration::from_millis(200)).await;
    a.shutdown(Duration::from_millis(200)).await;

    // A config loaded without its secrets (for a command that sends nothing) cannot start
    // deliveries: the error names the key and the variable.
    let mut unread = cfg.clone();
    unread.webhooks[0].secret.as_mut().unwrap().secret = None;
    let err = Alerter::start(&unread, &d.run, &d.state, "", Outcomes::default().hook())
        .unwrap_err()
        .to_string();
    assert!(
        err.starts_with(
            "alerts.webhooks[0].secret_env names the environment variable DIFFMON_T5_SECRET"
        ),
        "{err}"
    );
}

#[test]
fn alerter_can_be_shared_across_threads() {
    fn check<T: Send + Sync>() {}
    check::<Alerter>();
    check::<Event>();
}

#[test]
fn start_outside_a_runtime_is_an_error() {
    let d = dirs();
    let err = Alerter::start(
        &AlertsConfig::default(),
        &d.run,
        &d.state,
        "",
        Outcomes::default().hook(),
    )
    .unwrap_err();
    assert!(matches!(err, AlertError::NoRuntime), "{err}");
}

#[tokio::test]
async fn a_stop_file_that_cannot_be_written_is_retried_and_a_newer_event_supersedes_it() {
    let d = dirs();
    let cfg = config(vec![], None);
    let a = Alerter::start_with(
        &cfg,
        &d.run,
        &d.state,
        "",
        Outcomes::default().hook(),
        fast_policy(),
    )
    .unwrap();
    let stop = d.run.join("EARLY_STOP");
    // A folder at the stop file's path: renaming a file over it fails, also for root.
    std::fs::create_dir(&stop).unwrap();
    std::fs::write(stop.join("keep"), "x").unwrap();
    let e = early("run-r");
    let err = a.send(&e).unwrap_err().to_string();
    assert!(err.contains("EARLY_STOP"), "{err}");
    // Retried (fast policy) while the obstacle stays: still not written, still pending.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(stop.is_dir());
    assert!(a.stop.pending.lock().unwrap().is_some());
    std::fs::remove_dir_all(&stop).unwrap();
    wait_until("the stop file", Duration::from_secs(10), || stop.is_file()).await;
    let back: Event = serde_json::from_slice(&std::fs::read(&stop).unwrap()).unwrap();
    assert_eq!(back, e);
    assert!(a.stop.pending.lock().unwrap().is_none());

    // A resolution while an early stop is still pending replaces it: the stop file must not
    // appear once the obstacle is gone.
    std::fs::remove_file(&stop).unwrap();
    std::fs::create_dir(&stop).unwrap();
    std::fs::write(stop.join("keep"), "x").unwrap();
    assert!(a.send(&early("run-s")).is_err());
    assert!(a.send(&resolved("run-s")).is_err()); // a folder is not removed either
    std::fs::remove_dir_all(&stop).unwrap();
    wait_until(
        "the pending update to be done",
        Duration::from_secs(10),
        || a.stop.pending.lock().unwrap().is_none(),
    )
    .await;
    assert!(!stop.exists(), "a superseded early stop was written");
    a.shutdown(Duration::from_millis(200)).await;
}
