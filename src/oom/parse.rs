//! One message's text to its figures: the message's head names the format, then its sentences
//! are read in order, each by one clause, until none fits (where a paste was cut or garbled).
//!
//! The wordings are PyTorch's (c10/cuda/CUDACachingAllocator.cpp from 1.0's
//! THCCachingAllocator.cpp to 001074d, MPSAllocator.mm, c10/core/impl/alloc_cpu.cpp) and the
//! variants the corpus shows (tests/fixtures/oom/PYTORCH_TEXT_HISTORY.md).

use std::sync::LazyLock;

use regex::{Captures, Regex};

use super::{Format, Message, Printed, ProcessUse};

/// A printed size: c10's `format_size` ("1024 bytes", "22.00 KiB", "23.58 GiB"); older MPS
/// builds print "GB"/"MB" with the same binary units (MPSAllocator.mm's own `format_size`).
/// A number in exponent form ("1e30 GiB") is read too: PyTorch never prints one, but a message
/// edited by hand or by another tool may carry it, and it is still a message.
pub const SIZE: &str = r"(\d+(?:\.\d+)?(?:[eE][+-]?\d+)?) ?(bytes|KiB|MiB|GiB|TiB|KB|MB|GB|TB)\b";

/// A size's text to bytes and the interval that prints the same.
pub fn size(num: &str, unit: &str) -> Option<Printed> {
    let text = format!("{num} {unit}");
    let scale: u64 = match unit {
        "bytes" => 1,
        "KiB" | "KB" => 1 << 10,
        "MiB" | "MB" => 1 << 20,
        "GiB" | "GB" => 1 << 30,
        "TiB" | "TB" => 1 << 40,
        _ => return None,
    };
    if num.contains(['e', 'E']) {
        // Exponent form: the value as a float, saturated at the largest count of bytes.
        let v = num.parse::<f64>().ok()? * scale as f64;
        let bytes = if v.is_finite() && v < u64::MAX as f64 {
            v as u64
        } else {
            u64::MAX
        };
        return Some(Printed {
            bytes,
            min: bytes,
            max: bytes,
            text,
        });
    }
    let (int, frac) = num.split_once('.').unwrap_or((num, ""));
    let int: u64 = int.parse().ok()?;
    if frac.is_empty() {
        // Integers: exact for "N bytes"; a unit's integer means ± half a unit.
        let bytes = int.checked_mul(scale)?;
        let half = if scale == 1 { 0 } else { scale / 2 };
        return Some(Printed {
            bytes,
            min: bytes.saturating_sub(half),
            max: bytes.saturating_add(half),
            text,
        });
    }
    let digits = frac.len().min(6) as u32;
    let frac: u64 = frac[..digits as usize].parse().ok()?;
    let den = 10u128.pow(digits);
    // In units of 1/(2·den): the value is 2n, its interval [2n − 1, 2n + 1) (half of the last
    // printed digit either side).
    let n = int as u128 * den + frac as u128;
    let scale = scale as u128;
    let at = |twice: u128, up: bool| -> Option<u64> {
        let num = twice * scale;
        let d = 2 * den;
        u64::try_from(if up { num.div_ceil(d) } else { num / d }).ok()
    };
    Some(Printed {
        bytes: at(2 * n, false)?,
        min: at((2 * n).saturating_sub(1), false)?,
        max: at(2 * n + 1, true)?,
        text,
    })
}

fn sz(c: &Captures, i: usize) -> Option<Printed> {
    size(c.get(i)?.as_str(), c.get(i + 1)?.as_str())
}

fn re(pattern: &str) -> Regex {
    Regex::new(&pattern.replace("{SIZE}", SIZE)).expect("clause pattern")
}

