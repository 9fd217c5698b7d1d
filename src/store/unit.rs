//! Checkpoint units: what the watcher hands to the evaluator, and what a record names.
//!
//! A unit is an entry directly inside `run.dir` whose name matches `checkpoints.pattern`:
//!
//! - a **file**: one checkpoint file (`ckpt_500.pt`, `epoch=3-step=400.ckpt`,
//!   `network-snapshot-000200.pkl`, `ema-500.safetensors`);
//! - a **folder**: one checkpoint as training stacks write it (accelerate's
//!   `save_state` → `checkpoint-500/model.safetensors`, a diffusers `save_pretrained` tree
//!   `checkpoint-500/unet_ema/…`, a PyTorch Distributed Checkpoint `checkpoint-500/.metadata`).
//!   Its weights are the first entry of `checkpoints.weights_files` ([`default_weights_files`])
//!   that names a regular file inside it. Nested folders are never units of their own.
//!
//! The record's `checkpoint`, and so `best_checkpoint` and the early-stop event, name the unit:
//! for a folder that is the folder a user resumes from, not the file read inside it.
//!
//! A unit's [`key`] (path, size, mtime) tells whether it changed: for a folder it is taken over
//! every file of its tree (total size, newest mtime of any file or folder in it). Folders are
//! walked without following symlinked folders, at most [`MAX_DEPTH`] levels and
//! [`MAX_ENTRIES`] entries deep, so a hostile tree cannot make a scan unbounded.
//!
//! The training step comes from the unit's path relative to `run.dir` ([`step_of`]).

use crate::config::{CheckpointsConfig, StepPattern, WeightsFile};
use crate::store::history::CheckpointKey;
use std::path::{Path, PathBuf};

/// Deepest level of a checkpoint folder that is walked.
pub const MAX_DEPTH: usize = 8;
/// Most entries (files and folders) of one checkpoint folder.
pub const MAX_ENTRIES: usize = 10_000;

#[derive(Debug, thiserror::Error)]
pub enum UnitError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "{folder}: no weights file in this checkpoint folder (looked for {looked_for}); name it in checkpoints.weights_files"
    )]
    NoWeights { folder: PathBuf, looked_for: String },
    #[error(
        "{folder}: checkpoints.weights_files entry `{entry}` matches several files ({files}); make it name one"
    )]
    Ambiguous {
        folder: PathBuf,
        entry: String,
        files: String,
    },
    #[error(
        "{folder}: more than {MAX_ENTRIES} entries, or deeper than {MAX_DEPTH} levels: not read as a checkpoint folder"
    )]
    TooLarge { folder: PathBuf },
    #[error(
        "{folder}: weights file `{entry}` is a link to a file outside the checkpoint folder; not read"
    )]
    LinkOutside { folder: PathBuf, entry: String },
}

impl UnitError {
    /// The unit is gone (deleted, or a part of it deleted while it was looked at).
    pub fn is_not_found(&self) -> bool {
        matches!(self, UnitError::Io { source, .. } if source.kind() == std::io::ErrorKind::NotFound)
    }
}

/// The model files of a diffusers `save_pretrained` folder, in the order tried.
const DIFFUSERS_FILES: [&str; 3] = [
    "diffusion_pytorch_model.safetensors",
    "diffusion_pytorch_model.safetensors.index.json",
    "diffusion_pytorch_model.bin",
];

/// The default of `checkpoints.weights_files`. EMA folders of diffusers' training scripts
/// (`unet_ema/`, `transformer_ema/`) come first when `prefer_ema`, last otherwise; then
/// `unet/`, `transformer/`, a bare diffusers model folder, accelerate's `save_state`
/// (`model.safetensors`, `pytorch_model.bin`), a sharded `model.safetensors.index.json`, a
/// PyTorch Distributed Checkpoint (`.metadata`: torchtitan, Lightning's FSDP strategy) and
/// DeepSpeed's `checkpoint/mp_rank_00_model_states.pt` (Lightning's DeepSpeed strategy).
pub fn default_weights_files(prefer_ema: bool) -> Vec<WeightsFile> {
    let under = |dirs: &[&str]| -> Vec<String> {
        dirs.iter()
            .flat_map(|d| DIFFUSERS_FILES.iter().map(move |f| format!("{d}/{f}")))
            .collect()
    };
    let ema = under(&["unet_ema", "transformer_ema"]);
    let mut raw = under(&["unet", "transformer"]);
    raw.extend(DIFFUSERS_FILES.iter().map(|f| f.to_string()));
    raw.extend(
        [
            "model.safetensors",
            "pytorch_model.bin",
            "model.safetensors.index.json",
            ".metadata",
            "checkpoint/mp_rank_00_model_states.pt",
        ]
        .map(String::from),
    );
    let ordered = if prefer_ema {
        [ema, raw].concat()
    } else {
        [raw, ema].concat()
    };
    ordered
        .iter()
        .map(|f| WeightsFile::parse(f).expect("the defaults are plain relative paths"))
        .collect()
}

