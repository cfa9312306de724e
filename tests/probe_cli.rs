//! `oomprobe probe` end to end on the first wgpu adapter (lavapipe in CI): exact boundaries
//! under --budget checked with --at, a real OOM under an address-space limit, a killed child,
//! results written as they arrive, and bad input.

use assert_cmd::Command;
use serde_json::Value;

const INSTALL_HINT: &str =
    "no GPU adapter: install a driver or lavapipe (apt-get install -y mesa-vulkan-drivers libvulkan1)";

fn oomprobe() -> Command {
    Command::cargo_bin("oomprobe").expect("oomprobe binary")
}

fn require_adapter() {
    let out = oomprobe()
        .args(["devices", "--json"])
        .output()
        .expect("run devices");
    let list: Value = serde_json::from_slice(&out.stdout).unwrap_or(Value::Null);
    assert!(
        list.as_array().is_some_and(|a| !a.is_empty()),
        "{INSTALL_HINT}"
    );
}

fn probe_json(args: &[&str]) -> Value {
    let out = oomprobe()
        .arg("probe")
        .args(args)
        .args(["--json", "--quiet"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "probe {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("probe --json prints JSON")
}

fn only_run(report: &Value) -> &Value {
    let runs = report["runs"].as_array().expect("runs");
    assert_eq!(runs.len(), 1, "{report}");
    &runs[0]
}

#[test]
fn budget_boundary_is_exact_and_each_side_checks_out_with_at() {
    require_adapter();
    let base = [
        "--model",
        "tiny-gpt",
        "--scenario",
        "batch",
        "--budget",
        "48MiB",
    ];
    let report = probe_json(&base);
    assert_eq!(report["budget_bytes"], 48 * 1024 * 1024);
    let run = only_run(&report);
    let max = run["max_fit"].as_u64().expect("something fits in 48 MiB");
    assert!(max > 1, "boundary above 1: {run}");
    assert_eq!(run["first_fail"].as_u64(), Some(max + 1));
    assert_eq!(run["fail_reason"], "budget");
    assert!(run["bytes_at_max_fit"].as_u64().unwrap() <= 48 * 1024 * 1024);
    assert!(run["predicted_max"].as_u64().is_some());
    for p in run["probes"].as_array().unwrap() {
        if p["outcome"] == "fit" {
            let c = p["checksum"].as_str().unwrap_or("");
            assert!(
                c.starts_with("verified "),
                "a fit reads every word back: {p}"
            );
        }
    }

    let at = |x: u64| {
        let mut args = base.to_vec();
        let x = x.to_string();
        args.extend(["--at", x.as_str()]);
        only_run(&probe_json(&args))["probes"][0]["outcome"]
            .as_str()
            .unwrap()
            .to_string()
    };
    assert_eq!(at(max), "fit");
    assert_eq!(at(max + 1), "budget");

    // The failure is placed in the step's timeline: the plan's live bytes before the refused
    // allocation plus its request pass the budget, and the peak (start of backward, the loss
    // gradients) is where tiny-gpt's batch fails.
    let fail = run["probes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["outcome"] == "budget")
        .expect("a refused probe");
    let at = &fail["failed_at"];
    assert_eq!(at["phase"], "backward", "{fail}");
    let live = at["live_bytes"].as_u64().unwrap();
    let req = at["requested_bytes"].as_u64().unwrap();
    assert!(live <= 48 << 20 && live + req > 48 << 20, "{fail}");
    assert!(at["event"].as_u64().unwrap() > 0);
}

#[test]
fn a_real_oom_under_an_address_space_limit_is_a_result() {
    require_adapter();
    if std::process::Command::new("prlimit")
        .arg("--version")
        .output()
        .is_err()
    {
        panic!("prlimit (util-linux) is needed for this test");
    }
    let exe = assert_cmd::cargo::cargo_bin("oomprobe");
    // About 1.1 GiB of address space goes to the process and lavapipe; the rest is for tensors.
    let limit = (1400u64 << 20).to_string();
    let out = std::process::Command::new("prlimit")
        .arg(format!("--as={limit}"))
        .arg("--")
        .arg(&exe)
        .args([
            "probe",
            "--model",
            "tiny-gpt",
            "--scenario",
            "batch",
            "--json",
            "--quiet",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "an OOM must not fail the run: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(
        report["budget_bytes"].is_null(),
        "no cap of oomprobe's own under a limit"
    );
    let run = only_run(&report);
    assert_eq!(run["fail_reason"], "out_of_memory", "{run}");
    let max = run["max_fit"].as_u64().expect("something fits");
    assert_eq!(run["first_fail"].as_u64(), Some(max + 1));
    let probes = run["probes"].as_array().unwrap();
    let oom = probes
        .iter()
        .position(|p| p["outcome"] == "out_of_memory")
        .unwrap();
    assert!(oom + 1 < probes.len(), "probes go on after an OOM");
    assert!(probes.iter().any(|p| p["outcome"] == "fit"));
}

#[test]
fn a_killed_child_is_classified_and_the_search_goes_on() {
    require_adapter();
    let base = [
        "--model",
        "tiny-gpt",
        "--scenario",
        "batch",
        "--budget",
        "24MiB",
    ];
    let predicted = only_run(&probe_json(&[&base[..], &["--at", "1"]].concat()))["predicted_max"]
        .as_u64()
        .expect("a prediction");
    // The search starts at the prediction: that child dies as if the OOM killer struck.
    let out = oomprobe()
        .arg("probe")
        .args(base)
        .args(["--json", "--quiet"])
        .env("OOMPROBE_TEST_KILL_AT", predicted.to_string())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: Value = serde_json::from_slice(&out.stdout).unwrap();
    let run = only_run(&report);
    let probes = run["probes"].as_array().unwrap();
    assert_eq!(probes[0]["value"].as_u64(), Some(predicted));
    assert_eq!(probes[0]["outcome"], "killed", "{run}");
    assert!(probes.len() > 2, "the search went on: {run}");
    assert_eq!(run["max_fit"].as_u64(), Some(predicted - 1));
    assert_eq!(run["fail_reason"], "killed");
}

#[test]
fn out_file_holds_the_results() {
    require_adapter();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("run.json");
    oomprobe()
        .args([
            "probe",
            "--model",
            "tiny-gpt",
            "--scenario",
            "seq",
            "--budget",
            "16MiB",
        ])
        .args(["--quiet", "--out"])
        .arg(&path)
        .assert()
        .success();
    let saved: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    assert_eq!(saved["schema_version"], 1);
    let run = only_run(&saved);
    assert_eq!(run["scenario"], "seq");
    assert!(run["max_fit"].as_u64().unwrap() > 1);
}

#[test]
fn bad_input_exits_2_with_one_line() {
    for args in [
        vec!["probe", "--budget", "0"],
        vec!["probe", "--budget", "12XB"],
        vec!["probe", "--budget", "99999999999TiB"],
        vec!["probe", "--timeout", "-1"],
        vec!["probe", "--model", "nope"],
        vec!["probe", "--scenario", "width"],
        vec!["probe", "--backend", "opencl"],
        vec!["probe", "--device", "999"],
        vec!["probe", "--device", "gpu0"],
        vec!["probe", "--model", "tiny-gpt", "--at", "0"],
        vec!["probe", "--batch", "4"],
        vec!["probe", "--bogus"],
    ] {
        let out = oomprobe().args(&args).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        let lines: Vec<&str> = err
            .lines()
            .filter(|l| !l.contains("XDG_RUNTIME_DIR") && !l.trim().is_empty())
            .collect();
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert_eq!(lines.len(), 1, "{args:?}: one line, got {err}");
        assert!(!err.contains("panicked"), "{args:?}: {err}");
    }
}

#[test]
fn device_all_probes_each_device_and_compares() {
    require_adapter();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("fleet.json");
    oomprobe()
        .args([
            "probe",
            "--backend",
            "vulkan",
            "--device",
            "all",
            "--scenario",
            "params",
        ])
        .args(["--budget", "32MiB", "--quiet", "--out"])
        .arg(&path)
        .assert()
        .success();
    let cmp: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let files = cmp["files"]
        .as_array()
        .expect("a comparison with one file per device");
    assert!(!files.is_empty(), "{cmp}");
    let cell = &cmp["rows"][0]["cells"][0];
    assert!(cell["max_fit"].as_u64().is_some_and(|m| m > 1), "{cmp}");
}

/// A probe on a CPU adapter while an NVIDIA driver is present (forced: no GPU in CI) and wgpu
/// offers nothing else says so in its report, on every run; without the driver it does not.
#[test]
fn a_probe_on_the_cpu_under_an_nvidia_driver_says_so() {
    require_adapter();
    let notes = |driver: &str| -> Vec<String> {
        let out = oomprobe()
            .env("OOMPROBE_NVIDIA_DRIVER", driver)
            .args([
                "probe",
                "--model",
                "tiny-gpt",
                "--scenario",
                "batch",
                "--budget",
                "48MiB",
                "--at",
                "1",
                "--json",
                "--quiet",
            ])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let report: Value = serde_json::from_slice(&out.stdout).expect("JSON");
        assert!(report["device"].get("overhead_bytes").is_some(), "{report}");
        if report["device"]["device_type"] != "cpu" {
            return vec!["not a CPU adapter".into()];
        }
        only_run(&report)["notes"]
            .as_array()
            .expect("notes")
            .iter()
            .map(|n| n.as_str().unwrap_or("").to_string())
            .collect()
    };
    let with = notes("present");
    if with == ["not a CPU adapter"] {
        eprintln!("the default adapter is a GPU: the CPU note does not apply");
        return;
    }
    assert!(
        with.iter().any(|n| n.contains("NVIDIA Vulkan ICD")),
        "{with:?}"
    );
    assert!(
        !notes("absent").iter().any(|n| n.contains("NVIDIA")),
        "no driver, no note"
    );
}
