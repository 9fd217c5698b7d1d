//! [`Config`], the settings the program runs on, and what they tell: the files they name, the
//! run's name, the cost of a checkpoint, the early stop's confirmation (`confirm: auto` resolved
//! and the memorization ratio it implies) and summary. A single run's settings are built here
//! ([`ConfigFile::run_settings`]): each section checked in turn by its own file's check, every
//! problem kept.

use super::alerts::{AlertsConfig, SecretLookup, alerts};
use super::checkpoints::{CheckpointsConfig, checkpoints};
use super::early_stop::{
    Confirm, Confirmation, EarlyStopConfig, EarlyStopSettings, check_early_stop,
    implies_memorization,
};
use super::evaluation::{EvaluationConfig, evaluation};
use super::file::ConfigFile;
use super::http::{HttpConfig, http};
use super::icr::{IcrConfig, check_icr};
use super::model::{DataConfig, DeviceSpec, ModelConfig, check_model_data};
use super::pfd::{
    MemorizationConfig, PfdConfig, TailConfig, check_memorization, check_pfd, check_tail,
};
use super::run::{MAX_RUNS, RunConfig};
use super::runs_glob::RunsGlob;
use super::trackers::{TrackersConfig, trackers};
use super::validate::{Problem, Validator};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// PF-ODE latents of the memorization ratio that `early_stop.confirm: auto` turns on when no
/// held-out set is configured and `pfd.enabled` is false (docs/design.md §9): one memorized
/// sample is 0.8% of them, well under the 5% at which the toy runs count as memorizing, for 35 ×
/// 128 network calls per checkpoint.
pub const CONFIRM_LATENTS: usize = 128;

/// The settings the program runs on: a config file's values, each checked and parsed once by
/// [`ConfigFile::settings`] (through [`Config::load`]). The sections keep the file's names; keys
/// given in seconds are [`Duration`]s here, without the `_secs`.
#[derive(Debug, Clone)]
pub struct Config {
    pub run: RunConfig,
    /// Where diffmon keeps its history, alert outbox, caches, lock and crash marker.
    /// Default: `<run.dir>/.diffmon`.
    pub state_dir: Option<PathBuf>,
    pub checkpoints: CheckpointsConfig,
    pub model: ModelConfig,
    pub device: DeviceSpec,
    /// CPU threads of libtorch's operations (default: libtorch's choice, one per core).
    pub cpu_threads: Option<usize>,
    /// `shutdown_drain_secs`: how long the first SIGINT/SIGTERM waits for the evaluation in
    /// flight before the daemon exits anyway.
    pub shutdown_drain: Duration,
    pub data: DataConfig,
    pub icr: IcrConfig,
    pub pfd: PfdConfig,
    pub memorization: MemorizationConfig,
    pub tail: TailConfig,
    pub early_stop: EarlyStopConfig,
    pub alerts: AlertsConfig,
    pub http: HttpConfig,
    pub evaluation: EvaluationConfig,
    /// `trackers`: where the numbers are also written (TensorBoard); none by default.
    pub trackers: TrackersConfig,
    /// The config file this was read from (`None`: built from text); the Slurm executor's jobs
    /// read it.
    pub source: Option<PathBuf>,
    /// The memorization ratio (and, with `pfd.enabled: false`, a PF-ODE of
    /// [`CONFIRM_LATENTS`] latents) was turned on by `early_stop.confirm: auto` without a
    /// held-out set ([`Config::imply_memorization`]); not a key.
    pub implied_memorization: bool,
    /// Of these, the PF-ODE itself (`pfd.enabled` was false).
    pub implied_pf_ode: bool,
    /// A sweep (`runs`, or the folders `runs_glob` matches): each run's complete settings, in
    /// the file's order (by name for `runs_glob`); empty for a single run. The fields above are
    /// then the first run's. See [`Config::runs`].
    pub sweep: Vec<Config>,
    /// `runs_glob`: how to find the sweep's runs again, as folders appear. With no match yet,
    /// `sweep` is empty and the fields above are the shared settings, checked as those of a run
    /// in the glob's folder.
    pub runs_glob: Option<RunsGlob>,
    /// `max_runs`: the most runs of a sweep (1 to [`MAX_RUNS`]).
    pub max_runs: usize,
}

