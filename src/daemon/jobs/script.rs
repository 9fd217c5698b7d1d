//! What a job runs, whatever the scheduler: its script `job.sh`, which runs `diffmon eval --json`
//! and leaves `record.json` and `status` in the job's folder; its name; quoting for `sh`.

use crate::daemon::watcher::WorkItem;
use std::path::Path;

/// `text` in single quotes for `sh`.
pub fn quoted(text: &str) -> String {
    format!("'{}'", text.replace('\'', r"'\''"))
}

/// A job's name: `diffmon-<run>-<step>` with characters outside `[A-Za-z0-9._-]` as `_`.
pub(super) fn job_name(run: &str, step: i64) -> String {
    let run: String = run
        .chars()
        .take(64)
        .map(|c| {
            if c.is_ascii_alphanumeric() || "._-".contains(c) {
                c
            } else {
                '_'
            }
        })
        .collect();
    format!("diffmon-{run}-{step}")
}

/// The script of one job.
pub(super) fn script(
    binary: &Path,
    config: &Path,
    run: Option<&str>,
    folder: &Path,
    item: &WorkItem,
    index: usize,
) -> String {
    let dir = quoted(&folder.display().to_string());
    let run = run
        .map(|r| format!(" --run {}", quoted(r)))
        .unwrap_or_default();
    format!(
        "#!/bin/sh\n\
         # diffmon watch: evaluation of step {step}\n\
         dir={dir}\n\
         {bin} eval --json --failure-lines --evaluated-before {index} --job-folder \"$dir\" --config {config}{run} -- {checkpoint} > \"$dir/record.json.tmp\"\n\
         status=$?\n\
         # Stopped by SIGTERM (cancelled, a time limit, preemption): no status, so the job's\n\
         # state in the scheduler says why, not the signal's exit status.\n\
         [ \"$status\" -ne 143 ] || exit 143\n\
         mv -f \"$dir/record.json.tmp\" \"$dir/record.json\"\n\
         echo \"$status\" > \"$dir/status.tmp\" && mv -f \"$dir/status.tmp\" \"$dir/status\"\n\
         exit \"$status\"\n",
        step = item.step,
        bin = quoted(&binary.display().to_string()),
        config = quoted(&config.display().to_string()),
        // In place, not its pin: a job outlives the daemon that submitted it (it is adopted
        // after a restart), its pins do not.
        checkpoint = quoted(&item.path.display().to_string()),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::Command;

    /// Quoting survives every character a checkpoint's name may hold.
    #[test]
    fn quoted_text_is_one_word_for_sh() {
        for text in ["plain", "it's", "a b", "$(touch x)", "new\nline", "'\"`\\"] {
            let out = Command::new("sh")
                .arg("-c")
                .arg(format!("printf %s {}", quoted(text)))
                .output()
                .unwrap();
            assert_eq!(String::from_utf8_lossy(&out.stdout), text);
        }
    }

    #[test]
    fn job_names_keep_to_safe_characters() {
        assert_eq!(job_name("run 1/x", 300), "diffmon-run_1_x-300");
    }
}
