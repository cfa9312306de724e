//! `oomprobe devices`: JSON per the contract on whatever adapter is present (lavapipe in CI),
//! and bad flags exit 2 with one line.

use assert_cmd::Command;

const NO_ADAPTER: &str = "no wgpu adapter: install a GPU driver or the software Vulkan driver \
                          (apt-get install -y mesa-vulkan-drivers libvulkan1)";

fn oomprobe() -> Command {
    Command::cargo_bin("oomprobe").expect("oomprobe binary")
}

#[test]
fn devices_json_lists_adapters_with_their_limits() {
    let out = oomprobe().args(["devices", "--json"]).output().unwrap();
    assert!(
        out.status.success(),
        "{NO_ADAPTER}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON on stdout");
    let list = v.as_array().expect("an array");
    assert!(!list.is_empty(), "{NO_ADAPTER}");
    let types = ["discrete", "integrated", "cpu", "virtual", "other"];
    for d in list {
        for key in [
            "index",
            "name",
            "backend",
            "device_type",
            "driver",
            "memory_total_bytes",
            "memory_free_bytes",
            "max_buffer_size",
            "max_storage_binding_size",
        ] {
            assert!(d.get(key).is_some(), "missing {key} in {d}");
        }
        assert!(types.contains(&d["device_type"].as_str().unwrap()), "{d}");
        assert!(d["max_buffer_size"].as_u64().unwrap() > 0);
        assert!(d["max_storage_binding_size"].as_u64().unwrap() > 0);
        for key in ["memory_total_bytes", "memory_free_bytes"] {
            assert!(
                d[key].is_null() || d[key].as_u64().is_some(),
                "{key} in {d}"
            );
        }
    }
    // wgpu indices are positions 0..n.
    let wgpu: Vec<u64> = list
        .iter()
        .filter(|d| d["backend"] != "cuda")
        .map(|d| d["index"].as_u64().unwrap())
        .collect();
    assert_eq!(wgpu, (0..wgpu.len() as u64).collect::<Vec<_>>());
}

#[test]
fn lavapipe_is_listed_when_it_is_the_only_vulkan_device() {
    let out = oomprobe().args(["devices", "--json"]).output().unwrap();
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    let list = v.as_array().unwrap();
    let has_gpu = list
        .iter()
        .any(|d| d["device_type"] == "discrete" || d["device_type"] == "integrated");
    if has_gpu {
        return; // a real GPU machine: nothing to say about lavapipe
    }
    let lvp = list
        .iter()
        .find(|d| d["backend"] == "vulkan" && d["device_type"] == "cpu")
        .unwrap_or_else(|| panic!("{NO_ADAPTER}: {v}"));
    assert!(lvp["name"].as_str().unwrap().contains("llvmpipe"), "{lvp}");
    // Lavapipe's limits as measured (Mesa 22.3): 128 MiB bindings, buffers just under 2 GiB.
    assert!(lvp["max_storage_binding_size"].as_u64().unwrap() >= 128 << 20);
    assert!(
        lvp["max_buffer_size"].as_u64().unwrap()
            >= lvp["max_storage_binding_size"].as_u64().unwrap()
    );
}

#[test]
fn devices_table_has_a_header_and_a_row() {
    let out = oomprobe().arg("devices").output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("max binding"), "{text}");
    assert!(
        text.contains("vulkan")
            || text.contains("metal")
            || text.contains("dx12")
            || text.contains("gl"),
        "{text}"
    );
}

#[test]
fn a_bad_flag_exits_2_with_one_line() {
    let out = oomprobe().args(["devices", "--bogus"]).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(out.stdout.is_empty());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--bogus"), "{err}");
    assert_eq!(err.trim().lines().count(), 1, "{err}");
}

#[test]
fn no_adapter_at_all_exits_1_with_how_to_install_one() {
    // WGPU_BACKEND restricts wgpu to a backend this platform lacks (metal off macOS, vulkan on
    // macOS), so no adapter is found.
    let hidden = if cfg!(target_os = "macos") {
        "dx12"
    } else {
        "metal"
    };
    let out = oomprobe()
        .args(["devices", "--json"])
        .env("WGPU_BACKEND", hidden)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    if out.status.success() {
        // A CUDA device was listed instead: nothing to check here.
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert!(
            v.as_array().unwrap().iter().all(|d| d["backend"] == "cuda"),
            "{v}"
        );
        return;
    }
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(out.stdout.is_empty());
    assert!(err.contains("mesa-vulkan-drivers"), "{err}");
}

/// Every device object carries the (additive) overhead fields: numbers where measured (CUDA),
/// null on wgpu, which tells no free memory to measure them by.
#[test]
fn devices_json_has_the_overhead_fields() {
    let out = oomprobe().args(["devices", "--json"]).output().unwrap();
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON on stdout");
    for d in v.as_array().expect("an array") {
        for key in ["overhead_bytes", "kernel_overhead_bytes"] {
            assert!(d.get(key).is_some(), "missing {key} in {d}");
            if d["backend"] == "cuda" {
                assert!(d[key].as_u64().is_some(), "{key} measured on CUDA: {d}");
            } else {
                assert!(d[key].is_null(), "{key} unknown on wgpu: {d}");
            }
        }
    }
}

/// With an NVIDIA driver present (forced here: no GPU in CI) and only CPU adapters in wgpu,
/// `devices` says how to install the Vulkan ICD; without the driver it says nothing of it.
/// The JSON on stdout stays the contract array (the advice goes to stderr).
#[test]
fn a_driver_without_a_vulkan_gpu_gets_the_icd_advice() {
    let only_cpu = {
        let out = oomprobe().args(["devices", "--json"]).output().unwrap();
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
        v.as_array()
            .expect("array")
            .iter()
            .filter(|d| d["backend"] != "cuda")
            .all(|d| d["device_type"] == "cpu")
    };
    let run = |driver: &str, json: bool| {
        let mut c = oomprobe();
        c.env("OOMPROBE_NVIDIA_DRIVER", driver).arg("devices");
        if json {
            c.arg("--json");
        }
        c.output().unwrap()
    };
    let table = run("present", false);
    let text = String::from_utf8_lossy(&table.stdout);
    assert_eq!(table.status.code(), Some(0), "{text}");
    assert_eq!(
        text.contains("NVIDIA_DRIVER_CAPABILITIES"),
        only_cpu,
        "advice iff only CPU adapters:\n{text}"
    );
    let json = run("present", true);
    let _: serde_json::Value = serde_json::from_slice(&json.stdout).expect("stdout stays JSON");
    assert_eq!(
        String::from_utf8_lossy(&json.stderr).contains("graphics"),
        only_cpu
    );
    let absent = run("absent", false);
    assert!(!String::from_utf8_lossy(&absent.stdout).contains("NVIDIA_DRIVER_CAPABILITIES"));
}
