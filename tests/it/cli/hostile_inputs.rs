//! Hostile inputs, each as a tester met it: a pickle nested 2·10⁵ deep, trace sizes
//! of 2⁶², /dev/zero and a FIFO with no writer where a file is named (`--snapshot`, `compare`,
//! `--config`, the HF cache's `refs/main`, `diagnose --oom`). Each exits 2 with one line, in
//! well under a second and with bounded memory (the timeouts below would catch a hang), instead
//! of a stack overflow, a 6 GB replay, a read of /dev/zero until allocation failed or a block in
//! `open(2)` forever.

use std::path::{Path, PathBuf};
use std::time::Duration;

use assert_cmd::Command;

fn oomprobe() -> Command {
    let mut c = Command::cargo_bin("oomprobe").unwrap();
    // A hang fails the test instead of stalling the suite.
    c.timeout(Duration::from_secs(20));
    c
}

fn fixture(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(rel)
}

/// Runs `c`, expects exit 2 and one stderr line containing `needle`.
fn refused(c: &mut Command, needle: &str) {
    let out = c.output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    assert_eq!(out.status.code(), Some(2), "stderr: {err}");
    assert!(err.contains(needle), "{err}");
    assert_eq!(err.trim_end().lines().count(), 1, "{err}");
}

/// The stdout of a run that must succeed.
fn stdout_of(c: &mut Command) -> String {
    String::from_utf8(c.assert().success().get_output().stdout.clone()).unwrap()
}

fn mkfifo(p: &Path) {
    let c = std::ffi::CString::new(p.to_str().unwrap()).unwrap();
    // SAFETY: a valid NUL-terminated path; mkfifo only creates the node.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
}

#[test]
fn a_deeply_nested_pickle_is_refused_in_every_command_not_a_stack_overflow() {
    let d = tempfile::tempdir().unwrap();
    let p = d.path().join("n.pickle");
    let mut b = vec![0x80, 2];
    b.extend(std::iter::repeat_n(b']', 200_000));
    b.extend(std::iter::repeat_n(b'a', 199_999));
    b.push(b'.');
    std::fs::write(&p, b).unwrap();
    let f = p.to_str().unwrap();
    for args in [
        vec!["estimate", "--snapshot", f],
        vec!["diagnose", "--snapshot", f],
        vec!["probe", "--snapshot", f, "--budget", "64MiB"],
    ] {
        refused(oomprobe().args(&args), "nested more than 200 deep");
    }
}

#[test]
fn trace_sizes_beyond_any_address_space_are_refused_before_a_replay() {
    // A real trace (gpt2-tiny) with one entry's size set to 2^62.
    let snap = oomprobe::snapshot::read::read_file(&fixture("snapshots/gpt2-tiny-b1.pickle"))
        .expect("fixture reads");
    let mut snap = snap;
    let e = snap
        .device_traces
        .iter_mut()
        .flatten()
        .find(|e| e.size > 0)
        .expect("a sized entry");
    e.size = 1 << 62;
    let d = tempfile::tempdir().unwrap();
    let p = d.path().join("huge.pickle");
    std::fs::write(&p, oomprobe::snapshot::write::to_bytes(&snap).unwrap()).unwrap();
    let f = p.to_str().unwrap();
    refused(
        oomprobe().args(["probe", "--snapshot", f, "--budget", "64MiB"]),
        "more than a 48-bit address space",
    );
    refused(
        oomprobe().args(["estimate", "--snapshot", f]),
        "more than a 48-bit address space",
    );
}

#[cfg(unix)]
#[test]
fn devices_and_fifos_are_refused_wherever_a_file_is_named() {
    let d = tempfile::tempdir().unwrap();
    let fifo = d.path().join("c.json");
    mkfifo(&fifo);
    let fifo = fifo.to_str().unwrap();
    for (args, what) in [
        (
            vec!["estimate", "--snapshot", "/dev/zero"],
            "character device",
        ),
        (vec!["compare", "/dev/zero"], "character device"),
        (
            vec!["estimate", "--config", "/dev/zero"],
            "character device",
        ),
        (vec!["estimate", "--config", fifo], "FIFO"),
        (vec!["estimate", "--snapshot", fifo], "FIFO"),
        (vec!["compare", fifo], "FIFO"),
        (vec!["diagnose", "--oom", "/dev/zero"], "character device"),
    ] {
        refused(oomprobe().args(&args), what);
    }
}

#[cfg(unix)]
#[test]
fn a_cache_ref_that_cannot_be_read_is_an_error_not_a_silent_fallback() {
    let d = tempfile::tempdir().unwrap();
    let repo = d.path().join("hub/models--Org--Tiny");
    let cfg = std::fs::read_to_string(fixture("configs/qwen2.5-7b.json")).unwrap();
    let snap = repo.join("snapshots/aaaa1111");
    std::fs::create_dir_all(&snap).unwrap();
    std::fs::write(snap.join("config.json"), cfg).unwrap();
    std::fs::create_dir_all(repo.join("refs")).unwrap();
    let run = || {
        let mut c = oomprobe();
        c.env_remove("HF_HUB_CACHE")
            .env_remove("HUGGINGFACE_HUB_CACHE")
            .env("HF_HOME", d.path())
            .args(["estimate", "--model", "Org/Tiny"]);
        c
    };
    // No ref at all: the newest snapshot, as before.
    run().assert().success();
    std::os::unix::fs::symlink("/dev/zero", repo.join("refs/main")).unwrap();
    refused(&mut run(), "refs/main");
    std::fs::remove_file(repo.join("refs/main")).unwrap();
    mkfifo(&repo.join("refs/main"));
    refused(&mut run(), "FIFO");
}

