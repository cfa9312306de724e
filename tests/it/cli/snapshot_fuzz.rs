//! Fuzzing snapshot replay (issue 48) with the real snapshots of
//! `tests/fixtures/snapshots/real/` and `variants/`, mutated two ways:
//!
//! - the trace, as a pickle value (so the test does not lean on `snapshot::schema`): entries
//!   dropped, duplicated, swapped, the trace reversed, actions made unknown, sizes and
//!   addresses made huge, negative, of the wrong type or equal to another entry's (overlaps,
//!   double frees), segments moved onto each other;
//! - the raw bytes: bits flipped, bytes cut out, the file truncated.
//!
//! Each goes through `estimate --snapshot` and `diagnose --snapshot`, which exit 0 or 2 (one
//! escaped stderr line), never a panic, within [`BOUND`]. Whether an impossible trace is
//! refused (exit 2) or read is left to `snapshot::` and not asserted here.
//!
//! CI runs `support::fuzz::DEFAULT_CASES` cases on the fixtures under [`SHORT_PASS_BYTES`];
//! `OOMPROBE_FUZZ_CASES=N` (above the default) runs N on all of them (docs/src/testing.md).

use std::path::Path;
use std::sync::OnceLock;
use std::time::Duration;

use proptest::prelude::*;
use serde_pickle::{DeOptions, HashableValue, SerOptions, Value};

use crate::support::fuzz;

/// The fixtures a short pass mutates: the 0.6 and 2 MB ones take 1 to 3 s a run unmutated
/// (12,976 trace entries: 2.8 s and 135 MB, mostly decoding the pickle), too slow for CI.
const SHORT_PASS_BYTES: usize = 256 << 10;

/// A run's bound: the 2 MB fixtures take 3 s alone on an idle machine.
const BOUND: Duration = Duration::from_secs(15);

/// The snapshot fixtures: name, bytes, and the pickle value.
struct Fixture {
    name: String,
    bytes: Vec<u8>,
    value: Value,
}

fn fixtures() -> &'static [Fixture] {
    static F: OnceLock<Vec<Fixture>> = OnceLock::new();
    F.get_or_init(|| {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/snapshots");
        let mut out = Vec::new();
        for dir in ["real", "variants"] {
            let mut files: Vec<_> = std::fs::read_dir(root.join(dir))
                .unwrap()
                .map(|e| e.unwrap().path())
                .filter(|p| p.extension().is_some_and(|e| e == "pickle"))
                .collect();
            files.sort();
            for p in files {
                let bytes = std::fs::read(&p).unwrap();
                let value = serde_pickle::value_from_slice(&bytes, DeOptions::new())
                    .unwrap_or_else(|e| panic!("{}: {e}", p.display()));
                out.push(Fixture {
                    name: format!("{dir}/{}", p.file_name().unwrap().to_string_lossy()),
                    bytes,
                    value,
                });
            }
        }
        assert!(
            out.len() >= 10,
            "the snapshot fixtures are in {}",
            root.display()
        );
        out
    })
}

/// The fixtures this pass mutates.
fn pool() -> Vec<&'static Fixture> {
    let long = fuzz::long_pass();
    fixtures()
        .iter()
        .filter(|f| long || f.bytes.len() < SHORT_PASS_BYTES)
        .collect()
}

/// One change to a snapshot's trace or segments. Indices are taken modulo the list's length.
#[derive(Debug, Clone)]
enum Mutation {
    Drop(usize),
    Duplicate(usize),
    Swap(usize, usize),
    Reverse,
    Action(usize, &'static str),
    Field(usize, &'static str, Value),
    /// Entry a gets entry b's address (an overlap, or a free of another's block).
    SameAddr(usize, usize),
    /// Segment a moves onto segment b's address.
    SegmentOnto(usize, usize),
    SegmentSize(usize, Value),
}

/// 4·2⁶⁴, a Python int no u64 holds (pickle's LONG1 of 9 bytes, little-endian).
fn past_u64() -> Value {
    serde_pickle::value_from_slice(
        &[0x80, 2, 0x8a, 9, 0, 0, 0, 0, 0, 0, 0, 0, 4, b'.'],
        DeOptions::new(),
    )
    .unwrap()
}

fn odd_number() -> impl Strategy<Value = Value> {
    prop_oneof![
        prop::sample::select(vec![
            0i64,
            1,
            -1,
            511,
            512,
            1 << 20,
            1 << 40,
            1 << 47,
            1 << 48,
            1 << 62,
            i64::MAX,
            i64::MIN,
        ])
        .prop_map(Value::I64),
        any::<i64>().prop_map(Value::I64),
        Just(past_u64()),
        Just(Value::F64(1e30)),
        Just(Value::F64(f64::NAN)),
        Just(Value::String("12".into())),
        Just(Value::None),
    ]
}

fn mutation() -> impl Strategy<Value = Mutation> {
    let i = || any::<usize>();
    prop_oneof![
        3 => i().prop_map(Mutation::Drop),
        2 => i().prop_map(Mutation::Duplicate),
        2 => (i(), i()).prop_map(|(a, b)| Mutation::Swap(a, b)),
        1 => Just(Mutation::Reverse),
        2 => (i(), prop::sample::select(vec![
            "alloc", "free_requested", "free_completed", "segment_alloc", "segment_free",
            "segment_map", "segment_unmap", "oom", "snapshot", "annotate", "bogus", "",
            "ALLOC", "\u{1b}[31malloc",
        ])).prop_map(|(a, s)| Mutation::Action(a, s)),
        2 => (i(), prop::sample::select(vec!["size", "addr", "stream", "device_free", "time_us"]),
              odd_number()).prop_map(|(a, f, v)| Mutation::Field(a, f, v)),
        2 => (i(), i()).prop_map(|(a, b)| Mutation::SameAddr(a, b)),
        1 => (i(), i()).prop_map(|(a, b)| Mutation::SegmentOnto(a, b)),
        1 => (i(), odd_number()).prop_map(|(a, v)| Mutation::SegmentSize(a, v)),
    ]
}

fn key(k: &str) -> HashableValue {
    HashableValue::String(k.into())
}

/// The dict's list under `k`, if it has one.
fn list_mut<'a>(v: &'a mut Value, k: &str) -> Option<&'a mut Vec<Value>> {
    match v {
        Value::Dict(d) => match d.get_mut(&key(k)) {
            Some(Value::List(l)) => Some(l),
            _ => None,
        },
        _ => None,
    }
}

