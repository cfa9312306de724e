//! What a message's figures say caused it: `fragmentation`, `other_process`, `non_pytorch`,
//! `shortage`, or `unknown` when they cannot tell. The rules are the ones the corpus was labelled
//! by, by hand, before this code existed (tests/fixtures/oom/SOURCES.md, "How the labels were
//! decided"), checked in this order:
//!
//! 1. the request is larger than the card (or an `allowed` cap): `shortage`;
//! 2. the headroom was at least the request + 256 MiB, or free > total: `unknown`;
//! 3. other processes hold at least the shortfall: `other_process`;
//! 4. reserved-but-unallocated ≥ the request: `fragmentation`;
//! 5. with no process lines at all (1.x, HIP, Windows): more than 2 GiB in use outside this
//!    allocator that, less 1 GiB for context and display, still covers the shortfall:
//!    `other_process` (the message cannot tell whose);
//! 6. this process's non-PyTorch memory (MPS: other allocations) over 2 GiB and ≥ the
//!    shortfall: `non_pytorch`;
//! 7. otherwise `shortage`. A message with no allocator figures is `unknown`.

use std::ops::Sub;

use serde::Serialize;

use crate::alloc::cards::{Card, CARDS};
use crate::units::fmt_bytes;

use super::{range, Format, Message, Range};

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;
/// Free memory this far above the request should have served it (the allocator asks the
/// driver for at most the request rounded to 2 MiB, or a 20 MiB segment for small ones).
const UNEXPLAINED_MARGIN: u64 = 256 * MIB;
/// Memory outside the allocator that is more than a context, cuBLAS and a display hold.
const LARGE_OUTSIDE: u64 = 2 * GIB;
/// What a context and a display may hold when the message cannot say whose memory it is.
const CONTEXT_ALLOWANCE: u64 = GIB;
/// A card of the table matches a printed total within this share.
const CARD_TOLERANCE: f64 = 0.0015;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Cause {
    Fragmentation,
    OtherProcess,
    NonPytorch,
    Shortage,
    /// Host RAM, not the GPU: the CPU allocator was refused.
    HostMemory,
    Unknown,
}

impl Cause {
    pub fn name(self) -> &'static str {
        match self {
            Cause::Fragmentation => "fragmentation",
            Cause::OtherProcess => "other_process",
            Cause::NonPytorch => "non_pytorch",
            Cause::Shortage => "shortage",
            Cause::HostMemory => "host_memory",
            Cause::Unknown => "unknown",
        }
    }
}

/// One cause the figures support, with the bytes it accounts for.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Finding {
    pub cause: Cause,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bytes: Option<u64>,
    pub reason: String,
}

/// A remedy for one cause.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Remedy {
    pub cause: Cause,
    pub action: String,
    pub effect: String,
}

/// The card a message's total capacity names.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CardMatch {
    pub ids: Vec<&'static str>,
    pub name: &'static str,
    pub total_bytes: u64,
    /// What a process typically holds outside PyTorch on it (docs/validation.md, "The cards").
    pub typical_non_pytorch_bytes: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Judgement {
    pub cause: Cause,
    /// The first is `cause`; the others the figures also support, most bytes first.
    pub causes: Vec<Finding>,
    /// The deciding comparison sits within the rounding of the printed figures.
    pub borderline: bool,
    pub card: Option<CardMatch>,
    pub evidence: Vec<String>,
    pub remedies: Vec<Remedy>,
}

/// The cards whose total the printed one can be.
pub fn card_for(total: u64) -> Vec<&'static Card> {
    let mut v: Vec<&'static Card> = CARDS
        .iter()
        .filter(|c| (c.total as f64 - total as f64).abs() <= CARD_TOLERANCE * c.total as f64)
        .collect();
    v.sort_by_key(|c| c.total.abs_diff(total));
    v
}

fn b(r: Range) -> String {
    if r.lo == r.hi {
        return fmt_bytes(r.lo);
    }
    fmt_bytes(r.mid())
}