/// The heads that start a message, one alternation: the leftmost wins.
pub static HEAD: LazyLock<Regex> = LazyLock::new(|| {
    re(concat!(
        r"(?P<dev>CUDA|HIP|XPU|NPU) out of memory\.?",
        r"|(?P<mps>MPS backend out of memory)",
        r"|(?P<limit>Current platform can NOT allocate memory block with size larger than (?P<limnum>\d+) ?(?P<limunit>GB)!)",
        r"|(?P<tried>Tried to allocate) ",
        r"|(?P<paren>\((?:GPU|NPU) +\d+; {SIZE} total capacity)",
        r"|(?P<driver>CUDA error: out of memory)",
        r"|(?P<cpu>DefaultCPUAllocator: (?:can't allocate memory|not enough memory): you tried to allocate (?P<cpubytes>\d+) bytes\.?(?: Error code (?P<errno>\d+) \([^)]*\))?)",
        r"|(?P<memalign>posix_memalign\(&data, gAlignment, nbytes\) == 0\. 12 vs 0)",
        r"|(?P<cublas>CUBLAS_STATUS_ALLOC_FAILED(?: when calling `[^`]*`)?)",
        r"|(?P<cudnn>CUDNN_STATUS_ALLOC_FAILED|CUDNN_STATUS_NOT_ENOUGH_WORKSPACE|Unable to find a valid cuDNN algorithm to run \w+)",
        r"|(?P<thc>THCudaCheck FAIL file=\S+ line=\d+ error=2 : out of memory|cuda runtime error \(2\) : out of memory at \S+)",
        r"|(?P<fraction>Allocation on device (?:(?P<fdev>\d+) )?would exceed allowed memory\.?(?: \(out of memory\))?)",
        r"|(?P<caffe2>error == cudaSuccess\. 2 vs 0\. Error at: \S+: out of memory)",
        r"|(?P<accelerate>No executable batch size found, reached zero\.?)",
    ))
});

/// One sentence of the allocator text and what it sets.
enum Clause {
    Requested,
    MpsRequested,
    Total2,
    Process,
    ThisProcess,
    Allowed,
    Allocated2,
    PrivatePools,
    Unallocated2,
    Hint2,
    Hint1,
    Docs,
    EmptyCache,
    Open1,
    Total1,
    Allocated1,
    Active,
    Free1,
    Reserved1,
    Cached,
    Inactive,
    Mps,
    MpsHint,
}

static CLAUSES: LazyLock<Vec<(Clause, Regex)>> = LazyLock::new(|| {
    use Clause::*;
    vec![
        (
            MpsRequested,
            re(r"^Tried to allocate {SIZE} on (private|shared) pool"),
        ),
        (Requested, re(r"^Tried to allocate {SIZE}")),
        (
            Total2,
            re(
                r"^(?:GPU|Device) +(\d+) has a total (capacity|capacty) of {SIZE}(?: of which {SIZE} is free)?",
            ),
        ),
        (Process, re(r"^Process (\d+) has {SIZE} memory in use")),
        (
            ThisProcess,
            re(r"^(?:Including non-PyTorch memory, )?this process has {SIZE} memory in use"),
        ),
        (Allowed, re(r"^{SIZE} allowed")),
        (
            Allocated2,
            re(r"^(?:Of the allocated memory )?{SIZE} is allocated by (?i:pytorch)"),
        ),
        (
            PrivatePools,
            re(r"^with {SIZE} allocated in private pools \(e\.g\., CUDA Graphs\)"),
        ),
        (
            Unallocated2,
            re(r"^and {SIZE} is reserved by (?i:pytorch) but unallocated"),
        ),
        (
            Hint2,
            re(
                r"^If reserved but unallocated memory is large try setting (PYTORCH_\w*ALLOC_CONF=expandable_segments:True|max_split_size_mb) to avoid fragmentation",
            ),
        ),
        (
            Hint1,
            re(
                r"^If reserved memory is >> allocated memory try setting (max_split_size_mb) to avoid fragmentation",
            ),
        ),
        (
            Docs,
            re(
                r"^See documentation for Memory Management(?: and PYTORCH_CUDA_ALLOC_CONF)?(?:\s*\(\s*https?://[^\s)]+\s*\))?",
            ),
        ),
        (
            EmptyCache,
            re(r"^Please use `empty_cache` to release all unoccupied cached memory"),
        ),
        (Open1, re(r"^\((?:GPU|NPU|XPU) +(\d+);")),
        (Total1, re(r"^{SIZE} total capacity")),
        (Allocated1, re(r"^{SIZE} already allocated")),
        (Active, re(r"^{SIZE} current active")),
        (Free1, re(r"^{SIZE} free\b")),
        (Reserved1, re(r"^{SIZE} reserved in total by (?i:pytorch)")),
        (Cached, re(r"^{SIZE} cached")),
        (Inactive, re(r"^{SIZE} inactive")),
        (
            Mps,
            re(r"^\(MPS allocated: {SIZE}, other allocations: {SIZE}, max allowed: {SIZE}\)"),
        ),
        (
            MpsHint,
            re(
                r"^Use PYTORCH_MPS_HIGH_WATERMARK_RATIO=0\.0 to disable upper limit for memory allocations(?: \(may cause system failure\))?",
            ),
        ),
    ]
});

