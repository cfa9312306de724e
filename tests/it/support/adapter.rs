//! Shared by the end-to-end tests that need a GPU adapter: the binary, and a loud failure with
//! the install hint when no adapter exists (lavapipe in CI).

use assert_cmd::Command;
use serde_json::Value;

pub const INSTALL_HINT: &str =
    "no GPU adapter: install a driver or lavapipe (apt-get install -y mesa-vulkan-drivers libvulkan1)";

pub fn oomprobe() -> Command {
    Command::cargo_bin("oomprobe").expect("oomprobe binary")
}

/// Fail (never skip) when `oomprobe devices` lists no adapter.
pub fn require_adapter() {
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

/// Run `oomprobe ARGS --json` (`--quiet` too for a probe): it must succeed; its JSON.
pub fn json_of(args: &[&str]) -> Value {
    let mut cmd = oomprobe();
    cmd.args(args).arg("--json");
    if args.first() == Some(&"probe") {
        cmd.arg("--quiet");
    }
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "{args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("--json prints JSON")
}
