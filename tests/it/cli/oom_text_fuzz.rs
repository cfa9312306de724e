//! Fuzzing `diagnose --oom` (issue 48): the real messages of `tests/fixtures/oom/` and a few
//! templates with huge sizes ("1e30 GiB", 2⁶⁴ bytes), dressed as logs are found: ANSI colour
//! around the numbers (rich tracebacks), UTF-16 LE/BE with and without a BOM (Windows
//! consoles), lines ended by `\r` alone (progress bars) or `\r\n`, repeated, cut at any byte,
//! with binary junk inserted. Each, on stdin or in a file, exits 0 or 2 (one escaped stderr
//! line, and no raw control character on stdout), never a panic, within
//! `support::fuzz::RUN_BOUND`.
//!
//! CI runs `support::fuzz::DEFAULT_CASES` cases; `OOMPROBE_FUZZ_CASES=N` runs N
//! (docs/src/testing.md).

use std::path::Path;
use std::sync::OnceLock;

use proptest::prelude::*;

use crate::support::fuzz;

/// Messages with sizes past any card, in the wordings `oom::parse` reads.
const HUGE: &[&str] = &[
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1e30 GiB. GPU 0 has a total capacity of 79.11 GiB of which 1.5e300 GiB is free. Of the allocated memory 18446744073709551616 bytes is allocated by PyTorch, and 9.35 GiB is reserved by PyTorch but unallocated.",
    "RuntimeError: CUDA out of memory. Tried to allocate 18446744073709551616.00 MiB (GPU 0; 99999999999999999999 GiB total capacity; 1e309 GiB already allocated; 0 bytes free; 340282366920938463463374607431768211456 GiB reserved in total by PyTorch)",
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate -5.00 GiB. GPU 18446744073709551615 has a total capacity of 0 bytes of which NaN GiB is free.",
    "RuntimeError: [enforce fail at alloc_cpu.cpp:114] data. DefaultCPUAllocator: not enough memory: you tried to allocate 18446744073709551615 bytes.",
    "RuntimeError: cuda runtime error (2) : out of memory at /pytorch/aten/src/THC/THCStorage.cu:66",
];

/// The corpus: every message fixture, and the huge templates.
fn corpus() -> &'static [Vec<u8>] {
    static C: OnceLock<Vec<Vec<u8>>> = OnceLock::new();
    C.get_or_init(|| {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/oom");
        let mut files: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|e| e == "txt"))
            .collect();
        files.sort();
        let mut texts: Vec<Vec<u8>> = files.iter().map(|p| std::fs::read(p).unwrap()).collect();
        assert!(
            texts.len() > 50,
            "the message corpus is in {}",
            dir.display()
        );
        texts.extend(HUGE.iter().map(|t| t.as_bytes().to_vec()));
        texts
    })
}

/// How a text is dressed before it is read.
#[derive(Debug, Clone)]
struct Dress {
    ansi: bool,
    line_end: &'static str,
    repeat: usize,
    junk: Vec<(usize, Vec<u8>)>,
    cut: Option<usize>,
    encoding: &'static str,
}

fn dress() -> impl Strategy<Value = Dress> {
    (
        any::<bool>(),
        prop::sample::select(vec!["\n", "\r\n", "\r", "\n\r", "\u{2028}"]),
        prop_oneof![4 => Just(1usize), 1 => 2usize..50, 1 => Just(2000usize)],
        prop::collection::vec(
            (any::<usize>(), prop::collection::vec(any::<u8>(), 1..16)),
            0..3,
        ),
        prop::option::weighted(0.3, any::<usize>()),
        prop::sample::select(vec![
            "utf8",
            "utf8",
            "utf8",
            "utf8-bom",
            "utf16le",
            "utf16le-bom",
            "utf16be",
            "utf16be-bom",
        ]),
    )
        .prop_map(|(ansi, line_end, repeat, junk, cut, encoding)| Dress {
            ansi,
            line_end,
            repeat,
            junk,
            cut,
            encoding,
        })
}

/// Colour every run of digits (and its unit), as `rich` prints a traceback's numbers.
fn colour_numbers(text: &str) -> String {
    let mut out = String::with_capacity(text.len() * 2);
    let mut in_num = false;
    for c in text.chars() {
        let digit = c.is_ascii_digit() || (in_num && c == '.');
        if digit && !in_num {
            out.push_str("\u{1b}[1;36m");
        } else if !digit && in_num {
            out.push_str("\u{1b}[0m");
        }
        in_num = digit;
        out.push(c);
    }
    out
}

