//! HTML: one self-contained page (inline CSS, inline SVG charts, no scripts, no external
//! resources) with the tables and charts of a run or a comparison.

use super::markdown::{probe_rows, PROBE_COLUMNS};
use super::model::ProbeReport;
use super::svg::{esc, run_svg};
use super::table::{is_numeric_column, notes, summary_row, SUMMARY_COLUMNS};
use super::{device_line, run_label};

/// The page's style sheet.
pub const STYLE: &str = "\
body{font-family:system-ui,-apple-system,'Segoe UI',sans-serif;margin:24px auto;max-width:1120px;color:#222;padding:0 16px}\
h1{font-size:22px;margin:0 0 8px}h2{font-size:18px;margin:28px 0 8px;border-bottom:1px solid #ddd;padding-bottom:4px}\
h3{font-size:15px;margin:18px 0 6px}\
.meta{color:#444;margin:2px 0}\
table{border-collapse:collapse;margin:8px 0;font-size:13px}\
th,td{border:1px solid #d0d0d0;padding:3px 7px;text-align:left;white-space:nowrap}th{white-space:normal;vertical-align:bottom}\
.scroll{overflow-x:auto;max-width:100%}\
th{background:#f3f4f6}td.num{text-align:right;font-variant-numeric:tabular-nums}\
tr.best td{background:#fff6e0}tr.fail td.outcome{color:#c0392b}\
ul.notes{color:#444;font-size:13px}\
.chart{margin:10px 0;border:1px solid #e5e5e5;display:inline-block}\
.chart svg{display:block;max-width:100%;height:auto}\
.warn{color:#8a5a00;background:#fff6e0;padding:4px 8px;border-left:3px solid #e69f00}\
footer{margin-top:32px;color:#888;font-size:12px}";

/// An HTML table; `numeric(i)` right-aligns column i; `row_class(r)` gives a row's class.
pub fn table(
    headers: &[&str],
    rows: &[Vec<String>],
    numeric: impl Fn(usize) -> bool,
    row_class: impl Fn(usize) -> Option<String>,
) -> String {
    let mut s = String::from("<div class=\"scroll\"><table>\n<thead><tr>");
    for h in headers {
        s.push_str(&format!("<th>{}</th>", esc(h)));
    }
    s.push_str("</tr></thead>\n<tbody>\n");
    for (ri, r) in rows.iter().enumerate() {
        match row_class(ri) {
            Some(c) => s.push_str(&format!("<tr class=\"{}\">", esc(&c))),
            None => s.push_str("<tr>"),
        }
        for (i, c) in r.iter().enumerate() {
            let class = match (numeric(i), headers.get(i)) {
                (true, _) => " class=\"num\"",
                (false, Some(&"outcome")) => " class=\"outcome\"",
                _ => "",
            };
            s.push_str(&format!("<td{class}>{}</td>", esc(c)));
        }
        s.push_str("</tr>\n");
    }
    s.push_str("</tbody>\n</table></div>\n");
    s
}

/// Open a page: doctype, head with the inline style, body, and the title heading.
pub fn page_start(title: &str) -> String {
    format!(
        "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n\
         <meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n\
         <title>{t}</title>\n<style>{STYLE}</style>\n</head>\n<body>\n<h1>{t}</h1>\n",
        t = esc(title)
    )
}

/// Close a page.
pub fn page_end(tool: &str) -> String {
    format!(
        "<footer>written by {}</footer>\n</body>\n</html>\n",
        esc(tool)
    )
}

/// The whole probe report as one HTML page.
pub fn render(report: &ProbeReport) -> String {
    let mut s = page_start("oomprobe probe report");
    s.push_str(&format!(
        "<p class=\"meta\"><b>device</b>: {}</p>\n",
        esc(&device_line(report))
    ));
    if report.runs.is_empty() {
        s.push_str("<p>No runs.</p>\n");
    } else {
        s.push_str("<h2>Runs</h2>\n");
        let rows: Vec<Vec<String>> = report.runs.iter().map(summary_row).collect();
        s.push_str(&table(&SUMMARY_COLUMNS, &rows, is_numeric_column, |_| None));
        s.push_str(
            "<p class=\"meta\">error = (predicted max &minus; max fit) / max fit; fill = bytes \
             at max / capacity; best throughput = the fitting value with the most samples (or \
             tokens) per second.</p>\n",
        );
        let notes = notes(report);
        if !notes.is_empty() {
            s.push_str("<ul class=\"notes\">\n");
            for n in notes {
                s.push_str(&format!("<li>{}</li>\n", esc(&n)));
            }
            s.push_str("</ul>\n");
        }
        for run in &report.runs {
            s.push_str(&format!("<h2>{}</h2>\n", esc(&run_label(run))));
            s.push_str(&format!(
                "<div class=\"chart\">\n{}</div>\n",
                run_svg(report, run)
            ));
            let rows = probe_rows(run);
            s.push_str("<h3>Probes</h3>\n");
            s.push_str(&table(
                &PROBE_COLUMNS,
                &rows,
                |i| matches!(i, 0 | 2 | 3 | 4),
                |r| {
                    let row = &rows[r];
                    let mut c = Vec::new();
                    if row.get(6).is_some_and(|m| m.contains("best throughput")) {
                        c.push("best");
                    }
                    if row.get(1).is_some_and(|o| o != "fit") {
                        c.push("fail");
                    }
                    (!c.is_empty()).then(|| c.join(" "))
                },
            ));
        }
    }
    s.push_str(&page_end(&format!(
        "{} {}",
        report.tool.name, report.tool.version
    )));
    s
}
