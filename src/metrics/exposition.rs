//! The `/metrics` exposition: the two formats ([`Format`], negotiated from `Accept`), the
//! conversion of OpenMetrics text to the text format 0.0.4, and the encoding of one run's
//! metrics, of several runs' and of a sweep's; each with the process' own metrics once.

use super::process::encode_process;
use super::registry::Metrics;
use super::sweep::SweepMetrics;

/// The format of a `/metrics` answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// OpenMetrics 1.0.0 text.
    OpenMetrics,
    /// Prometheus text format 0.0.4.
    Text,
}

impl Format {
    pub fn content_type(self) -> &'static str {
        match self {
            Format::OpenMetrics => "application/openmetrics-text; version=1.0.0; charset=utf-8",
            Format::Text => "text/plain; version=0.0.4; charset=utf-8",
        }
    }

    /// The format an `Accept` header asks for: OpenMetrics only when it names
    /// `application/openmetrics-text` (version 1.0.0 or 0.0.1, or none) with a quality at least
    /// that of `text/plain` (or `text/*`, `*/*`); the text format otherwise, absent header
    /// included. Prometheus sends
    /// `application/openmetrics-text;version=1.0.0,...,text/plain;version=0.0.4;q=0.5,*/*;q=0.1`.
    pub fn negotiate(accept: Option<&str>) -> Format {
        let Some(accept) = accept else {
            return Format::Text;
        };
        let (mut om, mut text) = (0.0f64, 0.0f64);
        for range in accept.split(',') {
            let mut parts = range.split(';').map(str::trim);
            let media = parts.next().unwrap_or("").to_ascii_lowercase();
            let mut q = 1.0;
            let mut version_ok = true;
            for p in parts {
                let Some((k, v)) = p.split_once('=') else {
                    continue;
                };
                let v = v.trim().trim_matches('"');
                match k.trim().to_ascii_lowercase().as_str() {
                    "q" => {
                        q = v
                            .parse::<f64>()
                            .ok()
                            .filter(|q| q.is_finite())
                            .unwrap_or(0.0)
                    }
                    "version" => version_ok = matches!(v, "1.0.0" | "0.0.1"),
                    _ => {}
                }
            }
            match media.as_str() {
                "application/openmetrics-text" if version_ok => om = om.max(q),
                "text/plain" | "text/*" | "*/*" => text = text.max(q),
                _ => {}
            }
        }
        if om > 0.0 && om >= text {
            Format::OpenMetrics
        } else {
            Format::Text
        }
    }
}

/// Converts OpenMetrics text, as `prometheus-client` writes it, into the Prometheus text format
/// 0.0.4: no `# EOF` and no `# UNIT`; a counter's `HELP` and `TYPE` name its `_total` series;
/// `info` families become gauges named `*_info`, `unknown` ones `untyped`; no `_created` series;
/// exemplars dropped. `prometheus-client` writes HELP texts as they are, which must not contain
/// a backslash or a newline (ours do not: a test checks).
pub fn openmetrics_to_text(om: &str) -> String {
    let mut out = String::with_capacity(om.len());
    let mut help: Option<(&str, &str)> = None; // (family, text)
    let mut family = String::new();
    let mut kind = "";
    for line in om.lines() {
        if let Some(rest) = line.strip_prefix("# HELP ") {
            let (name, text) = rest.split_once(' ').unwrap_or((rest, ""));
            help = Some((name, text));
            continue;
        }
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, t) = rest.split_once(' ').unwrap_or((rest, "unknown"));
            kind = t.trim();
            let (series, text_type) = match kind {
                "counter" => (format!("{name}_total"), "counter"),
                "gauge" => (name.to_string(), "gauge"),
                "histogram" => (name.to_string(), "histogram"),
                "summary" => (name.to_string(), "summary"),
                "info" => (format!("{name}_info"), "gauge"),
                "stateset" => (name.to_string(), "gauge"),
                _ => (name.to_string(), "untyped"),
            };
            family = name.to_string();
            if let Some((_, text)) = help.take().filter(|(h, _)| *h == name) {
                out.push_str(&format!("# HELP {series} {text}\n"));
            }
            out.push_str(&format!("# TYPE {series} {text_type}\n"));
            continue;
        }
        if line.starts_with('#') || line.trim().is_empty() {
            continue; // # UNIT, # EOF
        }
        let sample_name = line.split(['{', ' ']).next().unwrap_or("");
        if sample_name == format!("{family}_created")
            && matches!(kind, "counter" | "histogram" | "summary")
        {
            continue;
        }
        // An exemplar follows ` # ` after the value; label values (quoted) may hold `#` and `}`.
        let body_start = labels_end(line);
        let sample = match line[body_start..].find(" # ") {
            Some(i) => &line[..body_start + i],
            None => line,
        };
        out.push_str(sample);
        out.push('\n');
    }
    out
}