/// Judge one message.
pub fn judge(m: &Message) -> Judgement {
    let mut j = Judgement {
        cause: Cause::Unknown,
        causes: Vec::new(),
        borderline: false,
        card: None,
        evidence: Vec::new(),
        remedies: Vec::new(),
    };
    if let Some(t) = &m.total {
        let cards = card_for(t.bytes);
        if let Some(first) = cards.first() {
            j.card = Some(CardMatch {
                ids: cards.iter().map(|c| c.id).collect(),
                name: first.name,
                total_bytes: first.total,
                typical_non_pytorch_bytes: first.non_pytorch,
            });
        }
    }

    if m.format == Format::Cpu {
        let reason = no_figures_reason(m);
        decided(
            &mut j,
            Cause::HostMemory,
            m.requested.as_ref().map(|r| r.bytes),
            reason,
        );
        remedies(m, &mut j);
        return j;
    }
    if !m.has_figures() && m.format != Format::Mps {
        let reason = no_figures_reason(m);
        decided(&mut j, Cause::Unknown, None, reason);
        remedies(m, &mut j);
        return j;
    }

    let f = Figures::of(m);
    let Figures {
        req,
        headroom,
        unalloc,
        ..
    } = f;
    evidence(
        m,
        &mut j,
        headroom,
        unalloc,
        f.non_pt,
        f.outside,
        f.shortfall,
    );
    let mut also = supporting(m, j.card.as_ref(), &f);
    let too_big = decide(m, &mut j, &mut also, &f);
    // Within the rounding: a shortage whose cache might have been as large as the request
    // (29.11 − 29.04 GiB against 70 MiB), or headroom that might have reached the margin.
    j.borderline = match (j.cause, unalloc, req, headroom) {
        (Cause::Shortage, Some(u), Some(t), _) if u.hi >= t.lo && u.lo < t.hi => true,
        (Cause::Shortage | Cause::Unknown, _, Some(t), Some(h)) => {
            let edge = t.mid().saturating_add(UNEXPLAINED_MARGIN);
            h.lo < edge && h.hi >= edge
        }
        _ => false,
    };
    also.sort_by_key(|f| std::cmp::Reverse(f.bytes));
    j.causes.extend(also);
    // Short by less than the cache: the free memory and the cached pieces together were
    // enough, which expandable segments can join (the allocator model calls this fragmentation
    // too); never the deciding cause by the hand rules, so listed after it.
    if let (Cause::Shortage, Some(u), Some(h), Some(t)) = (j.cause, unalloc, headroom, req) {
        let together = u + h;
        if u.hi > 0 && together.lo >= t.hi && !too_big {
            j.causes.push(Finding {
                cause: Cause::Fragmentation,
                bytes: Some(u.mid()),
                reason: format!(
                    "the {} free and the {} cached in pieces together would serve the {} request: expandable segments map the free memory next to cached pages",
                    b(h),
                    b(u),
                    b(t)
                ),
            });
        }
    }
    remedies(m, &mut j);
    j
}

/// The figures the rules read, derived from a message's printed ones.
#[derive(Debug, Clone, Copy)]
struct Figures {
    req: Option<Range>,
    total: Option<Range>,
    /// The card's total, or the cap (`allowed`) when lower; MPS: the cap alone.
    cap: Option<Range>,
    headroom: Option<Range>,
    shortfall: Option<Range>,
    /// The shortfall's middle (0 when unknown).
    sf: u64,
    unalloc: Option<Range>,
    others: Range,
    non_pt: Option<Range>,
    /// Memory in use outside this allocator, when no process line explains it.
    outside: Option<Range>,
}

impl Figures {
    fn of(m: &Message) -> Figures {
        let req = range(&m.requested);
        let total = range(&m.total);
        let cap = if m.format == Format::Mps {
            range(&m.allowed)
        } else {
            match (total, range(&m.allowed)) {
                (Some(t), Some(a)) => Some(t.min(a)),
                (t, a) => t.or(a),
            }
        };
        let headroom = m.headroom();
        let shortfall = match (req, headroom) {
            (Some(t), Some(h)) => Some(t.sub(h)),
            (Some(t), None) => Some(t),
            (None, _) => Some(Range { lo: 0, hi: 0 }),
        };
        let sf = shortfall.map_or(0, |s| s.mid());
        let unalloc = m.unallocated();
        let others = m.others_total();
        let has_process_info = m.process.is_some() || !m.other_processes.is_empty();
        let non_pt = m.non_pytorch();
        let outside = if has_process_info {
            None
        } else {
            m.outside_allocator()
        };
        Figures {
            req,
            total,
            cap,
            headroom,
            shortfall,
            sf,
            unalloc,
            others,
            non_pt,
            outside,
        }
    }
}

