//! The `trackers` section: the experiment trackers a run's numbers are written into
//! (docs/design.md §21): TensorBoard event files and an MLflow tracking server. As written
//! ([`Trackers`]) and as settings ([`TrackersConfig`]: MLflow's URL parsed, its run and token
//! read from where the file says), built and checked by [`trackers`].

use super::alerts::SecretLookup;
use super::validate::Validator;
use super::values;
use reqwest::Url;
use serde::Deserialize;
use std::fmt;
use std::path::PathBuf;

/// `trackers`: every tracker is off unless its section is given.
#[derive(Debug, Clone, Default)]
pub struct TrackersConfig {
    /// `trackers.tensorboard`: TensorBoard event files.
    pub tensorboard: Option<TensorboardConfig>,
    /// `trackers.mlflow`: an MLflow tracking server.
    pub mlflow: Option<MlflowConfig>,
}

/// `trackers.tensorboard`, as written and as used.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TensorboardConfig {
    /// The TensorBoard log folder (the one `tensorboard --logdir` is given, usually the
    /// training job's own): each run's events go to `<dir>/diffmon/<run name>/`. Relative to the
    /// config file's folder; made if absent; never a symbolic link.
    pub dir: PathBuf,
}

impl TensorboardConfig {
    /// The folder under `dir` that holds the runs' folders.
    pub const FOLDER: &'static str = "diffmon";

    /// Where run `run`'s events go: `<dir>/diffmon/<run>`.
    pub fn run_folder(&self, run: &str) -> PathBuf {
        self.dir.join(Self::FOLDER).join(run)
    }
}

/// Which MLflow run the metrics go into.
#[derive(Debug, Clone, PartialEq)]
pub enum MlflowRun {
    /// The training job's run: `run_id`, or the value of `run_id_env`.
    Id(String),
    /// A run diffmon makes (once: its id is kept in the state folder) in this experiment, made
    /// too if absent.
    Experiment(String),
}

/// A bearer token for the tracking server, from `token_env` or `token_file`. Its `Debug`
/// shows where it came from, never the token.
#[derive(Clone)]
pub struct Token {
    pub from: String,
    pub value: String,
}

impl fmt::Debug for Token {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Token({}: ***)", self.from)
    }
}

/// `trackers.mlflow`, as used.
#[derive(Debug, Clone)]
pub struct MlflowConfig {
    /// The tracking server's base URL (`http://host:5000`); the REST API is under
    /// `{uri}/api/2.0/mlflow/`.
    pub uri: Url,
    pub run: MlflowRun,
    /// `None`: no `Authorization` header (or not read: the config was loaded without secrets).
    pub token: Option<Token>,
}

/// `trackers`, as written.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct Trackers {
    #[serde(default)]
    pub(super) tensorboard: Option<TensorboardConfig>,
    #[serde(default)]
    pub(super) mlflow: Option<Mlflow>,
}

/// `trackers.mlflow`, as written.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct Mlflow {
    /// The tracking server, `http://` or `https://`.
    pub(super) uri: String,
    /// The training job's run.
    #[serde(default)]
    pub(super) run_id: Option<String>,
    /// An environment variable holding the training job's run id (`MLFLOW_RUN_ID`, which
    /// MLflow's own client reads); when it is set, it wins over `experiment`.
    #[serde(default)]
    pub(super) run_id_env: Option<String>,
    /// Without a run id: the experiment diffmon makes its own run in (named after the run).
    #[serde(default)]
    pub(super) experiment: Option<String>,
    /// An environment variable holding a bearer token (`MLFLOW_TRACKING_TOKEN`).
    #[serde(default)]
    pub(super) token_env: Option<String>,
    /// A file holding a bearer token (its first line; relative to the config file's folder).
    #[serde(default)]
    pub(super) token_file: Option<PathBuf>,
}

/// The longest token file read.
const MAX_TOKEN_BYTES: u64 = 16 << 10;

