//! The allocator's replay for people: one line of what was assumed, the reserved peak and
//! fragmentation, and the first request the card refused.

use super::conf::AllocConf;
use super::timeline::{Failure, Replay};
use super::Card;
use crate::units::fmt_bytes;

/// The lines `estimate` prints under the breakdown.
pub fn summary(r: &Replay, conf: &AllocConf, from: &str, card: Option<&Card>) -> String {
    let on = match card {
        Some(c) => format!(
            "{} for it of {} ({} outside PyTorch)",
            fmt_bytes(c.usable()),
            fmt_bytes(c.total),
            fmt_bytes(c.non_pytorch)
        ),
        None => "no card limit".into(),
    };
    let settings = if conf.text.is_empty() {
        "PyTorch's defaults".to_string()
    } else {
        format!("{}, from {from}", conf.text)
    };
    let mut s = format!(
        "\nPyTorch's caching allocator ({settings}; {} steps; {on}):\n",
        r.steps
    );
    s.push_str(&format!(
        "  reserved peak  {} ({} B), step {}{}\n  allocated then {} (blocks: tensors rounded to 512 B)\n  fragmentation  {} reserved but unallocated at that moment\n",
        fmt_bytes(r.reserved_peak_bytes),
        r.reserved_peak_bytes,
        r.reserved_peak_step,
        r.reserved_peak_phase
            .map_or(String::new(), |p| format!(", {}", p.name())),
        fmt_bytes(r.allocated_at_reserved_peak_bytes),
        fmt_bytes(r.fragmentation_bytes),
    ));
    if let Some(f) = &r.failure {
        s.push_str(&format!(
            "  refused        step {}, {} of {} ({}): tried to allocate {} with {} reserved, {} allocated{}\n",
            f.step,
            f.tensor,
            fmt_bytes(f.oom.requested),
            f.phase.name(),
            fmt_bytes(f.oom.alloc_size),
            fmt_bytes(f.oom.reserved),
            fmt_bytes(f.oom.allocated),
            refusal_cause(f)
        ));
    }
    s
}

/// Why a request was refused, as the tail of the "refused" line: fragmentation only when the
/// step's shortage is less than the free memory in pieces, else a shortage, by how much.
fn refusal_cause(f: &Failure) -> String {
    if f.fragmentation {
        format!(
            "; the free memory in total was enough ({} cached in pieces, the largest {}): fragmentation",
            fmt_bytes(f.oom.cached_free),
            fmt_bytes(f.oom.largest_cached)
        )
    } else if f.shortage_bytes > 0 {
        format!(
            "; the step's tensors are short by {} ({} cached in pieces then): not fragmentation",
            fmt_bytes(f.shortage_bytes),
            fmt_bytes(f.oom.cached_free)
        )
    } else {
        String::new()
    }
}
