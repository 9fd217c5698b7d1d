//! The binary's commands, exit codes and messages.

use crate::common::{diffmon, fixtures, stderr, stdout};
use std::fs;

/// A run folder with the files `diffmon init --run-dir` refers to.
fn run_dir() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let f = fixtures();
    fs::copy(f.join("arch.ts"), dir.path().join("model.ts")).unwrap();
    fs::copy(f.join("data_f32.h5"), dir.path().join("train.h5")).unwrap();
    fs::copy(f.join("data_u8_nchw.h5"), dir.path().join("heldout.h5")).unwrap();
    dir
}

#[test]
fn init_output_passes_check_config() {
    let dir = run_dir();
    let out = diffmon(&["init", "--run-dir", dir.path().to_str().unwrap()]);
    assert!(out.status.success());
    let config = dir.path().join("diffmon.yaml");
    fs::write(&config, stdout(&out)).unwrap();
    let out = diffmon(&["check-config", config.to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stdout(&out).contains(": ok"), "{}", stdout(&out));
}

#[test]
fn typo_key_fails_with_line_and_column_and_exit_2() {
    let dir = run_dir();
    let config = dir.path().join("bad.yaml");
    fs::write(
        &config,
        "run:\n  dir: .\nmodel:\n  architecture: model.ts\ndata:\n  path: train.h5\nicr:\n  samles: 10\n",
    )
    .unwrap();
    let out = diffmon(&["check-config", config.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2));
    let err = stderr(&out);
    assert!(
        err.contains(
            "bad.yaml: line 8, column 3: icr.samles: unknown field `samles`, expected one of"
        ),
        "{err}"
    );
}

#[test]
fn invalid_values_are_all_reported_with_exit_2() {
    let dir = run_dir();
    let config = dir.path().join("bad.yaml");
    fs::write(
        &config,
        "run: {dir: .}\nmodel: {architecture: nothere.ts}\ndata: {path: train.h5}\npfd: {samples: 0}\nearly_stop: {patience: 0}\n",
    )
    .unwrap();
    let out = diffmon(&["check-config", config.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2));
    let err = stderr(&out);
    assert!(err.contains("3 problems"), "{err}");
    assert!(err.contains("pfd.samples must be ≥ 1, got 0"), "{err}");
    assert!(
        err.contains("early_stop.patience must be ≥ 1, got 0"),
        "{err}"
    );
    assert!(
        err.contains("model.architecture names")
            && err.contains("nothere.ts, which does not exist"),
        "{err}"
    );
}

#[test]
fn usage_errors_exit_2_and_missing_config_file_is_named() {
    let out = diffmon(&["eval"]);
    assert_eq!(out.status.code(), Some(2));
    let out = diffmon(&["check-config", "/nonexistent/diffmon.yaml"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains("/nonexistent/diffmon.yaml"),
        "{}",
        stderr(&out)
    );
}

#[test]
fn check_config_takes_config_like_the_bare_file() {
    let dir = run_dir();
    let config = dir.path().join("diffmon.yaml");
    let out = diffmon(&["init", "--run-dir", dir.path().to_str().unwrap()]);
    fs::write(&config, stdout(&out)).unwrap();
    let path = config.to_str().unwrap();
    let flag = diffmon(&["check-config", "--config", path]);
    let bare = diffmon(&["check-config", path]);
    assert!(flag.status.success(), "{}", stderr(&flag));
    assert!(stdout(&flag).contains(": ok"), "{}", stdout(&flag));
    assert_eq!(stdout(&flag), stdout(&bare));

    fs::write(&config, "run:\n  dir: .\nicr:\n  samles: 10\n").unwrap();
    let flag = diffmon(&["check-config", "--config", path]);
    let bare = diffmon(&["check-config", path]);
    assert_eq!(flag.status.code(), Some(2), "{}", stderr(&flag));
    assert_eq!(bare.status.code(), Some(2), "{}", stderr(&bare));
    assert!(stderr(&flag).contains("icr.samles"), "{}", stderr(&flag));
    assert_eq!(stderr(&flag), stderr(&bare));

    // Both at once, or neither: a usage error.
    let both = diffmon(&["check-config", path, "--config", path]);
    assert_eq!(both.status.code(), Some(2), "{}", stderr(&both));
    let neither = diffmon(&["check-config"]);
    assert_eq!(neither.status.code(), Some(2), "{}", stderr(&neither));
}