fn field_mut<'a>(entry: &'a mut Value, k: &str) -> Option<&'a mut Value> {
    match entry {
        Value::Dict(d) => Some(d.entry(key(k)).or_insert(Value::None)),
        _ => None,
    }
}

fn field(entry: &Value, k: &str) -> Option<Value> {
    match entry {
        Value::Dict(d) => d.get(&key(k)).cloned(),
        _ => None,
    }
}

/// The longest device trace: the one mutated.
fn trace_mut(snap: &mut Value) -> Option<&mut Vec<Value>> {
    let traces = list_mut(snap, "device_traces")?;
    let t = traces
        .iter_mut()
        .filter_map(|t| match t {
            Value::List(l) => Some(l),
            _ => None,
        })
        .max_by_key(|l| l.len())?;
    (!t.is_empty()).then_some(t)
}

fn apply(snap: &mut Value, m: &Mutation) {
    if let Mutation::SegmentOnto(a, _) | Mutation::SegmentSize(a, _) = m {
        let Some(segs) = list_mut(snap, "segments").filter(|s| !s.is_empty()) else {
            return;
        };
        let n = segs.len();
        match m {
            Mutation::SegmentOnto(a, b) => {
                let addr = field(&segs[b % n], "address");
                if let (Some(addr), Some(f)) = (addr, field_mut(&mut segs[a % n], "address")) {
                    *f = addr;
                }
            }
            Mutation::SegmentSize(_, v) => {
                if let Some(f) = field_mut(&mut segs[a % n], "total_size") {
                    *f = v.clone();
                }
            }
            _ => unreachable!(),
        }
        return;
    }
    let Some(t) = trace_mut(snap) else { return };
    let n = t.len();
    match m {
        Mutation::Drop(a) => {
            t.remove(a % n);
        }
        Mutation::Duplicate(a) => {
            let e = t[a % n].clone();
            t.insert(a % n, e);
        }
        Mutation::Swap(a, b) => t.swap(a % n, b % n),
        Mutation::Reverse => t.reverse(),
        Mutation::Action(a, s) => {
            if let Some(f) = field_mut(&mut t[a % n], "action") {
                *f = Value::String(s.to_string());
            }
        }
        Mutation::Field(a, k, v) => {
            if let Some(f) = field_mut(&mut t[a % n], k) {
                *f = v.clone();
            }
        }
        Mutation::SameAddr(a, b) => {
            if let Some(addr) = field(&t[b % n], "addr") {
                if let Some(f) = field_mut(&mut t[a % n], "addr") {
                    *f = addr;
                }
            }
        }
        Mutation::SegmentOnto(..) | Mutation::SegmentSize(..) => unreachable!(),
    }
}

/// Runs both commands that replay a snapshot on `bytes`, `estimate` at either granularity.
fn replay_both(name: &str, what: &str, bytes: &[u8], blocks: bool) -> Result<(), String> {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("fuzz.pickle");
    std::fs::write(&p, bytes).unwrap();
    let f = p.to_str().unwrap();
    let granularity = if blocks { "blocks" } else { "segments" };
    for args in [
        vec!["estimate", "--snapshot", f, "--granularity", granularity],
        vec!["diagnose", "--snapshot", f, "--memory", "24GiB"],
    ] {
        fuzz::run_within(BOUND, &args, &[], b"")
            .map_err(|why| format!("{name} {what}: {args:?}: {why}"))?;
    }
    Ok(())
}