/// Record `cause` as the deciding one, first among the findings.
fn decided(j: &mut Judgement, cause: Cause, bytes: Option<u64>, reason: String) {
    j.cause = cause;
    j.causes.insert(
        0,
        Finding {
            cause,
            bytes,
            reason,
        },
    );
}

/// Causes the figures support besides the deciding one (rules 3-6, before the order picks).
fn supporting(m: &Message, card: Option<&CardMatch>, f: &Figures) -> Vec<Finding> {
    let Figures {
        req,
        sf,
        unalloc,
        others,
        non_pt,
        outside,
        ..
    } = *f;
    let mut also: Vec<Finding> = Vec::new();
    if others.hi > 0 && others.mid() >= sf {
        let pids: Vec<String> = m.others().map(|p| p.pid.to_string()).collect();
        also.push(Finding {
            cause: Cause::OtherProcess,
            bytes: Some(others.mid()),
            reason: format!(
                "other processes ({}) hold {}, at least the {} that was missing",
                pids.join(", "),
                b(others),
                fmt_bytes(sf)
            ),
        });
    }
    if let (Some(u), Some(t)) = (unalloc, req) {
        // Only when the rounding cannot undo it: 29.11 − 29.04 GiB is 61-82 MiB, not ≥ 70 MiB.
        if u.lo >= t.hi && u.hi > 0 {
            also.push(Finding {
                cause: Cause::Fragmentation,
                bytes: Some(u.mid()),
                reason: format!(
                    "{} is reserved by PyTorch but unallocated, at least the {} requested: the free blocks are there but no one of them is large enough",
                    b(u),
                    b(t)
                ),
            });
        }
    }
    let outside_hit = outside
        .filter(|o| o.mid() > LARGE_OUTSIDE && o.mid().saturating_sub(CONTEXT_ALLOWANCE) >= sf);
    if let Some(o) = outside_hit {
        also.push(Finding {
            cause: Cause::OtherProcess,
            bytes: Some(o.mid()),
            reason: format!(
                "{} of the card is in use outside this allocator (total − reserved − free); the message prints no process lines, so it cannot tell another process from this one's non-PyTorch memory",
                b(o)
            ),
        });
    }
    let non_pt_fig = if m.format == Format::Mps {
        range(&m.other_allocations)
    } else {
        non_pt
    };
    if let Some(n) = non_pt_fig.filter(|n| n.mid() > LARGE_OUTSIDE && n.mid() >= sf) {
        let typical = card
            .map(|c| {
                format!(
                    " ({:.1}× the {} typical on {})",
                    n.mid() as f64 / c.typical_non_pytorch_bytes as f64,
                    fmt_bytes(c.typical_non_pytorch_bytes),
                    c.name
                )
            })
            .unwrap_or_default();
        also.push(Finding {
            cause: Cause::NonPytorch,
            bytes: Some(n.mid()),
            reason: if m.format == Format::Mps {
                format!("{} of other allocations (memory not from PyTorch's MPS allocator) share the limit", b(n))
            } else {
                format!(
                    "this process holds {} outside PyTorch's allocator{typical}",
                    b(n)
                )
            },
        });
    }
    also
}

