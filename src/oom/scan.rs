//! Find every out-of-memory message in a log, read as it streams: only the lines near a head
//! are kept, their per-line prefixes (`[rank0]: `, `> `, `SUBPROCESS: `, quotes) dropped and the
//! lines joined, so a message hard-wrapped over eight lines reads as one.

use std::io::{BufRead, Read};
use std::sync::LazyLock;

use regex::Regex;

use super::parse::{message, HEAD};
use super::Message;

/// Lines kept after a line with a head: a wrapped message is shorter.
const FOLLOW: usize = 24;
/// A longer line is cut here (a log with its newlines lost is still read, in pieces).
const MAX_LINE: usize = 1 << 20;
/// A region of kept lines is read once it is this long, so memory stays bounded.
const MAX_REGION: usize = 2000;

/// A line holds one of the heads' words (cheaper than the head pattern itself).
static HINT: LazyLock<regex::bytes::Regex> = LazyLock::new(|| {
    regex::bytes::Regex::new(
        r"out of memory|exceed allowed memory|Tried to allocate|total capacity|allocate memory|not enough memory|ALLOC_FAILED|NOT_ENOUGH_WORKSPACE|valid cuDNN algorithm|12 vs 0|executable batch size",
    )
    .expect("hint pattern")
});

/// What a line may start with that is not the message: quote marks, markdown quotes, log
/// prefixes a launcher adds to each line.
static PREFIX: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r#"^(?:\s+|>+|#+|`+|"|'|\[rank\d+\]:|SUBPROCESS:|\x1b\[[0-9;]*m)"#)
        .expect("prefix pattern")
});

/// Terminal colour and cursor sequences (rich tracebacks put them around the numbers).
static ANSI: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"\x1b\[[0-9;?]*[A-Za-z]").expect("ansi pattern"));

fn clean(line: &str) -> String {
    let plain = ANSI.replace_all(line, "");
    let mut s = plain.trim_end_matches(['\r', '\n']);
    while let Some(m) = PREFIX.find(s) {
        if m.end() == 0 {
            break;
        }
        s = &s[m.end()..];
    }
    s.to_string()
}

/// Lines near heads, joined, with the input line each piece started on.
#[derive(Default)]
struct Region {
    flat: String,
    /// (offset in `flat`, input line), ascending.
    starts: Vec<(usize, usize)>,
}

impl Region {
    fn push(&mut self, line_no: usize, text: &str) {
        if !self.flat.is_empty() {
            self.flat.push(' ');
        }
        self.starts.push((self.flat.len(), line_no));
        // Runs of spaces (PyTorch's own "fragmentation.  See") read as one.
        let mut last_space = self.flat.ends_with(' ');
        for ch in text.chars() {
            let space = ch.is_whitespace();
            if !(space && last_space) {
                self.flat.push(if space { ' ' } else { ch });
            }
            last_space = space;
        }
    }

    fn line_at(&self, offset: usize) -> usize {
        let i = self.starts.partition_point(|(o, _)| *o <= offset);
        self.starts[i.saturating_sub(1)].1
    }

    fn read(&self, out: &mut Vec<Message>) {
        let mut pos = 0;
        while let Some(h) = HEAD.find_at(&self.flat, pos) {
            match message(&self.flat, h.start(), self.line_at(h.start())) {
                Some((m, end)) => {
                    add(out, m);
                    pos = end.max(h.end());
                }
                None => pos = h.end(),
            }
        }
    }
}

/// A message already seen (a logger's copy, a retry) counts as a repeat.
fn add(out: &mut Vec<Message>, m: Message) {
    match out.iter_mut().find(|o| o.text == m.text) {
        Some(o) => o.repeats += 1,
        None => out.push(m),
    }
}

/// UTF-16 text (Windows consoles save logs so), told by its byte-order mark or by NULs in
/// every other byte of its start: Some(little-endian).
fn utf16_order(head: &[u8]) -> Option<bool> {
    match head {
        [0xFF, 0xFE, ..] => Some(true),
        [0xFE, 0xFF, ..] => Some(false),
        [a, 0, b, 0, ..] if *a != 0 && *b != 0 => Some(true),
        [0, a, 0, b, ..] if *a != 0 && *b != 0 => Some(false),
        _ => None,
    }
}