proptest! {
    #![proptest_config(fuzz::config())]

    #[test]
    fn any_mutated_trace_replays_or_is_refused_cleanly(
        which in any::<prop::sample::Index>(),
        muts in prop::collection::vec(mutation(), 1..6),
        blocks in any::<bool>(),
    ) {
        let pool = pool();
        let fx = pool[which.index(pool.len())];
        let mut snap = fx.value.clone();
        for m in &muts {
            apply(&mut snap, m);
        }
        let bytes = serde_pickle::value_to_vec(&snap, SerOptions::new()).unwrap();
        if let Err(why) = replay_both(&fx.name, &format!("{muts:?}"), &bytes, blocks) {
            prop_assert!(false, "{}", why);
        }
    }

    #[test]
    fn any_damaged_pickle_is_read_or_refused_cleanly(
        which in any::<prop::sample::Index>(),
        flips in prop::collection::vec((any::<prop::sample::Index>(), 0u8..8), 0..8),
        hole in prop::option::of((any::<prop::sample::Index>(), 1usize..64)),
        cut in prop::option::of(any::<prop::sample::Index>()),
        blocks in any::<bool>(),
    ) {
        let pool = pool();
        let fx = pool[which.index(pool.len())];
        let mut bytes = fx.bytes.clone();
        for (at, bit) in &flips {
            let i = at.index(bytes.len());
            bytes[i] ^= 1 << bit;
        }
        if let Some((at, len)) = hole {
            let i = at.index(bytes.len());
            bytes.drain(i..(i + len).min(bytes.len()));
        }
        if let Some(at) = cut {
            bytes.truncate(at.index(bytes.len()));
        }
        let what = format!("flips {flips:?} hole {hole:?} cut {cut:?}");
        if let Err(why) = replay_both(&fx.name, &what, &bytes, blocks) {
            prop_assert!(false, "{}", why);
        }
    }
}

/// The mutations reach the trace: a fixture's value written back unchanged replays as the file
/// does, and one with its trace reversed differs from it.
#[test]
fn a_rewritten_fixture_replays_as_the_file_and_a_mutation_changes_it() {
    let fx = fixtures()
        .iter()
        .find(|f| f.name == "real/torch26-small-trace.pickle")
        .expect("fixture");
    // One path for every run: the JSON names the file.
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("s.pickle");
    let estimate = |bytes: &[u8]| {
        std::fs::write(&p, bytes).unwrap();
        fuzz::run(
            &["estimate", "--snapshot", p.to_str().unwrap(), "--json"],
            &[],
            b"",
        )
        .unwrap_or_else(|why| panic!("{why}"))
    };
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    let file = estimate(&fx.bytes);
    assert_eq!(file.code, 0, "{}", file.stderr);
    let same = estimate(&serde_pickle::value_to_vec(&fx.value, SerOptions::new()).unwrap());
    assert_eq!(
        text(&same.stdout),
        text(&file.stdout),
        "a round trip through Value changed the replay"
    );
    let mut rev = fx.value.clone();
    apply(&mut rev, &Mutation::Reverse);
    let rev = estimate(&serde_pickle::value_to_vec(&rev, SerOptions::new()).unwrap());
    assert!(
        rev.code == 2 || rev.stdout != file.stdout,
        "a reversed trace replayed exactly as the file"
    );
    eprintln!("snapshot fuzz: slowest run so far {:?}", fuzz::slowest());
}

/// A snapshot's strings (frame names and files, unknown actions) reach stdout escaped, so a
/// snapshot from elsewhere cannot send a terminal escape sequences (found by this fuzzer: they
/// were printed raw; `snapshot::schema` escapes a frame's strings as it reads them, the trace's
/// notes the actions they quote).
#[test]
fn a_snapshots_strings_reach_stdout_escaped() {
    let fx = fixtures()
        .iter()
        .find(|f| f.name == "real/torch26-small-trace.pickle")
        .expect("fixture");
    let mut snap = fx.value.clone();
    let Some(t) = trace_mut(&mut snap) else {
        panic!("no trace")
    };
    for e in t.iter_mut() {
        if let Some(Value::List(frames)) = field_mut(e, "frames") {
            for f in frames {
                if let Some(name) = field_mut(f, "filename") {
                    *name = Value::String("evil\u{1b}]0;pwn\u{7}.py".into());
                }
            }
        }
    }
    apply(&mut snap, &Mutation::Action(0, "\u{1b}[31malloc"));
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("evil.pickle");
    std::fs::write(
        &p,
        serde_pickle::value_to_vec(&snap, SerOptions::new()).unwrap(),
    )
    .unwrap();
    let f = p.to_str().unwrap();
    for args in [
        vec!["estimate", "--snapshot", f],
        vec!["diagnose", "--snapshot", f, "--memory", "1GiB"],
    ] {
        let r = fuzz::run(&args, &[], b"").unwrap_or_else(|why| panic!("{why}"));
        assert_eq!(fuzz::raw_control(&r.stdout), None, "{args:?}");
    }
}