/// The rules, in order (see the module's notes): the deciding cause goes into `j`, the
/// supporting findings it takes or rules out leave `also`. Whether the request alone was
/// larger than the card.
fn decide(m: &Message, j: &mut Judgement, also: &mut Vec<Finding>, f: &Figures) -> bool {
    let Figures {
        req,
        total,
        cap,
        headroom,
        shortfall,
        others,
        ..
    } = *f;
    let take = |also: &mut Vec<Finding>, c: Cause| -> Option<Finding> {
        let i = also.iter().position(|f| f.cause == c)?;
        Some(also.remove(i))
    };

    let too_big = match (req, cap) {
        (Some(t), Some(c)) => t.mid() > c.mid(),
        _ => false,
    };
    let free_contradicts = match (range(&m.free), total) {
        (Some(f), Some(t)) => f.lo > t.hi,
        _ => false,
    };
    let unexplained = match (req, headroom) {
        (Some(t), Some(h)) => h.mid() >= t.mid().saturating_add(UNEXPLAINED_MARGIN),
        _ => false,
    };
    let over_limit = match (&m.allocation_limit, req) {
        (Some(l), Some(t)) => t.lo > l.max,
        _ => false,
    };
    if over_limit {
        decided(
            j,
            Cause::Unknown,
            None,
            format!(
                "the platform refuses any single allocation over {} (IPEX on this GPU or WSL): not a shortage of memory; split the tensor",
                m.allocation_limit.as_ref().map_or("", |l| l.text.as_str())
            ),
        );
        also.clear();
    } else if free_contradicts {
        decided(
            j,
            Cause::Unknown,
            None,
            "free is larger than the card's total: the driver reports the memory wrongly (an APU or shared-memory carve-out), so no figure can be trusted".into(),
        );
        also.clear();
    } else if too_big {
        let (t, c) = (
            req.unwrap_or(Range { lo: 0, hi: 0 }),
            cap.unwrap_or(Range { lo: 0, hi: 0 }),
        );
        decided(
            j,
            Cause::Shortage,
            Some(t.mid().saturating_sub(c.mid())),
            format!(
                "the request alone ({}) is larger than the {} the {} has: no allocator setting makes it fit",
                b(t),
                b(c),
                if m.allowed.is_some() { "cap" } else { "card" }
            ),
        );
        also.clear();
    } else if unexplained {
        let why = format!(
            "{} was free for a {} request: the figures do not explain the failure (a single-allocation limit, a driver-side failure, or memory freed between the failure and the report)",
            b(headroom.unwrap_or(Range { lo: 0, hi: 0 })),
            b(req.unwrap_or(Range { lo: 0, hi: 0 }))
        );
        decided(j, Cause::Unknown, None, why);
        also.clear();
    } else if m.free.is_none()
        && m.allowed.is_none()
        && m.format != Format::Mps
        && !also.iter().any(|f| f.cause == Cause::Fragmentation)
    {
        decided(
            j,
            Cause::Unknown,
            None,
            "the message prints no free figure, so the shortfall cannot be read (older XPU and IPEX texts)".into(),
        );
        also.clear();
    } else if let Some(f) = {
        // Rules 3-6: listed processes first (rule 3), then fragmentation (4), then memory
        // outside the allocator that no process line explains (5), then non-PyTorch (6).
        use Cause::*;
        let order = if others.hi > 0 {
            [OtherProcess, Fragmentation, NonPytorch]
        } else {
            [Fragmentation, OtherProcess, NonPytorch]
        };
        order.into_iter().find_map(|c| take(also, c))
    } {
        j.cause = f.cause;
        j.causes.insert(0, f);
    } else {
        let need = shortfall.map_or(0, |s| s.mid());
        decided(
            j,
            Cause::Shortage,
            Some(need),
            match (req, headroom) {
                (Some(t), Some(h)) if need > 0 => format!(
                    "it needs {} more: {} requested, {} free{}",
                    fmt_bytes(need),
                    b(t),
                    b(h),
                    if m.allowed.is_some() { " under the cap" } else { "" }
                ),
                (Some(t), Some(h)) => format!(
                    "{} requested with {} free: the margin is too thin for the allocator's rounding (requests of 1-10 MiB take a 20 MiB segment) and the driver's own growth",
                    b(t),
                    b(h)
                ),
                _ => "the card was full; the message does not say by how much".into(),
            },
        );
    }
    too_big
}

