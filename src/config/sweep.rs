//! One run, a sweep or a glob of run folders: [`ConfigFile::settings`] builds the settings of
//! whichever the file gives (`run`, `runs` or `runs_glob`), a sweep's as one run's settings per
//! entry (its problems keyed under `runs[i]`); [`Config::runs`], [`Config::discover_runs`] and
//! [`Config::glob_run`] give each run's settings back.

use super::alerts::SecretLookup;
use super::file::ConfigFile;
use super::run::{MAX_RUNS, RunConfig, RunEntry, valid_run_name};
use super::runs_glob::RunsGlob;
use super::settings::Config;
use super::validate::{Problem, Validator};
use std::path::Path;

impl Config {
    /// Is this a sweep (`runs` or `runs_glob`), even one with no run yet?
    pub fn is_sweep(&self) -> bool {
        !self.sweep.is_empty() || self.runs_glob.is_some()
    }

    /// `runs_glob`: every run's settings as of now, the folders that appeared since the config
    /// was read included; otherwise [`Config::runs`].
    pub fn discover_runs(&self) -> Result<Vec<Config>, Vec<Problem>> {
        let Some(glob) = &self.runs_glob else {
            return Ok(self.runs());
        };
        let mut runs = glob.file.settings(true)?.runs();
        for run in &mut runs {
            run.source.clone_from(&self.source);
        }
        Ok(runs)
    }

    /// `runs_glob`: the settings of the run folder `name` the glob matches now, whether or not
    /// it is among the first `max_runs` by name ([`Config::runs`]): a daemon keeps the runs it
    /// holds when a folder that sorts first appears, and a Slurm job of such a run
    /// (`diffmon eval --run`) must find it. `None` when no such folder matches (or no glob).
    /// The webhooks' secrets are not looked up.
    pub fn glob_run(&self, name: &str) -> Option<Result<Config, Vec<Problem>>> {
        let glob = self.runs_glob.as_ref()?;
        let (name, dir) = glob.matches().into_iter().find(|(n, _)| n == name)?;
        let mut file = (*glob.file).clone();
        file.runs_glob = None;
        let entry = RunEntry {
            name,
            dir,
            state_dir: None,
            data: None,
            alerts: None,
        };
        Some(file.sweep_settings(&[entry], None).map(|run| Config {
            source: self.source.clone(),
            sweep: Vec::new(),
            ..run
        }))
    }

    /// Each watched run's complete settings: this config for a single run, one per entry of
    /// `runs` (or folder `runs_glob` matched) for a sweep (docs/design.md §19).
    pub fn runs(&self) -> Vec<Config> {
        if self.sweep.is_empty() && self.runs_glob.is_none() {
            vec![self.clone()]
        } else {
            // Each from the one config file (the Slurm executor's jobs read it).
            self.sweep
                .iter()
                .map(|c| Config {
                    source: self.source.clone(),
                    ..c.clone()
                })
                .collect()
        }
    }
}

impl ConfigFile {
    /// Every problem of the config, each with its key; empty when it is valid. Includes the
    /// webhooks' secrets, read from the environment.
    pub fn validate(&self) -> Vec<Problem> {
        self.settings(true).err().unwrap_or_default()
    }

    /// The typed settings, or every problem of the config, each with its key. With `secrets`,
    /// each webhook's `secret_env` variable is read from the environment and must hold a
    /// Standard-Webhooks secret; without, it is not looked up (for commands that send
    /// nothing). The only place where the config's values are checked.
    pub fn settings(&self, secrets: bool) -> Result<Config, Vec<Problem>> {
        let env: &SecretLookup = &|var: &str| std::env::var(var);
        self.settings_with(secrets.then_some(env))
    }

    /// [`ConfigFile::settings`] with the secrets' variables looked up by `lookup` (`None`: not
    /// looked up).
    pub(super) fn settings_with(
        &self,
        lookup: Option<&SecretLookup>,
    ) -> Result<Config, Vec<Problem>> {
        let problem = |key: &str, message: &str| {
            Err(vec![Problem {
                key: key.into(),
                message: message.into(),
            }])
        };
        match (&self.run, &self.runs, &self.runs_glob) {
            (Some(run), None, None) => self.run_settings(run, lookup),
            (None, Some(entries), None) => self.sweep_settings(entries, lookup),
            (None, None, Some(glob)) => self.glob_settings(glob, lookup),
            (Some(_), Some(_), _) => problem(
                "runs",
                "cannot be given with `run`: give one run (`run`) or a sweep (`runs`)",
            ),
            (_, _, Some(_)) => problem(
                "runs_glob",
                "cannot be given with `run` or `runs`: give one run (`run`), a list of runs \
                 (`runs`) or a glob of run folders (`runs_glob`)",
            ),
            (None, None, None) => problem(
                "run",
                "missing field `run` (or `runs` or `runs_glob`, for a sweep)",
            ),
        }
    }

