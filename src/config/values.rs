//! The values of the settings that are parsed from a string once, when the config is checked:
//! each `parse` gives the value or the problem's message (it follows the key, as in
//! `checkpoints.pattern is not a valid glob: ...`), and the value holds what its users need
//! (a compiled glob or regex, a URL, a decoded secret), so nothing later parses it again.

use crate::sign::Secret;
use reqwest::Url;
use std::fmt;

/// `checkpoints.pattern`: a glob on the names directly inside `run.dir`, compiled.
#[derive(Debug, Clone)]
pub struct Glob {
    text: String,
    matcher: globset::GlobMatcher,
}

impl Glob {
    /// The glob `text`; refused when it holds a `/` (it matches names, not paths) or is not a
    /// valid glob.
    pub fn parse(text: &str) -> Result<Glob, String> {
        if text.contains('/') {
            return Err(format!(
                "matches file names directly inside run.dir and must not contain `/`, got `{text}`"
            ));
        }
        let glob = globset::Glob::new(text).map_err(|e| format!("is not a valid glob: {e}"))?;
        Ok(Glob {
            text: text.to_string(),
            matcher: glob.compile_matcher(),
        })
    }

    /// Whether the entry name `name` matches.
    pub fn is_match(&self, name: &str) -> bool {
        self.matcher.is_match(name)
    }

    pub fn as_str(&self) -> &str {
        &self.text
    }
}

impl fmt::Display for Glob {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

/// `checkpoints.step_regex`: a regex whose first capture group is the training step.
#[derive(Debug, Clone)]
pub struct StepPattern(regex::Regex);

impl StepPattern {
    /// The regex `text`; refused when it is not a valid regex or has no capture group.
    pub fn parse(text: &str) -> Result<StepPattern, String> {
        match regex::Regex::new(text) {
            Ok(re) if re.captures_len() < 2 => {
                Err("needs a capture group for the step, e.g. `(\\d+)`".to_string())
            }
            Ok(re) => Ok(StepPattern(re)),
            Err(e) => Err(format!("is not a valid regex: {e}")),
        }
    }

    /// The first capture group in `text`, parsed as a step; `None` when there is none.
    pub fn step_in(&self, text: &str) -> Option<i64> {
        self.0.captures(text)?.get(1)?.as_str().parse().ok()
    }

    pub fn as_str(&self) -> &str {
        self.0.as_str()
    }
}

impl fmt::Display for StepPattern {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An entry of `checkpoints.weights_files`: a plain relative path inside a checkpoint folder,
/// whose components may hold a glob (`*` within one component: `/` is never matched by one).
#[derive(Debug, Clone)]
pub struct WeightsFile {
    text: String,
    /// Compiled when the entry has glob characters; `None` for a plain path.
    glob: Option<globset::GlobMatcher>,
}

impl WeightsFile {
    /// The entry `text`; refused when it is empty, absolute, has `..`, `.` or empty components,
    /// or is not a valid glob.
    pub fn parse(text: &str) -> Result<WeightsFile, String> {
        use std::path::{Component, Path};
        let p = Path::new(text);
        if text.is_empty() {
            return Err("must not be empty".into());
        }
        if p.is_absolute() {
            return Err(format!(
                "must be relative to the checkpoint folder, got `{text}`"
            ));
        }
        if p.components()
            .any(|c| !matches!(c, Component::Normal(_)) || c.as_os_str().is_empty())
        {
            return Err(format!(
                "must be a plain relative path (no `..`, `.` or empty parts), got `{text}`"
            ));
        }
        let matcher = globset::GlobBuilder::new(text)
            .literal_separator(true)
            .build()
            .map_err(|e| format!("is not a valid glob: {e}"))?
            .compile_matcher();
        let has_glob = text.contains(['*', '?', '[', '{']);
        Ok(WeightsFile {
            text: text.to_string(),
            glob: has_glob.then_some(matcher),
        })
    }

    /// The compiled glob, when the entry has glob characters; `None` for a plain path.
    pub fn glob(&self) -> Option<&globset::GlobMatcher> {
        self.glob.as_ref()
    }

    pub fn as_str(&self) -> &str {
        &self.text
    }
}

impl fmt::Display for WeightsFile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

/// A webhook's or Alertmanager's URL: `http://` or `https://` (a URL of these schemes has a
/// host: `http://` alone does not parse).
pub(super) fn http_url(text: &str) -> Result<Url, String> {
    if !(text.starts_with("http://") || text.starts_with("https://")) {
        return Err(format!("must be an http:// or https:// URL, got `{text}`"));
    }
    Url::parse(text).map_err(|e| format!("is not a valid URL ({e}), got `{text}`"))
}

/// A webhook's `secret_env`: the variable's name, and the Standard-Webhooks secret read from it.
/// Its `Debug` shows the name only (the secret's is `***`).
#[derive(Debug, Clone)]
pub struct SecretEnv {
    /// The variable's name; with the URL and the format it identifies the destination in the
    /// alert outbox and ledger.
    pub var: String,
    /// Its value, decoded; `None` when the config was loaded without secrets
    /// (`Config::load_without_secrets`, for commands that send nothing).
    pub secret: Option<Secret>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn weights_files_entries_must_be_plain_relative_paths() {
        for good in [
            "unet/diffusion_pytorch_model.safetensors",
            "*.safetensors.index.json",
            ".metadata",
        ] {
            assert!(WeightsFile::parse(good).is_ok(), "{good}");
        }
        for bad in ["", "/etc/passwd", "../x", "a/../b", "./x", "a[", "x\\"] {
            assert!(WeightsFile::parse(bad).is_err(), "{bad}");
        }
    }
}
