//! Fuzzing the layout flags (issue 48): random combinations of `--tp --pp --cp --dp --gpus
//! --microbatches --schedule --chunks --ddp --zero --fsdp …` with edge values (0, 1, the bound
//! and one past it, 2⁶³, 2⁶⁴, negative, fractional, non-numeric) on `estimate` for gpt2 and
//! llama3-8b, sometimes with a card named. Each run exits 0 or 2 (one escaped stderr line),
//! never a panic or a signal, within `support::fuzz::RUN_BOUND`.
//!
//! CI runs `support::fuzz::DEFAULT_CASES` cases; `OOMPROBE_FUZZ_CASES=N` runs N
//! (docs/src/testing.md).

use proptest::prelude::*;

use crate::support::fuzz;

/// Values a count flag may be given: ordinary ones, each bound and one past it
/// (`workload::flags::limit`), the edges of 64 bits, and text that is no count.
fn count_value() -> impl Strategy<Value = String> {
    prop_oneof![
        6 => prop::sample::select(vec!["1", "2", "4", "8"]).prop_map(str::to_string),
        2 => (1u64..=16).prop_map(|n| n.to_string()),
        3 => prop::sample::select(vec![
            "0", "1", "2", "3", "4", "7", "8", "32", "64", "1024", "2048", "2049", "4096",
            "4097", "65536", "65537", "1048576", "1048577", "16777216", "16777217",
            "4294967296", "9223372036854775807", "9223372036854775808",
            "18446744073709551615", "18446744073709551616", "99999999999999999999999",
            "-1", "-0", "+2", "1.5", "2e3", "0x10", "1_000", "1k", " 4", "4 ", "", "nan",
            "inf", "all", "auto", "２", "4\n", "\u{1b}[31m4",
        ])
        .prop_map(str::to_string),
        1 => any::<u64>().prop_map(|n| n.to_string()),
        1 => any::<i64>().prop_map(|n| n.to_string()),
    ]
}

/// Values for the flags that take a word.
fn word_value(words: &'static [&'static str]) -> impl Strategy<Value = String> {
    prop_oneof![
        4 => prop::sample::select(words).prop_map(str::to_string),
        1 => prop::sample::select(vec!["", "ON", "yes", "2", "-1", "full\nfull", "\u{7}"])
            .prop_map(str::to_string),
    ]
}

/// One layout flag and its value (`None`: the flag alone, which `--ddp` and
/// `--sequence-parallel` allow).
fn layout_flag() -> impl Strategy<Value = (&'static str, Option<String>)> {
    let count = |f: &'static str| count_value().prop_map(move |v| (f, Some(v)));
    let word =
        |f: &'static str, w: &'static [&'static str]| word_value(w).prop_map(move |v| (f, Some(v)));
    const ON_OFF: &[&str] = &["on", "off"];
    prop_oneof![
        count("--tp"),
        count("--pp"),
        count("--cp"),
        count("--dp"),
        count("--gpus"),
        count("--microbatches"),
        count("--chunks"),
        count("--ddp"),
        count("--rank"),
        count("--batch"),
        word("--schedule", &["gpipe", "1f1b", "interleaved"]),
        word("--zero", &["0", "1", "2", "3"]),
        word("--fsdp", &["full", "hybrid", "shard-grad-op", "none"]),
        word("--tp-head", &["sharded", "gathered", "replicated"]),
        word("--sequence-parallel", ON_OFF),
        word("--reshard-after-forward", ON_OFF),
        word("--offload", &["off", "off", "on"]),
        word("--bucket-view", ON_OFF),
        Just(("--ddp", None)),
        Just(("--sequence-parallel", None)),
    ]
}

/// `estimate` for a model with up to five layout flags, sometimes against a card or a memory.
fn layout_args() -> impl Strategy<Value = Vec<String>> {
    (
        prop::sample::select(vec!["gpt2", "llama3-8b"]),
        prop::collection::vec(layout_flag(), 1..6),
        prop::sample::select(vec![None, Some("--gpu"), Some("--memory")]),
    )
        .prop_map(|(model, flags, target)| {
            let mut args: Vec<String> = vec!["estimate".into(), "--model".into(), model.into()];
            // Each flag once: a repeated one is clap's refusal, which says nothing of the layout.
            let mut seen = std::collections::HashSet::new();
            for (flag, value) in flags.into_iter().filter(|(f, _)| seen.insert(*f)) {
                args.push(flag.into());
                if let Some(v) = value {
                    args.push(v);
                }
            }
            match target {
                Some("--gpu") => args.extend(["--gpu".into(), "h100-sxm".into()]),
                Some(m) => args.extend([m.into(), "80GB".into()]),
                None => {}
            }
            args
        })
}

proptest! {
    #![proptest_config(fuzz::config())]

    #[test]
    fn any_layout_exits_0_or_2_with_one_line_in_bounded_time(args in layout_args()) {
        let argv: Vec<&str> = args.iter().map(String::as_str).collect();
        if let Err(why) = fuzz::run(&argv, &[], b"") {
            prop_assert!(false, "oomprobe {:?}: {}", args, why);
        }
    }
}

/// The fuzzer's own check: it reaches both outcomes (a generator that only ever produced
/// refusals, or only successes, would test little), and the slowest run is printed.
#[test]
fn the_layout_generator_reaches_successes_and_refusals() {
    use proptest::strategy::ValueTree;
    use proptest::test_runner::TestRunner;
    let mut runner = TestRunner::deterministic();
    let (mut ok, mut refused) = (0, 0);
    for _ in 0..12 {
        let args = layout_args().new_tree(&mut runner).unwrap().current();
        let argv: Vec<&str> = args.iter().map(String::as_str).collect();
        match fuzz::run(&argv, &[], b"") {
            Ok(r) if r.code == 0 => ok += 1,
            Ok(_) => refused += 1,
            Err(why) => panic!("oomprobe {args:?}: {why}"),
        }
    }
    // Plain single flags guarantee one success whatever the generator draws.
    let r = fuzz::run(&["estimate", "--model", "gpt2", "--tp", "2"], &[], b"").unwrap();
    assert_eq!(r.code, 0, "{}", r.stderr);
    ok += 1;
    assert!(refused > 0, "12 generated layouts, none refused");
    eprintln!(
        "layout fuzz: {ok} ran, {refused} refused; slowest run so far {:?}",
        fuzz::slowest()
    );
}
