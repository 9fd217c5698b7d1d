//! What every tracker shows of a run, in history order ([`Item`]): the evaluations with their
//! scalars, the early stops and resolutions, the resumes. Built from the journal at start-up
//! ([`Timeline::of_history`], the replay's events placed after the entry that decided them),
//! then item by item from the live evaluations and events.

use crate::alerts::{Event, EventKind};
use crate::config::EarlyStopSettings;
use crate::engine::detector::{self, Detector, DetectorState, Replayed};
use crate::record::{Evaluation, FIELDS};
use crate::store::history::{CheckpointKey, Entry};

/// The marker scalar of the early stop (1) and its resolution (0).
pub const EARLY_STOP_TAG: &str = "diffmon/early_stop";
/// The early stop's sentence.
pub const EARLY_STOP_TEXT_TAG: &str = "diffmon/early_stop_summary";
/// Every evaluation's seconds.
pub const SECONDS_TAG: &str = "diffmon/evaluation_seconds";

/// One thing a tracker shows, at a training step and a wall time (seconds since the epoch).
#[derive(Debug, Clone, PartialEq)]
pub enum Item {
    /// An evaluation: `diffmon/<field>` for each metric field with a value, the smoothed
    /// value, the seconds; wall time = the checkpoint's modification time.
    Point {
        step: i64,
        wall_time: f64,
        values: Vec<(String, f64)>,
    },
    /// An early stop or its resolution, at the step it was decided (`fired_at`), with its
    /// sentence (the alerts' summary and the event id).
    Stop {
        step: i64,
        wall_time: f64,
        event: Box<Event>,
        text: String,
    },
    /// A resume from step S (`step` = S + 1: what comes after starts there again).
    Start { step: i64, wall_time: f64 },
}

impl Item {
    pub fn step(&self) -> i64 {
        match self {
            Item::Point { step, .. } | Item::Stop { step, .. } | Item::Start { step, .. } => *step,
        }
    }

    pub fn wall_time(&self) -> f64 {
        match self {
            Item::Point { wall_time, .. }
            | Item::Stop { wall_time, .. }
            | Item::Start { wall_time, .. } => *wall_time,
        }
    }
}

/// Seconds since the epoch now.
pub fn now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// Seconds since the epoch of an RFC 3339 time of the history, else now.
pub fn wall_time(at: &str) -> f64 {
    crate::metrics::parse_rfc3339_utc(at).unwrap_or_else(now)
}

/// The item of an early stop or resolution.
pub fn stop(event: &Event) -> Item {
    Item::Stop {
        step: event.current_step,
        wall_time: wall_time(&event.fired_at),
        event: Box::new(event.clone()),
        text: format!(
            "{}\n\nEvent `{}`, decided at {}.",
            crate::alerts::summary(event),
            event.id,
            event.fired_at
        ),
    }
}

impl Item {
    /// 1 for an early stop, 0 for its resolution.
    pub fn marker(event: &Event) -> f64 {
        if event.event == EventKind::EarlyStop {
            1.0
        } else {
            0.0
        }
    }
}

/// A run's items from its history, and how to make the live ones.
pub struct Timeline {
    /// The history's items, in order.
    pub items: Vec<Item>,
    /// The history's evaluations and resumes as (journal time, step, item index), to place the
    /// replayed events after the entry that decided them.
    placed: Vec<(String, i64, usize)>,
    /// `diffmon/<early_stop.metric>_smoothed`.
    smoothed_tag: String,
}

impl Timeline {
    /// The items of `entries` (the journal), replayed with the run's early-stop settings for
    /// the smoothed values; the events come with [`Timeline::place`].
    pub fn of_history(entries: &[Entry], early_stop: EarlyStopSettings) -> Timeline {
        let metric = early_stop.metric;
        let mut t = Timeline {
            items: Vec::new(),
            placed: Vec::new(),
            smoothed_tag: format!("diffmon/{}_smoothed", metric.as_str()),
        };
        let mut detector = Detector::new(early_stop, DetectorState::default());
        detector::replay(&mut detector, metric, entries, |entry| match entry {
            Replayed::Evaluation {
                record,
                key,
                at,
                decision,
                ..
            } => {
                let item = t.point(record, key, decision.smoothed);
                t.placed.push((at.to_string(), record.step, t.items.len()));
                t.items.push(item);
            }
            Replayed::Resume { step, at, .. } => {
                t.placed.push((at.to_string(), step, t.items.len()));
                t.items.push(Item::Start {
                    step: step.saturating_add(1),
                    wall_time: wall_time(at),
                });
            }
        });
        t
    }

