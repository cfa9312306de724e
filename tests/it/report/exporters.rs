//! Exporters on a synthetic probe report: JSON round-trips, CSV and Markdown are well-formed
//! tables, SVG is well-formed XML with a point per probe, HTML is self-contained.
//!
//! Set `OOMPROBE_PREVIEW_DIR=/some/dir` to also write the rendered files there (to look at
//! them in a browser).

use crate::support::formats::{check_xml, count, split_csv};
use oomprobe::cli::OutputFormat;
use oomprobe::report::sample::sample_report;
use oomprobe::report::{self, best_throughput, Outcome, ProbeRecord, ProbeReport};

const MIB: u64 = 1 << 20;

fn sample() -> ProbeReport {
    sample_report(512 * MIB)
}

fn render(r: &ProbeReport, f: OutputFormat) -> String {
    report::render(r, f).expect("render")
}

#[test]
fn sample_is_realistic() {
    // The exporter tests mean something only if the sample has boundaries and failures.
    let r = sample();
    assert_eq!(r.runs.len(), 6);
    for run in &r.runs {
        assert!(run.max_fit.is_some(), "{:?} has no max fit", run.scenario);
        assert!(run.first_fail > run.max_fit);
        assert!(run.probes.iter().any(|p| p.outcome == Outcome::Fit));
        assert!(run.probes.iter().any(|p| p.outcome != Outcome::Fit));
        // The device needs more than the plan: measured max at or below predicted.
        assert!(run.max_fit <= run.predicted_max, "{:?}", run.scenario);
    }
}

#[test]
fn json_round_trips() {
    let r = sample();
    let text = render(&r, OutputFormat::Json);
    let back: ProbeReport = serde_json::from_str(&text).expect("parse back");
    assert_eq!(back.runs.len(), r.runs.len());
    assert_eq!(back.device, r.device);
    assert_eq!(back.budget_bytes, r.budget_bytes);
    for (a, b) in back.runs.iter().zip(&r.runs) {
        assert_eq!(a.scenario, b.scenario);
        assert_eq!(a.variant, b.variant);
        assert_eq!(a.workload, b.workload);
        assert_eq!(a.max_fit, b.max_fit);
        assert_eq!(a.first_fail, b.first_fail);
        assert_eq!(a.probes.len(), b.probes.len());
        for (p, q) in a.probes.iter().zip(&b.probes) {
            assert_eq!((p.value, p.outcome, p.bytes), (q.value, q.outcome, q.bytes));
            assert!((p.seconds - q.seconds).abs() <= 1e-12 * q.seconds.abs().max(1.0));
        }
    }
    // The contract's field names are there.
    let v: serde_json::Value = serde_json::from_str(&text).expect("json");
    for k in ["schema_version", "tool", "device", "budget_bytes", "runs"] {
        assert!(v.get(k).is_some(), "missing {k}");
    }
    let run = &v["runs"][0];
    for k in [
        "scenario",
        "dimension",
        "workload",
        "max_fit",
        "first_fail",
        "fail_reason",
        "bytes_at_max_fit",
        "predicted_max",
        "probes",
        "seconds",
    ] {
        assert!(run.get(k).is_some(), "run missing {k}");
    }
    for k in ["value", "outcome", "bytes", "seconds", "step_seconds"] {
        assert!(run["probes"][0].get(k).is_some(), "probe missing {k}");
    }
}

#[test]
fn csv_has_header_and_a_row_per_run() {
    let r = sample();
    let text = render(&r, OutputFormat::Csv);
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 1 + r.runs.len());
    let header = split_csv(lines[0]);
    assert_eq!(header, report::csv::RUN_COLUMNS.to_vec());
    let col = |name: &str| header.iter().position(|h| h == name).expect(name);
    for (line, run) in lines[1..].iter().zip(&r.runs) {
        let f = split_csv(line);
        assert_eq!(f.len(), header.len(), "{line}");
        assert_eq!(f[col("scenario")], run.scenario.name());
        assert_eq!(
            f[col("max_fit")],
            run.max_fit.map(|v| v.to_string()).unwrap_or_default()
        );
        assert_eq!(f[col("budget_bytes")], (512 * MIB).to_string());
    }
    // Per-probe CSV: a row per probe.
    let probes = report::csv::probes_csv(&r);
    let n: usize = r.runs.iter().map(|run| run.probes.len()).sum();
    assert_eq!(probes.lines().count(), 1 + n);
    for line in probes.lines() {
        assert_eq!(
            split_csv(line).len(),
            report::csv::PROBE_COLUMNS.len(),
            "{line}"
        );
    }
}