/// The weights files tried inside a checkpoint folder, in order.
pub fn weights_files(c: &CheckpointsConfig) -> Vec<WeightsFile> {
    c.weights_files
        .clone()
        .unwrap_or_else(|| default_weights_files(c.prefer_ema))
}

/// A regular file of a checkpoint folder: its path relative to the folder, size and mtime.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FolderFile {
    pub relative: String,
    pub size: u64,
    pub mtime_ns: i64,
}

fn mtime_ns(meta: &std::fs::Metadata) -> i64 {
    match meta.modified() {
        Ok(t) => match t.duration_since(std::time::UNIX_EPOCH) {
            Ok(d) => d.as_nanos() as i64,
            Err(e) => -(e.duration().as_nanos() as i64),
        },
        Err(_) => 0,
    }
}

/// The regular files of `folder`'s tree (links to files included, symlinked folders not
/// followed), and the newest mtime of any folder in it.
pub fn walk(folder: &Path) -> Result<(Vec<FolderFile>, i64), UnitError> {
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| UnitError::Io { path, source }
    };
    let mut files = Vec::new();
    let mut newest_dir = mtime_ns(&std::fs::metadata(folder).map_err(io(folder))?);
    let mut entries = 0usize;
    let mut stack = vec![(folder.to_path_buf(), String::new(), 0usize)];
    while let Some((dir, rel, depth)) = stack.pop() {
        for entry in std::fs::read_dir(&dir).map_err(io(&dir))? {
            let entry = entry.map_err(io(&dir))?;
            entries += 1;
            if entries > MAX_ENTRIES {
                return Err(UnitError::TooLarge {
                    folder: folder.to_path_buf(),
                });
            }
            let Some(name) = entry.file_name().to_str().map(str::to_string) else {
                continue;
            };
            let relative = if rel.is_empty() {
                name
            } else {
                format!("{rel}/{name}")
            };
            let path = entry.path();
            let Ok(ft) = entry.file_type() else { continue };
            if ft.is_dir() {
                if depth + 1 >= MAX_DEPTH {
                    return Err(UnitError::TooLarge {
                        folder: folder.to_path_buf(),
                    });
                }
                if let Ok(m) = entry.metadata() {
                    newest_dir = newest_dir.max(mtime_ns(&m));
                }
                stack.push((path, relative, depth + 1));
                continue;
            }
            // Links are followed to files only; a broken link or a link to a folder is skipped.
            let meta = if ft.is_symlink() {
                std::fs::metadata(&path)
            } else {
                entry.metadata()
            };
            match meta {
                Ok(m) if m.is_file() => files.push(FolderFile {
                    relative,
                    size: m.len(),
                    mtime_ns: mtime_ns(&m),
                }),
                Ok(_) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound && !ft.is_symlink() => {
                    return Err(io(&path)(e));
                }
                Err(_) => {}
            }
        }
    }
    files.sort_by(|a, b| a.relative.cmp(&b.relative));
    Ok((files, newest_dir))
}

/// The key of unit `path` as it is now on disk: for a file, [`CheckpointKey::of`]; for a
/// folder, the total size of its files and the newest mtime of anything in its tree.
pub fn key(path: &Path) -> Result<CheckpointKey, UnitError> {
    let io = |source| UnitError::Io {
        path: path.to_path_buf(),
        source,
    };
    let meta = std::fs::metadata(path).map_err(io)?;
    if !meta.is_dir() {
        return CheckpointKey::of(path).map_err(io);
    }
    let (files, newest_dir) = walk(path)?;
    Ok(CheckpointKey {
        path: path.display().to_string(),
        size: files.iter().map(|f| f.size).sum(),
        mtime_ns: files.iter().map(|f| f.mtime_ns).fold(newest_dir, i64::max),
    })
}

