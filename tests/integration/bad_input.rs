//! The corpus of invalid configs in `tests/bad_configs/`: each file states, in `# expect:` lines,
//! what `diffmon check-config` must say about it, and in `# env: NAME=VALUE` lines the
//! environment it runs in. Every case must exit 2 with an error that names the file and
//! contains each expected text (a key path, the bad value, the reason); no `# env:` value may
//! appear in the error (they are secrets). And a history whose checkpoint names are hostile
//! (an escape sequence, a newline) replayed to the terminal.

use crate::common::{diffmon, root, stderr, stdout};
use std::fs;
use std::path::PathBuf;
use std::process::Command;

struct Case {
    path: PathBuf,
    expect: Vec<String>,
    env: Vec<(String, String)>,
}

fn cases() -> Vec<Case> {
    let mut cases: Vec<Case> = fs::read_dir(root().join("tests/bad_configs"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .map(|path| {
            let text = fs::read_to_string(&path).unwrap();
            let tagged = |tag: &str| -> Vec<String> {
                text.lines()
                    .filter_map(|l| l.strip_prefix(tag))
                    .map(str::to_string)
                    .collect()
            };
            let env = tagged("# env: ")
                .iter()
                .map(|l| {
                    let (k, v) = l.split_once('=').expect("# env: NAME=VALUE");
                    (k.to_string(), v.to_string())
                })
                .collect();
            Case {
                expect: tagged("# expect: "),
                env,
                path,
            }
        })
        .collect();
    cases.sort_by(|a, b| a.path.cmp(&b.path));
    cases
}

#[test]
fn every_invalid_config_is_refused_with_the_expected_message() {
    let cases = cases();
    assert!(cases.len() >= 30, "only {} cases", cases.len());
    // The files the valid parts of the configs name (their content is not read by check-config).
    let dir = tempfile::tempdir().unwrap();
    for f in ["model.ts", "train.h5"] {
        fs::write(dir.path().join(f), b"").unwrap();
    }
    let mut failures = Vec::new();
    for Case { path, expect, env } in &cases {
        let name = path.file_name().unwrap().to_str().unwrap();
        assert!(!expect.is_empty(), "{name} has no `# expect:` line");
        let copy = dir.path().join(name);
        fs::copy(path, &copy).unwrap();
        // SAFETY of the check: the variable case 42 names must not exist in this environment.
        assert!(std::env::var_os("DIFFMON_TEST_UNSET_SECRET").is_none());
        // Run from the folder, as a user would: paths in errors stay as the file wrote them.
        let out = Command::new(env!("CARGO_BIN_EXE_diffmon"))
            .args(["check-config", name])
            .envs(env.iter().map(|(k, v)| (k, v)))
            .current_dir(dir.path())
            .output()
            .unwrap();
        let err = stderr(&out);
        let mut problems = Vec::new();
        if out.status.code() != Some(2) {
            problems.push(format!("exit code {:?}, not 2", out.status.code()));
        }
        if !err.starts_with(&format!("error: {name}")) {
            problems.push("the error does not start by naming the file".to_string());
        }
        for e in expect {
            if !err.contains(e.as_str()) {
                problems.push(format!("missing `{e}`"));
            }
        }
        for (var, value) in env {
            if err.contains(value.as_str()) {
                problems.push(format!("the value of {var} is shown"));
            }
        }
        if !problems.is_empty() {
            failures.push(format!("{name}: {}\n{err}", problems.join("; ")));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// `diffmon replay` printed the best checkpoint's name raw: an escape sequence and a newline in
/// a name chosen by whoever writes `run.dir` reached the operator's terminal. It is escaped as in
/// the logs; `--json` keeps the real name (JSON escapes it).
#[test]
fn replay_prints_a_hostile_checkpoint_name_escaped() {
    let dir = tempfile::tempdir().unwrap();
    for f in ["model.ts", "train.h5"] {
        fs::write(dir.path().join(f), b"").unwrap();
    }
    let config = dir.path().join("diffmon.yaml");
    fs::write(
        &config,
        "run: {dir: .}\nmodel: {architecture: model.ts}\ndata: {path: train.h5}\n\
         early_stop: {confirm: none}\n",
    )
    .unwrap();
    let state = dir.path().join(".diffmon");
    fs::create_dir_all(&state).unwrap();
    let name = "ckpt_\x1b[31m\nFORGED line.pt";
    let lines: String = (0..12i64)
        .map(|i| {
            let step = 50 * (i + 1);
            let icr = 0.8 + 0.0004 * ((i - 5) * (i - 5)) as f64;
            let line = serde_json::json!({
                "kind": "evaluation",
                "key": {"path": format!("{name}{step}"), "size": 1, "mtime_ns": step},
                "at": "2026-01-01T00:00:00.000Z",
                "record": {"step": step, "checkpoint": format!("{name}{step}"), "icr": icr,
                           "seconds": 1.0},
            });
            format!("{line}\n")
        })
        .collect();
    fs::write(state.join("history.jsonl"), lines).unwrap();
    let out = diffmon(&["replay", "--config", config.to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    assert!(text.contains("best step"), "{text}");
    assert!(
        !text.contains('\x1b'),
        "an escape sequence reached stdout:\n{text}"
    );
    assert!(
        !text.lines().any(|l| l.starts_with("FORGED")),
        "a newline reached stdout:\n{text}"
    );
    assert!(text.contains("ckpt_\\u{1b}[31m\\nFORGED line.pt"), "{text}");
    let out = diffmon(&["replay", "--config", config.to_str().unwrap(), "--json"]);
    let last = stdout(&out).lines().last().unwrap().to_string();
    let summary: serde_json::Value = serde_json::from_str(&last).unwrap();
    assert!(
        summary["best_checkpoint"]
            .as_str()
            .unwrap()
            .starts_with(name),
        "{summary}"
    );
}
