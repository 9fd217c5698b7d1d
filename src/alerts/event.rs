//! The early-stop event (docs/design.md §17), its stable id and RFC 3339 timestamps.

use crate::config::Trigger;
use crate::record::rfc3339_utc;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::fmt;
use std::time::SystemTime;

/// What happened: the U-turn fired, or a later value went back below the best (double descent).
#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq, Eq, Hash)]
#[serde(rename_all = "snake_case")]
pub enum EventKind {
    EarlyStop,
    Resolved,
}

impl EventKind {
    /// The serialized name: `early_stop` or `resolved`.
    pub fn as_str(self) -> &'static str {
        match self {
            EventKind::EarlyStop => "early_stop",
            EventKind::Resolved => "resolved",
        }
    }
}

impl fmt::Display for EventKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One early-stop event, exactly as the `json` webhook format and the stop file carry it.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Event {
    /// Stable for the same event: see [`event_id`].
    pub id: String,
    /// `"early_stop"` or `"resolved"`.
    pub event: EventKind,
    pub run: String,
    /// The detector's series: `"icr"` or `"pfd_generalization"`.
    pub metric: String,
    /// Why the stop fired: `"turn"` (the series turned up, confirmed) or `"memorization"` (the
    /// memorization ratio reached `early_stop.memorization_level`); a `resolved` event has the
    /// trigger of the stop it resolves. Events written before it existed read as `"turn"`.
    #[serde(default)]
    pub trigger: Trigger,
    pub best_step: i64,
    pub best_checkpoint: String,
    /// Where diffmon keeps a copy of the best checkpoint (`early_stop.keep_best`), safe from the
    /// training job's rotation; `null` when it keeps none.
    #[serde(default)]
    pub best_checkpoint_kept: Option<String>,
    pub best_value: f64,
    pub current_step: i64,
    pub current_value: f64,
    /// RFC 3339, UTC (`2026-01-31T12:00:00.000Z`).
    pub fired_at: String,
}

impl Event {
    /// An event with its stable id (for no particular run folder: see [`run_instance`]),
    /// `fired_at` = now and no kept copy.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        kind: EventKind,
        run: &str,
        metric: &str,
        best_step: i64,
        best_checkpoint: &str,
        best_value: f64,
        current_step: i64,
        current_value: f64,
    ) -> Event {
        Event {
            id: event_id(run, "", kind, best_step, current_step),
            event: kind,
            run: run.to_string(),
            metric: metric.to_string(),
            trigger: Trigger::Turn,
            best_step,
            best_checkpoint: best_checkpoint.to_string(),
            best_checkpoint_kept: None,
            best_value,
            current_step,
            current_value,
            fired_at: rfc3339_utc(SystemTime::now()),
        }
    }
}

/// The event's stable id: lowercase hex of
/// `sha256("diffmon-event-v2\n{run}\n{instance}\n{kind}\n{best_step}\n{current_step}")`, where
/// `instance` tells apart runs of the same name ([`run_instance`]: the run folder and the state
/// folder).
///
/// A restart that re-derives the same event (same run, kind, best and current step) gets the same
/// id, so the delivered-ledger and receivers (`webhook-id`) can deduplicate it; two runs that
/// share a name do not. The preimage format is part of the on-disk contract: changing it
/// re-delivers events after an upgrade (v1, without the instance, was changed for that reason).
pub fn event_id(
    run: &str,
    instance: &str,
    kind: EventKind,
    best_step: i64,
    current_step: i64,
) -> String {
    let preimage =
        format!("diffmon-event-v2\n{run}\n{instance}\n{kind}\n{best_step}\n{current_step}");
    hex(&Sha256::digest(preimage.as_bytes()))
}

/// What makes a run unique beside its name, for [`event_id`]: its folder and its state folder,
/// as absolute paths (made so without looking at the file system).
pub fn run_instance(run_dir: &std::path::Path, state_dir: &std::path::Path) -> String {
    let abs = |p: &std::path::Path| {
        std::path::absolute(p)
            .unwrap_or_else(|_| p.to_path_buf())
            .display()
            .to_string()
    };
    format!("{}\n{}", abs(run_dir), abs(state_dir))
}

