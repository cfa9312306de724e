//! `PYTORCH_CUDA_ALLOC_CONF` as PyTorch parses it (c10/core/AllocatorConfig.cpp and
//! c10/cuda/CUDAAllocatorConfig.cpp @ 01f9ef3): the settings the caching allocator model obeys,
//! and a typed error naming the key that is wrong.

use serde::Serialize;
use thiserror::Error;

use super::sizes::LARGE_BUFFER;

const MB: u64 = 1 << 20;
/// `kRoundUpPowerOfTwoIntervals`: 16 intervals, from 1 MiB to 64 GiB.
pub const INTERVALS: usize = 16;

/// The allocator's settings. The default is PyTorch's (no option set).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct AllocConf {
    /// Blocks this large or larger are never split (`max_split_size_mb`; default: no limit).
    pub max_split_size: u64,
    /// How much larger than the request an unsplittable block may be (`max_non_split_rounding_mb`,
    /// default 20 MiB).
    pub max_non_split_rounding: u64,
    /// Divisions per power-of-two interval, interval i covering sizes in [2^(20+i), 2^(21+i))
    /// (the first also everything below 1 MiB, the last everything above); 0 or 1: none.
    pub roundup_power2_divisions: [u64; INTERVALS],
    /// Fraction of the allowed memory past which cached blocks are reclaimed (only when a
    /// per-process memory fraction is set, as in PyTorch); 0: off.
    pub garbage_collection_threshold: f64,
    /// `expandable_segments:True`: one segment per stream and pool, grown and shrunk in pages.
    pub expandable_segments: bool,
    /// The text it was parsed from ("" for the default).
    pub text: String,
}

impl Default for AllocConf {
    fn default() -> Self {
        AllocConf {
            max_split_size: u64::MAX,
            max_non_split_rounding: LARGE_BUFFER,
            roundup_power2_divisions: [0; INTERVALS],
            garbage_collection_threshold: 0.0,
            expandable_segments: false,
            text: String::new(),
        }
    }
}

/// What is wrong with an allocator setting string.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum ConfError {
    #[error("unknown key '{0}' in the allocator config (PyTorch's keys: {KNOWN})")]
    UnknownKey(String),
    #[error("allocator config key '{key}': {why}")]
    BadValue { key: String, why: String },
    #[error("allocator config: {0}")]
    Syntax(String),
}

const KNOWN: &str = "backend, max_split_size_mb, max_non_split_rounding_mb, \
garbage_collection_threshold, roundup_power2_divisions, expandable_segments, \
release_lock_on_cudamalloc, pinned_use_cuda_host_register, pinned_num_register_threads, \
pinned_use_background_threads, pinned_reserve_segment_size_mb, graph_capture_record_stream_reuse";

/// Keys PyTorch accepts that do not change where device memory goes.
const NO_EFFECT: [&str; 8] = [
    "release_lock_on_cudamalloc",
    "release_lock_on_hipmalloc",
    "pinned_use_cuda_host_register",
    "pinned_use_hip_host_register",
    "pinned_num_register_threads",
    "pinned_use_background_threads",
    "pinned_reserve_segment_size_mb",
    "graph_capture_record_stream_reuse",
];

/// PyTorch's `ConfigTokenizer`: `,` `:` `[` `]` are tokens of their own, spaces are dropped.
fn tokens(s: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut buf = String::new();
    for c in s.chars() {
        match c {
            ',' | ':' | '[' | ']' => {
                if !buf.is_empty() {
                    out.push(std::mem::take(&mut buf));
                }
                out.push(c.to_string());
            }
            ' ' => {}
            c => buf.push(c),
        }
    }
    if !buf.is_empty() {
        out.push(buf);
    }
    out
}

struct Cursor<'a> {
    t: &'a [String],
    i: usize,
    key: String,
}

impl Cursor<'_> {
    fn bad(&self, why: impl Into<String>) -> ConfError {
        ConfError::BadValue {
            key: self.key.clone(),
            why: why.into(),
        }
    }
    fn expect(&mut self, tok: &str) -> Result<(), ConfError> {
        match self.t.get(self.i) {
            Some(t) if t == tok => {
                self.i += 1;
                Ok(())
            }
            Some(t) => Err(self.bad(format!("expected '{tok}', found '{t}'"))),
            None => Err(self.bad(format!("expected '{tok}' at the end"))),
        }
    }
    fn next(&mut self) -> Result<&str, ConfError> {
        let t = self
            .t
            .get(self.i)
            .ok_or_else(|| self.bad("a value is missing"))?;
        self.i += 1;
        Ok(t)
    }
    fn uint(&mut self) -> Result<u64, ConfError> {
        let t = self.next()?.to_string();
        t.parse()
            .map_err(|_| self.bad(format!("'{t}' is not a whole number")))
    }
    fn boolean(&mut self) -> Result<bool, ConfError> {
        match self.next()? {
            "True" | "true" => Ok(true),
            "False" | "false" => Ok(false),
            t => {
                let t = t.to_string();
                Err(self.bad(format!("'{t}' is not True or False")))
            }
        }
    }
}

