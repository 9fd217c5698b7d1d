//! The live page (`GET /`) and `diffmon report` over a real history: a real `diffmon watch` run
//! over the toy run's checkpoints arranged into a U-curve (the early stop fires), rendered as
//! HTML, SVG and PNG, and the pages loaded in a real headless Chromium (Debian package, installed
//! by `make setup`). Screenshots and reports are kept under `target/test-artifacts/`.

use crate::common::{diffmon, root, stderr};
use crate::daemon::{Daemon, empty_run};
use crate::early_stop::{checkpoints_by_icr, detector_config, place, write_base_config};
use resvg::tiny_skia::Pixmap;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// The colour of the early-stop metric's raw points (ICR), as `src/report/mod.rs` gives it (`plots`) and `svg.rs` draws it.
const ICR_COLOR: [u8; 3] = [0x1f, 0x77, 0xb4];

/// A run a real daemon has finished: five checkpoints with ICR high, low, low, high, high; the
/// early stop fired at step 5 with the best at step 2.
struct Finished {
    dir: tempfile::TempDir,
    /// The daemon's extra config (checkpoint settings, the detector).
    extra: String,
    /// The toy checkpoints of higher and lower ICR.
    hi: PathBuf,
}

fn finished_run() -> &'static Finished {
    static RUN: OnceLock<Finished> = OnceLock::new();
    RUN.get_or_init(|| {
        let run = empty_run();
        let dir = run.path();
        write_base_config(dir, "");
        let (hi, lo, rise) = checkpoints_by_icr(dir);
        let extra = format!(
            "checkpoints: {{pattern: \"ckpt_*.pt\", settle_secs: 0.2, poll_secs: 0.5}}\n{}",
            detector_config(rise)
        );
        let mut d = Daemon::start(dir, &extra);
        for (step, src) in [(1, &hi), (2, &lo), (3, &lo), (4, &hi), (5, &hi)] {
            place(dir, src, step);
        }
        d.wait_for(
            Duration::from_secs(240),
            "five evaluations and the early stop",
            |d| {
                d.evaluated() >= 5.0
                    && d.metric("diffmon_early_stop_triggered{run=\"test\",metric=\"icr\"}")
                        == Some(1.0)
            },
        );
        d.terminate();
        Finished {
            dir: run,
            extra,
            hi,
        }
    })
}

pub fn artifacts() -> PathBuf {
    let dir = root().join("target/test-artifacts");
    fs::create_dir_all(&dir).unwrap();
    dir
}

// --- reading the plots back ---------------------------------------------------------------------

/// The attributes of every start tag `<name ...>` in HTML or SVG text.
fn tags(text: &str, name: &str) -> Vec<Vec<(String, String)>> {
    let tag = regex::Regex::new(&format!(r"<{name}\b([^>]*)>")).unwrap();
    let attr = regex::Regex::new(r#"([\w:-]+)="([^"]*)""#).unwrap();
    tag.captures_iter(text)
        .map(|c| {
            attr.captures_iter(&c[1])
                .map(|a| (a[1].to_string(), a[2].to_string()))
                .collect()
        })
        .collect()
}

fn attr<'a>(tag: &'a [(String, String)], name: &str) -> Option<&'a str> {
    tag.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str())
}

/// The vertex count of the polyline of `series` (there must be exactly one).
fn polyline_points(text: &str, series: &str) -> usize {
    let lines: Vec<_> = tags(text, "polyline")
        .into_iter()
        .filter(|t| attr(t, "data-series") == Some(series))
        .collect();
    assert_eq!(lines.len(), 1, "one polyline of {series} expected");
    attr(&lines[0], "points")
        .unwrap()
        .split_whitespace()
        .count()
}

