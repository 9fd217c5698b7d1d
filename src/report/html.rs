//! The plots as an HTML page: the live page (`GET /`, reloading itself) and `--out F.html`,
//! with the early stop's state and the last evaluations in a table.

use super::layout::PAGE_PLOT;
use super::plot::{Plot, early_stop_note, metric_names};
use super::snapshot::{KeptCopy, Row, Snapshot};
use super::svg::{escape, plot_body, summary, x_range};
use crate::store::keep_best::NOT_KEPT;
use std::fmt::Write as _;
use std::path::Path;

pub(super) fn fmt_opt(v: Option<f64>) -> String {
    v.map(|v| format!("{v:.5}")).unwrap_or_else(|| "–".into())
}

pub(super) fn html(s: &Snapshot, plots: &[Plot], refresh_secs: Option<u32>) -> String {
    let range = x_range(s);
    let run = escape(&s.run);
    let mut o = String::new();
    o.push_str(
        r#"<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
"#,
    );
    if let Some(secs) = refresh_secs {
        let _ = writeln!(o, r#"<meta http-equiv="refresh" content="{secs}">"#);
    }
    let _ = write!(
        o,
        r#"<title>diffmon: {run}</title>
<style>
body {{ font-family: system-ui, "DejaVu Sans", sans-serif; color: #222; margin: 0 auto; max-width: 760px; padding: 8px 12px; }}
h1 {{ font-size: 1.3em; margin: 0.4em 0; }}
svg.plot {{ display: block; width: 100%; height: auto; margin: 10px 0; border: 1px solid #eee; }}
.status {{ margin: 0.3em 0; }}
.fired {{ color: #d62728; font-weight: bold; }}
.warn {{ color: #a05a00; }}
.path {{ word-break: break-all; }}
.table {{ overflow-x: auto; }}
table {{ border-collapse: collapse; font-size: 0.85em; }}
th, td {{ padding: 2px 6px; text-align: right; border-bottom: 1px solid #eee; }}
td {{ white-space: nowrap; }}
td.path {{ text-align: left; }}
.foot {{ color: #777; font-size: 0.8em; }}
</style>
</head>
<body>
<h1>diffmon: {run}</h1>
<p class="status" id="summary">{}</p>
"#,
        escape(&summary(s))
    );
    let note = early_stop_note(s);
    let class = if s.fired.is_some() && !s.resolved {
        "status fired"
    } else {
        "status"
    };
    let _ = writeln!(
        o,
        r#"<p class="{class}" id="early-stop">{}</p>"#,
        escape(&note)
    );
    if let Some((step, warning)) = &s.parameterization {
        let _ = writeln!(
            o,
            r#"<p class="status warn" id="parameterization">parameterization check (step {step}): {}</p>"#,
            escape(warning)
        );
    }
    if let Some(b) = s.named() {
        // Its kept copy beside it: rotation may have deleted the original (docs/design.md §17).
        let kept = match s.best_kept() {
            Some(KeptCopy::At(path)) => format!(
                r#"kept as <span class="path" id="best-checkpoint-kept">{}</span>"#,
                escape(&path)
            ),
            Some(KeptCopy::Keeping) => {
                r#"<span id="best-checkpoint-kept">a copy is being kept (early_stop.keep_best)</span>"#
                    .into()
            }
            Some(KeptCopy::NotKept) | None => format!(
                r#"<span id="best-checkpoint-kept">{}</span>"#,
                escape(NOT_KEPT)
            ),
        };
        let _ = writeln!(
            o,
            r#"<p class="status">best checkpoint: <span class="path" id="best-checkpoint">{}</span> (step {}), {kept}</p>"#,
            escape(&b.checkpoint),
            b.step
        );
    }
    for p in plots {
        let _ = writeln!(
            o,
            r#"<svg class="plot" xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {} {}" role="img" aria-label="{}">{}</svg>"#,
            PAGE_PLOT.0,
            PAGE_PLOT.1,
            escape(&p.title),
            plot_body(p, range, PAGE_PLOT)
        );
    }
    let (_, label) = metric_names(s.metric);
    if !s.rows.is_empty() {
        o.push_str(&table(s, label));
    }
    let generated = crate::record::rfc3339_utc(std::time::SystemTime::now());
    let _ = write!(
        o,
        r#"<p class="foot">diffmon {} · generated {generated}"#,
        env!("CARGO_PKG_VERSION")
    );
    if let Some(at) = &s.last_at {
        let _ = write!(o, " · last evaluation recorded {}", escape(at));
    }
    if let Some(secs) = refresh_secs {
        let _ = write!(
            o,
            r#" · reloads every {secs} s · <a href="metrics">metrics</a> · <a href="v1/early-stop">early-stop status</a>"#
        );
    }
    o.push_str("</p>\n</body>\n</html>\n");
    o
}

/// The last ten evaluations, newest first, with the columns that have values.
pub(super) fn table(s: &Snapshot, label: &str) -> String {
    type Column = (&'static str, Box<dyn Fn(&Row) -> Option<f64>>);
    // The smoothed value, then the fields with a report column (`record::FIELDS`).
    let mut candidates: Vec<Column> = vec![("smoothed", Box::new(|r: &Row| r.smoothed))];
    for (k, c) in crate::record::columns() {
        if let Some(label) = c.report {
            candidates.push((label, Box::new(move |r: &Row| r.fields[k])));
        }
    }
    let rows: Vec<&Row> = s.rows.iter().rev().take(10).collect();
    let columns: Vec<&Column> = candidates
        .iter()
        .filter(|(_, get)| rows.iter().any(|r| get(r).is_some()))
        .collect();
    let mut o = format!(
        "<h2>Last evaluations</h2>\n<div class=\"table\"><table>\n<tr><th>step</th><th>{}</th>",
        escape(label)
    );
    for (name, _) in &columns {
        let _ = write!(o, "<th>{name}</th>");
    }
    // After a resume: which segment each evaluation is from, and whether its branch was left.
    let segmented = !s.resumes.is_empty();
    if segmented {
        o.push_str("<th>segment</th>");
    }
    o.push_str("<th>checkpoint</th></tr>\n");
    for r in rows {
        let _ = write!(o, "<tr><td>{}</td><td>{}</td>", r.step, fmt_opt(r.value));
        for (_, get) in &columns {
            let _ = write!(o, "<td>{}</td>", fmt_opt(get(r)));
        }
        if segmented {
            let left = if r.abandoned { " (abandoned)" } else { "" };
            let _ = write!(o, "<td>{}{left}</td>", r.segment);
        }
        let name = Path::new(&r.checkpoint)
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| r.checkpoint.clone());
        let _ = writeln!(
            o,
            r#"<td class="path" title="{}">{}</td></tr>"#,
            escape(&r.checkpoint),
            escape(&name)
        );
    }
    o.push_str("</table></div>\n");
    o
}
