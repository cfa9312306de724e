//! `oomprobe probe` end to end on the first wgpu adapter (lavapipe in CI): exact boundaries
//! under --budget checked with --at, a real OOM under an address-space limit, a killed child,
//! results written as they arrive, and bad input.

use serde_json::Value;

use crate::support::adapter::{self, oomprobe, require_adapter};

fn probe_json(args: &[&str]) -> Value {
    let mut all = vec!["probe"];
    all.extend(args);
    adapter::json_of(&all)
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
fn the_measuring_search_finds_each_budget_boundary_in_a_few_probes() {
    require_adapter();
    for (scenario, budget) in [("batch", "40MiB"), ("seq", "24MiB"), ("params", "48MiB")] {
        let base = [
            "--model",
            "tiny-gpt",
            "--scenario",
            scenario,
            "--budget",
            budget,
        ];
        let report = probe_json(&base);
        let run = only_run(&report);
        let probes = run["probes"].as_array().unwrap();
        assert!(
            probes.len() <= 6,
            "{scenario}: {} probes: {run}",
            probes.len()
        );
        let max = run["max_fit"].as_u64().expect("something fits");
        let first_fail = run["first_fail"].as_u64().expect("a failure");
        let step = if scenario == "params" { 1 << 16 } else { 1 };
        assert_eq!(first_fail, max + step, "{scenario}: {run}");
        assert_eq!(run["fail_reason"], "budget", "{scenario}: {run}");
        // The measured capacity lies within the budget and above what fit; the device's own
        // overhead is the budget minus it (oomprobe's verify buffers count against the budget).
        let budget_bytes = report["budget_bytes"].as_u64().unwrap();
        let measured = run["measured_capacity_bytes"].as_u64().expect("measured");
        assert!(measured <= budget_bytes, "{scenario}: {run}");
        assert!(
            measured >= run["bytes_at_max_fit"].as_u64().unwrap(),
            "{run}"
        );
        assert_eq!(
            run["device_overhead_bytes"].as_i64(),
            Some(budget_bytes as i64 - measured as i64),
            "{run}"
        );
        // The fit next to the boundary measured its room with filler at its peak.
        let room = probes
            .iter()
            .filter(|p| p["outcome"] == "fit")
            .find_map(|p| p.get("room"))
            .unwrap_or_else(|| panic!("{scenario}: a fit measured its room: {run}"));
        assert!(
            room["live_bytes"].as_u64().unwrap() + room["room_bytes"].as_u64().unwrap()
                <= budget_bytes
        );
        // The plain search agrees on the boundary, and each side checks out with --at.
        let mut gallop = base.to_vec();
        gallop.extend(["--search", "gallop"]);
        let plain = probe_json(&gallop);
        assert_eq!(
            only_run(&plain)["max_fit"].as_u64(),
            Some(max),
            "{scenario}: {plain}"
        );
        for (x, want) in [(max, "fit"), (first_fail, "budget")] {
            let mut args = base.to_vec();
            let x = x.to_string();
            args.extend(["--at", x.as_str()]);
            let at = probe_json(&args);
            assert_eq!(
                only_run(&at)["probes"][0]["outcome"],
                want,
                "{scenario} at {x}: {at}"
            );
        }
    }
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
    // At the edge lavapipe sometimes dies inside the driver instead of refusing the allocation
    // (a `crashed` result, retried once); the boundary is exact either way.
    assert!(
        run["fail_reason"] == "out_of_memory" || run["fail_reason"] == "crashed",
        "{run}"
    );
    let max = run["max_fit"].as_u64().expect("something fits");
    assert_eq!(run["first_fail"].as_u64(), Some(max + 1));
    let probes = run["probes"].as_array().unwrap();
    let oom = probes
        .iter()
        .position(|p| p["outcome"] == "out_of_memory")
        .expect("the driver refused an allocation at least once");
    // An OOM does not end the search: probes go on after it, or it is the boundary's failure.
    assert!(
        oom + 1 < probes.len() || probes[oom]["value"].as_u64() == Some(max + 1),
        "probes go on after an OOM: {run}"
    );
    assert!(probes.iter().any(|p| p["outcome"] == "fit"));
}

const TINY_BATCH: [&str; 6] = [
    "--model",
    "tiny-gpt",
    "--scenario",
    "batch",
    "--budget",
    "24MiB",
];

/// The probe values of an undisturbed search of `TINY_BATCH`, and its boundary.
fn undisturbed() -> (Vec<u64>, u64) {
    let report = probe_json(&TINY_BATCH);
    let run = only_run(&report);
    let values = run["probes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["value"].as_u64().unwrap())
        .collect();
    (values, run["max_fit"].as_u64().expect("a boundary"))
}

/// `probe TINY_BATCH --json` with one test hook set; exit code and report.
fn hooked(hook: &str, at: u64, extra: &[&str]) -> (Option<i32>, Value, String) {
    let out = oomprobe()
        .arg("probe")
        .args(TINY_BATCH)
        .args(extra)
        .args(["--json", "--quiet"])
        .env(hook, at.to_string())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    let report = serde_json::from_slice(&out.stdout).unwrap_or(Value::Null);
    (out.status.code(), report, err)
}

#[test]
fn a_killed_child_is_retried_and_never_moves_the_boundary() {
    require_adapter();
    let (_, boundary) = undisturbed();
    let probes_at = |run: &Value, x: u64| -> Vec<String> {
        run["probes"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|p| p["value"].as_u64() == Some(x))
            .map(|p| p["outcome"].as_str().unwrap().to_string())
            .collect()
    };
    for hook in ["OOMPROBE_TEST_KILL_AT", "OOMPROBE_TEST_TERM_AT"] {
        // Killed every time just above the boundary (as if the OOM killer struck there): the
        // search steps over it, and the boundary and its reason are the real ones.
        let (code, report, err) = hooked(hook, boundary + 1, &[]);
        assert_eq!(code, Some(0), "{hook}: {err}");
        let run = only_run(&report);
        let killed = probes_at(run, boundary + 1);
        assert!(
            killed.len() >= 2 && killed.iter().all(|o| o == "killed"),
            "{hook}: retried once: {run}"
        );
        assert_eq!(run["max_fit"].as_u64(), Some(boundary), "{hook}: {run}");
        assert_eq!(run["fail_reason"], "budget", "{hook}: {run}");
        // Killed every time at the boundary itself: that value stays unknown (a note says so),
        // it is not a failure: the first failure and its reason are still the real ones.
        let (code, report, err) = hooked(hook, boundary, &[]);
        assert_eq!(code, Some(0), "{hook}: {err}");
        let run = only_run(&report);
        assert_eq!(run["max_fit"].as_u64(), Some(boundary - 1), "{hook}: {run}");
        assert_eq!(
            run["first_fail"].as_u64(),
            Some(boundary + 1),
            "{hook}: {run}"
        );
        assert_eq!(run["fail_reason"], "budget", "{hook}: {run}");
        let notes = run["notes"].to_string();
        assert!(
            notes.contains(&format!("no answer at batch={boundary}")),
            "{notes}"
        );
    }
}

#[test]
fn a_crashing_or_panicking_child_is_crashed_with_its_cause() {
    require_adapter();
    let (_, boundary) = undisturbed();
    for (hook, cause) in [
        ("OOMPROBE_TEST_CRASH_AT", "memory allocation of"),
        ("OOMPROBE_TEST_PANIC_AT", "test hook: panic at"),
    ] {
        // Dies at the boundary on every try: counts as not fitting, the run still exits 0.
        let (code, report, err) = hooked(hook, boundary, &[]);
        assert_eq!(code, Some(0), "{hook}: {err}");
        let run = only_run(&report);
        assert_eq!(run["max_fit"].as_u64(), Some(boundary - 1), "{hook}: {run}");
        assert_eq!(run["fail_reason"], "crashed", "{hook}: {run}");
        let at: Vec<&Value> = run["probes"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|p| p["value"].as_u64() == Some(boundary))
            .collect();
        assert!(at.len() >= 2, "retried once: {run}");
        for p in at {
            assert_eq!(p["outcome"], "crashed");
            let detail = p["detail"].as_str().unwrap_or("");
            assert!(detail.contains(cause), "{hook}: {detail}");
            assert!(!detail.contains("XDG_RUNTIME_DIR"), "{detail}");
        }
        // One probe with --at: the same outcome, retried once.
        let (code, report, err) = hooked(hook, boundary, &["--at", &boundary.to_string()]);
        assert_eq!(code, Some(0), "{hook}: {err}");
        let run = only_run(&report);
        assert_eq!(run["fail_reason"], "crashed", "{run}");
        assert_eq!(run["probes"].as_array().unwrap().len(), 2, "{run}");
    }
    let (_, report, _) = hooked("OOMPROBE_TEST_CRASH_AT", boundary, &[]);
    let run = only_run(&report);
    let p = run["probes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["outcome"] == "crashed")
        .unwrap();
    assert!(p["detail"].as_str().unwrap().contains("SIGABRT"), "{p}");
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

/// Processes whose parent is `pid` (Linux /proc).
#[cfg(target_os = "linux")]
fn children_of(pid: u32) -> Vec<u32> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(child) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
            continue;
        };
        // pid (comm) state ppid ...
        let after = &stat[stat.rfind(')').map_or(0, |i| i + 1)..];
        let ppid = after
            .split_whitespace()
            .nth(1)
            .and_then(|p| p.parse::<u32>().ok());
        if ppid == Some(pid) {
            out.push(child);
        }
    }
    out
}

/// True once `pid` is gone (or a zombie no one reaps).
#[cfg(target_os = "linux")]
fn is_gone(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        Ok(stat) => {
            let after = &stat[stat.rfind(')').map_or(0, |i| i + 1)..];
            after.split_whitespace().next() == Some("Z")
        }
    }
}

