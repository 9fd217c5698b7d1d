//! `early_stop.keep_best` end to end: a trainer that rotates its checkpoints (accelerate's
//! `checkpoints_total_limit: 2`: checkpoint folders, the newest two kept) while `diffmon watch`
//! evaluates them. The best checkpoint survives in `<state_dir>/best/`, one kept copy at a time,
//! every output names both paths (the stop file, `/v1/early-stop`, each webhook format as a real
//! receiver gets it, the alert in a real Alertmanager, the live page, the report), and
//! `diffmon replay` over the recorded history decides what the daemon decided.

use crate::common::{diffmon, stdout};
use crate::daemon::{Daemon, empty_run, free_port, journal};
use crate::early_stop::{
    Alertmanager, Receiver, SECRET, checkpoints_by_icr, detector_config, write_base_config,
};
use serde_json::Value;
use std::fs;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// How many checkpoints the trainer keeps (`checkpoints_total_limit`).
const TOTAL_LIMIT: usize = 2;

/// The trainer: writes `checkpoint-<step>/` (the weights as accelerate's `pytorch_model.bin`,
/// and an optimizer file) under a hidden name and renames it into place, then deletes all but
/// the newest [`TOTAL_LIMIT`] checkpoint folders, as accelerate does before its next save.
fn save_and_rotate(dir: &Path, weights: &Path, step: i64) {
    let tmp = dir.join(format!(".checkpoint-{step}.partial"));
    fs::create_dir(&tmp).unwrap();
    fs::copy(weights, tmp.join("pytorch_model.bin")).unwrap();
    fs::write(tmp.join("optimizer.bin"), format!("optimizer state {step}")).unwrap();
    fs::rename(&tmp, dir.join(format!("checkpoint-{step}"))).unwrap();
}

fn rotate(dir: &Path) {
    let mut steps: Vec<i64> = fs::read_dir(dir)
        .unwrap()
        .filter_map(|e| {
            let name = e.unwrap().file_name().into_string().unwrap();
            name.strip_prefix("checkpoint-")?.parse().ok()
        })
        .collect();
    steps.sort_unstable();
    let excess = steps.len().saturating_sub(TOTAL_LIMIT);
    for step in &steps[..excess] {
        fs::remove_dir_all(dir.join(format!("checkpoint-{step}"))).unwrap();
    }
}