/// The byte index just after a sample line's label set (after its name if it has none).
fn labels_end(line: &str) -> usize {
    let Some(open) = line.find(['{', ' ']) else {
        return line.len();
    };
    if line.as_bytes()[open] != b'{' {
        return open;
    }
    let (mut quoted, mut escaped) = (false, false);
    for (i, c) in line[open..].char_indices() {
        match c {
            _ if escaped => escaped = false,
            '\\' if quoted => escaped = true,
            '"' => quoted = !quoted,
            '}' if !quoted => return open + i + 1,
            _ => {}
        }
    }
    line.len()
}

impl Metrics {
    /// The OpenMetrics text exposition of a daemon of this one run: its families, then the
    /// process' (`process_*`, without a `run` label).
    pub fn encode(&self) -> String {
        let own = self.encode_own();
        format!(
            "{}{}# EOF\n",
            own.strip_suffix("# EOF\n").unwrap_or(&own),
            encode_process()
        )
    }

    /// The run's own families (no process metrics), in OpenMetrics text.
    fn encode_own(&self) -> String {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry)
            .expect("writing to a String");
        out
    }

    /// The exposition in the given format.
    pub fn encode_as(&self, format: Format) -> String {
        match format {
            Format::OpenMetrics => self.encode(),
            Format::Text => openmetrics_to_text(&self.encode()),
        }
    }

    /// The OpenMetrics exposition of several runs' metrics (a sweep) as one: each family once,
    /// with every run's samples (each under its own `run` label), in the first run's order; then
    /// the process' metrics, once.
    pub fn encode_runs(runs: &[std::sync::Arc<Metrics>]) -> String {
        // (family name, its `# HELP`/`# TYPE`/`# UNIT` lines, its samples)
        let mut families: Vec<(String, Vec<String>, Vec<String>)> = Vec::new();
        for m in runs {
            let text = m.encode_own();
            let mut current: Option<usize> = None;
            for line in text.lines() {
                if line == "# EOF" {
                    continue;
                }
                let meta = ["# HELP ", "# TYPE ", "# UNIT "]
                    .iter()
                    .find_map(|p| line.strip_prefix(p));
                if let Some(rest) = meta {
                    let name = rest.split(' ').next().unwrap_or_default();
                    let at = match families.iter().position(|f| f.0 == name) {
                        Some(at) => at,
                        None => {
                            families.push((name.to_string(), Vec::new(), Vec::new()));
                            families.len() - 1
                        }
                    };
                    let header = &mut families[at].1;
                    if !header.iter().any(|h| h == line) {
                        header.push(line.to_string());
                    }
                    current = Some(at);
                } else if let Some(at) = current {
                    families[at].2.push(line.to_string());
                }
            }
        }
        let mut out = String::new();
        for (_, header, samples) in &families {
            for line in header.iter().chain(samples) {
                out.push_str(line);
                out.push('\n');
            }
        }
        out.push_str(&encode_process());
        out.push_str("# EOF\n");
        out
    }

    /// [`Metrics::encode_runs`] in the given format.
    pub fn encode_runs_as(runs: &[std::sync::Arc<Metrics>], format: Format) -> String {
        match format {
            Format::OpenMetrics => Metrics::encode_runs(runs),
            Format::Text => openmetrics_to_text(&Metrics::encode_runs(runs)),
        }
    }

    /// A sweep's exposition: its runs' ([`Metrics::encode_runs`]), then its own
    /// ([`SweepMetrics`]), in the given format.
    pub fn encode_sweep_as(
        runs: &[std::sync::Arc<Metrics>],
        sweep: &SweepMetrics,
        format: Format,
    ) -> String {
        let runs = Metrics::encode_runs(runs);
        let text = format!(
            "{}{}# EOF\n",
            runs.strip_suffix("# EOF\n").unwrap_or(&runs),
            sweep.encode()
        );
        match format {
            Format::OpenMetrics => text,
            Format::Text => openmetrics_to_text(&text),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::names::*;
    use crate::record::{Evaluation, FailureReason};

    /// A sweep's exposition: each family once (its metadata once), with every run's samples,
    /// A sweep's exposition: its runs' families, then its own gauge without a `run` label, one
    /// `# EOF`, in both formats.
    #[test]
    fn a_sweep_exposition_ends_with_its_own_gauge() {
        let runs = vec![std::sync::Arc::new(Metrics::new("a"))];
        let sweep = SweepMetrics::default();
        sweep.set_runs_ignored(44);
        let open = Metrics::encode_sweep_as(&runs, &sweep, Format::OpenMetrics);
        assert!(open.contains("diffmon_build_info{run=\"a\""), "{open}");
        assert!(
            open.ends_with("# TYPE diffmon_runs_ignored gauge\ndiffmon_runs_ignored 44\n# EOF\n"),
            "{open}"
        );
        assert_eq!(open.matches("# EOF").count(), 1, "{open}");
        let text = Metrics::encode_sweep_as(&runs, &sweep, Format::Text);
        assert!(text.contains("\ndiffmon_runs_ignored 44\n"), "{text}");
        assert!(!text.contains("# EOF"), "{text}");
    }

    /// each under its own label; one `# EOF`; a run's lines as its own exposition has them.
    #[test]
    fn several_runs_encode_as_one_exposition() {
        let runs: Vec<std::sync::Arc<Metrics>> = ["a", "b"]
            .into_iter()
            .map(|r| std::sync::Arc::new(Metrics::new(r)))
            .collect();
        runs[1].record(&Evaluation {
            step: 7,
            icr: Some(0.25),
            ..Evaluation::default()
        });
        let all = Metrics::encode_runs(&runs);
        assert!(
            all.ends_with("# EOF\n") && all.matches("# EOF").count() == 1,
            "{all}"
        );
        let meta: Vec<&str> = all.lines().filter(|l| l.starts_with("# ")).collect();
        let mut unique = meta.clone();
        unique.sort();
        unique.dedup();
        assert_eq!(meta.len(), unique.len(), "a family's metadata twice");
        // The process' own gauges (memory, CPU time) are read at each encoding: compared by name.
        let name = |l: &str| l.split(' ').next().unwrap_or("").to_string();
        for m in &runs {
            for line in m.encode().lines() {
                let found = if line.starts_with("process_") {
                    all.lines().any(|l| name(l) == name(line))
                } else {
                    all.lines().any(|l| l == line)
                };
                assert!(found, "{line} missing");
            }
        }
        assert!(all.contains("diffmon_icr{run=\"b\"} 0.25"), "{all}");
        // Issue 34: the process' metrics once, without a `run` label (not once per run).
        for p in crate::metrics::names::PROCESS_METRICS {
            let samples = all.lines().filter(|l| l.starts_with(p)).count();
            assert_eq!(samples, 1, "{p} in\n{all}");
        }
        assert!(!all.contains("process_resident_memory_bytes{"), "{all}");
        // Every sample line follows its family's metadata: no family is split in two.
        let mut seen = Vec::new();
        let mut family = "";
        for l in all.lines() {
            if let Some(rest) = l.strip_prefix("# TYPE ") {
                family = rest.split(' ').next().unwrap();
                assert!(!seen.contains(&family), "{family} twice");
                seen.push(family);
            } else if !l.starts_with('#') {
                assert!(l.starts_with(family), "{l} outside {family}");
            }
        }
        let text = Metrics::encode_runs_as(&runs, Format::Text);
        assert!(!text.contains("# EOF"));
        assert!(text.contains("run=\"a\"") && text.contains("run=\"b\""));
    }

    /// Issue 15: the text format 0.0.4 (no `# EOF`, no `# UNIT`, counters' HELP and TYPE name
    /// the `_total` series, no `_created`), with a HELP line for every TYPE.
    #[test]
    fn text_format_is_prometheus_0_0_4() {
        let m = Metrics::new("exp1");
        m.failure(FailureReason::Vanished);
        m.observe_stage(STAGE_LOAD, 0.002);
        let om = m.encode();
        assert!(om.ends_with("# EOF\n"), "{om}");
        let text = m.encode_as(Format::Text);
        assert!(
            !text.contains("# EOF") && !text.contains("# UNIT"),
            "{text}"
        );
        assert!(!text.contains("_created"), "{text}");
        for c in [
            CHECKPOINTS_EVALUATED,
            CHECKPOINT_FAILURES,
            WEBHOOK_DELIVERIES,
        ] {
            assert!(
                text.contains(&format!("# TYPE {c}_total counter\n")),
                "{c}: {text}"
            );
            assert!(text.contains(&format!("# HELP {c}_total ")), "{c}: {text}");
        }
        assert!(text.contains("# TYPE process_cpu_seconds_total counter\n"));
        assert!(text.contains(&format!("# TYPE {EVALUATION_DURATION} histogram\n")));
        // Every TYPE has its HELP just before, naming the same series; every sample belongs to
        // the family of the TYPE before it.
        let lines: Vec<&str> = text.lines().collect();
        let mut family = "";
        for (i, l) in lines.iter().enumerate() {
            if let Some(rest) = l.strip_prefix("# TYPE ") {
                family = rest.split(' ').next().unwrap();
                let help = lines[i - 1];
                assert!(
                    help.starts_with(&format!("# HELP {family} ")),
                    "{help} / {l}"
                );
            } else if !l.starts_with('#') {
                let name = l.split(['{', ' ']).next().unwrap();
                let ok = name == family
                    || ["_bucket", "_sum", "_count"]
                        .iter()
                        .any(|s| name == format!("{family}{s}"));
                assert!(ok, "{name} under TYPE {family}");
            }
        }
        // Samples are the same in both formats, but for OpenMetrics' extra lines.
        let samples = |t: &str| -> Vec<String> {
            t.lines()
                .filter(|l| !l.starts_with('#'))
                .map(str::to_string)
                .collect()
        };
        let (a, b) = (samples(&om), samples(&text));
        assert_eq!(a.len(), b.len());
        assert!(
            b.contains(
                &"diffmon_checkpoint_failures_total{run=\"exp1\",reason=\"vanished\"} 1"
                    .to_string()
            ),
            "{text}"
        );
    }

    #[test]
    fn conversion_handles_what_prometheus_client_may_write() {
        let om = "# HELP a_seconds A.\n# TYPE a_seconds counter\n# UNIT a_seconds seconds\n\
                  a_seconds_total{x=\"}#\"} 3 # {id=\"e\"} 1.0\na_seconds_created 1.7e9\n\
                  # HELP i Build.\n# TYPE i info\ni_info{v=\"1\"} 1\n\
                  # HELP u U.\n# TYPE u unknown\nu 2\n# EOF\n";
        assert_eq!(
            openmetrics_to_text(om),
            "# HELP a_seconds_total A.\n# TYPE a_seconds_total counter\n\
             a_seconds_total{x=\"}#\"} 3\n\
             # HELP i_info Build.\n# TYPE i_info gauge\ni_info{v=\"1\"} 1\n\
             # HELP u U.\n# TYPE u untyped\nu 2\n"
        );
    }

    /// Issue 15: negotiated like Prometheus' client libraries.
    #[test]
    fn accept_header_negotiation() {
        let om = Format::OpenMetrics;
        let text = Format::Text;
        for (accept, want) in [
            (None, text),
            (Some(""), text),
            (Some("*/*"), text),
            (Some("text/plain;version=0.0.4"), text),
            (Some("text/plain; version=0.0.4; charset=utf-8"), text),
            (Some("application/openmetrics-text"), om),
            (
                Some("application/openmetrics-text; version=1.0.0; charset=utf-8"),
                om,
            ),
            // What Prometheus 2.42 sends.
            (
                Some(
                    "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1",
                ),
                om,
            ),
            // Prometheus with `scrape_classic...`/text preferred.
            (
                Some("text/plain;version=0.0.4;q=1,application/openmetrics-text;q=0.5"),
                text,
            ),
            (Some("application/openmetrics-text;q=0"), text),
            (Some("application/openmetrics-text;version=9.9.9"), text),
            (Some("application/json"), text),
        ] {
            assert_eq!(Format::negotiate(accept), want, "{accept:?}");
        }
        assert_eq!(
            Format::Text.content_type(),
            "text/plain; version=0.0.4; charset=utf-8"
        );
    }
}
