//! `diagnose --oom` on the corpus of real messages (tests/fixtures/oom): every message parses,
//! every figure it printed is read, and its cause is the label assigned by hand in SOURCES.md
//! before the classifier existed.

use std::path::Path;

use oomprobe::oom::judge::judge;
use oomprobe::oom::scan::scan_str;
use oomprobe::oom::{Format, Message};

const DIR: &str = "tests/fixtures/oom";

/// Files that hold no message at all: what was pasted stops before it.
const NO_MESSAGE: &[&str] = &["077"];

struct Row {
    file: String,
    tag: String,
    label: String,
    note: String,
}

fn rows() -> Vec<Row> {
    let t = std::fs::read_to_string(Path::new(DIR).join("SOURCES.md")).unwrap();
    t.lines()
        .filter(|l| l.starts_with("| ") && l.contains(".txt"))
        .map(|l| {
            let c: Vec<&str> = l.split('|').map(str::trim).collect();
            Row {
                file: c[1].to_string(),
                tag: c[3].to_string(),
                label: c[5].to_string(),
                note: c[6].to_string(),
            }
        })
        .collect()
}

/// The SOURCES.md format tag's family, as `Format` names it.
fn family(tag: &str) -> Format {
    match tag.split('-').next().unwrap() {
        "cuda2" => Format::Cuda2,
        "cuda1" => Format::Cuda1,
        "hip" => Format::Hip,
        "mps" => Format::Mps,
        "xpu" => Format::Xpu,
        "npu" => Format::Npu,
        "cpu" => Format::Cpu,
        "cublas" => Format::Cublas,
        "cudnn" => Format::Cudnn,
        "driver" if tag == "driver-legacy" => Format::DriverLegacy,
        "driver" => Format::Driver,
        "wrapper" if tag == "wrapper-accelerate" => Format::Accelerate,
        // ComfyUI's report wraps the MPS text.
        "wrapper" => Format::Mps,
        other => panic!("unknown tag {other}"),
    }
}

fn messages(file: &str) -> Vec<Message> {
    let bytes = std::fs::read(Path::new(DIR).join(file)).unwrap();
    scan_str(&String::from_utf8_lossy(&bytes))
}

fn check(range: impl Fn(u32) -> bool) -> Vec<String> {
    let mut bad = Vec::new();
    let mut n = 0;
    for r in rows() {
        let num: u32 = r.file[..3].parse().unwrap();
        if !range(num) {
            continue;
        }
        n += 1;
        let ms = messages(&r.file);
        if NO_MESSAGE.contains(&&r.file[..3]) {
            if !ms.is_empty() {
                bad.push(format!(
                    "{}: expected no message, found {}",
                    r.file,
                    ms.len()
                ));
            }
            continue;
        }
        let want = family(&r.tag);
        let of: Vec<&Message> = ms.iter().filter(|m| m.format == want).collect();
        if of.is_empty() {
            bad.push(format!(
                "{}: no {:?} message (found {:?})",
                r.file,
                want,
                ms.iter().map(|m| m.format).collect::<Vec<_>>()
            ));
            continue;
        }
        for m in of {
            let j = judge(m);
            if j.cause.name() != r.label {
                bad.push(format!(
                    "{}: cause {} (label {}): {}",
                    r.file,
                    j.cause.name(),
                    r.label,
                    j.causes[0].reason
                ));
            }
            // Only a paste SOURCES.md calls mangled may leave figures unread.
            let mangled = r.note.contains("mangled") || r.note.contains("garbled");
            let excused = mangled && m.garbled;
            if !m.unread.is_empty() && !excused {
                bad.push(format!("{}: unread figures {:?}", r.file, m.unread));
            }
        }
    }
    assert!(n > 0);
    bad
}

#[test]
fn every_message_parses_to_its_hand_label() {
    let bad = check(|_| true);
    assert!(
        bad.is_empty(),
        "{} files off:\n{}",
        bad.len(),
        bad.join("\n")
    );
}

/// Every figure of a message, by the names expected.tsv uses.
fn figures(m: &Message) -> Vec<(String, String)> {
    let mut v = Vec::new();
    let mut put = |k: &str, p: &Option<oomprobe::oom::Printed>| {
        if let Some(p) = p {
            // The bytes stand for the printed text: inside its rounding interval.
            assert!(p.min <= p.bytes && p.bytes <= p.max, "{k} {p:?}");
            v.push((k.to_string(), p.text.clone()));
        }
    };
    put("requested", &m.requested);
    put("total", &m.total);
    put("free", &m.free);
    put("process", &m.process);
    put("allowed", &m.allowed);
    put("allocated", &m.allocated);
    put("private_pools", &m.private_pools);
    put("reserved_unallocated", &m.reserved_unallocated);
    put("reserved", &m.reserved);
    put("active", &m.active);
    put("inactive", &m.inactive);
    put("other_allocations", &m.other_allocations);
    for p in &m.other_processes {
        v.push((format!("other:{}", p.pid), p.bytes.text.clone()));
    }
    if let Some(g) = m.gpu {
        v.push(("gpu".into(), g.to_string()));
    }
    v.sort();
    v
}

#[test]
fn figures_equal_what_a_person_reads_off_the_message() {
    let t = std::fs::read_to_string(Path::new(DIR).join("expected.tsv")).unwrap();
    let mut want: std::collections::BTreeMap<(String, usize), Vec<(String, String)>> =
        Default::default();
    for l in t.lines().filter(|l| !l.starts_with('#') && !l.is_empty()) {
        let c: Vec<&str> = l.split('\t').collect();
        want.entry((c[0].to_string(), c[1].parse().unwrap()))
            .or_default()
            .push((c[2].to_string(), c[3].to_string()));
    }
    assert!(want.len() >= 25);
    let files: Vec<String> = std::fs::read_dir(DIR)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    for ((num, i), mut fields) in want {
        let file = files.iter().find(|f| f.starts_with(&num)).unwrap();
        let ms = messages(file);
        let m = ms
            .get(i)
            .unwrap_or_else(|| panic!("{file}: no message {i}"));
        fields.sort();
        assert_eq!(figures(m), fields, "{file} message {i}");
    }
}

#[test]
fn sizes_convert_as_pytorch_prints_them() {
    use oomprobe::oom::parse::size;
    let gib = 1u64 << 30;
    let p = size("23.58", "GiB").unwrap();
    // [23.575, 23.585) GiB.
    assert!(p.min <= 23_575 * gib / 1000 && p.max >= (23_585 * gib).div_ceil(1000));
    assert!(p.min > 23_574 * gib / 1000 && p.max < 23_586 * gib / 1000);
    assert_eq!(size("1024", "bytes").unwrap().max, 1024);
    // Older MPS texts print "GB" for the same binary unit.
    assert_eq!(size("1.00", "GB").unwrap().bytes, gib);
}
