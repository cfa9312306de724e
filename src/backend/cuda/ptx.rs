//! The kernels as PTX inside the binary (`shaders/ptx/<label>.ptx`), so that the CUDA backend
//! needs only the NVIDIA driver, and a small reader of PTX headers and entry signatures.
//!
//! The files are generated from `shaders/*.cu` by `scripts/gen-ptx.sh` (NVRTC, see
//! [`generate`]) and committed; `tests/it/backend/cuda/nvrtc.rs` checks they are byte-identical
//! to what the current sources compile to, `tests/it/backend/cuda/ptx.rs` (no NVRTC) parses every
//! one.
//!
//! Target and version:
//! - `.target sm_50` ([`EMBED_ARCH`], compute_50, Maxwell): PTX is JIT-compiled forward by the
//!   driver to any newer card, so this loads on every card a CUDA 12 driver runs (Maxwell to
//!   Blackwell). The kernels need nothing newer (32-bit atomics, f16 conversions through `cvt`,
//!   at most 16 KiB of shared memory per block). NVRTC 12.x warns that pre-Turing targets are
//!   deprecated; that one warning is accepted for this target only ([`DEPRECATED_ARCH_WARNING`]).
//! - `.version 7.0` ([`EMBED_ISA`]): NVRTC writes the newest PTX ISA it knows (8.8 for 12.9),
//!   which a driver older than that NVRTC refuses (`CUDA_ERROR_UNSUPPORTED_PTX_VERSION`). The
//!   line is rewritten to 7.0 (CUDA 11.0, driver r450), which is safe because every instruction
//!   in the files exists since an older ISA ([`OPCODE_ISA`], checked by
//!   `tests/it/backend/cuda/ptx.rs`, which fails on any opcode it does not know) and 7.0 is
//!   past 6.0, where the memory consistency model NVVM 12 assumes for plain `ld`/`st`/`atom`
//!   was defined. The backend's own floor is a little higher: cudarc's context creation asks for
//!   `CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED`, which drivers know since CUDA 11.2 (r460).

use crate::kernels::{KernelId, Op, Storage};

/// The compute capability the embedded PTX targets (`compute_50`).
pub const EMBED_ARCH: u32 = 50;

/// The PTX ISA version written into the embedded PTX (`.version 7.0`).
pub const EMBED_ISA: (u32, u32) = (7, 0);

/// The oldest driver that JIT-compiles [`EMBED_ISA`] (the CUDA 11.0 driver).
pub const EMBED_MIN_DRIVER: &str = "CUDA 11.0 (r450.80.02 on Linux, 451.48 on Windows)";

/// The NVRTC release the committed files were generated with (their header says so too);
/// another release may emit different code, so the byte-identity check needs this one.
pub const GENERATOR_RELEASE: &str = "release 12.9, V12.9.86";

/// NVRTC 12.x's one warning for [`EMBED_ARCH`]: accepted for the embedded target only.
pub const DEPRECATED_ARCH_WARNING: &str = "Architectures prior to '<compute/sm>_75' are deprecated";

/// The file (under `shaders/ptx/`) holding a kernel: `<op>_<storage>.ptx`; word kernels
/// (storage ignored) are stored once, as `<op>_f32.ptx`.
pub fn file_name(id: KernelId) -> String {
    format!("{}.ptx", canonical(id).label())
}

/// Word kernels ignore the storage type: they all map to `KernelId::words(op)`.
pub fn canonical(id: KernelId) -> KernelId {
    if super::nvrtc::is_word_op(id.op) {
        KernelId::words(id.op)
    } else {
        id
    }
}

macro_rules! ptx_file {
    ($name:literal) => {
        include_str!(concat!("../../../shaders/ptx/", $name, ".ptx"))
    };
}

