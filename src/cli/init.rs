//! `diffmon init`: the annotated example config, and with `--run-dir DIR` one written for what a
//! training run has already saved there. The run folder is looked at, never written: its
//! checkpoints (files or folders, see [`crate::store::unit`]), their format, the step pattern, EMA
//! weights, an exported architecture (`*.ts` that is TorchScript and has no step) and HDF5 data.

use crate::config::{CheckpointsConfig, EXAMPLE};
use crate::store::unit;
use crate::weights::{self, CheckpointFormat};
use std::path::{Path, PathBuf};

/// Most entries of the run folder looked at.
const MAX_ENTRIES: usize = 10_000;

/// One checkpoint found in the run folder.
#[derive(Debug, Clone, PartialEq)]
pub struct Found {
    pub name: String,
    pub step: i64,
    pub is_dir: bool,
    /// The weights read, relative to the run folder.
    pub weights: String,
    /// The weights' format, or why they cannot be read.
    pub format: Result<CheckpointFormat, String>,
}

/// What `init --run-dir` saw.
#[derive(Debug, Default)]
pub struct Survey {
    pub checkpoints: Vec<Found>,
    /// The architecture the config names: the one candidate, or the one `--architecture` chose.
    pub architecture: Option<PathBuf>,
    /// Every exported architecture found: TorchScript `*.ts` files without a step, in the run
    /// folder or one level down in a folder without a step (`unet/model.ts`), autoencoders
    /// left out.
    pub architectures: Vec<PathBuf>,
    /// A latent model's autoencoder: a `*.ts` whose exporter note says `"kind": "vae"`.
    pub vae: Option<PathBuf>,
    pub train: Option<PathBuf>,
    pub heldout: Option<PathBuf>,
    /// A pattern matching exactly the checkpoints' names (digits as `*`), when they share one.
    pub pattern: Option<String>,
    /// The CPU cores this process may use (its affinity and CPU quota: a Slurm job's
    /// `--cpus-per-task`), from which `cpu_threads` is written ([`threads_beside_training`]).
    pub cores: Option<usize>,
    /// The folder held more than [`MAX_ENTRIES`] entries: the others were not looked at.
    pub cut: bool,
    /// Entries whose names are not UTF-8 (lossily shown), not looked at: a config cannot name
    /// them.
    pub not_utf8: Vec<String>,
    /// A folder of the run holding TensorBoard event files (in it or one or two levels down:
    /// `logs/`, `lightning_logs/`), the first by name: `trackers.tensorboard.dir`.
    pub tensorboard: Option<PathBuf>,
}

/// The `cpu_threads` init writes for a machine with `cores` cores: half of them, at least one,
/// so that a training job on the same machine keeps the other half (libtorch's default is one
/// thread per core, which competes with it).
pub fn threads_beside_training(cores: usize) -> usize {
    (cores / 2).max(1)
}

impl Survey {
    /// The checkpoints' weights come from diffusers EMA folders.
    pub fn ema_folders(&self) -> bool {
        self.checkpoints.iter().any(|f| f.weights.contains("_ema/"))
    }
}

/// `name` with every run of digits replaced by `*`.
fn generalize(name: &str) -> String {
    let mut out = String::new();
    let mut in_digits = false;
    for c in name.chars() {
        if c.is_ascii_digit() {
            if !in_digits {
                out.push('*');
            }
            in_digits = true;
        } else {
            in_digits = false;
            if matches!(c, '[' | ']' | '{' | '}' | '?' | '*' | '\\') {
                out.push('\\');
            }
            out.push(c);
        }
    }
    out
}

/// A TorchScript file named `*.ts`.
fn is_exported(name: &str, path: &Path) -> bool {
    name.ends_with(".ts")
        && std::fs::symlink_metadata(path).is_ok_and(|m| m.is_file())
        && matches!(
            weights::detect_format(path),
            Ok(CheckpointFormat::TorchScript)
        )
}

/// The exported architectures in a folder of the run folder without a step (`unet/model.ts`):
/// TorchScript `*.ts` files directly in it, autoencoders left out; at most [`MAX_ENTRIES`]
/// entries looked at.
fn exported_files_in(folder: &Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(folder) else {
        return Vec::new();
    };
    let mut found: Vec<PathBuf> = entries
        .take(MAX_ENTRIES)
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().to_str()?.to_string();
            let path = e.path();
            (!name.starts_with('.') && is_exported(&name, &path)).then_some(path)
        })
        .filter(|p| {
            !crate::engine::model::export_note(p).is_ok_and(|n| n.is_some_and(|n| n.is_vae()))
        })
        .collect();
    found.sort();
    found
}

