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

/// A run folder with two exported architectures (`model.ts`, `unet/model.ts`): init chooses
/// none, lists both, asks for `--architecture` and writes nothing (exit 2); with it, the config
/// names that one and passes `check-config`, which prints `icr.sigma`'s signal-to-noise ratio.
#[test]
fn init_with_two_architectures_asks_which() {
    let dir = run_dir();
    let d = dir.path();
    fs::create_dir(d.join("unet")).unwrap();
    fs::copy(fixtures().join("arch.ts"), d.join("unet/model.ts")).unwrap();
    let config = d.join("diffmon.yaml");
    let out = diffmon_in(d, &["init", "--run-dir", ".", "--out", "diffmon.yaml"]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    for want in ["./model.ts", "./unet/model.ts", "--architecture"] {
        assert!(stderr(&out).contains(want), "{want}: {}", stderr(&out));
    }
    assert!(!config.exists(), "nothing written");

    let out = diffmon_in(
        d,
        &[
            "init",
            "--run-dir",
            ".",
            "--out",
            "diffmon.yaml",
            "--architecture",
            "./unet/model.ts",
        ],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let text = fs::read_to_string(&config).unwrap();
    assert!(text.contains("\n  architecture: unet/model.ts"), "{text}");
    assert!(text.contains("\ncpu_threads: "), "{text}");
    let check = diffmon_in(d, &["check-config", "--config", "diffmon.yaml"]);
    assert!(check.status.success(), "{}", stderr(&check));
    assert!(
        stdout(&check).contains("a signal-to-noise ratio of "),
        "{}",
        stdout(&check)
    );
    // Named relative to the current folder, the config's paths are still made absolute, the
    // same as through any other name of the file (the run folder was `.`, so its checkpoints
    // had other keys than through `--config /abs/diffmon.yaml`, and were all evaluated again).
    let canonical = fs::canonicalize(d).unwrap();
    let watching = format!("watching {}", canonical.display());
    assert!(stdout(&check).contains(&watching), "{}", stdout(&check));
    let parent = canonical.parent().unwrap();
    let name = canonical.file_name().unwrap().to_str().unwrap();
    let other = diffmon_in(parent, &["check-config", &format!("{name}/diffmon.yaml")]);
    assert!(stdout(&other).contains(&watching), "{}", stdout(&other));
}

#[test]
fn init_output_passes_check_config() {
    let dir = run_dir();
    let out = diffmon(&["init", "--run-dir", dir.path().to_str().unwrap()]);
    assert!(out.status.success());
    // Each file it filled in is named, with its key, on stderr and in the config's header.
    let d = dir.path().display();
    for filled in [
        format!("model.architecture: {d}/model.ts ("),
        format!("data.path: {d}/train.h5 ("),
        format!("data.heldout_path: {d}/heldout.h5 ("),
    ] {
        assert!(stderr(&out).contains(&filled), "{filled}: {}", stderr(&out));
        assert!(
            stdout(&out).contains(&format!("\n# {filled}")),
            "{filled}: {}",
            stdout(&out)
        );
    }
    let config = dir.path().join("diffmon.yaml");
    fs::write(&config, stdout(&out)).unwrap();
    let out = diffmon(&["check-config", config.to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stdout(&out).contains(": ok"), "{}", stdout(&out));
    // The device line names the threads the run will use (a number no machine's default is
    // likely to be).
    let text = fs::read_to_string(&config).unwrap();
    let threads = regex::Regex::new(r"(?m)^cpu_threads: \d+").unwrap();
    assert!(threads.is_match(&text), "{text}");
    fs::write(&config, threads.replace(&text, "cpu_threads: 7").as_ref()).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_diffmon"))
        .args(["check-config", config.to_str().unwrap()])
        .env("DIFFMON_LOG", "info")
        .output()
        .unwrap();
    assert!(
        stderr(&out).contains("; 7 CPU threads (cpu_threads)"),
        "{}",
        stderr(&out)
    );
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

/// `check-config` names what a sweep watches: its runs, and for `runs_glob` the glob and the
/// runs it matches now (none yet is valid).
#[test]
fn check_config_lists_a_sweeps_runs() {
    let dir = run_dir();
    let config = dir.path().join("diffmon.yaml");
    let check = || {
        let out = diffmon(&["check-config", config.to_str().unwrap()]);
        assert!(out.status.success(), "{}", stderr(&out));
        stdout(&out).lines().next().unwrap_or_default().to_string()
    };
    let shared = "model: {architecture: model.ts}\ndata: {path: train.h5}\n";
    for run in ["ra", "rb"] {
        fs::create_dir(dir.path().join(run)).unwrap();
    }
    fs::write(
        &config,
        format!("runs: [{{name: a, dir: ra}}, {{name: b, dir: rb}}]\n{shared}"),
    )
    .unwrap();
    assert!(
        check().ends_with("ok (a sweep of 2 runs: `a`, `b`)"),
        "{}",
        check()
    );
    fs::write(&config, format!("runs_glob: sweep/lr-*\n{shared}")).unwrap();
    fs::create_dir(dir.path().join("sweep")).unwrap();
    assert!(check().ends_with("runs now: none yet)"), "{}", check());
    fs::create_dir(dir.path().join("sweep/lr-1")).unwrap();
    assert!(check().ends_with("runs now: `lr-1`)"), "{}", check());
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
    // The header says so, naming the key.
    assert!(
        text.contains("found: data.heldout_path is left out"),
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
            // On stdout the config's place is unknown: absolute paths.
            let abs = run.display();
            assert!(text.contains(&format!("  dir: {abs} ")), "{text}");
            let heldout = format!("  heldout_path: {abs}/heldout.h5");
            assert!(text.contains(&heldout), "{text}");
            // With --out, relative to the file's folder (here the same as the working folder).
            let file = top.path().join("out.yaml");
            let out = diffmon_in(
                top.path(),
                &[
                    "init",
                    "--run-dir",
                    &format!("runs/{name}"),
                    "--out",
                    "out.yaml",
                ],
            );
            assert!(out.status.success(), "{}", stderr(&out));
            let text = fs::read_to_string(&file).unwrap();
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
fn init_config_saved_in_another_folder_passes_check_config() {
    // Issue #31's report: `diffmon init --run-dir exp1 > conf/diffmon.yaml` wrote `exp1`,
    // which the config then read as conf/exp1.
    let top = tempfile::tempdir().unwrap();
    let run = top.path().join("exp1");
    fs::create_dir_all(&run).unwrap();
    fs::create_dir_all(top.path().join("conf")).unwrap();
    for f in ["model.ts", "train.h5", "heldout.h5"] {
        fs::copy(run_dir().path().join(f), run.join(f)).unwrap();
    }
    let check = |config: &str| {
        let out = diffmon_in(top.path(), &["check-config", config]);
        assert!(
            out.status.success(),
            "{}\n{}",
            stderr(&out),
            fs::read_to_string(top.path().join(config)).unwrap()
        );
        assert!(stdout(&out).contains("(run `exp1`"), "{}", stdout(&out));
    };
    // As the issue wrote it, through the shell.
    let shell = Command::new("sh")
        .current_dir(top.path())
        .arg("-c")
        .arg(format!(
            "'{}' init --run-dir exp1 > conf/diffmon.yaml",
            env!("CARGO_BIN_EXE_diffmon")
        ))
        .output()
        .unwrap();
    assert!(shell.status.success(), "{}", stderr(&shell));
    check("conf/diffmon.yaml");
    // --out: relative paths, from the file's folder.
    let out = diffmon_in(
        top.path(),
        &["init", "--run-dir", "exp1", "--out", "conf/out.yaml"],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let text = fs::read_to_string(top.path().join("conf/out.yaml")).unwrap();
    assert!(text.contains("  dir: ../exp1 "), "{text}");
    assert!(text.contains("  architecture: ../exp1/model.ts"), "{text}");
    check("conf/out.yaml");
    // An existing file is never overwritten: exit 2, naming it, and the file unchanged.
    let again = diffmon_in(
        top.path(),
        &["init", "--run-dir", "exp1", "--out", "conf/out.yaml"],
    );
    assert_eq!(again.status.code(), Some(2), "{}", stderr(&again));
    assert!(
        stderr(&again).contains("conf/out.yaml: the file exists"),
        "{}",
        stderr(&again)
    );
    assert_eq!(
        fs::read_to_string(top.path().join("conf/out.yaml")).unwrap(),
        text
    );
}

#[test]
fn check_config_reports_a_run_folder_that_does_not_exist() {
    let top = tempfile::tempdir().unwrap();
    let run = top.path().join("exp1");
    fs::create_dir_all(&run).unwrap();
    for f in ["model.ts", "train.h5"] {
        fs::copy(run_dir().path().join(f), run.join(f)).unwrap();
    }
    let config = top.path().join("diffmon.yaml");
    let write = |dir: &str| {
        fs::write(
            &config,
            format!(
                "run: {{dir: {dir}}}\nmodel: {{architecture: exp1/model.ts}}\ndata: {{path: exp1/train.h5}}\n"
            ),
        )
        .unwrap()
    };
    write("exp1");
    let ok = diffmon(&["check-config", config.to_str().unwrap()]);
    assert!(ok.status.success(), "{}", stderr(&ok));
    write("exp2");
    let out = diffmon(&["check-config", config.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    let missing = top.path().join("exp2");
    let expected = format!("run.dir names {}, which does not exist", missing.display());
    assert!(stderr(&out).contains(&expected), "{}", stderr(&out));
    assert!(!missing.exists(), "check-config created the folder");
    // A sweep's runs, each by its key.
    fs::write(
        &config,
        "runs:\n  - {name: a, dir: exp1}\n  - {name: b, dir: nowhere}\nmodel: {architecture: exp1/model.ts}\ndata: {path: exp1/train.h5}\n",
    )
    .unwrap();
    let out = diffmon(&["check-config", config.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("runs[1].dir names"),
        "{}",
        stderr(&out)
    );
    assert!(!stderr(&out).contains("runs[0].dir"), "{}", stderr(&out));
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

/// The sections cited in `text`, as (file, section): `README, "Section"` (README.md) and
/// `docs/guide/NAME.md, "Section"` (a page of the user guide). Any other mention of the README
/// or of a guide page is returned as an error, so that every citation can be checked.
fn cited_sections(text: &str) -> Result<Vec<(String, String)>, String> {
    let mut sections = Vec::new();
    let mut mentions: Vec<(usize, &str)> = text.match_indices("README").collect();
    mentions.extend(text.match_indices("docs/guide/"));
    mentions.sort();
    for (i, what) in mentions {
        let rest = &text[i + what.len()..];
        let (file, rest) = if what == "README" {
            (Some("README.md".to_string()), rest)
        } else {
            match rest.split_once(".md") {
                Some((name, after))
                    if !name.is_empty()
                        && name
                            .chars()
                            .all(|c| c.is_ascii_alphanumeric() || "-_".contains(c)) =>
                {
                    (Some(format!("docs/guide/{name}.md")), after)
                }
                _ => (None, rest),
            }
        };
        let section = file.as_ref().and_then(|_| {
            rest.strip_prefix(", \"")
                .and_then(|r| r.split_once('"'))
                .map(|(s, _)| s.to_string())
                .filter(|s| !s.contains('\n'))
        });
        match (file, section) {
            (Some(file), Some(section)) => sections.push((file, section)),
            _ => {
                let line = text[..i].rsplit('\n').next().unwrap_or("");
                let end = rest.split('\n').next().unwrap_or("");
                return Err(format!(
                    "`{line}{what}{end}` does not cite a section as README, \"Section\" or \
                     docs/guide/NAME.md, \"Section\""
                ));
            }
        }
    }
    Ok(sections)
}

/// The headings of the Markdown file `file` (relative to the repository): for README.md its
/// sections (`##`, `###`), for a guide page every heading.
fn headings_of(file: &str) -> Option<Vec<String>> {
    let text = fs::read_to_string(root().join(file)).ok()?;
    let mut in_code = false;
    let mut out = Vec::new();
    for line in text.lines() {
        if line.starts_with("```") {
            in_code = !in_code;
        }
        if in_code {
            continue;
        }
        let heading = if file == "README.md" {
            line.strip_prefix("## ")
                .or_else(|| line.strip_prefix("### "))
        } else {
            line.trim_start_matches('#')
                .strip_prefix(' ')
                .filter(|_| line.starts_with('#'))
        };
        out.extend(heading.map(|h| h.trim().to_string()));
    }
    Some(out)
}

#[test]
fn readme_sections_cited_by_the_config_and_init_exist() {
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
        for (file, section) in sections {
            let headings = headings_of(&file)
                .unwrap_or_else(|| panic!("{what} cites {file}, which does not exist"));
            assert!(
                headings.contains(&section),
                "{what} cites {file}, \"{section}\", which is not a heading of it ({headings:?})"
            );
            cited += 1;
        }
    }
    // The example cites five, init's notes for an empty folder two more, --help one.
    assert!(cited >= 8, "{cited}");
}

#[test]
fn a_citation_not_in_the_form_is_refused() {
    let cite = |file: &str, section: &str| (file.to_string(), section.to_string());
    assert_eq!(
        cited_sections(
            "a (README, \"The early stop\") b README, \"X\" c docs/guide/early-stop.md, \"Y\""
        ),
        Ok(vec![
            cite("README.md", "The early stop"),
            cite("README.md", "X"),
            cite("docs/guide/early-stop.md", "Y")
        ])
    );
    assert!(cited_sections("# required: the model contract (README)").is_err());
    assert!(cited_sections("see docs/guide/early-stop.md for more").is_err());
    assert!(cited_sections("see docs/guide/, \"Y\"").is_err());
    assert!(cited_sections("docs/guide/x.md, \"two\nlines\"").is_err());
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

/// A state folder whose journal holds a U-curve of 20 checkpoints (its minimum at step 500) and
/// one failure, as `diffmon watch` writes it.
fn recorded_history(dir: &Path) {
    let state = dir.join(".diffmon");
    fs::create_dir_all(&state).unwrap();
    let mut lines = Vec::new();
    for i in 0..20i64 {
        let step = 50 * (i + 1);
        let icr = 0.8 + 0.0004 * ((i - 9) * (i - 9)) as f64;
        lines.push(serde_json::json!({
            "kind": "evaluation",
            "key": {"path": format!("{}/ckpt_{step}.pt", dir.display()), "size": 1, "mtime_ns": step},
            "at": "2026-01-01T00:00:00.000Z",
            "record": {"step": step, "checkpoint": format!("{}/ckpt_{step}.pt", dir.display()),
                       "icr": icr, "seconds": 1.0},
        }));
        if i == 4 {
            lines.push(serde_json::json!({
                "kind": "failure",
                "key": {"path": "x", "size": 1, "mtime_ns": 1},
                "at": "2026-01-01T00:00:00.000Z",
                "step": 251, "reason": "unreadable", "message": "m",
            }));
        }
    }
    let text: String = lines.iter().map(|l| format!("{l}\n")).collect();
    fs::write(state.join("history.jsonl"), text).unwrap();
}

#[test]
fn replay_prints_what_the_detector_decides_over_a_recorded_history() {
    let dir = tempfile::tempdir().unwrap();
    let config = config_with(dir.path(), "early_stop: {confirm: none}\n");
    let config = config.to_str().unwrap();
    // No history yet: a runtime failure naming the journal.
    let out = diffmon(&["replay", "--config", config]);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("history.jsonl: no history"),
        "{}",
        stderr(&out)
    );

    recorded_history(dir.path());
    let replay = |set: &[&str]| -> Vec<serde_json::Value> {
        let mut args = vec!["replay", "--config", config, "--json"];
        for s in set {
            args.extend(["--set", s]);
        }
        let out = diffmon(&args);
        assert!(out.status.success(), "{}", stderr(&out));
        stdout(&out)
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    };
    let lines = replay(&[]);
    assert_eq!(lines.len(), 21);
    let summary = &lines[20];
    assert_eq!(summary["kind"], "summary");
    assert_eq!(summary["evaluations"], 20);
    assert_eq!(summary["failures"], 1);
    // The smoothed minimum is 0.8004 (from step 500, the median of steps 450 to 550, naming
    // step 450); the parabola has no scatter, so the threshold is min_rise · 0.8004; the
    // smoothed value clears it at step 750 (0.8064) and again at 800 (patience 2).
    assert_eq!(summary["fired"], true);
    assert_eq!(summary["fired_at_step"], 800);
    assert_eq!(summary["best_step"], 450);
    assert_eq!(summary["settings"]["confirm"], "none");
    assert_eq!(summary["settings"]["noise_multiple"], 6.0);
    let row = &lines[15];
    assert_eq!(
        (row["kind"].as_str(), row["step"].as_i64()),
        (Some("checkpoint"), Some(800))
    );
    assert_eq!(row["decision"], "early_stop");
    assert!(row["noise"].as_f64().unwrap() < 1e-9, "{row}");
    assert!(
        (row["threshold"].as_f64().unwrap() - 0.005 * 0.8004).abs() < 1e-12,
        "{row}"
    );

    // Overrides on the command line: a larger min_rise does not fire within the history.
    let lines = replay(&["early_stop.min_rise=0.5"]);
    assert_eq!(lines[20]["fired"], false);
    assert_eq!(lines[20]["fired_at_step"], serde_json::Value::Null);
    // `confirm: auto` without a held-out set is the memorization ratio, which this history
    // does not have: the turn is seen, never confirmed.
    let lines = replay(&["early_stop.confirm=auto"]);
    assert_eq!(lines[20]["fired"], false);
    assert_eq!(lines[20]["turned_at_step"], 800);
    assert_eq!(lines[20]["settings"]["confirm"], "memorization_ratio");
    assert_eq!(lines[15]["decision"], "unconfirmed");
    assert_eq!(lines[14]["decision"], "above");

    // For people: a table and a summary.
    let out = diffmon(&[
        "replay",
        "--config",
        config,
        "--set",
        "early_stop.confirm=auto",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    assert!(text.contains("threshold  decision"), "{text}");
    assert!(text.contains("turned, unconfirmed"), "{text}");
    assert!(text.contains("did not fire: best step 450"), "{text}");
    assert!(
        text.contains("the history has no memorization_ratio"),
        "{text}"
    );

    // A bad override is a usage error naming the key.
    for (set, says) in [
        (
            "early_stop.patience=0",
            "early_stop.patience must be ≥ 1, got 0",
        ),
        ("early_stop.windw=3", "unknown field `windw`"),
        ("icr.samples=3", "only early_stop keys can be set"),
    ] {
        let out = diffmon(&["replay", "--config", config, "--set", set]);
        assert_eq!(out.status.code(), Some(2), "{set}: {}", stderr(&out));
        assert!(stderr(&out).contains(says), "{set}: {}", stderr(&out));
    }
}

/// `diffmon ARGS` whose standard output is a pipe whose reader has already gone (closed before
/// the command starts, as when `| head -1` has read its line and exited): every write to it
/// fails with EPIPE.
fn diffmon_into_closed_pipe(args: &[&str]) -> Output {
    let (reader, writer) = std::io::pipe().unwrap();
    drop(reader);
    Command::new(env!("CARGO_BIN_EXE_diffmon"))
        .args(args)
        .env("DIFFMON_LOG", "warn")
        .stdout(writer)
        .output()
        .expect("run diffmon")
}

/// A command whose reader has gone ends quietly with status 0: no panic, no error message.
fn assert_quiet_exit(out: &Output, what: &str) {
    let err = stderr(out);
    assert_eq!(out.status.code(), Some(0), "{what}: {err}");
    for said in ["panicked", "Broken pipe", "error:"] {
        assert!(!err.contains(said), "{what} says `{said}`: {err}");
    }
}

#[test]
fn a_closed_stdout_ends_each_command_quietly() {
    let run = run_dir();
    let init = diffmon(&["init", "--run-dir", run.path().to_str().unwrap()]);
    assert!(init.status.success(), "{}", stderr(&init));
    let config = run.path().join("diffmon.yaml");
    fs::write(&config, stdout(&init)).unwrap();
    let config = config.to_str().unwrap();
    let history = tempfile::tempdir().unwrap();
    let replayed = config_with(history.path(), "early_stop: {confirm: none}\n");
    recorded_history(history.path());
    let replayed = replayed.to_str().unwrap();
    let report = history.path().join("report.svg");
    let commands: [&[&str]; 8] = [
        &["check-config", config],
        &["check-config", "--config", config],
        &["init"],
        &["init", "--run-dir", run.path().to_str().unwrap()],
        &["replay", "--config", replayed],
        &["replay", "--config", replayed, "--json"],
        &[
            "report",
            "--config",
            replayed,
            "--out",
            report.to_str().unwrap(),
        ],
        &["--help"],
    ];
    for args in commands {
        assert_quiet_exit(&diffmon_into_closed_pipe(args), &args.join(" "));
    }
    assert!(report.is_file(), "the report was written before its path");
}

/// The reader reads the first line, then closes the pipe while `init` is still writing: a
/// one-page pipe holds less than the example config, so the rest meets the closed pipe.
#[test]
fn init_stops_quietly_when_its_reader_stops_after_one_line() {
    use std::io::Read;
    use std::os::fd::AsRawFd;
    let (mut reader, writer) = std::io::pipe().unwrap();
    // SAFETY: fcntl on a pipe this test owns.
    let size = unsafe { libc::fcntl(writer.as_raw_fd(), libc::F_SETPIPE_SZ, 4096) };
    assert!(
        (4096..8192).contains(&size),
        "pipe size {size}: {}",
        std::io::Error::last_os_error()
    );
    let child = Command::new(env!("CARGO_BIN_EXE_diffmon"))
        .arg("init")
        .stdout(writer)
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut first = Vec::new();
    let mut byte = [0u8];
    while first.last() != Some(&b'\n') {
        reader.read_exact(&mut byte).unwrap();
        first.push(byte[0]);
    }
    assert!(
        first.starts_with(b"#"),
        "{}",
        String::from_utf8_lossy(&first)
    );
    drop(reader);
    let out = child.wait_with_output().unwrap();
    assert_quiet_exit(&out, "init");
}

/// As people run it: `bash -o pipefail` fails the pipeline if diffmon's status is not 0.
#[test]
fn check_config_piped_into_head_exits_0() {
    let run = run_dir();
    let init = diffmon(&["init", "--run-dir", run.path().to_str().unwrap()]);
    let config = run.path().join("diffmon.yaml");
    fs::write(&config, stdout(&init)).unwrap();
    let out = Command::new("bash")
        .args([
            "-o",
            "pipefail",
            "-c",
            "\"$0\" check-config \"$1\" | head -1",
        ])
        .arg(env!("CARGO_BIN_EXE_diffmon"))
        .arg(&config)
        .env("DIFFMON_LOG", "warn")
        .output()
        .unwrap();
    assert_quiet_exit(&out, "check-config | head -1");
    assert!(stdout(&out).contains(": ok ("), "{}", stdout(&out));
    assert_eq!(stdout(&out).lines().count(), 1, "{}", stdout(&out));
}

/// `watch` whose standard output's reader has gone runs on (its console lines are best effort):
/// it evaluates each checkpoint, printing its summary line into the closed pipe, and ends on
/// SIGTERM with status 0. Before, the first summary line panicked the daemon (status 1).
#[test]
fn watch_runs_on_when_its_stdout_is_closed() {
    use crate::daemon::{empty_run, free_port, journal};
    use std::time::{Duration, Instant};
    let run = empty_run();
    let dir = run.path();
    let port = free_port();
    let config = dir.join("diffmon.yaml");
    fs::write(
        &config,
        format!(
            "run: {{dir: ., name: test}}\nmodel: {{architecture: model.ts}}\ndevice: cpu\n\
             data: {{path: train.h5, heldout_path: heldout.h5}}\n\
             http: {{listen: \"127.0.0.1:{port}\"}}\nicr: {{samples: 256, batch_size: 256}}\n\
             checkpoints: {{pattern: \"ckpt_*.pt\", settle_secs: 0.2, poll_secs: 0.5}}\n"
        ),
    )
    .unwrap();
    let log = dir.join("watch.log");
    let (reader, writer) = std::io::pipe().unwrap();
    drop(reader);
    let mut child = Command::new(env!("CARGO_BIN_EXE_diffmon"))
        .args(["watch", "--config", config.to_str().unwrap()])
        .env("DIFFMON_LOG", "info")
        .stdin(std::process::Stdio::null())
        .stdout(writer)
        .stderr(fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let log = || fs::read_to_string(&log).unwrap_or_default();
    for (from, to) in [
        ("ckpt_000030.pt", "ckpt_000100.pt"),
        ("ckpt_000060.pt", "ckpt_000200.pt"),
    ] {
        let tmp = dir.join(format!("{to}.tmp"));
        fs::copy(toy_run().join(from), &tmp).unwrap();
        fs::rename(&tmp, dir.join(to)).unwrap();
    }
    // Both evaluations recorded: the recorder printed the first one's line before taking the
    // second. A daemon that exits meanwhile fails the test at once.
    let start = Instant::now();
    while journal(dir).0.len() < 2 {
        if let Some(status) = child.try_wait().unwrap() {
            panic!("the daemon exited ({status}):\n{}", log());
        }
        assert!(
            start.elapsed() < Duration::from_secs(300),
            "no two evaluations after 300 s:\n{}",
            log()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    // SAFETY: a signal to the child this test started.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let status = child.wait().unwrap();
    let log = log();
    assert_eq!(status.code(), Some(0), "{log}");
    assert!(!log.contains("panicked"), "{log}");
    assert_eq!(journal(dir).0, [100, 200], "{log}");
}
