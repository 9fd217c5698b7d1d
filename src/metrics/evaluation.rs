//! What each evaluation publishes: the gauges of the record's fields, the last evaluated step,
//! the evaluation's durations by stage, and the detector's state with its timestamps.

use super::labels::FieldLabels;
use super::names::STAGE_TOTAL;
use super::registry::Metrics;
use super::time::{parse_rfc3339_utc, unix_now};
use crate::record::{Evaluation, FIELDS};

impl Metrics {
    /// Publishes one evaluation's values (gauges only: a restart republishes the last one). A
    /// field the record does not have leaves its gauge as it was.
    pub fn record(&self, e: &Evaluation) {
        for (f, family) in FIELDS.iter().zip(&self.fields) {
            if let (Some(g), Some(family), Some(v)) = (f.gauge, family, f.float(e)) {
                let mut labels: FieldLabels = vec![("run", self.run.clone())];
                labels.extend(g.labels.iter().map(|(k, v)| (*k, v.to_string())));
                family.get_or_create(&labels).set(v);
            }
        }
        self.last_evaluated_step
            .get_or_create(&self.label())
            .set(e.step);
    }

    /// Counts one evaluation done by this process and its durations (total and per stage).
    pub fn evaluated(&self, e: &Evaluation) {
        self.checkpoints_evaluated
            .get_or_create(&self.label())
            .inc();
        self.last_evaluation_timestamp
            .get_or_create(&self.label())
            .set(unix_now());
        if let Some(s) = e.gpu_seconds {
            self.gpu_seconds.get_or_create(&self.label()).inc_by(s);
        }
        self.observe_stage(STAGE_TOTAL, e.seconds);
        for (stage, seconds) in &e.stages {
            self.observe_stage(stage, *seconds);
        }
    }

    /// The run's measured seconds per checkpoint (`daemon/pace.rs`).
    pub fn set_evaluation_seconds(&self, seconds: f64) {
        self.evaluation_seconds
            .get_or_create(&self.label())
            .set(seconds);
    }

    pub fn observe_stage(&self, stage: &str, seconds: f64) {
        self.evaluation_duration
            .get_or_create(&self.stage_labels(stage))
            .observe(seconds);
    }

    /// Publishes the detector's state after the evaluation made at `at` (RFC 3339, as the
    /// history records it; replayed evaluations keep their own time). A change of the best step,
    /// and the early stop firing, set their timestamp gauges to that time: the dashboard's
    /// annotations read them as the annotation's time, so none is missed between two steps.
    pub fn set_detector(
        &self,
        smoothed: Option<f64>,
        best_step: Option<i64>,
        triggered: bool,
        unconfirmed: bool,
        at: &str,
    ) {
        let l = self.label();
        {
            let mut seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
            let when = || parse_rfc3339_utc(at).unwrap_or_else(unix_now);
            if best_step.is_some() && best_step != seen.0 {
                self.best_step_timestamp.get_or_create(&l).set(when());
            }
            if triggered && !seen.1 {
                self.early_stop_timestamp.get_or_create(&l).set(when());
            }
            *seen = (best_step.or(seen.0), triggered);
        }
        if let Some(s) = smoothed {
            self.icr_smoothed.get_or_create(&l).set(s);
        }
        if let Some(b) = best_step {
            self.best_step.get_or_create(&l).set(b);
        }
        self.early_stop_triggered
            .get_or_create(&self.early_stop_labels())
            .set(triggered as i64);
        self.early_stop_unconfirmed
            .get_or_create(&l)
            .set(unconfirmed as i64);
    }

    /// The history segment the detector follows (1, then one more at each resume).
    pub fn set_segment(&self, segment: u32) {
        self.history_segment
            .get_or_create(&self.label())
            .set(i64::from(segment));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::exposition::Format;
    use crate::metrics::names::*;

    /// Each field of the table with a gauge is registered and set from a full record, with its
    /// labels, its help and its value; a record without the field leaves its gauge as it was.
    #[test]
    fn every_gauge_of_the_field_table_is_registered_and_set() {
        let full = crate::record::full_record();
        let m = Metrics::new("r");
        let before = m.encode_as(Format::Text);
        m.record(&Evaluation {
            step: 7,
            ..Evaluation::default()
        });
        let empty = m.encode_as(Format::Text);
        m.record(&full);
        let text = m.encode_as(Format::Text);
        m.record(&Evaluation {
            step: 8,
            ..Evaluation::default()
        });
        let after_empty = m.encode_as(Format::Text);
        let mut gauges = 0;
        for f in &crate::record::FIELDS {
            let Some(g) = f.gauge else { continue };
            gauges += 1;
            assert!(exported_names().iter().any(|n| n == g.name), "{}", g.name);
            assert!(
                text.contains(&format!(
                    "# HELP {} {}.\n# TYPE {} gauge\n",
                    g.name, g.help, g.name
                )),
                "{}: {text}",
                g.name
            );
            let labels: String = g
                .labels
                .iter()
                .map(|(k, v)| format!(",{k}=\"{v}\""))
                .collect();
            let series = format!("{}{{run=\"r\"{labels}}} ", g.name);
            let value = f.float(&full).unwrap();
            let line = text.lines().find(|l| l.starts_with(&series));
            let line = line.unwrap_or_else(|| panic!("no {series} in\n{text}"));
            assert_eq!(
                line[series.len()..].parse::<f64>().unwrap(),
                value,
                "{line}"
            );
            for t in [&before, &empty] {
                assert!(!t.contains(&series), "{series} set without a value");
            }
            assert!(
                after_empty.contains(line),
                "{series} changed by a record without it"
            );
        }
        assert_eq!(gauges, 13);
        assert!(
            text.contains(&format!("{ICR_STDERR}{{run=\"r\"}} 0.0042\n")),
            "{text}"
        );
    }

    /// The annotation gauges move only when the best step changes or the stop fires, to the
    /// evaluation's own time.
    #[test]
    fn best_step_and_early_stop_timestamps_are_the_evaluations_times() {
        let m = Metrics::new("r");
        let value = |name: &str| -> f64 {
            let text = m.encode_as(Format::Text);
            text.lines()
                .find_map(|l| l.strip_prefix(&format!("{name}{{run=\"r\"}} ")))
                .unwrap()
                .parse()
                .unwrap()
        };
        m.set_detector(Some(1.0), Some(1), false, false, "2023-11-14T22:13:20.500Z");
        assert_eq!(value(BEST_STEP_TIMESTAMP), 1_700_000_000.5);
        m.set_detector(Some(1.0), Some(1), false, false, "2023-11-14T22:13:30.000Z");
        assert_eq!(value(BEST_STEP_TIMESTAMP), 1_700_000_000.5);
        m.set_detector(Some(0.5), Some(2), false, false, "2023-11-14T22:13:40Z");
        assert_eq!(value(BEST_STEP_TIMESTAMP), 1_700_000_020.0);
        assert_eq!(value(EARLY_STOP_TIMESTAMP), 0.0);
        m.set_detector(Some(0.9), Some(2), true, false, "2023-11-14T22:13:50.000Z");
        m.set_detector(Some(0.9), Some(2), true, false, "2023-11-14T22:14:00.000Z");
        assert_eq!(value(EARLY_STOP_TIMESTAMP), 1_700_000_030.0);
        assert_eq!(value(BEST_STEP_TIMESTAMP), 1_700_000_020.0);
    }
}
