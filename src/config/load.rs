//! Reading a config: [`Config::load`] reads the file (at most [`MAX_CONFIG_BYTES`]), parses it
//! ([`ConfigFile::parse`], whose errors name the key, line and column), resolves its relative
//! paths against its folder ([`normalize`]d) and builds the settings; [`ConfigError`] is what
//! can go wrong.

use super::file::ConfigFile;
use super::settings::Config;
use super::text::{MAX_FLOW_DEPTH, key_position, too_deep};
use super::validate::Problem;
use std::path::{Path, PathBuf};

/// Largest config file read (a real one is a few KiB).
pub const MAX_CONFIG_BYTES: u64 = 1 << 20;

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("{path}: cannot read the config file: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: the config file is {size} bytes; at most {MAX_CONFIG_BYTES} are read")]
    TooLarge { path: PathBuf, size: u64 },
    #[error("{file}: {location}{key}: {message}")]
    Parse {
        file: String,
        /// `line L, column C: ` when the parser knows where.
        location: String,
        /// The key path (`icr.samples`), or `(top level)`.
        key: String,
        message: String,
    },
    #[error("{file}: {} problem{}:\n{}", problems.len(), if problems.len() == 1 { "" } else { "s" },
        problems.iter().map(|p| format!("  - {p}")).collect::<Vec<_>>().join("\n"))]
    Invalid {
        file: String,
        problems: Vec<Problem>,
    },
}

impl Config {
    /// Reads, parses and validates a config file; relative paths become relative to its folder.
    /// The webhooks' secrets must be set in the environment and well-formed (for `watch` and
    /// `check-config`).
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        Config::load_checking(path, true)
    }

    /// [`Config::load`] for commands that send nothing (`eval`, `report`, `bias-variance`):
    /// the webhooks' secrets are not looked up.
    pub fn load_without_secrets(path: &Path) -> Result<Config, ConfigError> {
        Config::load_checking(path, false)
    }

    fn load_checking(path: &Path, secrets: bool) -> Result<Config, ConfigError> {
        let text = read_bounded(path)?;
        // Relative paths are resolved against the file's folder made absolute: the run's
        // checkpoints are then named the same (in the journal's keys, the records and the
        // events) whatever folder the command was started from and however the file was named
        // (`--config diffmon.yaml` in the run folder and `--config runs/exp1/diffmon.yaml`
        // evaluated every checkpoint again under a second name).
        let absolute = std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf());
        let base = absolute.parent().unwrap_or(Path::new("."));
        let mut config = ConfigFile::parse(&text, &path.display().to_string())?;
        config.resolve_paths(base);
        let mut config = config
            .settings(secrets)
            .map_err(|problems| ConfigError::Invalid {
                file: path.display().to_string(),
                problems,
            })?;
        config.source = Some(absolute);
        Ok(config)
    }
}

impl ConfigFile {
    /// Parses YAML text; `file` names the source in errors. No validation, no path resolution.
    /// A UTF-8 byte-order mark (which some Windows editors write) is dropped first; it is
    /// invisible, so columns are counted without it.
    pub fn parse(text: &str, file: &str) -> Result<ConfigFile, ConfigError> {
        let text = text.strip_prefix('\u{feff}').unwrap_or(text);
        if let Some((line, column)) = too_deep(text) {
            return Err(ConfigError::Parse {
                file: file.to_string(),
                location: format!("line {line}, column {column}: "),
                key: "(top level)".to_string(),
                message: format!(
                    "brackets nest more than {MAX_FLOW_DEPTH} deep; a config needs at most a few levels"
                ),
            });
        }
        let de = serde_yaml::Deserializer::from_str(text);
        serde_path_to_error::deserialize(de).map_err(|e| {
            let key = match e.path().to_string() {
                p if p == "." => "(top level)".to_string(),
                p => p,
            };
            let inner = e.into_inner();
            // serde_yaml appends " at line L column C" itself; keep the message clean.
            let mut message = inner.to_string();
            if let Some(i) = message.find(" at line ") {
                message.truncate(i);
            }
            // It also starts nested messages with its own (shorter) path: `icr: unknown field`.
            if let Some((head, rest)) = message.split_once(": ")
                && !head.contains(char::is_whitespace)
            {
                message = rest.to_string();
            }
            // For errors raised after a value was read (`device: tpu`) and for duplicate keys,
            // serde_yaml points at the start of the enclosing mapping; the key is found in the
            // text instead. (A duplicate's path is the mapping that holds it.)
            let path = if key == "(top level)" { "" } else { &key };
            let duplicate = message
                .strip_prefix("duplicate field `")
                .and_then(|m| m.split('`').next());
            let found = match duplicate {
                Some(name) => key_position(text, path, Some((name, 2))),
                None if !path.is_empty() => key_position(text, path, None),
                None => None,
            };
            let reported = inner.location().map(|l| (l.line(), l.column()));
            let location = match (reported, found) {
                (Some((line, _)), Some(at)) if at.0 != line => Some(at),
                (reported, found) => reported.or(found),
            }
            .map(|(line, column)| format!("line {line}, column {column}: "))
            .unwrap_or_default();
            ConfigError::Parse {
                file: file.to_string(),
                location,
                key,
                message,
            }
        })
    }