/// The file to read for unit `path`: the file itself, or the weights file found in the folder.
pub fn weights_path(path: &Path, c: &CheckpointsConfig) -> Result<PathBuf, UnitError> {
    let meta = std::fs::metadata(path).map_err(|source| UnitError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    if !meta.is_dir() {
        return Ok(path.to_path_buf());
    }
    find_weights(path, &weights_files(c))
}

/// `path` (inside `folder`) once links are resolved stays inside `folder`: a weights file that
/// is a link to a file elsewhere is refused like a `../` path.
fn inside(folder: &Path, path: &Path) -> Result<PathBuf, UnitError> {
    let io = |source| UnitError::Io {
        path: path.to_path_buf(),
        source,
    };
    let target = std::fs::canonicalize(path).map_err(io)?;
    let root = std::fs::canonicalize(folder).map_err(io)?;
    if target.starts_with(&root) {
        return Ok(path.to_path_buf());
    }
    Err(UnitError::LinkOutside {
        folder: folder.to_path_buf(),
        entry: crate::weights::quote(
            &path
                .strip_prefix(folder)
                .unwrap_or(path)
                .display()
                .to_string(),
        ),
    })
}

/// The first of `candidates` that names one regular file in `folder` (links to files inside
/// the folder followed; a link to a file outside it is an error).
pub fn find_weights(folder: &Path, candidates: &[WeightsFile]) -> Result<PathBuf, UnitError> {
    let mut listing: Option<Vec<FolderFile>> = None;
    for entry in candidates {
        let Some(m) = entry.glob() else {
            let p = folder.join(entry.as_str());
            if std::fs::metadata(&p).is_ok_and(|m| m.is_file()) {
                return inside(folder, &p);
            }
            continue;
        };
        if listing.is_none() {
            listing = Some(walk(folder)?.0);
        }
        let hits: Vec<&str> = listing
            .iter()
            .flatten()
            .filter(|f| m.is_match(&f.relative))
            .map(|f| f.relative.as_str())
            .collect();
        match hits.as_slice() {
            [] => {}
            [one] => return inside(folder, &folder.join(one)),
            several => {
                return Err(UnitError::Ambiguous {
                    folder: folder.to_path_buf(),
                    entry: entry.to_string(),
                    files: several
                        .iter()
                        .take(5)
                        .map(|s| crate::weights::quote(s))
                        .collect::<Vec<_>>()
                        .join(", "),
                });
            }
        }
    }
    Err(UnitError::NoWeights {
        folder: folder.to_path_buf(),
        looked_for: candidates
            .iter()
            .map(WeightsFile::as_str)
            .collect::<Vec<_>>()
            .join(", "),
    })
}

/// The training step of `path`: `step_regex` on its path relative to `run_dir` when it is
/// inside it (`checkpoint-400/model.safetensors` → 400), otherwise on its file name and then on
/// `parent/name`. `None` when none of these has a step.
pub fn step_of(path: &Path, run_dir: Option<&Path>, step_regex: &StepPattern) -> Option<i64> {
    let absolute = |p: &Path| std::path::absolute(p).map(|a| crate::config::normalize(&a));
    if let (Some(dir), Ok(p)) = (run_dir, absolute(path))
        && let Ok(dir) = absolute(dir)
        && let Ok(rel) = p.strip_prefix(&dir)
        && !rel.as_os_str().is_empty()
    {
        return step_regex.step_in(rel.to_str()?);
    }
    let name = path.file_name()?.to_str()?;
    if let Some(step) = step_regex.step_in(name) {
        return Some(step);
    }
    let parent = path.parent()?.file_name()?.to_str()?;
    step_regex.step_in(&format!("{parent}/{name}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn re() -> StepPattern {
        CheckpointsConfig::default().step_regex
    }

    fn entry(f: &str) -> WeightsFile {
        WeightsFile::parse(f).unwrap()
    }

    #[test]
    fn steps_come_from_the_path_relative_to_the_run_folder() {
        let run = Path::new("/data/run7");
        let s = |p: &str, dir| step_of(Path::new(p), dir, &re());
        assert_eq!(s("/data/run7/checkpoint-400", Some(run)), Some(400));
        assert_eq!(
            s("/data/run7/checkpoint-400/model.safetensors", Some(run)),
            Some(400)
        );
        // Outside the run folder: the name, then parent/name, never the grandparents.
        assert_eq!(s("/x/checkpoint-50/model.safetensors", None), Some(50));
        assert_eq!(s("/data/run7/x/model.safetensors", None), None);
        assert_eq!(s("/data/run7/model.safetensors", Some(run)), None);
        assert_eq!(s("ckpt_000300.pt", None), Some(300));
    }

    #[test]
    fn weights_files_are_tried_in_order_and_ema_first_by_default() {
        let dir = tempfile::tempdir().unwrap();
        for f in [
            "unet/diffusion_pytorch_model.safetensors",
            "unet_ema/diffusion_pytorch_model.safetensors",
            "optimizer.bin",
        ] {
            let p = dir.path().join(f);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(p, b"x").unwrap();
        }
        let found = |ema| find_weights(dir.path(), &default_weights_files(ema)).unwrap();
        assert!(found(true).ends_with("unet_ema/diffusion_pytorch_model.safetensors"));
        assert!(found(false).ends_with("unet/diffusion_pytorch_model.safetensors"));
        // A glob naming one file wins; naming several is an error naming them.
        let one = find_weights(dir.path(), &[entry("*/diffusion_pytorch_model.*")]);
        assert!(matches!(one, Err(UnitError::Ambiguous { .. })), "{one:?}");
        let one = find_weights(dir.path(), &[entry("opt*.bin")]).unwrap();
        assert!(one.ends_with("optimizer.bin"));
        let none = find_weights(dir.path(), &[entry("model.safetensors")]).unwrap_err();
        assert!(
            none.to_string().contains("checkpoints.weights_files"),
            "{none}"
        );
    }

    #[test]
    fn a_folder_key_changes_when_a_file_inside_changes() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("unet")).unwrap();
        std::fs::write(dir.path().join("unet/w"), b"abc").unwrap();
        let before = key(dir.path()).unwrap();
        assert_eq!(before.size, 3);
        std::fs::write(dir.path().join("unet/w"), b"abcd").unwrap();
        let after = key(dir.path()).unwrap();
        assert_eq!(after.size, 4);
        assert_ne!(before, after);
    }

    #[test]
    fn a_weights_file_linked_outside_its_folder_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let elsewhere = tempfile::tempdir().unwrap();
        let secret = elsewhere.path().join("secret");
        std::fs::write(&secret, b"root:*:20000:TOPSECRET").unwrap();
        let folder = dir.path().join("checkpoint-100");
        std::fs::create_dir(&folder).unwrap();
        std::os::unix::fs::symlink(&secret, folder.join("model.safetensors")).unwrap();
        let c = CheckpointsConfig::default();
        let e = weights_path(&folder, &c).unwrap_err();
        assert!(matches!(e, UnitError::LinkOutside { .. }), "{e}");
        let e = e.to_string();
        assert!(
            e.contains("`model.safetensors` is a link to a file outside"),
            "{e}"
        );
        assert!(!e.contains("secret") && !e.contains("TOPSECRET"), "{e}");
        // A glob entry too; a link inside the folder is followed.
        let glob = [entry("*.safetensors")];
        assert!(matches!(
            find_weights(&folder, &glob),
            Err(UnitError::LinkOutside { .. })
        ));
        std::fs::remove_file(folder.join("model.safetensors")).unwrap();
        std::fs::write(folder.join("real.bin"), b"x").unwrap();
        std::os::unix::fs::symlink("real.bin", folder.join("model.safetensors")).unwrap();
        assert_eq!(
            weights_path(&folder, &c).unwrap(),
            folder.join("model.safetensors")
        );
    }

    #[test]
    fn a_deep_or_huge_tree_is_refused_not_walked_forever() {
        let dir = tempfile::tempdir().unwrap();
        let mut p = dir.path().to_path_buf();
        for i in 0..MAX_DEPTH + 1 {
            p = p.join(format!("d{i}"));
        }
        std::fs::create_dir_all(&p).unwrap();
        assert!(matches!(key(dir.path()), Err(UnitError::TooLarge { .. })));
    }
}
