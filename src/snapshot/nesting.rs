//! How deeply a pickle nests and how tall its stack grows, found by walking its opcodes without
//! building anything, so a file nested 10⁵ deep is refused in one line before a recursive
//! decoder (or the drop of what it built) overflows the thread's stack.
//!
//! Each stack item carries the depth of the object it stands for (a leaf is 0, a container one
//! more than its deepest item) and the memo slot it was stored in, so a memoized container
//! filled later (`BINPUT` then `APPENDS`) and fetched again (`BINGET`) keeps its depth.

use std::collections::HashMap;

/// The deepest nesting read: a real memory snapshot nests about 8 deep (the dict, its segments,
/// their blocks, each block's frames).
pub const MAX_DEPTH: u32 = 200;

/// The most items the pickle's stack may hold at once: pickle writes containers in batches of
/// 1000, so a real file's stack stays a few thousand high.
pub const MAX_STACK: usize = 1 << 20;

/// Why a pickle is refused before it is decoded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TooDeep {
    Nesting(u32),
    Stack(usize),
}

impl std::fmt::Display for TooDeep {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TooDeep::Nesting(d) => write!(
                f,
                "objects nested more than {d} deep (a memory snapshot nests about 8 deep)"
            ),
            TooDeep::Stack(n) => write!(
                f,
                "more than {n} items on the pickle's stack at once (a memory snapshot holds a \
                 few thousand)"
            ),
        }
    }
}

#[derive(Clone, Copy)]
struct Item {
    depth: u32,
    memo: Option<u32>,
}

const LEAF: Item = Item {
    depth: 0,
    memo: None,
};

/// How an opcode's argument is laid out in the stream.
enum Arg {
    None,
    /// Up to a newline.
    Line,
    /// Two lines (GLOBAL, INST).
    Lines2,
    Fixed(usize),
    /// A little-endian length of 1, 4 or 8 bytes, then that many bytes.
    Len(usize),
}

/// What an opcode does to the stack.
enum Effect {
    /// Push an object with no items.
    Leaf,
    /// Push an empty container.
    Empty,
    Mark,
    Pop,
    PopMark,
    Dup,
    /// Pop n items, push a container of them.
    Wrap(usize),
    /// Pop to the mark, push a container of them.
    WrapMark,
    /// Pop n items into the container beneath them.
    Fill(usize),
    /// Pop to the mark into the container beneath it.
    FillMark,
    /// Pop n, push a leaf (STACK_GLOBAL, BINPERSID).
    Replace(usize),
    Put,
    Get,
    Memoize,
    Stop,
    /// Protocol, framing: nothing.
    Nothing,
}

fn opcode(op: u8) -> Option<(Arg, Effect)> {
    use Arg::*;
    use Effect::*;
    Some(match op {
        b'(' => (None, Mark),
        b'.' => (None, Stop),
        b'0' => (None, Pop),
        b'1' => (None, PopMark),
        b'2' => (None, Dup),
        b'F' | b'I' | b'L' | b'S' | b'V' | b'P' => (Line, Leaf),
        b'J' => (Fixed(4), Leaf),
        b'K' => (Fixed(1), Leaf),
        b'M' => (Fixed(2), Leaf),
        b'G' => (Fixed(8), Leaf),
        b'N' | 0x88 | 0x89 | 0x97 => (None, Leaf),
        b'T' | b'X' | b'B' | 0x8b => (Len(4), Leaf),
        b'U' | b'C' | 0x8c | 0x8a => (Len(1), Leaf),
        0x8d | 0x8e | 0x96 => (Len(8), Leaf),
        0x82 => (Fixed(1), Leaf),
        0x83 => (Fixed(2), Leaf),
        0x84 => (Fixed(4), Leaf),
        b'c' => (Lines2, Leaf),
        b'Q' => (None, Replace(1)),
        0x93 => (None, Replace(2)),
        0x98 => (None, Wrap(1)),
        b']' | b'}' | b')' | 0x8f => (None, Empty),
        b'd' | b'l' | b't' | b'o' | 0x91 => (None, WrapMark),
        b'i' => (Lines2, WrapMark),
        0x85 => (None, Wrap(1)),
        0x86 | b'R' | 0x81 => (None, Wrap(2)),
        0x87 | 0x92 => (None, Wrap(3)),
        b'a' | b'b' => (None, Fill(1)),
        b's' => (None, Fill(2)),
        b'e' | b'u' | 0x90 => (None, FillMark),
        b'p' => (Line, Put),
        b'q' => (Fixed(1), Put),
        b'r' => (Fixed(4), Put),
        b'g' => (Line, Get),
        b'h' => (Fixed(1), Get),
        b'j' => (Fixed(4), Get),
        0x94 => (None, Memoize),
        0x80 => (Fixed(1), Nothing),
        0x95 => (Fixed(8), Nothing),
        _ => return Option::None,
    })
}