/// How far past a sentence that does not parse the next one is looked for.
const RESYNC: usize = 160;

fn clause_at(flat: &str, p: usize) -> Option<(&'static Clause, Captures<'_>)> {
    let rest = &flat[p..];
    CLAUSES
        .iter()
        .find_map(|(k, r)| r.captures(rest).map(|c| (k, c)))
}

/// What may sit between two sentences.
fn skip_separators(s: &str, mut p: usize) -> usize {
    let b = s.as_bytes();
    while p < b.len() && matches!(b[p], b' ' | b'.' | b',' | b';' | b')' | b'\t') {
        p += 1;
    }
    p
}

static ANY_SIZE: LazyLock<Regex> = LazyLock::new(|| re(SIZE));

fn empty(line: usize, format: Format, backend: &'static str, release: &'static str) -> Message {
    Message {
        line,
        format,
        backend,
        release,
        gpu: None,
        requested: None,
        total: None,
        free: None,
        process: None,
        other_processes: Vec::new(),
        self_as_process: None,
        allowed: None,
        allocated: None,
        private_pools: None,
        reserved_unallocated: None,
        reserved: None,
        active: None,
        inactive: None,
        other_allocations: None,
        pool: None,
        hint: None,
        allocation_limit: None,
        truncated: false,
        garbled: false,
        repeats: 0,
        text: String::new(),
        unread: Vec::new(),
    }
}

