//! A real-OOM search on a machine whose cores are busy with other work finds the
//! boundary it finds on an idle machine, in as few probes. Loaded, a params search under
//! `prlimit --as=4GiB` once took 16 probes for 5: a replay's reserve measured while the machine
//! was busy said 33 MiB where it is 1.5 MiB (`probe::dry::measure_settled` now takes the middle
//! of three measurements). Here on tiny-gpt's batch scenario under 1.4 GiB (the CI soak's case),
//! with a busy loop per core.
//!
//! The edge itself is noisy by one value under an address-space limit, loaded or not: idle on
//! lavapipe, batch 410 failed and then fit in 1 of 4 runs here (where the mappings land varies),
//! and the search reports that run `flaky` after a second confirmation pair (7 probes, batch
//! 409 as always). The first CI run of this test met that edge and failed on the count; a flaky
//! run is allowed that pair, and nothing more.

use crate::support::adapter::require_adapter;
use crate::support::load::every_core;

/// Busy loops, killed when dropped.
struct Load(Vec<std::process::Child>);

impl Drop for Load {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// (max fit, probes, flaky) of a search under a real address-space limit.
fn search() -> (u64, usize, bool) {
    let out = std::process::Command::new("prlimit")
        .arg("--as=1468006400")
        .arg(assert_cmd::cargo::cargo_bin("oomprobe"))
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
        .expect("prlimit (util-linux) runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    let run = &v["runs"][0];
    let fit = run["max_fit"]
        .as_u64()
        .unwrap_or_else(|| panic!("no boundary: {run}"));
    (
        fit,
        run["probes"].as_array().map_or(0, Vec::len),
        run["flaky"]
            .as_bool()
            .expect("a run says whether it was flaky"),
    )
}

/// Probes a search may take: 6, and the confirmation pair of a flaky edge.
fn allowed(flaky: bool) -> usize {
    if flaky {
        8
    } else {
        6
    }
}

#[cfg(target_os = "linux")]
#[test]
fn a_search_on_a_loaded_machine_finds_the_idle_boundary_in_at_most_6_probes() {
    require_adapter();
    // The busy loops below must not run beside a test that asserts on wall time.
    let _load = every_core();
    let idle = search();
    let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
    let load = Load(
        (0..cores)
            .map(|_| {
                std::process::Command::new("sh")
                    .args(["-c", "while :; do :; done"])
                    .spawn()
                    .expect("sh runs")
            })
            .collect(),
    );
    let loaded = search();
    drop(load);
    assert_eq!(loaded.0, idle.0, "loaded {loaded:?}, idle {idle:?}");
    assert!(idle.1 <= allowed(idle.2), "idle {idle:?}");
    assert!(
        loaded.1 <= allowed(loaded.2),
        "loaded {loaded:?}, idle {idle:?}"
    );
}
