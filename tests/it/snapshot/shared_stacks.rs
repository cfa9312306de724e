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
