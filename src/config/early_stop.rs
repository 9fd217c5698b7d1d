//! The `early_stop` section (docs/design.md §9): the monitored metric, the smoother and the
//! rule's numbers, and the confirming signal, as written ([`EarlyStopConfig`]) and as the
//! detector applies them, `confirm: auto` resolved ([`EarlyStopSettings`]); the ranges of its
//! values and what it needs of the other sections.

use super::icr::IcrConfig;
use super::model::DataConfig;
use super::pfd::{MemorizationConfig, MemorizationCriterion, PfdConfig};
use super::validate::{Problem, Validator};
use crate::record::Evaluation;
use serde::{Deserialize, Serialize};

/// The series the early-stop detector watches (`early_stop.metric`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum EarlyStopMetric {
    Icr,
    PfdGeneralization,
}

impl EarlyStopMetric {
    /// Its name: the config value, the evaluation record's field, and the `metric` of the
    /// early-stop events (JSON and alert labels).
    pub const fn as_str(self) -> &'static str {
        match self {
            EarlyStopMetric::Icr => "icr",
            EarlyStopMetric::PfdGeneralization => "pfd_generalization",
        }
    }

    /// Its value in an evaluation record; `None` when it was not computed.
    pub fn value(self, r: &Evaluation) -> Option<f64> {
        match self {
            EarlyStopMetric::Icr => r.icr,
            EarlyStopMetric::PfdGeneralization => r.pfd_generalization,
        }
    }
}

/// Why the early stop fired: the `trigger` of the early-stop events (JSON and alert
/// annotation) and of `diffmon replay`'s summary.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Trigger {
    /// The curve turned, and the confirmation signal rose. Also what an event stored before
    /// the field existed reads as.
    #[default]
    Turn,
    /// The memorization ratio reached `early_stop.memorization_level`, turned or not.
    Memorization,
}

impl Trigger {
    /// Its name, as the event JSON writes it.
    pub const fn as_str(self) -> &'static str {
        match self {
            Trigger::Turn => "turn",
            Trigger::Memorization => "memorization",
        }
    }
}

/// `early_stop.confirm` as written: a confirming signal, or `auto` (resolved by
/// [`Config::early_stop_resolved`](super::Config::early_stop_resolved) into a [`Confirmation`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Confirm {
    /// `generalization_gap` when `data.heldout_path` is set, else `memorization_ratio`.
    Auto,
    None,
    GeneralizationGap,
    MemorizationRatio,
}

impl Confirm {
    /// Its name, as the config writes it.
    pub const fn as_str(self) -> &'static str {
        match self {
            Confirm::Auto => "auto",
            Confirm::None => "none",
            Confirm::GeneralizationGap => "generalization_gap",
            Confirm::MemorizationRatio => "memorization_ratio",
        }
    }
}

/// The signal that confirms a turn, as the detector applies it: `early_stop.confirm` with
/// `auto` resolved (docs/design.md §9).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Confirmation {
    None,
    GeneralizationGap,
    MemorizationRatio,
}

impl Confirmation {
    /// Its name, as the config writes it.
    pub const fn as_str(self) -> &'static str {
        match self {
            Confirmation::None => "none",
            Confirmation::GeneralizationGap => "generalization_gap",
            Confirmation::MemorizationRatio => "memorization_ratio",
        }
    }
}

/// How the detector smooths the monitored series (`early_stop.smoother`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Smoother {
    /// The median of the last `window` values.
    Median,
    /// An exponential moving average of span `window` (weight `2/(window + 1)` on the newest).
    Ema,
}