fn no_figures_reason(m: &Message) -> String {
    match m.format {
        Format::Cpu => match &m.requested {
            Some(r) => format!(
                "host memory (RAM), not the GPU: the CPU allocator was refused {} ({})",
                fmt_bytes(r.bytes),
                r.text
            ),
            None => "host memory (RAM), not the GPU: the CPU allocator was refused".into(),
        },
        Format::Cublas => "cuBLAS could not allocate its handle or workspace: the card was already full when the first matmul ran (the message carries no figures)".into(),
        Format::Cudnn => "cuDNN could not allocate its workspace (\"no valid algorithm\" is often this): the card was full when a convolution ran (no figures)".into(),
        Format::Driver | Format::DriverLegacy => "the CUDA runtime itself ran out (outside PyTorch's allocator, or an asynchronous kernel error): the message carries no figures".into(),
        Format::Accelerate => "Accelerate's find_executable_batch_size ran out at every batch size down to 1: even one sample does not fit (the per-try OOM messages were not kept)".into(),
        _ => "the message stops before PyTorch's figures (cut in the paste, or PyTorch's own truncation, pytorch/pytorch#126766)".into(),
    }
}

fn evidence(
    m: &Message,
    j: &mut Judgement,
    headroom: Option<Range>,
    unalloc: Option<Range>,
    non_pt: Option<Range>,
    outside: Option<Range>,
    shortfall: Option<Range>,
) {
    let e = &mut j.evidence;
    if let Some(t) = &m.total {
        let card = match &j.card {
            Some(c) => format!(
                ": {} ({} in the card table{})",
                c.name,
                fmt_bytes(c.total_bytes),
                if c.ids.len() > 1 {
                    format!("; also {}", c.ids[1..].join(", "))
                } else {
                    String::new()
                }
            ),
            None => ": no card of the table within 0.15 %".into(),
        };
        e.push(format!("card: {} total{card}", t.text));
    }
    if let Some(r) = &m.requested {
        e.push(format!(
            "requested {}{}",
            r.text,
            m.pool
                .as_ref()
                .map(|p| format!(" on the {p} pool"))
                .unwrap_or_default()
        ));
    }
    if let Some(h) = headroom {
        e.push(format!(
            "headroom {}{}",
            b(h),
            if m.allowed.is_some() && m.format != Format::Mps {
                " (under the `allowed` cap: allowed − reserved)"
            } else {
                ""
            }
        ));
    }
    if let (Some(r), Some(u)) = (m.reserved_total(), unalloc) {
        e.push(format!(
            "PyTorch: reserved {} = allocated {} + unallocated {}",
            b(r),
            m.allocated.as_ref().map_or("?".into(), |a| a.text.clone()),
            b(u)
        ));
    }
    if let Some(n) = non_pt {
        e.push(format!(
            "non-PyTorch in this process: {} (its {} − PyTorch's reserved; between {} and {} by rounding)",
            b(n),
            if m.process.is_some() {
                "\"this process has\""
            } else {
                "Process line taken as self"
            },
            fmt_bytes(n.lo),
            fmt_bytes(n.hi)
        ));
    }
    if let Some(pid) = m.self_as_process {
        e.push(format!(
            "Process {pid} is this process seen from a container (no \"this process\" line; its figure is PyTorch's reserved plus less than 3 GiB)"
        ));
    }
    for p in m.others() {
        e.push(format!("other process {}: {}", p.pid, p.bytes.text));
    }
    if let Some(o) = outside {
        e.push(format!(
            "in use outside this allocator: {} (total − reserved − free)",
            b(o)
        ));
    }
    if let Some(s) = shortfall.filter(|s| s.hi > 0) {
        e.push(format!(
            "missing: {} (between {} and {} by rounding)",
            b(s),
            fmt_bytes(s.lo),
            fmt_bytes(s.hi)
        ));
    }
    if m.truncated {
        e.push("the message is cut before its last figure".into());
    }
}

fn conf_var(m: &Message) -> &'static str {
    match (m.format, m.hint.as_deref()) {
        (Format::Hip, Some(h)) if h.starts_with("PYTORCH_HIP") => "PYTORCH_HIP_ALLOC_CONF",
        (_, Some(h)) if h.starts_with("PYTORCH_ALLOC_CONF") => "PYTORCH_ALLOC_CONF",
        _ => "PYTORCH_CUDA_ALLOC_CONF",
    }
}