/// UTF-16 in, UTF-8 out, as it streams (an odd byte or a high surrogate waits for the next
/// read; unpaired surrogates become U+FFFD).
struct Utf16<R> {
    inner: R,
    le: bool,
    pending: Vec<u8>,
    out: Vec<u8>,
    pos: usize,
}

impl<R: Read> Read for Utf16<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        while self.pos == self.out.len() {
            let mut chunk = [0u8; 8192];
            let n = self.inner.read(&mut chunk)?;
            if n == 0 {
                return Ok(0);
            }
            self.pending.extend_from_slice(&chunk[..n]);
            let even = self.pending.len() & !1;
            let le = self.le;
            let mut units: Vec<u16> = self.pending[..even]
                .chunks_exact(2)
                .map(|b| {
                    if le {
                        u16::from_le_bytes([b[0], b[1]])
                    } else {
                        u16::from_be_bytes([b[0], b[1]])
                    }
                })
                .collect();
            let mut used = even;
            if units.last().is_some_and(|u| (0xD800..0xDC00).contains(u)) {
                units.pop();
                used -= 2;
            }
            self.pending.drain(..used);
            self.out.clear();
            self.pos = 0;
            for ch in char::decode_utf16(units) {
                let ch = ch.unwrap_or(char::REPLACEMENT_CHARACTER);
                if ch != '\u{FEFF}' {
                    let mut b = [0u8; 4];
                    self.out
                        .extend_from_slice(ch.encode_utf8(&mut b).as_bytes());
                }
            }
        }
        let n = buf.len().min(self.out.len() - self.pos);
        buf[..n].copy_from_slice(&self.out[self.pos..self.pos + n]);
        self.pos += n;
        Ok(n)
    }
}

/// Every distinct message in `input` (UTF-8, or UTF-16 told by its start), in order.
pub fn scan<R: BufRead>(input: R) -> std::io::Result<Vec<Message>> {
    Ok(scan_bounded(input)?.messages)
}

/// What a scan found, and what it left out to stay bounded.
#[derive(Debug, Default)]
pub struct Scanned {
    pub messages: Vec<Message>,
    /// Distinct messages past [`MAX_MESSAGES`] (counted, not kept).
    pub messages_dropped: u64,
    /// Input bytes past [`MAX_READ`] (not read): None when the input ended first.
    pub stopped_at: Option<u64>,
}

/// Distinct messages kept; more are counted (a log of a million different OOMs is not read
/// into memory).
pub const MAX_MESSAGES: usize = 10_000;
/// Bytes read from one input at most.
pub const MAX_READ: u64 = 4 << 30;
/// A region of kept lines is read once it holds this many bytes.
const MAX_REGION_BYTES: usize = 4 << 20;

/// [`scan`], saying what it left out: memory is bounded by one line piece, one region and
/// [`MAX_MESSAGES`] messages, and time by [`MAX_READ`] bytes.
pub fn scan_bounded<R: BufRead>(mut input: R) -> std::io::Result<Scanned> {
    match utf16_order(input.fill_buf()?) {
        Some(le) => scan_utf8(std::io::BufReader::new(Utf16 {
            inner: input,
            le,
            pending: Vec::new(),
            out: Vec::new(),
            pos: 0,
        })),
        None => scan_utf8(input),
    }
}

/// The scan's state between lines.
#[derive(Default)]
struct Scanner {
    found: Scanned,
    region: Region,
    /// Lines still kept after the last head.
    left: usize,
    kept: usize,
    region_bytes: usize,
}

impl Scanner {
    /// One line (or a `\r`-separated piece of one: progress bars rewrite a line so).
    fn line(&mut self, line_no: usize, bytes: &[u8]) {
        if HINT.is_match(bytes) {
            self.left = FOLLOW + 1;
        }
        if self.left > 0 {
            self.left -= 1;
            self.region
                .push(line_no.max(1), &clean(&String::from_utf8_lossy(bytes)));
            self.kept += 1;
            self.region_bytes += bytes.len();
        }
        if (self.left == 0 && self.kept > 0)
            || self.kept >= MAX_REGION
            || self.region_bytes >= MAX_REGION_BYTES
        {
            self.flush();
        }
    }