/// Looks at `dir` with the default checkpoint settings.
pub fn survey(dir: &Path) -> std::io::Result<Survey> {
    let cfg = CheckpointsConfig::default();
    let mut s = Survey {
        cores: std::thread::available_parallelism().ok().map(|n| n.get()),
        ..Survey::default()
    };
    let mut listed = std::fs::read_dir(dir)?.flatten();
    let mut entries = Vec::new();
    for e in listed.by_ref().take(MAX_ENTRIES) {
        match e.file_name().to_str() {
            Some(name) if !name.starts_with('.') => entries.push((name.to_string(), e.path())),
            Some(_) => {}
            None => s
                .not_utf8
                .push(e.file_name().to_string_lossy().into_owned()),
        }
    }
    s.cut = listed.next().is_some();
    entries.sort();
    for (name, path) in entries {
        let is_dir = std::fs::symlink_metadata(&path).is_ok_and(|m| m.is_dir());
        let step = cfg.step_regex.step_in(&name);
        if !is_dir && name.ends_with(".h5") {
            let slot = if name.contains("heldout") || name.contains("val") {
                &mut s.heldout
            } else {
                &mut s.train
            };
            if slot.is_none() || name == "train.h5" {
                *slot = Some(path);
            }
            continue;
        }
        if is_dir && step.is_none() {
            // A folder without a step is no checkpoint; it may hold an export (`unet/model.ts`)
            // or the training job's TensorBoard logs.
            s.architectures.extend(exported_files_in(&path));
            if s.tensorboard.is_none() && holds_event_files(&path, 2) {
                s.tensorboard = Some(path);
            }
            continue;
        }
        if !cfg.pattern.is_match(&name) {
            continue;
        }
        if step.is_none() {
            if is_exported(&name, &path) {
                let is_vae = crate::engine::model::export_note(&path)
                    .is_ok_and(|n| n.is_some_and(|n| n.is_vae()));
                if is_vae {
                    s.vae.get_or_insert(path);
                } else {
                    s.architectures.push(path);
                }
            }
            continue;
        }
        let (weights, format) = match unit::weights_path(&path, &cfg) {
            Ok(w) => {
                let format = weights::detect_format(&w).map_err(|e| e.to_string());
                (w, format)
            }
            Err(e) => (path.clone(), Err(e.to_string())),
        };
        s.checkpoints.push(Found {
            name,
            step: step.unwrap_or_default(),
            is_dir,
            weights: weights
                .strip_prefix(dir)
                .unwrap_or(&weights)
                .display()
                .to_string(),
            format,
        });
    }
    if let [one] = s.architectures.as_slice() {
        s.architecture = Some(one.clone());
    }
    s.checkpoints.sort_by_key(|f| f.step);
    let mut globs: Vec<String> = s.checkpoints.iter().map(|f| generalize(&f.name)).collect();
    globs.dedup();
    globs.sort();
    globs.dedup();
    if globs.len() == 1 {
        s.pattern = globs.pop();
    }
    Ok(s)
}

/// Entries looked at per folder by [`holds_event_files`].
const MAX_LOG_ENTRIES: usize = 256;

/// Does `folder` hold a TensorBoard event file (`tfevents` in a regular file's name), in it or
/// up to `depth` levels down? Links are not followed; at most [`MAX_LOG_ENTRIES`] entries a
/// folder are looked at.
fn holds_event_files(folder: &Path, depth: usize) -> bool {
    let Ok(listed) = std::fs::read_dir(folder) else {
        return false;
    };
    let mut folders = Vec::new();
    for e in listed.flatten().take(MAX_LOG_ENTRIES) {
        let Ok(kind) = e.file_type() else { continue };
        if kind.is_file() && e.file_name().to_string_lossy().contains("tfevents") {
            return true;
        }
        if kind.is_dir() {
            folders.push(e.path());
        }
    }
    depth > 0 && folders.iter().any(|f| holds_event_files(f, depth - 1))
}

