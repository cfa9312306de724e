//! `oomprobe diagnose --oom` from the outside: the cause in the first line, a pipe on stdin, the
//! JSON contract, and bad input exiting 2 with one line.

use assert_cmd::Command;
use serde_json::Value;

const DIR: &str = "tests/fixtures/oom";

fn oomprobe() -> Command {
    Command::cargo_bin("oomprobe").unwrap()
}

fn fixture(num: &str) -> String {
    let f = std::fs::read_dir(DIR)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .find(|f| f.starts_with(num))
        .unwrap();
    format!("{DIR}/{f}")
}

fn stdout(c: &mut Command) -> String {
    String::from_utf8(c.assert().success().get_output().stdout.clone()).unwrap()
}

#[test]
fn the_cause_comes_first_then_the_evidence() {
    // The issue's first example: fragmentation; the pids of the second, another process.
    let s = stdout(oomprobe().args(["diagnose", "--oom", &fixture("003")]));
    assert!(s.starts_with("fragmentation: "), "{s}");
    assert!(s.contains("expandable_segments:True"), "{s}");
    let s = stdout(oomprobe().args(["diagnose", "--oom", &fixture("024")]));
    assert!(s.starts_with("other_process: "), "{s}");
    assert!(s.contains("1246069"), "{s}");
    assert!(s.contains("also fragmentation"), "{s}");
}

#[test]
fn it_reads_a_pipe() {
    let log = std::fs::read(fixture("069")).unwrap();
    let s = stdout(oomprobe().args(["diagnose", "--oom", "-"]).write_stdin(log));
    assert!(s.starts_with("non_pytorch: "), "{s}");
    assert!(s.contains("Process 105400 is this process"), "{s}");
}

#[test]
fn json_carries_every_figure_in_bytes_with_its_rounding() {
    let out = stdout(oomprobe().args(["diagnose", "--oom", &fixture("004"), "--json"]));
    let v: Value = serde_json::from_str(&out).unwrap();
    let m = &v["messages"][0];
    let mib = 1u64 << 20;
    let gib = 1u64 << 30;
    assert_eq!(m["requested_bytes"], 86 * mib);
    assert_eq!(m["free_bytes"], 264 * mib);
    assert_eq!(m["backend"], "cuda");
    assert_eq!(m["gpu"], 0);
    assert_eq!(m["cause"], "other_process");
    assert_eq!(m["other_processes"].as_array().unwrap().len(), 2);
    assert_eq!(m["other_processes"][1]["pid"], 2797307);
    // 8.04 GiB − (7.63 GiB + 40.11 MiB): about 380 MiB outside PyTorch.
    let non_pt = m["non_pytorch_bytes"].as_u64().unwrap();
    assert!((370 * mib..390 * mib).contains(&non_pt), "{non_pt}");
    let b = &m["bounds"]["total_bytes"];
    let (lo, hi) = (b[0].as_u64().unwrap(), b[1].as_u64().unwrap());
    assert!(lo < 2364 * gib / 100 && hi > 2364 * gib / 100 && hi - lo <= gib / 100 + 1);
    // Free exceeded the request, so nothing was missing, but the margin was thin.
    assert_eq!(m["missing_bytes"], 0);
    assert_eq!(m["card"]["ids"][0], "rtx4090");
}

fn refused(path: &str) {
    let out = oomprobe()
        .args(["diagnose", "--oom", path])
        .assert()
        .code(2)
        .get_output()
        .clone();
    assert!(out.stdout.is_empty());
    let err = String::from_utf8(out.stderr).unwrap();
    assert_eq!(
        err,
        format!("oomprobe: no out-of-memory message found in {path}\n")
    );
}