/// Parse the message whose head starts at `start` of `flat` (lines joined); `line` is the input
/// line there. Returns the message (None: a head with no figure after it, as in prose that only
/// names the error) and where its text ends.
pub fn message(flat: &str, start: usize, line: usize) -> Option<(Message, usize)> {
    let c = HEAD.captures_at(flat, start)?;
    let head = c.get(0)?;
    let mut end = head.end();
    let named = |n: &str| c.name(n).is_some();
    let mut m = if named("dev") {
        let (backend, format) = match &c["dev"] {
            "HIP" => ("hip", Format::Hip),
            "XPU" => ("xpu", Format::Xpu),
            "NPU" => ("npu", Format::Npu),
            _ => ("cuda", Format::Cuda2),
        };
        empty(line, format, backend, "")
    } else if named("limit") {
        // IPEX on some platforms refuses any single allocation over 4 GB.
        let mut m = empty(line, Format::Xpu, "xpu", "");
        m.allocation_limit = size(&c["limnum"], &c["limunit"]);
        m
    } else if named("mps") {
        empty(line, Format::Mps, "mps", "PyTorch ≥ 2.0 (MPS)")
    } else if named("tried") || named("paren") {
        // A message whose head was cut off: the figures tell the format.
        end = head.start();
        empty(line, Format::Cuda2, "cuda", "")
    } else if named("driver") {
        let mut m = empty(line, Format::Driver, "cuda", "any");
        end = driver_tail(flat, end);
        m.text = flat[head.start()..end].trim().to_string();
        return Some((m, end));
    } else if named("fraction") {
        let mut m = empty(
            line,
            Format::Cuda2,
            "cuda",
            "PyTorch ≥ 2.1 (memory fraction or cudaMallocAsync)",
        );
        m.gpu = c.name("fdev").and_then(|d| d.as_str().parse().ok());
        end = fraction_figures(flat, end, &mut m);
        m.text = flat[head.start()..end].trim().to_string();
        return Some((m, end));
    } else if named("cpu") || named("memalign") {
        let mut m = empty(
            line,
            Format::Cpu,
            "cpu",
            if named("memalign") {
                "PyTorch ≤ 1.1"
            } else {
                "PyTorch ≥ 1.2"
            },
        );
        if let Some(b) = c.name("cpubytes") {
            let n: u64 = b.as_str().parse().ok()?;
            m.requested = Some(Printed::exact(n, &format!("{n} bytes")));
        }
        m.text = head.as_str().to_string();
        return Some((m, end));
    } else {
        let (format, release) = if named("cublas") {
            (Format::Cublas, "any")
        } else if named("cudnn") {
            (Format::Cudnn, "any")
        } else if named("thc") || named("caffe2") {
            (Format::DriverLegacy, "PyTorch 0.x / caffe2")
        } else {
            (Format::Accelerate, "Accelerate")
        };
        let mut m = empty(line, format, "cuda", release);
        m.text = head.as_str().to_string();
        return Some((m, end));
    };

    let mut figures = 0usize;
    let mut said = Wording::default();
    let mut skipped: Vec<&str> = Vec::new();
    loop {
        let mut p = skip_separators(flat, end);
        let mut found = clause_at(flat, p);
        if found.is_none() && figures > 0 && !complete(&m, said.one_x || said.cached_text) {
            // A garbled paste ("of which 0 bytes i emory 10.65 GiB is allocated"): read on
            // from the next sentence that parses, and keep what was passed over.
            if let Some(q) = (p + 1..(p + RESYNC).min(flat.len()))
                .filter(|&q| flat.is_char_boundary(q))
                .find(|&q| clause_at(flat, q).is_some())
            {
                skipped.push(&flat[p..q]);
                p = q;
                found = clause_at(flat, q);
            }
        }
        let Some((clause, caps)) = found else {
            break;
        };
        read_clause(&mut m, clause, &caps, &mut said)?;
        figures += ANY_SIZE
            .find_iter(caps.get(0).map_or("", |g| g.as_str()))
            .count();
        end = p + caps.get(0).map_or(0, |g| g.end());
    }
    if figures == 0 {
        return None;
    }
    if said.one_x && matches!(m.format, Format::Cuda2) {
        m.format = Format::Cuda1;
    }
    m.release = release(&m, said.capacty, said.one_x, said.cached_text);
    m.truncated = !complete(&m, said.one_x || said.cached_text);
    m.self_as_process = self_as_process(&m);
    m.text = flat[head.start()..end].trim().to_string();
    // Figures passed over, and (when the text stops short) sizes right after where reading
    // stopped, in the same sentence: figures left unread.
    m.garbled = !skipped.is_empty();
    m.unread = skipped
        .iter()
        .flat_map(|t| ANY_SIZE.find_iter(t).map(|x| x.as_str().to_string()))
        .collect();
    if m.truncated {
        let mut tail_end = flat[end..]
            .find(". ")
            .map_or(flat.len(), |i| end + i)
            .min(end + 200)
            .min(flat.len());
        while !flat.is_char_boundary(tail_end) {
            tail_end -= 1;
        }
        m.unread.extend(
            ANY_SIZE
                .find_iter(&flat[end..tail_end])
                .map(|x| x.as_str().to_string()),
        );
    }
    Some((m, end))
}

/// What a message's wording says besides its figures (it dates the release that printed it).
#[derive(Debug, Default)]
struct Wording {
    /// "has a total capacty of" (the misspelling PyTorch 2.1 printed).
    capacty: bool,
    /// The 1.x layout: "(GPU N; … total capacity; …)".
    one_x: bool,
    /// "… cached" for reserved-but-unallocated (PyTorch 1.0-1.3).
    cached_text: bool,
}

