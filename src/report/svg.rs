//! The plots drawn as SVG: axes, ticks, points and curves, markers, and the standalone SVG
//! of all plots (what `--out F.svg` writes and the PNG rasterizes).

use super::layout::{
    FONT, HEADER_HEIGHT, MARGIN_BOTTOM, MARGIN_LEFT, MARGIN_RIGHT, MARGIN_TOP, SVG_PLOT,
};
use super::plot::{Band, Plot, metric_names};
use super::snapshot::Snapshot;
use std::fmt::Write as _;

/// Escapes text for HTML and XML (element content and quoted attributes alike).
pub fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            // Characters XML 1.0 does not allow: control characters, U+FFFE and U+FFFF.
            c if (c as u32) < 0x20 && !matches!(c, '\t' | '\n' | '\r') => out.push('\u{FFFD}'),
            '\u{FFFE}' | '\u{FFFF}' => out.push('\u{FFFD}'),
            c => out.push(c),
        }
    }
    out
}

/// About `n` round tick values covering [lo, hi].
pub(super) fn ticks(lo: f64, hi: f64, n: usize, integer: bool) -> (Vec<f64>, usize) {
    let raw = (hi - lo) / n.max(1) as f64;
    let magnitude = 10f64.powf(raw.log10().floor());
    let norm = raw / magnitude;
    let mut step = magnitude
        * if norm < 1.5 {
            1.0
        } else if norm < 3.0 {
            2.0
        } else if norm < 7.0 {
            5.0
        } else {
            10.0
        };
    if integer {
        step = step.max(1.0);
    }
    let decimals = if integer {
        0
    } else {
        (-step.log10().floor()).clamp(0.0, 12.0) as usize
    };
    let first = (lo / step).ceil();
    let out = (0..50)
        .map(|k| (first + k as f64) * step)
        .take_while(|v| *v <= hi + step * 1e-9)
        // Snap values within rounding error of zero to +0 (no "-0.00" label).
        .map(|v| if v.abs() < step * 1e-6 { 0.0 } else { v })
        .collect();
    (out, decimals)
}

/// A range around the values, padded, never empty. A flat series (every value the same, to
/// within rounding) gets a range its ticks can label in a few digits: `[0, 1]` (padded) around
/// 0, which is where a ratio or a distance that never moved sits, and ± a tenth of
/// `max(|value|, 1)` around any other value.
pub(super) fn domain(values: impl Iterator<Item = f64>, pad: f64) -> (f64, f64) {
    let (lo, hi) = values.fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| {
        (lo.min(v), hi.max(v))
    });
    if !lo.is_finite() || !hi.is_finite() {
        return (0.0, 1.0);
    }
    let span = hi - lo;
    let scale = lo.abs().max(hi.abs()).max(1.0);
    if span <= 1e-9 * scale {
        let mid = lo + span / 2.0;
        if mid.abs() <= 1e-9 {
            return (-pad, 1.0 + pad);
        }
        let d = 0.1 * mid.abs().max(1.0);
        return (mid - d, mid + d);
    }
    (lo - pad * span, hi + pad * span)
}