#[test]
fn csv_quotes_fields_with_commas_and_quotes() {
    let mut r = sample();
    r.device.name = "GPU \"X\", rev 2".into();
    let text = render(&r, OutputFormat::Csv);
    let row = split_csv(text.lines().nth(1).expect("row"));
    assert_eq!(row[0], "GPU \"X\", rev 2");
}

/// Every Markdown table: rows start and end with `|`, the second line is the separator, all
/// rows have the header's cell count.
fn check_markdown_tables(md: &str) -> usize {
    let mut tables = 0;
    let lines: Vec<&str> = md.lines().collect();
    let mut i = 0;
    let cells = |l: &str| {
        let inner = &l[1..l.len() - 1];
        // Split on unescaped pipes.
        let mut n = 1;
        let mut prev = ' ';
        for c in inner.chars() {
            if c == '|' && prev != '\\' {
                n += 1;
            }
            prev = c;
        }
        n
    };
    while i < lines.len() {
        if lines[i].starts_with('|') {
            tables += 1;
            let n = cells(lines[i]);
            let sep = lines.get(i + 1).expect("separator");
            assert!(
                sep.split('|')
                    .filter(|s| !s.is_empty())
                    .all(|s| s == "---" || s == "---:"),
                "bad separator: {sep}"
            );
            assert_eq!(cells(sep), n);
            i += 2;
            while i < lines.len() && lines[i].starts_with('|') {
                assert!(lines[i].ends_with('|'), "{}", lines[i]);
                assert_eq!(cells(lines[i]), n, "{}", lines[i]);
                i += 1;
            }
        } else {
            i += 1;
        }
    }
    tables
}

#[test]
fn markdown_tables_are_well_formed() {
    let mut r = sample();
    r.runs[0].variant = Some("a|b".into());
    let md = render(&r, OutputFormat::Markdown);
    // The runs table plus one probe table per run.
    assert_eq!(check_markdown_tables(&md), 1 + r.runs.len());
    assert!(md.contains("a\\|b"));
    assert!(md.contains("best throughput"));
}

#[test]
fn svg_is_well_formed_with_a_point_per_probe() {
    let r = sample();
    let svg = render(&r, OutputFormat::Svg);
    let names = check_xml(&svg).unwrap_or_else(|e| panic!("SVG not well-formed: {e}"));
    assert_eq!(names[0], "svg");
    let probes: usize = r.runs.iter().map(|run| run.probes.len()).sum();
    let fits: usize = r
        .runs
        .iter()
        .flat_map(|run| &run.probes)
        .filter(|p| p.outcome.is_fit())
        .count();
    assert_eq!(count(&svg, "class=\"probe fit\""), fits);
    assert_eq!(count(&svg, "class=\"probe fail\""), probes - fits);
    // One chart per run, each with a predicted line, a capacity line and a boundary.
    assert_eq!(count(&svg, "class=\"chart\""), r.runs.len());
    assert_eq!(count(&svg, "class=\"predicted\""), r.runs.len());
    assert_eq!(count(&svg, "class=\"capacity\""), r.runs.len());
    assert_eq!(count(&svg, "class=\"boundary\""), r.runs.len());
    assert!(svg.contains("capacity 512.00 MiB"));
    preview("report.svg", &svg);
}

#[test]
fn svg_escapes_names_and_handles_an_empty_report() {
    let mut r = sample();
    r.device.name = "<GPU & Co>".into();
    let svg = render(&r, OutputFormat::Svg);
    check_xml(&svg).unwrap_or_else(|e| panic!("{e}"));
    assert!(svg.contains("&lt;GPU &amp; Co&gt;"));
    r.runs.clear();
    let svg = render(&r, OutputFormat::Svg);
    check_xml(&svg).unwrap_or_else(|e| panic!("{e}"));
    assert!(svg.contains("no runs"));
}