    /// A sweep of folders: the runs `pattern` matches now, each with the shared sections, as
    /// `runs` entries with nothing of their own would give; with no match yet, the shared
    /// settings checked as those of a run in the glob's folder. Either way the glob is kept to
    /// find new runs ([`Config::discover_runs`]).
    fn glob_settings(
        &self,
        pattern: &Path,
        lookup: Option<&SecretLookup>,
    ) -> Result<Config, Vec<Problem>> {
        let problem = |key: &str, message: String| {
            vec![Problem {
                key: key.into(),
                message,
            }]
        };
        let glob = RunsGlob::compile(pattern, self).map_err(|m| problem("runs_glob", m))?;
        if self.data.is_none() {
            return Err(problem(
                "data",
                "missing field `data` (the training images of every run `runs_glob` finds)".into(),
            ));
        }
        if self.state_dir.is_some() {
            return Err(problem(
                "state_dir",
                "cannot be given with `runs_glob`: each run keeps its state in its own folder \
                 (`<run>/.diffmon`)"
                    .into(),
            ));
        }
        let mut shared = self.clone();
        shared.runs_glob = None;
        let mut found = glob.matches();
        // At most `max_runs`: first those with a history (runs a daemon watches or watched, so
        // that a folder made later that sorts before them pushes none out of `report` or a
        // restart), then the others by name; the daemon warns about the rest (`daemon/sweep.rs`).
        // The default state folder's journal (`store::history::JOURNAL`; config is below store).
        // Only past the cap: the daemon rescans the glob at every poll.
        if found.len() > self.max_runs {
            let journal = |dir: &Path| dir.join(".diffmon").join("history.jsonl");
            found.sort_by_key(|(_, dir)| !journal(dir).exists()); // stable: by name within each
            found.truncate(self.max_runs);
            found.sort();
        }
        let mut config = if found.is_empty() {
            let run = RunConfig {
                name: Some("runs_glob".into()),
                dir: glob.parent.clone(),
            };
            shared.run_settings(&run, lookup)?
        } else {
            let entries: Vec<RunEntry> = found
                .into_iter()
                .map(|(name, dir)| RunEntry {
                    name,
                    dir,
                    state_dir: None,
                    data: None,
                    alerts: None,
                })
                .collect();
            shared.sweep_settings(&entries, lookup)?
        };
        config.runs_glob = Some(glob);
        Ok(config)
    }

