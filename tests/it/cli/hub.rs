//! `--model ORG/NAME` from a local Hugging Face cache (a fake one in a temporary folder, laid
//! out as `huggingface_hub` writes it), offline; a folder holding a config.json; and what
//! estimate and diagnose judge against when no `--memory` is given.

use std::path::Path;

use assert_cmd::Command;

use crate::support::output::workload_line;

fn oomprobe(hf_home: &Path) -> Command {
    let mut c = Command::cargo_bin("oomprobe").unwrap();
    c.env_remove("HF_HUB_CACHE")
        .env_remove("HUGGINGFACE_HUB_CACHE")
        .env("HF_HOME", hf_home);
    c
}

/// A cache holding Qwen/Qwen2.5-7B at two commits, `refs/main` naming the older.
fn fake_cache() -> tempfile::TempDir {
    let d = tempfile::tempdir().unwrap();
    let repo = d.path().join("hub/models--Qwen--Qwen2.5-7B");
    let cfg = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/configs/qwen2.5-7b.json"),
    )
    .unwrap();
    for (commit, layers) in [("aaaa1111", 28), ("bbbb2222", 4)] {
        let snap = repo.join("snapshots").join(commit);
        std::fs::create_dir_all(&snap).unwrap();
        let text = cfg.replace(
            "\"num_hidden_layers\": 28",
            &format!("\"num_hidden_layers\": {layers}"),
        );
        std::fs::write(snap.join("config.json"), text).unwrap();
    }
    std::fs::create_dir_all(repo.join("refs")).unwrap();
    std::fs::write(repo.join("refs/main"), "aaaa1111").unwrap();
    d
}

fn model_line(c: &mut Command) -> String {
    let out = c.assert().success().get_output().stdout.clone();
    workload_line(&String::from_utf8(out).unwrap()).to_string()
}

#[test]
fn a_model_id_reads_the_cached_config_offline() {
    let d = fake_cache();
    let line = model_line(oomprobe(d.path()).args([
        "estimate",
        "--model",
        "Qwen/Qwen2.5-7B",
        "--seq",
        "2048",
    ]));
    assert!(line.starts_with("Qwen/Qwen2.5-7B: 28 layers"), "{line}");
    assert!(
        line.contains("4 key/value heads") && line.contains("seq 2048"),
        "{line}"
    );
    // Another cached revision, by commit prefix.
    let line = model_line(oomprobe(d.path()).args([
        "estimate",
        "--model",
        "Qwen/Qwen2.5-7B",
        "--revision",
        "bbbb2222",
    ]));
    assert!(line.contains(": 4 layers"), "{line}");
    // A folder with a config.json.
    let snap = d
        .path()
        .join("hub/models--Qwen--Qwen2.5-7B/snapshots/bbbb2222");
    let line = model_line(oomprobe(d.path()).args(["estimate", "--model", snap.to_str().unwrap()]));
    assert!(line.contains(": 4 layers"), "{line}");
}

#[test]
fn a_missing_id_says_where_it_looked_and_how_to_fetch_it() {
    let d = fake_cache();
    let out = oomprobe(d.path())
        .args(["estimate", "--model", "meta-llama/Meta-Llama-3-8B"])
        .assert()
        .code(2)
        .get_output()
        .clone();
    let e = String::from_utf8(out.stderr).unwrap();
    assert_eq!(e.trim_end().lines().count(), 1, "{e}");
    assert!(e.contains("models--meta-llama--Meta-Llama-3-8B"), "{e}");
    assert!(
        e.contains("huggingface-cli download meta-llama/Meta-Llama-3-8B config.json"),
        "{e}"
    );
    let out = oomprobe(d.path())
        .args(["estimate", "--model", "Qwen/Qwen2.5-7B", "--revision", "v9"])
        .assert()
        .code(2)
        .get_output()
        .clone();
    let e = String::from_utf8(out.stderr).unwrap();
    assert!(
        e.contains("no revision 'v9'") && e.contains("aaaa1111"),
        "{e}"
    );
    let out = oomprobe(d.path())
        .args(["estimate", "--model", "gpt2", "--revision", "main"])
        .assert()
        .code(2)
        .get_output()
        .clone();
    assert!(String::from_utf8_lossy(&out.stderr).contains("--revision"));
}

#[test]
fn without_memory_a_cpu_adapter_is_never_the_card() {
    // On this machine (lavapipe or no adapter) estimate prints no boundaries and diagnose asks
    // for --memory: a CPU adapter's heap is no card's memory. With a GPU both would say
    // "(detected)".
    let d = tempfile::tempdir().unwrap();
    let out = oomprobe(d.path())
        .args(["estimate", "--model", "tiny-gpt"])
        .assert()
        .success()
        .get_output()
        .stdout
        .clone();
    let text = String::from_utf8(out).unwrap();
    let gpu = workload_line(&text).contains("(detected)");
    assert_eq!(gpu, text.contains("predicted boundaries"), "{text}");
    let cpu_only = Command::cargo_bin("oomprobe")
        .unwrap()
        .args(["devices", "--json"])
        .output()
        .unwrap();
    let devices: serde_json::Value = serde_json::from_slice(&cpu_only.stdout).unwrap_or_default();
    let any_gpu = devices
        .as_array()
        .is_some_and(|a| a.iter().any(|d| d["device_type"] != "cpu"));
    if !any_gpu {
        assert!(!gpu, "{text}");
    }
}