/// One plot's elements in a `size` box, steps mapped over `x_range`.
pub(super) fn plot_body(p: &Plot, x_range: (f64, f64), size: (u32, u32)) -> String {
    let (w, h) = (size.0 as f64, size.1 as f64);
    let (x0, x1) = (MARGIN_LEFT, w - MARGIN_RIGHT);
    let (y0, y1) = (h - MARGIN_BOTTOM, MARGIN_TOP + 14.0);
    let mut values: Vec<f64> = p
        .series
        .iter()
        .flat_map(|s| s.points.iter().map(|q| q.1))
        .collect();
    values.extend(p.ring.map(|r| r.2));
    if let Some(band) = &p.band {
        values.extend(
            band.points
                .iter()
                .filter_map(|q| q.1)
                .flat_map(|(v, e)| [v - e, v + e]),
        );
    }
    let (lo, hi) = domain(values.into_iter(), 0.08);
    let sx = |step: f64| x0 + (step - x_range.0) / (x_range.1 - x_range.0) * (x1 - x0);
    let sy = |v: f64| y0 + (v - lo) / (hi - lo) * (y1 - y0);
    let mut o = String::new();
    let _ = write!(
        o,
        r##"<g class="plot" data-plot="{id}" font-family="{FONT}" font-size="13" fill="#222">"##,
        id = p.id
    );
    let _ = write!(
        o,
        r##"<rect x="0" y="0" width="{w}" height="{h}" fill="#fff"/><text x="8" y="18" font-size="15" font-weight="bold">{}</text>"##,
        escape(&p.title)
    );
    if let Some(note) = &p.note {
        let color = if note.starts_with("EARLY STOP") {
            "#d62728"
        } else {
            "#555"
        };
        let _ = write!(
            o,
            r##"<text x="8" y="{}" fill="{color}" data-note="early-stop">{}</text>"##,
            MARGIN_TOP + 4.0,
            escape(note)
        );
    }
    // Axes, grid and tick labels.
    let (yticks, yd) = ticks(lo, hi, 5, false);
    for v in &yticks {
        let y = sy(*v);
        let _ = write!(
            o,
            r##"<line x1="{x0}" y1="{y:.1}" x2="{x1}" y2="{y:.1}" stroke="#e5e5e5"/><text x="{:.1}" y="{:.1}" text-anchor="end">{v:.yd$}</text>"##,
            x0 - 6.0,
            y + 4.0
        );
    }
    let (xticks, _) = ticks(x_range.0, x_range.1, (w / 100.0) as usize, true);
    for v in &xticks {
        let x = sx(*v);
        let _ = write!(
            o,
            r##"<line x1="{x:.1}" y1="{y0}" x2="{x:.1}" y2="{:.1}" stroke="#999"/><text x="{x:.1}" y="{:.1}" text-anchor="middle">{v:.0}</text>"##,
            y0 + 5.0,
            y0 + 18.0
        );
    }
    let _ = write!(
        o,
        r##"<path d="M{x0},{y1} V{y0} H{x1}" fill="none" stroke="#444"/><text x="{:.1}" y="{:.1}" text-anchor="middle" data-axis="x">step</text><text transform="translate(14 {:.1}) rotate(-90)" text-anchor="middle" data-axis="y">{}</text>"##,
        (x0 + x1) / 2.0,
        h - 6.0,
        (y0 + y1) / 2.0,
        escape(p.y_label)
    );
    if let Some(band) = &p.band {
        o.push_str(&band_path(band, sx, sy));
    }
    // Marker lines under the data.
    for (k, (marker, step, label, color, dashed)) in p.lines.iter().enumerate() {
        let x = sx(*step as f64);
        let dash = if *dashed {
            r#" stroke-dasharray="5 4""#
        } else {
            ""
        };
        let anchor = if x > (x0 + x1) / 2.0 { "end" } else { "start" };
        let tx = if anchor == "end" { x - 4.0 } else { x + 4.0 };
        let _ = write!(
            o,
            r##"<g data-marker="{marker}" data-step="{step}"><line x1="{x:.1}" y1="{y0}" x2="{x:.1}" y2="{y1}" stroke="{color}" stroke-width="1.5"{dash}/><text x="{tx:.1}" y="{:.1}" fill="{color}" text-anchor="{anchor}">{}</text></g>"##,
            y1 + 12.0 + 14.0 * k as f64,
            escape(label)
        );
    }
    // The data: the lines (of two points or more), then the dots over them.
    for s in p.series.iter().filter(|s| s.points.len() >= 2) {
        let points: Vec<String> = s
            .points
            .iter()
            .map(|(step, v, _)| format!("{:.1},{:.1}", sx(*step as f64), sy(*v)))
            .collect();
        let dash = if s.dashed {
            r#" stroke-dasharray="4 3""#
        } else {
            ""
        };
        let width = if s.dots { 1.5 } else { 2.5 };
        let _ = write!(
            o,
            r##"<polyline data-series="{id}" data-points="{n}" points="{pts}" fill="none" stroke="{color}" stroke-width="{width}" stroke-linejoin="round"{dash}/>"##,
            id = s.id,
            n = s.points.len(),
            pts = points.join(" "),
            color = s.color
        );
    }
    for s in p.series.iter().filter(|s| s.dots) {
        let _ = write!(o, r#"<g data-series="{}-points">"#, s.id);
        for (step, v, checkpoint) in &s.points {
            let _ = write!(
                o,
                r##"<circle cx="{:.1}" cy="{:.1}" r="3.5" fill="{color}"><title>step {step}: {label} {v:.6} ({})</title></circle>"##,
                sx(*step as f64),
                sy(*v),
                escape(checkpoint),
                color = s.color,
                label = s.label,
            );
        }
        o.push_str("</g>");
    }
    if let Some((marker, step, v)) = p.ring {
        let _ = write!(
            o,
            r##"<circle data-marker="{marker}-point" data-step="{step}" cx="{:.1}" cy="{:.1}" r="7" fill="none" stroke="#2ca02c" stroke-width="2.5"/>"##,
            sx(step as f64),
            sy(v)
        );
    }
    // The legend, top right.
    let mut lx = x1;
    for s in p.series.iter().rev().filter(|s| !s.points.is_empty()) {
        let text_w = 7.5 * s.label.chars().count() as f64;
        lx -= text_w + 26.0;
        let _ = write!(
            o,
            r##"<line x1="{lx:.1}" y1="13" x2="{:.1}" y2="13" stroke="{}" stroke-width="3"/><text x="{:.1}" y="18">{}</text>"##,
            lx + 16.0,
            s.color,
            lx + 20.0,
            s.label
        );
    }
    if p.series.iter().all(|s| s.points.is_empty()) {
        let _ = write!(
            o,
            r##"<text x="{:.1}" y="{:.1}" text-anchor="middle" fill="#888">no evaluations yet</text>"##,
            (x0 + x1) / 2.0,
            (y0 + y1) / 2.0
        );
    }
    o.push_str("</g>");
    o
}

/// The band as one `<path>`: a closed outline (value + stderr forwards, value − stderr back) for
/// each run of two or more consecutive points with a standard error; a point without one
/// breaks it, and a point alone between two breaks is left out. Empty without such a run.
fn band_path(band: &Band, sx: impl Fn(f64) -> f64, sy: impl Fn(f64) -> f64) -> String {
    let mut d = String::new();
    for run in band.points.split(|q| q.1.is_none()) {
        if run.len() < 2 {
            continue;
        }
        let vertex = |q: &(i64, Option<(f64, f64)>), sign: f64| {
            let (v, e) = q.1.unwrap_or_default();
            format!("{:.1},{:.1}", sx(q.0 as f64), sy(v + sign * e))
        };
        let upper = run.iter().map(|q| vertex(q, 1.0));
        let lower = run.iter().rev().map(|q| vertex(q, -1.0));
        let outline: Vec<String> = upper.chain(lower).collect();
        if !d.is_empty() {
            d.push(' ');
        }
        let _ = write!(d, "M{} Z", outline.join(" L"));
    }
    if d.is_empty() {
        return d;
    }
    format!(
        r##"<path data-band="{id}" d="{d}" fill="{color}" fill-opacity="0.18" stroke="none"><title>± one standard error (jackknife)</title></path>"##,
        id = band.id,
        color = band.color
    )
}

/// The step range shared by all plots, so that they line up.
pub(super) fn x_range(s: &Snapshot) -> (f64, f64) {
    let (lo, hi) = s.rows.iter().fold((i64::MAX, i64::MIN), |(lo, hi), r| {
        (lo.min(r.step), hi.max(r.step))
    });
    if lo > hi {
        return (0.0, 1.0);
    }
    let span = (hi - lo) as f64;
    if span == 0.0 {
        return (lo as f64 - 1.0, hi as f64 + 1.0);
    }
    (lo as f64 - 0.03 * span, hi as f64 + 0.03 * span)
}

pub(super) fn summary(s: &Snapshot) -> String {
    let (_, label) = metric_names(s.metric);
    let mut text = format!("{} evaluation(s)", s.rows.len());
    if let Some(last) = s.rows.last() {
        text += &format!(", last step {}", last.step);
        if let Some(v) = last.value {
            text += &format!(" ({label} {v:.5})");
        }
    }
    if s.failures > 0 {
        text += &format!(", {} failed", s.failures);
    }
    text
}

pub(super) fn standalone_svg(s: &Snapshot, plots: &[Plot]) -> String {
    let (width, plot_height) = SVG_PLOT;
    let height = HEADER_HEIGHT + plot_height * plots.len() as u32;
    let range = x_range(s);
    let mut o = String::new();
    let _ = write!(
        o,
        r##"<?xml version="1.0" encoding="UTF-8"?>
<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" viewBox="0 0 {width} {height}" font-family="{FONT}"><rect width="100%" height="100%" fill="#fff"/><text x="8" y="24" font-size="18" font-weight="bold" fill="#222">diffmon: {}</text><text x="8" y="44" font-size="13" fill="#555">{}</text>"##,
        escape(&s.run),
        escape(&summary(s))
    );
    for (k, p) in plots.iter().enumerate() {
        let _ = write!(
            o,
            r#"<g transform="translate(0 {})">{}</g>"#,
            HEADER_HEIGHT + plot_height * k as u32,
            plot_body(p, range, SVG_PLOT)
        );
    }
    o.push_str("</svg>\n");
    o
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The labels of the y axis as drawn: the `<text>` elements of a plot body that hold a
    /// number (the x axis's steps are integers, drawn below the plot; these are right-aligned
    /// at its left).
    fn y_tick_labels(body: &str) -> Vec<String> {
        let doc = roxmltree::Document::parse(body).expect("the plot is well-formed XML");
        doc.descendants()
            .filter(|n| n.has_tag_name("text") && n.attribute("text-anchor") == Some("end"))
            .filter_map(|n| n.text())
            .filter(|t| t.parse::<f64>().is_ok())
            .map(str::to_string)
            .collect()
    }

    /// A memorization ratio that is 0 at every checkpoint drew the axis from -0.0000000010 to
    /// 0.0000000010, its labels over the axis title: a flat series gets short, plain labels
    /// (at most 6 characters, no exponent) around its value, which lies within the axis.
    #[test]
    fn a_flat_series_has_short_plain_tick_labels() {
        use super::super::plot::Series;
        for value in [0.0, 0.775, -3.0, 1234.5, 1e-12] {
            let series = Series {
                id: "memorization_ratio",
                label: "memorized",
                color: "#9467bd",
                dots: true,
                dashed: false,
                points: (1..=6).map(|k| (50 * k, value, format!("c{k}"))).collect(),
            };
            let plot = Plot::new("memorization", "memorization", "memorized", vec![series]);
            let body = plot_body(&plot, (0.0, 350.0), SVG_PLOT);
            let labels = y_tick_labels(&body);
            assert!(labels.len() >= 3, "{value}: {labels:?}");
            for l in &labels {
                assert!(
                    l.len() <= 6 && !l.contains(['e', 'E']),
                    "{value}: {labels:?}"
                );
            }
            let ticks: Vec<f64> = labels.iter().map(|l| l.parse().unwrap()).collect();
            let (lo, hi) = (ticks[0], ticks[ticks.len() - 1]);
            assert!(lo <= value && value <= hi, "{value}: {labels:?}");
        }
        // At 0: the axis of a ratio, from 0 to 1.
        assert_eq!(domain([0.0, 0.0].into_iter(), 0.05), (-0.05, 1.05));
    }

    #[test]
    fn tick_labels_are_round_and_never_negative_zero() {
        let (t, decimals) = ticks(-0.003, 0.041, 5, false);
        assert_eq!(decimals, 2);
        assert_eq!(t.len(), 5);
        assert!(t.contains(&0.0));
        let labels: Vec<String> = t.iter().map(|v| format!("{v:.decimals$}")).collect();
        assert_eq!(labels, ["0.00", "0.01", "0.02", "0.03", "0.04"]);
        let (t, _) = ticks(37.0, 1063.0, 8, true);
        assert_eq!(t.first(), Some(&100.0));
        assert!(t.iter().all(|v| v.fract() == 0.0));
    }
}
