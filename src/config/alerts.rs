//! The `alerts` section: the webhooks and Alertmanager that receive the early-stop events, and
//! the stop file; as written ([`Alerts`]) and as settings ([`AlertsConfig`], with the URLs
//! parsed and the webhooks' secrets read), built and checked by [`alerts`].

use super::validate::Validator;
use super::values::{self, SecretEnv};
use reqwest::Url;
use serde::{Deserialize, Serialize};
use std::path::Path;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum WebhookFormat {
    Json,
    Slack,
    Alertmanager,
}

/// `alerts.webhooks[]`: a destination of the early-stop events.
#[derive(Debug, Clone)]
pub struct WebhookConfig {
    pub url: Url,
    pub format: WebhookFormat,
    /// `secret_env`: the variable and the signing secret read from it.
    pub secret: Option<SecretEnv>,
}

/// `alerts.alertmanager`.
#[derive(Debug, Clone)]
pub struct AlertmanagerConfig {
    /// Alertmanager's base URL (the alerts are posted to `{url}/api/v2/alerts`).
    pub url: Url,
}

#[derive(Debug, Clone)]
pub struct AlertsConfig {
    pub webhooks: Vec<WebhookConfig>,
    pub alertmanager: Option<AlertmanagerConfig>,
    /// File name inside `run.dir` written when the early stop fires.
    pub stop_file: String,
}

impl Default for AlertsConfig {
    /// No destinations, the default stop file.
    fn default() -> Self {
        alerts(&mut Validator::default(), &Alerts::default(), None)
            .expect("the default alerts section is valid")
    }
}

/// `alerts.webhooks[]`, as written.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct Webhook {
    pub(super) url: String,
    #[serde(default = "default_webhook_format")]
    pub(super) format: WebhookFormat,
    /// Name of the environment variable holding the signing secret (never the secret itself).
    #[serde(default)]
    pub(super) secret_env: Option<String>,
}

fn default_webhook_format() -> WebhookFormat {
    WebhookFormat::Json
}

/// `alerts.alertmanager`, as written.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct Alertmanager {
    pub(super) url: String,
}

/// `alerts`, as written.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct Alerts {
    #[serde(default)]
    pub(super) webhooks: Vec<Webhook>,
    #[serde(default)]
    pub(super) alertmanager: Option<Alertmanager>,
    /// File name inside `run.dir` written when the early stop fires.
    #[serde(default = "default_stop_file")]
    pub(super) stop_file: String,
}

fn default_stop_file() -> String {
    "EARLY_STOP".into()
}

impl Default for Alerts {
    fn default() -> Self {
        Alerts {
            webhooks: Vec::new(),
            alertmanager: None,
            stop_file: default_stop_file(),
        }
    }
}

/// Reads an environment variable: [`std::env::var`], or a stand-in in tests.
pub(super) type SecretLookup = dyn Fn(&str) -> Result<String, std::env::VarError>;

/// The `alerts` section's settings: the destinations' URLs parsed and, with a `lookup`, their
/// secrets read; `None` when a value is refused (the problem is in `v`).
pub(super) fn alerts(
    v: &mut Validator,
    a: &Alerts,
    lookup: Option<&SecretLookup>,
) -> Option<AlertsConfig> {
    let mut webhooks = Some(Vec::new());
    for (k, w) in a.webhooks.iter().enumerate() {
        let url = v.parse(
            &format!("alerts.webhooks[{k}].url"),
            values::http_url(&w.url),
        );
        let secret = match &w.secret_env {
            None => Some(None),
            Some(var) => {
                let secret = match lookup {
                    Some(lookup) => v
                        .secret(
                            &format!("alerts.webhooks[{k}].secret_env"),
                            var,
                            lookup(var),
                        )
                        .map(Some),
                    None => Some(None),
                };
                secret.map(|secret| {
                    Some(SecretEnv {
                        var: var.clone(),
                        secret,
                    })
                })
            }
        };
        match (url, secret, webhooks.as_mut()) {
            (Some(url), Some(secret), Some(list)) => list.push(WebhookConfig {
                url,
                format: w.format,
                secret,
            }),
            _ => webhooks = None,
        }
    }
    let alertmanager = match &a.alertmanager {
        Some(am) => v
            .parse("alerts.alertmanager.url", values::http_url(&am.url))
            .map(|url| Some(AlertmanagerConfig { url })),
        None => Some(None),
    };
    v.check(
        !a.stop_file.is_empty()
            && Path::new(&a.stop_file)
                .components()
                .all(|c| matches!(c, std::path::Component::Normal(_))),
        "alerts.stop_file",
        format!(
            "must be a file name inside run.dir (no `..`, no absolute path), got `{}`",
            a.stop_file
        ),
    );
    Some(AlertsConfig {
        webhooks: webhooks?,
        alertmanager: alertmanager?,
        stop_file: a.stop_file.clone(),
    })
}

