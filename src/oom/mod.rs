//! The out-of-memory messages users paste: found in a log or traceback however it was wrapped
//! ([`scan`]), read to bytes with the rounding of their printed figures ([`parse`]), and judged:
//! fragmentation, another process, the runtime's own memory, or a real shortage ([`judge`]).
//!
//! [`Message`] is the one type every part reads. This floor imports only `alloc::cards` (the card
//! a total capacity names) and `units`.

pub mod explain;
pub mod judge;
pub mod parse;
pub mod scan;

use std::ops::{Add, Sub};

use serde::Serialize;

/// A figure as a message printed it ("23.58 GiB") and the bytes it can stand for: PyTorch prints
/// two decimals of the largest unit that keeps the value ≥ 1 (c10's `format_size`), so
/// "23.58 GiB" is anything in [23.575, 23.585) GiB.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Printed {
    /// The printed value in bytes.
    pub bytes: u64,
    /// The least and most bytes that print this way.
    pub min: u64,
    pub max: u64,
    /// The text as printed.
    pub text: String,
}

impl Printed {
    /// An exact count ("1024 bytes", "132426121216 bytes").
    pub fn exact(bytes: u64, text: &str) -> Printed {
        Printed {
            bytes,
            min: bytes,
            max: bytes,
            text: text.to_string(),
        }
    }

    pub fn range(&self) -> Range {
        Range {
            lo: self.min,
            hi: self.max,
        }
    }
}

/// A figure's interval, if it was printed.
pub fn range(p: &Option<Printed>) -> Option<Range> {
    p.as_ref().map(Printed::range)
}

/// An interval of bytes, for figures derived from rounded ones (signed: a difference of
/// rounded figures can dip below zero).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Range {
    pub lo: u64,
    pub hi: u64,
}

impl Add for Range {
    type Output = Range;
    fn add(self, o: Range) -> Range {
        Range {
            lo: self.lo.saturating_add(o.lo),
            hi: self.hi.saturating_add(o.hi),
        }
    }
}

impl Sub for Range {
    type Output = Range;
    /// `self − o`, floored at zero.
    fn sub(self, o: Range) -> Range {
        Range {
            lo: self.lo.saturating_sub(o.hi),
            hi: self.hi.saturating_sub(o.lo),
        }
    }
}

impl Range {
    pub fn min(self, o: Range) -> Range {
        Range {
            lo: self.lo.min(o.lo),
            hi: self.hi.min(o.hi),
        }
    }
    pub fn mid(self) -> u64 {
        self.lo / 2 + self.hi / 2
    }
}

/// Which text a message is, by its wording (see tests/fixtures/oom/PYTORCH_TEXT_HISTORY.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Format {
    /// PyTorch ≥ 2.1: "GPU n has a total capacity of X of which Y is free. …".
    Cuda2,
    /// PyTorch 1.0–2.0: "(GPU n; X total capacity; Y already allocated; …)".
    Cuda1,
    /// ROCm builds: the 2.x text with "HIP".
    Hip,
    /// Apple: "MPS backend out of memory (MPS allocated: …)".
    Mps,
    /// Intel GPUs.
    Xpu,
    /// Ascend (torch_npu): the 1.x text with "NPU" and "current active".
    Npu,
    /// `DefaultCPUAllocator: can't allocate memory` (host RAM).
    Cpu,
    /// `CUBLAS_STATUS_ALLOC_FAILED`: cuBLAS could not get its workspace or handle.
    Cublas,
    /// cuDNN's allocation failures (and "Unable to find a valid cuDNN algorithm", which is one).
    Cudnn,
    /// `CUDA error: out of memory` from the runtime, with no allocator figures.
    Driver,
    /// PyTorch 0.x `THCudaCheck … error=2` and caffe2's enforce.
    DriverLegacy,
    /// Accelerate's `find_executable_batch_size`: every batch down to 1 ran out.
    Accelerate,
}

impl Format {
    pub fn name(self) -> &'static str {
        match self {
            Format::Cuda2 => "cuda2",
            Format::Cuda1 => "cuda1",
            Format::Hip => "hip",
            Format::Mps => "mps",
            Format::Xpu => "xpu",
            Format::Npu => "npu",
            Format::Cpu => "cpu",
            Format::Cublas => "cublas",
            Format::Cudnn => "cudnn",
            Format::Driver => "driver",
            Format::DriverLegacy => "driver_legacy",
            Format::Accelerate => "accelerate",
        }
    }
}

/// One other process on the card (NVML's list in the 2.x text).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ProcessUse {
    pub pid: u64,
    pub bytes: Printed,
}

