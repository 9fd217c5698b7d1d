//! The corpus of invalid configs in `tests/bad_configs/`: each file states, in `# expect:` lines,
//! what `diffmon check-config` must say about it, and in `# env: NAME=VALUE` lines the
//! environment it runs in. Every case must exit 2 with an error that names the file and
//! contains each expected text (a key path, the bad value, the reason); no `# env:` value may
//! appear in the error (they are secrets).

use crate::common::{root, stderr};
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