/// The embedded PTX text of a kernel (no trailing NUL).
pub fn embedded(id: KernelId) -> &'static str {
    use Storage::{Bf16, F16, F32};
    match (id.op, id.storage) {
        (Op::Fill, _) => ptx_file!("fill_f32"),
        (Op::Verify, _) => ptx_file!("verify_f32"),
        (Op::Checksum, _) => ptx_file!("checksum_f32"),
        (Op::Matmul, F32) => ptx_file!("matmul_f32"),
        (Op::Matmul, F16) => ptx_file!("matmul_f16"),
        (Op::Matmul, Bf16) => ptx_file!("matmul_bf16"),
        (Op::Softmax, F32) => ptx_file!("softmax_f32"),
        (Op::Softmax, F16) => ptx_file!("softmax_f16"),
        (Op::Softmax, Bf16) => ptx_file!("softmax_bf16"),
        (Op::Attention, F32) => ptx_file!("attention_f32"),
        (Op::Attention, F16) => ptx_file!("attention_f16"),
        (Op::Attention, Bf16) => ptx_file!("attention_bf16"),
        (Op::FlashAttention, F32) => ptx_file!("flash_attention_f32"),
        (Op::FlashAttention, F16) => ptx_file!("flash_attention_f16"),
        (Op::FlashAttention, Bf16) => ptx_file!("flash_attention_bf16"),
        (Op::Conv2d, F32) => ptx_file!("conv2d_f32"),
        (Op::Conv2d, F16) => ptx_file!("conv2d_f16"),
        (Op::Conv2d, Bf16) => ptx_file!("conv2d_bf16"),
        (Op::Relu, F32) => ptx_file!("relu_f32"),
        (Op::Relu, F16) => ptx_file!("relu_f16"),
        (Op::Relu, Bf16) => ptx_file!("relu_bf16"),
        (Op::Gelu, F32) => ptx_file!("gelu_f32"),
        (Op::Gelu, F16) => ptx_file!("gelu_f16"),
        (Op::Gelu, Bf16) => ptx_file!("gelu_bf16"),
        (Op::LayerNorm, F32) => ptx_file!("layer_norm_f32"),
        (Op::LayerNorm, F16) => ptx_file!("layer_norm_f16"),
        (Op::LayerNorm, Bf16) => ptx_file!("layer_norm_bf16"),
        (Op::Adam, F32) => ptx_file!("adam_f32"),
        (Op::Adam, F16) => ptx_file!("adam_f16"),
        (Op::Adam, Bf16) => ptx_file!("adam_bf16"),
    }
}

/// The embedded PTX as a module image for `cuModuleLoadData` (NUL-terminated).
pub fn embedded_image(id: KernelId) -> Vec<u8> {
    let text = embedded(id);
    let mut image = Vec::with_capacity(text.len() + 1);
    image.extend_from_slice(text.as_bytes());
    image.push(0);
    image
}

/// Rewrites the `.version` line of NVRTC's PTX to [`EMBED_ISA`] (see the module docs for why
/// that is safe). Errors when there is no `.version` line, or when it is already older.
pub fn pin_version(ptx: &str) -> Result<String, String> {
    let header = parse_header(ptx)?;
    if header.version < EMBED_ISA {
        return Err(format!(
            "NVRTC wrote .version {}.{}, older than the {}.{} it would be rewritten to",
            header.version.0, header.version.1, EMBED_ISA.0, EMBED_ISA.1
        ));
    }
    let wanted = format!(".version {}.{}", EMBED_ISA.0, EMBED_ISA.1);
    let mut out = String::with_capacity(ptx.len());
    let mut done = false;
    for line in ptx.split_inclusive('\n') {
        if !done && line.trim_start().starts_with(".version ") {
            out.push_str(&wanted);
            out.push('\n');
            done = true;
        } else {
            out.push_str(line);
        }
    }
    Ok(out)
}