    pub(super) fn resolve_paths(&mut self, base: &Path) {
        let fix = |p: &mut PathBuf| {
            *p = if p.is_relative() {
                normalize(&base.join(&*p))
            } else {
                normalize(p)
            };
        };
        if let Some(run) = self.run.as_mut() {
            fix(&mut run.dir);
        }
        if let Some(p) = self.state_dir.as_mut() {
            fix(p);
        }
        if let Some(p) = self.runs_glob.as_mut() {
            fix(p);
        }
        if let Some(tb) = self.trackers.tensorboard.as_mut() {
            fix(&mut tb.dir);
        }
        if let Some(p) = self
            .trackers
            .mlflow
            .as_mut()
            .and_then(|m| m.token_file.as_mut())
        {
            fix(p);
        }
        for entry in self.runs.iter_mut().flatten() {
            fix(&mut entry.dir);
            if let Some(p) = entry.state_dir.as_mut() {
                fix(p);
            }
            if let Some(data) = entry.data.as_mut() {
                fix(&mut data.path);
                for p in [data.heldout_path.as_mut(), data.latents_path.as_mut()]
                    .into_iter()
                    .flatten()
                {
                    fix(p);
                }
            }
        }
        fix(&mut self.model.architecture);
        if let super::model::CompiledSetting::Path(p) = &mut self.model.compiled {
            fix(p);
        }
        if let Some(data) = self.data.as_mut() {
            fix(&mut data.path);
        }
        let data = self.data.as_mut();
        let (heldout, latents) = match data {
            Some(d) => (d.heldout_path.as_mut(), d.latents_path.as_mut()),
            None => (None, None),
        };
        for p in [
            self.model.vae.as_mut(),
            heldout,
            latents,
            self.pfd.teacher.as_mut(),
            self.pfd.descriptor.as_mut(),
            self.pfd.latents.as_mut(),
        ]
        .into_iter()
        .flatten()
        {
            fix(p);
        }
        if let Some(p) = self.evaluation.slurm.binary.as_mut() {
            fix(p);
        }
    }
}

/// Reads the config file, refusing one larger than [`MAX_CONFIG_BYTES`] before reading it.
fn read_bounded(path: &Path) -> Result<String, ConfigError> {
    use std::io::Read;
    let read_error = |source| ConfigError::Read {
        path: path.to_path_buf(),
        source,
    };
    let file = std::fs::File::open(path).map_err(read_error)?;
    let mut text = String::new();
    file.take(MAX_CONFIG_BYTES + 1)
        .read_to_string(&mut text)
        .map_err(read_error)?;
    if text.len() as u64 > MAX_CONFIG_BYTES {
        let size = std::fs::metadata(path).map_or(text.len() as u64, |m| m.len());
        return Err(ConfigError::TooLarge {
            path: path.to_path_buf(),
            size,
        });
    }
    Ok(text)
}