#[test]
fn html_is_self_contained() {
    let r = sample();
    let html = render(&r, OutputFormat::Html);
    assert!(html.starts_with("<!DOCTYPE html>"));
    assert!(html.trim_end().ends_with("</html>"));
    for bad in [
        "src=\"http",
        "href=\"http",
        "src='http",
        "href='http",
        "<script",
        "@import",
        "url(",
    ] {
        assert!(!html.contains(bad), "HTML contains {bad}");
    }
    assert_eq!(count(&html, "<svg "), r.runs.len());
    // Each inline SVG is well-formed XML on its own.
    let mut rest = html.as_str();
    while let Some(a) = rest.find("<svg ") {
        let b = a + rest[a..].find("</svg>").expect("closed svg") + "</svg>".len();
        check_xml(&rest[a..b]).unwrap_or_else(|e| panic!("inline SVG: {e}"));
        rest = &rest[b..];
    }
    assert_eq!(count(&html, "<table>"), 1 + r.runs.len());
    preview("report.html", &html);
    preview("report.md", &render(&r, OutputFormat::Markdown));
    preview("report.json", &render(&r, OutputFormat::Json));
    preview("report.csv", &render(&r, OutputFormat::Csv));
    preview("report.txt", &render(&r, OutputFormat::Table));
}

#[test]
fn table_shows_device_and_a_row_per_run() {
    let r = sample();
    let t = render(&r, OutputFormat::Table);
    assert!(t.starts_with("device: llvmpipe"));
    assert!(t.contains("budget 512.00 MiB"));
    for col in report::table::SUMMARY_COLUMNS {
        assert!(t.contains(col), "missing column {col}");
    }
    for label in [
        "params",
        "batch",
        "naive",
        "flash",
        "checkpoint none",
        "checkpoint full",
    ] {
        assert!(t.contains(label), "missing {label}");
    }
}

fn probe(value: u64, fit: bool, step: Option<f64>) -> ProbeRecord {
    let outcome = if fit {
        Outcome::Fit
    } else {
        Outcome::OutOfMemory
    };
    ProbeRecord {
        seconds: 1.0,
        step_seconds: step,
        ..ProbeRecord::new(value, outcome, value * MIB)
    }
}

#[test]
fn best_throughput_is_not_simply_the_largest_fit() {
    let mut run = sample().runs[1].clone();
    assert_eq!(run.dimension, "batch");
    run.probes = vec![
        probe(8, true, Some(0.10)),   // 80/s
        probe(16, true, Some(0.16)),  // 100/s
        probe(32, true, Some(0.40)),  // 80/s
        probe(64, false, Some(0.01)), // failed: ignored however fast
        probe(24, true, None),        // no step time: ignored
    ];
    run.max_fit = Some(32);
    let best = best_throughput(&run).expect("best");
    assert_eq!(best.value, 16);
    // A value probed twice: only the faster probe is marked.
    run.probes.push(probe(16, true, Some(0.32)));
    let rows = report::markdown::probe_rows(&run);
    let marked: Vec<&Vec<String>> = rows
        .iter()
        .filter(|r| r[6].contains("best throughput"))
        .collect();
    assert_eq!(marked.len(), 1, "{rows:?}");
    assert_eq!(marked[0][4], "0.160");
    assert!((best.per_second - 100.0).abs() < 1e-9);
    assert_eq!(best.unit, "samples");
    // Tokens per second for seq: value * batch / t.
    let mut seq = sample().runs[2].clone();
    seq.workload.batch = 2;
    seq.probes = vec![probe(1024, true, Some(0.5))];
    let b = best_throughput(&seq).expect("seq best");
    assert_eq!((b.value, b.unit), (1024, "tokens"));
    assert!((b.per_second - 4096.0).abs() < 1e-9);
    // No rate for params.
    assert!(best_throughput(&sample().runs[0]).is_none());
    // The sample's batch run peaks below its max fit, and the table says so.
    let r = sample();
    let b = best_throughput(&r.runs[1]).expect("batch best");
    assert!(b.value < r.runs[1].max_fit.expect("max"));
    assert!(render(&r, OutputFormat::Table).contains("most throughput at batch"));
}

