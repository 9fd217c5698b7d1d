//! The monitoring kit: the Grafana dashboards against the metric names the code exports and
//! against a real Prometheus (Debian package) scraping a real `diffmon watch`, and the Prometheus
//! config and alert rules through `promtool` (the same package).

use crate::common::{http_get, root};
use crate::daemon::{Daemon, empty_run, free_port, journal, journal_entries};
use crate::early_stop::{
    Alertmanager, checkpoints_by_icr, detector_config, place, write_base_config,
};
use regex::Regex;
use serde_json::Value;
use std::collections::BTreeSet;
use std::fs;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// One PromQL expression of a dashboard: (file name, where in the file, expression).
type Expr = (String, String, String);

/// Every PromQL expression in every dashboard JSON of `dashboards/`: each `expr` (panel targets,
/// annotations, at any depth) and the query variables' queries, Grafana's
/// `label_values(SELECTOR, LABEL)` reduced to its SELECTOR.
fn dashboard_exprs() -> Vec<Expr> {
    fn walk(v: &Value, at: &str, file: &str, out: &mut Vec<Expr>) {
        match v {
            Value::Object(map) => {
                for (k, child) in map {
                    let here = format!("{at}.{k}");
                    match (k.as_str(), child) {
                        ("expr", Value::String(e)) => {
                            out.push((file.into(), here, e.clone()));
                        }
                        _ => walk(child, &here, file, out),
                    }
                }
            }
            Value::Array(items) => {
                for (i, child) in items.iter().enumerate() {
                    walk(child, &format!("{at}[{i}]"), file, out);
                }
            }
            _ => {}
        }
    }
    let label_values =
        Regex::new(r"^\s*label_values\((.*),\s*[A-Za-z_][A-Za-z0-9_]*\s*\)\s*$").unwrap();
    let mut out = Vec::new();
    let mut files = 0;
    for entry in fs::read_dir(root().join("dashboards")).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().and_then(|e| e.to_str()) != Some("json") {
            continue;
        }
        files += 1;
        let file = path.file_name().unwrap().to_string_lossy().into_owned();
        let dash: Value = serde_json::from_str(&fs::read_to_string(&path).unwrap())
            .unwrap_or_else(|e| panic!("{file}: {e}"));
        walk(&dash["panels"], "panels", &file, &mut out);
        walk(&dash["annotations"], "annotations", &file, &mut out);
        for (i, var) in dash["templating"]["list"]
            .as_array()
            .unwrap_or(&Vec::new())
            .iter()
            .enumerate()
        {
            if var["type"] != "query" {
                continue;
            }
            let query = var["query"]["query"]
                .as_str()
                .or(var["query"].as_str())
                .unwrap_or_else(|| panic!("{file}: variable {i} has no query"));
            let expr = match label_values.captures(query) {
                Some(c) => c[1].to_string(),
                None => query.to_string(),
            };
            out.push((file.clone(), format!("templating.list[{i}].query"), expr));
        }
    }
    assert!(files >= 1, "no dashboard JSON in dashboards/");
    out
}

/// The metric names a PromQL expression reads: identifiers outside strings, label matchers,
/// range brackets and grouping clauses that are neither functions nor keywords.
fn metric_names(expr: &str) -> Vec<String> {
    let strings = Regex::new(r#""(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|`[^`]*`"#).unwrap();
    let matchers = Regex::new(r"\{[^}]*\}").unwrap();
    let ranges = Regex::new(r"\[[^\]]*\]").unwrap();
    let grouping =
        Regex::new(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)").unwrap();
    let token = Regex::new(r"[$A-Za-z0-9_:.]+").unwrap();
    let keywords = [
        "and",
        "or",
        "unless",
        "offset",
        "bool",
        "by",
        "without",
        "on",
        "ignoring",
        "group_left",
        "group_right",
        "inf",
        "nan",
    ];
    let e = strings.replace_all(expr, " ");
    let e = matchers.replace_all(&e, " ");
    let e = ranges.replace_all(&e, " ");
    let e = grouping.replace_all(&e, " ");
    let mut names = Vec::new();
    for m in token.find_iter(&e) {
        let t = m.as_str();
        let first = t.chars().next().unwrap();
        if !(first.is_ascii_alphabetic() || first == '_' || first == ':') {
            continue; // a number, a duration or a Grafana variable
        }
        if keywords.contains(&t.to_ascii_lowercase().as_str()) {
            continue;
        }
        if e[m.end()..].trim_start().starts_with('(') {
            continue; // a function or an aggregation
        }
        names.push(t.to_string());
    }
    names
}

/// The series names the code can export: `exported_names()`, with the histogram as its three
/// series (`_bucket`, `_sum`, `_count`) instead of its family name.
fn known_series_names() -> BTreeSet<String> {
    use diffmon::metrics::{EVALUATION_DURATION, SLURM_QUEUE_WAIT, SLURM_RUN, exported_names};
    let mut names: BTreeSet<String> = exported_names().into_iter().collect();
    for histogram in [EVALUATION_DURATION, SLURM_QUEUE_WAIT, SLURM_RUN] {
        assert!(names.remove(histogram));
        for s in ["_bucket", "_sum", "_count"] {
            names.insert(format!("{histogram}{s}"));
        }
    }
    names
}

#[test]
fn promql_metric_names_are_extracted_and_nothing_else() {
    assert_eq!(
        metric_names(
            r#"histogram_quantile(0.9, sum by (le, stage) (rate(a_bucket{run="$run",x=~"b|c"}[$__rate_interval])))"#
        ),
        ["a_bucket"]
    );
    assert_eq!(
        metric_names(
            "sum without (reason) (b_total) / on (run) group_left c offset 5m > bool 1e-3 \
             and d unless count(e) or up"
        ),
        ["b_total", "c", "d", "e", "up"]
    );
    assert_eq!(metric_names("sum(rate(x[5m]))  * 2"), ["x"]);
}

/// Every metric a dashboard queries is one the code exports (the issue's acceptance), and the
/// dashboards cover the panels the issue asks for.
#[test]
fn dashboards_query_only_metrics_the_code_exports() {
    let known = known_series_names();
    let mut used = BTreeSet::new();
    let exprs = dashboard_exprs();
    for (file, at, expr) in &exprs {
        let names = metric_names(expr);
        assert!(!names.is_empty(), "{file} {at}: no metric in {expr:?}");
        for n in names {
            assert!(
                known.contains(&n),
                "{file} {at}: {n} is not a metric diffmon exports ({expr:?}); known: {known:?}"
            );
            used.insert(n);
        }
    }
    for needed in [
        "diffmon_icr",
        "diffmon_icr_smoothed",
        "diffmon_best_step",
        "diffmon_icr_invariant_trace",
        "diffmon_icr_residual_trace",
        "diffmon_pfd_generalization",
        "diffmon_pfd_memorization",
        "diffmon_memorization_ratio",
        "diffmon_tail_rmsqe",
        "diffmon_tail_loader",
        "diffmon_last_evaluated_step",
        "diffmon_evaluation_duration_seconds_bucket",
        "diffmon_checkpoints_pending",
        "diffmon_checkpoint_failures_total",
        "diffmon_webhook_deliveries_total",
        "diffmon_early_stop_triggered",
        "diffmon_build_info",
        "diffmon_slurm_jobs_submitted_total",
        "diffmon_slurm_jobs_running",
        "diffmon_slurm_jobs_failed_total",
        "diffmon_slurm_queue_wait_seconds_bucket",
        "diffmon_slurm_run_seconds_bucket",
        "diffmon_gpu_seconds_total",
        "diffmon_gpu_memory_peak_bytes",
    ] {
        assert!(used.contains(needed), "no dashboard shows {needed}");
    }

    // Classic dashboard model, `$datasource` (Prometheus) and `$run` from label_values,
    // several runs at once (a sweep) or all.
    for entry in fs::read_dir(root().join("dashboards")).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().and_then(|e| e.to_str()) != Some("json") {
            continue;
        }
        let dash: Value = serde_json::from_str(&fs::read_to_string(&path).unwrap()).unwrap();
        let vars = dash["templating"]["list"].as_array().unwrap();
        let var = |name: &str| {
            vars.iter()
                .find(|v| v["name"] == name)
                .unwrap_or_else(|| panic!("{}: no ${name}", path.display()))
        };
        assert_eq!(var("datasource")["type"], "datasource");
        assert_eq!(var("datasource")["query"], "prometheus");
        assert_eq!(var("run")["multi"], true);
        assert_eq!(var("run")["includeAll"], true);
        assert!(
            var("run")["definition"]
                .as_str()
                .unwrap()
                .starts_with("label_values(")
        );
        for p in dash["panels"].as_array().unwrap() {
            assert_eq!(p["datasource"]["uid"], "${datasource}", "{p}");
            for t in p["targets"].as_array().unwrap() {
                let e = t["expr"].as_str().unwrap();
                // `$run` is multi-select (a sweep): a regex match.
                assert!(e.contains("run=~\"$run\""), "{}: {e}", p["title"]);
                // Issue 34: every series is named by an explicit legend, which the overrides
                // and a sweep's runs rely on.
                let legend = t["legendFormat"].as_str().unwrap_or("");
                assert!(
                    !legend.is_empty() && legend != "__auto",
                    "{}: {t}",
                    p["title"]
                );
            }
            // Legends shown explicitly: tools that apply the schema's defaults hide them.
            if p["type"] == "timeseries" {
                assert_eq!(p["options"]["legend"]["showLegend"], true, "{}", p["title"]);
            }
            // Overrides match by query (or by a pattern), not by a display name that the
            // legends no longer produce (the test on a sweep below checks they match).
            for o in p["fieldConfig"]["overrides"]
                .as_array()
                .into_iter()
                .flatten()
            {
                let id = o["matcher"]["id"].as_str().unwrap_or("");
                assert!(
                    ["byFrameRefID", "byRegexp"].contains(&id),
                    "{}: {o}",
                    p["title"]
                );
            }
        }
    }
}

