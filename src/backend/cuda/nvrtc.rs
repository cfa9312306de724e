//! CUDA kernel sources (`shaders/*.cu`) and their run-time compilation to PTX through NVRTC.
//!
//! A kernel module mirrors `kernels::source::wgsl_source`: `#define WG_X/WG_Y/WG_Z` (the op's
//! workgroup size, launched as `blockDim`), `shaders/common.cu`, then for compute ops the
//! storage prelude `shaders/storage_<type>.cu` (`FMT`, `EPW`) and `shaders/codec.cu`
//! (`load_elem`/`store_elem` and the run-time-format `fmt_load`/`fmt_store`), then the op's
//! file; `softmax` gets `#define MASKED false` first, and `attention` is `attention.cu` (which
//! sets `MASKED` and the entry name) followed by `softmax.cu`. The entry point is
//! `extern "C" __global__ void <op>(const Params P, u32* ...)`: the op's params struct of
//! `kernels::params` by value, then one word pointer per buffer in binding order.
//! NVRTC needs no GPU: [`compile_all_kernels`] is the CI check that every kernel compiles
//! without errors or warnings.

use std::ffi::{c_char, CStr, CString};

use cudarc::nvrtc::{result, sys};

use super::loader;
use crate::kernels::{KernelId, Op, Storage};

/// The PTX architecture of the compile check: Turing (sm_75) is the oldest architecture that
/// CUDA 12.x compiles for without a deprecation warning; the backend itself compiles for the
/// device's own compute capability (see [`target_for_device`]).
pub const CHECK_ARCH: u32 = 75;

/// Warnings accepted in an NVRTC log, each with the reason. A log line containing one of these
/// does not fail the compile check. Empty today: every kernel must compile silently.
pub const WARNING_WHITELIST: &[(&str, &str)] = &[];

/// Shared helpers included first in every CUDA kernel module.
pub const COMMON: &str = include_str!("../../../shaders/common.cu");

/// The element codec of compute kernels (the twin of `shaders/codec.wgsl`).
pub const CODEC: &str = include_str!("../../../shaders/codec.cu");
/// The fill pattern (`fmix32`, `pattern`) that fill and verify share.
pub const WORD_PATTERN: &str = include_str!("../../../shaders/word_pattern.cu");

/// Every `.cu` file under `shaders/` that is not an op's own kernel file.
pub const SUPPORT_FILES: &[&str] = &[
    "common.cu",
    "codec.cu",
    "storage_f32.cu",
    "storage_f16.cu",
    "storage_bf16.cu",
    "word_pattern.cu",
];

/// The raw CUDA text of an op, as stored in `shaders/<op>.cu`.
pub fn cuda_file(op: Op) -> &'static str {
    match op {
        Op::Fill => include_str!("../../../shaders/fill.cu"),
        Op::Verify => include_str!("../../../shaders/verify.cu"),
        Op::Checksum => include_str!("../../../shaders/checksum.cu"),
        Op::Matmul => include_str!("../../../shaders/matmul.cu"),
        Op::Softmax => include_str!("../../../shaders/softmax.cu"),
        Op::Attention => include_str!("../../../shaders/attention.cu"),
        Op::FlashAttention => include_str!("../../../shaders/flash_attention.cu"),
        Op::Conv2d => include_str!("../../../shaders/conv2d.cu"),
        Op::Relu => include_str!("../../../shaders/relu.cu"),
        Op::Gelu => include_str!("../../../shaders/gelu.cu"),
        Op::LayerNorm => include_str!("../../../shaders/layer_norm.cu"),
        Op::Adam => include_str!("../../../shaders/adam.cu"),
    }
}

/// The storage prelude of a compute kernel (`shaders/storage_<type>.cu`).
pub fn storage_prelude(storage: Storage) -> &'static str {
    match storage {
        Storage::F32 => include_str!("../../../shaders/storage_f32.cu"),
        Storage::F16 => include_str!("../../../shaders/storage_f16.cu"),
        Storage::Bf16 => include_str!("../../../shaders/storage_bf16.cu"),
    }
}

