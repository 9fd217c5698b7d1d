//! Plots of a run's history: the daemon's live page (`GET /`) and `diffmon report --out
//! F.{html,svg,png}` (docs/design.md §14) draw the same plots with the one renderer here,
//! [`render`].
//!
//! The plots: the early-stop metric (ICR by default) as raw points with the smoothed curve the
//! detector uses, the best step and the early stop marked, and for ICR a shaded band of ± its
//! standard error (`icr_stderr`, docs/design.md §2) where records have one; then [`PLOTS`], whose series are the
//! record fields drawn in them (`record::FIELDS`): PFD (E_gen, E_mem); the memorization ratio;
//! the invariant and residual traces; the denoising generalization gap. A plot whose metrics
//! were never computed is left out. The input is a [`Snapshot`]: plain data that the
//! daemon keeps up to date after every evaluation and that the report command rebuilds by
//! replaying the history journal through the detector, as the daemon does when it restarts.
//!
//! Everything is server-side SVG: no JavaScript. The HTML page scales each plot to the width of
//! the screen. PNG is the SVG rasterized by `resvg`, with a system font (DejaVu Sans, from the
//! Debian package `fonts-dejavu-core`, or any other sans-serif face found).
//!
//! A sweep's report ([`write_sweep`]) is one file per run, named after the output with the
//! run's name appended (`report.html` → `report-<run>.html`), and, in HTML, the index of the
//! runs at the output's own name, linking each run's page; the daemon's live front page of a
//! sweep is the same index ([`index_page`]).
//!
//! Files: `mod.rs` the formats, [`write`], [`write_sweep`] and [`render`]; `index.rs` the index
//! of a sweep's runs; `snapshot.rs` the [`Snapshot`] and
//! its rows and markers; `plot.rs` what is plotted (the plot model, the plots of a snapshot,
//! [`PLOTS`]); `layout.rs` sizes, margins and fonts; `svg.rs` the plots drawn as SVG (and
//! [`escape`]); `html.rs` the page; `png.rs` the SVG rasterized; `error.rs` the
//! [`ReportError`].

mod error;
mod html;
mod index;
mod layout;
mod plot;
mod png;
mod snapshot;
mod svg;

use crate::store::history::{History, JOURNAL};
pub use error::ReportError;
use html::html;
pub use index::{IndexRow, index_page};
pub use plot::PLOTS;
use plot::plots;
use png::rasterize;
pub use snapshot::{KeptCopy, Marker, Row, Snapshot};
use std::path::{Path, PathBuf};
pub use svg::escape;
use svg::standalone_svg;

/// How often the live page reloads itself.
pub const LIVE_REFRESH_SECS: u32 = 10;

/// The output format.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// A standalone page; with `refresh_secs`, the live page that reloads itself.
    Html { refresh_secs: Option<u32> },
    /// One SVG with the plots stacked.
    Svg,
    /// That SVG rasterized.
    Png,
}

impl Format {
    /// The format named by a file's extension (`.html`/`.htm`, `.svg`, `.png`, any case).
    pub fn of_path(path: &Path) -> Result<Format, ReportError> {
        let extension = path
            .extension()
            .map(|e| e.to_string_lossy().to_lowercase())
            .unwrap_or_default();
        match extension.as_str() {
            "html" | "htm" => Ok(Format::Html { refresh_secs: None }),
            "svg" => Ok(Format::Svg),
            "png" => Ok(Format::Png),
            _ => Err(ReportError::UnknownFormat {
                path: path.to_path_buf(),
                extension: if extension.is_empty() {
                    "(none)".into()
                } else {
                    format!(".{extension}")
                },
            }),
        }
    }
}

/// `diffmon report`: the plots of the run's history in the format of `out`'s extension.
pub fn write(config: &crate::config::Config, out: &Path) -> Result<(), ReportError> {
    let format = Format::of_path(out)?;
    let snapshot = snapshot_of(config)?;
    write_file(out, &render(&snapshot, format)?)
}