/// Compiles a kernel with NVRTC into the text committed as `shaders/ptx/<label>.ptx`:
/// PTX for [`EMBED_ARCH`], its `.version` pinned to [`EMBED_ISA`]. Needs NVRTC.
pub fn generate(id: KernelId) -> Result<String, String> {
    let id = canonical(id);
    let c = super::nvrtc::compile(id, super::nvrtc::Target::Ptx(EMBED_ARCH))?;
    let unexpected: Vec<String> = super::nvrtc::unexpected_log_lines(&c.log)
        .into_iter()
        .filter(|l| !l.contains(DEPRECATED_ARCH_WARNING))
        .collect();
    if !unexpected.is_empty() {
        return Err(format!(
            "{} (compute_{EMBED_ARCH} PTX): warnings:\n{}",
            id.label(),
            unexpected.join("\n")
        ));
    }
    pin_version(&c.ptx)
}

/// `.version`, `.target` and `.address_size` of a PTX module.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Header {
    pub version: (u32, u32),
    pub target: String,
    pub address_size: u32,
}

/// One kernel parameter as PTX declares it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Param {
    /// `.param .align A .b8 name[N]`: a struct passed by value.
    Bytes { align: u32, size: usize },
    /// `.param .u64 name` (and other scalar types): `(type, bits)`.
    Scalar(String, u32),
}

impl Param {
    /// Bytes the parameter occupies.
    pub fn size(&self) -> usize {
        match self {
            Param::Bytes { size, .. } => *size,
            Param::Scalar(_, bits) => *bits as usize / 8,
        }
    }
}

/// A `.entry` (kernel) and its parameters in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    pub name: String,
    pub params: Vec<Param>,
}

/// Reads `.version`, `.target` and `.address_size`.
pub fn parse_header(ptx: &str) -> Result<Header, String> {
    let directive = |name: &str| -> Result<&str, String> {
        ptx.lines()
            .map(str::trim)
            .find_map(|l| l.strip_prefix(name))
            .map(str::trim)
            .ok_or_else(|| format!("no `{}` directive", name.trim()))
    };
    let v = directive(".version ")?;
    let (major, minor) = v
        .split_once('.')
        .ok_or_else(|| format!("bad .version `{v}`"))?;
    let num = |s: &str| {
        s.trim()
            .parse::<u32>()
            .map_err(|_| format!("bad number `{s}` in a PTX directive"))
    };
    Ok(Header {
        version: (num(major)?, num(minor)?),
        target: directive(".target ")?.to_string(),
        address_size: num(directive(".address_size ")?)?,
    })
}

/// Every `.entry` with its parameter list.
pub fn parse_entries(ptx: &str) -> Result<Vec<Entry>, String> {
    let mut entries = Vec::new();
    let mut rest = ptx;
    while let Some(at) = rest.find(".entry ") {
        let after = &rest[at + ".entry ".len()..];
        let open = after
            .find('(')
            .ok_or_else(|| "an .entry without a parameter list".to_string())?;
        let name = after[..open].trim().to_string();
        let close = after[open..]
            .find(')')
            .ok_or_else(|| format!("{name}: unterminated parameter list"))?;
        let list = &after[open + 1..open + close];
        let params = list
            .split(',')
            .map(str::trim)
            .filter(|p| !p.is_empty())
            .map(|p| parse_param(&name, p))
            .collect::<Result<Vec<_>, _>>()?;
        entries.push(Entry { name, params });
        rest = &after[open + close..];
    }
    Ok(entries)
}

fn parse_param(entry: &str, text: &str) -> Result<Param, String> {
    let words: Vec<&str> = text.split_whitespace().collect();
    let bad = || format!("{entry}: cannot read parameter `{text}`");
    match words.as_slice() {
        [".param", ".align", align, ".b8", name] => {
            let open = name.find('[').ok_or_else(bad)?;
            let size = name[open + 1..]
                .trim_end_matches(']')
                .parse()
                .map_err(|_| bad())?;
            Ok(Param::Bytes {
                align: align.parse().map_err(|_| bad())?,
                size,
            })
        }
        [".param", ty, _name] => {
            let bits = ty
                .trim_start_matches(['.', 'u', 's', 'b', 'f'])
                .parse()
                .map_err(|_| bad())?;
            Ok(Param::Scalar(ty.trim_start_matches('.').to_string(), bits))
        }
        _ => Err(bad()),
    }
}

