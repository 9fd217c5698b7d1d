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
    /// Only the first [`MAX_GLOB_ENTRIES`] entries of the folder are looked at: a WARN says so,
    /// once per process, when it holds more.
    pub fn matches(&self) -> Vec<(String, PathBuf)> {
        static WARNED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
        let (found, beyond) = self.matches_within(MAX_GLOB_ENTRIES);
        if beyond && !WARNED.swap(true, std::sync::atomic::Ordering::SeqCst) {
            tracing::warn!(folder = %self.parent.display(), limit = MAX_GLOB_ENTRIES,
                "the runs_glob folder holds more than {MAX_GLOB_ENTRIES} entries: only the first \
                 {MAX_GLOB_ENTRIES} the file system lists are looked at for runs, at every \
                 rescan; a run folder among the others is never found (move old entries away)");
        }
        found
    }

    /// [`RunsGlob::matches`] over the first `max` entries, and whether there were more.
    fn matches_within(&self, max: usize) -> (Vec<(String, PathBuf)>, bool) {
        let Ok(entries) = std::fs::read_dir(&self.parent) else {
            return (Vec::new(), false);
        };
        let mut entries = entries.peekable();
        let mut found: Vec<(String, PathBuf)> = entries
            .by_ref()
            .take(max)
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
        (found, entries.peek().is_some())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A folder with more entries than a scan reads says so (issue #45: runs past the cap were
    /// never seen, and nothing said it).
    #[test]
    fn a_folder_past_the_cap_is_said_to_be() {
        let dir = tempfile::tempdir().unwrap();
        for i in 0..5 {
            std::fs::create_dir(dir.path().join(format!("lr-{i}"))).unwrap();
        }
        let file = ConfigFile::parse(super::super::test_support::MINIMAL, "c.yaml").unwrap();
        let glob = RunsGlob::compile(&dir.path().join("lr-*"), &file).unwrap();
        let (found, beyond) = glob.matches_within(3);
        assert_eq!((found.len(), beyond), (3, true));
        let (found, beyond) = glob.matches_within(5);
        assert_eq!((found.len(), beyond), (5, false));
        assert_eq!(glob.matches().len(), 5);
    }
}
