//! What a person at a terminal sees: shell completions, the man page, examples under every
//! command's `--help`, `NO_COLOR`, and a probe screen free of driver noise with one device line.

use assert_cmd::Command;
use clap::Parser;
use oomprobe::cli::Cli;

fn oomprobe() -> Command {
    Command::cargo_bin("oomprobe").expect("oomprobe binary")
}

fn stdout_of(cmd: &mut Command) -> String {
    let out = cmd.output().expect("run oomprobe");
    assert!(
        out.status.success(),
        "failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("utf8")
}

#[test]
fn completions_for_each_shell_know_the_commands_and_flags() {
    for shell in ["bash", "zsh", "fish", "elvish", "powershell"] {
        let text = stdout_of(oomprobe().args(["completions", shell]));
        for word in ["probe", "compare", "budget", "scenario"] {
            assert!(text.contains(word), "{shell} completions lack {word}");
        }
        assert!(
            !text.contains("probe-child"),
            "{shell}: the hidden command leaked"
        );
    }
    let out = oomprobe().args(["completions", "tcsh"]).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(err.contains("tcsh"), "{err}");
}

#[test]
fn the_man_page_documents_every_command() {
    let page = stdout_of(oomprobe().arg("man"));
    assert!(
        page.starts_with(".ie") || page.contains(".TH oomprobe 1"),
        "{page}"
    );
    for cmd in [
        "devices",
        "estimate",
        "probe",
        "diagnose",
        "compare",
        "completions",
    ] {
        assert!(page.contains(cmd), "man page lacks {cmd}");
    }
    assert!(!page.contains("probe\\-child"), "the hidden command leaked");

    let dir = tempfile::tempdir().expect("tmp");
    oomprobe()
        .args(["man", "--dir"])
        .arg(dir.path())
        .assert()
        .success();
    for name in ["oomprobe.1", "oomprobe-probe.1", "oomprobe-compare.1"] {
        let p = dir.path().join(name);
        let text = std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert!(text.contains(".TH"), "{name}");
    }
    let probe_page = std::fs::read_to_string(dir.path().join("oomprobe-probe.1")).unwrap();
    assert!(probe_page.contains("budget"), "{probe_page}");
    assert!(!dir.path().join("oomprobe-probe-child.1").exists());
}

#[test]
fn every_command_help_ends_with_examples_that_parse() {
    let lines = oomprobe::help::example_lines();
    assert!(lines.len() >= 14, "{lines:?}");
    for line in lines {
        let argv: Vec<&str> = line.split_whitespace().collect();
        assert_eq!(argv[0], "oomprobe", "{line}");
        if let Err(e) = Cli::try_parse_from(&argv) {
            panic!("example `{line}` does not parse: {e}");
        }
    }
    for cmd in [
        "devices",
        "estimate",
        "probe",
        "diagnose",
        "compare",
        "completions",
        "man",
    ] {
        let text = stdout_of(oomprobe().args([cmd, "--help"]));
        assert!(text.contains("Examples:"), "{cmd} --help:\n{text}");
        assert!(
            text.contains(&format!("oomprobe {cmd}")),
            "{cmd} --help:\n{text}"
        );
    }
}

fn has_adapter() -> bool {
    let out = oomprobe().args(["devices", "--json"]).output().unwrap();
    let list: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
    list.as_array().is_some_and(|a| !a.is_empty())
}

/// One quick probe: a tiny model at batch 1 under a small budget.
fn quick_probe() -> Command {
    let mut cmd = oomprobe();
    cmd.args([
        "probe",
        "--model",
        "tiny-gpt",
        "--scenario",
        "batch",
        "--at",
        "1",
        "--budget",
        "64MiB",
    ]);
    cmd
}

#[test]
fn no_color_keeps_the_table_plain_even_when_color_is_forced() {
    assert!(
        has_adapter(),
        "no GPU adapter: install lavapipe (apt-get install -y mesa-vulkan-drivers libvulkan1)"
    );
    let forced = stdout_of(
        quick_probe()
            .env_remove("NO_COLOR")
            .env("CLICOLOR_FORCE", "1"),
    );
    assert!(
        forced.contains('\u{1b}'),
        "CLICOLOR_FORCE gave no color:\n{forced}"
    );
    let plain = stdout_of(
        quick_probe()
            .env("CLICOLOR_FORCE", "1")
            .env("NO_COLOR", "1"),
    );
    assert!(!plain.contains('\u{1b}'), "NO_COLOR ignored:\n{plain}");
    let piped = stdout_of(quick_probe().env_remove("CLICOLOR_FORCE"));
    assert!(!piped.contains('\u{1b}'), "color on a pipe:\n{piped}");
}

#[test]
fn a_probe_prints_one_device_line_and_no_driver_noise() {
    assert!(
        has_adapter(),
        "no GPU adapter: install lavapipe (apt-get install -y mesa-vulkan-drivers libvulkan1)"
    );
    // Isolated children, and no runtime directory: Mesa's EGL would complain without one.
    let out = quick_probe()
        .env_remove("XDG_RUNTIME_DIR")
        .output()
        .unwrap();
    assert!(out.status.success());
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.trim().is_empty(), "stderr is not quiet:\n{stderr}");
    let device_lines = stdout
        .lines()
        .chain(stderr.lines())
        .filter(|l| l.contains("llvmpipe") || l.starts_with("device:"))
        .count();
    assert_eq!(device_lines, 1, "{stdout}\n{stderr}");
}

#[test]
fn llvmpipe_on_gl_suggests_lavapipe() {
    let gl_only = |cmd: &mut Command| {
        cmd.env("WGPU_BACKEND", "gl");
    };
    let mut devices = oomprobe();
    gl_only(devices.args(["devices", "--json"]));
    let list: serde_json::Value =
        serde_json::from_slice(&devices.output().unwrap().stdout).unwrap_or_default();
    let cpu_gl = list.as_array().is_some_and(|a| {
        a.iter()
            .any(|d| d["backend"] == "gl" && d["device_type"] == "cpu")
    });
    if !cpu_gl {
        eprintln!("skipped: no GL software adapter (llvmpipe) here");
        return;
    }
    let mut probe = quick_probe();
    gl_only(&mut probe);
    let out = probe.output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("lavapipe is faster") && stderr.contains("mesa-vulkan-drivers"),
        "{stderr}"
    );
}