/// The opcodes (the instruction name before its first `.` modifier) used in a module's
/// function bodies, sorted and without repeats.
pub fn opcodes(ptx: &str) -> Vec<String> {
    let mut ops: Vec<String> = ptx
        .lines()
        .map(|l| l.split("//").next().unwrap_or("").trim())
        .filter(|l| l.ends_with(';') && !l.starts_with('.'))
        .filter_map(|l| {
            // `@%p1 bra $L__BB0_2;` has a guard first.
            let l = if l.starts_with('@') {
                l.split_once(char::is_whitespace)?.1.trim_start()
            } else {
                l
            };
            let word = l.split(|c: char| c.is_whitespace() || c == ';').next()?;
            let op = word.split('.').next()?;
            (!op.is_empty()).then(|| op.to_string())
        })
        .collect();
    ops.sort();
    ops.dedup();
    ops
}

/// PTX instructions with the ISA version that introduced the newest form of each this file
/// relies on (PTX ISA manual, "PTX ISA Notes" of each instruction; e.g. `ld` counts as 3.1 for
/// `ld.global.nc`, `fma` as 2.0 for `fma.rn.f32`). An opcode missing here fails
/// `tests/it/backend/cuda/ptx.rs`: look it up and add it before relying on the `.version` rewrite.
pub const OPCODE_ISA: &[(&str, (u32, u32))] = &[
    ("abs", (1, 0)),
    ("add", (1, 0)),
    ("and", (1, 0)),
    ("atom", (2, 0)),
    ("bar", (2, 0)),
    ("bfe", (2, 0)),
    ("bfi", (2, 0)),
    ("bra", (1, 0)),
    ("brev", (2, 0)),
    ("clz", (2, 0)),
    ("copysign", (2, 0)),
    ("cvt", (2, 0)),
    ("cvta", (2, 0)),
    ("div", (2, 0)),
    ("ex2", (2, 0)),
    ("fma", (2, 0)),
    ("ld", (3, 1)),
    ("lg2", (2, 0)),
    ("lop3", (4, 3)),
    ("mad", (2, 0)),
    ("max", (1, 0)),
    ("min", (1, 0)),
    ("mov", (1, 0)),
    ("mul", (2, 0)),
    ("neg", (1, 0)),
    ("not", (1, 0)),
    ("or", (1, 0)),
    ("popc", (2, 0)),
    ("prmt", (2, 0)),
    ("rcp", (2, 0)),
    ("rem", (1, 0)),
    ("ret", (1, 0)),
    ("rsqrt", (1, 0)),
    ("selp", (1, 0)),
    ("setp", (1, 0)),
    ("shf", (3, 1)),
    ("shl", (1, 0)),
    ("shr", (1, 0)),
    ("sqrt", (2, 0)),
    ("st", (1, 0)),
    ("sub", (1, 0)),
    ("testp", (2, 0)),
    ("xor", (1, 0)),
];

/// The directives that open a line (`.reg`, `.shared`, ...), sorted and without repeats.
pub fn directives(ptx: &str) -> Vec<String> {
    let mut out: Vec<String> = ptx
        .lines()
        .map(str::trim_start)
        .filter(|l| l.starts_with('.'))
        .filter_map(|l| l.split_whitespace().next())
        .map(str::to_string)
        .collect();
    out.sort();
    out.dedup();
    out
}

/// Directives with the ISA version that introduced them (as [`OPCODE_ISA`]).
pub const DIRECTIVE_ISA: &[(&str, (u32, u32))] = &[
    (".address_size", (2, 3)),
    (".align", (1, 0)),
    (".entry", (1, 0)),
    (".local", (1, 0)),
    (".param", (1, 0)),
    (".pragma", (2, 0)),
    (".reg", (1, 0)),
    (".shared", (1, 0)),
    (".target", (1, 0)),
    (".version", (1, 0)),
    (".visible", (1, 0)),
];

