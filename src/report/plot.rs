//! What is plotted: the plot model ([`Plot`], its series, band and markers) and the plots of a
//! [`Snapshot`], the early-stop one first, then [`PLOTS`].

use super::snapshot::{Row, Snapshot};
use crate::config::{EarlyStopMetric, Trigger};
use crate::record::FIELDS;

pub(super) struct Series {
    /// `data-series` of its elements.
    pub(super) id: &'static str,
    pub(super) label: &'static str,
    pub(super) color: &'static str,
    /// (step, value, checkpoint) of each evaluation that has the value.
    pub(super) points: Vec<(i64, f64, String)>,
    /// Points drawn as dots (raw values) or only as a line (the smoothed curve).
    pub(super) dots: bool,
    pub(super) dashed: bool,
}

/// A shaded band value ± standard error behind a series.
pub(super) struct Band {
    /// `data-band` of its path.
    pub(super) id: &'static str,
    pub(super) color: &'static str,
    /// (step, value, stderr) of each evaluation, `None` where it has no standard error (the
    /// band breaks there).
    pub(super) points: Vec<(i64, Option<(f64, f64)>)>,
}

pub(super) struct Plot {
    pub(super) id: &'static str,
    pub(super) title: String,
    pub(super) y_label: &'static str,
    pub(super) series: Vec<Series>,
    /// Vertical lines: (data-marker, step, label, color, dashed).
    pub(super) lines: Vec<(&'static str, i64, String, &'static str, bool)>,
    /// A ringed point: (data-marker, step, value).
    pub(super) ring: Option<(&'static str, i64, f64)>,
    /// Drawn under the series.
    pub(super) band: Option<Band>,
    /// A note under the title (the early stop's state).
    pub(super) note: Option<String>,
}

impl Plot {
    /// A plot of `series` with no markers and no note.
    pub(super) fn new(
        id: &'static str,
        title: &str,
        y_label: &'static str,
        series: Vec<Series>,
    ) -> Plot {
        Plot {
            id,
            title: title.into(),
            y_label,
            series,
            lines: Vec::new(),
            ring: None,
            band: None,
            note: None,
        }
    }
}

pub(super) fn series(
    rows: &[Row],
    id: &'static str,
    label: &'static str,
    color: &'static str,
    get: impl Fn(&Row) -> Option<f64>,
) -> Series {
    Series {
        id,
        label,
        color,
        points: rows
            .iter()
            .filter_map(|r| {
                get(r)
                    .filter(|v| v.is_finite())
                    .map(|v| (r.step, v, r.checkpoint.clone()))
            })
            .collect(),
        dots: true,
        dashed: false,
    }
}

/// The early-stop series' id in the plots (`data-series`; E_gen's is `e_gen`, not the metric's
/// name [`EarlyStopMetric::as_str`]) and its axis label.
pub(super) fn metric_names(metric: EarlyStopMetric) -> (&'static str, &'static str) {
    match metric {
        EarlyStopMetric::Icr => ("icr", "ICR"),
        EarlyStopMetric::PfdGeneralization => ("e_gen", "E_gen"),
    }
}

/// The plots after the early-stop one, in order: (id, title, y label). Their series are the
/// fields of `record::FIELDS` whose `series` names the plot, in the table's order.
pub const PLOTS: [(&str, &str, &str); 4] = [
    (
        "pfd",
        "PFD: E_gen (to the teacher), E_mem (to the data)",
        "PFD",
    ),
    (
        "memorization",
        "Memorization ratio (share of samples)",
        "ratio",
    ),
    (
        "traces",
        "ICR traces: invariant Tr Σ_s, residual Tr Σ_ξ",
        "trace",
    ),
    ("gap", "Generalization gap (held-out − train loss)", "gap"),
];

/// The plots of a snapshot. Every series follows the run's lineage (the rows no resume
/// abandoned); the early-stop plot also shows the abandoned branches' values, in grey, and a
/// line at each resume.
pub(super) fn plots(s: &Snapshot) -> Vec<Plot> {
    let rows: Vec<Row> = s.lineage().cloned().collect();
    let rows = &rows;
    let (id, label) = metric_names(s.metric);
    let raw = series(rows, id, label, "#1f77b4", |r| r.value);
    let mut smoothed = series(rows, "smoothed", "smoothed", "#ff7f0e", |r| r.smoothed);
    smoothed.dots = false;
    let abandoned: Vec<Row> = s.rows.iter().filter(|r| r.abandoned).cloned().collect();
    let mut before_resume = series(
        &abandoned,
        "abandoned",
        "before the resume",
        "#aaaaaa",
        |r| r.value,
    );
    before_resume.dashed = true;
    let mut main = Plot {
        id: "early-stop",
        title: format!("{label}: raw and smoothed"),
        y_label: label,
        series: [raw, smoothed]
            .into_iter()
            .chain((!before_resume.points.is_empty()).then_some(before_resume))
            .collect(),
        lines: Vec::new(),
        ring: None,
        band: None,
        note: Some(early_stop_note(s)),
    };
    if rows.iter().any(|r| r.stderr.is_some()) {
        main.band = Some(Band {
            id,
            color: "#1f77b4",
            points: rows
                .iter()
                .filter(|r| r.value.is_some())
                .map(|r| (r.step, r.value.zip(r.stderr)))
                .collect(),
        });
    }
    for &(step, segment) in &s.resumes {
        main.lines.push((
            "resume",
            step,
            format!("resumed {step} (segment {segment})"),
            "#7f7f7f",
            false,
        ));
    }
    if let Some(b) = &s.best {
        main.ring = Some(("best", b.step, b.value));
        main.lines
            .push(("best", b.step, format!("best {}", b.step), "#2ca02c", true));
    }
    if let Some((best, step)) = &s.fired {
        if s.best.as_ref().is_none_or(|b| b.step != best.step) {
            main.lines.push((
                "fired-best",
                best.step,
                format!("best at the stop {}", best.step),
                "#2ca02c",
                true,
            ));
        }
        main.lines.push((
            "early-stop",
            *step,
            format!("early stop {step}"),
            "#d62728",
            false,
        ));
    }
    let mut out = vec![main];
    let optional = PLOTS.iter().map(|&(id, title, y_label)| {
        let drawn = FIELDS.iter().enumerate().filter_map(|(k, f)| {
            let s = f.series.filter(|s| s.plot == id)?;
            Some(series(rows, f.name, s.label, s.color, |r| r.fields[k]))
        });
        Plot::new(id, title, y_label, drawn.collect())
    });
    out.extend(optional.filter(|p| p.series.iter().any(|s| !s.points.is_empty())));
    out
}

pub(super) fn early_stop_note(s: &Snapshot) -> String {
    let state = state_note(s);
    let mut note = match s.resumes.last() {
        Some((step, segment)) => format!("{state} (segment {segment}: resumed from step {step})"),
        None => state,
    };
    // The stops of the segments a resume ended: the current segment's note does not show them.
    for stop in &s.earlier_stops {
        note.push_str(&format!(
            "; segment {}: early stop fired at step {} (best step {}){}",
            stop.segment,
            stop.at,
            stop.best.step,
            if stop.resolved { ", then resolved" } else { "" }
        ));
    }
    note
}

fn state_note(s: &Snapshot) -> String {
    match &s.fired {
        Some((best, step)) if s.resolved => format!(
            "early stop fired at step {step} (best step {}), then resolved: the curve went below that best again",
            best.step
        ),
        Some((best, step)) if s.fired_by == Some(Trigger::Memorization) => format!(
            "EARLY STOP fired at step {step}, where the memorization ratio reached its stop level: best checkpoint before it step {} ({:.5})",
            best.step, best.value
        ),
        Some((best, step)) => format!(
            "EARLY STOP fired at step {step}: best checkpoint step {} ({:.5})",
            best.step, best.value
        ),
        None if s.unconfirmed => "the curve has turned, not confirmed yet: nothing sent".into(),
        None => match &s.best {
            Some(b) => format!(
                "no early stop; best so far step {} ({:.5})",
                b.step, b.value
            ),
            None => "no evaluations yet".into(),
        },
    }
}