fn remedies(m: &Message, j: &mut Judgement) {
    let causes: Vec<Cause> = j.causes.iter().map(|f| f.cause).collect();
    for c in causes {
        let r = match c {
            Cause::Fragmentation => {
                let u = m.unallocated().map_or(0, |u| u.mid());
                if matches!(m.format, Format::Cuda1) {
                    Remedy {
                        cause: c,
                        action: "upgrade to PyTorch ≥ 2.1 and set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True; on this release, PYTORCH_CUDA_ALLOC_CONF=garbage_collection_threshold:0.6,max_split_size_mb:128 (PyTorch's documented example)".into(),
                        effect: format!("expandable segments grow one segment in place, so the {} cached in split blocks serves the request (the allocator model loses at most one 20 MiB page per stream to rounding; modelled, not measured for this run)", fmt_bytes(u)),
                    }
                } else {
                    Remedy {
                        cause: c,
                        action: format!("{}=expandable_segments:True", conf_var(m)),
                        effect: format!("segments grow in place instead of splitting, so the {} cached in split blocks serves the request (the allocator model loses at most one 20 MiB page per stream to rounding; modelled, not measured for this run)", fmt_bytes(u)),
                    }
                }
            }
            Cause::OtherProcess => {
                let pids: Vec<String> = m
                    .others()
                    .map(|p| format!("{} ({})", p.pid, p.bytes.text))
                    .collect();
                Remedy {
                    cause: c,
                    action: if pids.is_empty() {
                        "find what else holds the card while it runs (nvidia-smi --query-compute-apps=pid,used_memory --format=csv, rocm-smi --showpids) and stop it, or run on another GPU (CUDA_VISIBLE_DEVICES)".into()
                    } else {
                        format!("stop process {} or run on another GPU (CUDA_VISIBLE_DEVICES)", pids.join(", "))
                    },
                    effect: format!("frees {}", fmt_bytes(j.causes.iter().find(|f| f.cause == c).and_then(|f| f.bytes).unwrap_or(0))),
                }
            }
            Cause::NonPytorch if m.format == Format::Mps => Remedy {
                cause: c,
                action: "close other programs using unified memory; PYTORCH_MPS_HIGH_WATERMARK_RATIO=0.0 lifts the limit but may make the system swap or fail".into(),
                effect: "frees the other allocations".into(),
            },
            Cause::NonPytorch => Remedy {
                cause: c,
                action: "look for memory outside PyTorch in this process: NCCL buffers (fewer process groups, NCCL_BUFFSIZE), cuDNN benchmark workspaces (torch.backends.cudnn.benchmark = False), a second CUDA context (TensorFlow, JAX or CuPy in the same process; XLA_PYTHON_CLIENT_PREALLOCATE=false)".into(),
                effect: format!(
                    "up to {} beyond the card's usual footprint",
                    fmt_bytes(
                        m.non_pytorch()
                            .map_or(0, |n| n.mid())
                            .saturating_sub(j.card.as_ref().map_or(0, |c| c.typical_non_pytorch_bytes))
                    )
                ),
            },
            Cause::Shortage => Remedy {
                cause: c,
                action: "make the step smaller: smaller batch or sequence, activation checkpointing, flash attention, ZeRO/FSDP; add --model/--config with its flags to see what each buys on this card".into(),
                effect: format!(
                    "must free {}",
                    fmt_bytes(j.causes.iter().find(|f| f.cause == c).and_then(|f| f.bytes).unwrap_or(0))
                ),
            },
            Cause::HostMemory => Remedy {
                cause: c,
                action: "give the process more host RAM (or swap), or hold less on the host: fewer DataLoader workers, pin_memory=False, no CPU offload of optimizer state or parameters, load checkpoints with mmap=True".into(),
                effect: format!(
                    "the {} the CPU allocator was refused",
                    fmt_bytes(m.requested.as_ref().map_or(0, |r| r.bytes))
                ),
            },
            Cause::Unknown => continue,
        };
        j.remedies.push(r);
    }
}
