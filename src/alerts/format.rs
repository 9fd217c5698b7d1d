//! Request bodies: the `json`, `slack` and `alertmanager` (v4 webhook payload) webhook formats,
//! and the body of Alertmanager's `POST /api/v2/alerts`.

use super::event::{Event, EventKind};
use crate::config::{Trigger, WebhookFormat};
use crate::store::keep_best::NOT_KEPT;
use serde_json::{Map, Value, json};

/// `alertname` label of the alert diffmon raises in Alertmanager.
pub const ALERT_NAME: &str = "DiffusionEarlyStop";
/// `receiver` field of the `alertmanager` webhook format.
pub const RECEIVER_NAME: &str = "diffmon";
/// Alertmanager's "zero time", used for `endsAt` of firing alerts in the v4 webhook payload.
const ZERO_TIME: &str = "0001-01-01T00:00:00Z";

/// The body sent to a webhook of the given format.
pub fn webhook_body(format: WebhookFormat, event: &Event) -> Vec<u8> {
    let value = match format {
        WebhookFormat::Json => serde_json::to_value(event).unwrap_or(Value::Null),
        // Markdown off: `*`, `_`, `~` and backticks in a run's or checkpoint's name are shown as
        // they are, never as formatting.
        WebhookFormat::Slack => json!({ "text": slack_escape(&summary(event)), "mrkdwn": false }),
        WebhookFormat::Alertmanager => alertmanager_webhook_payload(event),
    };
    serde_json::to_vec(&value).unwrap_or_default()
}

/// Slack's escaping of a message's text: `&`, `<` and `>` (its control characters, which a
/// checkpoint's name may hold), and nothing else.
fn slack_escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// The best checkpoint and its kept copy, as every message names them (docs/design.md §17):
/// `<checkpoint> (kept as <copy>)`, or, without a copy, that the original is the only one.
pub fn best_checkpoint(event: &Event) -> String {
    match &event.best_checkpoint_kept {
        Some(kept) => format!("{} (kept as {kept})", event.best_checkpoint),
        None => format!("{} ({NOT_KEPT})", event.best_checkpoint),
    }
}

/// A readable one-line summary: run, metric, best step/value and checkpoint (with its kept
/// copy), current step/value.
pub fn summary(event: &Event) -> String {
    let best = format!(
        "best {} = {} at step {}: {}",
        event.metric,
        fmt_value(event.best_value),
        event.best_step,
        best_checkpoint(event)
    );
    let now = format!(
        "now {} at step {}",
        fmt_value(event.current_value),
        event.current_step
    );
    match event.event {
        EventKind::EarlyStop if event.trigger == Trigger::Memorization => format!(
            "diffmon: early stop for run {}: the memorization ratio reached its stop level; {best}, {now}",
            event.run
        ),
        EventKind::EarlyStop => format!(
            "diffmon: early stop for run {}: {} turned up (memorization); {best}, {now}",
            event.run, event.metric
        ),
        EventKind::Resolved => format!(
            "diffmon: early stop resolved for run {}: {} went below its previous best again; {best}, {now}",
            event.run, event.metric
        ),
    }
}

/// The alert's `description` annotation: complete sentences naming the run, the metric, the
/// best and the current step and value, and what to do, ending with a full stop so that a
/// grouped notification (Slack lists its alerts' descriptions) keeps them apart.
pub fn description(event: &Event) -> String {
    let best = format!(
        "Its best value, {}, was at step {}: checkpoint {}",
        fmt_value(event.best_value),
        event.best_step,
        best_checkpoint(event)
    );
    let now = format!(
        "at step {} it is {}",
        event.current_step,
        fmt_value(event.current_value)
    );
    match event.event {
        EventKind::EarlyStop if event.trigger == Trigger::Memorization => format!(
            "Run {}: the memorization ratio has reached early_stop.memorization_level (the model copies training images), whether or not {} has turned. {best}, the best checkpoint evaluated before that; {now}. The stop file has been written: stop the training and keep the checkpoint of step {}.",
            event.run, event.metric, event.best_step,
        ),
        EventKind::EarlyStop => format!(
            "Run {}: the early-stop metric {} has turned up (the model starts to memorize). {best}; {now}. The stop file has been written: stop the training and keep the checkpoint of step {}.",
            event.run, event.metric, event.best_step,
        ),
        EventKind::Resolved => format!(
            "Run {}: the early stop is resolved: the metric {} went below its previous best again. {best}; {now}.",
            event.run, event.metric
        ),
    }
}