/// Read one clause's figures into `m` (None: a figure it must have did not parse).
fn read_clause(
    m: &mut Message,
    clause: &Clause,
    caps: &Captures,
    said: &mut Wording,
) -> Option<()> {
    use Clause::*;
    match clause {
        Requested => m.requested = sz(caps, 1),
        MpsRequested => {
            m.requested = sz(caps, 1);
            m.pool = Some(caps[3].to_string());
        }
        Total2 => {
            m.gpu = caps[1].parse().ok();
            said.capacty = &caps[2] == "capacty";
            m.total = sz(caps, 3);
            m.free = sz(caps, 5);
        }
        Process => m.other_processes.push(ProcessUse {
            pid: caps[1].parse().unwrap_or(0),
            bytes: sz(caps, 2)?,
        }),
        ThisProcess => m.process = sz(caps, 1),
        Allowed => m.allowed = sz(caps, 1),
        Allocated2 => m.allocated = sz(caps, 1),
        PrivatePools => m.private_pools = sz(caps, 1),
        Unallocated2 => m.reserved_unallocated = sz(caps, 1),
        Hint2 | Hint1 => m.hint = Some(caps[1].to_string()),
        Docs | EmptyCache | MpsHint => {}
        Open1 => {
            said.one_x = true;
            m.gpu = caps[1].parse().ok();
        }
        Total1 => {
            said.one_x = true;
            m.total = sz(caps, 1);
        }
        Allocated1 => m.allocated = sz(caps, 1),
        Active => m.active = sz(caps, 1),
        Free1 => m.free = sz(caps, 1),
        Reserved1 => m.reserved = sz(caps, 1),
        Cached => {
            said.cached_text = true;
            m.reserved_unallocated = sz(caps, 1);
        }
        Inactive => m.inactive = sz(caps, 1),
        Mps => {
            m.allocated = sz(caps, 1);
            m.other_allocations = sz(caps, 3);
            m.allowed = sz(caps, 5);
        }
    }
    Some(())
}

/// The runtime's text after `CUDA error: out of memory`, as far as it goes.
/// The figures after "Allocation on device N would exceed allowed memory": the message of
/// `set_per_process_memory_fraction` and of cudaMallocAsync, one "name : size" per line
/// ("Currently allocated : …", "Requested : …", "Device limit : …", "Free (according to CUDA):
/// …", "PyTorch limit (set by user-supplied memory fraction) : …"). Where its text ends.
fn fraction_figures(flat: &str, mut end: usize, m: &mut Message) -> usize {
    static FIELD: LazyLock<Regex> = LazyLock::new(|| {
        re(
            r"^ ?(Currently allocated|Requested|Device limit|Free \(according to CUDA\)|PyTorch limit \(set by user-supplied memory fraction\)) *: *{SIZE}",
        )
    });
    while let Some(c) = FIELD.captures(&flat[end..]) {
        let v = sz(&c, 2);
        match &c[1] {
            "Currently allocated" => m.allocated = v,
            "Requested" => m.requested = v,
            "Device limit" => m.total = v,
            "Free (according to CUDA)" => m.free = v,
            _ => m.allowed = v,
        }
        end += c.get(0).map_or(0, |g| g.end());
    }
    end
}

fn driver_tail(flat: &str, mut end: usize) -> usize {
    static TAIL: LazyLock<Vec<Regex>> = LazyLock::new(|| {
        vec![
            re(r"^ ?Search for `cudaErrorMemoryAllocation' in \S+ for more information\."),
            re(
                r"^ ?CUDA kernel errors might be asynchronously reported at some other API call, ?so (?:t ?he|the) stacktrace below might be incorrect\.",
            ),
            re(r"^ ?For debugging consider passing CUDA_LAUNCH_BLOCKING=1\.?"),
            re(r"^ ?Compile with `TORCH_USE_CUDA_DSA` to enable device-side assertions\."),
        ]
    });
    while let Some(m) = TAIL.iter().find_map(|r| r.find(&flat[end..])) {
        end += m.end();
    }
    end
}

/// Whether the message printed every figure its format has.
fn complete(m: &Message, one_x: bool) -> bool {
    match m.format {
        Format::Mps => m.requested.is_some() && m.allowed.is_some(),
        _ if one_x => m.reserved.is_some() || m.reserved_unallocated.is_some(),
        _ => m.reserved_unallocated.is_some(),
    }
}