    /// The history's items with the replay's `events` each placed right after the evaluation
    /// or resume that decided it (same journal time and step); one that matches none goes last.
    pub fn place(&mut self, events: &[Event]) -> Vec<Item> {
        let placed = std::mem::take(&mut self.placed);
        let items = std::mem::take(&mut self.items);
        let mut after: Vec<Vec<Item>> = vec![Vec::new(); items.len() + 1];
        for event in events {
            let at = placed
                .iter()
                .rev()
                .find(|(at, step, _)| *at == event.fired_at && *step == event.current_step)
                .map_or(items.len(), |&(_, _, i)| i + 1);
            after[at].push(stop(event));
        }
        let mut ordered = Vec::with_capacity(items.len() + events.len());
        ordered.append(&mut after[0]);
        for (i, item) in items.into_iter().enumerate() {
            ordered.push(item);
            ordered.append(&mut after[i + 1]);
        }
        ordered
    }

    /// The item of an evaluation of the checkpoint `key` (`smoothed`: the detector's value
    /// after it).
    pub fn point(&self, record: &Evaluation, key: &CheckpointKey, smoothed: Option<f64>) -> Item {
        let mut values: Vec<(String, f64)> = FIELDS
            .iter()
            .filter_map(|f| Some((format!("diffmon/{}", f.name), f.float(record)?)))
            .collect();
        if let Some(s) = smoothed {
            values.push((self.smoothed_tag.clone(), s));
        }
        values.push((SECONDS_TAG.into(), record.seconds));
        Item::Point {
            step: record.step,
            wall_time: key.mtime_ns as f64 / 1e9,
            values,
        }
    }

    /// The live item of an evaluation; `state`: the detector's after it.
    pub fn live(&self, record: &Evaluation, key: &CheckpointKey, state: &DetectorState) -> Item {
        self.point(record, key, state.last_smoothed)
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use crate::config::EarlyStopMetric;

    fn entry(step: i64, icr: f64, at: &str) -> Entry {
        Entry::Evaluation {
            key: CheckpointKey {
                path: format!("/r/ckpt_{step}.pt"),
                size: 1,
                mtime_ns: step * 1_000_000_000 + 500_000_000,
            },
            at: at.into(),
            record: Box::new(Evaluation {
                step,
                icr: Some(icr),
                seconds: 0.25,
                ..Evaluation::default()
            }),
        }
    }

    /// An early stop decided at `step`, at `at`.
    pub(in crate::trackers) fn event(step: i64, at: &str) -> Event {
        Event {
            id: format!("id-{step}"),
            event: EventKind::EarlyStop,
            run: "r".into(),
            metric: "icr".into(),
            trigger: crate::config::Trigger::Turn,
            best_step: 1,
            best_checkpoint: "ckpt_1.pt".into(),
            best_checkpoint_kept: None,
            best_value: 0.25,
            current_step: step,
            current_value: 0.5,
            fired_at: at.into(),
        }
    }

    /// Each event goes right after the evaluation that decided it; the points carry every
    /// field of the record, the smoothed value and the seconds, at the checkpoint's mtime.
    #[test]
    fn the_history_becomes_points_with_the_events_in_place() {
        let entries = [
            entry(1, 0.3, "2026-01-01T00:00:01.000Z"),
            entry(2, 0.2, "2026-01-01T00:00:02.000Z"),
            entry(3, 0.4, "2026-01-01T00:00:03.000Z"),
        ];
        let settings = EarlyStopSettings {
            metric: EarlyStopMetric::Icr,
            ..EarlyStopSettings::default()
        };
        let mut t = Timeline::of_history(&entries, settings);
        let items = t.place(&[event(2, "2026-01-01T00:00:02.000Z"), event(9, "elsewhere")]);
        let steps: Vec<(i64, bool)> = items
            .iter()
            .map(|i| (i.step(), matches!(i, Item::Stop { .. })))
            .collect();
        assert_eq!(
            steps,
            [(1, false), (2, false), (2, true), (3, false), (9, true)]
        );
        let Item::Point {
            wall_time, values, ..
        } = &items[0]
        else {
            panic!("{items:?}")
        };
        assert_eq!(*wall_time, 1.5);
        let tags: Vec<&str> = values.iter().map(|(t, _)| t.as_str()).collect();
        assert_eq!(tags, ["diffmon/icr", "diffmon/icr_smoothed", SECONDS_TAG]);
        assert_eq!(values[0].1, 0.3);
        assert_eq!(items[2].wall_time(), 1_767_225_602.0);
    }
}