#[test]
fn empty_binary_huge_and_cut_inputs_exit_2_with_one_line() {
    let dir = std::env::temp_dir().join(format!("oomprobe-oom-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let write = |name: &str, bytes: &[u8]| {
        let p = dir.join(name);
        std::fs::write(&p, bytes).unwrap();
        p.to_string_lossy().into_owned()
    };
    refused(&write("empty.log", b""));
    // Binary: a fixed pseudo-random stream.
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    let bin: Vec<u8> = (0..1 << 20)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect();
    refused(&write("binary.bin", &bin));
    // 100 MB of log with no OOM in it.
    let line = b"step 1200 | loss 2.31 | lr 3e-4 | 412 tokens/s | GPU memory 21.3 GiB\n";
    let big: Vec<u8> = line.iter().copied().cycle().take(100_000_000).collect();
    refused(&write("big.log", &big));
    // Cut mid-number: no figure is whole.
    refused(&write(
        "cut.log",
        b"RuntimeError: CUDA out of memory. Tried to allocate 2.3",
    ));
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn a_missing_file_exits_2() {
    let out = oomprobe()
        .args(["diagnose", "--oom", "/nonexistent/train.log"])
        .assert()
        .code(2)
        .get_output()
        .clone();
    let err = String::from_utf8(out.stderr).unwrap();
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.contains("cannot read /nonexistent/train.log"), "{err}");
}

/// A message as PyTorch prints it where the allocator model says gpt2 at batch 16, seq 1024
/// fails on an 8 GiB card (`oomprobe estimate --model gpt2 --batch 16 --memory 8GiB`: 192 MiB
/// refused with 7.71 GiB allocated, 109.79 MiB cached): built from the model, so this checks
/// the comparison, not the model.
const GPT2_ON_8G: &str = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 192.00 MiB. GPU 0 has a total capacity of 8.00 GiB of which 190.00 MiB is free. Of the allocated memory 7.71 GiB is allocated by PyTorch, and 109.79 MiB is reserved by PyTorch but unallocated.\n";

#[test]
fn a_workload_is_checked_against_the_message() {
    let run = |batch: &str| -> Value {
        let out = stdout(
            oomprobe()
                .args(["diagnose", "--oom", "-", "--json", "--model", "gpt2"])
                .args(["--batch", batch, "--seq", "1024"])
                .write_stdin(GPT2_ON_8G),
        );
        serde_json::from_str(&out).unwrap()
    };
    let same = run("16");
    let c = &same["messages"][0]["workload_check"];
    assert_eq!(c["same_run"], true, "{c}");
    assert_eq!(c["predicted_failure"]["phase"], "forward");
    assert_eq!(c["diagnosis"]["cause"], "batch_too_large");
    // Batch 2 fits in what PyTorch had: the message cannot be from it.
    let other = run("2");
    let c = &other["messages"][0]["workload_check"];
    assert_eq!(c["same_run"], false, "{c}");
    assert!(c["predicted_failure"].is_null());
    assert!(c["verdict"]
        .as_str()
        .unwrap()
        .starts_with("not this workload"));
    // The first cause stays the message's own.
    assert_eq!(other["messages"][0]["cause"], "shortage");
    assert_eq!(other["messages"][0]["causes"][1]["cause"], "fragmentation");
}

#[test]
fn memory_does_not_go_with_oom_nor_a_snapshot_without_an_oom() {
    let no_oom = "tests/fixtures/snapshots/real/torch26-small-trace.pickle";
    for extra in [&["--memory", "8GiB"][..], &["--snapshot", no_oom][..]] {
        let out = oomprobe()
            .args(["diagnose", "--oom", "-"])
            .args(extra)
            .write_stdin(GPT2_ON_8G)
            .assert()
            .code(2)
            .get_output()
            .clone();
        assert_eq!(String::from_utf8(out.stderr).unwrap().lines().count(), 1);
    }
}

/// Issue 48: `--gpu nonexistent` with `--oom` exited 0, the card ignored; an unknown card exits
/// 2 as it does without `--oom`, and a known one is refused like `--memory`.
#[test]
fn a_card_is_checked_with_oom_too() {
    for (gpu, needle) in [
        ("nonexistent", "--gpu: no card 'nonexistent'"),
        ("h100-sxm", "--gpu does not go with --oom"),
    ] {
        let out = oomprobe()
            .args(["diagnose", "--oom", "-", "--gpu", gpu])
            .write_stdin(GPT2_ON_8G)
            .assert()
            .code(2)
            .get_output()
            .clone();
        let err = String::from_utf8(out.stderr).unwrap();
        assert!(err.contains(needle), "{err}");
        assert_eq!(err.lines().count(), 1, "{err}");
    }
}

/// The message PyTorch would print for the OOM recorded in the committed expandable-segments
/// snapshot (device 1: 90.01 MiB asked, 9.50 MiB free, 60.01 MiB allocated, 21.99 MiB cached).
#[test]
fn a_snapshot_says_whether_it_recorded_this_oom() {
    let snap = "tests/fixtures/snapshots/variants/expandable-oom-4dev.pickle";
    let msg = |alloc: &str| {
        format!("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 90.01 MiB. GPU 1 has a total capacity of 100.00 MiB of which 9.50 MiB is free. Of the allocated memory {alloc} is allocated by PyTorch, and 21.99 MiB is reserved by PyTorch but unallocated.\n")
    };
    let run = |alloc: &str| -> Value {
        let out = stdout(
            oomprobe()
                .args(["diagnose", "--oom", "-", "--json", "--snapshot", snap])
                .write_stdin(msg(alloc)),
        );
        serde_json::from_str(&out).unwrap()
    };
    let same = run("60.01 MiB");
    assert_eq!(same["messages"][0]["snapshot_check"]["same_oom"], true);
    assert_eq!(same["messages"][0]["snapshot_check"]["device"], 1);
    let other = run("50.00 MiB");
    assert_eq!(other["messages"][0]["snapshot_check"]["same_oom"], false);
}

/// The JSON of `diagnose --oom -` over `log`, less what names the text.
fn judged(log: Vec<u8>) -> Value {
    let out = stdout(
        oomprobe()
            .args(["diagnose", "--oom", "-", "--json"])
            .write_stdin(log),
    );
    let mut v: Value = serde_json::from_str(&out).unwrap();
    for m in v["messages"].as_array_mut().unwrap() {
        m.as_object_mut().unwrap().retain(|k, _| k != "text");
    }
    v
}

#[test]
fn colour_and_utf16_logs_read_as_the_plain_text() {
    // Rich tracebacks colour the numbers; Windows consoles save logs as UTF-16 (with a BOM, or
    // big-endian without one). Each reads to the figures of the plain message.
    let plain = std::fs::read_to_string(fixture("008")).unwrap();
    let want = judged(plain.clone().into_bytes());
    assert_eq!(want["messages"].as_array().unwrap().len(), 1, "{want}");
    let colour = plain
        .replace("GiB", "GiB\x1b[0m")
        .replace("Tried to allocate ", "Tried to allocate \x1b[1;31m");
    assert!(colour.contains('\x1b'));
    assert_eq!(judged(colour.into_bytes()), want);
    let mut le = vec![0xFF, 0xFE];
    le.extend(plain.encode_utf16().flat_map(u16::to_le_bytes));
    assert_eq!(judged(le), want);
    let be: Vec<u8> = plain.encode_utf16().flat_map(u16::to_be_bytes).collect();
    assert_eq!(judged(be), want);
}

#[test]
fn memory_fraction_legacy_runtime_and_host_ram_messages_are_read() {
    // The memory-fraction / cudaMallocAsync wording, as a FramePack user pasted it (public
    // notes of a ComfyUI session, 2026-05): its figures are read.
    let fraction = "torch.OutOfMemoryError: Allocation on device 0 would exceed allowed memory.\n\
        Currently allocated     : 22.43 GiB\nRequested               : 4.07 GiB\n\
        Device limit            : 16.00 GiB\nFree (according to CUDA): 0 bytes\n";
    let v = judged(fraction.into());
    let m = &v["messages"][0];
    assert_eq!(m["cause"], "shortage", "{v}");
    assert_eq!(m["gpu"], 0, "{v}");
    for (k, gib) in [
        ("requested_bytes", 4.07),
        ("total_bytes", 16.0),
        ("allocated_bytes", 22.43),
    ] {
        let b = m[k].as_f64().unwrap_or_else(|| panic!("{k} in {m}"));
        assert!((b / f64::from(1 << 30) - gib).abs() < 0.006, "{k} {b}");
    }
    // PyTorch 0.4's wording (THC), from pytorch/pytorch issues of 2018.
    let thc = "RuntimeError: cuda runtime error (2) : out of memory at /pytorch/aten/src/THC/generic/THCStorage.cu:66\n";
    let v = judged(thc.into());
    assert_eq!(v["messages"][0]["format"], "driver_legacy", "{v}");
    // Host RAM has its own cause, with the request.
    let cpu = "RuntimeError: [enforce fail at alloc_cpu.cpp:75] . DefaultCPUAllocator: can't allocate memory: you tried to allocate 8589934592 bytes. Error code 12 (Cannot allocate memory)\n";
    let v = judged(cpu.into());
    assert_eq!(v["messages"][0]["cause"], "host_memory", "{v}");
    assert_eq!(
        v["messages"][0]["requested_bytes"], 8_589_934_592_u64,
        "{v}"
    );
}

#[test]
fn progress_bar_logs_are_read_in_bounded_memory_and_pseudo_files_refused() {
    // Lines that end in `\r` only (a progress bar's redraws), 64 MB of them around one
    // message: the message is read (as many times as it stands), each redraw is a line of its
    // own, so nothing grows with the log.
    let msg = std::fs::read_to_string(fixture("008"))
        .unwrap()
        .replace('\n', " ");
    let mut log = Vec::new();
    while log.len() < 64 << 20 {
        for _ in 0..50 {
            log.extend_from_slice(b"  5/10 [00:01<00:01, 3.2it/s]\r");
        }
        log.extend_from_slice(msg.as_bytes());
        log.push(b'\r');
    }
    let v = judged(log);
    let m = &v["messages"].as_array().unwrap();
    assert_eq!(m.len(), 1, "{v}");
    assert!(m[0]["repeats"].as_u64().unwrap() > 1000, "{v}");
    // procfs and sysfs files say size 0 and may yield without end: one line, exit 2.
    for (path, what) in [
        ("/proc/self/pagemap", "a procfs file"),
        ("/proc/self/status", "a procfs file"),
    ] {
        let out = oomprobe()
            .args(["diagnose", "--oom", path])
            .timeout(std::time::Duration::from_secs(10))
            .assert()
            .code(2)
            .get_output()
            .clone();
        let err = String::from_utf8(out.stderr).unwrap();
        assert_eq!(
            err,
            format!("oomprobe: cannot read {path}: it is {what}, not a regular file\n")
        );
    }
}

#[test]
fn a_size_in_exponent_form_is_read_in_either_wording() {
    // PyTorch never prints one, but an edited message may: "1e30 GiB" is past any count of
    // bytes and reads as the largest, a request no card serves.
    let v2 = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1e30 GiB. GPU 0 has a total capacity of 79.15 GiB of which 10.56 MiB is free. Including non-PyTorch memory, this process has 79.13 GiB memory in use. Of the allocated memory 77.52 GiB is allocated by PyTorch, and 1.08 GiB is reserved by PyTorch but unallocated.\n";
    let v1 = "RuntimeError: CUDA out of memory. Tried to allocate 1e30 GiB (GPU 0; 79.15 GiB total capacity; 77.52 GiB already allocated; 10.56 MiB free; 78.60 GiB reserved in total by PyTorch)\n";
    for log in [v2, v1] {
        let v = judged(log.as_bytes().to_vec());
        let m = &v["messages"][0];
        assert_eq!(m["requested_bytes"], u64::MAX, "{v}");
        assert_eq!(m["cause"], "shortage", "{v}");
    }
    // Every figure past any card, beside a workload: judged, not replayed, no panic.
    let all = v2
        .replace("79.15 GiB", "1e30 GiB")
        .replace("10.56 MiB", "1e30 GiB");
    let out = oomprobe()
        .args(["diagnose", "--oom", "-", "--model", "gpt2", "--json"])
        .write_stdin(all)
        .assert()
        .success()
        .get_output()
        .stdout
        .clone();
    let v: Value = serde_json::from_slice(&out).unwrap();
    assert_eq!(v["messages"][0]["total_bytes"], u64::MAX, "{v}");
}

/// Issue 47: a message from a 4090 (23.64 GiB total) with Llama-3-8B at 2048 given: the ways
/// out on that card follow the messages (text) and sit beside them (JSON), each fitting.
#[test]
fn with_a_workload_the_ways_out_are_planned_on_the_messages_card() {
    let args = ["--model", "llama3-8b", "--seq", "2048"];
    let f = fixture("004");
    let v: Value = serde_json::from_str(&stdout(
        oomprobe()
            .args(["diagnose", "--oom", &f, "--json"])
            .args(args),
    ))
    .unwrap();
    let ways = v["ways"]["ways"]
        .as_array()
        .expect("ways beside the messages");
    assert!(!ways.is_empty(), "{v}");
    // The message's total capacity is the memory searched.
    assert_eq!(v["ways"]["memory_bytes"], v["messages"][0]["total_bytes"]);
    assert!(ways.iter().all(|w| w["fits"] == true
        && w["reserved_peak_bytes"].as_u64().unwrap()
            <= v["ways"]["memory_bytes"].as_u64().unwrap()));
    let text = stdout(oomprobe().args(["diagnose", "--oom", &f]).args(args));
    assert!(text.contains("ways out ("), "{text}");
}