/// `path` without `.` components and with each `name/..` pair removed, lexically (what the user
/// wrote, shorter: `config/../runs/demo` is `runs/demo`). Leading `..` stay; an empty result is
/// `.`.
pub(crate) fn normalize(path: &Path) -> PathBuf {
    use std::path::Component;
    let mut out: Vec<Component> = Vec::new();
    for c in path.components() {
        match c {
            Component::CurDir => {}
            Component::ParentDir => match out.last() {
                Some(Component::Normal(_)) => {
                    out.pop();
                }
                Some(Component::RootDir | Component::Prefix(_)) => {}
                _ => out.push(c),
            },
            _ => out.push(c),
        }
    }
    if out.is_empty() {
        PathBuf::from(".")
    } else {
        out.iter().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_support::{MINIMAL, settings};
    use super::*;

    #[test]
    fn keys_are_found_in_the_text_for_error_positions() {
        let text = "# a comment naming icr: and device:\n\
                    run: {dir: ., name: x}\n\
                    icr:\n  samples: 8  # not samples: here\n  seed: 1\n\
                    pfd: {enabled: true, samples: 4}\n\
                    alerts:\n  webhooks:\n    - {url: 'http://h', format: json}\n\
                    device: tpu\n\
                    icr: {samples: 16}\n";
        assert_eq!(key_position(text, "device", None), Some((10, 1)));
        assert_eq!(key_position(text, "icr.samples", None), Some((4, 3)));
        assert_eq!(key_position(text, "pfd.samples", None), Some((6, 22)));
        assert_eq!(key_position(text, "run.name", None), Some((2, 15)));
        assert_eq!(
            key_position(text, "alerts.webhooks[0].format", None),
            Some((9, 25))
        );
        assert_eq!(key_position(text, "", Some(("icr", 2))), Some((11, 1)));
        assert_eq!(key_position(text, "icr.sample", None), None);
        assert_eq!(key_position(text, "", Some(("pfd", 2))), None);
        // The error of a value checked after it was read names the key's line, not the start
        // of the enclosing mapping.
        let e = ConfigFile::parse(text, "c.yaml").unwrap_err().to_string();
        assert!(e.starts_with("c.yaml: line 10, column 1: device: "), "{e}");
        // A duplicate key names its second occurrence, at the top level and nested.
        let e = ConfigFile::parse(
            &format!("{MINIMAL}icr: {{seed: 1}}\nicr: {{seed: 2}}\n"),
            "c.yaml",
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.starts_with("c.yaml: line 5, column 1: (top level): duplicate field `icr`"),
            "{e}"
        );
        let e = ConfigFile::parse(
            &format!("{MINIMAL}icr:\n  seed: 1\n  samples: 8\n  samples: 16\n"),
            "c.yaml",
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.starts_with("c.yaml: line 7, column 3: icr: duplicate field `samples`"),
            "{e}"
        );
    }

    #[test]
    fn unknown_key_names_path_line_and_column() {
        let text = format!("{MINIMAL}icr:\n  sigma: 0.3\n  sampels: 12\n");
        let err = ConfigFile::parse(&text, "t.yaml").unwrap_err().to_string();
        assert!(
            err.starts_with("t.yaml: line 6, column 3: icr.sampels: unknown field `sampels`"),
            "{err}"
        );
        assert!(err.contains("unknown field `sampels`"), "{err}");
    }

    #[test]
    fn wrong_type_names_the_key() {
        let text = format!("{MINIMAL}pfd:\n  samples: many\n");
        let err = ConfigFile::parse(&text, "t.yaml").unwrap_err().to_string();
        assert!(err.contains("line 5, column 12: pfd.samples:"), "{err}");
        let text = format!("{MINIMAL}device: gpu\n");
        let err = ConfigFile::parse(&text, "t.yaml").unwrap_err().to_string();
        assert!(
            err.contains("device: must be auto, cpu, cuda or cuda:N, got `gpu`"),
            "{err}"
        );
    }

    /// Every shipped config parses and is valid apart from files that a run creates.
    #[test]
    fn every_file_in_config_folder_loads() {
        let folder = Path::new(env!("CARGO_MANIFEST_DIR")).join("config");
        let mut seen = 0;
        for entry in std::fs::read_dir(&folder).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().and_then(|e| e.to_str()) != Some("yaml") {
                continue;
            }
            seen += 1;
            let text = std::fs::read_to_string(&path).unwrap();
            let mut config = ConfigFile::parse(&text, &path.display().to_string()).unwrap();
            config.resolve_paths(&folder);
            let problems: Vec<Problem> = config
                .validate()
                .into_iter()
                .filter(|p| !p.message.ends_with("which does not exist"))
                .collect();
            assert!(problems.is_empty(), "{}: {problems:?}", path.display());
        }
        assert!(seen >= 2, "config/ holds {seen} yaml files");
    }

    /// Found by the `config` fuzz target (`make fuzz`): the 3-byte file `.[:` made `parse` loop
    /// forever while locating the key `.[` in the text (its path has an empty segment name).
    #[test]
    fn fuzz_key_with_path_characters_does_not_hang() {
        for text in [".[:", "a.[0]: 1", "run: {.: 1}", "\"\": 1\n\"\": 2"] {
            let (tx, rx) = std::sync::mpsc::channel();
            let owned = text.to_string();
            std::thread::spawn(move || tx.send(ConfigFile::parse(&owned, "c.yaml").is_err()));
            let failed = rx.recv_timeout(std::time::Duration::from_secs(10));
            assert_eq!(failed, Ok(true), "{text:?}: no error within 10 s");
        }
    }

    /// 100 KB of nested brackets took 12 s in the YAML scanner (quadratic in the depth); the
    /// depth is now refused by a linear scan before the scanner runs. Brackets in comments and
    /// quoted scalars do not count.
    #[test]
    fn deep_nesting_is_refused_before_parsing() {
        let deep = format!("icr: {}{}", "[".repeat(50_000), "]".repeat(50_000));
        match ConfigFile::parse(&deep, "c.yaml") {
            Err(ConfigError::Parse {
                location, message, ..
            }) => {
                assert_eq!(location, "line 1, column 38: ");
                assert!(message.contains("nest more than 32 deep"), "{message}");
            }
            other => panic!("{other:?}"),
        }
        let fine = format!(
            "# {open}\nrun: {{dir: '{open}'}}\nmodel: {{architecture: \"{open}\\\"\"}}\ndata: {{path: don't{open}}}\n",
            open = "[".repeat(40)
        );
        assert_eq!(
            too_deep(&fine),
            Some((4, 50)),
            "only the plain scalar counts"
        );
        let ok = format!("# {open}\nrun: {{dir: '{open}'}}\n", open = "[".repeat(40));
        assert_eq!(too_deep(&ok), None);
        assert_eq!(too_deep(&format!("a: {}", "[".repeat(32))), None);
    }

    /// A file starting with a UTF-8 byte-order mark failed with "missing field `model`"; it
    /// reads as the same text without it, and errors keep their line and column.
    #[test]
    fn a_byte_order_mark_is_ignored() {
        let with_bom = format!("\u{feff}{MINIMAL}");
        let c = settings(&with_bom);
        assert_eq!(c.run.dir.file_name().unwrap(), "r");
        let bad = "\u{feff}icr: {samples: many}\n";
        match ConfigFile::parse(bad, "c.yaml") {
            Err(ConfigError::Parse { location, key, .. }) => {
                let plain = match ConfigFile::parse(&bad['\u{feff}'.len_utf8()..], "c.yaml") {
                    Err(ConfigError::Parse { location, .. }) => location,
                    other => panic!("{other:?}"),
                };
                assert_eq!(location, plain);
                assert!(location.starts_with("line 1, column "), "{location}");
                assert_eq!(key, "icr.samples");
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn paths_are_normalized_lexically() {
        for (path, want) in [
            ("config/../runs/demo", "runs/demo"),
            ("./a/./b/", "a/b"),
            ("../x/../y", "../y"),
            ("a/..", "."),
            ("/a/../../b", "/b"),
        ] {
            assert_eq!(normalize(Path::new(path)), PathBuf::from(want), "{path}");
        }
        let dir = tempfile::tempdir().unwrap();
        let sub = dir.path().join("config");
        std::fs::create_dir(&sub).unwrap();
        for f in ["model.ts", "train.h5"] {
            std::fs::write(dir.path().join(f), b"").unwrap();
        }
        let file = sub.join("c.yaml");
        std::fs::write(
            &file,
            "run: {dir: ../runs/x}\nmodel: {architecture: ../model.ts}\ndata: {path: ./../train.h5}\n",
        )
        .unwrap();
        let c = Config::load(&file).unwrap();
        assert_eq!(c.run.dir, dir.path().join("runs/x"));
        assert_eq!(c.model.architecture, dir.path().join("model.ts"));
        assert_eq!(c.data.path, dir.path().join("train.h5"));
    }

    #[test]
    fn a_config_larger_than_the_bound_is_not_read() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("big.yaml");
        std::fs::write(&file, "#".repeat(MAX_CONFIG_BYTES as usize + 1)).unwrap();
        let err = Config::load(&file).unwrap_err().to_string();
        assert!(
            err.contains("big.yaml: the config file is 1048577 bytes"),
            "{err}"
        );
    }
}