/// `diffmon report` on a sweep: each run's plots in the format of `out`'s extension, in
/// [`run_file`]`(out, run)`; in HTML, then the index of the runs in `out`, linking each page.
/// A run with no history yet gets no page (the index names it so); with none at all, it is
/// [`ReportError::NoHistory`]. Returns the files written, the index last.
pub fn write_sweep(
    runs: &[crate::config::Config],
    out: &Path,
) -> Result<Vec<PathBuf>, ReportError> {
    let format = Format::of_path(out)?;
    let mut written = Vec::new();
    let mut rows = Vec::new();
    let mut missing = None;
    for config in runs {
        let name = config.run_name();
        let snapshot = match snapshot_of(config) {
            Ok(snapshot) => snapshot,
            Err(ReportError::NoHistory { path }) => {
                tracing::warn!(run = %name, journal = %path.display(), "no history yet: no page for this run");
                missing.get_or_insert(path);
                rows.push(IndexRow {
                    name,
                    ..IndexRow::default()
                });
                continue;
            }
            Err(e) => return Err(e),
        };
        let file = run_file(out, &name);
        write_file(&file, &render(&snapshot, format)?)?;
        rows.push(IndexRow {
            href: file.file_name().map(|f| f.to_string_lossy().into_owned()),
            last_step: snapshot.rows.last().map(|r| r.step),
            best_step: snapshot.best.as_ref().map(|b| b.step),
            fired: snapshot.fired.is_some() && !snapshot.resolved,
            name,
        });
        written.push(file);
    }
    if written.is_empty() {
        return Err(ReportError::NoHistory {
            path: missing.unwrap_or_else(|| out.to_path_buf()),
        });
    }
    if matches!(format, Format::Html { .. }) {
        write_file(out, index_page(&rows, None).as_bytes())?;
        written.push(out.to_path_buf());
    }
    Ok(written)
}

/// The file of run `run`'s plots in a sweep's report to `out`: `out` with `-<run>` appended to
/// its name before the extension (`report.html` → `report-<run>.html`), in the same folder.
pub fn run_file(out: &Path, run: &str) -> PathBuf {
    let stem = out
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    let name = match out.extension() {
        Some(ext) => format!("{stem}-{run}.{}", ext.to_string_lossy()),
        None => format!("{stem}-{run}"),
    };
    out.with_file_name(name)
}

/// The snapshot of a run's history, replayed as the daemon does at start, with the kept copy
/// of its best checkpoint as the state folder holds it now.
fn snapshot_of(config: &crate::config::Config) -> Result<Snapshot, ReportError> {
    let state_dir = config.state_dir();
    let journal = state_dir.join(JOURNAL);
    if !journal.is_file() {
        return Err(ReportError::NoHistory { path: journal });
    }
    let entries = History::read(&state_dir)?;
    let mut snapshot = Snapshot::replay(
        &config.run_name(),
        config.early_stop.metric,
        config.early_stop_resolved(),
        &entries,
    );
    // The kept copy is what the state folder holds now (the daemon may still be making it).
    if let Some(best) = snapshot
        .best
        .as_ref()
        .filter(|_| config.early_stop.keep_best)
    {
        let copy = crate::store::keep_best::lookup(&state_dir, Path::new(&best.checkpoint))
            .map_or(KeptCopy::NotKept, |p| KeptCopy::At(p.display().to_string()));
        snapshot.kept = Some((best.checkpoint.clone(), copy));
    }
    Ok(snapshot)
}

fn write_file(path: &Path, bytes: &[u8]) -> Result<(), ReportError> {
    std::fs::write(path, bytes).map_err(|source| ReportError::Write {
        path: path.to_path_buf(),
        source,
    })
}