/// Word ops (fill, verify, checksum) work on raw 32-bit words and take no storage prelude.
pub fn is_word_op(op: Op) -> bool {
    matches!(op, Op::Fill | Op::Verify | Op::Checksum)
}

/// The kernel's entry point name in the module.
pub fn entry_point(op: Op) -> &'static str {
    op.name()
}

/// The complete CUDA source of a kernel.
pub fn cuda_source(id: KernelId) -> String {
    let [x, y, z] = id.workgroup_size();
    let mut s = format!(
        "// oomprobe kernel {label}\n#define WG_X {x}u\n#define WG_Y {y}u\n#define WG_Z {z}u\n",
        label = id.label()
    );
    s.push_str(COMMON);
    s.push('\n');
    if !is_word_op(id.op) {
        s.push_str(storage_prelude(id.storage));
        s.push('\n');
        s.push_str(CODEC);
        s.push('\n');
    }
    if matches!(id.op, Op::Fill | Op::Verify) {
        s.push_str(WORD_PATTERN);
        s.push('\n');
    }
    match id.op {
        Op::Softmax => {
            s.push_str("#define MASKED false\n");
            s.push_str(cuda_file(Op::Softmax));
        }
        Op::Attention => {
            s.push_str(cuda_file(Op::Attention));
            s.push('\n');
            s.push_str(cuda_file(Op::Softmax));
        }
        op => s.push_str(cuda_file(op)),
    }
    s
}

/// The kernels a backend (and the compile check) builds: word ops once (their storage type
/// is ignored, `KernelId::words`), compute ops for every storage type.
pub fn all_kernel_ids() -> Vec<KernelId> {
    let mut ids = Vec::new();
    for op in Op::ALL {
        if is_word_op(op) {
            ids.push(KernelId::words(op));
        } else {
            for s in [Storage::F32, Storage::F16, Storage::Bf16] {
                ids.push(KernelId::new(op, s));
            }
        }
    }
    ids
}

/// What NVRTC is asked to produce.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Target {
    /// PTX for `compute_XX`, JIT-compiled by the driver at load time. The driver must be at
    /// least as new as NVRTC (PTX has no minor-version compatibility).
    Ptx(u32),
    /// A CUBIN (machine code) for `sm_XX`, assembled by NVRTC itself: loads on any driver of
    /// the same CUDA major version (minor-version compatibility), only on that architecture.
    Cubin(u32),
}

impl Target {
    fn option(self) -> String {
        match self {
            Target::Ptx(a) => format!("--gpu-architecture=compute_{a}"),
            Target::Cubin(a) => format!("--gpu-architecture=sm_{a}"),
        }
    }
}

impl std::fmt::Display for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Target::Ptx(a) => write!(f, "compute_{a} PTX"),
            Target::Cubin(a) => write!(f, "sm_{a} CUBIN"),
        }
    }
}

/// A compiled kernel: the module image to load (PTX text with its NUL, or CUBIN bytes), the
/// PTX text when the target was PTX, and NVRTC's log (empty when it had nothing to say).
#[derive(Debug, Clone)]
pub struct Compiled {
    pub target: Target,
    pub image: Vec<u8>,
    pub ptx: String,
    pub log: String,
}

/// NVRTC's version, e.g. (12, 9).
pub fn version() -> Result<(i32, i32), String> {
    loader::nvrtc_library()?;
    loader::guarded("nvrtcVersion", || {
        let (mut major, mut minor) = (0, 0);
        // SAFETY: two out-pointers to live locals.
        let r = unsafe { sys::nvrtcVersion(&mut major, &mut minor) };
        r.result()
            .map(|()| (major, minor))
            .map_err(|e| format!("nvrtcVersion: {e:?}"))
    })?
}