/// The interval index of a boundary given in MiB (a power of two), as PyTorch computes it.
fn interval_of_mb(mb: u64) -> usize {
    (63 - mb.leading_zeros() as usize).min(INTERVALS - 1)
}

/// Parse `PYTORCH_CUDA_ALLOC_CONF` syntax (`expandable_segments:True,max_split_size_mb:128`).
pub fn parse(text: &str) -> Result<AllocConf, ConfError> {
    let t = tokens(text);
    let mut conf = AllocConf {
        text: text.to_string(),
        ..AllocConf::default()
    };
    let mut c = Cursor {
        t: &t,
        i: 0,
        key: String::new(),
    };
    while c.i < t.len() {
        c.key = t[c.i].clone();
        c.i += 1;
        let key = c.key.clone();
        match key.as_str() {
            "max_split_size_mb" | "max_non_split_rounding_mb" => {
                c.expect(":")?;
                let v = c.uint()?;
                if v < LARGE_BUFFER / MB {
                    return Err(c.bad(format!("must be >= {}", LARGE_BUFFER / MB)));
                }
                let bytes = v.min(u64::MAX / MB) * MB;
                if key == "max_split_size_mb" {
                    conf.max_split_size = bytes;
                } else {
                    conf.max_non_split_rounding = bytes;
                }
            }
            "garbage_collection_threshold" => {
                c.expect(":")?;
                let s = c.next()?.to_string();
                let v: f64 = s
                    .parse()
                    .map_err(|_| c.bad(format!("'{s}' is not a number")))?;
                if !(v > 0.0 && v < 1.0) {
                    return Err(c.bad("must be in (0.0, 1.0)"));
                }
                conf.garbage_collection_threshold = v;
            }
            "roundup_power2_divisions" => {
                c.expect(":")?;
                conf.roundup_power2_divisions = divisions(&mut c)?;
            }
            "expandable_segments" => {
                c.expect(":")?;
                conf.expandable_segments = c.boolean()?;
            }
            "backend" => {
                c.expect(":")?;
                match c.next()? {
                    "native" => {}
                    "cudaMallocAsync" | "hipMallocAsync" => {
                        return Err(c.bad(
                            "cudaMallocAsync is CUDA's own pool, which oomprobe does not model \
                             (only the native caching allocator)",
                        ))
                    }
                    v => {
                        let v = v.to_string();
                        return Err(
                            c.bad(format!("unknown backend '{v}' (native or cudaMallocAsync)"))
                        );
                    }
                }
            }
            k if NO_EFFECT.contains(&k) => {
                c.expect(":")?;
                // Not modelled, so not read; but PyTorch takes only True/False or a number for
                // each, and the text is echoed in the report: a control character in it would
                // reach the terminal (found by tests/it/cli/alloc_conf_fuzz.rs, issue 48).
                let v = c.next()?.to_string();
                if v.contains(char::is_control) {
                    return Err(c.bad(format!("'{v}' holds a control character")));
                }
            }
            "" | "," => return Err(ConfError::Syntax(format!("an empty key in '{text}'"))),
            k => return Err(ConfError::UnknownKey(k.to_string())),
        }
        if c.i < t.len() {
            c.expect(",")?;
            if c.i == t.len() {
                return Err(ConfError::Syntax(format!("a trailing ',' in '{text}'")));
            }
        }
    }
    Ok(conf)
}

/// `roundup_power2_divisions:4` (every interval) or `[256:1,512:2,>:8]` (boundaries in MiB).
fn divisions(c: &mut Cursor) -> Result<[u64; INTERVALS], ConfError> {
    let mut d = [0u64; INTERVALS];
    if c.t.get(c.i).map(String::as_str) != Some("[") {
        let v = c.uint()?;
        if !v.is_power_of_two() {
            return Err(c.bad("the divisions have to be a power of 2"));
        }
        return Ok([v; INTERVALS]);
    }
    c.i += 1;
    let mut first = true;
    let mut last = 0usize;
    loop {
        let at = c.next()?.to_string();
        if at == "]" {
            break;
        }
        c.expect(":")?;
        let v = c.uint()?;
        if v != 0 && !v.is_power_of_two() {
            return Err(c.bad("the divisions have to be a power of 2 or 0"));
        }
        if at == ">" {
            for x in d.iter_mut().skip(last + 1) {
                *x = v;
            }
        } else {
            let b: u64 = at
                .parse()
                .map_err(|_| c.bad(format!("'{at}' is not a size in MiB")))?;
            if !b.is_power_of_two() {
                return Err(c.bad("the intervals have to be a power of 2"));
            }
            let ix = interval_of_mb(b);
            if first {
                for x in d.iter_mut().take(ix) {
                    *x = v;
                }
                first = false;
            }
            d[ix] = v;
            last = ix;
        }
        match c.t.get(c.i).map(String::as_str) {
            Some("]") => {}
            _ => c.expect(",")?,
        }
    }
    Ok(d)
}