/// The ISA version a directive needs, where [`DIRECTIVE_ISA`] knows it.
pub fn directive_isa(d: &str) -> Option<(u32, u32)> {
    DIRECTIVE_ISA
        .iter()
        .find(|(name, _)| *name == d)
        .map(|&(_, v)| v)
}

/// The ISA version an opcode needs, where [`OPCODE_ISA`] knows it.
pub fn opcode_isa(op: &str) -> Option<(u32, u32)> {
    OPCODE_ISA
        .iter()
        .find(|(name, _)| *name == op)
        .map(|&(_, v)| v)
}

#[cfg(test)]
mod tests {
    use super::*;

    const SAMPLE: &str = "//\n// Generated by NVIDIA NVVM Compiler\n//\n\n.version 8.8\n\
        .target sm_50\n.address_size 64\n\n\t// .globl\tk\n\n.visible .entry k(\n\
        \t.param .align 4 .b8 k_param_0[16],\n\t.param .u64 k_param_1\n)\n{\n\
        \t.reg .pred \t%p<2>;\n\tld.param.u32 \t%r1, [k_param_0];\n\
        \tsetp.ge.u32 \t%p1, %r1, 4;\n\t@%p1 bra \t$L__BB0_2;\n\
        \tatom.global.add.u32 \t%r3, [%rd2], 1; // a comment\n$L__BB0_2:\n\tret;\n\n}\n";

    #[test]
    fn the_version_line_alone_is_rewritten() {
        let pinned = pin_version(SAMPLE).expect("pinned");
        assert!(
            pinned.contains("\n.version 7.0\n.target sm_50\n"),
            "{pinned}"
        );
        assert_eq!(pinned.len(), SAMPLE.len());
        assert_eq!(
            pinned.replace(".version 7.0", ".version 8.8"),
            SAMPLE,
            "only the version changed"
        );
        assert_eq!(parse_header(&pinned).expect("header").version, (7, 0));
        // An already older version is not "upgraded" silently, and no line is an error.
        assert!(pin_version(&SAMPLE.replace("8.8", "6.4")).is_err());
        assert!(pin_version(".target sm_50\n").is_err());
    }

    #[test]
    fn header_entries_and_opcodes_are_read() {
        let h = parse_header(SAMPLE).expect("header");
        assert_eq!(
            h,
            Header {
                version: (8, 8),
                target: "sm_50".into(),
                address_size: 64
            }
        );
        let e = parse_entries(SAMPLE).expect("entries");
        assert_eq!(
            e,
            vec![Entry {
                name: "k".into(),
                params: vec![
                    Param::Bytes { align: 4, size: 16 },
                    Param::Scalar("u64".into(), 64)
                ]
            }]
        );
        assert_eq!(opcodes(SAMPLE), vec!["atom", "bra", "ld", "ret", "setp"]);
        assert_eq!(opcode_isa("ld"), Some((3, 1)));
        assert_eq!(opcode_isa("wgmma"), None);
    }

    #[test]
    fn word_kernels_share_one_file_and_compute_kernels_have_one_each() {
        assert_eq!(
            file_name(KernelId::new(Op::Fill, Storage::Bf16)),
            "fill_f32.ptx"
        );
        assert_eq!(
            file_name(KernelId::new(Op::Gelu, Storage::Bf16)),
            "gelu_bf16.ptx"
        );
        assert_eq!(
            embedded(KernelId::new(Op::Verify, Storage::F16)),
            embedded(KernelId::words(Op::Verify))
        );
        let img = embedded_image(KernelId::words(Op::Fill));
        assert_eq!(img.last(), Some(&0));
        assert!(!img[..img.len() - 1].contains(&0));
    }
}