/// The `compute_XX` architectures this NVRTC can target, ascending (e.g. 75, 80, ..., 120).
pub fn supported_archs() -> Result<Vec<u32>, String> {
    loader::nvrtc_library()?;
    loader::guarded("nvrtcGetSupportedArchs", || {
        let mut n = 0;
        // SAFETY: an out-pointer to a live local.
        unsafe { sys::nvrtcGetNumSupportedArchs(&mut n) }
            .result()
            .map_err(|e| format!("nvrtcGetNumSupportedArchs: {e:?}"))?;
        let mut archs = vec![0i32; n.max(0) as usize];
        // SAFETY: `archs` holds the `n` entries NVRTC writes.
        unsafe { sys::nvrtcGetSupportedArchs(archs.as_mut_ptr()) }
            .result()
            .map_err(|e| format!("nvrtcGetSupportedArchs: {e:?}"))?;
        let mut archs: Vec<u32> = archs
            .into_iter()
            .filter_map(|a| u32::try_from(a).ok())
            .collect();
        archs.sort_unstable();
        Ok(archs)
    })?
}

/// What to compile for a device of compute capability `major.minor`: a CUBIN for its own
/// architecture when NVRTC knows it (no driver JIT, so a driver older than NVRTC within the
/// same major version still loads it), else PTX for the newest architecture NVRTC supports
/// below the device (the driver JIT-compiles it forward).
pub fn target_for_device(major: i32, minor: i32) -> Result<Target, String> {
    let cc = u32::try_from(major * 10 + minor).unwrap_or(0);
    let archs = supported_archs()?;
    if archs.contains(&cc) {
        return Ok(Target::Cubin(cc));
    }
    archs
        .iter()
        .copied()
        .filter(|&a| a <= cc)
        .max()
        .map(Target::Ptx)
        .ok_or_else(|| {
            format!(
            "this NVRTC cannot target compute capability {major}.{minor} (it supports {archs:?})"
        )
        })
}

/// Compiles one kernel. A compile error returns NVRTC's log.
pub fn compile(id: KernelId, target: Target) -> Result<Compiled, String> {
    compile_source(&id.label(), &cuda_source(id), target)
}

/// Compiles CUDA source text with the options every kernel uses.
pub fn compile_source(label: &str, source: &str, target: Target) -> Result<Compiled, String> {
    loader::nvrtc_library()?;
    let src =
        CString::new(source).map_err(|_| format!("{label}: kernel source contains a NUL byte"))?;
    let name = CString::new(format!("{label}.cu")).unwrap_or_default();
    let options = vec![
        target.option(),
        "--std=c++17".to_string(),
        // Same arithmetic as the WGSL kernels: no flush-to-zero, IEEE division and sqrt.
        "--ftz=false".to_string(),
        "--prec-div=true".to_string(),
        "--prec-sqrt=true".to_string(),
    ];
    loader::guarded("NVRTC compile", || {
        let prog = result::create_program(&src, Some(&name))
            .map_err(|e| format!("{label}: nvrtcCreateProgram: {e:?}"))?;
        // SAFETY: `prog` is a live program until destroyed below; options are valid strings.
        let compiled = unsafe { result::compile_program(prog, &options) };
        // SAFETY: as above.
        let log = unsafe { result::get_program_log(prog) }
            .map(|raw| c_chars_to_string(&raw))
            .unwrap_or_default();
        let out = match compiled {
            // SAFETY: as above; compilation succeeded so the output is available.
            Ok(()) => unsafe { output(prog, target) }
                .map_err(|e| format!("{label}: {e}"))
                .map(|(image, ptx)| Compiled {
                    target,
                    image,
                    ptx,
                    log: log.clone(),
                }),
            Err(e) => Err(format!(
                "{label} failed to compile for {target} ({e:?}):\n{log}"
            )),
        };
        // SAFETY: destroyed once, after its last use.
        let _ = unsafe { result::destroy_program(prog) };
        out
    })?
}

