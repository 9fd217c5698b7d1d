//! `runs_glob`, compiled: [`RunsGlob`] keeps the glob's folder, the matcher of its entries'
//! names and the config as written, to find a sweep's run folders now and as they appear.

use super::file::ConfigFile;
use super::run::valid_run_name;
use std::path::{Path, PathBuf};

/// `runs_glob`, compiled: the folder whose entries are matched, and the matcher of their names.
#[derive(Debug, Clone)]
pub struct RunsGlob {
    /// The glob, as resolved against the config file's folder.
    pub pattern: PathBuf,
    pub(super) parent: PathBuf,
    matcher: globset::GlobMatcher,
    /// The config as written (paths resolved): each new run's settings are built from it.
    pub(super) file: std::sync::Arc<ConfigFile>,
}

/// Entries of the glob's folder read at most per scan: the folder is the user's, but what lands
/// in it may not be.
const MAX_GLOB_ENTRIES: usize = 100_000;

impl RunsGlob {
    /// Splits `pattern` into its folder, which must be literal, and the glob of the last
    /// component.
    pub(super) fn compile(pattern: &Path, file: &ConfigFile) -> Result<RunsGlob, String> {
        let wild = |s: &str| s.contains(['*', '?', '[', '{']);
        let (Some(parent), Some(last)) = (pattern.parent(), pattern.file_name()) else {
            return Err(format!(
                "`{}` names no folder entries: give a glob such as `sweep/*`",
                pattern.display()
            ));
        };
        if wild(&parent.to_string_lossy()) {
            return Err(format!(
                "`{}`: wildcards only in the last component (the runs are the entries of one folder)",
                pattern.display()
            ));
        }
        let last = last.to_string_lossy();
        let matcher = globset::GlobBuilder::new(&last)
            .literal_separator(true)
            .build()
            .map_err(|e| format!("`{}` is not a valid glob: {e}", pattern.display()))?
            .compile_matcher();
        Ok(RunsGlob {
            pattern: pattern.to_path_buf(),
            parent: parent.to_path_buf(),
            matcher,
            file: std::sync::Arc::new(file.clone()),
        })
    }

    /// The folder whose entries are the runs (the pattern's literal part).
    pub fn folder(&self) -> &Path {
        &self.parent
    }

    /// The runs now: the folder's entries that match, are folders (not links), are not hidden
    /// and have a run's name, as (name, folder), sorted by name; all of them, of which the sweep
    /// watches at most `max_runs`. A folder that cannot be read has none.
    pub fn matches(&self) -> Vec<(String, PathBuf)> {
        let Ok(entries) = std::fs::read_dir(&self.parent) else {
            return Vec::new();
        };
        let mut found: Vec<(String, PathBuf)> = entries
            .take(MAX_GLOB_ENTRIES)
            .filter_map(|e| {
                let e = e.ok()?;
                let name = e.file_name().into_string().ok()?;
                let is_dir = e.file_type().ok()?.is_dir();
                (is_dir
                    && !name.starts_with('.')
                    && valid_run_name(&name)
                    && self.matcher.is_match(&name))
                .then(|| (name, e.path()))
            })
            .collect();
        found.sort();
        found
    }
}
