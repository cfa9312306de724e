//! A synthetic probe report for tests and exporter previews (not a measurement).
//!
//! Each run is simulated the way the real search proceeds (doubling from a start value, then
//! bisection between the last fit and the first failure) against a closed-form memory model:
//! the plan's bytes `f(x)`, and a "device" that needs `f(x) · overhead + reserve` bytes, so the
//! measured boundary sits a little below the predicted one, as on real hardware.

use crate::backend::DeviceInfo;
use crate::scenario::Scenario;
use crate::workload::{Arch, Attention, Checkpoint, Workload};

use super::model::{Outcome, ProbeRecord, ProbeReport, RunResult, ToolInfo, SCHEMA_VERSION};

/// A workload with every field set (synthetic; not a preset lookup).
pub fn workload(
    name: &str,
    arch: Arch,
    batch: u64,
    seq: u64,
    layers: u64,
    hidden: u64,
) -> Workload {
    let mut w = crate::workload::presets::base(name, arch);
    w.batch = batch;
    w.seq = seq;
    w.layers = layers;
    w.hidden = hidden;
    w.heads = (hidden / 64).max(1);
    w.ffn = hidden * 4;
    w.vocab = 50257;
    w.image = 224;
    w.patch = 16;
    w.max_positions = 1024;
    w.dropout = true;
    w
}

/// How one simulated run behaves.
pub struct SimSpec<'a> {
    pub scenario: Scenario,
    pub variant: Option<&'a str>,
    pub workload: Workload,
    pub start: u64,
    /// The plan's bytes at x.
    pub bytes: &'a dyn Fn(u64) -> u64,
    /// Step time at x (seconds) for fitting probes.
    pub step: &'a dyn Fn(u64) -> f64,
    /// Activation share at x.
    pub activation_share: &'a dyn Fn(u64) -> f64,
}

/// Simulate one run against `capacity` bytes: device need = bytes · 1.04 + 24 MiB.
pub fn simulate(spec: &SimSpec<'_>, capacity: u64) -> RunResult {
    let device_need = |x: u64| ((spec.bytes)(x) as f64 * 1.04) as u64 + (24 << 20);
    let fits = |x: u64| device_need(x) <= capacity;
    let mut probes = Vec::new();
    let record = |x: u64, probes: &mut Vec<ProbeRecord>| -> bool {
        let ok = fits(x);
        let step = (spec.step)(x);
        probes.push(ProbeRecord {
            value: x,
            outcome: if ok { Outcome::Fit } else { Outcome::Budget },
            bytes: (spec.bytes)(x),
            bytes_allocated: if ok {
                (spec.bytes)(x)
            } else {
                capacity.saturating_sub(64 << 20)
            },
            failed_tensor: if ok {
                None
            } else {
                Some("activations.layer3".to_string())
            },
            seconds: 0.2 + if ok { step * 3.0 } else { 0.05 },
            step_seconds: ok.then_some(step),
            checksum: ok.then(|| format!("{:08x}", x.wrapping_mul(2654435761) & 0xffff_ffff)),
            detail: (!ok).then(|| "budget: allocation would pass the budget".to_string()),
            failed_at: None,
            spill: None,
            room: None,
            allocator: None,
            dry: None,
            time_limit_seconds: None,
        });
        ok
    };
    // Doubling, then bisection.
    let mut lo: Option<u64> = None;
    let mut hi: Option<u64> = None;
    let mut x = spec.start.max(1);
    for _ in 0..64 {
        if record(x, &mut probes) {
            lo = Some(x);
            x = x.saturating_mul(2);
        } else {
            hi = Some(x);
            break;
        }
    }
    if let (Some(mut l), Some(mut h)) = (lo, hi) {
        while h - l > 1 && h - l > l / 64 {
            let m = l + (h - l) / 2;
            if record(m, &mut probes) {
                l = m;
            } else {
                h = m;
            }
        }
        lo = Some(l);
        hi = Some(h);
    }
    // The plan's prediction: the largest x whose plan bytes fit the capacity.
    let predicted = {
        let (mut l, mut h) = (0u64, spec.start.max(1));
        while (spec.bytes)(h) <= capacity && h < u64::MAX / 4 {
            l = h;
            h *= 2;
        }
        while h - l > 1 {
            let m = l + (h - l) / 2;
            if (spec.bytes)(m) <= capacity {
                l = m;
            } else {
                h = m;
            }
        }
        (l > 0).then_some(l)
    };
    let bytes_at = lo.map(|l| (spec.bytes)(l));
    RunResult {
        scenario: spec.scenario,
        dimension: spec.scenario.dimension().to_string(),
        variant: spec.variant.map(str::to_string),
        workload: spec.workload.clone(),
        max_fit: lo,
        first_fail: hi,
        fail_reason: hi.map(|_| Outcome::Budget),
        bytes_at_max_fit: bytes_at,
        predicted_max: predicted,
        capacity_bytes: Some(capacity),
        fill_ratio: bytes_at.map(|b| b as f64 / capacity as f64),
        activation_share: lo.map(|l| (spec.activation_share)(l)),
        at: None,
        flaky: false,
        measured_capacity_bytes: None,
        measured_capacity_below: None,
        device_overhead_bytes: None,
        notes: Vec::new(),
        seconds: probes.iter().map(|p| p.seconds).sum(),
        repeats: Vec::new(),
        probes,
        in_progress: false,
    }
}