/// A sentence per finding, for the config's header and the terminal: the checkpoints, and each
/// key [`config_for`] fills in from the folder, named with its value (or why it was not found).
pub fn describe(dir: &Path, s: &Survey) -> Vec<String> {
    let mut out = Vec::new();
    if s.cut {
        out.push(format!(
            "the folder holds more than {MAX_ENTRIES} entries: only the first {MAX_ENTRIES} were looked at, so checkpoints may be missing below"
        ));
    }
    if !s.not_utf8.is_empty() {
        let (n, which) = match s.not_utf8.len() {
            1 => (1, "entry whose name is not UTF-8 was"),
            n => (n, "entries whose names are not UTF-8 were"),
        };
        out.push(format!(
            "{n} {which} not looked at (a config cannot name them; the daemon skips them too): {}",
            s.not_utf8
                .iter()
                .take(5)
                .cloned()
                .collect::<Vec<_>>()
                .join(", ")
        ));
    }
    let filled = |key: &str, value: &str, what: &str| format!("{key}: {value} ({what})");
    let path = |p: &PathBuf| p.display().to_string();
    match (s.checkpoints.first(), s.checkpoints.last()) {
        (Some(first), Some(last)) => {
            let kind = if first.is_dir { "folders" } else { "files" };
            let format = match &first.format {
                Ok(f) => format!("{f}"),
                Err(e) => format!("not readable: {e}"),
            };
            out.push(format!(
                "{} checkpoint {kind} (steps {} to {}); e.g. {} reads {} ({format})",
                s.checkpoints.len(),
                first.step,
                last.step,
                first.name,
                first.weights
            ));
            let unreadable = s.checkpoints.iter().filter(|f| f.format.is_err()).count();
            if unreadable > 0 {
                out.push(format!(
                    "{unreadable} of them cannot be read yet (still being written, or see checkpoints.weights_files)"
                ));
            }
            out.push(match &s.pattern {
                Some(p) => filled(
                    "checkpoints.pattern",
                    &quoted(p),
                    "their names, each number as *",
                ),
                None => "checkpoints.pattern: the default (the checkpoints' names share no one pattern)".into(),
            });
            if s.ema_folders() {
                out.push(
                    "EMA weights (the *_ema/ folders) are evaluated: checkpoints.prefer_ema"
                        .into(),
                );
            }
        }
        _ => out.push(format!(
            "no checkpoint yet in {} (files or folders named with their step, e.g. checkpoint-500/ or ckpt_500.pt); the defaults below find what common training stacks write",
            dir.display()
        )),
    }
    match &s.architecture {
        Some(a) => out.push(filled(
            "model.architecture",
            &path(a),
            "the exported architecture",
        )),
        None if s.architectures.len() > 1 => out.push(format!(
            "{} exported architectures found: {}; choose one with --architecture",
            s.architectures.len(),
            s.architectures
                .iter()
                .map(|a| a.display().to_string())
                .collect::<Vec<_>>()
                .join(", ")
        )),
        None => out.push(
            "no exported architecture (*.ts) found: export one with diffmon-export (docs/guide/training-stacks.md, \"Exporting the architecture\") and set model.architecture".into(),
        ),
    }
    if let Some(v) = &s.vae {
        out.push(filled(
            "model.vae",
            &path(v),
            "a latent model's autoencoder, diffmon-export --vae",
        ));
    }
    match &s.train {
        Some(t) => out.push(filled("data.path", &path(t), "training images")),
        None => out.push(
            "no training images (*.h5) found: write them as HDF5 (docs/guide/configuration.md, \"Training images\") and set data.path".into(),
        ),
    }
    match &s.heldout {
        Some(h) => out.push(filled(
            "data.heldout_path",
            &path(h),
            "held-out images, for the generalization gap",
        )),
        None => out.push(
            "no held-out images (*.h5 named *heldout* or *val*) found: data.heldout_path is left out (set it for the generalization gap)".into(),
        ),
    }
    if let Some(t) = &s.tensorboard {
        out.push(filled(
            "trackers.tensorboard.dir",
            &path(t),
            "the training job's TensorBoard logs: diffmon's numbers go beside them, in diffmon/<run>",
        ));
    }
    if let Some(cores) = s.cores {
        out.push(filled(
            "cpu_threads",
            &threads_beside_training(cores).to_string(),
            &format!(
                "half of the {cores} cores this machine gives it, the rest left to a training job beside it; {cores} when diffmon has the machine to itself"
            ),
        ));
    }
    out
}