fn fmt_value(v: f64) -> String {
    if !v.is_finite() {
        return v.to_string();
    }
    if v != 0.0 && (v.abs() < 1e-3 || v.abs() >= 1e6) {
        return format!("{v:.4e}");
    }
    let s = format!("{v:.6}");
    let s = s.trim_end_matches('0').trim_end_matches('.');
    if s.is_empty() || s == "-" {
        "0".into()
    } else {
        s.to_string()
    }
}

/// The alert's identity in Alertmanager: the same labels for `early_stop` and `resolved`, so a
/// resolved event resolves the firing alert.
pub fn labels(event: &Event) -> Map<String, Value> {
    let mut m = Map::new();
    m.insert("alertname".into(), ALERT_NAME.into());
    m.insert("run".into(), event.run.clone().into());
    m.insert("severity".into(), "warning".into());
    m.insert("metric".into(), event.metric.clone().into());
    m
}

/// Annotations (Alertmanager wants string values).
pub fn annotations(event: &Event) -> Map<String, Value> {
    let mut m = Map::new();
    m.insert("summary".into(), summary(event).into());
    m.insert("description".into(), description(event).into());
    m.insert("event_id".into(), event.id.clone().into());
    m.insert("trigger".into(), event.trigger.as_str().into());
    m.insert("best_step".into(), event.best_step.to_string().into());
    m.insert(
        "best_checkpoint".into(),
        event.best_checkpoint.clone().into(),
    );
    if let Some(kept) = &event.best_checkpoint_kept {
        m.insert("best_checkpoint_kept".into(), kept.clone().into());
    }
    m.insert("best_value".into(), fmt_value(event.best_value).into());
    m.insert("current_step".into(), event.current_step.to_string().into());
    m.insert(
        "current_value".into(),
        fmt_value(event.current_value).into(),
    );
    m
}

/// Body of `POST {alertmanager}/api/v2/alerts`: one postable alert. A firing alert carries
/// `startsAt` and no `endsAt` (Alertmanager then keeps it active for its `resolve_timeout`, which
/// is why the firing alert is re-posted periodically); a resolved one carries `endsAt` = its
/// `fired_at`, which ends the alert with the same labels.
pub fn alertmanager_api_body(event: &Event) -> Vec<u8> {
    let mut alert = Map::new();
    alert.insert("labels".into(), Value::Object(labels(event)));
    alert.insert("annotations".into(), Value::Object(annotations(event)));
    match event.event {
        EventKind::EarlyStop => {
            alert.insert("startsAt".into(), event.fired_at.clone().into());
        }
        EventKind::Resolved => {
            alert.insert("endsAt".into(), event.fired_at.clone().into());
        }
    }
    serde_json::to_vec(&Value::Array(vec![Value::Object(alert)])).unwrap_or_default()
}

/// Alertmanager's webhook payload (version 4), for receivers that expect it. A resolved event
/// carries `startsAt` = `endsAt` = its `fired_at` (the firing time is not part of the event).
pub fn alertmanager_webhook_payload(event: &Event) -> Value {
    let labels = labels(event);
    let annotations = annotations(event);
    let (status, ends_at) = match event.event {
        EventKind::EarlyStop => ("firing", ZERO_TIME.to_string()),
        EventKind::Resolved => ("resolved", event.fired_at.clone()),
    };
    let group_labels = json!({ "alertname": ALERT_NAME, "run": event.run });
    json!({
        "version": "4",
        "groupKey": format!("{{}}:{{alertname={}, run={}}}", quote(ALERT_NAME), quote(&event.run)),
        "truncatedAlerts": 0,
        "status": status,
        "receiver": RECEIVER_NAME,
        "groupLabels": group_labels,
        "commonLabels": labels.clone(),
        "commonAnnotations": annotations.clone(),
        "externalURL": "",
        "alerts": [{
            "status": status,
            "labels": labels.clone(),
            "annotations": annotations,
            "startsAt": event.fired_at,
            "endsAt": ends_at,
            "generatorURL": "",
            "fingerprint": fingerprint(&labels),
        }],
    })
}

