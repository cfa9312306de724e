//! Every case file in `cases/` parses, names its card's memory, and `estimate` / `diagnose`
//! (through the library API) give each expectation's verdict and cause.

use std::path::{Path, PathBuf};

use oomprobe::diagnose::diagnose;
use oomprobe::estimate::breakdown;
use oomprobe::plan::Plan;
use oomprobe::resolve::{load_config, LoadedConfig};
use oomprobe::workload::case::{CaseFile, Verdict};

fn case_paths() -> Vec<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("cases");
    let mut v: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("cannot list {}: {e}", dir.display()))
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "toml"))
        .collect();
    v.sort();
    v
}

fn load(path: &Path) -> CaseFile {
    match load_config(path) {
        Ok(LoadedConfig::Case(c)) => *c,
        Ok(LoadedConfig::Hf(_)) => panic!("{} read as a config.json", path.display()),
        Err(e) => panic!("{e}"),
    }
}

#[test]
fn every_seed_anecdote_has_a_case() {
    let names: Vec<String> = case_paths()
        .iter()
        .map(|p| load(p).workload.name.clone() + " | " + &load(p).name)
        .collect();
    let has = |needle: &str| names.iter().any(|n| n.to_lowercase().contains(needle));
    assert!(has("llama-13b"), "{names:?}");
    assert!(has("vit-l"), "{names:?}");
    assert!(has("seq 8192"), "{names:?}");
    assert!(has("checkpointing"), "{names:?}");
}

#[test]
fn every_case_gives_its_expected_verdicts() {
    let paths = case_paths();
    assert!(paths.len() >= 4, "expected the seed's cases in cases/");
    let mut checked = 0;
    for path in &paths {
        let case = load(path);
        let file = path.display();
        let memory = case
            .memory
            .unwrap_or_else(|| panic!("{file}: names no card memory"));
        assert!(
            case.expects.iter().any(|e| e.verdict == Verdict::Oom),
            "{file}: a seed case should reproduce an OOM"
        );
        for (i, e) in case.expects.iter().enumerate() {
            let w = case
                .workload_for(i)
                .unwrap_or_else(|err| panic!("{file} expect[{i}]: {err}"));
            let plan = Plan::for_workload(&w).unwrap_or_else(|err| panic!("{file}: {err}"));
            let b = breakdown(&plan);
            let verdict = if b.total <= memory {
                Verdict::Fits
            } else {
                Verdict::Oom
            };
            assert_eq!(
                verdict, e.verdict,
                "{file} expect[{i}]: estimate total {} bytes against {} bytes",
                b.total, memory
            );
            let d = diagnose(&w, memory).unwrap_or_else(|err| panic!("{file}: {err}"));
            assert_eq!(d.breakdown.total, b.total);
            // diagnose's cause agrees with the verdict ...
            assert_eq!(
                d.cause.name() == "fits",
                e.verdict == Verdict::Fits,
                "{file} expect[{i}]: cause {} ({})",
                d.cause.name(),
                d.reason
            );
            // ... and with the cause the case names.
            if let Some(c) = &e.cause {
                assert_eq!(d.cause.name(), c, "{file} expect[{i}]: {}", d.reason);
            }
            checked += 1;
        }
    }
    assert!(checked >= 8, "only {checked} expectations checked");
}