/// The plots of a snapshot as an HTML page, one SVG, or a PNG image.
pub fn render(s: &Snapshot, format: Format) -> Result<Vec<u8>, ReportError> {
    let plots = plots(s);
    match format {
        Format::Html { refresh_secs } => Ok(html(s, &plots, refresh_secs).into_bytes()),
        Format::Svg => Ok(standalone_svg(s, &plots).into_bytes()),
        Format::Png => rasterize(&standalone_svg(s, &plots)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{EarlyStopMetric, EarlyStopSettings};
    use crate::record::{Evaluation, FIELDS};
    use crate::store::history::Entry;

    fn record(step: i64, icr: f64, checkpoint: &str) -> Evaluation {
        Evaluation {
            step,
            checkpoint: checkpoint.to_string(),
            icr: Some(icr),
            icr_invariant_trace: Some(10.0 + icr),
            icr_residual_trace: Some(2.0 * icr),
            generalization_gap: Some(0.01 * step as f64 / 50.0),
            seconds: 1.0,
            ..Evaluation::default()
        }
    }

    /// A U-curve over 12 checkpoints, its smoothed minimum named after step 300 (at step 350,
    /// the median of 0.87, 0.85 and 0.84 is the value of step 300); the default detector fires
    /// at step 500.
    fn u_curve(hostile: &str) -> Snapshot {
        let icr = [
            0.95, 0.93, 0.91, 0.89, 0.87, 0.85, 0.84, 0.86, 0.88, 0.90, 0.92, 0.94,
        ];
        let entries: Vec<Entry> = (1..=12)
            .map(|i| {
                let step = 50 * i;
                let icr = icr[i as usize - 1];
                let checkpoint = if i == 6 {
                    hostile.to_string()
                } else {
                    format!("/runs/x/ckpt_{step}.pt")
                };
                Entry::Evaluation {
                    key: crate::store::history::CheckpointKey {
                        path: checkpoint.clone(),
                        size: 1,
                        mtime_ns: step,
                    },
                    at: "2026-01-01T00:00:00Z".into(),
                    record: Box::new(record(step, icr, &checkpoint)),
                }
            })
            .collect();
        let config = EarlyStopSettings::default();
        Snapshot::replay(hostile, EarlyStopMetric::Icr, config, &entries)
    }

    /// After a resume the report still shows the early stop of the segment it ended, and after
    /// a second resume both segments' (issue #45: "no early stop" although segment 2 fired).
    #[test]
    fn the_note_shows_every_segments_early_stop() {
        let evaluation = |step: i64, icr: f64| {
            let checkpoint = format!("/runs/x/ckpt_{step}.pt");
            Entry::Evaluation {
                key: crate::store::history::CheckpointKey {
                    path: checkpoint.clone(),
                    size: 1,
                    mtime_ns: step,
                },
                at: "2026-01-01T00:00:00Z".into(),
                record: Box::new(record(step, icr, &checkpoint)),
            }
        };
        let resume = |step: i64| Entry::Resume {
            at: "2026-01-01T01:00:00Z".into(),
            step,
            checkpoint: format!("/runs/x/ckpt_{step}.pt"),
            restored: None,
            set_aside: Vec::new(),
        };
        // Window 1, patience 1, no rise needed: a curve fires at its first rise.
        let config = EarlyStopSettings {
            window: 1,
            warmup: 1,
            patience: 1,
            min_rise: 0.0,
            noise_multiple: 0.0,
            ..EarlyStopSettings::default()
        };
        let mut entries = vec![
            evaluation(100, 0.9),
            evaluation(200, 0.8),
            evaluation(300, 0.85),
            resume(200),
            evaluation(300, 0.7),
            evaluation(400, 0.75),
        ];
        let note = |entries: &[Entry]| {
            let s = Snapshot::replay("r", EarlyStopMetric::Icr, config.clone(), entries);
            plot::early_stop_note(&s)
        };
        let after_one = note(&entries);
        assert!(
            after_one.starts_with("EARLY STOP fired at step 400: best checkpoint step 300"),
            "{after_one}"
        );
        assert!(
            after_one.contains("segment 1: early stop fired at step 300 (best step 200)"),
            "{after_one}"
        );
        entries.push(resume(300));
        let after_two = note(&entries);
        assert!(!after_two.contains("EARLY STOP"), "{after_two}");
        assert!(
            after_two.contains("segment 1: early stop fired at step 300 (best step 200)")
                && after_two.contains("segment 2: early stop fired at step 400 (best step 300)"),
            "{after_two}"
        );
    }

    /// A sweep's run pages are named after the output, the run's name appended.
    #[test]
    fn a_runs_file_is_the_output_with_its_name_appended() {
        assert_eq!(
            run_file(Path::new("out/report.html"), "lr-1e-4"),
            Path::new("out/report-lr-1e-4.html")
        );
        assert_eq!(
            run_file(Path::new("r.v1.png"), "a"),
            Path::new("r.v1-a.png")
        );
    }

    const HOSTILE: &str = "</svg><script>alert('x')</script>&\"ckpt\u{1}\u{fffe}\u{ffff}\".pt";

    fn svg_of(s: &Snapshot) -> String {
        String::from_utf8(render(s, Format::Svg).unwrap()).unwrap()
    }

    fn polyline_vertices(doc: &roxmltree::Document, series: &str) -> usize {
        let node = doc
            .descendants()
            .find(|n| n.has_tag_name("polyline") && n.attribute("data-series") == Some(series))
            .unwrap_or_else(|| panic!("no polyline {series}"));
        let n = node.attribute("points").unwrap().split_whitespace().count();
        assert_eq!(node.attribute("data-points"), Some(n.to_string().as_str()));
        n
    }

    #[test]
    fn one_vertex_and_one_dot_per_evaluation_and_the_markers_at_their_steps() {
        let s = u_curve("/runs/x/ckpt_300.pt");
        let svg = svg_of(&s);
        let doc = roxmltree::Document::parse(&svg).expect("the SVG is well-formed XML");
        assert_eq!(polyline_vertices(&doc, "icr"), 12);
        assert_eq!(polyline_vertices(&doc, "smoothed"), 12);
        assert_eq!(polyline_vertices(&doc, "icr_invariant_trace"), 12);
        assert_eq!(polyline_vertices(&doc, "generalization_gap"), 12);
        let dots = doc
            .descendants()
            .find(|n| n.attribute("data-series") == Some("icr-points"))
            .unwrap()
            .children()
            .filter(|c| c.has_tag_name("circle"))
            .count();
        assert_eq!(dots, 12);
        // No PFD or memorization computed: those plots are left out.
        assert!(!svg.contains("data-plot=\"pfd\""));
        assert!(!svg.contains("data-plot=\"memorization\""));
        // The best is the minimum of the median-smoothed curve, named after step 300; the stop
        // fired after two smoothed values above best · 1.005.
        let best = s.best.as_ref().unwrap();
        assert_eq!((best.step, best.value), (300, 0.85));
        let (fired_best, fired_at) = s.fired.clone().unwrap();
        assert_eq!((fired_best.step, fired_at), (300, 500));
        let marker = |name: &str| {
            doc.descendants()
                .find(|n| n.attribute("data-marker") == Some(name))
                .unwrap_or_else(|| panic!("no marker {name}"))
                .attribute("data-step")
                .unwrap()
                .parse::<i64>()
                .unwrap()
        };
        assert_eq!(marker("best"), 300);
        assert_eq!(marker("best-point"), 300);
        assert_eq!(marker("early-stop"), fired_at);
        // The ring sits on the raw point of step 300 (the value the median picked).
        let ring = doc
            .descendants()
            .find(|n| n.attribute("data-marker") == Some("best-point"))
            .unwrap();
        let raw = doc
            .descendants()
            .find(|n| n.has_tag_name("polyline") && n.attribute("data-series") == Some("icr"))
            .unwrap();
        let vertex = raw
            .attribute("points")
            .unwrap()
            .split_whitespace()
            .nth(5)
            .unwrap();
        assert_eq!(
            format!(
                "{},{}",
                ring.attribute("cx").unwrap(),
                ring.attribute("cy").unwrap()
            ),
            vertex
        );
        // Axis labels are there.
        assert!(svg.contains(">step</text>"));
        assert!(svg.contains("data-axis=\"y\">ICR</text>"));
    }

    #[test]
    fn a_hostile_checkpoint_name_and_run_name_are_escaped() {
        let s = u_curve(HOSTILE);
        let html = String::from_utf8(
            render(
                &s,
                Format::Html {
                    refresh_secs: Some(5),
                },
            )
            .unwrap(),
        )
        .unwrap();
        assert!(!html.contains("<script>"), "{html}");
        assert!(!html.contains("</svg><script"), "{html}");
        assert!(html.contains(
            "&lt;/svg&gt;&lt;script&gt;alert(&#39;x&#39;)&lt;/script&gt;&amp;&quot;ckpt"
        ));
        assert!(html.contains(r#"<meta http-equiv="refresh" content="5">"#));
        assert!(html.contains(r#"name="viewport""#));
        // The best checkpoint is the hostile one (step 300), shown escaped.
        assert!(html.contains(r#"<span class="path" id="best-checkpoint">&lt;/svg&gt;"#));
        // Each plot is one SVG: all 12 points are still in the ICR plot.
        assert_eq!(html.matches("<svg class=\"plot\"").count(), 3);
        let svg = svg_of(&s);
        let doc = roxmltree::Document::parse(&svg).expect("still well-formed XML");
        assert_eq!(polyline_vertices(&doc, "icr"), 12);
        let titles: Vec<&str> = doc
            .descendants()
            .filter(|n| n.has_tag_name("title"))
            .filter_map(|n| n.text())
            .collect();
        assert!(
            titles
                .iter()
                .any(|t| t.contains("</svg><script>alert('x')</script>&\"ckpt")),
            "{titles:?}"
        );
        assert!(!svg.contains(['\u{1}', '\u{fffe}', '\u{ffff}']));
        // The report file has no refresh.
        let report =
            String::from_utf8(render(&s, Format::Html { refresh_secs: None }).unwrap()).unwrap();
        assert!(!report.contains("http-equiv"));
    }

    /// Every field with a series is drawn, in a plot of [`PLOTS`], and every field with a
    /// report column heads one, from a history of full records.
    #[test]
    fn every_plotted_field_of_the_table_is_drawn() {
        let entries: Vec<Entry> = (1..=3)
            .map(|i| {
                let mut r = crate::record::full_record();
                r.step = 100 * i;
                r.icr = Some(0.8 + 0.01 * i as f64);
                r.generalization_gap = Some(0.01 * i as f64);
                Entry::Evaluation {
                    key: crate::store::history::CheckpointKey {
                        path: format!("/r/{i}.pt"),
                        size: 1,
                        mtime_ns: i,
                    },
                    at: "2026-01-01T00:00:00Z".into(),
                    record: Box::new(r),
                }
            })
            .collect();
        let s = Snapshot::replay(
            "r",
            EarlyStopMetric::Icr,
            EarlyStopSettings::default(),
            &entries,
        );
        let svg = svg_of(&s);
        let doc = roxmltree::Document::parse(&svg).unwrap();
        let mut drawn = 0;
        for f in &FIELDS {
            let Some(series) = f.series else { continue };
            assert!(
                PLOTS.iter().any(|(id, ..)| *id == series.plot),
                "{}: no plot {}",
                f.name,
                series.plot
            );
            let plot = doc
                .descendants()
                .find(|n| n.attribute("data-plot") == Some(series.plot))
                .unwrap_or_else(|| panic!("plot {} not drawn", series.plot));
            assert!(
                plot.descendants()
                    .any(|n| n.has_tag_name("polyline")
                        && n.attribute("data-series") == Some(f.name)),
                "{} not drawn in {}",
                f.name,
                series.plot
            );
            assert_eq!(polyline_vertices(&doc, f.name), 3);
            drawn += 1;
        }
        assert_eq!(drawn, 6);
        for (id, ..) in PLOTS {
            assert!(
                FIELDS
                    .iter()
                    .any(|f| f.series.is_some_and(|s| s.plot == id)),
                "{id}"
            );
        }
        let html =
            String::from_utf8(render(&s, Format::Html { refresh_secs: None }).unwrap()).unwrap();
        assert!(
            html.contains("<th>step</th><th>ICR</th><th>smoothed</th><th>gap</th><th>E_gen</th><th>E_mem</th><th>memorized</th><th>checkpoint</th>"),
            "{html}"
        );
    }

    /// The early-stop plot of ICR values with these standard errors (steps 50, 100, ...).
    fn with_stderr(metric: EarlyStopMetric, icr: &[f64], stderr: &[Option<f64>]) -> Snapshot {
        let entries: Vec<Entry> = icr
            .iter()
            .zip(stderr)
            .enumerate()
            .map(|(i, (&v, &e))| {
                let step = 50 * (i as i64 + 1);
                let mut r = record(step, v, &format!("/r/{step}.pt"));
                r.icr_stderr = e;
                r.pfd_generalization = Some(v);
                Entry::Evaluation {
                    key: crate::store::history::CheckpointKey {
                        path: r.checkpoint.clone(),
                        size: 1,
                        mtime_ns: step,
                    },
                    at: "2026-01-01T00:00:00Z".into(),
                    record: Box::new(r),
                }
            })
            .collect();
        Snapshot::replay("r", metric, EarlyStopSettings::default(), &entries)
    }

    fn vertex(text: &str) -> (f64, f64) {
        let (x, y) = text.split_once(',').unwrap();
        (x.parse().unwrap(), y.parse().unwrap())
    }

    /// The ICR band's outline is at value ± stderr at each point, in the ICR series' own
    /// scale (recovered from its polyline), and a point without a standard error breaks it.
    #[test]
    fn the_icr_band_is_value_plus_minus_stderr() {
        let icr = [0.95, 0.91, 0.87, 0.85, 0.86, 0.90, 0.93];
        let stderr = [
            Some(0.010),
            Some(0.015),
            Some(0.020),
            None,
            Some(0.012),
            Some(0.018),
            Some(0.011),
        ];
        let s = with_stderr(EarlyStopMetric::Icr, &icr, &stderr);
        let svg = svg_of(&s);
        let doc = roxmltree::Document::parse(&svg).unwrap();
        let line: Vec<(f64, f64)> = doc
            .descendants()
            .find(|n| n.has_tag_name("polyline") && n.attribute("data-series") == Some("icr"))
            .unwrap()
            .attribute("points")
            .unwrap()
            .split_whitespace()
            .map(vertex)
            .collect();
        assert_eq!(line.len(), icr.len());
        // The y scale is affine: recover it from the two points farthest apart (0.95, 0.85).
        let slope = (line[0].1 - line[3].1) / (icr[0] - icr[3]);
        let sy = |v: f64| line[3].1 + slope * (v - icr[3]);
        let band = doc
            .descendants()
            .find(|n| n.attribute("data-band") == Some("icr"))
            .expect("a band");
        assert!(band.has_tag_name("path"));
        let plot = band
            .ancestors()
            .find_map(|n| n.attribute("data-plot"))
            .unwrap();
        assert_eq!(plot, "early-stop");
        let opacity: f64 = band.attribute("fill-opacity").unwrap().parse().unwrap();
        assert!(opacity > 0.0 && opacity < 0.5, "{opacity}");
        // Two closed outlines: points 0..3 and 4..7 (point 3 has no standard error).
        let d = band.attribute("d").unwrap();
        let outlines: Vec<Vec<(f64, f64)>> = d
            .split('M')
            .filter(|p| !p.trim().is_empty())
            .map(|p| {
                let p = p.trim().strip_suffix('Z').expect("closed").trim();
                p.split(" L").map(vertex).collect()
            })
            .collect();
        assert_eq!(outlines.len(), 2, "{d}");
        for (outline, run) in outlines.iter().zip([0..3, 4..7]) {
            let n = run.len();
            assert_eq!(outline.len(), 2 * n, "{d}");
            for (k, i) in run.enumerate() {
                let e = stderr[i].unwrap();
                let (upper, lower) = (outline[k], outline[2 * n - 1 - k]);
                for (vertex, want) in [(upper, icr[i] + e), (lower, icr[i] - e)] {
                    assert_eq!(vertex.0, line[i].0, "step of point {i}");
                    // 0.1 px rounding of the SVG's coordinates; one standard error here is
                    // over 10 px.
                    assert!(
                        (vertex.1 - sy(want)).abs() < 0.25,
                        "point {i}: {} against {} ({d})",
                        vertex.1,
                        sy(want)
                    );
                }
            }
        }
        // The PNG is drawn from the same SVG.
        assert!(!render(&s, Format::Png).unwrap().is_empty());
    }

    #[test]
    fn no_band_without_a_standard_error() {
        let icr = [0.95, 0.91, 0.87];
        let s = with_stderr(EarlyStopMetric::Icr, &icr, &[None; 3]);
        assert!(!svg_of(&s).contains("data-band"));
        assert!(!svg_of(&u_curve("/r/x.pt")).contains("data-band"));
        // A lone point with one between two without is no band either.
        let s = with_stderr(EarlyStopMetric::Icr, &icr, &[None, Some(0.01), None]);
        assert!(!svg_of(&s).contains("data-band"));
        // E_gen has no standard error: ICR's is not drawn around it.
        let s = with_stderr(EarlyStopMetric::PfdGeneralization, &icr, &[Some(0.01); 3]);
        assert!(!svg_of(&s).contains("data-band"));
        let html =
            String::from_utf8(render(&s, Format::Html { refresh_secs: None }).unwrap()).unwrap();
        assert!(!html.contains("data-band"));
    }

    /// The page names the best checkpoint's kept copy beside it (escaped), says while it is
    /// being made, and says when the original is the only copy (issue #33).
    #[test]
    fn the_page_names_the_kept_copy_of_the_best_checkpoint() {
        let page = |s: &Snapshot| {
            String::from_utf8(render(s, Format::Html { refresh_secs: None }).unwrap()).unwrap()
        };
        let mut s = u_curve("/runs/x/ckpt_300.pt");
        let best = "/runs/x/ckpt_300.pt".to_string();
        let line = |tail: &str| {
            format!(r#"id="best-checkpoint">/runs/x/ckpt_300.pt</span> (step 300), {tail}</p>"#)
        };
        // Without keep_best.
        let only = line(
            r#"<span id="best-checkpoint-kept">not kept: the original is the only copy</span>"#,
        );
        assert!(page(&s).contains(&only), "{}", page(&s));
        s.kept = Some((best.clone(), KeptCopy::NotKept));
        assert!(page(&s).contains(&only));
        s.kept = Some((best.clone(), KeptCopy::Keeping));
        assert!(page(&s).contains(&line(
            r#"<span id="best-checkpoint-kept">a copy is being kept (early_stop.keep_best)</span>"#
        )));
        s.kept = Some((
            best.clone(),
            KeptCopy::At("/runs/x/.diffmon/best/ckpt_<300>.pt".into()),
        ));
        assert!(page(&s).contains(&line(r#"kept as <span class="path" id="best-checkpoint-kept">/runs/x/.diffmon/best/ckpt_&lt;300&gt;.pt</span>"#)), "{}", page(&s));
        // What the keeper said of another checkpoint (an older best) is not this one's.
        s.kept = Some((
            "/runs/x/ckpt_999.pt".into(),
            KeptCopy::At("/k/ckpt_999.pt".into()),
        ));
        assert!(!page(&s).contains("/k/ckpt_999.pt"));
        assert!(page(&s).contains("a copy is being kept"));
    }

    #[test]
    fn an_empty_history_still_renders() {
        let s = Snapshot::new("empty", EarlyStopMetric::Icr);
        let svg = svg_of(&s);
        let doc = roxmltree::Document::parse(&svg).unwrap();
        assert!(!doc.descendants().any(|n| n.has_tag_name("polyline")));
        assert!(svg.contains("no evaluations yet"));
        assert!(svg.contains(">step</text>"));
    }

    #[test]
    fn formats_by_extension() {
        assert_eq!(
            Format::of_path(Path::new("a/r.HTML")).unwrap(),
            Format::Html { refresh_secs: None }
        );
        assert_eq!(Format::of_path(Path::new("r.svg")).unwrap(), Format::Svg);
        assert_eq!(Format::of_path(Path::new("r.png")).unwrap(), Format::Png);
        let e = Format::of_path(Path::new("r.pdf")).unwrap_err();
        assert!(e.is_usage());
        assert!(e.to_string().contains("`.pdf`"), "{e}");
        assert!(e.to_string().contains("r.pdf"), "{e}");
    }
}