impl TrackersConfig {
    /// Where each tracker writes for run `run`, one line each (`check-config`); empty when
    /// none is on. No token is shown.
    pub fn destinations(&self, run: &str) -> Vec<String> {
        let tensorboard = self
            .tensorboard
            .iter()
            .map(|tb| format!("tensorboard: {}", tb.run_folder(run).display()));
        let mlflow = self.mlflow.iter().map(|m| {
            let into = match &m.run {
                MlflowRun::Id(id) => format!("run {id}"),
                MlflowRun::Experiment(e) => format!("a run `{run}` of experiment `{e}`"),
            };
            let auth = m
                .token
                .as_ref()
                .map_or(String::new(), |t| format!(", token from {}", t.from));
            format!("mlflow: {} ({into}{auth})", m.uri)
        });
        tensorboard.chain(mlflow).collect()
    }
}

/// A run id as MLflow makes them (32 hex digits) or any other plain name: letters, digits, `-`
/// and `_`, at most 256.
fn plain_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= 256
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
}

pub(super) fn trackers(
    v: &mut Validator,
    t: &Trackers,
    lookup: Option<&SecretLookup>,
) -> Option<TrackersConfig> {
    if let Some(tb) = &t.tensorboard
        && tb.dir.as_os_str().is_empty()
    {
        v.problem(
            "trackers.tensorboard.dir",
            "is empty: give the TensorBoard log folder, e.g. `dir: logs`",
        );
    }
    let mlflow = match &t.mlflow {
        None => Some(None),
        Some(m) => mlflow(v, m, lookup).map(Some),
    };
    Some(TrackersConfig {
        tensorboard: t.tensorboard.clone(),
        mlflow: mlflow?,
    })
}