impl Config {
    /// Files the config names that may sit in `run.dir` and are never checkpoints: the
    /// architecture, the data, the teacher, descriptor and latents, the stop file and the state
    /// folder.
    pub fn named_files(&self) -> Vec<PathBuf> {
        let mut v = vec![
            self.model.architecture.clone(),
            self.data.path.clone(),
            self.run.dir.join(&self.alerts.stop_file),
            self.state_dir(),
        ];
        v.extend(
            [
                &self.model.vae,
                &self.data.heldout_path,
                &self.data.latents_path,
                &self.pfd.teacher,
                &self.pfd.descriptor,
                &self.pfd.latents,
            ]
            .into_iter()
            .flatten()
            .cloned(),
        );
        v
    }

    /// The label `run` on every metric.
    pub fn run_name(&self) -> String {
        self.run.name.clone().unwrap_or_else(|| {
            let dir = std::fs::canonicalize(&self.run.dir).unwrap_or_else(|_| self.run.dir.clone());
            // The folder's name, its control characters escaped (it reaches logs and labels).
            dir.file_name()
                .map(|n| {
                    n.to_string_lossy()
                        .chars()
                        .flat_map(|c| match c.is_control() {
                            true => c.escape_default().collect::<Vec<char>>(),
                            false => vec![c],
                        })
                        .collect()
                })
                .unwrap_or_else(|| "run".into())
        })
    }

    /// What one checkpoint costs in network calls (one image through the network), per metric:
    /// one line for `check-config` and the daemon's start. ICR is two views per pair (and again
    /// per sweep sigma), the gap one call per training and held-out image (at most
    /// `icr.samples` each), PFD the student's PF-ODE, `2·steps − 1` calls per latent.
    pub fn cost_summary(&self) -> String {
        let mut parts = Vec::new();
        let n = self.icr.samples;
        if self.icr.enabled {
            let sigmas = 1 + self.icr.sigmas.as_ref().map_or(0, Vec::len);
            let times = if sigmas > 1 {
                format!(" x {sigmas} sigmas")
            } else {
                String::new()
            };
            parts.push(format!("ICR {} (2 x icr.samples{times})", 2 * n * sigmas));
        }
        if self.data.heldout_path.is_some() {
            parts.push(format!("gap up to {} (train and held-out images)", 2 * n));
        }
        if self.pfd.enabled {
            let per_latent = 2 * self.pfd.steps - 1;
            let every = match self.pfd.every {
                1 => "every checkpoint".to_string(),
                k => format!("every {k}{} checkpoint", ordinal_suffix(k)),
            };
            let (what, why) = if self.implied_pf_ode {
                (
                    "memorization ratio",
                    ", for early_stop.confirm: auto without data.heldout_path",
                )
            } else {
                ("PFD", "")
            };
            parts.push(match &self.pfd.latents {
                Some(_) => format!("{what} {per_latent} per latent of pfd.latents, {every}{why}"),
                None if self.implied_pf_ode => format!(
                    "{what} {} ({per_latent} x {} latents, {every}{why})",
                    per_latent * self.pfd.samples,
                    self.pfd.samples
                ),
                None => format!(
                    "{what} {} ({per_latent} x pfd.samples, {every})",
                    per_latent * self.pfd.samples
                ),
            });
        }
        format!(
            "network calls per checkpoint: {} (docs/guide/cost-and-gpu.md, \"Cost per checkpoint\")",
            parts.join(", ")
        )
    }

    /// `early_stop.confirm` resolved: `auto` is the generalization gap when a held-out set is
    /// configured, else the memorization ratio (docs/design.md §9).
    pub fn confirmation(&self) -> Confirmation {
        match self.early_stop.confirm {
            Confirm::Auto if self.data.heldout_path.is_some() => Confirmation::GeneralizationGap,
            Confirm::Auto | Confirm::MemorizationRatio => Confirmation::MemorizationRatio,
            Confirm::GeneralizationGap => Confirmation::GeneralizationGap,
            Confirm::None => Confirmation::None,
        }
    }

