//! A PyTorch release (`--torch-version`) and what it keeps that today's does not.

use serde::{Deserialize, Serialize};

/// A PyTorch release (`--torch-version X.Y`): the plan follows what that release keeps where it
/// differs from today's (`Release::softmax_saves_input`, `zero_grad_keeps`, `blas_in_pool`,
/// `lazy_modules`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct Release {
    pub major: u16,
    pub minor: u16,
}

impl Release {
    /// Before 1.11, `_softmax` and `_log_softmax` saved their input as well as their output
    /// for the backward (pytorch/pytorch#64000; the fix, #66018, landed on 2021-10-01, after
    /// 1.10 branched).
    pub fn softmax_saves_input(self) -> bool {
        self < Release::new(1, 11)
    }
    /// Before 2.0, `zero_grad()` defaulted to `set_to_none=False`: gradients are zeroed in
    /// place and kept between steps.
    pub fn zero_grad_keeps(self) -> bool {
        self < Release::new(2, 0)
    }
    /// From 2.0, PyTorch hands cuBLAS a workspace from its caching allocator
    /// (pytorch/pytorch#83461; #95668 reports the 8 MiB + 128 KiB that 2.0 keeps and 1.13 did
    /// not); before, cuBLAS allocated its own, outside PyTorch's pool.
    pub fn blas_in_pool(self) -> bool {
        self >= Release::new(2, 0)
    }
    /// From 1.13 PyTorch sets `CUDA_MODULE_LOADING=LAZY` itself (with CUDA 11.7+,
    /// pytorch#86509); before, every kernel was loaded with the context.
    pub fn lazy_modules(self) -> bool {
        self >= Release::new(1, 13)
    }
    /// PyTorch's `scaled_dot_product_attention` arrived in 2.0.
    pub fn has_sdpa(self) -> bool {
        self >= Release::new(2, 0)
    }
    pub const fn new(major: u16, minor: u16) -> Release {
        Release { major, minor }
    }
}

impl std::fmt::Display for Release {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}", self.major, self.minor)
    }
}

impl std::str::FromStr for Release {
    type Err = String;
    /// `X.Y` or `X.Y.Z` (a patch release or a local tag such as `2.1.0+cu121` keeps X.Y).
    fn from_str(v: &str) -> Result<Release, String> {
        let bad = || {
            format!(
                "expected a version like 1.10 or 2.1.0, not '{}'",
                v.escape_debug()
            )
        };
        let core = v.trim().split('+').next().unwrap_or("");
        let parts: Vec<&str> = core.split('.').collect();
        if !(2..=3).contains(&parts.len()) || parts.iter().any(|p| p.is_empty()) {
            return Err(bad());
        }
        let num = |p: &str| p.parse::<u16>().map_err(|_| bad());
        let r = Release::new(num(parts[0])?, num(parts[1])?);
        if let Some(p) = parts.get(2) {
            num(p)?;
        }
        if r < Release::new(1, 0) {
            return Err(format!(
                "{r} is older than PyTorch 1.0, which is not modelled"
            ));
        }
        Ok(r)
    }
}

impl TryFrom<String> for Release {
    type Error = String;
    fn try_from(v: String) -> Result<Release, String> {
        v.parse()
    }
}

impl From<Release> for String {
    fn from(r: Release) -> String {
        r.to_string()
    }
}