#[cfg(target_os = "linux")]
#[test]
fn killing_the_parent_leaves_no_orphan_and_keeps_the_finished_probes() {
    use std::time::{Duration, Instant};
    require_adapter();
    /// Kills the parent if the test fails half way.
    struct Reap(std::process::Child);
    impl Drop for Reap {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let (values, _) = undisturbed();
    // The first probe at a value not seen before hangs; the probes before it are finished.
    let done = (1..values.len())
        .find(|&i| !values[..i].contains(&values[i]))
        .expect("a search probes more than one value");
    let hang = values[done];
    for sig in [libc::SIGKILL, libc::SIGTERM, libc::SIGINT] {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("run.json");
        let mut cmd = std::process::Command::new(assert_cmd::cargo::cargo_bin("oomprobe"));
        cmd.arg("probe")
            .args(TINY_BATCH)
            .args(["--quiet", "--timeout", "600", "--out"])
            .arg(&path)
            .env("OOMPROBE_TEST_HANG_AT", hang.to_string())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null());
        // A suite started in the background from a non-interactive shell inherits SIGINT
        // ignored, and the parent would wait out its hung child: give it the default, as a
        // terminal's ^C finds it.
        // SAFETY: signal(2) is async-signal-safe, the only call between fork and exec.
        unsafe {
            std::os::unix::process::CommandExt::pre_exec(&mut cmd, || {
                libc::signal(libc::SIGINT, libc::SIG_DFL);
                Ok(())
            });
        }
        let parent = cmd.spawn().unwrap();
        let mut parent = Reap(parent);
        let deadline = Instant::now() + Duration::from_secs(120);
        let child = loop {
            assert!(
                Instant::now() < deadline,
                "signal {sig}: the hang never came"
            );
            let finished = std::fs::read_to_string(&path)
                .ok()
                .and_then(|t| serde_json::from_str::<Value>(&t).ok())
                .and_then(|v| v["runs"][0]["probes"].as_array().map(|p| p.len()))
                .unwrap_or(0);
            let kids = children_of(parent.0.id());
            if finished == done && kids.len() == 1 {
                break kids[0];
            }
            std::thread::sleep(Duration::from_millis(100));
        };
        // SAFETY: signalling a process this test started.
        unsafe {
            libc::kill(parent.0.id() as libc::pid_t, sig);
        }
        let status = parent.0.wait().unwrap();
        assert!(!status.success(), "signal {sig}: {status}");
        let deadline = Instant::now() + Duration::from_secs(10);
        while !is_gone(child) {
            assert!(
                Instant::now() < deadline,
                "signal {sig}: the probe child {child} outlived its parent"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        let saved: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        assert_eq!(saved["in_progress"], true, "{saved}");
        let run = only_run(&saved);
        assert_eq!(run["in_progress"], true, "{run}");
        let probes = run["probes"].as_array().unwrap();
        let got: Vec<u64> = probes
            .iter()
            .map(|p| p["value"].as_u64().unwrap())
            .collect();
        assert_eq!(
            got,
            values[..done].to_vec(),
            "signal {sig}: finished probes kept"
        );
    }
}

#[test]
fn negative_and_overflowing_values_name_their_flag() {
    for (args, needle) in [
        (vec!["probe", "--timeout", "-1"], "--timeout"),
        (vec!["probe", "--at", "-5"], "--at: '-5' is negative"),
        (vec!["probe", "--device", "-1"], "--device: '-1'"),
        (
            vec!["probe", "--budget", "-1GiB"],
            "--budget: '-1GiB' is negative",
        ),
        (
            vec![
                "probe",
                "--model",
                "tiny-gpt",
                "--out",
                "/no/such/dir/run.json",
            ],
            "folder does not exist",
        ),
        (vec!["probe", "--out", "/tmp"], "is a folder"),
        (vec![], "missing command"),
    ] {
        let out = oomprobe().args(&args).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        let lines: Vec<&str> = err
            .lines()
            .filter(|l| !l.contains("XDG_RUNTIME_DIR") && !l.trim().is_empty())
            .collect();
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert_eq!(lines.len(), 1, "{args:?}: one line, got {err}");
        assert!(
            lines[0].contains(needle),
            "{args:?}: '{needle}' not in {err}"
        );
        assert!(!err.contains("unexpected argument"), "{args:?}: {err}");
    }
}

#[test]
fn an_at_beyond_the_scenario_is_bad_input() {
    require_adapter();
    let out = oomprobe()
        .arg("probe")
        .args(TINY_BATCH)
        .args(["--at", "18446744073709551615", "--quiet"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("--at: 18446744073709551615"), "{err}");
}

#[test]
fn no_isolate_says_what_it_gives_up() {
    require_adapter();
    let out = oomprobe()
        .arg("probe")
        .args(TINY_BATCH)
        .args(["--at", "1", "--no-isolate", "--quiet", "--json"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(
        err.contains("--no-isolate") && err.contains("ends the whole run"),
        "{err}"
    );
}

#[test]
fn a_verify_failure_is_retried_in_a_fresh_child_and_a_corrupting_adapter_is_named() {
    require_adapter();
    let (_, boundary) = undisturbed();
    // Every read-back at the boundary loses its data: retried once, then a failure; the run
    // ends with exit 0, the boundary below it, and a note naming the adapter as corrupting.
    let (code, report, err) = hooked("OOMPROBE_TEST_VERIFY_FAIL_AT", boundary, &[]);
    assert_eq!(code, Some(0), "{err}");
    let run = only_run(&report);
    let at: Vec<&str> = run["probes"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|p| p["value"].as_u64() == Some(boundary))
        .map(|p| p["outcome"].as_str().unwrap())
        .collect();
    assert!(
        at.len() >= 2 && at.iter().all(|o| *o == "verify_failed"),
        "{at:?}"
    );
    assert!(
        run["max_fit"].as_u64().is_some_and(|m| m < boundary),
        "{run}"
    );
    let notes = run["notes"].to_string();
    assert!(
        notes.contains("twice") && notes.contains("corrupting"),
        "{notes}"
    );
}

#[test]
fn repeat_probes_the_boundary_again_in_fresh_children() {
    require_adapter();
    let mut args = TINY_BATCH.to_vec();
    args.extend(["--repeat", "2"]);
    let report = probe_json(&args);
    let run = only_run(&report);
    let (fit, fail) = (
        run["max_fit"].as_u64().unwrap(),
        run["first_fail"].as_u64().unwrap(),
    );
    let repeats = run["repeats"].as_array().expect("repeats in the JSON");
    let at = |x: u64| {
        repeats
            .iter()
            .find(|r| r["value"].as_u64() == Some(x))
            .cloned()
    };
    // Under a budget the edge is exact: max_fit fits both times, first_fail fails both times.
    let f = at(fit).expect("max_fit repeated");
    assert_eq!(
        (f["tries"].as_u64(), f["fits"].as_u64()),
        (Some(2), Some(2)),
        "{f}"
    );
    let ff = at(fail).expect("first_fail repeated");
    assert_eq!(ff["fits"].as_u64(), Some(0), "{ff}");
    // The search's own probes are not changed by the repeats.
    assert!(run["probes"].as_array().unwrap().len() <= 6, "{run}");
    // Without --repeat, a budget run repeats nothing.
    let plain = probe_json(&TINY_BATCH);
    assert!(only_run(&plain).get("repeats").is_none());
    oomprobe()
        .arg("probe")
        .args(TINY_BATCH)
        .args(["--repeat", "many"])
        .assert()
        .code(2);
}

/// `--allocator pytorch` needs a backend that binds part of a buffer (CUDA): on the adapter
/// wgpu gives, it is one line and exit 2, as is a setting PyTorch would refuse; the default
/// there stays direct.
#[test]
fn the_pytorch_allocator_is_refused_where_buffers_bind_whole() {
    require_adapter();
    for (extra, want) in [
        (vec!["--allocator", "pytorch"], "binds whole buffers only"),
        (
            vec!["--alloc-conf", "max_split_size_mb:64"],
            "apply to --allocator pytorch",
        ),
    ] {
        let out = oomprobe()
            .arg("probe")
            .args(TINY_BATCH)
            .args(&extra)
            .assert()
            .code(2);
        let err = String::from_utf8(out.get_output().stderr.clone()).unwrap();
        assert_eq!(err.trim_end().lines().count(), 1, "{err}");
        assert!(err.contains(want), "{extra:?}: {err}");
    }
}

/// Issue 35: a timeout says in the JSON what limit it ran past (every child probe records it).
#[test]
fn a_timed_out_probe_records_its_limit() {
    require_adapter();
    let out = oomprobe()
        .args([
            "probe",
            "--model",
            "tiny-gpt",
            "--scenario",
            "batch",
            "--at",
            "3",
        ])
        .args(["--timeout", "2", "--json", "--quiet"])
        .env("OOMPROBE_TEST_HANG_AT", "3")
        .output()
        .unwrap();
    let v: Value = serde_json::from_slice(&out.stdout).expect("probe --json prints JSON");
    let p = &only_run(&v)["probes"][0];
    assert_eq!(p["outcome"], "timeout", "{p}");
    assert_eq!(p["time_limit_seconds"], 2.0, "{p}");
}

/// Today's mixers replayed on the device to an exact boundary under a budget: MLA runs its
/// matmuls and attention; Gated DeltaNet and Mamba-2 have no scan kernel yet, so their layers
/// run touch-only and the record says so. Each boundary is the plan's prediction, and every
/// fit checked its bytes (verified against their pattern, or checksummed after a kernel).
#[test]
fn todays_mixers_probe_to_the_predicted_boundary() {
    require_adapter();
    for (family, touch_only) in [
        ("deepseek_v3", None),
        ("qwen3_next", Some("Gated DeltaNet layers ran touch-only")),
        ("nemotron_h", Some("Mamba-2 layers ran touch-only")),
    ] {
        let config = format!(
            "{}/tests/fixtures/validation_families/{family}.json",
            env!("CARGO_MANIFEST_DIR")
        );
        let report = probe_json(&[
            "--config",
            &config,
            "--scenario",
            "batch",
            "--seq",
            "64",
            "--budget",
            "96MiB",
            "--compute",
            "full",
        ]);
        let run = only_run(&report);
        let max = run["max_fit"]
            .as_u64()
            .unwrap_or_else(|| panic!("{family}: {run}"));
        assert_eq!(run["first_fail"].as_u64(), Some(max + 1), "{family}: {run}");
        assert_eq!(run["fail_reason"], "budget", "{family}");
        assert_eq!(run["predicted_max"].as_u64(), Some(max), "{family}: {run}");
        for p in run["probes"].as_array().unwrap() {
            if p["outcome"] == "fit" {
                // Full compute: each tensor verified against its pattern, or checksummed once
                // a kernel wrote it, folded into one word.
                let c = p["checksum"].as_str().unwrap_or("");
                assert!(
                    c.len() == 16 && c.chars().all(|d| d.is_ascii_hexdigit()),
                    "{family}: {p}"
                );
            }
        }
        let notes: Vec<&str> = run["notes"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|n| n.as_str())
            .collect();
        let said = notes.iter().any(|n| n.contains("touch-only"));
        match touch_only {
            Some(words) => assert!(
                notes.iter().any(|n| n.starts_with(words)),
                "{family}: {notes:?}"
            ),
            None => assert!(!said, "{family}: {notes:?}"),
        }
    }
}