/// Which releases print this wording.
fn release(m: &Message, capacty: bool, one_x: bool, cached: bool) -> &'static str {
    match m.format {
        Format::Mps => "PyTorch ≥ 2.0 (MPS)",
        Format::Hip => "PyTorch ≥ 2.1 (ROCm)",
        Format::Xpu if one_x => "IPEX 1.x",
        Format::Xpu => "PyTorch ≥ 2.4 (XPU)",
        Format::Npu => "torch_npu",
        _ if cached => "PyTorch 1.0-1.3",
        _ if one_x && m.hint.is_some() => "PyTorch 1.10-2.0",
        _ if one_x => "PyTorch 1.4-1.9",
        _ if capacty => "PyTorch 2.1",
        _ if m.private_pools.is_some() => "PyTorch ≥ 2.5",
        _ if m
            .hint
            .as_deref()
            .is_some_and(|h| h.starts_with("PYTORCH_ALLOC_CONF")) =>
        {
            "PyTorch ≥ 2.9"
        }
        _ if m.hint.as_deref() == Some("max_split_size_mb") => "PyTorch 2.1",
        _ if m.hint.is_some() => "PyTorch ≥ 2.2",
        _ => "PyTorch ≥ 2.1",
    }
}

/// Headroom above PyTorch's reserved for what a process holds outside it (context, cuBLAS,
/// NCCL): a `Process N` line within it is this process seen from a container.
const SELF_MARGIN: u64 = 3 << 30;

/// With no "this process" line, NVML may still list this process under a pid the container
/// does not know: the `Process N` line closest above PyTorch's reserved, within 3 GiB.
fn self_as_process(m: &Message) -> Option<u64> {
    if m.process.is_some() {
        return None;
    }
    let reserved = m.reserved_total()?;
    m.other_processes
        .iter()
        .filter(|p| p.bytes.max >= reserved.lo && p.bytes.min <= reserved.hi + SELF_MARGIN)
        .min_by_key(|p| p.bytes.bytes.abs_diff(reserved.mid()))
        .map(|p| p.pid)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_carry_the_interval_of_their_last_digit() {
        let p = size("23.58", "GiB").unwrap();
        let g = 1u64 << 30;
        assert_eq!(p.bytes, 2358 * g / 100);
        assert_eq!(p.min, 47_150 * g / 2000);
        assert_eq!(p.max, (47_170 * g).div_ceil(2000));
        let b = size("1024", "bytes").unwrap();
        assert_eq!((b.min, b.bytes, b.max), (1024, 1024, 1024));
        assert_eq!(size("0", "bytes").unwrap().max, 0);
    }

    #[test]
    fn a_head_with_no_figure_is_no_message() {
        assert!(message("I hit CUDA out of memory again", 2, 1).is_none());
        assert!(message("CUDA out of memory. Tried to allocate 2.3", 0, 1).is_none());
    }

    #[test]
    fn the_2x_text_reads_to_every_figure() {
        let t = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 86.00 MiB. GPU 0 has a total capacity of 23.64 GiB of which 264.00 MiB is free. Process 2086283 has 419.48 MiB memory in use. Including non-PyTorch memory, this process has 8.04 GiB memory in use. Process 2797307 has 14.85 GiB memory in use. Of the allocated memory 7.63 GiB is allocated by PyTorch, and 40.11 MiB is reserved by PyTorch but unallocated. If reserved but unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See documentation for Memory Management  (https://pytorch.org/docs/stable/notes/cuda.html#environment-variables) Exiting";
        let (m, end) = message(t, 0, 1).unwrap();
        assert_eq!(m.format, Format::Cuda2);
        assert_eq!(m.requested.unwrap().text, "86.00 MiB");
        assert_eq!(m.free.unwrap().text, "264.00 MiB");
        assert_eq!(m.other_processes.len(), 2);
        assert_eq!(m.process.unwrap().text, "8.04 GiB");
        assert_eq!(m.reserved_unallocated.unwrap().text, "40.11 MiB");
        assert!(!m.truncated);
        assert!(m.unread.is_empty());
        assert_eq!(&t[end..], " Exiting");
    }
}