#[test]
fn out_file_format_and_atomic_write() {
    use std::path::Path;
    assert_eq!(
        report::format_for_path(Path::new("r.html"), None).ok(),
        Some(OutputFormat::Html)
    );
    assert!(report::format_for_path(Path::new("r.bin"), None).is_err());
    let dir = tempfile::tempdir().expect("tempdir");
    let p = dir.path().join("r.json");
    let r = sample();
    report::write_atomically(&p, &render(&r, OutputFormat::Json)).expect("write");
    let back: ProbeReport =
        serde_json::from_str(&std::fs::read_to_string(&p).expect("read")).expect("parse");
    assert_eq!(back.runs.len(), r.runs.len());
}

fn preview(name: &str, text: &str) {
    if let Ok(dir) = std::env::var("OOMPROBE_PREVIEW_DIR") {
        let _ = std::fs::create_dir_all(&dir);
        std::fs::write(std::path::Path::new(&dir).join(name), text).expect("write preview");
    }
}

#[test]
fn predicted_line_comes_from_the_plan_when_it_matches_the_probes() {
    use oomprobe::plan::Plan;
    use oomprobe::scenario::Scenario;
    let w = oomprobe::workload::presets::get("tiny-gpt").expect("preset");
    let total = |x: u64| {
        Plan::for_value(&w, Scenario::Batch, x)
            .expect("plan")
            .peak_bytes()
    };
    let mut r = sample();
    let mut run = r.runs[1].clone();
    run.workload = w.clone();
    run.probes = [(8, true), (16, true), (24, true), (32, false)]
        .iter()
        .map(|&(v, fit)| {
            let mut p = probe(v, fit, Some(0.1));
            p.bytes = total(v);
            p
        })
        .collect();
    run.max_fit = Some(24);
    run.first_fail = Some(32);
    run.predicted_max = Some(29);
    run.capacity_bytes = Some(total(30));
    r.runs = vec![run];
    let points = |svg: &str| {
        let a = svg.find("class=\"predicted\"").expect("predicted line");
        let rest = &svg[a..];
        let p = rest.find("points=\"").expect("points") + 8;
        let end = rest[p..].find('"').expect("end");
        rest[p..p + end].split_whitespace().count()
    };
    let svg = render(&r, OutputFormat::Svg);
    check_xml(&svg).unwrap_or_else(|e| panic!("{e}"));
    assert!(svg.contains("data-source=\"plan\""));
    assert!(points(&svg) > 20, "{}", points(&svg));
    // A report whose bytes the plan does not reproduce: the line goes through its probes only.
    r.runs[0].probes[1].bytes += 1;
    let svg = render(&r, OutputFormat::Svg);
    assert!(svg.contains("data-source=\"probes\""));
    assert_eq!(points(&svg), 4);
}

#[test]
fn a_partial_report_is_marked_in_every_format() {
    let mut r = sample();
    r.in_progress = true;
    r.runs.truncate(2);
    r.runs[1].in_progress = true;
    let done = sample();
    for f in [
        OutputFormat::Table,
        OutputFormat::Markdown,
        OutputFormat::Html,
        OutputFormat::Svg,
    ] {
        let text = render(&r, f);
        assert!(text.contains("in progress"), "{f:?} marks the partial run");
        assert!(
            !render(&done, f).contains("in progress"),
            "{f:?}: a finished report is not marked"
        );
    }
    for f in [
        OutputFormat::Table,
        OutputFormat::Markdown,
        OutputFormat::Html,
    ] {
        assert!(render(&r, f).contains("IN PROGRESS"), "{f:?}");
    }
    let csv = render(&r, OutputFormat::Csv);
    let rows: Vec<Vec<String>> = csv.lines().map(split_csv).collect();
    let status = report::csv::RUN_COLUMNS
        .iter()
        .position(|c| *c == "status")
        .expect("a status column");
    assert_eq!(rows[1][status], "complete");
    assert_eq!(rows[2][status], "in_progress");
    let v: serde_json::Value = serde_json::from_str(&render(&r, OutputFormat::Json)).unwrap();
    assert_eq!(v["in_progress"], true);
    assert_eq!(v["runs"][1]["in_progress"], true);
    assert!(v["runs"][0].get("in_progress").is_none());
    let v: serde_json::Value = serde_json::from_str(&render(&done, OutputFormat::Json)).unwrap();
    assert!(
        v.get("in_progress").is_none(),
        "additive: absent when finished"
    );
}