/// `promtool ARGS` in `config/prometheus/`.
fn promtool(args: &[&str]) -> Output {
    let out = Command::new("promtool")
        .args(args)
        .current_dir(root().join("config/prometheus"))
        .output()
        .expect("promtool (Debian package prometheus, installed by make setup)");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "promtool {args:?} failed:\n{text}");
    assert!(text.contains("SUCCESS"), "promtool {args:?}:\n{text}");
    out
}

#[test]
fn promtool_checks_the_prometheus_config() {
    let out = promtool(&["check", "config", "prometheus.yml"]);
    // The rule file is found and loaded through the config.
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("1 rule files found"),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
}

#[test]
fn promtool_checks_the_alert_rules() {
    promtool(&["check", "rules", "diffmon-rules.yml"]);
}

/// The rules' unit tests pass, and they test every alert both firing and not firing.
#[test]
fn promtool_unit_tests_of_the_alert_rules_pass_and_cover_every_alert() {
    promtool(&["test", "rules", "diffmon-rules.test.yml"]);
    let dir = root().join("config/prometheus");
    let rules: serde_yaml::Value =
        serde_yaml::from_str(&fs::read_to_string(dir.join("diffmon-rules.yml")).unwrap()).unwrap();
    let tests: serde_yaml::Value =
        serde_yaml::from_str(&fs::read_to_string(dir.join("diffmon-rules.test.yml")).unwrap())
            .unwrap();
    let mut alerts = BTreeSet::new();
    for g in rules["groups"].as_sequence().unwrap() {
        for r in g["rules"].as_sequence().unwrap() {
            if let Some(a) = r["alert"].as_str() {
                alerts.insert(a.to_string());
            }
        }
    }
    assert!(alerts.len() >= 3, "{alerts:?}");
    for alert in &alerts {
        let (mut firing, mut silent) = (0, 0);
        for t in tests["tests"].as_sequence().unwrap() {
            for case in t["alert_rule_test"].as_sequence().into_iter().flatten() {
                if case["alertname"].as_str() == Some(alert) {
                    match case["exp_alerts"].as_sequence().map(|s| s.len()) {
                        Some(0) | None => silent += 1,
                        Some(_) => firing += 1,
                    }
                }
            }
        }
        assert!(
            firing >= 1 && silent >= 1,
            "{alert}: {firing} firing and {silent} silent test cases"
        );
    }
}