fn quote(s: &str) -> String {
    format!("\"{}\"", s.replace('\\', "\\\\").replace('"', "\\\""))
}

/// Alertmanager's alert fingerprint: FNV-1a 64 over the labels sorted by name, each name and
/// value followed by the byte 0xff (Prometheus' `LabelsToSignature`), as 16 hex digits.
pub fn fingerprint(labels: &Map<String, Value>) -> String {
    let mut names: Vec<&String> = labels.keys().collect();
    names.sort();
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut add = |bytes: &[u8]| {
        for b in bytes {
            h ^= u64::from(*b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    };
    for name in names {
        add(name.as_bytes());
        add(&[0xff]);
        add(labels[name].as_str().unwrap_or_default().as_bytes());
        add(&[0xff]);
    }
    format!("{h:016x}")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(kind: EventKind) -> Event {
        Event {
            id: "abc".into(),
            event: kind,
            run: "run-a".into(),
            metric: "icr".into(),
            trigger: Trigger::Turn,
            best_step: 1000,
            best_checkpoint: "ckpt-001000.pt".into(),
            best_checkpoint_kept: None,
            best_value: 0.12345678,
            current_step: 3000,
            current_value: 0.1302,
            fired_at: "2026-01-31T12:00:00.000Z".into(),
        }
    }

    fn parse(bytes: &[u8]) -> Value {
        serde_json::from_slice(bytes).unwrap()
    }

    #[test]
    fn json_format_is_the_event() {
        let e = event(EventKind::EarlyStop);
        let back: Event = serde_json::from_slice(&webhook_body(WebhookFormat::Json, &e)).unwrap();
        assert_eq!(back, e);
    }

    #[test]
    fn slack_format_is_one_readable_line() {
        let v = parse(&webhook_body(
            WebhookFormat::Slack,
            &event(EventKind::EarlyStop),
        ));
        // The text and Slack's switch for its markdown, off (issue #45: `*`, backticks in names
        // were formatting).
        assert_eq!(v.as_object().unwrap().len(), 2);
        assert_eq!(v["mrkdwn"], false);
        let text = v["text"].as_str().unwrap();
        assert!(!text.contains('\n'));
        for part in [
            "run-a",
            "icr",
            "step 1000",
            "0.123457",
            "step 3000",
            "0.1302",
            "ckpt-001000.pt",
            "early stop",
        ] {
            assert!(text.contains(part), "{part:?} not in {text:?}");
        }
        let r = parse(&webhook_body(
            WebhookFormat::Slack,
            &event(EventKind::Resolved),
        ));
        assert!(r["text"].as_str().unwrap().contains("resolved"));
    }

    /// A stop the memorization ratio fired says so in every text, and in the alert's
    /// `trigger` annotation; an event stored before the field existed reads as a turn.
    #[test]
    fn a_memorization_stop_says_why_it_fired() {
        let e = Event {
            trigger: Trigger::Memorization,
            ..event(EventKind::EarlyStop)
        };
        assert!(
            summary(&e).contains("the memorization ratio reached its stop level"),
            "{}",
            summary(&e)
        );
        assert!(!summary(&e).contains("turned up"));
        assert!(description(&e).contains("early_stop.memorization_level"));
        assert!(description(&e).contains("keep the checkpoint of step 1000"));
        let a = parse(&alertmanager_api_body(&e));
        assert_eq!(a[0]["annotations"]["trigger"], "memorization");
        let turn = event(EventKind::EarlyStop);
        assert!(summary(&turn).contains("icr turned up"));
        let mut old = serde_json::to_value(&turn).unwrap();
        old.as_object_mut().unwrap().remove("trigger");
        let back: Event = serde_json::from_value(old).unwrap();
        assert_eq!(back, turn);
    }

    #[test]
    fn values_are_readable() {
        assert_eq!(fmt_value(0.5), "0.5");
        assert_eq!(fmt_value(0.0), "0");
        assert_eq!(fmt_value(12.0), "12");
        assert_eq!(fmt_value(-0.25), "-0.25");
        assert_eq!(fmt_value(1.5e-5), "1.5000e-5");
        assert_eq!(fmt_value(f64::NAN), "NaN");
    }

    #[test]
    fn alertmanager_api_body_firing_and_resolved() {
        let f = parse(&alertmanager_api_body(&event(EventKind::EarlyStop)));
        let a = &f.as_array().unwrap()[0];
        assert_eq!(a["labels"]["alertname"], ALERT_NAME);
        assert_eq!(a["labels"]["run"], "run-a");
        assert_eq!(a["labels"]["severity"], "warning");
        assert_eq!(a["labels"]["metric"], "icr");
        assert_eq!(a["annotations"]["best_step"], "1000");
        assert_eq!(a["annotations"]["best_checkpoint"], "ckpt-001000.pt");
        assert_eq!(a["startsAt"], "2026-01-31T12:00:00.000Z");
        assert!(a.get("endsAt").is_none());
        // Every label and annotation value is a string (Alertmanager's LabelSet).
        for section in ["labels", "annotations"] {
            for (k, v) in a[section].as_object().unwrap() {
                assert!(v.is_string(), "{section}.{k} = {v}");
            }
        }
        let r = parse(&alertmanager_api_body(&event(EventKind::Resolved)));
        let b = &r.as_array().unwrap()[0];
        assert_eq!(b["labels"], a["labels"]);
        assert_eq!(b["endsAt"], "2026-01-31T12:00:00.000Z");
        // The kept copy of the best checkpoint is named when there is one.
        assert!(a["annotations"].get("best_checkpoint_kept").is_none());
        let kept = Event {
            best_checkpoint_kept: Some("/r/.diffmon/best/ckpt-001000.pt".into()),
            ..event(EventKind::EarlyStop)
        };
        let k = parse(&alertmanager_api_body(&kept));
        let k = &k.as_array().unwrap()[0]["annotations"];
        assert_eq!(k["best_checkpoint_kept"], "/r/.diffmon/best/ckpt-001000.pt");
        for text in ["summary", "description"] {
            assert!(
                k[text]
                    .as_str()
                    .unwrap()
                    .contains("ckpt-001000.pt (kept as /r/.diffmon/best/ckpt-001000.pt)"),
                "{k}"
            );
            // Without a copy, the original is named the only one.
            assert!(
                a["annotations"][text]
                    .as_str()
                    .unwrap()
                    .contains("ckpt-001000.pt (not kept: the original is the only copy)"),
                "{a}"
            );
        }
    }

    /// Every text format names the kept copy beside the checkpoint (issue #33), and Slack's
    /// text escapes `&`, `<` and `>` of the paths, its only control characters.
    #[test]
    fn every_text_names_the_kept_copy_and_slack_escapes_the_paths() {
        let kept = Event {
            best_checkpoint: "/r/ckpt<1000>&.pt".into(),
            best_checkpoint_kept: Some("/r/.diffmon/best/ckpt<1000>&.pt".into()),
            ..event(EventKind::EarlyStop)
        };
        let text = parse(&webhook_body(WebhookFormat::Slack, &kept))["text"]
            .as_str()
            .unwrap()
            .to_string();
        assert!(
            text.contains(
                "at step 1000: /r/ckpt&lt;1000&gt;&amp;.pt (kept as \
                 /r/.diffmon/best/ckpt&lt;1000&gt;&amp;.pt), now"
            ),
            "{text}"
        );
        assert!(!text.contains(['<', '>']), "{text}");
        assert_eq!(text.matches('&').count(), 6, "{text}");
        let resolved = Event {
            event: EventKind::Resolved,
            ..kept.clone()
        };
        assert!(summary(&resolved).contains("(kept as /r/.diffmon/best/ckpt<1000>&.pt)"));
        assert!(description(&resolved).contains("(kept as /r/.diffmon/best/ckpt<1000>&.pt)"));
        // The alertmanager format carries the raw paths (Alertmanager's templates escape).
        let am = parse(&webhook_body(WebhookFormat::Alertmanager, &kept));
        let ann = &am["alerts"][0]["annotations"];
        assert_eq!(
            ann["best_checkpoint_kept"],
            "/r/.diffmon/best/ckpt<1000>&.pt"
        );
        assert!(
            ann["summary"]
                .as_str()
                .unwrap()
                .contains("(kept as /r/.diffmon/best/ckpt<1000>&.pt)")
        );
        // Without a copy: the original is the only one.
        let text = parse(&webhook_body(
            WebhookFormat::Slack,
            &event(EventKind::EarlyStop),
        ))["text"]
            .as_str()
            .unwrap()
            .to_string();
        assert!(
            text.contains("ckpt-001000.pt (not kept: the original is the only copy)"),
            "{text}"
        );
    }

    #[test]
    fn alertmanager_webhook_payload_v4_shape() {
        let v = parse(&webhook_body(
            WebhookFormat::Alertmanager,
            &event(EventKind::EarlyStop),
        ));
        assert_eq!(v["version"], "4");
        assert_eq!(v["status"], "firing");
        assert_eq!(v["receiver"], RECEIVER_NAME);
        assert_eq!(
            v["groupKey"],
            "{}:{alertname=\"DiffusionEarlyStop\", run=\"run-a\"}"
        );
        assert_eq!(v["commonLabels"]["run"], "run-a");
        assert_eq!(v["groupLabels"]["alertname"], ALERT_NAME);
        let a = &v["alerts"][0];
        assert_eq!(a["status"], "firing");
        assert_eq!(a["endsAt"], ZERO_TIME);
        assert_eq!(a["startsAt"], "2026-01-31T12:00:00.000Z");
        assert_eq!(
            a["annotations"]["summary"],
            summary(&event(EventKind::EarlyStop))
        );
        let r = parse(&webhook_body(
            WebhookFormat::Alertmanager,
            &event(EventKind::Resolved),
        ));
        assert_eq!(r["status"], "resolved");
        assert_eq!(r["alerts"][0]["endsAt"], "2026-01-31T12:00:00.000Z");
    }

    /// Issue 15: the pushed alert has a `description` (and a `summary`): complete sentences
    /// with the run, the metric, the best and the current step and value.
    #[test]
    fn alerts_carry_a_description_of_full_sentences() {
        for kind in [EventKind::EarlyStop, EventKind::Resolved] {
            let e = event(kind);
            let v = parse(&alertmanager_api_body(&e));
            let ann = &v[0]["annotations"];
            assert_eq!(ann["summary"], summary(&e));
            let d = ann["description"].as_str().expect("a description");
            for part in [
                "Run run-a",
                "icr",
                "step 1000",
                "0.123457",
                "step 3000",
                "0.1302",
            ] {
                assert!(d.contains(part), "{part:?} not in {d:?}");
            }
            assert!(d.ends_with('.') && !d.contains('\n'), "{d:?}");
            let w = parse(&webhook_body(WebhookFormat::Alertmanager, &e));
            assert_eq!(w["alerts"][0]["annotations"]["description"], d);
        }
    }

    #[test]
    fn fingerprint_matches_an_independent_vector() {
        // Computed once with Python: FNV-1a 64 over sorted labels, each name and value followed
        // by b"\xff" (Prometheus model.LabelsToSignature).
        let l = labels(&event(EventKind::EarlyStop));
        assert_eq!(fingerprint(&l), "3acb8959e1507daf");
    }
}