/// Why `init --out` wrote nothing.
#[derive(Debug, thiserror::Error)]
pub enum InitError {
    #[error(
        "{0}: the file exists; `init --out` never overwrites a config (remove it, or write to another file)"
    )]
    OutExists(PathBuf),
    #[error("{file}: cannot write the config: {source}")]
    Write {
        file: PathBuf,
        source: std::io::Error,
    },
    #[error("{0}: cannot make the path absolute: {1}")]
    Path(PathBuf, std::io::Error),
    #[error(
        "{dir}: {} exported architectures, and init does not guess which one the checkpoints are for: {}; \
         name it with --architecture FILE (e.g. diffmon init --run-dir {dir} --architecture {})",
        candidates.len(),
        candidates.iter().map(|c| c.display().to_string()).collect::<Vec<_>>().join(", "),
        candidates.first().map(|c| c.display().to_string()).unwrap_or_default()
    )]
    Ambiguous {
        dir: String,
        candidates: Vec<PathBuf>,
    },
}

impl InitError {
    /// A usage error (exit code 2): the output file, or the architecture, is the user's choice.
    pub fn is_usage(&self) -> bool {
        matches!(self, InitError::OutExists(_) | InitError::Ambiguous { .. })
    }
}

/// The architecture the config names: `chosen` (`--architecture`, kept relative when it is
/// under `dir` as given, else made absolute), else the survey's one candidate; with several and
/// none chosen, [`InitError::Ambiguous`] listing them.
pub fn choose_architecture(
    dir: &Path,
    survey: &mut Survey,
    chosen: Option<&Path>,
) -> Result<(), InitError> {
    if let Some(chosen) = chosen {
        let path = if chosen.starts_with(dir) {
            chosen.to_path_buf()
        } else {
            std::path::absolute(chosen).map_err(|e| InitError::Path(chosen.to_path_buf(), e))?
        };
        survey.architecture = Some(path);
        return Ok(());
    }
    if survey.architecture.is_none() && survey.architectures.len() > 1 {
        return Err(InitError::Ambiguous {
            dir: dir.display().to_string(),
            candidates: survey.architectures.clone(),
        });
    }
    Ok(())
}

/// How a config saved at `out` names the run folder `dir`: relative to `out`'s folder (a config's
/// paths are read relative to its own folder), or absolute where the config goes to stdout and
/// its place is unknown. Lexical: `.` and `..` are folded, links are not followed.
pub fn written_dir(dir: &Path, out: Option<&Path>) -> Result<PathBuf, InitError> {
    let absolute = |p: &Path| {
        std::path::absolute(p)
            .map(|a| crate::config::normalize(&a))
            .map_err(|e| InitError::Path(p.to_path_buf(), e))
    };
    let dir = absolute(dir)?;
    let Some(out) = out else { return Ok(dir) };
    let out = absolute(out)?;
    let base = out.parent().unwrap_or(Path::new("/"));
    let common = dir
        .components()
        .zip(base.components())
        .take_while(|(a, b)| a == b)
        .count();
    let mut rel = PathBuf::new();
    for _ in base.components().skip(common) {
        rel.push("..");
    }
    rel.extend(dir.components().skip(common));
    Ok(if rel.as_os_str().is_empty() {
        PathBuf::from(".")
    } else {
        rel
    })
}

/// Writes `text` to `out`, a new file (an existing one, or a link there, is refused).
pub fn write_new(out: &Path, text: &str) -> Result<(), InitError> {
    use std::io::Write;
    let file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(out);
    let mut file = match file {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
            return Err(InitError::OutExists(out.to_path_buf()));
        }
        Err(source) => {
            return Err(InitError::Write {
                file: out.to_path_buf(),
                source,
            });
        }
    };
    file.write_all(text.as_bytes())
        .and_then(|()| file.sync_all())
        .map_err(|source| InitError::Write {
            file: out.to_path_buf(),
            source,
        })
}