    /// The detector's settings, with `confirm: auto` resolved ([`Config::confirmation`]).
    pub fn early_stop_resolved(&self) -> EarlyStopSettings {
        EarlyStopSettings::of(&self.early_stop, self.confirmation())
    }

    /// Does `early_stop.confirm: auto` need the memorization ratio that the config does not
    /// compute? (No held-out set, and `memorization.enabled` false.)
    fn needs_implied_memorization(&self) -> bool {
        implies_memorization(&self.early_stop, &self.data, &self.memorization)
    }

    /// Turns on what `early_stop.confirm: auto` without a held-out set confirms by: the
    /// memorization ratio, computed from the PF-ODE samples of PFD when `pfd.enabled`, else from
    /// [`CONFIRM_LATENTS`] latents integrated for it alone (the other `pfd.*` keys as written;
    /// E_mem comes with them). For the commands that evaluate for the early stop (`eval`,
    /// `watch`) and `check-config`, after [`Config::load`], which validates the config as
    /// written (`bias-variance` keeps its `pfd.samples`).
    pub fn imply_memorization(&mut self) {
        if !self.needs_implied_memorization() {
            return;
        }
        self.memorization.enabled = true;
        if !self.pfd.enabled {
            self.pfd.enabled = true;
            self.pfd.samples = CONFIRM_LATENTS;
            self.implied_pf_ode = true;
        }
        self.implied_memorization = true;
    }

    /// What the early stop, as configured, can and cannot tell apart (for `check-config`).
    pub fn early_stop_summary(&self) -> String {
        let e = &self.early_stop;
        let metric = e.metric.as_str();
        let rule = if e.noise_multiple > 0.0 {
            format!(
                "fires when the smoothed {metric} rises above its best by more than min_rise \
                 ({}) and {} times its own noise",
                e.min_rise, e.noise_multiple
            )
        } else {
            format!(
                "fires when the smoothed {metric} rises above its best by more than min_rise \
                 ({}); noise_multiple is 0, so a rise of noise alone can fire it",
                e.min_rise
            )
        };
        let confirm = match self.confirmation() {
            Confirmation::GeneralizationGap => "confirmed by the generalization gap \
                (data.heldout_path): tells a model that memorizes (the held-out loss rises above \
                the training loss) from a steady rise of the metric in data-rich training, \
                provided the training job never sees the held-out images"
                .to_string(),
            Confirmation::MemorizationRatio => {
                let source = match (self.implied_memorization, self.implied_pf_ode) {
                    (true, true) => format!(
                        " (early_stop.confirm: auto without data.heldout_path; from {} PF-ODE \
                         latents of its own, {} network calls per checkpoint)",
                        self.pfd.samples,
                        (2 * self.pfd.steps - 1) * self.pfd.samples
                    ),
                    (true, false) => " (early_stop.confirm: auto without data.heldout_path; \
                        from the PFD samples)"
                        .to_string(),
                    _ => String::new(),
                };
                format!(
                    "confirmed by the memorization ratio{source}: tells a model that memorizes \
                     (its samples copy training images) from a steady rise of the metric in \
                     data-rich training, but sees only copies of the images in data.path, so \
                     that file must hold the whole training set"
                )
            }
            Confirmation::None => "unconfirmed (early_stop.confirm: none): tells a turn from \
                noise, but not a model that memorizes from a steady rise of the metric in \
                data-rich training (about 2% on the full digits set, with no memorization)"
                .to_string(),
        };
        let memorization = match (e.memorization_level > 0.0, self.memorization.enabled) {
            (true, true) => format!(
                "; it also fires once the memorization ratio reaches {} \
                 (early_stop.memorization_level), turned or not, naming the best checkpoint \
                 evaluated before that",
                e.memorization_level
            ),
            (true, false) => "; no memorization ratio is computed (memorization.enabled is \
                false), so early_stop.memorization_level has nothing to watch"
                .to_string(),
            (false, _) => String::new(),
        };
        format!(
            "early stop: {rule}; {confirm}{memorization} (docs/guide/early-stop.md, \"The detector\")"
        )
    }

