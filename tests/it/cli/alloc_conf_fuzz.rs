//! Fuzzing the allocator settings (issue 48): generated `PYTORCH_CUDA_ALLOC_CONF` strings (every
//! key `alloc::conf` reads, the `[256:1,>:4]` list form, unknown keys, huge numbers, control
//! characters, newlines and escape sequences, stray separators) given as `--alloc-conf` or in
//! the environment to `estimate`. Each run exits 0 or 2; a refusal is one line with no raw
//! control character (the key or value it names is escaped), and a report has none either,
//! within `support::fuzz::RUN_BOUND`.
//!
//! CI runs `support::fuzz::DEFAULT_CASES` cases; `OOMPROBE_FUZZ_CASES=N` runs N
//! (docs/src/testing.md).

use proptest::prelude::*;

use crate::support::fuzz;

/// Keys PyTorch reads (c10/cuda/CUDAAllocatorConfig.cpp), typos of them, and junk.
const KEYS: &[&str] = &[
    "expandable_segments",
    "max_split_size_mb",
    "max_non_split_rounding_mb",
    "garbage_collection_threshold",
    "roundup_power2_divisions",
    "backend",
    "pinned_use_cuda_host_register",
    "pinned_num_register_threads",
    "release_lock_on_cudamalloc",
    "expandable_segment",
    "Max_Split_Size_MB",
    "",
    " expandable_segments",
    "\u{1b}[31mkey",
    "\u{1b}]0;title\u{7}",
    "a\nb",
    "a\rb",
    "tab\tkey",
    "ключ",
];

/// Values: good ones for some key, and ones that fit none.
fn value() -> impl Strategy<Value = String> {
    prop_oneof![
        3 => prop::sample::select(vec![
            "True", "False", "true", "1", "0", "20", "128", "512", "0.6", "0.0", "1.0", "1e-300",
            "native", "cudaMallocAsync", "4", "3", "[256:1,>:4]", "[1:2,2:4,>:8]", "[>:16]",
            "[256:3]", "[]", "[256:1", "[>:4,>:8]", "[4096:2,256:1]", "[18446744073709551615:2]",
            "18446744073709551615", "18446744073709551616", "99999999999999999999999999",
            "-1", "nan", "inf", "", " ", "True\n", "1\r", "\u{1b}[0m", "\u{1b}c", "a\u{7}b", "\u{0}x",
        ])
        .prop_map(str::to_string),
        1 => any::<u64>().prop_map(|n| n.to_string()),
        1 => any::<f64>().prop_map(|f| f.to_string()),
        1 => "\\PC{0,12}",
        1 => "[\\x01-\\x1f\\x7f a-z0-9:,\\[\\]>]{0,12}",
    ]
}

/// One setting: `key:value`, or a malformed piece.
fn setting() -> impl Strategy<Value = String> {
    prop_oneof![
        6 => (prop::sample::select(KEYS), value()).prop_map(|(k, v)| format!("{k}:{v}")),
        1 => prop::sample::select(KEYS).prop_map(str::to_string),
        1 => prop::sample::select(vec![":", "::", ",", "[", "]", ":True:False"])
            .prop_map(str::to_string),
    ]
}

/// A settings string: settings joined by `,` (sometimes by another separator).
fn conf() -> impl Strategy<Value = String> {
    (
        prop::collection::vec(setting(), 0..5),
        prop::sample::select(vec![",", ",", ",", ", ", ";", "\n", ",,"]),
    )
        // An argument or environment variable cannot hold NUL.
        .prop_map(|(parts, sep)| parts.join(sep).replace('\0', ""))
}

proptest! {
    #![proptest_config(fuzz::config())]

    #[test]
    fn any_alloc_conf_exits_0_or_2_with_one_escaped_line(
        text in conf(),
        in_env in any::<bool>(),
        memory in any::<bool>(),
    ) {
        let mut args = vec!["estimate", "--model", "gpt2"];
        if memory {
            args.extend(["--memory", "24GiB"]);
        }
        let env_value = [("PYTORCH_CUDA_ALLOC_CONF", Some(text.as_str()))];
        let env: &[(&str, Option<&str>)] = if in_env {
            &env_value
        } else {
            args.extend(["--alloc-conf", text.as_str()]);
            &[]
        };
        let why = match fuzz::run(&args, env, b"") {
            Err(why) => why,
            // Settings that are taken are echoed in the report, escaped.
            Ok(r) => match fuzz::raw_control(&r.stdout) {
                Some(line) => format!("a raw control character on stdout: {line}"),
                None => return Ok(()),
            },
        };
        prop_assert!(false, "{:?} ({}): {}", text, if in_env { "env" } else { "flag" }, why);
    }
}

/// The generator's settings reach both outcomes, and good ones are read: a list form that
/// PyTorch takes is taken, the same with a newline inside is refused in one line.
#[test]
fn the_alloc_conf_generator_reaches_successes_and_refusals() {
    let est = |conf: &str| {
        fuzz::run(
            &[
                "estimate",
                "--model",
                "gpt2",
                "--memory",
                "24GiB",
                "--alloc-conf",
                conf,
            ],
            &[],
            b"",
        )
        .unwrap_or_else(|why| panic!("{conf:?}: {why}"))
    };
    let ok = "expandable_segments:True,roundup_power2_divisions:[256:1,>:4],backend:native";
    assert_eq!(est(ok).code, 0, "{}", est(ok).stderr);
    let bad = est("roundup_power2_divisions:[256:1,\n>:4]");
    assert_eq!(bad.code, 2);
    eprintln!("alloc-conf fuzz: slowest run so far {:?}", fuzz::slowest());
}