#[test]
fn a_profile_turned_into_a_snapshot_reads_as_its_block_peak() {
    // _profile_to_snapshot over a CPU profile: one made-up segment of 41.40 TiB.
    let f = fixture("snapshots/variants/profile-to-snapshot-cpu.pickle");
    let text = stdout_of(oomprobe().args(["estimate", "--snapshot", f.to_str().unwrap()]));
    // 8 MiB held before the trace, 16 + 8 MiB live at once in it.
    assert!(text.contains("peak 32.00 MiB (33554432 B)"), "{text}");
    assert!(text.contains("blocks granularity"), "{text}");
    let notes: Vec<&str> = text.lines().filter(|l| l.contains("made up")).collect();
    assert_eq!(notes.len(), 1, "{text}");
    // Asked for segments, it reads them, and says what they are.
    let text = stdout_of(
        oomprobe()
            .args(["estimate", "--snapshot", f.to_str().unwrap()])
            .args(["--granularity", "segments"]),
    );
    assert!(
        text.contains("--granularity blocks reads the tensors"),
        "{text}"
    );
}

#[test]
fn gemma2_with_sdpa_is_refused_and_inference_names_no_optimizer() {
    refused(
        oomprobe().args(["estimate", "--model", "gemma2-9b", "--attention", "sdpa"]),
        "_supports_sdpa = False",
    );
    oomprobe()
        .args(["estimate", "--model", "gemma2-9b", "--attention", "flash"])
        .assert()
        .success();
    let text = stdout_of(oomprobe().args([
        "estimate",
        "--model",
        "tiny-gpt",
        "--mode",
        "inference",
        "--json",
    ]));
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["workload"]["optimizer"], "none", "{}", v["workload"]);
    let out = oomprobe()
        .args(["estimate", "--model", "tiny-gpt", "--mode", "inference"])
        .args(["--optimizer", "adam"])
        .assert()
        .success()
        .get_output()
        .stderr
        .clone();
    let err = String::from_utf8(out).unwrap();
    assert!(err.contains("--optimizer adam does not apply"), "{err}");
}

/// Issue 48: every layout count has a bound checked before any work. A micro-batch count of
/// 2⁶³ panicked with `capacity overflow`; 100,000 micro-batches on 4 stages grew past 19 GB;
/// a DDP bucket of 2⁶³ MiB wrapped to a tiny bucket and made buckets without end.
#[test]
fn layout_counts_are_bounded_before_any_work() {
    let _load = crate::support::load::timed();
    let huge = "9223372036854775808";
    let gpt2 = ["estimate", "--model", "gpt2"];
    refused(
        oomprobe()
            .args(gpt2)
            .args(["--pp", "2", "--schedule", "gpipe", "--microbatches", huge]),
        "--microbatches: 9223372036854775808 is absurd for microbatches (at most 4096)",
    );
    refused(
        oomprobe()
            .args(["estimate", "--model", "llama3-8b", "--pp", "4"])
            .args(["--microbatches", "100000"]),
        "(at most 4096)",
    );
    // Within the flag's bound but past what the plans hold together.
    refused(
        oomprobe()
            .args(["estimate", "--model", "llama-13b", "--pp", "4"])
            .args(["--microbatches", "4096"]),
        "--microbatches: 4096 micro-batches through 40 layers",
    );
    refused(
        oomprobe().args(gpt2).args(["--gpus", "2", "--ddp", huge]),
        "--ddp: 9223372036854775808 is absurd for ddp (at most 1048576)",
    );
    for (flag, max) in [
        ("--pp", "2048"),
        ("--chunks", "2048"),
        ("--tp", "65536"),
        ("--cp", "65536"),
        ("--dp", "16777216"),
        ("--gpus", "16777216"),
    ] {
        refused(
            oomprobe().args(gpt2).args([flag, huge]),
            &format!(
                "{flag}: {huge} is absurd for {} (at most {max})",
                &flag[2..]
            ),
        );
    }
    // The largest bucket answers at once: the buckets never outnumber the trainable tensors.
    let t = std::time::Instant::now();
    oomprobe()
        .args(gpt2)
        .args(["--gpus", "2", "--ddp", "1048576"])
        .assert()
        .success();
    oomprobe()
        .args(["estimate", "--params", "1T", "--gpus", "2", "--ddp", "1"])
        .assert()
        .success();
    assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
}

/// Issue 48: a newline in `--alloc-conf` made the one-line error three lines, and an escape
/// sequence in a `PYTORCH_CUDA_ALLOC_CONF` key reached the terminal; every error line is now
/// escaped where it is printed.
#[test]
fn user_input_in_an_error_line_is_escaped() {
    refused(
        oomprobe().args(["estimate", "--model", "gpt2", "--alloc-conf", "foo\nbar:1"]),
        "unknown key 'foo\\nbar'",
    );
    let out = oomprobe()
        .args(["estimate", "--model", "gpt2"])
        .env("PYTORCH_CUDA_ALLOC_CONF", "\u{1b}]0;pwned\u{7}x\ry:1")
        .env_remove("PYTORCH_ALLOC_CONF")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        !err.trim_end().contains(|c: char| c.is_control()),
        "{err:?}"
    );
    assert!(err.contains("\\u{1b}"), "{err}");
    assert_eq!(err.trim_end().lines().count(), 1, "{err}");
    refused(
        oomprobe().args(["estimate", "--batch", "1\n2"]),
        "invalid count '1\\n2'",
    );
}