/// Prometheus on a free port with a temporary storage, killed when dropped.
struct Prometheus {
    child: Child,
    url: String,
    log: PathBuf,
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Prometheus {
    /// Scrapes `target` every second and evaluates diffmon's alert rules every second.
    fn start(dir: &Path, target: &str) -> Prometheus {
        let port = free_port();
        let config = dir.join("prometheus.yml");
        fs::write(
            &config,
            format!(
                "global: {{scrape_interval: 1s, evaluation_interval: 1s}}\n\
                 rule_files: [{:?}]\n\
                 scrape_configs:\n  - job_name: diffmon\n    static_configs:\n      - targets: [\"{target}\"]\n",
                root()
                    .join("config/prometheus/diffmon-rules.yml")
                    .display()
                    .to_string()
            ),
        )
        .unwrap();
        let log = dir.join("prometheus.log");
        let out = fs::File::create(&log).unwrap();
        let child = Command::new("prometheus")
            .arg(format!("--config.file={}", config.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.join("prometheus-data").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .stdin(Stdio::null())
            .stdout(out.try_clone().unwrap())
            .stderr(out)
            .spawn()
            .expect("prometheus (Debian package, installed by make setup)");
        let p = Prometheus {
            child,
            url: format!("http://127.0.0.1:{port}"),
            log,
        };
        p.wait_for(Duration::from_secs(60), "Prometheus to be ready", |p| {
            http_get(&format!("{}/-/ready", p.url)).is_some()
        });
        p
    }

    /// The result vector of an instant query now.
    fn query(&self, promql: &str) -> Vec<Value> {
        let body = http_get(&format!(
            "{}/api/v1/query?query={}",
            self.url,
            encode(promql)
        ))
        .unwrap_or_else(|| panic!("query {promql:?} failed; log:\n{}", self.log()));
        let v: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(v["status"], "success", "{promql}: {v}");
        v["data"]["result"].as_array().cloned().unwrap_or_default()
    }

    /// The result matrix of a range query, as Grafana sends it (start, end, step in seconds).
    fn query_range(&self, promql: &str, start: f64, end: f64, step: f64) -> Vec<Value> {
        let body = http_get(&format!(
            "{}/api/v1/query_range?query={}&start={start:.3}&end={end:.3}&step={step}",
            self.url,
            encode(promql)
        ))
        .unwrap_or_else(|| panic!("range query {promql:?} failed; log:\n{}", self.log()));
        let v: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(v["status"], "success", "{promql}: {v}");
        v["data"]["result"].as_array().cloned().unwrap_or_default()
    }

    fn log(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }

    fn wait_for(&self, timeout: Duration, what: &str, mut cond: impl FnMut(&Prometheus) -> bool) {
        let start = Instant::now();
        while !cond(self) {
            assert!(
                start.elapsed() < timeout,
                "timed out after {timeout:?} waiting for {what}; Prometheus log:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }
}

/// Percent-encoding of a query parameter.
fn encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// A dashboard expression as Grafana sends it for run `test` with the tests' Prometheus
/// (`scrape_interval: 1s`): `$__interval` at its smallest, the scrape interval;
/// `$__rate_interval` = max($__interval + scrape interval, 4 scrape intervals); `$__range` the
/// time picker's (1 h covers all the test's data).
fn substitute(expr: &str) -> String {
    substitute_run(expr, "test")
}

/// [`substitute`] with `$run` as `run`: one run's name, or Grafana's value of several
/// selected (`(a|b)`, as it formats a multi-value variable in a regex matcher).
fn substitute_run(expr: &str, run: &str) -> String {
    let e = expr
        .replace("${run}", run)
        .replace("$run", run)
        .replace("$__rate_interval", "4s")
        .replace("$__interval", "1s")
        .replace("$__range", "1h");
    assert!(
        !e.contains('$'),
        "a variable the test does not know in {expr:?}"
    );
    e
}

/// The series names in a `/metrics` text.
fn scraped_names(text: &str) -> BTreeSet<String> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .map(|l| l.split(['{', ' ']).next().unwrap().to_string())
        .collect()
}

/// The acceptance test of issue 6: a real Prometheus scrapes a real `diffmon watch` over the toy
/// run, configured so that every panel has data (ICR, the gap, PFD with a teacher, memorization,
/// tails, a failing checkpoint, the early stop and a webhook nobody answers), and every PromQL
/// expression of every dashboard returns at least one series. Prometheus also loads the alert
/// rules: the early stop and the failure alert fire on the real series.
#[test]
fn every_dashboard_query_returns_data_from_a_real_prometheus() {
    let run = empty_run();
    let dir = run.path();
    write_base_config(dir, "");
    let (hi, lo, rise) = checkpoints_by_icr(dir);
    let dead_port = free_port(); // nothing listens there: deliveries are retried
    let extra = format!(
        "checkpoints: {{pattern: \"ckpt_*.pt\", settle_secs: 0.2, poll_secs: 0.5}}\n\
         pfd: {{enabled: true, teacher: model.ts, samples: 16, batch_size: 16}}\n\
         memorization: {{enabled: true}}\n\
         tail: {{enabled: true, reference: training}}\n{}\
         alerts:\n  webhooks:\n    - url: http://127.0.0.1:{dead_port}/hook\n      format: json\n",
        detector_config(rise)
    );
    let d = Daemon::start(dir, &extra);
    let prom = Prometheus::start(dir, &format!("127.0.0.1:{}", d.port));
    prom.wait_for(Duration::from_secs(60), "the first scrape", |p| {
        !p.query("diffmon_build_info{run=\"test\"}").is_empty()
    });

    // Step 1 alone first, so that Prometheus sees the best step change (annotation).
    place(dir, &hi, 1);
    prom.wait_for(Duration::from_secs(180), "step 1 in Prometheus", |p| {
        !p.query("diffmon_best_step{run=\"test\"} == 1").is_empty()
    });
    for (step, src) in [(2, &lo), (3, &lo), (4, &hi), (5, &hi)] {
        place(dir, src, step);
    }
    // A valid container (safetensors, no tensors) that does not fit the model: a failure.
    let header = b"{}      ";
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header);
    fs::write(dir.join("ckpt_6.pt.tmp"), bytes).unwrap();
    fs::rename(dir.join("ckpt_6.pt.tmp"), dir.join("ckpt_6.pt")).unwrap();
    d.wait_for(
        Duration::from_secs(240),
        "the early stop, the failure and a webhook attempt",
        |d| {
            let text = d.get("/metrics").unwrap_or_default();
            // Every series exists from the start (at 0): wait for non-zero values.
            text.contains("diffmon_early_stop_triggered{run=\"test\",metric=\"icr\"} 1")
                && sum_of(&text, "diffmon_checkpoint_failures_total{") > 0.0
                && sum_of(&text, "diffmon_webhook_deliveries_total{") > 0.0
        },
    );
    let (steps, failures) = journal(dir);
    assert_eq!(steps, vec![1, 2, 3, 4, 5]);
    assert_eq!(failures.len(), 1, "{failures:?}");

    // Every name a dashboard uses is in the live scrape, but the Slurm executor's and the GPU's:
    // this daemon runs the local executor, which does not export the first (issue 34), on the
    // CPU, where there is no GPU time or memory.
    let live = scraped_names(&d.get("/metrics").unwrap());
    let slurm = |name: &str| name.starts_with("diffmon_slurm_");
    let gpu = |name: &str| name.starts_with("diffmon_gpu_");
    let exprs: Vec<Expr> = dashboard_exprs()
        .into_iter()
        .filter(|(_, _, e)| !metric_names(e).iter().any(|n| slurm(n) || gpu(n)))
        .collect();
    for (file, at, expr) in &exprs {
        for n in metric_names(expr) {
            assert!(
                live.contains(&n),
                "{file} {at}: {n} is not in the daemon's /metrics: {live:?}"
            );
        }
    }
    assert!(!live.iter().any(|n| slurm(n) || gpu(n)), "{live:?}");

    // Every expression returns data once Prometheus has scraped the final state.
    let start = Instant::now();
    loop {
        let empty: Vec<&Expr> = exprs
            .iter()
            .filter(|(_, _, e)| prom.query(&substitute(e)).is_empty())
            .collect();
        if empty.is_empty() {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "dashboard queries without data: {empty:#?}\n/metrics:\n{}",
            d.get("/metrics").unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(500));
    }
    assert!(exprs.len() >= 20, "only {} expressions", exprs.len());

    // The run variable lists the run, and Prometheus holds the daemon's values.
    let runs: Vec<String> = prom
        .query("diffmon_build_info")
        .iter()
        .map(|s| s["metric"]["run"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(runs, ["test"]);
    let best = prom.query("diffmon_best_step{run=\"test\"}");
    assert_eq!(best[0]["value"][1], "2", "{best:?}");

    // Prometheus (2.42 asks for OpenMetrics first) parsed every scrape.
    let targets: Value =
        serde_json::from_str(&http_get(&format!("{}/api/v1/targets", prom.url)).unwrap()).unwrap();
    let target = &targets["data"]["activeTargets"][0];
    assert_eq!(target["health"], "up", "{target}");
    assert_eq!(target["lastError"], "", "{target}");

    // The alert rules fire on the real series.
    prom.wait_for(Duration::from_secs(30), "the alerts", |p| {
        let firing: BTreeSet<String> = p
            .query("ALERTS{alertstate=\"firing\",run=\"test\"}")
            .iter()
            .map(|s| s["metric"]["alertname"].as_str().unwrap().to_string())
            .collect();
        firing.contains("DiffusionEarlyStop") && firing.contains("DiffmonCheckpointFailures")
    });
}

/// A series as a Grafana panel sees it: the query's refId, its labels, and its display name
/// (the legend format rendered with its labels).
struct Shown {
    ref_id: String,
    labels: Value,
    name: String,
    value: f64,
}

/// A legend format rendered as Grafana renders `legendFormat` for a Prometheus series: each
/// `{{label}}` replaced with the series' value of that label (empty when it has none).
fn render_legend(format: &str, labels: &Value) -> String {
    let template = Regex::new(r"\{\{\s*(.+?)\s*\}\}").unwrap();
    template
        .replace_all(format, |c: &regex::Captures| {
            labels[&c[1]].as_str().unwrap_or("").to_string()
        })
        .into_owned()
}

/// Whether a panel override's matcher matches a series, as Grafana's field matchers do:
/// `byFrameRefID` by the query, `byRegexp` a pattern found in the display name, `byName` the
/// display name itself.
fn override_matches(matcher: &Value, s: &Shown) -> bool {
    let options = matcher["options"].as_str().unwrap_or_default();
    match matcher["id"].as_str().unwrap_or_default() {
        "byFrameRefID" => s.ref_id == options,
        "byRegexp" => Regex::new(options).unwrap().is_match(&s.name),
        "byName" => s.name == options,
        other => panic!("a matcher the test does not know: {other}"),
    }
}

/// Issue 34, the acceptance test of the dashboard's overrides: a real Prometheus scrapes a
/// two-run sweep (`a`, `b`), one checkpoint each, and every panel's queries run as Grafana runs
/// them (`$run` as both runs, or as each run in a panel repeated over `$run`); the legend
/// formats name the series. Every override matches at least one series in every copy of its
/// panel; display names are unique in each; the ICR band's upper bound fills down to the lower
/// bound of the same run (`custom.fillBelowTo` names a series of that run). Before the first
/// evaluation the sweep exports no last-evaluation timestamp, the process metrics once and
/// without a `run` label, no Slurm series, and the "time since the last evaluation" panel falls
/// back to the daemon's start for both runs.
#[test]
fn dashboard_overrides_match_the_series_of_a_two_run_sweep() {
    let run = empty_run();
    let dir = run.path();
    let port = free_port();
    let config = dir.join("sweep.yaml");
    fs::write(
        &config,
        format!(
            "http: {{listen: \"127.0.0.1:{port}\"}}\nmodel: {{architecture: model.ts}}\n\
             device: cpu\ncpu_threads: 1\ndata: {{path: train.h5, heldout_path: heldout.h5}}\n\
             icr: {{samples: 256, batch_size: 256}}\n\
             checkpoints: {{pattern: \"ckpt_*.pt\", settle_secs: 0.2, poll_secs: 0.5}}\n\
             runs:\n  - {{name: a, dir: a}}\n  - {{name: b, dir: b}}\n"
        ),
    )
    .unwrap();
    let runs = ["a", "b"];
    for r in runs {
        fs::create_dir(dir.join(r)).unwrap();
    }
    let d = Daemon::spawn(config, port);
    let text = d.get("/metrics").unwrap();
    assert!(
        !text.contains("diffmon_last_evaluation_timestamp_seconds"),
        "{text}"
    );
    assert!(
        !text.contains("diffmon_slurm_") && !text.contains("reason=\"job_"),
        "{text}"
    );
    for p in [
        "process_resident_memory_bytes",
        "process_start_time_seconds",
    ] {
        let lines: Vec<&str> = text.lines().filter(|l| l.starts_with(p)).collect();
        assert_eq!(lines.len(), 1, "{p} once, without labels: {lines:?}");
        assert!(lines[0].starts_with(&format!("{p} ")), "{lines:?}");
    }

    let prom = Prometheus::start(dir, &format!("127.0.0.1:{port}"));
    let both = format!("({})", runs.join("|"));
    let dash: Value =
        serde_json::from_str(&fs::read_to_string(root().join("dashboards/diffmon.json")).unwrap())
            .unwrap();
    let panels = dash["panels"].as_array().unwrap();
    let panel = |title: &str| {
        panels
            .iter()
            .find(|p| p["title"].as_str().unwrap().starts_with(title))
            .unwrap()
    };
    // Before any evaluation: the time since the daemon's start, per run.
    let since = substitute_run(
        panel("Time since the last evaluation")["targets"][0]["expr"]
            .as_str()
            .unwrap(),
        &both,
    );
    prom.wait_for(Duration::from_secs(60), "both runs' clocks", |p| {
        p.query(&since).len() == 2
    });
    for s in prom.query(&since) {
        let v: f64 = s["value"][1].as_str().unwrap().parse().unwrap();
        assert!((0.0..600.0).contains(&v), "{s}");
    }

    for r in runs {
        fs::copy(
            crate::common::toy_run().join("ckpt_000030.pt"),
            dir.join(r).join("ckpt_1.pt.tmp"),
        )
        .unwrap();
        fs::rename(
            dir.join(r).join("ckpt_1.pt.tmp"),
            dir.join(r).join("ckpt_1.pt"),
        )
        .unwrap();
    }
    let cpu = "rate(process_cpu_seconds_total[4s])";
    prom.wait_for(Duration::from_secs(180), "both runs' ICR and s.e.", |p| {
        p.query("diffmon_icr_stderr").len() == 2 && !p.query(cpu).is_empty()
    });

    let mut checked = 0;
    let mut bands = BTreeSet::new();
    for p in panels {
        let overrides = p["fieldConfig"]["overrides"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        let title = p["title"].as_str().unwrap();
        // A panel repeated over `$run` is one copy per run, each with `$run` its run.
        let copies: Vec<String> = if p["repeat"] == "run" {
            runs.iter().map(|r| r.to_string()).collect()
        } else {
            vec![both.clone()]
        };
        for run in &copies {
            let mut shown = Vec::new();
            for t in p["targets"].as_array().unwrap() {
                for series in prom.query(&substitute_run(t["expr"].as_str().unwrap(), run)) {
                    let labels = series["metric"].clone();
                    shown.push(Shown {
                        ref_id: t["refId"].as_str().unwrap().to_string(),
                        name: render_legend(t["legendFormat"].as_str().unwrap(), &labels),
                        value: series["value"][1]
                            .as_str()
                            .unwrap()
                            .parse()
                            .unwrap_or(f64::NAN),
                        labels,
                    });
                }
            }
            let names: BTreeSet<&str> = shown.iter().map(|s| s.name.as_str()).collect();
            assert_eq!(
                names.len(),
                shown.len(),
                "{title} ({run}): a name twice: {names:?}"
            );
            for o in &overrides {
                let matched: Vec<&Shown> = shown
                    .iter()
                    .filter(|s| override_matches(&o["matcher"], s))
                    .collect();
                assert!(
                    !matched.is_empty(),
                    "{title} ({run}): {o} matches none of {names:?}"
                );
                checked += 1;
                let fill = o["properties"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .find(|prop| prop["id"] == "custom.fillBelowTo");
                let Some(fill) = fill else { continue };
                // Each upper bound fills down to its own run's lower bound, below it.
                for upper in matched {
                    let lower = shown
                        .iter()
                        .find(|s| s.name == fill["value"].as_str().unwrap())
                        .unwrap_or_else(|| {
                            panic!("{title} ({run}): no series {} in {names:?}", fill["value"])
                        });
                    assert_eq!(upper.labels["run"], lower.labels["run"], "{title}");
                    assert!(upper.value > lower.value, "{title} ({run})");
                    bands.insert(upper.labels["run"].as_str().unwrap().to_string());
                }
            }
        }
    }
    assert_eq!(
        bands,
        runs.iter().map(|r| r.to_string()).collect(),
        "runs with a band"
    );
    assert!(checked >= 2 * 4 + 2, "only {checked} overrides checked");
}

/// The sum of the values of the series of a `/metrics` text whose line starts with `prefix`.
fn sum_of(text: &str, prefix: &str) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(prefix))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Writes `<dir>/diffmon.yaml` like `Daemon::start` does, with `http_keys` (flow-mapping
/// entries) beside `http.listen`, and starts the daemon.
fn start_daemon_with_http(dir: &Path, http_keys: &str, extra: &str) -> Daemon {
    let port = free_port();
    let config = dir.join("diffmon.yaml");
    fs::write(
        &config,
        format!(
            "run: {{dir: ., name: test}}\nmodel: {{architecture: model.ts}}\ndevice: cpu\n\
             data: {{path: train.h5, heldout_path: heldout.h5}}\n\
             http: {{listen: \"127.0.0.1:{port}\", {http_keys}}}\n\
             icr: {{samples: 256, batch_size: 256}}\n{extra}"
        ),
    )
    .unwrap();
    Daemon::spawn(config, port)
}

/// `GET path` over HTTP/1.0 with `Accept: accept`: (status line and headers, body).
fn get_accepting(port: u16, path: &str, accept: &str) -> (String, String) {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    write!(
        s,
        "GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\nAccept: {accept}\r\n\r\n"
    )
    .unwrap();
    let mut text = String::new();
    s.read_to_string(&mut text).unwrap();
    let (head, body) = text.split_once("\r\n\r\n").unwrap();
    (head.to_string(), body.to_string())
}

/// `promtool check metrics` on `body`: (success, output).
fn promtool_check_metrics(body: &str) -> (bool, String) {
    let mut child = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("promtool (Debian package prometheus, installed by make setup)");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(body.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    (
        out.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs_f64()
}

/// Issue 15: a fresh daemon's `/metrics` has every known series, at 0: each failure reason,
/// each stage of the duration histogram, each receiver and outcome of the deliveries, the
/// timestamps and the process metrics. Issue 34: on the local executor, none of the Slurm
/// executor's series (its jobs, its failure reasons); the process metrics once, without a `run`
/// label; no last-evaluation timestamp before the first evaluation.
#[test]
fn a_fresh_daemon_exports_every_known_series_at_zero() {
    use diffmon::alerts::{DeliveryOutcome, Receiver};
    use diffmon::metrics::{LAST_EVALUATION_TIMESTAMP, SLURM_METRICS, STAGES};
    use diffmon::record::FailureReason;
    let run = empty_run();
    let d = Daemon::start(run.path(), "");
    let text = d.get("/metrics").unwrap();
    let mut zero = vec![
        "diffmon_checkpoints_evaluated_total{run=\"test\"}".to_string(),
        "diffmon_checkpoints_skipped_total{run=\"test\"}".to_string(),
        "diffmon_checkpoints_pending{run=\"test\"}".to_string(),
        "diffmon_early_stop_triggered{run=\"test\",metric=\"icr\"}".to_string(),
        "diffmon_best_step_timestamp_seconds{run=\"test\"}".to_string(),
        "diffmon_early_stop_timestamp_seconds{run=\"test\"}".to_string(),
    ];
    for r in FailureReason::ALL {
        let series = format!("diffmon_checkpoint_failures_total{{run=\"test\",reason=\"{r}\"}}");
        if r.slurm_only() {
            assert!(!text.contains(&series), "{series} on the local executor");
        } else {
            zero.push(series);
        }
    }
    for name in SLURM_METRICS.iter().chain([&LAST_EVALUATION_TIMESTAMP]) {
        assert!(!text.contains(name), "{name} in\n{text}");
    }
    for s in STAGES {
        zero.push(format!(
            "diffmon_evaluation_duration_seconds_count{{run=\"test\",stage=\"{s}\"}}"
        ));
        zero.push(format!(
            "diffmon_evaluation_duration_seconds_bucket{{le=\"0.001\",run=\"test\",stage=\"{s}\"}}"
        ));
    }
    for r in Receiver::ALL {
        for o in DeliveryOutcome::ALL {
            zero.push(format!(
                "diffmon_webhook_deliveries_total{{run=\"test\",receiver=\"{r}\",outcome=\"{o}\"}}"
            ));
        }
    }
    for series in &zero {
        let line = text
            .lines()
            .find(|l| l.starts_with(&format!("{series} ")))
            .unwrap_or_else(|| panic!("{series} missing in\n{text}"));
        let v: f64 = line.rsplit(' ').next().unwrap().parse().unwrap();
        assert_eq!(v, 0.0, "{line}");
    }
    let now = unix_now();
    for (series, low, high) in [
        ("process_start_time_seconds", now - 600.0, now + 1.0),
        ("process_resident_memory_bytes", 1e6, 1e12),
        ("process_virtual_memory_bytes", 1e6, 1e15),
        ("process_open_fds", 3.0, 1e6),
        ("process_max_fds", 16.0, 1e9),
        ("process_cpu_seconds_total", 0.0, 1e6),
    ] {
        let lines: Vec<&str> = text.lines().filter(|l| l.starts_with(series)).collect();
        assert_eq!(lines.len(), 1, "{series}: {lines:?}");
        let v = sum_of(&text, &format!("{series} "));
        assert!((low..=high).contains(&v), "{series} = {v}\n{text}");
    }
}

/// Issue 15: `/metrics` answers the text format 0.0.4 unless OpenMetrics is asked for, and
/// `promtool check metrics` (which reads the text format) passes on the daemon's body after
/// evaluations and a failure. The OpenMetrics body is OpenMetrics (a real Prometheus parses it:
/// the test above).
#[test]
fn metrics_are_negotiated_and_the_text_format_passes_promtool() {
    let run = empty_run();
    let dir = run.path();
    write_base_config(dir, "");
    let (hi, lo, _) = checkpoints_by_icr(dir);
    let dead_port = free_port();
    let extra = format!(
        "checkpoints: {{pattern: \"ckpt_*.pt\", settle_secs: 0.2, poll_secs: 0.5}}\n\
         alerts:\n  webhooks:\n    - url: http://127.0.0.1:{dead_port}/hook\n      format: json\n"
    );
    let d = Daemon::start(dir, &extra);
    place(dir, &hi, 1);
    place(dir, &lo, 2);
    let header = b"{}      ";
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header);
    fs::write(dir.join("ckpt_3.pt.tmp"), bytes).unwrap();
    fs::rename(dir.join("ckpt_3.pt.tmp"), dir.join("ckpt_3.pt")).unwrap();
    d.wait_for(
        Duration::from_secs(240),
        "two evaluations and a failure",
        |d| {
            let text = d.get("/metrics").unwrap_or_default();
            sum_of(&text, "diffmon_checkpoints_evaluated_total{") == 2.0
                && sum_of(&text, "diffmon_checkpoint_failures_total{") == 1.0
        },
    );

    let text_type = "text/plain; version=0.0.4; charset=utf-8";
    let om_type = "application/openmetrics-text; version=1.0.0; charset=utf-8";
    let prometheus_accept = "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1";
    for (accept, want) in [
        ("text/plain;version=0.0.4", text_type),
        ("*/*", text_type),
        ("application/openmetrics-text; version=1.0.0", om_type),
        (prometheus_accept, om_type),
    ] {
        let (head, body) = get_accepting(d.port, "/metrics", accept);
        assert!(head.starts_with("HTTP/1.0 200"), "{head}");
        let content_type = head
            .lines()
            .find_map(|l| {
                l.to_ascii_lowercase()
                    .strip_prefix("content-type: ")
                    .map(str::to_string)
            })
            .unwrap();
        assert_eq!(content_type, want, "Accept: {accept}");
        if want == om_type {
            assert!(body.ends_with("# EOF\n"), "{body}");
            assert!(body.contains("# TYPE diffmon_checkpoints_evaluated counter\n"));
        } else {
            assert!(
                !body.contains("# EOF") && !body.contains("# UNIT"),
                "{body}"
            );
            assert!(body.contains("# TYPE diffmon_checkpoints_evaluated_total counter\n"));
            let (ok, out) = promtool_check_metrics(&body);
            assert!(ok, "promtool check metrics failed:\n{out}\non:\n{body}");
        }
    }
    // Without an Accept header (curl, the tests' http_get): the text format too.
    let body = d.get("/metrics").unwrap();
    assert!(!body.contains("# EOF"));
    let (ok, out) = promtool_check_metrics(&body);
    assert!(ok, "{out}");
}

/// Grafana's annotation events for a range query's result, as its Prometheus data source makes
/// them (`transformToAnnotations`): each sample's time, or with "series value as timestamp"
/// (`useValueForTime`) its value, in ms; samples with a value > 0 (all of them with
/// `useValueForTime`); times at most one step apart make one event (a region). Returns the
/// events' start times in ms.
fn grafana_annotation_events(series: &[Value], step_secs: f64, use_value: bool) -> Vec<f64> {
    let step_ms = (step_secs.floor() * 1000.0).max(0.0);
    let mut events = Vec::new();
    for s in series {
        let mut times = Vec::new();
        for pair in s["values"].as_array().unwrap() {
            let t = pair[0].as_f64().unwrap() * 1000.0;
            let v: f64 = pair[1].as_str().unwrap().parse().unwrap();
            let (time, value) = if use_value {
                (v.floor(), 1.0)
            } else {
                (t.floor(), v)
            };
            if value > 0.0 {
                times.push(time);
            }
        }
        let mut latest: Option<(f64, f64)> = None;
        for t in times {
            if let Some((_, end)) = latest.as_mut()
                && *end + step_ms >= t
            {
                *end = t;
                continue;
            }
            if let Some((start, _)) = latest {
                events.push(start);
            }
            latest = Some((t, t));
        }
        if let Some((start, _)) = latest {
            events.push(start);
        }
    }
    events
}

/// Issue 15: the dashboard's annotations, run as Grafana runs them at its default interval (a
/// range query with step = `$__interval` = the scrape interval), find every change of the best
/// step and the early stop, once each, at the time of the evaluation that made it.
#[test]
fn dashboard_annotations_find_every_best_step_change_and_the_early_stop() {
    use diffmon::metrics::parse_rfc3339_utc;
    let run = empty_run();
    let dir = run.path();
    write_base_config(dir, "");
    let (hi, lo, rise) = checkpoints_by_icr(dir);
    let extra = format!(
        "checkpoints: {{pattern: \"ckpt_*.pt\", settle_secs: 0.2, poll_secs: 0.5}}\n{}",
        detector_config(rise)
    );
    let d = Daemon::start(dir, &extra);
    let prom = Prometheus::start(dir, &format!("127.0.0.1:{}", d.port));
    prom.wait_for(Duration::from_secs(60), "the first scrape", |p| {
        !p.query("diffmon_build_info{run=\"test\"}").is_empty()
    });
    let start = unix_now() - 5.0;
    let mut best: Option<i64> = None;
    let mut best_changes = Vec::new(); // evaluation times (s) of the steps that changed the best
    let mut fired = Vec::new();
    for (step, src) in [(1, &hi), (2, &lo), (3, &lo), (4, &hi), (5, &hi)] {
        place(dir, src, step);
        // Evaluated, and scraped more than one scrape interval after its evaluation: the next
        // change comes more than one step later (Grafana merges closer ones into a region).
        let q = format!(
            "diffmon_last_evaluated_step{{run=\"test\"}} == {step} and on (run) \
             (timestamp(diffmon_last_evaluation_timestamp_seconds{{run=\"test\"}}) \
             - diffmon_last_evaluation_timestamp_seconds{{run=\"test\"}}) > 1.5"
        );
        prom.wait_for(
            Duration::from_secs(180),
            &format!("step {step} scraped after its evaluation"),
            |p| !p.query(&q).is_empty(),
        );
        let status: Value = serde_json::from_str(&d.get("/v1/early-stop").unwrap()).unwrap();
        let at = journal_entries(dir)
            .iter()
            .find(|e| e["kind"] == "evaluation" && e["record"]["step"] == step)
            .map(|e| parse_rfc3339_utc(e["at"].as_str().unwrap()).unwrap())
            .unwrap();
        if status["best_step"].as_i64() != best {
            best = status["best_step"].as_i64();
            best_changes.push(at);
        }
        if status["fired"] == true && fired.is_empty() {
            fired.push(at);
        }
    }
    assert!(best_changes.len() >= 2, "{best_changes:?}");
    assert_eq!(fired.len(), 1, "the early stop did not fire");
    let end = unix_now() + 1.0;

    let dash: Value =
        serde_json::from_str(&fs::read_to_string(root().join("dashboards/diffmon.json")).unwrap())
            .unwrap();
    let annotations = dash["annotations"]["list"].as_array().unwrap();
    for (name, expected) in [
        ("New best checkpoint", &best_changes),
        ("Early stop", &fired),
    ] {
        let a = annotations
            .iter()
            .find(|a| a["name"] == name)
            .unwrap_or_else(|| panic!("no annotation {name:?}"));
        assert_eq!(a["step"], "$__interval", "{a}");
        let use_value = a["useValueForTime"] == true;
        let step = 1.0; // $__interval at Grafana's default = the scrape interval
        let expr = substitute(a["expr"].as_str().unwrap());
        let series = prom.query_range(&expr, start, end, step);
        let events = grafana_annotation_events(&series, step, use_value);
        assert_eq!(
            events.len(),
            expected.len(),
            "{name}: events at {events:?} ms, expected {expected:?} s ({expr})"
        );
        for (e, x) in events.iter().zip(expected.iter()) {
            assert!(
                (e - x * 1000.0).abs() <= 1.0,
                "{name}: an event at {e} ms, expected {x} s"
            );
        }
    }
}

/// Issue 15: the alert Alertmanager receives (its API v2) has a `description` and a `summary`;
/// `diffmon_webhook_deliveries_total` counts Alertmanager pushes apart from webhooks.
#[test]
fn alertmanager_gets_a_description_and_deliveries_are_counted_per_receiver() {
    let run = empty_run();
    let dir = run.path();
    write_base_config(dir, "");
    let (hi, lo, rise) = checkpoints_by_icr(dir);
    let am = Alertmanager::start_on(dir, free_port());
    let dead_port = free_port(); // nothing listens there: the webhook is retried
    let extra = format!(
        "checkpoints: {{pattern: \"ckpt_*.pt\", settle_secs: 0.2, poll_secs: 0.5}}\n{}\
         alerts:\n  webhooks:\n    - url: http://127.0.0.1:{dead_port}/hook\n      format: json\n\
         \x20 alertmanager:\n    url: {}\n",
        detector_config(rise),
        am.url
    );
    let d = Daemon::start(dir, &extra);
    for (step, src) in [(1, &hi), (2, &lo), (3, &lo), (4, &hi), (5, &hi)] {
        place(dir, src, step);
    }
    let start = Instant::now();
    let alert = loop {
        let found = am.active_alerts().into_iter().find(|a| {
            a["labels"]["alertname"] == "DiffusionEarlyStop" && a["labels"]["run"] == "test"
        });
        if let Some(a) = found {
            break a;
        }
        assert!(
            start.elapsed() < Duration::from_secs(240),
            "no DiffusionEarlyStop alert in Alertmanager; log:\n{}",
            d.log()
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    let status: Value = serde_json::from_str(&d.get("/v1/early-stop").unwrap()).unwrap();
    let best = status["best_step"].as_i64().unwrap();
    let description = alert["annotations"]["description"]
        .as_str()
        .unwrap_or_else(|| panic!("no description: {alert}"));
    for part in [
        "Run test".to_string(),
        "icr".to_string(),
        format!("step {best}"),
    ] {
        assert!(
            description.contains(&part),
            "{part:?} not in {description:?}"
        );
    }
    assert!(description.ends_with('.'), "{description:?}");
    assert!(
        alert["annotations"]["summary"]
            .as_str()
            .is_some_and(|s| s.contains("test")),
        "{alert}"
    );

    let series = |r: &str, o: &str| {
        format!("diffmon_webhook_deliveries_total{{run=\"test\",receiver=\"{r}\",outcome=\"{o}\"}}")
    };
    d.wait_for(
        Duration::from_secs(60),
        "the Alertmanager push and a webhook retry counted",
        |d| {
            d.metric(&series("alertmanager", "delivered"))
                .unwrap_or(0.0)
                >= 1.0
                && d.metric(&series("webhook", "retried")).unwrap_or(0.0) >= 1.0
        },
    );
    assert_eq!(d.metric(&series("webhook", "delivered")), Some(0.0));
    assert_eq!(d.metric(&series("alertmanager", "retried")), Some(0.0));
    assert_eq!(d.metric(&series("alertmanager", "rejected")), Some(0.0));
}

/// Issue 15: the HTTP server's bounds, with short settings in the defaults' ratio (the idle
/// timeout 6 times the header timeout). Slow clients (a request head sent a byte every 100 ms)
/// are closed after `http.header_timeout_secs` without an answer, not after the idle timeout
/// (issue 62: the watchdog slept for the idle deadline and was not woken when a head started);
/// idle connections filling `http.max_connections` do not keep `/healthz` from being answered:
/// a new connection closes the one that has waited longest, and the rest are closed after
/// `http.idle_timeout_secs`.
#[test]
fn slow_and_idle_http_clients_are_closed_and_the_connection_cap_frees_up() {
    let run = empty_run();
    let dir = run.path();
    let d = start_daemon_with_http(
        dir,
        "header_timeout_secs: 1, idle_timeout_secs: 6, max_connections: 16, allowed_hosts: [trainbox]",
        "",
    );
    let port = d.port;
    // The `Host` header (issue #45, DNS rebinding): another site's name is refused, an
    // address, localhost and a configured name are answered.
    let raw = |head: &str| {
        let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        write!(s, "{head}\r\n").unwrap();
        let mut text = String::new();
        s.read_to_string(&mut text).unwrap();
        text
    };
    let with_host = |host: &str| raw(&format!("GET /v1/early-stop HTTP/1.0\r\nHost: {host}\r\n"));
    let refused = with_host(&format!("attacker.example:{port}"));
    assert!(refused.starts_with("HTTP/1.0 403"), "{refused}");
    assert!(refused.contains("http.allowed_hosts"), "{refused}");
    // Issue 62: a second Host header, or a request line in absolute form, were answered.
    let two = raw("GET /v1/early-stop HTTP/1.0\r\nHost: 127.0.0.1\r\nHost: attacker.example\r\n");
    assert!(two.starts_with("HTTP/1.0 400"), "{two}");
    assert!(two.contains("more than one Host header"), "{two}");
    let absolute = raw(&format!(
        "GET http://attacker.example/v1/early-stop HTTP/1.0\r\nHost: 127.0.0.1:{port}\r\n"
    ));
    assert!(absolute.starts_with("HTTP/1.0 400"), "{absolute}");
    for host in [
        format!("127.0.0.1:{port}"),
        "localhost".into(),
        format!("trainbox:{port}"),
    ] {
        let answer = with_host(&host);
        assert!(answer.starts_with("HTTP/1.0 200"), "{host}: {answer}");
    }
    // A head of 230 bytes: 23 s at a byte every 100 ms, if nothing closes it.
    let head = format!(
        "GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: {}\r\n\r\n",
        "a".repeat(180)
    );
    let slow: Vec<_> = (0..12)
        .map(|_| {
            let head = head.clone();
            std::thread::spawn(move || {
                let started = Instant::now();
                let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
                s.set_read_timeout(Some(Duration::from_millis(100)))
                    .unwrap();
                let mut buf = [0u8; 256];
                for b in head.bytes() {
                    if s.write_all(&[b]).is_err() {
                        return Ok(started.elapsed());
                    }
                    match s.read(&mut buf) {
                        Ok(0) => return Ok(started.elapsed()),
                        Ok(n) => {
                            return Err(format!(
                                "an answer: {}",
                                String::from_utf8_lossy(&buf[..n])
                            ));
                        }
                        Err(e)
                            if matches!(
                                e.kind(),
                                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                            ) => {}
                        Err(_) => return Ok(started.elapsed()), // reset
                    }
                }
                Err("the whole head went through, the connection still open".into())
            })
        })
        .collect();
    for t in slow {
        let closed_after = t.join().unwrap().unwrap();
        assert!(
            closed_after >= Duration::from_millis(900),
            "closed before the header timeout: {closed_after:?}"
        );
        // 1 s after the head's first byte, with the bounds' own slack (up to 100 ms each side
        // of the client's reads, and a loaded machine's scheduling): far from the 6 s idle
        // timeout it was closed at before the fix.
        assert!(
            closed_after < Duration::from_secs(4),
            "closed after the idle timeout, not the header timeout: {closed_after:?}"
        );
    }
    assert_eq!(
        http_get(&format!("http://127.0.0.1:{port}/healthz")).as_deref(),
        Some("ok\n")
    );

    // The cap: 16 idle connections (the first one oldest), then one more is answered, and the
    // oldest idle one is closed at once to make its place.
    let mut idle: Vec<TcpStream> = (0..16)
        .map(|k| {
            let s = TcpStream::connect(("127.0.0.1", port)).unwrap();
            if k == 0 {
                std::thread::sleep(Duration::from_millis(200));
            }
            s
        })
        .collect();
    std::thread::sleep(Duration::from_millis(300)); // every one accepted
    let asked = Instant::now();
    let mut extra = TcpStream::connect(("127.0.0.1", port)).unwrap();
    extra
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    let _ = write!(extra, "GET /healthz HTTP/1.0\r\n\r\n");
    let mut answer = Vec::new();
    let _ = extra.read_to_end(&mut answer);
    let answer = String::from_utf8_lossy(&answer);
    assert!(
        answer.starts_with("HTTP/1.0 200"),
        "over the cap: {answer:?}"
    );
    idle[0]
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    let mut buf = [0u8; 16];
    match idle[0].read(&mut buf) {
        Ok(0) => {}
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {}
        other => panic!("the oldest idle connection was not closed: {other:?}"),
    }
    assert!(
        asked.elapsed() < Duration::from_secs(4),
        "the oldest idle connection was closed by its idle timeout, not by the new one: {:?}",
        asked.elapsed()
    );
    // The other idle ones are closed by the server (EOF) after the idle timeout.
    for s in &mut idle[1..] {
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        let mut buf = [0u8; 16];
        match s.read(&mut buf) {
            Ok(0) => {}
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {}
            other => panic!("an idle connection was not closed: {other:?}"),
        }
    }
    assert_eq!(
        http_get(&format!("http://127.0.0.1:{port}/healthz")).as_deref(),
        Some("ok\n")
    );
    assert!(
        d.log()
            .contains("each new one closes the one that has waited longest without a request"),
        "{}",
        d.log()
    );
}
