//! Every integration test is compiled: with `autotests = false` a new `tests/*.rs` file, or a
//! file in `tests/it/` that `main.rs` does not name, would never run and nothing would say so.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

fn it_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/it")
}

/// The files the module tree of `main.rs` (and `support/mod.rs`) declares, relative to
/// `tests/it`. `main.rs` is written one `mod` per line: `mod a {` opens a folder, `}` closes it.
fn declared() -> BTreeSet<String> {
    let mut files = BTreeSet::from(["main.rs".to_string()]);
    let mut stack: Vec<String> = Vec::new();
    let main = std::fs::read_to_string(it_dir().join("main.rs")).unwrap();
    for line in main.lines().map(str::trim) {
        if let Some(name) = line.strip_prefix("mod ").and_then(|l| l.strip_suffix(" {")) {
            stack.push(name.to_string());
        } else if line == "}" {
            stack.pop();
        } else if let Some(name) = line.strip_prefix("mod ").and_then(|l| l.strip_suffix(';')) {
            let mut path = stack.clone();
            path.push(name.to_string());
            let path = path.join("/");
            if it_dir().join(&path).join("mod.rs").is_file() {
                files.insert(format!("{path}/mod.rs"));
            } else {
                files.insert(format!("{path}.rs"));
            }
        }
    }
    let support = std::fs::read_to_string(it_dir().join("support/mod.rs")).unwrap();
    for line in support.lines() {
        if let Some(name) = line
            .strip_prefix("pub mod ")
            .and_then(|l| l.strip_suffix(';'))
        {
            files.insert(format!("support/{name}.rs"));
        }
    }
    files
}

fn on_disk(dir: &Path, base: &Path, out: &mut BTreeSet<String>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            on_disk(&path, base, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            let rel = path
                .strip_prefix(base)
                .unwrap()
                .to_string_lossy()
                .into_owned();
            out.insert(rel);
        }
    }
}

#[test]
fn every_test_file_is_in_the_one_test_binary() {
    let tests = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests");
    let stray: Vec<_> = std::fs::read_dir(&tests)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "rs"))
        .collect();
    assert!(
        stray.is_empty(),
        "{stray:?}: integration tests go in tests/it/ (see its main.rs), or they never run"
    );
    let mut files = BTreeSet::new();
    on_disk(&it_dir(), &it_dir(), &mut files);
    let declared = declared();
    let missing: Vec<_> = files.difference(&declared).collect();
    assert!(
        missing.is_empty(),
        "not in tests/it/main.rs's module tree, so never compiled: {missing:?}"
    );
    let absent: Vec<_> = declared.difference(&files).collect();
    assert!(absent.is_empty(), "declared but not found: {absent:?}");
}
