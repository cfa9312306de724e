//! `oomprobe compare` end to end: two probe files in every format, the workload-differs warning,
//! and bad files (exit 2, one line naming the file).

use std::path::{Path, PathBuf};

use crate::support::formats::{check_xml, count, split_csv};
use assert_cmd::Command;
use oomprobe::report::sample::sample_report;
use oomprobe::report::ProbeReport;
use predicates::prelude::*;

const MIB: u64 = 1 << 20;

fn write(dir: &Path, name: &str, r: &ProbeReport) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, serde_json::to_string_pretty(r).expect("json")).expect("write");
    p
}

fn two_files(dir: &Path) -> (PathBuf, PathBuf) {
    let a = write(dir, "small.json", &sample_report(512 * MIB));
    let b = write(dir, "large.json", &sample_report(1024 * MIB));
    (a, b)
}

fn oomprobe() -> Command {
    Command::cargo_bin("oomprobe").expect("binary")
}

#[test]
fn table_has_a_column_per_file_and_ratios() {
    let dir = tempfile::tempdir().expect("tmp");
    let (a, b) = two_files(dir.path());
    let out = oomprobe()
        .arg("compare")
        .arg(&a)
        .arg(&b)
        .assert()
        .success()
        .stderr(predicate::str::contains("warning").not())
        .get_output()
        .stdout
        .clone();
    let text = String::from_utf8(out).expect("utf8");
    assert!(text.contains("budget 512.00 MiB"));
    assert!(text.contains("budget 1.00 GiB"));
    for m in oomprobe::report::compare::MEASURES {
        assert!(text.contains(m), "missing measure {m}");
    }
    assert!(text.contains("1.00\u{00d7}"));
}

#[test]
fn json_output_is_the_documented_object() {
    let dir = tempfile::tempdir().expect("tmp");
    let (a, b) = two_files(dir.path());
    let out = oomprobe()
        .args(["compare", "--format", "json"])
        .arg(&a)
        .arg(&b)
        .assert()
        .success()
        .get_output()
        .stdout
        .clone();
    let v: serde_json::Value = serde_json::from_slice(&out).expect("json");
    assert_eq!(v["schema_version"], 1);
    assert_eq!(v["files"].as_array().map(Vec::len), Some(2));
    let rows = v["rows"].as_array().expect("rows");
    assert_eq!(rows.len(), 6);
    for row in rows {
        let cells = row["cells"].as_array().expect("cells");
        assert_eq!(cells.len(), 2);
        assert_eq!(cells[0]["ratio_to_first"], 1.0);
        let m0 = cells[0]["max_fit"].as_f64().expect("max 0");
        let m1 = cells[1]["max_fit"].as_f64().expect("max 1");
        let r = cells[1]["ratio_to_first"].as_f64().expect("ratio");
        assert!((r - m1 / m0).abs() < 1e-9);
        // Twice the budget fits more.
        assert!(r > 1.0, "{row}");
    }
}

#[test]
fn writes_markdown_csv_svg_html_by_extension() {
    let dir = tempfile::tempdir().expect("tmp");
    let (a, b) = two_files(dir.path());
    for ext in ["md", "csv", "svg", "html", "json", "txt"] {
        let out = dir.path().join(format!("cmp.{ext}"));
        oomprobe()
            .arg("compare")
            .arg(&a)
            .arg(&b)
            .arg("--out")
            .arg(&out)
            .assert()
            .success()
            .stdout(predicate::str::is_empty());
        let text = std::fs::read_to_string(&out).expect("read");
        match ext {
            "md" => {
                assert!(text.starts_with("# oomprobe comparison"));
                let table: Vec<&str> = text.lines().filter(|l| l.starts_with('|')).collect();
                // header + separator + 7 measures x 6 rows
                assert_eq!(table.len(), 2 + 7 * 6);
            }
            "csv" => {
                let lines: Vec<&str> = text.lines().collect();
                assert_eq!(lines.len(), 1 + 2 * 6);
                let n = split_csv(lines[0]).len();
                assert!(lines.iter().all(|l| split_csv(l).len() == n));
                assert!(lines[0].ends_with("ratio_to_first"));
            }
            "svg" => {
                check_xml(&text).unwrap_or_else(|e| panic!("svg: {e}"));
                assert_eq!(count(&text, "class=\"chart\""), 6);
                assert_eq!(count(&text, "class=\"series\""), 12);
                if let Ok(d) = std::env::var("OOMPROBE_PREVIEW_DIR") {
                    let _ = std::fs::create_dir_all(&d);
                    std::fs::write(Path::new(&d).join("compare.svg"), &text).expect("preview");
                }
            }
            "html" => {
                assert!(text.starts_with("<!DOCTYPE html>"));
                assert_eq!(count(&text, "<svg "), 6);
                assert!(!text.contains("src=\"http") && !text.contains("href=\"http"));
                if let Ok(d) = std::env::var("OOMPROBE_PREVIEW_DIR") {
                    let _ = std::fs::create_dir_all(&d);
                    std::fs::write(Path::new(&d).join("compare.html"), &text).expect("preview");
                }
            }
            "json" => {
                let v: serde_json::Value = serde_json::from_str(&text).expect("json");
                assert_eq!(v["rows"].as_array().map(Vec::len), Some(6));
            }
            _ => assert!(text.contains("max fit")),
        }
    }
}