    pub fn state_dir(&self) -> PathBuf {
        self.state_dir
            .clone()
            .unwrap_or_else(|| self.run.dir.join(".diffmon"))
    }

    /// This config with its state folder reached through `path` (the daemon's held handle,
    /// `crate::store::state_dir`), for the evaluator, which writes caches and the crash marker there.
    pub fn writing_state_through(&self, path: &Path) -> Config {
        Config {
            state_dir: Some(path.to_path_buf()),
            ..self.clone()
        }
    }
}

impl ConfigFile {
    /// A single run's settings.
    pub(super) fn run_settings(
        &self,
        run: &RunConfig,
        lookup: Option<&SecretLookup>,
    ) -> Result<Config, Vec<Problem>> {
        let mut v = Validator::default();
        if let Some(name) = &run.name {
            // As a sweep's run names are: a name holding a newline or ESC would forge log lines
            // and reach the terminal and the metrics' label raw.
            v.check(
                super::run::valid_run_name(name),
                "run.name",
                format!(
                    "`{}`: a run's name is letters, digits, `.`, `_` or `-` (it is a URL path and a label)",
                    name.escape_debug()
                ),
            );
        }

        let checkpoints = checkpoints(&mut v, &self.checkpoints);

        if let Some(n) = self.cpu_threads {
            v.count("cpu_threads", n, 1..=1024);
        }
        v.count("max_runs", self.max_runs, 1..=MAX_RUNS);
        let shutdown_drain = v.secs(
            "shutdown_drain_secs",
            self.shutdown_drain_secs,
            0.1..=86_400.0,
        );
        match &self.data {
            Some(data) => check_model_data(&mut v, &self.model, data, self.icr.enabled),
            None => v.problem(
                "data",
                "missing field `data` (the training images: `data: {path: train.h5}`)",
            ),
        }
        check_icr(&mut v, &self.icr);
        check_pfd(&mut v, &self.pfd);
        check_memorization(&mut v, &self.memorization, &self.pfd);
        check_tail(&mut v, &self.tail, &self.pfd);
        if let Some(data) = &self.data {
            check_early_stop(
                &mut v,
                &self.early_stop,
                &self.icr,
                &self.pfd,
                &self.memorization,
                data,
            );
        }

        let alerts = alerts(&mut v, &self.alerts, lookup);
        let http = http(&mut v, &self.http);
        let evaluation = evaluation(&mut v, &self.evaluation);
        let trackers = trackers(&mut v, &self.trackers, lookup);

        match (
            checkpoints,
            shutdown_drain,
            alerts,
            http,
            evaluation,
            trackers,
            &self.data,
        ) {
            (
                Some(checkpoints),
                Some(shutdown_drain),
                Some(alerts),
                Some(http),
                Some(evaluation),
                Some(trackers),
                Some(data),
            ) if v.problems.is_empty() => Ok(Config {
                run: run.clone(),
                state_dir: self.state_dir.clone(),
                checkpoints,
                model: self.model.clone(),
                device: self.device,
                cpu_threads: self.cpu_threads,
                shutdown_drain,
                data: data.clone(),
                icr: self.icr.clone(),
                pfd: self.pfd.clone(),
                memorization: self.memorization.clone(),
                tail: self.tail.clone(),
                early_stop: self.early_stop.clone(),
                alerts,
                http,
                evaluation,
                trackers,
                source: None,
                implied_memorization: false,
                implied_pf_ode: false,
                sweep: Vec::new(),
                runs_glob: None,
                max_runs: self.max_runs,
            }),
            _ => Err(v.problems),
        }
    }
}

/// `st`, `nd`, `rd` or `th`, as English writes the ordinal of `k`.
fn ordinal_suffix(k: usize) -> &'static str {
    match (k % 10, k % 100) {
        (_, 11..=13) => "th",
        (1, _) => "st",
        (2, _) => "nd",
        (3, _) => "rd",
        _ => "th",
    }
}

#[cfg(test)]
mod tests {
    use super::super::early_stop::Smoother;
    use super::super::icr::BiasCorrection;
    use super::super::load::ConfigError;
    use super::super::test_support::{MINIMAL, settings};
    use super::*;
    use std::net::SocketAddr;