/// The example config, filled in for the run folder `dir` and what [`survey`] found there, with
/// the folder written as `written` (see [`written_dir`]; the survey's paths are under `dir`).
/// Paths and the pattern are written as YAML scalars that read back as themselves, whatever the
/// folder's name.
pub fn config_for(dir: &Path, written: &Path, s: &Survey) -> String {
    let rebase = |p: &Path| {
        let inside = p.strip_prefix(dir).unwrap_or(p);
        if written == Path::new(".") {
            inside.to_path_buf()
        } else {
            written.join(inside)
        }
    };
    let d = written.display().to_string();
    let demo = regex::Regex::new(r"runs/demo(/\S*)?").expect("a valid regex");
    let mut text = demo
        .replace_all(EXAMPLE, |c: &regex::Captures| {
            yaml_scalar(&format!("{d}{}", c.get(1).map_or("", |m| m.as_str())))
        })
        .into_owned();
    // The name check-config and the metrics use: the folder's own (`.` is the current one).
    let name = std::fs::canonicalize(dir)
        .unwrap_or_else(|_| dir.to_path_buf())
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "run".into());
    text = text.replace("# name: demo ", &format!("# name: {} ", one_line(&name)));
    if let Some(p) = &s.pattern {
        text = replace_value(&text, "  pattern: ", &quoted(p));
    }
    if let Some(a) = &s.architecture {
        text = replace_value(
            &text,
            "  architecture: ",
            &yaml_scalar(&rebase(a).display().to_string()),
        );
    }
    if let Some(v) = &s.vae {
        text = replace_value(
            &text.replacen("  # vae: ", "  vae: ", 1),
            "  vae: ",
            &yaml_scalar(&rebase(v).display().to_string()),
        );
    }
    if let Some(t) = &s.train {
        text = replace_value(
            &text,
            "  path: ",
            &yaml_scalar(&rebase(t).display().to_string()),
        );
    }
    match &s.heldout {
        Some(h) => {
            text = replace_value(
                &text,
                "  heldout_path: ",
                &yaml_scalar(&rebase(h).display().to_string()),
            )
        }
        None => text = text.replacen("  heldout_path: ", "  # heldout_path: ", 1),
    }
    if let Some(cores) = s.cores {
        text = replace_value(
            &text.replacen("# cpu_threads: ", "cpu_threads: ", 1),
            "cpu_threads: ",
            &threads_beside_training(cores).to_string(),
        );
    }
    if let Some(t) = &s.tensorboard {
        text = replace_value(
            &text
                .replacen(
                    "# trackers:\n#   tensorboard:",
                    "trackers:\n  tensorboard:",
                    1,
                )
                .replacen("\n#     dir: ", "\n    dir: ", 1),
            "    dir: ",
            &yaml_scalar(&rebase(t).display().to_string()),
        );
    }
    let header: String = describe(dir, s)
        .iter()
        .map(|l| format!("# {}\n", one_line(l)))
        .collect();
    format!(
        "# Written by `diffmon init --run-dir {}`, which found:\n{header}\n{text}",
        one_line(&dir.display().to_string())
    )
}

/// What YAML reads as a line break or refuses in a file, besides `\n` and `\r`: the other
/// control characters, NEL (U+0085, a control character too), and the Unicode line and
/// paragraph separators. A file name holding one must not end a comment line or a value.
fn breaks_yaml(c: char) -> bool {
    c.is_control() || matches!(c, '\u{2028}' | '\u{2029}')
}

/// `s` for a comment line: line breaks and control characters shown escaped (`\n`,
/// `\u{2028}`), so that a file name never starts a line of its own.
fn one_line(s: &str) -> String {
    s.chars()
        .flat_map(|c| {
            let escaped: Vec<char> = if breaks_yaml(c) {
                c.escape_default().collect()
            } else {
                vec![c]
            };
            escaped
        })
        .collect()
}

/// `s` double-quoted, with JSON's escapes (JSON strings are YAML scalars), and `\u` escapes for
/// the characters JSON leaves as they are and YAML does not ([`breaks_yaml`]).
fn quoted(s: &str) -> String {
    serde_json::to_string(s)
        .expect("a string serializes")
        .chars()
        .map(|c| match c {
            c if breaks_yaml(c) => format!("\\u{:04x}", c as u32),
            c => c.to_string(),
        })
        .collect()
}

/// `s` as a YAML scalar: plain when it reads back as the same string, else [`quoted`].
fn yaml_scalar(s: &str) -> String {
    let lower = s.to_ascii_lowercase();
    let safe = s
        .chars()
        .all(|c| c.is_alphanumeric() || matches!(c, '/' | '.' | '_' | '-' | '+'));
    let other_type = matches!(
        lower.as_str(),
        "" | "~" | "null" | "true" | "false" | "yes" | "no" | "on" | "off" | "y" | "n"
    ) || lower
        .trim_start_matches(['+', '-', '.'])
        .parse::<f64>()
        .is_ok();
    if safe && !other_type && !s.starts_with('-') {
        s.to_string()
    } else {
        quoted(s)
    }
}