#[test]
fn warns_when_workloads_differ() {
    let dir = tempfile::tempdir().expect("tmp");
    let a = write(dir.path(), "a.json", &sample_report(512 * MIB));
    let mut other = sample_report(512 * MIB);
    other.runs[1].workload.image = 112;
    // The varied dimension itself may differ without a warning.
    other.runs[2].workload.seq = 4096;
    let b = write(dir.path(), "b.json", &other);
    oomprobe()
        .arg("compare")
        .arg(&a)
        .arg(&b)
        .assert()
        .success()
        .stderr(predicate::str::contains("batch: workloads differ"))
        .stderr(predicate::str::contains("image 64 vs 112"))
        .stderr(predicate::str::contains("seq (naive)").not());
}

#[test]
fn unknown_out_extension_is_a_usage_error() {
    let dir = tempfile::tempdir().expect("tmp");
    let (a, b) = two_files(dir.path());
    oomprobe()
        .arg("compare")
        .arg(&a)
        .arg(&b)
        .arg("--out")
        .arg(dir.path().join("x.xlsx"))
        .assert()
        .code(2)
        .stderr(predicate::str::contains("x.xlsx"));
}

fn assert_bad_file(content: Option<&str>, expect: &str) {
    let dir = tempfile::tempdir().expect("tmp");
    let good = write(dir.path(), "good.json", &sample_report(512 * MIB));
    let bad = dir.path().join("bad.json");
    if let Some(c) = content {
        std::fs::write(&bad, c).expect("write");
    }
    let out = oomprobe()
        .arg("compare")
        .arg(&good)
        .arg(&bad)
        .assert()
        .code(2)
        .stdout(predicate::str::is_empty())
        .get_output()
        .stderr
        .clone();
    let err = String::from_utf8(out).expect("utf8");
    assert_eq!(err.trim_end().lines().count(), 1, "{err}");
    assert!(err.contains("bad.json"), "{err}");
    assert!(err.contains(expect), "{err}");
}

#[test]
fn bad_files_exit_2_naming_the_file() {
    assert_bad_file(None, "cannot read");
    assert_bad_file(Some("{ not json"), "invalid JSON");
    assert_bad_file(Some("[1, 2]"), "expected a JSON object");
    assert_bad_file(Some("{\"runs\": []}"), "schema_version");
    assert_bad_file(
        Some("{\"schema_version\": 1, \"runs\": []}"),
        "not an oomprobe probe result",
    );
    let mut v = serde_json::to_value(sample_report(512 * MIB)).expect("v");
    v["schema_version"] = 99.into();
    assert_bad_file(Some(&v.to_string()), "schema_version 99");
}

#[test]
fn a_run_missing_from_one_file_is_an_empty_cell() {
    let dir = tempfile::tempdir().expect("tmp");
    let a = write(dir.path(), "a.json", &sample_report(512 * MIB));
    let mut partial = sample_report(1024 * MIB);
    partial.runs.truncate(2); // killed half way: params and batch only
    let b = write(dir.path(), "b.json", &partial);
    let out = oomprobe()
        .args(["compare", "--format", "json"])
        .arg(&a)
        .arg(&b)
        .assert()
        .success()
        .get_output()
        .stdout
        .clone();
    let v: serde_json::Value = serde_json::from_slice(&out).expect("json");
    let rows = v["rows"].as_array().expect("rows");
    assert_eq!(rows.len(), 6);
    assert!(rows[0]["cells"][1].is_object());
    assert!(rows[5]["cells"][1].is_null());
    oomprobe()
        .arg("compare")
        .arg(&a)
        .arg(&b)
        .assert()
        .success()
        .stdout(predicate::str::contains("no run"));
}

#[test]
fn no_files_or_a_missing_out_folder_is_one_line_naming_it() {
    let out = oomprobe()
        .arg("compare")
        .assert()
        .code(2)
        .get_output()
        .clone();
    let err = String::from_utf8(out.stderr).expect("utf8");
    assert_eq!(err.trim_end().lines().count(), 1, "{err}");
    assert!(err.contains("<FILE>"), "says what is missing: {err}");
    let dir = tempfile::tempdir().expect("tmp");
    let (a, b) = two_files(dir.path());
    oomprobe()
        .arg("compare")
        .arg(&a)
        .arg(&b)
        .arg("--out")
        .arg(dir.path().join("missing").join("x.md"))
        .assert()
        .code(2)
        .stderr(predicate::str::contains("folder does not exist"));
}