    #[test]
    fn ordinals_read_as_english() {
        let got: Vec<String> = [1, 2, 3, 4, 11, 12, 13, 21, 22, 102, 111]
            .map(|k| format!("{k}{}", ordinal_suffix(k)))
            .to_vec();
        assert_eq!(
            got,
            [
                "1st", "2nd", "3rd", "4th", "11th", "12th", "13th", "21st", "22nd", "102nd",
                "111th"
            ]
        );
    }

    #[test]
    fn the_cost_summary_counts_network_calls_per_metric() {
        let c = settings(MINIMAL);
        assert_eq!(
            c.cost_summary(),
            "network calls per checkpoint: ICR 8192 (2 x icr.samples) (docs/guide/cost-and-gpu.md, \"Cost per checkpoint\")"
        );
        let text = format!(
            "{MINIMAL}icr: {{samples: 100, sigmas: [0.1, 1.0]}}\n\
             pfd: {{enabled: true, samples: 10000, every: 5}}\n"
        );
        let text = text.replace(
            "data: {path: d.h5}",
            "data: {path: d.h5, heldout_path: h.h5}",
        );
        let c = settings(&text);
        assert_eq!(
            c.cost_summary(),
            "network calls per checkpoint: ICR 600 (2 x icr.samples x 3 sigmas), gap up to 200 \
             (train and held-out images), PFD 350000 (35 x pfd.samples, every 5th checkpoint) \
             (docs/guide/cost-and-gpu.md, \"Cost per checkpoint\")"
        );
    }

    #[test]
    fn defaults_follow_the_design() {
        let c = settings(MINIMAL);
        assert_eq!(c.icr.samples, 4096);
        assert_eq!(c.icr.sigma, 0.29);
        assert_eq!(c.icr.ridge, 1e-4);
        assert_eq!(c.icr.bias_correction, BiasCorrection::None);
        assert_eq!(c.pfd.samples, 10_000);
        assert_eq!(
            (c.pfd.steps, c.pfd.sigma_min, c.pfd.sigma_max, c.pfd.rho),
            (18, 0.002, 80.0, 7.0)
        );
        assert_eq!(c.early_stop.window, 3);
        assert_eq!(c.early_stop.smoother, Smoother::Median);
        assert_eq!(c.early_stop.min_rise, 0.005);
        assert_eq!(c.early_stop.noise_multiple, 6.0);
        assert!(c.early_stop.keep_best);
        assert_eq!(c.early_stop.confirm, Confirm::Auto);
        assert_eq!(
            c.early_stop_resolved().confirm,
            Confirmation::MemorizationRatio
        );
        let with_heldout = MINIMAL.replace("{path: d.h5}", "{path: d.h5, heldout_path: h.h5}");
        let c = settings(&with_heldout);
        assert_eq!(
            c.early_stop_resolved().confirm,
            Confirmation::GeneralizationGap
        );
        assert_eq!(c.data.dataset, "images");
        assert_eq!(c.alerts.stop_file, "EARLY_STOP");
        assert_eq!(c.http.listen, SocketAddr::from(([127, 0, 0, 1], 9464)));
        assert_eq!(
            (c.http.header_timeout, c.http.idle_timeout),
            (Duration::from_secs(10), Duration::from_secs(60))
        );
        assert_eq!(c.http.max_connections.get(), 256);
        assert_eq!(
            (c.checkpoints.settle, c.checkpoints.poll, c.shutdown_drain),
            (
                Duration::from_secs(2),
                Duration::from_secs(10),
                Duration::from_secs(120)
            )
        );
        assert_eq!(
            c.checkpoints.pattern.as_str(),
            "{*.pt,*.pth,*.ckpt,*.safetensors,*.bin,*.pkl,*.ts,checkpoint-*,checkpoint_*}"
        );
        assert_eq!(c.checkpoints.step_regex.as_str(), r"(\d+)\D*$");
        assert!(c.checkpoints.weights_files.is_none());
        assert_eq!(
            c.checkpoints.max_entry_mib,
            crate::weights::DEFAULT_MAX_ENTRY_MIB
        );
        assert_eq!(c.checkpoints.max_total_mib, None);
        assert_eq!(c.device, DeviceSpec::Auto);
        assert_eq!(c.run_name(), "r");
        assert_eq!(c.memorization.threshold(), 1.0 / 3.0);
    }