pub(crate) fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write;
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        let _ = write!(s, "{b:02x}");
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    #[test]
    fn id_is_stable_and_matches_an_independent_vector() {
        // Expected values computed once with Python:
        //   hashlib.sha256(b"diffmon-event-v2\nrun-a\n/r/a\n/r/a/.diffmon\nearly_stop\n1000\n3000").hexdigest()
        let instance = run_instance(Path::new("/r/a"), Path::new("/r/a/.diffmon"));
        let a = event_id("run-a", &instance, EventKind::EarlyStop, 1000, 3000);
        assert_eq!(
            a,
            "c8b671b773ed02c43eba722d87e8a2e70f933df748985e897759addf66037687"
        );
        assert_eq!(
            a,
            event_id("run-a", &instance, EventKind::EarlyStop, 1000, 3000)
        );
        assert_eq!(
            event_id("run-a", &instance, EventKind::Resolved, 1000, 3000),
            "7d784852fbed5bc4736e323ac5f9b5688f4b0b85c7a71b553c01bf96b22d33ea"
        );
        let id = |run, kind, best, current| event_id(run, &instance, kind, best, current);
        assert_ne!(a, id("run-b", EventKind::EarlyStop, 1000, 3000));
        assert_ne!(a, id("run-a", EventKind::EarlyStop, 1001, 3000));
        assert_ne!(a, id("run-a", EventKind::EarlyStop, 1000, 3001));
        // Two runs of the same name in other folders (issue #29, item 10).
        for other in [
            run_instance(Path::new("/r/b"), Path::new("/r/a/.diffmon")),
            run_instance(Path::new("/r/a"), Path::new("/s/.diffmon")),
        ] {
            assert_ne!(
                a,
                event_id("run-a", &other, EventKind::EarlyStop, 1000, 3000)
            );
        }
        let a = event_id("run-a", "", EventKind::EarlyStop, 1000, 3000);
        assert_eq!(
            a,
            "abe7b0e1db3c597cff0e643274d58fad55431d1008da1d15a5c0986f9feca78d"
        );
        // Events built at different times keep the id, and so does naming a kept copy.
        let e1 = Event::new(
            EventKind::EarlyStop,
            "run-a",
            "icr",
            1000,
            "c",
            0.1,
            3000,
            0.2,
        );
        let e2 = Event::new(
            EventKind::EarlyStop,
            "run-a",
            "icr",
            1000,
            "d",
            0.3,
            3000,
            0.4,
        );
        assert_eq!(e1.id, a);
        assert_eq!(e2.id, a);
        let kept = Event {
            best_checkpoint_kept: Some("/r/.diffmon/best/c".into()),
            ..e1.clone()
        };
        assert_eq!(kept.id, a);
    }

    #[test]
    fn serializes_with_the_documented_names() {
        let e = Event::new(EventKind::EarlyStop, "r", "icr", 1, "ck", 0.5, 2, 0.6);
        let v = serde_json::to_value(&e).unwrap();
        assert_eq!(v["event"], "early_stop");
        for key in [
            "id",
            "event",
            "run",
            "metric",
            "trigger",
            "best_step",
            "best_checkpoint",
            "best_checkpoint_kept",
            "best_value",
            "current_step",
            "current_value",
            "fired_at",
        ] {
            assert!(v.get(key).is_some(), "{key} missing in {v}");
        }
        assert_eq!(v.as_object().unwrap().len(), 12);
        assert_eq!(v["best_checkpoint_kept"], serde_json::Value::Null);
        assert_eq!(v["trigger"], "turn");
        let back: Event = serde_json::from_value(v).unwrap();
        assert_eq!(back, e);
        let r = serde_json::to_value(EventKind::Resolved).unwrap();
        assert_eq!(r, "resolved");
    }
}