/// The line of `bytes` from `pos` (without its newline) and where the next one starts.
fn line_at(bytes: &[u8], pos: usize) -> Option<(&[u8], usize)> {
    let rest = bytes.get(pos..)?;
    let n = rest.iter().position(|&b| b == b'\n')?;
    Some((&rest[..n], pos + n + 1))
}

/// An opcode's argument at `pos`: its bytes (for memo ids) and where the next opcode starts.
/// None where the stream ends before the argument does.
fn argument<'a>(bytes: &'a [u8], pos: usize, arg: &Arg) -> Option<(&'a [u8], usize)> {
    Some(match *arg {
        Arg::None => (&[], pos),
        Arg::Line => line_at(bytes, pos)?,
        Arg::Lines2 => {
            let (_, p) = line_at(bytes, pos).and_then(|(_, p)| line_at(bytes, p))?;
            (&[], p)
        }
        Arg::Fixed(n) => (bytes.get(pos..pos + n)?, pos + n),
        Arg::Len(w) => {
            let len = bytes.get(pos..pos + w)?;
            let mut le = [0u8; 8];
            le[..w].copy_from_slice(len);
            let n = u64::from_le_bytes(le);
            match (pos + w).checked_add(n as usize) {
                Some(end) if end <= bytes.len() => (&[], end),
                _ => return None,
            }
        }
    })
}

/// Check that `bytes` (a pickle) nests at most [`MAX_DEPTH`] deep and keeps at most
/// [`MAX_STACK`] items on its stack. A stream this walk cannot follow (an unknown opcode, a
/// short read, an underflow) passes: the decoder reports what is wrong with it.
pub fn check(bytes: &[u8]) -> Result<(), TooDeep> {
    let mut stack: Vec<Item> = Vec::new();
    let mut marks: Vec<usize> = Vec::new();
    let mut memo: HashMap<u32, u32> = HashMap::new();
    let mut pos = 0usize;
    let deeper = |d: u32| -> Result<u32, TooDeep> {
        let d = d + 1;
        if d > MAX_DEPTH {
            Err(TooDeep::Nesting(MAX_DEPTH))
        } else {
            Ok(d)
        }
    };
    while let Some(&op) = bytes.get(pos) {
        pos += 1;
        let Some((arg, effect)) = opcode(op) else {
            return Ok(());
        };
        // The argument: its bytes (for memo ids) and where the next opcode starts.
        let Some((arg_bytes, next)) = argument(bytes, pos, &arg) else {
            return Ok(());
        };
        pos = next;
        let base = marks.last().copied().unwrap_or(0);
        let pop_n = |stack: &mut Vec<Item>, n: usize| -> Option<u32> {
            if stack.len() < base + n {
                return None;
            }
            let d = stack.drain(stack.len() - n..).map(|i| i.depth).max();
            Some(d.unwrap_or(0))
        };
        match effect {
            Effect::Leaf => stack.push(LEAF),
            Effect::Empty => stack.push(Item {
                depth: 1,
                memo: None,
            }),
            Effect::Mark => marks.push(stack.len()),
            Effect::Pop => {
                if stack.len() > base {
                    stack.pop();
                } else if marks.pop().is_none() {
                    return Ok(());
                }
            }
            Effect::PopMark => match marks.pop() {
                Some(m) => stack.truncate(m),
                None => return Ok(()),
            },
            Effect::Dup => match stack.last().copied() {
                Some(top) if stack.len() > base => stack.push(top),
                _ => return Ok(()),
            },
            Effect::Wrap(n) => {
                let Some(d) = pop_n(&mut stack, n) else {
                    return Ok(());
                };
                stack.push(Item {
                    depth: deeper(d)?,
                    memo: None,
                });
            }
            Effect::WrapMark => {
                let Some(m) = marks.pop() else {
                    return Ok(());
                };
                let d = stack.drain(m..).map(|i| i.depth).max().unwrap_or(0);
                stack.push(Item {
                    depth: deeper(d)?,
                    memo: None,
                });
            }
            Effect::Fill(n) => {
                let Some(d) = pop_n(&mut stack, n) else {
                    return Ok(());
                };
                if !fill(&mut stack, base, &mut memo, deeper(d)?) {
                    return Ok(());
                }
            }
            Effect::FillMark => {
                let Some(m) = marks.pop() else {
                    return Ok(());
                };
                let d = stack.drain(m..).map(|i| i.depth).max();
                let base = marks.last().copied().unwrap_or(0);
                if let Some(d) = d {
                    if !fill(&mut stack, base, &mut memo, deeper(d)?) {
                        return Ok(());
                    }
                }
            }
            Effect::Replace(n) => {
                if pop_n(&mut stack, n).is_none() {
                    return Ok(());
                }
                stack.push(LEAF);
            }
            Effect::Put | Effect::Memoize => {
                let id = match effect {
                    Effect::Memoize => memo.len() as u32,
                    _ => match memo_id(arg_bytes, matches!(arg, Arg::Line)) {
                        Some(id) => id,
                        None => return Ok(()),
                    },
                };
                let above = stack.len() > base;
                match stack.last_mut() {
                    Some(top) if above => {
                        top.memo = Some(id);
                        memo.insert(id, top.depth);
                    }
                    _ => return Ok(()),
                }
            }
            Effect::Get => {
                let Some(id) = memo_id(arg_bytes, matches!(arg, Arg::Line)) else {
                    return Ok(());
                };
                let Some(&depth) = memo.get(&id) else {
                    return Ok(());
                };
                stack.push(Item {
                    depth,
                    memo: Some(id),
                });
            }
            Effect::Stop => return Ok(()),
            Effect::Nothing => {}
        }
        if stack.len() + marks.len() > MAX_STACK {
            return Err(TooDeep::Stack(MAX_STACK));
        }
    }
    Ok(())
}