fn mlflow(v: &mut Validator, m: &Mlflow, lookup: Option<&SecretLookup>) -> Option<MlflowConfig> {
    let uri = v.parse("trackers.mlflow.uri", values::http_url(&m.uri));
    let from_env = match (&m.run_id_env, lookup) {
        (Some(var), Some(lookup)) => match lookup(var) {
            Ok(id) => Some(id.trim().to_string()),
            Err(_) if m.experiment.is_some() || m.run_id.is_some() => None,
            Err(_) => {
                v.problem(
                    "trackers.mlflow.run_id_env",
                    format!(
                        "names the environment variable {var}, which is not set (or not UTF-8): \
                         start diffmon where the training job's run id is set, or give run_id, \
                         or experiment for a run of diffmon's own"
                    ),
                );
                return None;
            }
        },
        _ => None,
    };
    let run = match (from_env.or_else(|| m.run_id.clone()), &m.experiment) {
        (Some(id), _) if plain_id(&id) => MlflowRun::Id(id),
        (Some(id), _) => {
            v.problem(
                "trackers.mlflow.run_id",
                format!(
                    "is not a run id (letters, digits, - and _, at most 256), got `{}`",
                    id.escape_debug()
                ),
            );
            return None;
        }
        (None, Some(e)) if !e.trim().is_empty() && e.len() <= 500 => {
            MlflowRun::Experiment(e.clone())
        }
        (None, Some(_)) => {
            v.problem(
                "trackers.mlflow.experiment",
                "must be a name of 1 to 500 characters",
            );
            return None;
        }
        (None, None) if m.run_id_env.is_some() && lookup.is_none() => {
            // Loaded without reading the environment: the run is not known here.
            MlflowRun::Id(String::new())
        }
        (None, None) => {
            v.problem(
                "trackers.mlflow",
                "names no run: give run_id (the training job's), run_id_env (e.g. MLFLOW_RUN_ID) \
                 or experiment (diffmon makes a run of its own there)",
            );
            return None;
        }
    };
    let token = match (&m.token_env, &m.token_file, lookup) {
        (Some(_), Some(_), _) => {
            v.problem(
                "trackers.mlflow.token_file",
                "cannot be given with token_env: give one",
            );
            return None;
        }
        (_, _, None) | (None, None, _) => None,
        (Some(var), None, Some(lookup)) => match lookup(var) {
            Ok(value) if !value.trim().is_empty() => Some(Token {
                from: format!("${var}"),
                value: value.trim().to_string(),
            }),
            _ => {
                v.problem(
                    "trackers.mlflow.token_env",
                    format!("names the environment variable {var}, which is not set or empty"),
                );
                return None;
            }
        },
        (None, Some(file), Some(_)) => {
            let read = std::fs::File::open(file).and_then(|f| {
                let mut bytes = Vec::new();
                std::io::Read::read_to_end(
                    &mut std::io::Read::take(f, MAX_TOKEN_BYTES),
                    &mut bytes,
                )?;
                Ok(bytes)
            });
            let line = read.as_ref().ok().and_then(|b| {
                let text = std::str::from_utf8(b).ok()?;
                let line = text.lines().next()?.trim();
                (!line.is_empty()).then(|| line.to_string())
            });
            match (line, read) {
                (Some(value), _) => Some(Token {
                    from: file.display().to_string(),
                    value,
                }),
                (None, Err(e)) => {
                    v.problem(
                        "trackers.mlflow.token_file",
                        format!("cannot read {}: {e}", file.display()),
                    );
                    return None;
                }
                (None, Ok(_)) => {
                    v.problem(
                        "trackers.mlflow.token_file",
                        format!("{} holds no token on its first line", file.display()),
                    );
                    return None;
                }
            }
        }
    };
    Some(MlflowConfig {
        uri: uri?,
        run,
        token,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn built(yaml: &str, env: &[(&str, &str)]) -> Result<TrackersConfig, Vec<String>> {
        let t: Trackers = serde_yaml::from_str(yaml).unwrap();
        let env: Vec<(String, String)> = env
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let lookup = move |var: &str| {
            env.iter()
                .find(|(k, _)| k == var)
                .map(|(_, v)| v.clone())
                .ok_or(std::env::VarError::NotPresent)
        };
        let mut v = Validator::default();
        let out = trackers(&mut v, &t, Some(&lookup));
        match out {
            Some(c) if v.problems.is_empty() => Ok(c),
            _ => Err(v.problems.iter().map(|p| p.to_string()).collect()),
        }
    }

    #[test]
    fn the_mlflow_run_comes_from_the_environment_then_the_id_then_the_experiment() {
        let m = |yaml: &str, env: &[(&str, &str)]| built(yaml, env).unwrap().mlflow.unwrap();
        let both = "mlflow: {uri: 'http://h:5000', run_id_env: R, experiment: e}";
        assert_eq!(
            m(both, &[("R", "abc123\n")]).run,
            MlflowRun::Id("abc123".into())
        );
        assert_eq!(m(both, &[]).run, MlflowRun::Experiment("e".into()));
        let id = "mlflow: {uri: 'http://h', run_id: f00d}";
        assert_eq!(m(id, &[]).run, MlflowRun::Id("f00d".into()));
        let token = "mlflow: {uri: 'http://h', run_id: a, token_env: T}";
        let t = m(token, &[("T", "s3cret")]).token.unwrap();
        assert_eq!(t.value, "s3cret");
        assert!(!format!("{t:?}").contains("s3cret"), "{t:?}");
    }

    #[test]
    fn mlflow_problems_name_their_key() {
        for (yaml, key) in [
            ("mlflow: {uri: 'ftp://h', run_id: a}", "trackers.mlflow.uri"),
            ("mlflow: {uri: 'http://h'}", "trackers.mlflow"),
            (
                "mlflow: {uri: 'http://h', run_id_env: UNSET}",
                "trackers.mlflow.run_id_env",
            ),
            (
                "mlflow: {uri: 'http://h', run_id: 'a/../b'}",
                "trackers.mlflow.run_id",
            ),
            (
                "mlflow: {uri: 'http://h', run_id: a, token_env: UNSET}",
                "trackers.mlflow.token_env",
            ),
            (
                "mlflow: {uri: 'http://h', run_id: a, token_file: /nonexistent/t}",
                "trackers.mlflow.token_file",
            ),
            ("tensorboard: {dir: ''}", "trackers.tensorboard.dir"),
        ] {
            let problems = built(yaml, &[]).unwrap_err();
            assert!(
                problems.iter().any(|p| p.starts_with(&format!("{key} "))),
                "{yaml}: {problems:?}"
            );
        }
    }
}