impl Smoother {
    /// Its name, as the config writes it.
    pub const fn as_str(self) -> &'static str {
        match self {
            Smoother::Median => "median",
            Smoother::Ema => "ema",
        }
    }
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct EarlyStopConfig {
    #[serde(default = "default_es_metric")]
    pub metric: EarlyStopMetric,
    #[serde(default = "default_smoother")]
    pub smoother: Smoother,
    #[serde(default = "default_window")]
    pub window: usize,
    #[serde(default = "default_warmup")]
    pub warmup: usize,
    #[serde(default = "default_patience")]
    pub patience: usize,
    #[serde(default = "default_min_rise")]
    pub min_rise: f64,
    /// The rise must also exceed this many times the noise of the smoothed value; 0 turns the
    /// noise rule off.
    #[serde(default = "default_noise_multiple")]
    pub noise_multiple: f64,
    #[serde(default = "default_confirm")]
    pub confirm: Confirm,
    #[serde(default = "default_confirm_rise")]
    pub confirm_rise: f64,
    /// The early stop also fires once the memorization ratio reaches this share, turned or not,
    /// naming the best checkpoint evaluated before it; 0 turns it off.
    #[serde(default = "default_memorization_level")]
    pub memorization_level: f64,
    /// Keep a link (or a copy) of the best checkpoint in `<state_dir>/best/`.
    #[serde(default = "default_keep_best")]
    pub keep_best: bool,
}

fn default_es_metric() -> EarlyStopMetric {
    EarlyStopMetric::Icr
}
fn default_smoother() -> Smoother {
    Smoother::Median
}
fn default_window() -> usize {
    3
}
fn default_warmup() -> usize {
    3
}
fn default_patience() -> usize {
    2
}
fn default_min_rise() -> f64 {
    0.005
}
fn default_noise_multiple() -> f64 {
    6.0
}
fn default_confirm() -> Confirm {
    Confirm::Auto
}
fn default_confirm_rise() -> f64 {
    0.5
}
fn default_memorization_level() -> f64 {
    0.05
}
fn default_keep_best() -> bool {
    true
}

impl Default for EarlyStopConfig {
    fn default() -> Self {
        EarlyStopConfig {
            metric: default_es_metric(),
            smoother: default_smoother(),
            window: default_window(),
            warmup: default_warmup(),
            patience: default_patience(),
            min_rise: default_min_rise(),
            noise_multiple: default_noise_multiple(),
            confirm: default_confirm(),
            confirm_rise: default_confirm_rise(),
            memorization_level: default_memorization_level(),
            keep_best: default_keep_best(),
        }
    }
}

/// The detector's settings: the `early_stop` section with `confirm: auto` resolved
/// ([`Config::early_stop_resolved`](super::Config::early_stop_resolved)), so that the detector never meets `auto`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct EarlyStopSettings {
    pub metric: EarlyStopMetric,
    pub smoother: Smoother,
    pub window: usize,
    pub warmup: usize,
    pub patience: usize,
    pub min_rise: f64,
    pub noise_multiple: f64,
    pub confirm: Confirmation,
    pub confirm_rise: f64,
    pub memorization_level: f64,
}

impl EarlyStopSettings {
    /// The section's settings with `confirmation` in place of its `confirm`.
    pub fn of(e: &EarlyStopConfig, confirmation: Confirmation) -> EarlyStopSettings {
        EarlyStopSettings {
            metric: e.metric,
            smoother: e.smoother,
            window: e.window,
            warmup: e.warmup,
            patience: e.patience,
            min_rise: e.min_rise,
            noise_multiple: e.noise_multiple,
            confirm: confirmation,
            confirm_rise: e.confirm_rise,
            memorization_level: e.memorization_level,
        }
    }
}

impl EarlyStopConfig {
    /// The ranges of its values (the dependencies on other sections are checked by
    /// [`check_early_stop`]).
    fn check_ranges(&self, v: &mut Validator) {
        v.count("early_stop.window", self.window, 1..=1000);
        v.count("early_stop.warmup", self.warmup, 0..=1_000_000);
        v.count("early_stop.patience", self.patience, 1..=1_000_000);
        v.real("early_stop.min_rise", self.min_rise, 0.0..=10.0);
        v.real(
            "early_stop.noise_multiple",
            self.noise_multiple,
            0.0..=100.0,
        );
        v.positive("early_stop.confirm_rise", self.confirm_rise, 10.0);
        v.real(
            "early_stop.memorization_level",
            self.memorization_level,
            0.0..=1.0,
        );
    }

    /// Every problem of the section's values, each with its key: the ranges alone, for
    /// settings given apart from a config file.
    pub fn problems(&self) -> Vec<Problem> {
        let mut v = Validator::default();
        self.check_ranges(&mut v);
        v.problems
    }
}

impl Default for EarlyStopSettings {
    /// The defaults, without a confirmation (the defaults' `auto` depends on the data keys).
    fn default() -> Self {
        EarlyStopSettings::of(&EarlyStopConfig::default(), Confirmation::None)
    }
}