/// The module image (and PTX text) of a compiled program.
///
/// # Safety
/// `prog` must be a live program that compiled successfully for `target`.
unsafe fn output(prog: sys::nvrtcProgram, target: Target) -> Result<(Vec<u8>, String), String> {
    match target {
        Target::Ptx(_) => {
            // SAFETY: per this function's contract.
            let raw =
                unsafe { result::get_ptx(prog) }.map_err(|e| format!("nvrtcGetPTX: {e:?}"))?;
            // SAFETY: c_char and u8 have the same size and alignment.
            let image: Vec<u8> =
                unsafe { std::slice::from_raw_parts(raw.as_ptr().cast::<u8>(), raw.len()) }
                    .to_vec();
            Ok((image, c_chars_to_string(&raw)))
        }
        Target::Cubin(_) => {
            let mut size = 0usize;
            // SAFETY: per this function's contract; out-pointer to a live local.
            unsafe { sys::nvrtcGetCUBINSize(prog, &mut size) }
                .result()
                .map_err(|e| format!("nvrtcGetCUBINSize: {e:?}"))?;
            let mut image = vec![0u8; size];
            // SAFETY: `image` holds the `size` bytes NVRTC writes.
            unsafe { sys::nvrtcGetCUBIN(prog, image.as_mut_ptr().cast()) }
                .result()
                .map_err(|e| format!("nvrtcGetCUBIN: {e:?}"))?;
            Ok((image, String::new()))
        }
    }
}

/// Log lines that are not whitelisted warnings (see [`WARNING_WHITELIST`]).
pub fn unexpected_log_lines(log: &str) -> Vec<String> {
    log.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .filter(|l| !WARNING_WHITELIST.iter().any(|(pat, _)| l.contains(pat)))
        .map(str::to_string)
        .collect()
}

/// The targets of the compile check: PTX for the oldest architecture CUDA 12 compiles for
/// without a deprecation warning (what a GPU without its own CUBIN gets), and a CUBIN for
/// Hopper (sm_90, the H100/H200 class), which runs NVRTC's assembler too, so register or
/// shared-memory overflows fail here rather than on a GPU.
pub const CHECK_TARGETS: [Target; 2] = [Target::Ptx(CHECK_ARCH), Target::Cubin(90)];

/// Compiles every CUDA kernel (every op; compute ops for every storage type) for every
/// [`CHECK_TARGETS`] entry, without a GPU. Fails on any compile error, and on any NVRTC log
/// output (warnings) not listed in [`WARNING_WHITELIST`]. Returns ("label target", bytes).
pub fn compile_all_kernels() -> Result<Vec<(String, usize)>, String> {
    let mut out = Vec::new();
    let mut problems = Vec::new();
    for target in CHECK_TARGETS {
        for id in all_kernel_ids() {
            match compile(id, target) {
                Ok(c) => {
                    let unexpected = unexpected_log_lines(&c.log);
                    if unexpected.is_empty() {
                        out.push((format!("{} {target}", id.label()), c.image.len()));
                    } else {
                        problems.push(format!(
                            "{} ({target}): warnings:\n{}",
                            id.label(),
                            unexpected.join("\n")
                        ));
                    }
                }
                Err(e) => problems.push(e),
            }
        }
    }
    if problems.is_empty() {
        Ok(out)
    } else {
        Err(problems.join("\n\n"))
    }
}

fn c_chars_to_string(raw: &[c_char]) -> String {
    // SAFETY: c_char and u8 have the same size and alignment.
    let bytes: &[u8] = unsafe { std::slice::from_raw_parts(raw.as_ptr().cast(), raw.len()) };
    match CStr::from_bytes_until_nul(bytes) {
        Ok(c) => c.to_string_lossy().into_owned(),
        Err(_) => String::from_utf8_lossy(bytes).into_owned(),
    }
}
