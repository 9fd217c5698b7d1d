//! The index of a sweep's runs, one row per run (last and best step, early stop) linking each
//! run's page: the daemon's live front page (`GET /` of a sweep) and the index `diffmon report`
//! writes beside the runs' pages (docs/design.md §14, §19).

use super::svg::escape;
use std::fmt::Write as _;

/// One run's row of the index.
#[derive(Debug, Clone, Default)]
pub struct IndexRow {
    pub name: String,
    /// The run's page, relative to the index; `None`: it has none (no history yet).
    pub href: Option<String>,
    pub last_step: Option<i64>,
    pub best_step: Option<i64>,
    /// The early stop fired (and was not resolved).
    pub fired: bool,
}

/// The index page of `rows`; with `refresh_secs`, a live page that reloads itself.
pub fn index_page(rows: &[IndexRow], refresh_secs: Option<u32>) -> String {
    let mut o = String::from(
        "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n\
         <meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n",
    );
    if let Some(secs) = refresh_secs {
        let _ = writeln!(o, r#"<meta http-equiv="refresh" content="{secs}">"#);
    }
    let n = rows.len();
    let _ = write!(
        o,
        r#"<title>diffmon: {n} runs</title>
<style>
body {{ font-family: system-ui, "DejaVu Sans", sans-serif; color: #222; margin: 0 auto; max-width: 760px; padding: 8px 12px; }}
h1 {{ font-size: 1.3em; margin: 0.4em 0; }}
.table {{ overflow-x: auto; }}
table {{ border-collapse: collapse; }}
th, td {{ padding: 4px 8px; text-align: right; border-bottom: 1px solid #eee; white-space: nowrap; }}
th:first-child, td:first-child {{ text-align: left; }}
.fired {{ color: #d62728; font-weight: bold; }}
</style>
</head>
<body>
<h1>diffmon: {n} runs</h1>
<div class="table"><table>
<tr><th>run</th><th>last step</th><th>best step</th><th>early stop</th></tr>
"#
    );
    let step = |v: Option<i64>| v.map_or("–".to_string(), |s| s.to_string());
    for r in rows {
        let name = escape(&r.name);
        let run = match &r.href {
            Some(href) => format!("<a href=\"{}\">{name}</a>", escape(href)),
            None => format!("{name} (no history yet)"),
        };
        let fired = if r.fired {
            "<span class=\"fired\">stop</span>"
        } else {
            ""
        };
        let _ = writeln!(
            o,
            "<tr><td>{run}</td><td>{}</td><td>{}</td><td>{fired}</td></tr>",
            step(r.last_step),
            step(r.best_step)
        );
    }
    o.push_str("</table></div>\n</body>\n</html>\n");
    o
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A row per run, each linking its page (escaped), a run without one named as such; the
    /// page fits a phone's screen, and reloads itself only when live.
    #[test]
    fn the_index_links_each_run_and_fits_the_screen() {
        let rows = [
            IndexRow {
                name: "a".into(),
                href: Some("report-a.html".into()),
                last_step: Some(900),
                best_step: Some(600),
                fired: true,
            },
            IndexRow {
                name: "b".into(),
                ..IndexRow::default()
            },
        ];
        let page = index_page(&rows, None);
        assert!(
            page.contains(
                r#"<meta name="viewport" content="width=device-width, initial-scale=1">"#
            )
        );
        assert!(!page.contains("http-equiv=\"refresh\""));
        assert!(page.contains(r#"<a href="report-a.html">a</a></td><td>900</td><td>600</td>"#));
        assert!(page.contains("b (no history yet)"), "{page}");
        assert!(index_page(&rows, Some(10)).contains(r#"content="10""#));
    }
}