#[test]
fn a_partial_run_is_marked_in_every_format() {
    let dir = tempfile::tempdir().expect("tmp");
    let a = write(dir.path(), "a.json", &sample_report(512 * MIB));
    let mut stopped = sample_report(1024 * MIB);
    stopped.in_progress = true;
    stopped.runs.truncate(2);
    stopped.runs[1].in_progress = true;
    let b = write(dir.path(), "b.json", &stopped);
    let table = oomprobe()
        .arg("compare")
        .arg(&a)
        .arg(&b)
        .assert()
        .success()
        .stderr(predicate::str::contains(
            "b.json: the probe was not finished",
        ))
        .get_output()
        .stdout
        .clone();
    assert!(String::from_utf8_lossy(&table).contains("(in progress)"));
    let json = oomprobe()
        .args(["compare", "--format", "json"])
        .arg(&a)
        .arg(&b)
        .assert()
        .success()
        .get_output()
        .stdout
        .clone();
    let v: serde_json::Value = serde_json::from_slice(&json).expect("json");
    assert_eq!(v["rows"][1]["cells"][1]["in_progress"], true);
    assert_eq!(v["rows"][0]["cells"][1]["in_progress"], false);
    assert_eq!(v["rows"][1]["cells"][0]["in_progress"], false);
    let csv = oomprobe()
        .args(["compare", "--format", "csv"])
        .arg(&a)
        .arg(&b)
        .assert()
        .success()
        .get_output()
        .stdout
        .clone();
    let csv = String::from_utf8_lossy(&csv);
    assert_eq!(csv.matches("in_progress").count(), 1, "{csv}");
    for f in ["markdown", "html", "svg"] {
        let out = oomprobe()
            .args(["compare", "--format", f])
            .arg(&a)
            .arg(&b)
            .assert()
            .success()
            .get_output()
            .stdout
            .clone();
        assert!(
            String::from_utf8_lossy(&out).contains("in progress"),
            "{f} marks the partial run"
        );
    }
}

#[test]
fn out_refuses_what_a_rename_would_clobber_before_any_work() {
    let d = tempfile::tempdir().unwrap();
    let (a, b) = two_files(d.path());
    let fifo = d.path().join("pipe.json");
    assert!(std::process::Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .unwrap()
        .success());
    let target = d.path().join("real.json");
    std::fs::write(&target, "{}").unwrap();
    let link = d.path().join("link.json");
    std::os::unix::fs::symlink(&target, &link).unwrap();
    let looped = d.path().join("loop.json");
    std::os::unix::fs::symlink(&looped, &looped).unwrap();
    for (out, why) in [
        (fifo.as_path(), "not a regular file"),
        (Path::new("/dev/null"), "not a regular file"),
        (link.as_path(), "symbolic link"),
        (looped.as_path(), "symbolic link"),
        (d.path(), "is a folder"),
    ] {
        let o = oomprobe()
            .args(["compare"])
            .arg(&a)
            .arg(&b)
            .arg("--out")
            .arg(out)
            .arg("--format")
            .arg("json")
            .assert()
            .code(2)
            .get_output()
            .clone();
        let e = String::from_utf8(o.stderr).unwrap();
        assert_eq!(e.trim_end().lines().count(), 1, "{e}");
        assert!(e.contains(why), "{}: {e}", out.display());
    }
    // The symlink's target is untouched.
    assert_eq!(std::fs::read_to_string(&target).unwrap(), "{}");
    // probe refuses the same before opening a device.
    let o = oomprobe()
        .args([
            "probe",
            "--budget",
            "64MiB",
            "--out",
            "/dev/null",
            "--format",
            "json",
        ])
        .assert()
        .code(2)
        .get_output()
        .clone();
    assert!(String::from_utf8_lossy(&o.stderr).contains("not a regular file"));
}

#[test]
fn the_table_fits_100_columns_and_wide_heads_columns_by_label() {
    let dir = tempfile::tempdir().expect("tmp");
    let (a, b) = two_files(dir.path());
    let run = |wide: bool| {
        let mut c = oomprobe();
        c.arg("compare").arg(&a).arg(&b);
        if wide {
            c.arg("--wide");
        }
        String::from_utf8(c.assert().success().get_output().stdout.clone()).unwrap()
    };
    let narrow = run(false);
    for l in narrow.lines().filter(|l| !l.starts_with('[')) {
        assert!(
            l.chars().count() <= 100,
            "{} columns: {l}",
            l.chars().count()
        );
    }
    let header = narrow.lines().find(|l| l.contains("scenario")).unwrap();
    assert!(header.contains("[1]") && header.contains("[2]"), "{header}");
    let wide = run(true);
    let header = wide.lines().find(|l| l.contains("scenario")).unwrap();
    assert!(header.contains("budget 512.00 MiB"), "{header}");
}
