//! The monitoring kit: the Grafana dashboards against the metric names the code exports and
//! against a real Prometheus (Debian package) scraping a real `diffmon watch`, and the Prometheus
//! config and alert rules through `promtool` (the same package).

use crate::common::{http_get, root};
use crate::daemon::{Daemon, empty_run, free_port, journal};
use crate::early_stop::{checkpoints_by_icr, detector_config, place, write_base_config};
use regex::Regex;
use serde_json::Value;
use std::collections::BTreeSet;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

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
    use diffmon::metrics::{EVALUATION_DURATION, exported_names};
    let mut names: BTreeSet<String> = exported_names().into_iter().collect();
    assert!(names.remove(EVALUATION_DURATION));
    for s in ["_bucket", "_sum", "_count"] {
        names.insert(format!("{EVALUATION_DURATION}{s}"));
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
    ] {
        assert!(used.contains(needed), "no dashboard shows {needed}");
    }

    // Classic dashboard model, `$datasource` (Prometheus) and `$run` from label_values.
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
                assert!(e.contains("run=\"$run\""), "{}: {e}", p["title"]);
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

/// A dashboard expression as Grafana sends it for run `test`. The windows are longer than the
/// test's data is old, so each covers all of it (Grafana's `$__rate_interval` is at least four
/// scrape intervals; `$__interval` and `$__range` follow the time picker).
fn substitute(expr: &str) -> String {
    let e = expr
        .replace("${run}", "test")
        .replace("$run", "test")
        .replace("$__rate_interval", "5m")
        .replace("$__interval", "5m")
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
            text.contains("diffmon_early_stop_triggered{run=\"test\"} 1")
                && text.contains("diffmon_checkpoint_failures_total{")
                && text.contains("diffmon_webhook_deliveries_total{")
        },
    );
    let (steps, failures) = journal(dir);
    assert_eq!(steps, vec![1, 2, 3, 4, 5]);
    assert_eq!(failures.len(), 1, "{failures:?}");

    // Every name a dashboard uses is in the live scrape.
    let live = scraped_names(&d.get("/metrics").unwrap());
    let exprs = dashboard_exprs();
    for (file, at, expr) in &exprs {
        for n in metric_names(expr) {
            assert!(
                live.contains(&n),
                "{file} {at}: {n} is not in the daemon's /metrics: {live:?}"
            );
        }
    }

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

    // The alert rules fire on the real series.
    prom.wait_for(Duration::from_secs(30), "the alerts", |p| {
        let firing: BTreeSet<String> = p
            .query("ALERTS{alertstate=\"firing\",run=\"test\"}")
            .iter()
            .map(|s| s["metric"]["alertname"].as_str().unwrap().to_string())
            .collect();
        firing.contains("DiffmonEarlyStop") && firing.contains("DiffmonCheckpointFailures")
    });
}