/// Does `early_stop.confirm: auto` confirm by a memorization ratio that the config does not
/// compute? (No held-out set, and `memorization.enabled` false.)
pub(super) fn implies_memorization(
    e: &EarlyStopConfig,
    data: &DataConfig,
    m: &MemorizationConfig,
) -> bool {
    e.confirm == Confirm::Auto && data.heldout_path.is_none() && !m.enabled
}

/// The `early_stop` section's ranges and what its metric and confirmation need of the other
/// sections (the problems are in `v`).
pub(super) fn check_early_stop(
    v: &mut Validator,
    e: &EarlyStopConfig,
    i: &IcrConfig,
    p: &PfdConfig,
    m: &MemorizationConfig,
    data: &DataConfig,
) {
    e.check_ranges(v);
    match e.metric {
        EarlyStopMetric::Icr => v.check(
            i.enabled,
            "early_stop.metric",
            "is `icr` but icr.enabled is false",
        ),
        EarlyStopMetric::PfdGeneralization => v.check(
            p.enabled && p.teacher.is_some(),
            "early_stop.metric",
            "`pfd_generalization` needs pfd.enabled and pfd.teacher",
        ),
    }
    match e.confirm {
        Confirm::None | Confirm::Auto => {}
        Confirm::GeneralizationGap => v.check(
            data.heldout_path.is_some(),
            "early_stop.confirm",
            "`generalization_gap` needs data.heldout_path",
        ),
        Confirm::MemorizationRatio => v.check(
            m.enabled,
            "early_stop.confirm",
            "`memorization_ratio` needs memorization.enabled",
        ),
    }
    if implies_memorization(e, data, m) && m.criterion == MemorizationCriterion::Cosine {
        v.check(
            p.descriptor.is_some(),
            "memorization.criterion",
            "`cosine` needs a descriptor model in pfd.descriptor (early_stop.confirm: auto \
             without data.heldout_path confirms by the memorization ratio)",
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The early-stop metric's name is its config spelling and its record field.
    #[test]
    fn early_stop_metric_names_and_values() {
        let r = Evaluation {
            icr: Some(0.5),
            pfd_generalization: Some(2.0),
            ..Evaluation::default()
        };
        for (metric, name, value) in [
            (EarlyStopMetric::Icr, "icr", 0.5),
            (
                EarlyStopMetric::PfdGeneralization,
                "pfd_generalization",
                2.0,
            ),
        ] {
            assert_eq!(metric.as_str(), name);
            assert_eq!(serde_json::to_value(metric).unwrap(), name);
            assert_eq!(serde_json::to_value(&r).unwrap()[name], value);
            assert_eq!(metric.value(&r), Some(value));
        }
        assert_eq!(EarlyStopMetric::Icr.value(&Evaluation::default()), None);
    }

    #[test]
    fn confirm_names_are_the_config_spelling() {
        for c in [
            Confirm::Auto,
            Confirm::None,
            Confirm::GeneralizationGap,
            Confirm::MemorizationRatio,
        ] {
            let yaml: Confirm = serde_yaml::from_str(c.as_str()).unwrap();
            assert_eq!(yaml, c);
        }
    }

    #[test]
    fn early_stop_keys_have_ranges_and_names() {
        let e = EarlyStopConfig {
            noise_multiple: -1.0,
            window: 0,
            ..EarlyStopConfig::default()
        };
        let problems: Vec<String> = e.problems().iter().map(|p| p.to_string()).collect();
        assert_eq!(
            problems,
            [
                "early_stop.window must be ≥ 1, got 0",
                "early_stop.noise_multiple must be ≥ 0, got -1"
            ]
        );
        for s in [Smoother::Median, Smoother::Ema] {
            let yaml: Smoother = serde_yaml::from_str(s.as_str()).unwrap();
            assert_eq!(yaml, s);
        }
        for c in [
            Confirmation::None,
            Confirmation::GeneralizationGap,
            Confirmation::MemorizationRatio,
        ] {
            let yaml: Confirm = serde_yaml::from_str(c.as_str()).unwrap();
            assert_eq!(yaml.as_str(), c.as_str());
        }
    }
}
