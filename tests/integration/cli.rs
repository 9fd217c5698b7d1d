//! The binary's commands, exit codes and messages.

use crate::common::{diffmon, fixtures, root, stderr, stdout, toy_run};
use std::fs;
use std::path::Path;
use std::process::{Command, Output};

/// A run folder with the files `diffmon init --run-dir` refers to.
fn run_dir() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let f = fixtures();
    fs::copy(f.join("arch.ts"), dir.path().join("model.ts")).unwrap();
    fs::copy(f.join("data_f32.h5"), dir.path().join("train.h5")).unwrap();
    fs::copy(f.join("data_u8_nchw.h5"), dir.path().join("heldout.h5")).unwrap();
    dir
}

/// `diffmon ARGS` run in `cwd`.
fn diffmon_in(cwd: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_diffmon"))
        .args(args)
        .current_dir(cwd)
        .env("DIFFMON_LOG", "warn")
        .output()
        .expect("run diffmon")
}

/// `diffmon init --run-dir RUN` (run in `cwd`) written to `config` as printed, then
/// `diffmon check-config --config CONFIG` (run in `cwd`): its stdout, asserting both succeed.
fn init_then_check(cwd: &Path, run: &str, config: &Path) -> String {
    let out = diffmon_in(cwd, &["init", "--run-dir", run]);
    assert!(out.status.success(), "{}", stderr(&out));
    fs::write(config, stdout(&out)).unwrap();
    let check = diffmon_in(cwd, &["check-config", "--config", config.to_str().unwrap()]);
    assert!(
        check.status.success(),
        "check-config of what init printed:\n{}\n{}",
        stderr(&check),
        stdout(&out)
    );
    stdout(&check)
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

#[test]
fn init_without_heldout_data_passes_check_config() {
    let dir = run_dir();
    fs::remove_file(dir.path().join("heldout.h5")).unwrap();
    let elsewhere = tempfile::tempdir().unwrap();
    let config = elsewhere.path().join("diffmon.yaml");
    let check = init_then_check(elsewhere.path(), dir.path().to_str().unwrap(), &config);
    let text = fs::read_to_string(&config).unwrap();
    assert!(
        text.lines().any(|l| l.starts_with("  # heldout_path: ")),
        "{text}"
    );
    assert!(
        !text.lines().any(|l| l.starts_with("  heldout_path:")),
        "{text}"
    );
    let name = dir.path().file_name().unwrap().to_str().unwrap();
    assert!(check.contains(&format!("(run `{name}`")), "{check}");
}

#[test]
fn init_of_a_relative_run_folder_names_the_run_after_it() {
    // The README's workflow: `diffmon init --run-dir runs/NAME > diffmon.yaml`, in the folder
    // holding runs/; the example's own run folder, runs/demo; a name YAML would misread plain.
    for name in ["exp1", "demo", "exp #2: [a]"] {
        let top = tempfile::tempdir().unwrap();
        let run = top.path().join("runs").join(name);
        fs::create_dir_all(&run).unwrap();
        for f in ["model.ts", "train.h5", "heldout.h5"] {
            fs::copy(run_dir().path().join(f), run.join(f)).unwrap();
        }
        let config = top.path().join("diffmon.yaml");
        let check = init_then_check(top.path(), &format!("runs/{name}"), &config);
        assert!(check.contains(&format!("(run `{name}`")), "{check}");
        let text = fs::read_to_string(&config).unwrap();
        assert!(text.contains(&format!("  # name: {name} ")), "{text}");
        if name != "exp #2: [a]" {
            assert!(text.contains(&format!("  dir: runs/{name} ")), "{text}");
            let heldout = format!("  heldout_path: runs/{name}/heldout.h5");
            assert!(text.contains(&heldout), "{text}");
        }

        // From inside the run folder, `--run-dir .`: the name is still the folder's.
        let config = run.join("diffmon.yaml");
        let check = init_then_check(&run, ".", &config);
        assert!(check.contains(&format!("(run `{name}`")), "{check}");
        let text = fs::read_to_string(&config).unwrap();
        assert!(text.contains(&format!("  # name: {name} ")), "{text}");
    }
}

#[test]
fn init_of_a_toy_training_run_passes_check_config() {
    let toy = toy_run();
    let out = diffmon(&["init", "--run-dir", toy.to_str().unwrap()]);
    let found = stderr(&out);
    assert!(
        found.contains("checkpoint files (steps 30 to 60)"),
        "{found}"
    );
    assert!(found.contains("architecture: "), "{found}");
    let elsewhere = tempfile::tempdir().unwrap();
    let config = elsewhere.path().join("diffmon.yaml");
    let check = init_then_check(elsewhere.path(), toy.to_str().unwrap(), &config);
    let name = toy.file_name().unwrap().to_str().unwrap();
    assert!(check.contains(&format!("(run `{name}`")), "{check}");
}

/// The sections cited as `README, "Section"` in `text`; any other mention of the README is
/// returned as an error, so that every citation can be checked.
fn cited_sections(text: &str) -> Result<Vec<String>, String> {
    let mut sections = Vec::new();
    for (i, _) in text.match_indices("README") {
        let rest = &text[i + "README".len()..];
        let section = rest
            .strip_prefix(", \"")
            .and_then(|r| r.split_once('"'))
            .map(|(s, _)| s.to_string())
            .ok_or_else(|| {
                let line = text[..i].rsplit('\n').next().unwrap_or("");
                let end = rest.split('\n').next().unwrap_or("");
                format!("`{line}README{end}` does not cite a section as README, \"Section\"")
            })?;
        sections.push(section);
    }
    Ok(sections)
}

#[test]
fn readme_sections_cited_by_the_config_and_init_exist() {
    let readme = fs::read_to_string(root().join("README.md")).unwrap();
    let headings: Vec<&str> = readme
        .lines()
        .filter_map(|l| l.strip_prefix("## ").or_else(|| l.strip_prefix("### ")))
        .map(str::trim)
        .collect();
    let example = fs::read_to_string(root().join("config/diffmon.example.yaml")).unwrap();
    let empty = tempfile::tempdir().unwrap();
    let full = run_dir();
    let mut texts = vec![("config/diffmon.example.yaml".to_string(), example)];
    for args in [
        vec!["init"],
        vec!["init", "--run-dir", empty.path().to_str().unwrap()],
        vec!["init", "--run-dir", full.path().to_str().unwrap()],
        vec!["init", "--run-dir", "/nonexistent/run"],
        vec!["--help"],
    ] {
        let out = diffmon(&args);
        assert!(out.status.success(), "{args:?}: {}", stderr(&out));
        texts.push((format!("{args:?}"), stdout(&out) + &stderr(&out)));
    }
    let mut cited = 0;
    for (what, text) in &texts {
        let sections = cited_sections(text).unwrap_or_else(|e| panic!("{what}: {e}"));
        for section in sections {
            assert!(
                headings.contains(&section.as_str()),
                "{what} cites README section \"{section}\", which is not a heading of README.md ({headings:?})"
            );
            cited += 1;
        }
    }
    // The example cites two, init's notes for an empty folder two more, --help one.
    assert!(cited >= 5, "{cited}");
}

#[test]
fn a_citation_not_in_the_form_is_refused() {
    assert_eq!(
        cited_sections("a (README, \"The early stop\") b README, \"X\""),
        Ok(vec!["The early stop".to_string(), "X".to_string()])
    );
    assert!(cited_sections("# required: the model contract (README)").is_err());
}

/// A config in `dir` naming files that exist (empty: nothing is loaded), plus `extra`.
fn config_with(dir: &Path, extra: &str) -> std::path::PathBuf {
    for f in ["model.ts", "train.h5", "heldout.h5"] {
        fs::write(dir.join(f), b"").unwrap();
    }
    let config = dir.join("diffmon.yaml");
    let data = if extra.contains("data:") {
        ""
    } else {
        "data: {path: train.h5}\n"
    };
    fs::write(
        &config,
        format!("run: {{dir: .}}\nmodel: {{architecture: model.ts}}\n{data}{extra}"),
    )
    .unwrap();
    config
}

/// `check-config` says which signal confirms the early stop, what it can and cannot tell
/// apart, and what the memorization ratio that `confirm: auto` turns on without a held-out set
/// costs.
#[test]
fn check_config_says_what_the_early_stop_can_tell_apart() {
    let check = |extra: &str| {
        let dir = tempfile::tempdir().unwrap();
        let config = config_with(dir.path(), extra);
        let out = diffmon(&["check-config", config.to_str().unwrap()]);
        assert!(out.status.success(), "{}", stderr(&out));
        stdout(&out)
    };
    let auto = check("");
    assert!(
        auto.contains("confirmed by the memorization ratio (early_stop.confirm: auto"),
        "{auto}"
    );
    assert!(
        auto.contains("memorization ratio 4480 (35 x 128 latents, every checkpoint"),
        "{auto}"
    );
    let gap = check("data: {path: train.h5, heldout_path: heldout.h5}\n");
    assert!(gap.contains("confirmed by the generalization gap"), "{gap}");
    assert!(!gap.contains("memorization ratio 4480"), "{gap}");
    let none = check("early_stop: {confirm: none}\n");
    assert!(
        none.contains("unconfirmed (early_stop.confirm: none)"),
        "{none}"
    );
    assert!(
        !none.contains("PFD") && !none.contains("memorization ratio 4480"),
        "{none}"
    );
}