    #[test]
    fn validation_reports_every_problem_with_its_key() {
        let text = format!(
            "{MINIMAL}pfd: {{samples: 0, sigma_min: 1, sigma_max: 0.5}}\nicr: {{sigma: -1}}\n\
             http: {{listen: nowhere}}\nalerts: {{stop_file: ../x, webhooks: [{{url: ftp://a, secret_env: DIFFMON_TEST_UNSET_VAR}}]}}\n"
        );
        let c = ConfigFile::parse(&text, "t.yaml").unwrap();
        let keys: Vec<String> = c.validate().into_iter().map(|p| p.to_string()).collect();
        let has = |s: &str| keys.iter().any(|k| k.starts_with(s));
        assert!(has("pfd.samples must be ≥ 1, got 0"), "{keys:?}");
        assert!(
            has("pfd.sigma_max must be greater than pfd.sigma_min"),
            "{keys:?}"
        );
        assert!(has("icr.sigma must be > 0, got -1"), "{keys:?}");
        assert!(has("http.listen"), "{keys:?}");
        assert!(has("alerts.stop_file"), "{keys:?}");
        assert!(has("alerts.webhooks[0].url"), "{keys:?}");
        assert!(
            has(
                "alerts.webhooks[0].secret_env names the environment variable DIFFMON_TEST_UNSET_VAR"
            ),
            "{keys:?}"
        );
        assert!(
            has("model.architecture names m.ts, which does not exist"),
            "{keys:?}"
        );
        assert!(has("data.path names d.h5"), "{keys:?}");
    }

    /// A loaded config in a folder holding the files it names: [`MINIMAL`] and `extra`
    /// (whose `data:` line, if any, replaces the minimal one).
    fn loaded(extra: &str) -> Result<Config, ConfigError> {
        let dir = tempfile::tempdir().unwrap();
        for f in ["m.ts", "d.h5", "h.h5", "desc.ts"] {
            std::fs::write(dir.path().join(f), b"").unwrap();
        }
        let base = if extra.contains("data:") {
            MINIMAL.replace("data: {path: d.h5}\n", "")
        } else {
            MINIMAL.to_string()
        };
        let file = dir.path().join("c.yaml");
        std::fs::write(&file, format!("{base}{extra}")).unwrap();
        let mut config = Config::load(&file)?;
        config.imply_memorization();
        Ok(config)
    }

    /// `confirm: auto` without a held-out set confirms by the memorization ratio, which
    /// `imply_memorization` turns on: with PFD off, from `CONFIRM_LATENTS` PF-ODE latents (counted in the
    /// cost summary); with PFD on, from its samples. A held-out set, an explicit confirmation
    /// or the ratio already enabled leave the config as written.
    #[test]
    fn auto_without_heldout_data_turns_the_memorization_ratio_on() {
        let c = loaded("").unwrap();
        assert!(c.memorization.enabled && c.pfd.enabled && c.implied_memorization);
        assert_eq!(c.pfd.samples, CONFIRM_LATENTS);
        assert_eq!(
            c.cost_summary(),
            "network calls per checkpoint: ICR 8192 (2 x icr.samples), memorization ratio 4480 \
             (35 x 128 latents, every checkpoint, for early_stop.confirm: auto without \
             data.heldout_path) (docs/guide/cost-and-gpu.md, \"Cost per checkpoint\")"
        );
        assert!(
            c.early_stop_summary()
                .contains("confirmed by the memorization ratio (early_stop.confirm: auto"),
            "{}",
            c.early_stop_summary()
        );
        let c = loaded("pfd: {enabled: true, samples: 500}\n").unwrap();
        assert!(c.memorization.enabled && c.implied_memorization && !c.implied_pf_ode);
        assert_eq!(c.pfd.samples, 500);
        for extra in [
            "early_stop: {confirm: none}\n",
            "data: {path: d.h5, heldout_path: h.h5}\n",
        ] {
            let c = loaded(extra).unwrap();
            assert!(!c.memorization.enabled && !c.pfd.enabled, "{extra}");
            assert!(!c.implied_memorization);
        }
        // Validation checks the config as written: the implied PF-ODE does not satisfy a key
        // that needs pfd.enabled.
        let e = loaded("tail: {enabled: true, reference: training}\n").unwrap_err();
        assert!(
            e.to_string().contains("tail.enabled needs pfd.enabled"),
            "{e}"
        );
        // The implied ratio's criterion must be computable.
        let e = loaded("memorization: {criterion: cosine}\n").unwrap_err();
        assert!(
            e.to_string()
                .contains("memorization.criterion `cosine` needs a descriptor model"),
            "{e}"
        );
    }