/// One out-of-memory message and every figure it printed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Message {
    /// 1-based line of the input where it starts.
    pub line: usize,
    pub format: Format,
    /// "cuda", "hip", "mps", "xpu", "npu", "cpu".
    pub backend: &'static str,
    /// Which release printed this wording, as far as the text tells.
    pub release: &'static str,
    pub gpu: Option<u32>,
    pub requested: Option<Printed>,
    pub total: Option<Printed>,
    pub free: Option<Printed>,
    /// "Including non-PyTorch memory, this process has X memory in use."
    pub process: Option<Printed>,
    pub other_processes: Vec<ProcessUse>,
    /// A `Process N` line taken to be this process seen from a container (no "this process" line,
    /// and its figure is PyTorch's reserved plus less than 3 GiB).
    pub self_as_process: Option<u64>,
    /// `X allowed;` (a per-process memory fraction); MPS's "max allowed".
    pub allowed: Option<Printed>,
    pub allocated: Option<Printed>,
    /// "with X allocated in private pools (e.g., CUDA Graphs)" (part of `allocated`).
    pub private_pools: Option<Printed>,
    /// 2.x "reserved by PyTorch but unallocated"; 1.0–1.3 "cached".
    pub reserved_unallocated: Option<Printed>,
    /// 1.x "reserved in total by PyTorch".
    pub reserved: Option<Printed>,
    /// torch_npu "current active".
    pub active: Option<Printed>,
    /// IBM Large Model Support "inactive".
    pub inactive: Option<Printed>,
    /// MPS "other allocations".
    pub other_allocations: Option<Printed>,
    /// MPS "on private pool" / "on shared pool".
    pub pool: Option<String>,
    /// The allocator hint the message ends with, as printed ("PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True").
    pub hint: Option<String>,
    /// "Current platform can NOT allocate memory block with size larger than 4GB!" (IPEX).
    pub allocation_limit: Option<Printed>,
    /// The text stops before its last figure (a cut paste, or PyTorch's own #126766).
    pub truncated: bool,
    /// Some of the text did not parse and was passed over (a mangled paste); its sizes are in
    /// `unread`.
    pub garbled: bool,
    /// Copies of this same message further on (loggers and retries repeat it).
    pub repeats: usize,
    /// The message as read (lines joined, prefixes dropped).
    pub text: String,
    /// Sizes in the text no field took (empty when the whole message was read).
    pub unread: Vec<String>,
}

impl Message {
    fn r(p: &Option<Printed>) -> Option<Range> {
        range(p)
    }

    /// Reserved but unallocated: printed (2.x, "cached"), or reserved − allocated (1.x).
    pub fn unallocated(&self) -> Option<Range> {
        Self::r(&self.reserved_unallocated)
            .or_else(|| Some(Self::r(&self.reserved)?.sub(Self::r(&self.allocated)?)))
    }

    /// Everything PyTorch's allocator holds: printed (1.x), or allocated + unallocated.
    pub fn reserved_total(&self) -> Option<Range> {
        Self::r(&self.reserved)
            .or_else(|| Some(Self::r(&self.allocated)?.add(Self::r(&self.reserved_unallocated)?)))
    }

    /// This process's own figure: its "this process" line, or the `Process N` line taken as self.
    pub fn own_process(&self) -> Option<Range> {
        Self::r(&self.process).or_else(|| {
            let pid = self.self_as_process?;
            self.other_processes
                .iter()
                .find(|p| p.pid == pid)
                .map(|p| p.bytes.range())
        })
    }

    /// The other processes (the one taken as self left out).
    pub fn others(&self) -> impl Iterator<Item = &ProcessUse> {
        self.other_processes
            .iter()
            .filter(move |p| Some(p.pid) != self.self_as_process)
    }

    pub fn others_total(&self) -> Range {
        self.others()
            .fold(Range { lo: 0, hi: 0 }, |a, p| a.add(p.bytes.range()))
    }

    /// This process's memory outside PyTorch's allocator: its figure − reserved (2.x).
    pub fn non_pytorch(&self) -> Option<Range> {
        Some(self.own_process()?.sub(self.reserved_total()?))
    }

    /// Memory in use that is not this allocator's: total − reserved − free (1.x and HIP, which
    /// cannot say whose it is).
    pub fn outside_allocator(&self) -> Option<Range> {
        let total = Self::r(&self.total)?;
        Some(total.sub(self.reserved_total()?).sub(Self::r(&self.free)?))
    }

    /// What the allocator could still have taken: free, or less under an `allowed` cap
    /// (allowed − reserved); MPS: max allowed − allocated − other allocations.
    pub fn headroom(&self) -> Option<Range> {
        if self.format == Format::Mps {
            let cap = Self::r(&self.allowed)?;
            return Some(
                cap.sub(Self::r(&self.allocated)?)
                    .sub(Self::r(&self.other_allocations)?),
            );
        }
        let free = Self::r(&self.free);
        let capped = match (&self.allowed, self.reserved_total()) {
            (Some(a), Some(r)) => Some(a.range().sub(r)),
            _ => None,
        };
        match (free, capped) {
            (Some(f), Some(c)) => Some(f.min(c)),
            (f, c) => f.or(c),
        }
    }

    /// What would have had to be free besides: requested − headroom (zero when it was there).
    pub fn missing(&self) -> Option<Range> {
        Some(Self::r(&self.requested)?.sub(self.headroom()?))
    }

    /// Whether the message carries the allocator's figures at all.
    pub fn has_figures(&self) -> bool {
        self.allocated.is_some() || self.reserved.is_some() || self.reserved_unallocated.is_some()
    }
}