    fn flush(&mut self) {
        let mut found = Vec::new();
        std::mem::take(&mut self.region).read(&mut found);
        for m in found {
            let known = self.found.messages.iter().any(|o| o.text == m.text);
            if known || self.found.messages.len() < MAX_MESSAGES {
                add(&mut self.found.messages, m);
            } else {
                self.found.messages_dropped += 1;
            }
        }
        self.kept = 0;
        self.region_bytes = 0;
    }
}

fn scan_utf8<R: BufRead>(mut input: R) -> std::io::Result<Scanned> {
    let mut sc = Scanner::default();
    let mut buf = Vec::new();
    let mut line_no = 0usize;
    let mut at_line_start = true;
    let mut read = 0u64;
    loop {
        if read >= MAX_READ {
            sc.found.stopped_at = Some(read);
            break;
        }
        buf.clear();
        let n = read_piece(&mut input, &mut buf, MAX_LINE)?;
        if n == 0 {
            break;
        }
        read += n as u64;
        // A redraw (`\r`) or a cut piece of a long line stays on its line's number.
        if at_line_start {
            line_no += 1;
        }
        at_line_start = buf.ends_with(b"\n");
        sc.line(line_no, &buf);
    }
    sc.flush();
    Ok(sc.found)
}

/// One piece of the input into `buf`: up to and including a `\n`, or a `\r` that is not the
/// start of `\r\n` (a progress bar's redraw), or `max` bytes of a longer line. Returns the
/// bytes consumed (0 at the end).
fn read_piece<R: BufRead>(input: &mut R, buf: &mut Vec<u8>, max: usize) -> std::io::Result<usize> {
    let mut n = 0;
    loop {
        let avail = input.fill_buf()?;
        if avail.is_empty() {
            return Ok(n);
        }
        let take = avail.len().min(max - n);
        match avail[..take].iter().position(|&b| b == b'\n' || b == b'\r') {
            Some(i) => {
                let cr = avail[i] == b'\r';
                buf.extend_from_slice(&avail[..=i]);
                input.consume(i + 1);
                n += i + 1;
                if cr && input.fill_buf()?.first() == Some(&b'\n') {
                    buf.push(b'\n');
                    input.consume(1);
                    n += 1;
                }
                return Ok(n);
            }
            None => {
                buf.extend_from_slice(&avail[..take]);
                input.consume(take);
                n += take;
                if n >= max {
                    return Ok(n);
                }
            }
        }
    }
}

/// Every message in a string (tests, the library).
pub fn scan_str(s: &str) -> Vec<Message> {
    scan(s.as_bytes()).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_hard_wrapped_message_reads_as_one() {
        let t = "torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 138.00 MiB.\nGPU 0 has a total capacty of 15.90 GiB of which 8.44 MiB is free.\nProcess 1246069 has 577.00 MiB memory in use. Including non-PyTorch memory,\nthis process has 15.32 GiB memory in use. Of the allocated memory\n14.12 GiB is allocated by PyTorch, and 410.41 MiB is reserved\nby PyTorch but unallocated.\n";
        let m = scan_str(t);
        assert_eq!(m.len(), 1);
        assert_eq!(m[0].line, 1);
        assert_eq!(m[0].process.as_ref().unwrap().text, "15.32 GiB");
        assert_eq!(m[0].release, "PyTorch 2.1");
        assert!(!m[0].truncated);
    }

    #[test]
    fn prefixes_are_dropped_and_copies_counted() {
        let one = "CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; 1.96 GiB total capacity; 923.43 MiB already allocated; 15.62 MiB free; 954.00 MiB reserved in total by PyTorch)";
        let t = format!("[rank0]: {one}\nnoise\n> {one}\n");
        let m = scan_str(&t);
        assert_eq!(m.len(), 1);
        assert_eq!(m[0].repeats, 1);
        assert_eq!(m[0].format, super::super::Format::Cuda1);
    }

    #[test]
    fn no_head_no_message() {
        assert!(scan_str("").is_empty());
        assert!(scan_str("\u{0}\u{1}binary\u{ff}").is_empty());
    }
}