#[cfg(test)]
mod tests {
    use super::super::file::ConfigFile;
    use super::super::test_support::MINIMAL;
    use super::*;

    /// The webhooks' URLs are parsed, and their secrets read and decoded, when the settings are
    /// built; without secrets (commands that send nothing) the variable is kept, not read.
    #[test]
    fn destinations_are_parsed_with_their_secrets() {
        let text = format!(
            "{MINIMAL}alerts: {{webhooks: [{{url: 'https://hooks.example/x?t=1', format: slack, \
             secret_env: DIFFMON_T_SET}}, {{url: 'http://127.0.0.1:8/h'}}], \
             alertmanager: {{url: 'http://am:9093/'}}}}\n"
        );
        let file = ConfigFile::parse(&text, "c.yaml").unwrap();
        // `whsec_` + base64 of the 3 bytes "key".
        let lookup = |var: &str| match var {
            "DIFFMON_T_SET" => Ok("whsec_a2V5".to_string()),
            _ => Err(std::env::VarError::NotPresent),
        };
        let problems = file.settings_with(Some(&lookup)).unwrap_err();
        // Only the files MINIMAL names are missing: the alerts are fine.
        assert!(
            problems.iter().all(|p| !p.key.starts_with("alerts.")),
            "{problems:?}"
        );
        let dir = tempfile::tempdir().unwrap();
        for f in ["m.ts", "d.h5"] {
            std::fs::write(dir.path().join(f), b"").unwrap();
        }
        let mut file = file;
        file.resolve_paths(dir.path());
        let c = file.settings_with(Some(&lookup)).unwrap();
        let w = &c.alerts.webhooks;
        assert_eq!(w[0].url.as_str(), "https://hooks.example/x?t=1");
        assert_eq!(w[0].format, WebhookFormat::Slack);
        let secret = w[0].secret.as_ref().unwrap();
        assert_eq!(secret.var, "DIFFMON_T_SET");
        assert_eq!(
            crate::sign::signature(secret.secret.as_ref().unwrap(), "id", 1, b"body"),
            crate::sign::signature(
                &crate::sign::Secret::parse("a2V5").unwrap(),
                "id",
                1,
                b"body"
            ),
            "the secret is the decoded key"
        );
        assert!(!format!("{c:?}").contains("a2V5"), "Debug shows no secret");
        assert!(w[1].secret.is_none());
        assert_eq!(
            c.alerts.alertmanager.unwrap().url.as_str(),
            "http://am:9093/"
        );
        let unread = file.settings_with(None).unwrap();
        let secret = unread.alerts.webhooks[0].secret.as_ref().unwrap();
        assert_eq!(
            (secret.var.as_str(), secret.secret.is_none()),
            ("DIFFMON_T_SET", true)
        );

        // A variable that is not set, or holds no secret: a problem naming key and variable.
        let unset = |_: &str| Err(std::env::VarError::NotPresent);
        let problems = file.settings_with(Some(&unset)).unwrap_err();
        assert_eq!(
            problems.iter().map(|p| p.to_string()).collect::<Vec<_>>(),
            [
                "alerts.webhooks[0].secret_env names the environment variable DIFFMON_T_SET, \
              which is not set"
            ]
        );
        let mangled = |_: &str| Ok("not-a-secret".to_string());
        let problems = file.settings_with(Some(&mangled)).unwrap_err();
        assert_eq!(problems.len(), 1, "{problems:?}");
        assert!(
            problems[0]
                .message
                .contains("is not a Standard-Webhooks secret")
                && !problems[0].message.contains("not-a-secret"),
            "{problems:?}"
        );
    }

    #[test]
    fn urls_must_be_http_with_a_host() {
        for (url, message) in [
            (
                "ftp://a/x",
                "must be an http:// or https:// URL, got `ftp://a/x`",
            ),
            (
                "HTTP://a/x",
                "must be an http:// or https:// URL, got `HTTP://a/x`",
            ),
            ("http://", "is not a valid URL (empty host), got `http://`"),
            (
                "http://a b/",
                "is not a valid URL (invalid international domain name), got `http://a b/`",
            ),
        ] {
            let text = format!("{MINIMAL}alerts: {{alertmanager: {{url: '{url}'}}}}\n");
            let problems = ConfigFile::parse(&text, "c.yaml").unwrap().validate();
            let got: Vec<String> = problems
                .iter()
                .filter(|p| p.key == "alerts.alertmanager.url")
                .map(|p| p.message.clone())
                .collect();
            assert_eq!(got, [message], "{url}");
        }
        assert!(values::http_url("https://h:1/p").is_ok());
    }
}
