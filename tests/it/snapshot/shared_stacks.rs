//! Snapshots share their stacks: a trace entry's frames are one copy per distinct stack
//! (`schema::Stack`), and the vendored serde-pickle walks memoized objects by reference while
//! still refusing a recursive structure (vendor/serde-pickle/PATCHED.md).

use std::collections::HashSet;
use std::path::Path;

use oomprobe::snapshot::read;
use oomprobe::snapshot::schema::Frame;

#[test]
fn equal_stacks_are_one_copy() {
    let p = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/snapshots/real/cs336-niu-fwdbwd-200-mixed.pickle");
    let snap = read::read_file(&p).unwrap();
    let entries = &snap.device_traces[0];
    let contents: HashSet<&[Frame]> = entries.iter().map(|e| &e.frames[..]).collect();
    let copies: HashSet<*const Frame> = entries.iter().map(|e| e.frames.as_ptr()).collect();
    // 12,976 entries; fewer distinct stacks; exactly one copy of each.
    assert!(
        contents.len() < entries.len() / 2,
        "{} stacks",
        contents.len()
    );
    assert_eq!(copies.len(), contents.len());
}

#[test]
fn a_recursive_pickle_is_still_refused() {
    // PROTO 2, EMPTY_LIST, BINPUT 0, BINGET 0, APPEND, STOP: `l = []; l.append(l)`.
    let bytes = b"\x80\x02]q\x00h\x00a.";
    let e = serde_pickle::from_slice::<serde_pickle::Value>(bytes, Default::default()).unwrap_err();
    assert!(e.to_string().contains("recursive"), "{e}");
    let e = read::read_bytes(bytes).unwrap_err();
    assert!(e.to_string().contains("recursive"), "{e}");
}

#[test]
fn a_memoized_value_used_many_times_is_read_each_time() {
    // [s, s, s] with s = "abc" memoized once: PROTO 2, MARK... via EMPTY_LIST + APPENDS.
    let bytes = b"\x80\x02]q\x00(X\x03\x00\x00\x00abcq\x01h\x01h\x01e.";
    let v: Vec<String> = serde_pickle::from_slice(bytes, Default::default()).unwrap();
    assert_eq!(v, ["abc", "abc", "abc"]);
}

/// Each trace entry is typed as the pickle appends it (serde-pickle's `take_list_items`,
/// PATCHED.md change 5): what is read must be what a plain read of the whole file gives.
#[test]
fn trace_entries_taken_while_parsing_read_as_a_plain_read() {
    use oomprobe::snapshot::schema::{interning, take_trace_entry, Snapshot};
    use serde_pickle::DeOptions;
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/snapshots/real");
    let mut read_some = 0;
    for f in std::fs::read_dir(dir).unwrap() {
        let p = f.unwrap().path();
        if p.extension().is_none_or(|e| e != "pickle") {
            continue;
        }
        let bytes = std::fs::read(&p).unwrap();
        let read = |o: DeOptions| interning(|| serde_pickle::from_slice::<Snapshot>(&bytes, o));
        let Ok(plain) = read(DeOptions::new()) else {
            continue; // a bare segment list: no traces
        };
        let taken = read(DeOptions::new().take_list_items(take_trace_entry)).unwrap();
        assert!(taken == plain, "{}: read differently", p.display());
        read_some += plain.device_traces.iter().map(Vec::len).sum::<usize>();
    }
    assert!(read_some > 10_000, "{read_some} trace entries compared");
}

#[test]
fn a_trace_with_an_item_that_is_not_an_entry_is_refused() {
    // {'segments': [], 'device_traces': [[{'action': 'alloc', 'addr': 4096, 'size': 512}, 5]]},
    // pickled by Python at protocol 2.
    let bad: &[u8] = b"\x80\x02}q\x00(X\x08\x00\x00\x00segmentsq\x01]q\x02X\r\x00\x00\x00\
device_tracesq\x03]q\x04]q\x05(}q\x06(X\x06\x00\x00\x00actionq\x07X\x05\x00\x00\x00allocq\x08\
X\x04\x00\x00\x00addrq\tM\x00\x10X\x04\x00\x00\x00sizeq\nM\x00\x02uK\x05eau.";
    assert!(read::read_bytes(bad).is_err());
    // The same with a second entry (whose keys are memo references into the first, taken one).
    let good: &[u8] = b"\x80\x02}q\x00(X\x08\x00\x00\x00segmentsq\x01]q\x02X\r\x00\x00\x00\
device_tracesq\x03]q\x04]q\x05(}q\x06(X\x06\x00\x00\x00actionq\x07X\x05\x00\x00\x00allocq\x08\
X\x04\x00\x00\x00addrq\tM\x00\x10X\x04\x00\x00\x00sizeq\nM\x00\x02u}q\x0b(h\x07X\x0e\x00\x00\x00\
free_completedq\x0ch\tM\x00\x10h\nM\x00\x02ueau.";
    let snap = read::read_bytes(good).unwrap();
    let t = &snap.device_traces[0];
    assert_eq!(t.len(), 2);
    assert_eq!(
        (t[0].action.as_str(), t[0].addr, t[0].size),
        ("alloc", Some(4096), 512)
    );
    assert_eq!(t[1].action.as_str(), "free_completed");
}