/// `text` with the value of the first line starting with `prefix` replaced (its comment kept).
fn replace_value(text: &str, prefix: &str, value: &str) -> String {
    let mut done = false;
    text.lines()
        .map(|line| {
            if done || !line.starts_with(prefix) {
                return line.to_string();
            }
            done = true;
            let rest = &line[prefix.len()..];
            let comment = rest
                .find(" #")
                .map(|i| rest[i..].trim_start())
                .unwrap_or("");
            let mut out = format!("{prefix}{value}");
            if !comment.is_empty() {
                out.push_str(&format!(
                    "{}{comment}",
                    " ".repeat(line.len().saturating_sub(out.len() + comment.len()).max(1))
                ));
            }
            out
        })
        .collect::<Vec<_>>()
        .join("\n")
        + "\n"
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_generalize_to_one_pattern() {
        assert_eq!(generalize("checkpoint-500"), "checkpoint-*");
        assert_eq!(generalize("epoch=3-step=400.ckpt"), "epoch=*-step=*.ckpt");
        assert_eq!(generalize("ema-12.pt"), "ema-*.pt");
    }

    #[test]
    fn scalars_read_back_as_themselves() {
        for s in [
            "runs/exp1",
            "/tmp/.tmpAb12/model.ts",
            "runs/exp #1/train.h5",
            "runs/a: b",
            "[x]",
            "*",
            "'q'",
            "\"q\"",
            "back\\slash",
            "line\nbreak",
            "line\u{2028}separator\u{2029}paragraph\u{85}next",
            "escape\u{1b}[2J\u{7f}",
            "1000",
            "1e3",
            ".inf",
            "true",
            "on",
            "~",
            "-x",
            "é/ü",
        ] {
            let yaml = format!("k: {}  # comment\n", yaml_scalar(s));
            let v: std::collections::BTreeMap<String, serde_yaml::Value> =
                serde_yaml::from_str(&yaml).unwrap_or_else(|e| panic!("{yaml}: {e}"));
            assert_eq!(v["k"].as_str(), Some(s), "{yaml}");
        }
        assert_eq!(yaml_scalar("runs/exp1/model.ts"), "runs/exp1/model.ts");
        assert_eq!(quoted("ckpt\\[1\\]_*.pt"), r#""ckpt\\[1\\]_*.pt""#);
        // A file name in a comment line: no key of its own, whatever breaks YAML's lines.
        for name in [
            "heldout\u{2028}state_dir: ..\u{2028}#.h5",
            "heldout\u{85}state_dir: ..\u{2029}#.h5",
            "heldout\rstate_dir: ..\n#.h5",
            "esc\u{1b}.h5",
        ] {
            let yaml = format!("# data.heldout_path: {} (held-out)\nk: v\n", one_line(name));
            let v: std::collections::BTreeMap<String, serde_yaml::Value> =
                serde_yaml::from_str(&yaml).unwrap_or_else(|e| panic!("{yaml}: {e}"));
            assert_eq!(v.keys().collect::<Vec<_>>(), ["k"], "{yaml:?}");
        }
    }

    /// The keys of a written config whose value is not the example's, but for `run.dir` (the
    /// folder given, not something found in it): key → value as written. Comments are left out.
    fn filled_keys(text: &str) -> std::collections::BTreeMap<String, String> {
        let example: std::collections::HashSet<&str> = EXAMPLE.lines().collect();
        let (mut section, mut sub) = ("", "");
        let mut keys = std::collections::BTreeMap::new();
        for line in text.lines() {
            let code = line.split(" #").next().unwrap_or("").trim_end();
            if !line.starts_with([' ', '#']) && code.ends_with(':') {
                section = code.trim_end_matches(':');
            }
            let entry = line.trim_start();
            if !line.starts_with("  ") || entry.starts_with('#') || example.contains(line) {
                continue;
            }
            // A section inside a section (`trackers:` / `  tensorboard:`) names its keys.
            if !line.starts_with("   ") && code.ends_with(':') {
                sub = code.trim().trim_end_matches(':');
                continue;
            }
            let (leaf, value) = code.trim_start().split_once(": ").expect("key: value");
            let key = if line.starts_with("    ") {
                format!("{section}.{sub}.{leaf}")
            } else {
                format!("{section}.{leaf}")
            };
            if key != "run.dir" {
                keys.insert(key, value.trim().to_string());
            }
        }
        keys
    }

    /// A folder with TensorBoard event files two levels down (Lightning's
    /// `lightning_logs/version_0/`) turns `trackers.tensorboard` on at it, and says so; a
    /// folder of other files, or event files three levels down, does not.
    #[test]
    fn init_offers_the_tensorboard_tracker_where_it_finds_event_files() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("a_notes/x/y/z")).unwrap();
        std::fs::write(
            dir.path().join("a_notes/x/y/z/events.out.tfevents.1.h"),
            b"",
        )
        .unwrap();
        std::fs::create_dir_all(dir.path().join("lightning_logs/version_0")).unwrap();
        let events = "lightning_logs/version_0/events.out.tfevents.1700000000.host.1.0";
        std::fs::write(dir.path().join(events), b"").unwrap();
        let s = survey(dir.path()).unwrap();
        assert_eq!(s.tensorboard, Some(dir.path().join("lightning_logs")));
        let text = config_for(dir.path(), Path::new("."), &s);
        assert!(
            text.contains("# trackers.tensorboard.dir: ") && text.contains("lightning_logs ("),
            "{text}"
        );
        crate::config::ConfigFile::parse(&text, "init.yaml").unwrap();
        let yaml: serde_yaml::Value = serde_yaml::from_str(&text).unwrap();
        assert_eq!(
            yaml["trackers"]["tensorboard"]["dir"].as_str(),
            Some("lightning_logs"),
            "{text}"
        );
        std::fs::remove_file(dir.path().join(events)).unwrap();
        let s = survey(dir.path()).unwrap();
        assert_eq!(s.tensorboard, None);
        let text = config_for(dir.path(), Path::new("."), &s);
        assert!(text.contains("# trackers:\n"), "{text}");
    }

    /// A folder of more entries than are looked at, or with names that are not UTF-8, is said
    /// so, not surveyed as if it held nothing more.
    #[test]
    fn a_survey_says_what_it_did_not_look_at() {
        use std::os::unix::ffi::OsStrExt;
        let dir = tempfile::tempdir().unwrap();
        for i in 0..MAX_ENTRIES + 1 {
            std::fs::write(dir.path().join(format!("junk-{i}.txt")), b"").unwrap();
        }
        let odd = std::ffi::OsStr::from_bytes(b"ckpt_000040\xff.pt");
        std::fs::write(dir.path().join(odd), b"").unwrap();
        let s = survey(dir.path()).unwrap();
        assert!(s.cut);
        let said = describe(dir.path(), &s).join("\n");
        assert!(
            said.contains(&format!("more than {MAX_ENTRIES} entries")),
            "{said}"
        );
        // Listed in no order: the odd name is among the first looked at or the rest.
        if !s.not_utf8.is_empty() {
            assert!(said.contains("ckpt_000040\u{fffd}.pt"), "{said}");
        }
        let small = tempfile::tempdir().unwrap();
        std::fs::write(small.path().join(odd), b"").unwrap();
        let s = survey(small.path()).unwrap();
        assert!(!s.cut);
        let said = describe(small.path(), &s).join("\n");
        assert!(
            said.contains("1 entry whose name is not UTF-8 was not looked at"),
            "{said}"
        );
        assert!(said.contains("ckpt_000040\u{fffd}.pt"), "{said}");
    }

    /// Every value `config_for` fills in from what the folder holds is named in the report
    /// (stderr and the config's header) with that value; a key it could not fill is named too.
    #[test]
    fn the_report_names_every_value_filled_in() {
        let dir = Path::new("/runs/exp1");
        let everything = Survey {
            checkpoints: vec![Found {
                name: "ckpt_500.pt".into(),
                step: 500,
                is_dir: false,
                weights: "ckpt_500.pt".into(),
                format: Ok(CheckpointFormat::TorchScript),
            }],
            architecture: Some(dir.join("model.ts")),
            architectures: vec![dir.join("model.ts")],
            vae: Some(dir.join("vae.ts")),
            train: Some(dir.join("train.h5")),
            heldout: Some(dir.join("heldout.h5")),
            pattern: Some("ckpt_*.pt".into()),
            cores: Some(16),
            cut: false,
            not_utf8: Vec::new(),
            tensorboard: Some(dir.join("logs")),
        };
        let text = config_for(dir, dir, &everything);
        let keys = filled_keys(&text);
        let names: Vec<&str> = keys.keys().map(String::as_str).collect();
        assert_eq!(
            names,
            [
                "checkpoints.pattern",
                "data.heldout_path",
                "data.path",
                "model.architecture",
                "model.vae",
                "trackers.tensorboard.dir"
            ],
            "{text}"
        );
        let report = describe(dir, &everything);
        assert!(text.contains("\ncpu_threads: 8 "), "{text}");
        assert!(
            report.iter().any(|l| l.starts_with("cpu_threads: 8 (")),
            "{report:#?}"
        );
        for (key, value) in &keys {
            let named = format!("{key}: {value} (");
            assert!(
                report.iter().any(|l| l.starts_with(&named)),
                "`{named}` is not in the report: {report:#?}"
            );
            assert!(text.contains(&format!("\n# {named}")), "{text}");
        }

        // Nothing found: the keys left at the example's paths (under the folder) and the
        // held-out set, left out, are each named with why.
        let nothing = Survey::default();
        let text = config_for(dir, dir, &nothing);
        let keys = filled_keys(&text);
        let report = describe(dir, &nothing);
        assert!(keys.contains_key("model.architecture"), "{text}");
        assert!(!keys.contains_key("data.heldout_path"), "{text}");
        for key in keys.keys().map(String::as_str).chain(["data.heldout_path"]) {
            assert!(
                report
                    .iter()
                    .any(|l| l.contains(" found: ") && l.contains(key)),
                "{key} is not in the report: {report:#?}"
            );
        }
    }

    /// A stand-in TorchScript archive: a zip with `constants.pkl` beside `data.pkl`, which is
    /// what the format check looks for.
    fn torchscript_stub(path: &Path) {
        use std::io::Write;
        let mut w = zip::ZipWriter::new(std::fs::File::create(path).unwrap());
        let opts = zip::write::SimpleFileOptions::default()
            .compression_method(zip::CompressionMethod::Stored);
        for name in ["m/data.pkl", "m/constants.pkl"] {
            w.start_file(name, opts).unwrap();
            w.write_all(b"").unwrap();
        }
        w.finish().unwrap();
    }

    /// Two exported architectures (`pixart.ts`, and `unet/model.ts` one level down): none is
    /// chosen; init lists both and asks for --architecture, which settles it. One alone is
    /// taken as before; a `*.ts` that is not TorchScript is no candidate.
    #[test]
    fn two_architectures_are_listed_and_one_must_be_chosen() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path();
        torchscript_stub(&dir.join("pixart.ts"));
        std::fs::write(dir.join("notes.ts"), "export const x = 1;").unwrap();
        let mut s = survey(dir).unwrap();
        assert_eq!(s.architectures, [dir.join("pixart.ts")]);
        assert_eq!(s.architecture, Some(dir.join("pixart.ts")));
        choose_architecture(dir, &mut s, None).unwrap();

        std::fs::create_dir(dir.join("unet")).unwrap();
        torchscript_stub(&dir.join("unet/model.ts"));
        let mut s = survey(dir).unwrap();
        assert_eq!(
            s.architectures,
            [dir.join("pixart.ts"), dir.join("unet/model.ts")]
        );
        assert_eq!(s.architecture, None);
        let e = choose_architecture(dir, &mut s, None).unwrap_err();
        assert!(e.is_usage());
        let text = e.to_string();
        for want in ["pixart.ts", "unet/model.ts", "--architecture"] {
            assert!(text.contains(want), "{want} not in: {text}");
        }
        assert!(
            describe(dir, &s)
                .iter()
                .any(|l| l.contains("2 exported architectures") && l.contains("--architecture")),
            "{:#?}",
            describe(dir, &s)
        );
        choose_architecture(dir, &mut s, Some(&dir.join("unet/model.ts"))).unwrap();
        assert_eq!(s.architecture, Some(dir.join("unet/model.ts")));
        let text = config_for(dir, Path::new("."), &s);
        assert!(text.contains("\n  architecture: unet/model.ts"), "{text}");
    }

    #[test]
    fn a_value_is_replaced_and_its_comment_kept() {
        let t = "a:\n  path: x.h5      # required: images\n  path: y\n";
        assert_eq!(
            replace_value(t, "  path: ", "/data/train.h5"),
            "a:\n  path: /data/train.h5 # required: images\n  path: y\n"
        );
    }
}