/// The dots of `series` (the circles of its `<g data-series="SERIES-points">`).
fn dots(text: &str, series: &str) -> usize {
    let start = text
        .find(&format!(r#"<g data-series="{series}-points">"#))
        .unwrap_or_else(|| panic!("no dots of {series}"));
    let rest = &text[start..];
    rest[..rest.find("</g>").unwrap()]
        .matches("<circle")
        .count()
}

/// The step of the element marked `data-marker="NAME"`.
fn marker_step(text: &str, name: &str) -> Option<i64> {
    ["g", "circle"]
        .iter()
        .flat_map(|t| tags(text, t))
        .find(|t| attr(t, "data-marker") == Some(name))
        .and_then(|t| attr(&t, "data-step").map(|s| s.parse().unwrap()))
}

/// Asserts an image is not blank and shows the ICR points; returns its size.
fn assert_plot_image(path: &Path) -> (u32, u32) {
    let bytes = fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let image =
        Pixmap::decode_png(&bytes).unwrap_or_else(|e| panic!("{}: not a PNG: {e}", path.display()));
    let lum: Vec<f64> = image
        .pixels()
        .iter()
        .map(|p| {
            let c = p.demultiply();
            0.299 * c.red() as f64 + 0.587 * c.green() as f64 + 0.114 * c.blue() as f64
        })
        .collect();
    let n = lum.len() as f64;
    let mean = lum.iter().sum::<f64>() / n;
    let std = (lum.iter().map(|l| (l - mean).powi(2)).sum::<f64>() / n).sqrt();
    let dark = lum.iter().filter(|&&l| l < 128.0).count();
    let icr = image
        .pixels()
        .iter()
        .filter(|p| {
            let c = p.demultiply();
            let d = [c.red(), c.green(), c.blue()]
                .iter()
                .zip(ICR_COLOR)
                .map(|(&a, b)| (a as i32 - b as i32).pow(2))
                .sum::<i32>();
            d < 60 * 60
        })
        .count();
    assert!(
        std > 5.0 && dark > 200,
        "{}: blank image (luminance std {std:.1}, {dark} dark pixels)",
        path.display()
    );
    assert!(
        icr > 15,
        "{}: no ICR points drawn ({icr} pixels of their colour)",
        path.display()
    );
    (image.width(), image.height())
}

// --- Chromium ------------------------------------------------------------------------------------

fn chromium_binary() -> PathBuf {
    let path = std::env::var_os("PATH").unwrap_or_default();
    for name in ["chromium", "chromium-browser"] {
        for dir in std::env::split_paths(&path) {
            let candidate = dir.join(name);
            if candidate.is_file() {
                return candidate;
            }
        }
    }
    panic!("chromium is not installed: run `make setup` (it installs the Debian package chromium)");
}

/// Runs headless Chromium with a fresh profile on `url`; its output after at most 90 s.
fn chromium(url: &str, args: &[&str]) -> Output {
    let profile = tempfile::tempdir().unwrap();
    let out = tempfile::NamedTempFile::new().unwrap();
    let err = tempfile::NamedTempFile::new().unwrap();
    let mut child = Command::new(chromium_binary())
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--disable-dev-shm-usage",
            "--hide-scrollbars",
        ])
        .arg(format!("--user-data-dir={}", profile.path().display()))
        .args(args)
        .arg(url)
        .stdin(Stdio::null())
        .stdout(out.reopen().unwrap())
        .stderr(err.reopen().unwrap())
        .spawn()
        .expect("start chromium");
    let start = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if start.elapsed() > Duration::from_secs(90) {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "chromium {args:?} {url} did not finish in 90 s:\n{}",
                fs::read_to_string(err.path()).unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let output = Output {
        status,
        stdout: fs::read(out.path()).unwrap(),
        stderr: fs::read(err.path()).unwrap(),
    };
    assert!(
        output.status.success(),
        "chromium {args:?} {url} failed:\n{}",
        stderr(&output)
    );
    output
}

/// The DOM of a page as Chromium renders it.
fn rendered_dom(url: &str) -> String {
    String::from_utf8_lossy(&chromium(url, &["--dump-dom"]).stdout).into_owned()
}

/// A screenshot of a page, kept as a test artifact; asserts it shows the plots.
fn screenshot(url: &str, name: &str, size: (u32, u32)) -> PathBuf {
    let file = artifacts().join(name);
    let _ = fs::remove_file(&file);
    let shot = format!("--screenshot={}", file.display());
    let window = format!("--window-size={},{}", size.0, size.1);
    chromium(url, &[shot.as_str(), window.as_str()]);
    assert_eq!(assert_plot_image(&file), size, "{}", file.display());
    file
}

// --- the tests -----------------------------------------------------------------------------------

#[test]
fn live_page_follows_the_daemon_and_renders_in_chromium() {
    chromium_binary();
    let finished = finished_run();
    // A new run folder holding the finished run's history but not its checkpoints: the daemon
    // rebuilds the page from the history, then adds what it evaluates.
    let run = empty_run();
    let dir = run.path();
    fs::create_dir_all(dir.join(".diffmon")).unwrap();
    fs::copy(
        finished.dir.path().join(".diffmon/history.jsonl"),
        dir.join(".diffmon/history.jsonl"),
    )
    .unwrap();
    let d = Daemon::start(dir, &finished.extra);
    let page = d.get("/").expect("GET / answers 200");
    assert!(page.starts_with("<!DOCTYPE html>"), "{page}");
    assert!(page.contains(r#"<meta http-equiv="refresh""#), "{page}");
    assert!(page.contains(r#"name="viewport""#), "{page}");
    assert_eq!(polyline_points(&page, "icr"), 5);
    assert_eq!(polyline_points(&page, "smoothed"), 5);
    assert_eq!(dots(&page, "icr"), 5);
    assert_eq!(polyline_points(&page, "icr_invariant_trace"), 5);
    assert_eq!(polyline_points(&page, "generalization_gap"), 5);
    assert_eq!(marker_step(&page, "best"), Some(2), "{page}");
    assert_eq!(marker_step(&page, "best-point"), Some(2), "{page}");
    assert_eq!(marker_step(&page, "early-stop"), Some(5), "{page}");
    assert!(page.contains("EARLY STOP fired at step 5"), "{page}");

    // A new evaluation shows up without a restart.
    place(dir, &finished.hi, 6);
    d.wait_for(
        Duration::from_secs(180),
        "the sixth point on the live page",
        |d| {
            d.get("/")
                .is_some_and(|p| polyline_points(&p, "icr") == 6 && dots(&p, "icr") == 6)
        },
    );

    // In a real browser: the SVG elements are there with every point, and the page is drawn.
    let url = format!("http://127.0.0.1:{}/", d.port);
    let dom = rendered_dom(&url);
    assert_eq!(polyline_points(&dom, "icr"), 6, "{dom}");
    assert_eq!(polyline_points(&dom, "smoothed"), 6, "{dom}");
    assert_eq!(dots(&dom, "icr"), 6, "{dom}");
    assert_eq!(marker_step(&dom, "early-stop"), Some(5), "{dom}");
    assert_eq!(dom.matches("<svg class=\"plot\"").count(), 3, "{dom}");
    // A phone-sized window: the plots scale to its width.
    screenshot(&url, "live-page.png", (412, 1400));
}

#[test]
fn report_in_every_format_from_a_real_history() {
    chromium_binary();
    let finished = finished_run();
    let config = finished.dir.path().join("diffmon.yaml");
    let out = tempfile::tempdir().unwrap();
    let report = |name: &str| -> (Output, PathBuf) {
        let file = out.path().join(name);
        let o = diffmon(&[
            "report",
            "--config",
            config.to_str().unwrap(),
            "--out",
            file.to_str().unwrap(),
        ]);
        (o, file)
    };

    // SVG: one document, every evaluation a vertex, the best and the turn marked.
    let (o, svg_file) = report("report.svg");
    assert!(o.status.success(), "{}", stderr(&o));
    let svg = fs::read_to_string(&svg_file).unwrap();
    let doc = roxmltree::Document::parse(&svg).expect("the SVG parses");
    let root = doc.root_element();
    assert!(root.has_tag_name("svg"));
    let size: (u32, u32) = (
        root.attribute("width").unwrap().parse().unwrap(),
        root.attribute("height").unwrap().parse().unwrap(),
    );
    assert_eq!(polyline_points(&svg, "icr"), 5);
    assert_eq!(polyline_points(&svg, "smoothed"), 5);
    assert_eq!(dots(&svg, "icr"), 5);
    assert_eq!(marker_step(&svg, "best"), Some(2));
    assert_eq!(marker_step(&svg, "early-stop"), Some(5));
    let plots = doc
        .descendants()
        .filter(|n| n.attribute("data-plot").is_some())
        .count();
    assert_eq!(plots, 3, "ICR, traces and gap (no PFD on this run)");
    fs::copy(&svg_file, artifacts().join("report.svg")).unwrap();

    // PNG: the same plots rasterized, at the SVG's size.
    let (o, png_file) = report("report.png");
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(assert_plot_image(&png_file), size);
    fs::copy(&png_file, artifacts().join("report.png")).unwrap();

    // HTML: standalone (no refresh), and Chromium renders it.
    let (o, html_file) = report("report.html");
    assert!(o.status.success(), "{}", stderr(&o));
    let html = fs::read_to_string(&html_file).unwrap();
    assert!(!html.contains("http-equiv=\"refresh\""));
    assert_eq!(polyline_points(&html, "icr"), 5);
    // The best checkpoint's kept copy (`early_stop.keep_best`, on by default) beside it.
    let kept = format!(
        r#"kept as <span class="path" id="best-checkpoint-kept">{}</span>"#,
        finished
            .dir
            .path()
            .join(".diffmon/best/ckpt_2.pt")
            .display()
    );
    assert!(html.contains(&kept), "{html}");
    fs::copy(&html_file, artifacts().join("report.html")).unwrap();
    let url = format!("file://{}", html_file.display());
    let dom = rendered_dom(&url);
    assert_eq!(polyline_points(&dom, "icr"), 5, "{dom}");
    assert_eq!(dots(&dom, "icr"), 5, "{dom}");
    assert_eq!(marker_step(&dom, "best-point"), Some(2), "{dom}");
    assert!(dom.contains(&kept), "{dom}");
    screenshot(&url, "report-html.png", (1000, 1200));

    // An unknown extension is a usage error naming it; nothing is written.
    let (o, pdf) = report("report.pdf");
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("report.pdf") && stderr(&o).contains("`.pdf`"),
        "{}",
        stderr(&o)
    );
    assert!(!pdf.exists());
}

#[test]
fn report_without_a_history_says_so() {
    let run = empty_run();
    let dir = run.path();
    write_base_config(dir, "");
    let out = dir.join("report.svg");
    let o = diffmon(&[
        "report",
        "--config",
        dir.join("diffmon.yaml").to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(
        stderr(&o).contains(".diffmon/history.jsonl") && stderr(&o).contains("no history"),
        "{}",
        stderr(&o)
    );
    assert!(!out.exists());
}

/// `report` sends nothing, so it must not need the webhooks' secrets (before, it refused to run
/// unless their variables were set); `check-config` still checks them.
#[test]
fn report_runs_without_the_webhook_secrets_that_check_config_requires() {
    let finished = finished_run();
    let dir = finished.dir.path();
    let text = fs::read_to_string(dir.join("diffmon.yaml")).unwrap();
    assert!(!text.contains("alerts:"), "{text}");
    let var = "DIFFMON_TEST_UNSET_REPORT_SECRET";
    assert!(std::env::var_os(var).is_none());
    let config = dir.join("with-webhook.yaml");
    fs::write(
        &config,
        format!(
            "{text}alerts: {{webhooks: [{{url: 'http://127.0.0.1:1/h', secret_env: {var}}}]}}\n"
        ),
    )
    .unwrap();
    let out = tempfile::tempdir().unwrap();
    let svg = out.path().join("report.svg");
    let o = diffmon(&[
        "report",
        "--config",
        config.to_str().unwrap(),
        "--out",
        svg.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(svg.exists());
    let o = diffmon(&["check-config", config.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains(var), "{}", stderr(&o));
}