/// Raise the container on top of the stack (above `base`) to hold something `depth` deep,
/// and its memo slot with it. False when there is no container there.
fn fill(stack: &mut [Item], base: usize, memo: &mut HashMap<u32, u32>, depth: u32) -> bool {
    if stack.len() <= base {
        return false;
    }
    let Some(top) = stack.last_mut() else {
        return false;
    };
    top.depth = top.depth.max(depth);
    if let Some(id) = top.memo {
        let m = memo.entry(id).or_insert(0);
        *m = (*m).max(top.depth);
    }
    true
}

/// A memo index: ASCII digits (PUT, GET) or little-endian bytes (BINPUT, LONG_BINGET, ...).
fn memo_id(arg: &[u8], ascii: bool) -> Option<u32> {
    if ascii {
        std::str::from_utf8(arg).ok()?.trim().parse().ok()
    } else {
        let mut le = [0u8; 4];
        le.get_mut(..arg.len())?.copy_from_slice(arg);
        Some(u32::from_le_bytes(le))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nested_lists(depth: usize) -> Vec<u8> {
        let mut b = vec![0x80, 2];
        b.extend(std::iter::repeat_n(b']', depth));
        b.extend(std::iter::repeat_n(b'a', depth - 1));
        b.push(b'.');
        b
    }

    #[test]
    fn deep_lists_tuples_and_memoized_containers_are_measured() {
        assert_eq!(check(&nested_lists(MAX_DEPTH as usize)), Ok(()));
        assert_eq!(
            check(&nested_lists(MAX_DEPTH as usize + 1)),
            Err(TooDeep::Nesting(MAX_DEPTH))
        );
        assert!(check(&nested_lists(200_000)).is_err());
        // TUPLE1 wraps the top again and again: deep with a stack one high.
        let mut t = vec![0x80, 2, b'N'];
        t.extend(std::iter::repeat_n(0x85, 1000));
        t.push(b'.');
        assert_eq!(check(&t), Err(TooDeep::Nesting(MAX_DEPTH)));
        // A memoized list filled after it was stored and fetched again keeps its depth:
        // L0 = [[[...]]] built through the memo, then wrapped in one list per BINGET.
        let mut m = vec![0x80, 2, b']', b'q', 0];
        for _ in 0..MAX_DEPTH {
            // [memo0] -> memo0
            m.extend([b']', b'h', 0, b'a', b'q', 0]);
        }
        m.push(b'.');
        assert_eq!(check(&m), Err(TooDeep::Nesting(MAX_DEPTH)));
    }

    #[test]
    fn a_tall_stack_is_refused_and_ordinary_pickles_pass() {
        let mut b = vec![0x80, 2, b'('];
        b.extend(std::iter::repeat_n(b'N', MAX_STACK + 1));
        assert_eq!(check(&b), Err(TooDeep::Stack(MAX_STACK)));
        // {'segments': [{'address': 1, 'blocks': []}], 'device_traces': []}, as Python writes it.
        let dict: &[u8] = b"\x80\x04\x95@\x00\x00\x00\x00\x00\x00\x00}\x94(\x8c\x08segments\
\x94]\x94}\x94(\x8c\x07address\x94K\x01\x8c\x06blocks\x94]\x94ua\x8c\rdevice_traces\x94]\x94u.";
        assert_eq!(check(dict), Ok(()));
        // What the walk cannot follow is left to the decoder.
        assert_eq!(check(b"\x80\x02\xff"), Ok(()));
        assert_eq!(check(b"a."), Ok(()));
    }
}
