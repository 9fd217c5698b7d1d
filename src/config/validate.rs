//! Validation's shared parts: [`Problem`], one problem with the key it concerns; the
//! [`Validator`] that collects the problems while each section's values are checked and parsed
//! (its checks word the messages: ranges, durations, files, secrets); [`num`], which writes a
//! number as YAML does; and the bounds and serde defaults that several sections share.

use std::fmt;
use std::ops::RangeInclusive;
use std::path::Path;
use std::time::Duration;

/// Upper bounds of the validated ranges shared by several keys (documented in
/// `config/diffmon.example.yaml`): noise levels (EDM's largest is 80), image counts and batches.
pub(super) const MAX_SIGMA: f64 = 1_000.0;
pub(super) const MAX_SAMPLES: usize = 1 << 20;
pub(super) const MAX_BATCH: usize = 1 << 16;

/// A number as a person writes it in YAML: `1e20` rather than twenty-one digits.
pub(super) fn num(x: f64) -> String {
    if x != 0.0 && x.is_finite() && !(1e-4..1e6).contains(&x.abs()) {
        format!("{x:e}")
    } else {
        format!("{x}")
    }
}

// Serde defaults shared by several sections.
pub(super) fn default_true() -> bool {
    true
}
pub(super) fn default_batch_size() -> usize {
    256
}

/// One problem found by validation, with the key it concerns.
#[derive(Debug, Clone, PartialEq)]
pub struct Problem {
    pub key: String,
    pub message: String,
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}", self.key, self.message)
    }
}

/// Collects the problems of a config's values, each with its key.
#[derive(Default)]
pub(super) struct Validator {
    pub(super) problems: Vec<Problem>,
}

impl Validator {
    pub(super) fn problem(&mut self, key: &str, message: impl Into<String>) {
        self.problems.push(Problem {
            key: key.to_string(),
            message: message.into(),
        });
    }

    pub(super) fn check(&mut self, ok: bool, key: &str, message: impl Into<String>) {
        if !ok {
            self.problem(key, message);
        }
    }

    /// The value of `parsed`, or `None` with its message as the problem of `key`.
    pub(super) fn parse<T>(&mut self, key: &str, parsed: Result<T, String>) -> Option<T> {
        parsed.map_err(|message| self.problem(key, message)).ok()
    }

    /// `x` must be a finite number in `range`; the message names the bound that is broken.
    /// Whether it is.
    pub(super) fn real(&mut self, key: &str, x: f64, range: RangeInclusive<f64>) -> bool {
        let message = if !x.is_finite() {
            format!("must be a finite number, got {}", num(x))
        } else if x < *range.start() {
            format!("must be ≥ {}, got {}", num(*range.start()), num(x))
        } else if x > *range.end() {
            format!("must be ≤ {}, got {}", num(*range.end()), num(x))
        } else {
            return true;
        };
        self.problem(key, message);
        false
    }

    /// A number of seconds in `range` (which must lie within what a [`Duration`] holds), as a
    /// duration.
    pub(super) fn secs(
        &mut self,
        key: &str,
        x: f64,
        range: RangeInclusive<f64>,
    ) -> Option<Duration> {
        if !self.real(key, x, range) {
            return None;
        }
        let d = Duration::try_from_secs_f64(x);
        self.check(d.is_ok(), key, format!("is not a duration, got {}", num(x)));
        d.ok()
    }

    /// `x` must be a finite number in `(0, max]`.
    pub(super) fn positive(&mut self, key: &str, x: f64, max: f64) {
        if x.is_finite() && x <= 0.0 {
            self.problem(key, format!("must be > 0, got {}", num(x)));
        } else {
            self.real(key, x, 0.0..=max);
        }
    }

    pub(super) fn count(&mut self, key: &str, x: usize, range: RangeInclusive<usize>) {
        if x < *range.start() {
            self.problem(key, format!("must be ≥ {}, got {x}", range.start()));
        } else if x > *range.end() {
            self.problem(key, format!("must be ≤ {}, got {x}", range.end()));
        }
    }

    pub(super) fn file(&mut self, key: &str, path: &Path) {
        if !path.is_file() {
            let what = if path.exists() {
                "is not a file"
            } else {
                "does not exist"
            };
            self.problem(key, format!("names {}, which {what}", path.display()));
        }
    }

    /// The variable `var`, whose lookup gave `value`, must hold a Standard-Webhooks secret
    /// (never shown in the message).
    pub(super) fn secret(
        &mut self,
        key: &str,
        var: &str,
        value: Result<String, std::env::VarError>,
    ) -> Option<crate::sign::Secret> {
        let message = match value {
            Err(std::env::VarError::NotPresent) => {
                format!("names the environment variable {var}, which is not set")
            }
            Err(std::env::VarError::NotUnicode(_)) => {
                format!("names the environment variable {var}, whose value is not UTF-8")
            }
            Ok(value) => match crate::sign::Secret::parse(&value) {
                Ok(secret) => return Some(secret),
                Err(reason) => format!(
                    "names the environment variable {var}, whose value is not a \
                     Standard-Webhooks secret: it {reason}"
                ),
            },
        };
        self.problem(key, message);
        None
    }
}