/// The settings in force: `--alloc-conf` when given, else `PYTORCH_ALLOC_CONF`, else
/// `PYTORCH_CUDA_ALLOC_CONF` (PyTorch reads them in that order), else the default. Returns the
/// settings and where they came from; a bad setting is one line that names its source and key.
pub fn from_flag_or_env(flag: Option<&str>) -> Result<(AllocConf, &'static str), String> {
    let sourced = |text: &str, from: &'static str| {
        parse(text)
            .map(|c| (c, from))
            .map_err(|e| format!("{from}: {e}"))
    };
    if let Some(f) = flag {
        return sourced(f, "--alloc-conf");
    }
    for var in ["PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"] {
        if let Ok(v) = std::env::var(var) {
            return sourced(&v, var);
        }
    }
    Ok((AllocConf::default(), "PyTorch's defaults"))
}

impl AllocConf {
    /// The divisions for a (rounded-to-512) size: PyTorch's `roundup_power2_divisions(size)`.
    pub fn divisions_for(&self, size: u64) -> u64 {
        let log = 63 - size.max(1).leading_zeros() as usize;
        let ix = log.saturating_sub(20).min(INTERVALS - 1);
        self.roundup_power2_divisions[ix]
    }

    /// A short description for people ("PyTorch's defaults" or the text).
    pub fn describe(&self) -> String {
        if self.text.is_empty() {
            "PyTorch's defaults".into()
        } else {
            self.text.clone()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_control_character_in_an_unmodelled_value_is_refused() {
        assert!(parse("pinned_use_cuda_host_register:True").is_ok());
        for v in ["\u{1b}c", "a\u{7}b", "x\ny"] {
            let e = parse(&format!("pinned_use_cuda_host_register:{v}")).unwrap_err();
            assert!(e.to_string().contains("holds a control character"), "{e}");
        }
    }

    #[test]
    fn pytorch_syntax_parses() {
        let c = parse("expandable_segments:True, max_split_size_mb:128").unwrap();
        assert!(c.expandable_segments);
        assert_eq!(c.max_split_size, 128 << 20);
        let c = parse("roundup_power2_divisions:4").unwrap();
        assert_eq!(c.roundup_power2_divisions, [4; INTERVALS]);
        // 256 MiB is interval 8: intervals 0..8 take the first value, 9.. the '>' one.
        let c = parse("roundup_power2_divisions:[256:1,512:2,1024:4,>:8]").unwrap();
        let d = c.roundup_power2_divisions;
        assert_eq!(&d[..9], &[1; 9]);
        assert_eq!((d[9], d[10]), (2, 4));
        assert_eq!(&d[11..], &[8; 5]);
        let c = parse("garbage_collection_threshold:0.6,backend:native").unwrap();
        assert_eq!(c.garbage_collection_threshold, 0.6);
        assert_eq!(parse("").unwrap(), AllocConf::default());
    }

    #[test]
    fn bad_keys_and_values_are_named() {
        assert_eq!(
            parse("expandable_segment:True").unwrap_err(),
            ConfError::UnknownKey("expandable_segment".into())
        );
        let e = parse("max_split_size_mb:10").unwrap_err().to_string();
        assert!(
            e.contains("max_split_size_mb") && e.contains(">= 20"),
            "{e}"
        );
        let e = parse("expandable_segments:yes").unwrap_err().to_string();
        assert!(e.contains("expandable_segments"), "{e}");
        assert!(parse("garbage_collection_threshold:1.5").is_err());
        assert!(parse("roundup_power2_divisions:3").is_err());
        assert!(parse("backend:cudaMallocAsync").is_err());
        assert!(parse("expandable_segments:True,").is_err());
        assert!(parse("max_split_size_mb").is_err());
    }

    #[test]
    fn divisions_follow_the_size_interval() {
        let c = parse("roundup_power2_divisions:[256:1,512:2,1024:4,>:8]").unwrap();
        assert_eq!(c.divisions_for(1000), 1);
        assert_eq!(c.divisions_for(300 << 20), 1);
        assert_eq!(c.divisions_for(600 << 20), 2);
        assert_eq!(c.divisions_for(1500 << 20), 4);
        assert_eq!(c.divisions_for(100 << 30), 8);
    }
}
