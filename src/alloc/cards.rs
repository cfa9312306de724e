//! The cards people have: total memory as CUDA/HIP reports it and what a process holds outside
//! PyTorch's allocator on each (filled from cited sources; docs/validation.md lists them).

/// One card of the table.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Card {
    pub id: &'static str,
    pub name: &'static str,
    pub arch: &'static str,
}

pub const CARDS: &[Card] = &[];
