//! What several files' unit tests share: a minimal config, and the settings of a config text
//! read in a folder that holds the files it names.

use super::file::ConfigFile;
use super::settings::Config;

pub(super) const MINIMAL: &str = "run: {dir: r}\nmodel: {architecture: m.ts}\ndata: {path: d.h5}\n";

/// The settings of `text`, with the files MINIMAL names (and `h.h5`) created in a temporary
/// folder the paths are resolved against.
pub(super) fn settings(text: &str) -> Config {
    let dir = tempfile::tempdir().unwrap();
    for f in ["m.ts", "d.h5", "h.h5"] {
        std::fs::write(dir.path().join(f), b"").unwrap();
    }
    let mut file = ConfigFile::parse(text, "c.yaml").unwrap();
    file.resolve_paths(dir.path());
    file.settings(false).unwrap()
}