    /// `check-config` says what each configuration can and cannot tell apart.
    #[test]
    fn the_early_stop_summary_says_what_each_confirmation_tells_apart() {
        let summary = |extra: &str| loaded(extra).unwrap().early_stop_summary();
        let gap = summary(
            "early_stop: {confirm: generalization_gap}\ndata: {path: d.h5, heldout_path: h.h5}\n",
        );
        assert!(gap.contains("confirmed by the generalization gap"), "{gap}");
        assert!(gap.contains("never sees the held-out images"), "{gap}");
        let memorization = summary("");
        assert!(
            memorization.contains("must hold the whole training set"),
            "{memorization}"
        );
        assert!(
            memorization.contains("also fires once the memorization ratio reaches 0.05"),
            "{memorization}"
        );
        assert!(gap.contains("has nothing to watch"), "{gap}");
        let off = summary("early_stop: {memorization_level: 0}\n");
        assert!(!off.contains("memorization_level"), "{off}");
        let none = summary("early_stop: {confirm: none}\n");
        assert!(
            none.contains("not a model that memorizes from a steady rise"),
            "{none}"
        );
        assert!(
            none.contains("min_rise (0.005) and 6 times its own noise"),
            "{none}"
        );
        let no_noise = summary("early_stop: {confirm: none, noise_multiple: 0}\n");
        assert!(
            no_noise.contains("a rise of noise alone can fire it"),
            "{no_noise}"
        );
    }

    /// Every value that is a string or a number of seconds in the file is parsed once into the
    /// value its users need.
    #[test]
    fn settings_hold_parsed_values() {
        let c = settings(&format!(
            "{MINIMAL}checkpoints: {{pattern: 'ckpt_*.pt', step_regex: 'step=(\\d+)', \
             settle_secs: 0.25, poll_secs: 1.5, weights_files: [unet/w.bin, '*/model.*']}}\n\
             shutdown_drain_secs: 3\n\
             http: {{listen: '[::1]:9000', header_timeout_secs: 0.5, idle_timeout_secs: 7, \
             max_connections: 3}}\n"
        ));
        let k = &c.checkpoints;
        assert!(k.pattern.is_match("ckpt_10.pt") && !k.pattern.is_match("ckpt_10.pth"));
        assert_eq!(k.step_regex.step_in("epoch=3-step=400.ckpt"), Some(400));
        assert_eq!(k.step_regex.step_in("ckpt_10.pt"), None);
        assert_eq!(
            (k.settle, k.poll, c.shutdown_drain),
            (
                Duration::from_millis(250),
                Duration::from_millis(1500),
                Duration::from_secs(3)
            )
        );
        let files = k.weights_files.as_ref().unwrap();
        assert_eq!(files[0].as_str(), "unet/w.bin");
        assert!(files[0].glob().is_none(), "a plain path is not a glob");
        let glob = files[1].glob().unwrap();
        assert!(glob.is_match("unet/model.safetensors"));
        assert!(
            !glob.is_match("a/unet/model.safetensors"),
            "`*` crosses no `/`"
        );
        assert_eq!(c.http.listen, "[::1]:9000".parse::<SocketAddr>().unwrap());
        assert_eq!(c.http.header_timeout, Duration::from_millis(500));
        assert_eq!(c.http.idle_timeout, Duration::from_secs(7));
        assert_eq!(c.http.max_connections.get(), 3);
    }
}
