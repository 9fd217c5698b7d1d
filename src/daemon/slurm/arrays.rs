//! Job arrays: the driver script of items submitted together as one array (`sbatch --array`);
//! the ids of an array's tasks as `squeue` shows them.

use crate::daemon::jobs::quoted;
use std::path::PathBuf;

/// Most tasks in one job array (Slurm's default `MaxArraySize` is 1001).
pub(super) const MAX_ARRAY_TASKS: usize = 1000;

/// The driver `array.sh` of a job array whose task `i` runs `folders[i]`'s `job.sh`, its output
/// in that folder's file `output`.
pub(super) fn driver(folders: &[PathBuf], output: &str) -> String {
    let mut driver =
        String::from("#!/bin/sh\n# diffmon watch: a job array\ncase \"$SLURM_ARRAY_TASK_ID\" in\n");
    for (i, dir) in folders.iter().enumerate() {
        driver += &format!(
            "{i}) exec /bin/sh {} > {} 2>&1 ;;\n",
            quoted(&dir.join("job.sh").display().to_string()),
            quoted(&dir.join(output).display().to_string()),
        );
    }
    driver + "*) echo \"no task $SLURM_ARRAY_TASK_ID\" >&2; exit 1 ;;\nesac\n"
}

/// Bound on the tasks read from one line of `squeue` (`<id>_[0-99999]`).
const MAX_QUEUE_TASKS: usize = 100_000;

/// The job ids one `squeue` id stands for: itself, or for the pending tasks of an array that
/// `squeue` shows as one line, `<id>_[0-3,7%2]`, each task's `<id>_<index>` (the `%` limit
/// dropped).
pub(super) fn queue_ids(id: &str) -> Vec<String> {
    let Some((base, rest)) = id.split_once("_[") else {
        return vec![id.to_string()];
    };
    let ranges = rest.trim_end_matches(']');
    let ranges = ranges.split('%').next().unwrap_or("");
    let mut ids = Vec::new();
    for part in ranges.split(',') {
        let (low, high) = part.split_once('-').unwrap_or((part, part));
        let (Ok(low), Ok(high)) = (low.trim().parse::<usize>(), high.trim().parse::<usize>())
        else {
            continue;
        };
        for index in low..=high.min(low.saturating_add(MAX_QUEUE_TASKS)) {
            if ids.len() >= MAX_QUEUE_TASKS {
                return ids;
            }
            ids.push(format!("{base}_{index}"));
        }
    }
    ids
}

/// The array's own id in a task's id (`<id>_<index>`, `<id>_[0-3]`), or the job's id.
pub(super) fn array_id(id: &str) -> &str {
    id.split('_').next().unwrap_or(id)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `squeue`'s ids: a job, a running task, and pending tasks folded into one line (with a
    /// limit of tasks at once), each task as `<id>_<index>`; the array's id of a task.
    #[test]
    fn queue_ids_expand_an_arrays_pending_tasks() {
        assert_eq!(queue_ids("41"), ["41"]);
        assert_eq!(queue_ids("42_3"), ["42_3"]);
        assert_eq!(queue_ids("42_[0-3]"), ["42_0", "42_1", "42_2", "42_3"]);
        assert_eq!(queue_ids("42_[1,4-5%2]"), ["42_1", "42_4", "42_5"]);
        assert_eq!(queue_ids("42_[x-y]"), Vec::<String>::new());
        assert_eq!(queue_ids("42_[0-99999999999]").len(), MAX_QUEUE_TASKS);
        assert_eq!(array_id("42_3"), "42");
        assert_eq!(array_id("42_[0-3]"), "42");
        assert_eq!(array_id("41"), "41");
    }
}