/// A lavapipe-like device.
pub fn device(name: &str, total: u64) -> DeviceInfo {
    crate::backend::DeviceInfo::sample(name, total)
}

/// A synthetic report of the four scenarios (six runs) against `budget` bytes.
pub fn sample_report(budget: u64) -> ProbeReport {
    const MB: u64 = 1 << 20;
    let params_bytes = |x: u64| x * 16 + 4 * MB;
    let params_step = |x: u64| 0.01 + x as f64 * 2e-9;
    let share0 = |_x: u64| 0.0;
    // A ResNet-like CNN at 64 px: model states ~200 MB, ~3 MB per sample.
    let cnn_bytes = |b: u64| 200 * MB + b * 3_000_000;
    // Step time grows faster than linear past 32 (cache pressure): best throughput below max.
    let cnn_step = |b: u64| 0.05 + 0.01 * b as f64 + 0.0004 * (b.saturating_sub(32) as f64).powi(2);
    let cnn_share = |b: u64| {
        let a = b as f64 * 3e6;
        a / (a + 200.0 * MB as f64)
    };
    // A wide attention block at batch 1: s² scores (naive) vs linear (flash).
    let naive_bytes = |s: u64| 60 * MB + s * 12 * 768 * 4 * 4 + s * s * 12 * 4 * 2;
    let flash_bytes = |s: u64| 60 * MB + s * 12 * 768 * 4 * 4 + s * 12 * 8;
    let seq_step = |s: u64| 0.02 + s as f64 * 1e-5 + (s as f64).powi(2) * 1e-9;
    // gpt2-small-like stack, seq 256: none vs full checkpointing.
    let act_none = |b: u64| 100 * MB + b * 28 * MB;
    let act_full = |b: u64| 100 * MB + 20 * MB + b * 5 * MB;
    let act_step = |b: u64| 0.1 + 0.03 * b as f64;
    let share_none = |b: u64| (b * 28) as f64 / (100 + b * 28) as f64;
    let share_full = |b: u64| (20 + b * 5) as f64 / (120 + b * 5) as f64;

    let mut dense = workload("params", Arch::Dense, 1, 1, 0, 0);
    dense.params = Some(1_000_000);
    let mut cnn = workload("resnet50", Arch::Resnet, 1, 1, 50, 0);
    cnn.image = 64;
    let naive = workload("gpt2-attn", Arch::Gpt2, 1, 512, 1, 768);
    let mut flash = naive.clone();
    flash.attention = Attention::Flash;
    let stack = workload("gpt2", Arch::Gpt2, 1, 256, 12, 768);
    let mut stack_full = stack.clone();
    stack_full.checkpoint = Checkpoint::Full;

    let specs = [
        SimSpec {
            scenario: Scenario::Params,
            variant: None,
            workload: dense,
            start: 1_000_000,
            bytes: &params_bytes,
            step: &params_step,
            activation_share: &share0,
        },
        SimSpec {
            scenario: Scenario::Batch,
            variant: None,
            workload: cnn,
            start: 1,
            bytes: &cnn_bytes,
            step: &cnn_step,
            activation_share: &cnn_share,
        },
        SimSpec {
            scenario: Scenario::Seq,
            variant: Some("naive"),
            workload: naive,
            start: 128,
            bytes: &naive_bytes,
            step: &seq_step,
            activation_share: &share0,
        },
        SimSpec {
            scenario: Scenario::Seq,
            variant: Some("flash"),
            workload: flash,
            start: 128,
            bytes: &flash_bytes,
            step: &seq_step,
            activation_share: &share0,
        },
        SimSpec {
            scenario: Scenario::Activations,
            variant: Some("checkpoint none"),
            workload: stack,
            start: 1,
            bytes: &act_none,
            step: &act_step,
            activation_share: &share_none,
        },
        SimSpec {
            scenario: Scenario::Activations,
            variant: Some("checkpoint full"),
            workload: stack_full,
            start: 1,
            bytes: &act_full,
            step: &act_step,
            activation_share: &share_full,
        },
    ];
    ProbeReport {
        schema_version: SCHEMA_VERSION,
        tool: ToolInfo::default(),
        device: device("llvmpipe (LLVM 15.0.6, 256 bits) [synthetic]", 2 << 30),
        budget_bytes: Some(budget),
        compute: Some("touch".to_string()),
        runs: specs.iter().map(|s| simulate(s, budget)).collect(),
        in_progress: false,
    }
}