    /// A sweep's settings: each entry's run settings (the shared sections with the entry's own
    /// `state_dir`, `data` and `alerts`), checked as a single run's are; a problem of an entry's
    /// own section is keyed under `runs[i]`, one of a shared section is reported once.
    fn sweep_settings(
        &self,
        entries: &[RunEntry],
        lookup: Option<&SecretLookup>,
    ) -> Result<Config, Vec<Problem>> {
        let mut v = Validator::default();
        v.check(!entries.is_empty(), "runs", "must list at least one run");
        v.count("max_runs", self.max_runs, 1..=MAX_RUNS);
        v.check(
            entries.len() <= self.max_runs,
            "runs",
            format!(
                "lists {} runs; at most {} (max_runs)",
                entries.len(),
                self.max_runs
            ),
        );
        let mut configs = Vec::new();
        for (i, entry) in entries.iter().enumerate().take(self.max_runs.min(MAX_RUNS)) {
            let at = format!("runs[{i}]");
            v.check(
                valid_run_name(&entry.name),
                &format!("{at}.name"),
                format!(
                    "`{}`: a run's name is letters, digits, `.`, `_` or `-` (it is a URL path and a label)",
                    entry.name.escape_debug()
                ),
            );
            if let Some(j) = entries[..i].iter().position(|e| e.name == entry.name) {
                v.problem(
                    &format!("{at}.name"),
                    format!("`{}` is also the name of runs[{j}]", entry.name),
                );
            }
            let mut one = self.clone();
            one.runs = None;
            one.run = Some(RunConfig {
                name: Some(entry.name.clone()),
                dir: entry.dir.clone(),
            });
            if let Some(state_dir) = &entry.state_dir {
                one.state_dir = Some(state_dir.clone());
            } else {
                one.state_dir = None;
            }
            let own = |key: &str| {
                (key.starts_with("data") && entry.data.is_some())
                    || (key.starts_with("alerts") && entry.alerts.is_some())
                    || key.starts_with("state_dir")
            };
            if let Some(data) = &entry.data {
                one.data = Some(data.clone());
            }
            if let Some(alerts) = &entry.alerts {
                one.alerts = alerts.clone();
            }
            match one.run_settings(one.run.as_ref().expect("set above"), lookup) {
                Ok(config) => {
                    let state_dir = config.state_dir();
                    if let Some(j) = configs
                        .iter()
                        .position(|c: &Config| c.state_dir() == state_dir)
                    {
                        v.problem(
                            &format!("{at}.state_dir"),
                            format!(
                                "{} is also the state folder of runs[{j}] (each run needs its own)",
                                state_dir.display()
                            ),
                        );
                    }
                    configs.push(config);
                }
                Err(problems) => {
                    for mut p in problems {
                        // No data of its own, and none at the top level to share.
                        if p.key == "data" && one.data.is_none() {
                            p.message = "missing: this run gives no `data` of its own, and \
                                there is no top-level `data` (the data of the runs that give none)"
                                .into();
                            p.key = format!("{at}.data");
                        }
                        let key = match p.key.strip_prefix("run.") {
                            Some(rest) => format!("{at}.{rest}"),
                            None if own(&p.key) => format!("{at}.{}", p.key),
                            None => p.key.clone(),
                        };
                        let p = Problem { key, ..p };
                        if !v.problems.contains(&p) {
                            v.problems.push(p);
                        }
                    }
                }
            }
        }
        if !v.problems.is_empty() {
            return Err(v.problems);
        }
        let mut first = configs[0].clone();
        first.sweep = configs;
        Ok(first)
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_support::{MINIMAL, settings};
    use super::*;

    const SWEEP: &str = "runs:\n  - {name: a, dir: ra}\n  - {name: b, dir: rb, state_dir: sb, data: {path: h.h5}}\n  \
        - {name: c, dir: rc, alerts: {stop_file: STOP_C}}\nmodel: {architecture: m.ts}\ndata: {path: d.h5}\n\
        icr: {samples: 512}\n";

    /// A sweep is one complete single-run config per entry: its own name, folder, state folder,
    /// data and alerts where it gives them, the shared sections otherwise.
    #[test]
    fn a_sweep_is_one_complete_config_per_run() {
        let c = settings(SWEEP);
        let runs = c.runs();
        let names: Vec<String> = runs.iter().map(|r| r.run_name()).collect();
        assert_eq!(names, ["a", "b", "c"]);
        assert!(runs[0].state_dir().ends_with("ra/.diffmon"));
        assert!(runs[1].state_dir().ends_with("sb"));
        assert!(runs[0].data.path.ends_with("d.h5"));
        assert!(runs[1].data.path.ends_with("h.h5"), "b's own data");
        assert!(runs[2].data.path.ends_with("d.h5"));
        assert_eq!(runs[2].alerts.stop_file, "STOP_C");
        assert_eq!(runs[0].alerts.stop_file, c.alerts.stop_file);
        assert!(
            runs.iter()
                .all(|r| r.icr.samples == 512 && r.sweep.is_empty())
        );
        // The top-level fields are the first run's; a single run is its own only run.
        assert_eq!(c.run_name(), "a");
        let one = settings(MINIMAL);
        assert!(one.sweep.is_empty());
        assert_eq!(one.runs().len(), 1);
        assert_eq!(one.runs()[0].run_name(), one.run_name());
    }

    /// `runs_glob`: the matching folders are the runs, by name, each with the shared sections
    /// and its state in its own folder; hidden folders, links, files and names that are not run
    /// names are not runs; with no match yet the sweep is empty, and a folder that appears is
    /// found by `discover_runs`.
    #[test]
    fn runs_glob_makes_a_run_of_each_matching_folder() {
        let dir = tempfile::tempdir().unwrap();
        let at = dir.path();
        for f in ["m.ts", "d.h5"] {
            std::fs::write(at.join(f), b"").unwrap();
        }
        std::fs::create_dir(at.join("sweep")).unwrap();
        let load = || {
            let text = "runs_glob: sweep/lr-*
model: {architecture: m.ts}
data: {path: d.h5}
";
            let mut file = ConfigFile::parse(text, "c.yaml").unwrap();
            file.resolve_paths(at);
            file.settings(false).unwrap()
        };
        let empty = load();
        assert!(empty.is_sweep());
        assert!(empty.runs().is_empty());
        assert!(empty.discover_runs().unwrap().is_empty());

        for d in ["lr-b", "lr-a", ".lr-hidden", "lr-a b", "other"] {
            std::fs::create_dir(at.join("sweep").join(d)).unwrap();
        }
        std::fs::write(at.join("sweep/lr-file"), b"").unwrap();
        std::os::unix::fs::symlink(at.join("sweep/other"), at.join("sweep/lr-link")).unwrap();
        let names = |runs: &[Config]| runs.iter().map(|r| r.run_name()).collect::<Vec<_>>();
        // Found by the config read before the folders appeared, and by a fresh read.
        assert_eq!(names(&empty.discover_runs().unwrap()), ["lr-a", "lr-b"]);
        let c = load();
        let runs = c.runs();
        assert_eq!(names(&runs), ["lr-a", "lr-b"]);
        assert!(runs[1].run.dir.ends_with("sweep/lr-b"));
        assert!(runs[1].state_dir().ends_with("sweep/lr-b/.diffmon"));
        assert!(runs.iter().all(|r| r.data.path.ends_with("d.h5")));
        assert_eq!(c.run_name(), "lr-a");

        // At `max_runs`, the first by name are the runs; the others are still found by name
        // (the Slurm job of a run the daemon holds, after a folder sorting first appeared).
        let text = "runs_glob: sweep/lr-*\nmax_runs: 1\nmodel: {architecture: m.ts}\n\
                    data: {path: d.h5}\n";
        let mut file = ConfigFile::parse(text, "c.yaml").unwrap();
        file.resolve_paths(at);
        let capped = file.settings(false).unwrap();
        assert_eq!(names(&capped.runs()), ["lr-a"]);
        assert_eq!(names(&capped.discover_runs().unwrap()), ["lr-a"]);
        let b = capped.glob_run("lr-b").unwrap().unwrap();
        assert_eq!(b.run_name(), "lr-b");
        assert!(b.state_dir().ends_with("sweep/lr-b/.diffmon"));
        assert!(b.sweep.is_empty() && b.runs_glob.is_none());
        assert!(capped.glob_run("lr-x").is_none());
        assert!(
            capped.glob_run("other").is_none(),
            "not matched by the glob"
        );
    }

    /// The problems of a config whose model and data files exist (`m.ts`, `d.h5`).
    fn problems(text: &str) -> Vec<String> {
        let dir = tempfile::tempdir().unwrap();
        for f in ["m.ts", "d.h5"] {
            std::fs::write(dir.path().join(f), b"").unwrap();
        }
        let mut file = ConfigFile::parse(text, "c.yaml").unwrap();
        file.resolve_paths(dir.path());
        let problems = file.settings(false).unwrap_err();
        problems.iter().map(|p| p.to_string()).collect()
    }

    /// `runs_glob` is exclusive with `run` and `runs`, takes wildcards in its last component
    /// only, and leaves each run's state in its own folder (no `state_dir`).
    #[test]
    fn runs_glob_problems() {
        let tail = "model: {architecture: m.ts}\ndata: {path: d.h5}\n";
        for (text, expected) in [
            (
                "run: {dir: r}\nruns_glob: s/*\n",
                "runs_glob cannot be given with `run` or `runs`",
            ),
            ("runs_glob: s*/x\n", "runs_glob "),
            ("runs_glob: 's/[a'\n", "is not a valid glob"),
            (
                "runs_glob: s/*\nstate_dir: st\n",
                "state_dir cannot be given with `runs_glob`",
            ),
        ] {
            let p = problems(&format!("{text}{tail}"));
            assert_eq!(p.len(), 1, "{text}: {p:?}");
            assert!(p[0].contains(expected), "{text}: {p:?}");
        }
        assert!(
            problems(&format!("runs_glob: s*/x\n{tail}"))[0]
                .contains("wildcards only in the last component")
        );
    }

    /// A sweep whose every entry gives its own `data` needs none at the top level; an entry
    /// without `data` when there is none to share, a single run and a `runs_glob` without
    /// `data` are each refused with the key.
    #[test]
    fn top_level_data_is_optional_when_every_run_has_its_own() {
        let dir = tempfile::tempdir().unwrap();
        for f in ["m.ts", "a.h5", "b.h5"] {
            std::fs::write(dir.path().join(f), b"").unwrap();
        }
        let load = |text: &str| {
            let mut file = ConfigFile::parse(text, "c.yaml").unwrap();
            file.resolve_paths(dir.path());
            file.settings(false)
                .map_err(|p| p.iter().map(|p| p.to_string()).collect::<Vec<_>>())
        };
        let model = "model: {architecture: m.ts}\n";
        let c = load(&format!(
            "runs:\n  - {{name: a, dir: ra, data: {{path: a.h5}}}}\n  \
             - {{name: b, dir: rb, data: {{path: b.h5}}}}\n{model}"
        ))
        .unwrap();
        let data: Vec<_> = c.runs().iter().map(|r| r.data.path.clone()).collect();
        assert_eq!(data, [dir.path().join("a.h5"), dir.path().join("b.h5")]);

        let e = load(&format!(
            "runs:\n  - {{name: a, dir: ra, data: {{path: a.h5}}}}\n  - {{name: b, dir: rb}}\n{model}"
        ))
        .unwrap_err();
        assert_eq!(e.len(), 1, "{e:?}");
        assert!(
            e[0].starts_with("runs[1].data missing: this run gives no `data` of its own"),
            "{e:?}"
        );
        let e = load(&format!("run: {{dir: r}}\n{model}")).unwrap_err();
        assert_eq!(e.len(), 1, "{e:?}");
        assert!(e[0].starts_with("data missing field `data`"), "{e:?}");
        let e = load(&format!("runs_glob: s/*\n{model}")).unwrap_err();
        assert!(e[0].starts_with("data missing field `data`"), "{e:?}");
    }

    /// Of the folders `runs_glob` matches, at most `max_runs` are runs: first those with a
    /// history (a daemon watches them: a folder made later that sorts before them must not push
    /// them out of `report` or a restart), then the others by name.
    #[test]
    fn runs_glob_keeps_the_runs_with_a_history_at_max_runs() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("m.ts"), b"").unwrap();
        std::fs::write(dir.path().join("d.h5"), b"").unwrap();
        for run in ["lr-2", "lr-3"] {
            let state = dir.path().join("s").join(run).join(".diffmon");
            std::fs::create_dir_all(&state).unwrap();
            std::fs::write(state.join(crate::store::history::JOURNAL), b"").unwrap();
        }
        std::fs::create_dir_all(dir.path().join("s/lr-1")).unwrap(); // made later, sorts first
        let text = "runs_glob: s/lr-*
max_runs: 2
model: {architecture: m.ts}
data: {path: d.h5}
";
        let mut file = ConfigFile::parse(text, "c.yaml").unwrap();
        file.resolve_paths(dir.path());
        let names = || -> Vec<String> {
            let runs = file.settings(false).unwrap().runs();
            runs.iter().map(|r| r.run_name()).collect()
        };
        assert_eq!(names(), ["lr-2", "lr-3"]);
        std::fs::remove_file(
            dir.path()
                .join("s/lr-3/.diffmon")
                .join(crate::store::history::JOURNAL),
        )
        .unwrap();
        assert_eq!(names(), ["lr-1", "lr-2"]);
    }

    /// `run` xor `runs`; names and state folders unique; an entry's own sections' problems are
    /// keyed under it, a shared section's reported once.
    #[test]
    fn sweep_problems_are_keyed_by_entry() {
        let tail = "model: {architecture: m.ts}\ndata: {path: d.h5}\n";
        let both = problems(&format!(
            "run: {{dir: r}}\nruns: [{{name: a, dir: r}}]\n{tail}"
        ));
        assert_eq!(both.len(), 1);
        assert!(
            both[0].starts_with("runs cannot be given with `run`"),
            "{both:?}"
        );
        let neither = problems(tail);
        assert!(
            neither[0].starts_with("run missing field `run`"),
            "{neither:?}"
        );
        let same = problems(&format!(
            "runs: [{{name: a, dir: r}}, {{name: a, dir: s}}, {{name: b, dir: r}}]\n{tail}"
        ));
        assert!(
            same.iter()
                .any(|p| p.starts_with("runs[1].name `a` is also the name of runs[0]")),
            "{same:?}"
        );
        assert!(
            same.iter()
                .any(|p| p.starts_with("runs[2].state_dir") && p.contains("runs[0]")),
            "{same:?}"
        );
        let bad = problems(&format!(
            "runs: [{{name: a, dir: r, data: {{path: x.h5}}}}, {{name: b, dir: s}}]\nicr: {{samples: 0}}\n{tail}"
        ));
        assert!(
            bad.iter().any(|p| p.starts_with("runs[0].data.path")),
            "{bad:?}"
        );
        assert_eq!(
            bad.iter().filter(|p| p.starts_with("icr.samples")).count(),
            1,
            "{bad:?}"
        );
    }
}
