//! A judged message for people (the cause in one line first, then the evidence and remedies)
//! and for programs (`--json`: every figure in bytes, with the interval its rounding allows).

use std::collections::BTreeMap;

use serde::Serialize;

use super::judge::Judgement;
use super::{Format, Message, Printed, Range};

/// The most messages the text view lists one by one (`--json` has them all).
pub const TEXT_MESSAGES: usize = 8;

#[derive(Debug, Clone, Serialize)]
pub struct OtherProcess {
    pub pid: u64,
    pub bytes: u64,
}

/// One message for `--json`.
#[derive(Debug, Clone, Serialize)]
pub struct Entry {
    pub line: usize,
    pub repeats: usize,
    pub format: Format,
    pub backend: &'static str,
    pub release: &'static str,
    pub gpu: Option<u32>,
    pub requested_bytes: Option<u64>,
    pub total_bytes: Option<u64>,
    pub free_bytes: Option<u64>,
    pub process_bytes: Option<u64>,
    pub other_processes: Vec<OtherProcess>,
    /// The `Process N` line taken to be this process (containers).
    pub self_as_process: Option<u64>,
    pub allowed_bytes: Option<u64>,
    pub allocated_bytes: Option<u64>,
    pub private_pool_bytes: Option<u64>,
    pub reserved_unallocated_bytes: Option<u64>,
    pub reserved_bytes: Option<u64>,
    pub active_bytes: Option<u64>,
    pub inactive_bytes: Option<u64>,
    pub other_allocations_bytes: Option<u64>,
    /// Derived: this process outside PyTorch's allocator (2.x).
    pub non_pytorch_bytes: Option<u64>,
    /// Derived: what would have had to be free besides (requested − headroom).
    pub missing_bytes: Option<u64>,
    /// [least, most] bytes each figure can be, by the rounding of what was printed.
    pub bounds: BTreeMap<&'static str, [u64; 2]>,
    pub truncated: bool,
    pub hint: Option<String>,
    #[serde(flatten)]
    pub judgement: Judgement,
    pub text: String,
}

fn bytes(p: &Option<Printed>) -> Option<u64> {
    p.as_ref().map(|p| p.bytes)
}

pub fn entry(m: &Message, j: &Judgement) -> Entry {
    let mut bounds = BTreeMap::new();
    let printed: [(&'static str, &Option<Printed>); 12] = [
        ("requested_bytes", &m.requested),
        ("total_bytes", &m.total),
        ("free_bytes", &m.free),
        ("process_bytes", &m.process),
        ("allowed_bytes", &m.allowed),
        ("allocated_bytes", &m.allocated),
        ("private_pool_bytes", &m.private_pools),
        ("reserved_unallocated_bytes", &m.reserved_unallocated),
        ("reserved_bytes", &m.reserved),
        ("active_bytes", &m.active),
        ("inactive_bytes", &m.inactive),
        ("other_allocations_bytes", &m.other_allocations),
    ];
    for (k, p) in printed {
        if let Some(p) = p {
            bounds.insert(k, [p.min, p.max]);
        }
    }
    let derived: [(&'static str, Option<Range>); 2] = [
        ("non_pytorch_bytes", m.non_pytorch()),
        ("missing_bytes", m.missing()),
    ];
    for (k, r) in derived {
        if let Some(r) = r {
            bounds.insert(k, [r.lo, r.hi]);
        }
    }
    Entry {
        line: m.line,
        repeats: m.repeats,
        format: m.format,
        backend: m.backend,
        release: m.release,
        gpu: m.gpu,
        requested_bytes: bytes(&m.requested),
        total_bytes: bytes(&m.total),
        free_bytes: bytes(&m.free),
        process_bytes: bytes(&m.process),
        other_processes: m
            .other_processes
            .iter()
            .map(|p| OtherProcess {
                pid: p.pid,
                bytes: p.bytes.bytes,
            })
            .collect(),
        self_as_process: m.self_as_process,
        allowed_bytes: bytes(&m.allowed),
        allocated_bytes: bytes(&m.allocated),
        private_pool_bytes: bytes(&m.private_pools),
        reserved_unallocated_bytes: bytes(&m.reserved_unallocated),
        reserved_bytes: bytes(&m.reserved),
        active_bytes: bytes(&m.active),
        inactive_bytes: bytes(&m.inactive),
        other_allocations_bytes: bytes(&m.other_allocations),
        non_pytorch_bytes: m.non_pytorch().map(|r| r.mid()),
        missing_bytes: m.missing().map(|r| r.mid()),
        bounds,
        truncated: m.truncated,
        hint: m.hint.clone(),
        judgement: j.clone(),
        text: m.text.clone(),
    }
}

fn what(m: &Message) -> String {
    let kind = match m.format {
        Format::Cuda2 | Format::Cuda1 => "CUDA out of memory",
        Format::Hip => "HIP out of memory",
        Format::Mps => "MPS backend out of memory",
        Format::Xpu => "XPU out of memory",
        Format::Npu => "NPU out of memory",
        Format::Cpu => "CPU allocator",
        Format::Cublas => "cuBLAS allocation failure",
        Format::Cudnn => "cuDNN allocation failure",
        Format::Driver | Format::DriverLegacy => "CUDA runtime out of memory",
        Format::Accelerate => "Accelerate batch-size search",
    };
    let mut s = format!("line {}: {kind}", m.line);
    if !m.release.is_empty() && m.release != "any" {
        s += &format!(", {} text", m.release);
    }
    if let Some(g) = m.gpu {
        s += &format!(", GPU {g}");
    }
    if m.repeats > 0 {
        s += &format!(
            " (and {} more time{})",
            m.repeats,
            if m.repeats == 1 { "" } else { "s" }
        );
    }
    s
}

/// One message for people.
pub fn text(m: &Message, j: &Judgement, extra: &[String]) -> String {
    let mut out = String::new();
    let first = &j.causes[0];
    out += &format!("{}: {}\n", first.cause.name(), first.reason);
    out += &format!("  {}\n", what(m));
    if j.borderline {
        out +=
            "  borderline: the deciding comparison is within the rounding of the printed figures\n";
    }
    for f in &j.causes[1..] {
        out += &format!("  also {}: {}\n", f.cause.name(), f.reason);
    }
    for e in &j.evidence {
        out += &format!("  {e}\n");
    }
    if !j.remedies.is_empty() {
        out += "  remedies:\n";
        for r in &j.remedies {
            out += &format!("    {}\n      -> {}\n", r.action, r.effect);
        }
    }
    for e in extra {
        out += &format!("  {e}\n");
    }
    out
}