/// The names in `<state_dir>/best/`.
fn kept(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = fs::read_dir(dir.join(".diffmon/best"))
        .map(|entries| {
            entries
                .map(|e| e.unwrap().file_name().into_string().unwrap())
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    names
}

#[test]
fn the_best_checkpoint_survives_rotation_and_one_copy_is_kept() {
    let run = empty_run();
    let dir = run.path();
    write_base_config(dir, "");
    let (hi, lo, rise) = checkpoints_by_icr(dir);
    // Every webhook format, to one real receiver (the JSON one signed), and a real Alertmanager.
    let receiver = Receiver::start(dir, free_port(), "");
    let am = Alertmanager::start_on(dir, free_port());
    // SAFETY of the tests: every test that sets it sets the same value.
    unsafe { std::env::set_var("DIFFMON_TEST_SECRET", SECRET) };
    let hook = |path: &str, format: &str| {
        format!(
            "    - {{url: \"http://127.0.0.1:{}/{path}\", format: {format}}}\n",
            receiver.port
        )
    };
    let alerts = format!(
        "alerts:\n  webhooks:\n    - {{url: \"http://127.0.0.1:{}/json\", format: json, \
         secret_env: DIFFMON_TEST_SECRET}}\n{}{}  alertmanager: {{url: \"{}\"}}\n",
        receiver.port,
        hook("slack", "slack"),
        hook("alertmanager", "alertmanager"),
        am.url
    );
    let mut d = Daemon::start(
        dir,
        &format!(
            "checkpoints: {{pattern: \"checkpoint-*\", settle_secs: 0.2, poll_secs: 0.5}}\n{}{alerts}",
            detector_config(rise)
        ),
    );
    // ICR high, low, low, high, high: the best is step 2 (step 3 only equals it), and the
    // early stop fires at step 5, when rotation has long deleted checkpoint-2.
    let plan: [(i64, &PathBuf, i64); 5] = [
        (1, &hi, 1),
        (2, &lo, 2),
        (3, &lo, 2),
        (4, &hi, 2),
        (5, &hi, 2),
    ];
    for (step, weights, best) in plan {
        save_and_rotate(dir, weights, step);
        d.wait_for(
            Duration::from_secs(180),
            &format!("the evaluation of step {step}"),
            |_| journal(dir).0.len() as i64 >= step,
        );
        rotate(dir);
        let want = vec![format!("checkpoint-{best}")];
        d.wait_for(
            Duration::from_secs(60),
            &format!("checkpoint-{best} kept alone after step {step}"),
            |_| kept(dir) == want,
        );
    }
    assert!(!dir.join("checkpoint-2").exists(), "rotation kept it");
    let copy = dir.join(".diffmon/best/checkpoint-2");
    assert_eq!(
        fs::read(copy.join("pytorch_model.bin")).unwrap(),
        fs::read(&lo).unwrap()
    );
    assert_eq!(
        fs::read_to_string(copy.join("optimizer.bin")).unwrap(),
        "optimizer state 2"
    );

    // The event names the best checkpoint and its kept copy.
    d.wait_for(Duration::from_secs(60), "the stop file", |_| {
        dir.join("EARLY_STOP").is_file()
    });
    let stop: Value =
        serde_json::from_str(&fs::read_to_string(dir.join("EARLY_STOP")).unwrap()).unwrap();
    assert_eq!(stop["best_step"], 2);
    assert_eq!(stop["current_step"], 5);
    assert!(
        stop["best_checkpoint"]
            .as_str()
            .unwrap()
            .ends_with("/checkpoint-2"),
        "{stop}"
    );
    assert_eq!(stop["best_checkpoint_kept"], copy.display().to_string());
    let status: Value = serde_json::from_str(&d.get("/v1/early-stop").unwrap()).unwrap();
    assert_eq!(
        status["event"]["best_checkpoint_kept"],
        stop["best_checkpoint_kept"]
    );
    assert!(
        d.log()
            .contains("best checkpoint kept (early_stop.keep_best)")
    );

    // Every other output names the kept copy beside the original, which rotation deleted.
    let original = stop["best_checkpoint"].as_str().unwrap().to_string();
    let copy = copy.display().to_string();
    let named = format!("{original} (kept as {copy})");
    let page_names_it =
        format!(r#"kept as <span class="path" id="best-checkpoint-kept">{copy}</span>"#);
    let page = d.get("/").unwrap();
    assert!(page.contains(&page_names_it), "{page}");
    d.wait_for(Duration::from_secs(60), "the three webhooks", |_| {
        let paths: Vec<Value> = receiver
            .requests()
            .iter()
            .map(|r| r["path"].clone())
            .collect();
        ["/json", "/slack", "/alertmanager"]
            .iter()
            .all(|p| paths.contains(&Value::from(*p)))
    });
    let body = |path: &str| -> Value {
        let r = receiver
            .requests()
            .into_iter()
            .find(|r| r["path"] == path)
            .unwrap();
        assert_eq!(r["status"], 200, "{r}");
        r["body"].clone()
    };
    let json = receiver
        .requests()
        .into_iter()
        .find(|r| r["path"] == "/json")
        .unwrap();
    assert_eq!(json["valid"], true, "Standard Webhooks signature: {json}");
    assert_eq!(
        json["body"]["best_checkpoint_kept"],
        copy.as_str(),
        "{json}"
    );
    let slack = body("/slack");
    assert!(slack["text"].as_str().unwrap().contains(&named), "{slack}");
    let webhook = body("/alertmanager");
    let annotations = &webhook["alerts"][0]["annotations"];
    assert_eq!(
        annotations["best_checkpoint_kept"],
        copy.as_str(),
        "{webhook}"
    );
    for text in ["summary", "description"] {
        let t = annotations[text].as_str().unwrap();
        assert!(t.contains(&named), "{text}: {t}");
    }
    let alert = {
        let start = std::time::Instant::now();
        loop {
            if let Some(a) = am.active_alerts().into_iter().next() {
                break a;
            }
            assert!(
                start.elapsed() < Duration::from_secs(60),
                "no alert in Alertmanager"
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    };
    let annotations = &alert["annotations"];
    assert_eq!(
        annotations["best_checkpoint_kept"],
        copy.as_str(),
        "{alert}"
    );
    for text in ["summary", "description"] {
        let t = annotations[text].as_str().unwrap();
        assert!(t.contains(&named), "{text}: {t}");
    }

    // A restart finds the kept copy in the state folder and keeps it: still one.
    d.terminate();
    d.restart();
    d.wait_for(Duration::from_secs(120), "the restored status", |d| {
        d.get("/v1/early-stop")
            .is_some_and(|s| s.contains("\"fired\":true"))
    });
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(kept(dir), ["checkpoint-2"]);
    // The restarted daemon's live page names it again, from the state folder.
    d.wait_for(
        Duration::from_secs(60),
        "the kept copy on the live page",
        |d| d.get("/").is_some_and(|p| p.contains(&page_names_it)),
    );
    d.terminate();

    // So does the report, from the state folder.
    let config = dir.join("diffmon.yaml");
    let html = dir.join("report.html");
    let out = diffmon(&[
        "report",
        "--config",
        config.to_str().unwrap(),
        "--out",
        html.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", crate::common::stderr(&out));
    let report = fs::read_to_string(&html).unwrap();
    assert!(report.contains(&page_names_it), "{report}");

    // `diffmon replay` over the recorded history decides what the daemon decided.
    let out = diffmon(&["replay", "--config", config.to_str().unwrap(), "--json"]);
    assert!(out.status.success(), "{}", crate::common::stderr(&out));
    let lines: Vec<Value> = stdout(&out)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 6, "{lines:?}");
    let summary = &lines[5];
    assert_eq!(summary["kind"], "summary");
    assert_eq!(summary["fired_at_step"], 5);
    assert_eq!(summary["best_step"], 2);
    assert_eq!(lines[4]["decision"], "early_stop");
    assert_eq!(lines[1]["decision"], "best");
}

/// A best checkpoint that is a symbolic link is evaluated (reading follows it) but not kept
/// (keeping follows no link): the WARN says so once, although the run fires with that best and
/// the daemon stops keeping it (#62).
#[test]
fn a_symlinked_best_checkpoint_is_refused_with_one_warning() {
    let run = empty_run();
    let dir = run.path();
    write_base_config(dir, "");
    let (hi, lo, rise) = checkpoints_by_icr(dir);
    let outside = tempfile::tempdir().unwrap();
    let target = outside.path().join("weights.pt");
    fs::copy(&lo, &target).unwrap();
    let mut d = Daemon::start(
        dir,
        &format!(
            "checkpoints: {{pattern: \"ckpt_*.pt\", settle_secs: 0.2, poll_secs: 0.5}}\n{}",
            detector_config(rise)
        ),
    );
    crate::early_stop::place(dir, &hi, 1);
    std::os::unix::fs::symlink(&target, dir.join("ckpt_2.pt")).unwrap();
    d.wait_for(Duration::from_secs(120), "step 2", |d| d.evaluated() >= 2.0);
    for step in 3..=5 {
        crate::early_stop::place(dir, &hi, step);
    }
    let status = || -> Value {
        serde_json::from_str(&d.get("/v1/early-stop").unwrap_or_default()).unwrap_or_default()
    };
    d.wait_for(Duration::from_secs(240), "the early stop", |_| {
        let s = status();
        s["fired"] == true && s["best_step"] == 2
    });
    let stop = status();
    d.terminate();
    let log = d.log();
    let warned = log.matches("cannot keep the best checkpoint").count();
    assert_eq!(warned, 1, "{log}");
    assert!(log.contains("symbolic link"), "{log}");
    // The link's target is never copied, and the stop does not claim a kept copy of step 2 (the
    // copy of step 1, the best before it, may stay).
    assert!(
        !kept(dir).contains(&"ckpt_2.pt".to_string()),
        "{:?}",
        kept(dir)
    );
    assert!(stop["event"]["best_checkpoint_kept"].is_null(), "{stop}");
}