/// `base` dressed by `d`, as the bytes of a log.
fn dressed(base: &[u8], d: &Dress) -> Vec<u8> {
    let mut text = String::from_utf8_lossy(base).into_owned();
    if d.ansi {
        text = colour_numbers(&text);
    }
    let text = text.replace("\r\n", "\n").replace('\n', d.line_end);
    let text = text.repeat(d.repeat);
    let mut bytes = match d.encoding {
        "utf8" => text.into_bytes(),
        "utf8-bom" => [&[0xef, 0xbb, 0xbf][..], text.as_bytes()].concat(),
        enc => {
            let mut b = Vec::new();
            if enc.ends_with("-bom") {
                b.extend(if enc.starts_with("utf16le") {
                    [0xff, 0xfe]
                } else {
                    [0xfe, 0xff]
                });
            }
            for u in text.encode_utf16() {
                b.extend(if enc.starts_with("utf16le") {
                    u.to_le_bytes()
                } else {
                    u.to_be_bytes()
                });
            }
            b
        }
    };
    for (at, junk) in &d.junk {
        let at = at % (bytes.len() + 1);
        bytes.splice(at..at, junk.iter().copied());
    }
    if let Some(cut) = d.cut {
        bytes.truncate(cut % (bytes.len() + 1));
    }
    bytes
}

proptest! {
    #![proptest_config(fuzz::config())]

    #[test]
    fn any_dressed_oom_log_exits_0_or_2_in_bounded_time(
        which in any::<prop::sample::Index>(),
        d in dress(),
        from_file in any::<bool>(),
        workload in prop::sample::select(vec![
            vec![],
            vec!["--model", "gpt2", "--memory", "24GiB"],
            vec!["--gpu", "nonexistent"],
            vec!["--gpu", "h100-sxm"],
        ]),
    ) {
        let c = corpus();
        let bytes = dressed(&c[which.index(c.len())], &d);
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("log.txt");
        let mut args = vec!["diagnose", "--oom"];
        let stdin: &[u8] = if from_file {
            std::fs::write(&file, &bytes).unwrap();
            args.push(file.to_str().unwrap());
            b""
        } else {
            args.push("-");
            &bytes
        };
        args.extend(workload.iter().copied());
        let why = match fuzz::run(&args, &[], stdin) {
            Err(why) => why,
            // The log's colour and junk are not echoed to the terminal.
            Ok(r) => match fuzz::raw_control(&r.stdout) {
                Some(line) => format!("a raw control character on stdout: {line}"),
                None => return Ok(()),
            },
        };
        prop_assert!(
            false,
            "{:?} on {:?} ({} bytes, starting {:?}): {}",
            args, d, bytes.len(), String::from_utf8_lossy(&bytes[..bytes.len().min(200)]),
            why
        );
    }
}

/// The dresses that issue 48 found unread are read: the message under ANSI colour, in UTF-16
/// with a BOM, and with `\r` line ends gives the request that the plain one gives.
#[test]
fn a_dressed_message_reads_as_the_plain_one() {
    let plain = &corpus()[0];
    let read = |bytes: &[u8]| {
        let r = fuzz::run(&["diagnose", "--oom", "-", "--json"], &[], bytes)
            .unwrap_or_else(|why| panic!("{why}"));
        assert_eq!(r.code, 0, "{}", r.stderr);
        let v: serde_json::Value = serde_json::from_slice(&r.stdout).unwrap();
        let found = v.to_string();
        assert!(found.contains("requested 22.78 GiB"), "{found}");
        found
    };
    read(plain);
    for d in [
        Dress {
            ansi: true,
            line_end: "\n",
            repeat: 1,
            junk: vec![],
            cut: None,
            encoding: "utf8",
        },
        Dress {
            ansi: false,
            line_end: "\r",
            repeat: 3,
            junk: vec![],
            cut: None,
            encoding: "utf16le-bom",
        },
    ] {
        read(&dressed(plain, &d));
    }
    eprintln!("oom text fuzz: slowest run so far {:?}", fuzz::slowest());
}
