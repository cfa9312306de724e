//! NVRTC compile check (no GPU needed): every `shaders/*.cu` kernel compiles to PTX for every
//! storage type, without errors or unexpected warnings. Fails (does not skip) when NVRTC is
//! missing, saying how to install it.
#![cfg(feature = "cuda")]

use oomprobe::backend::cuda::nvrtc::Target;
use oomprobe::backend::cuda::ptx;
use oomprobe::backend::cuda::{self, loader, nvrtc};
use oomprobe::kernels::{params, Op};

fn require_nvrtc() {
    if let Err(reason) = loader::nvrtc_library() {
        panic!(
            "NVRTC is required for the CUDA kernel compile check and was not found: {reason}\n\
             (cudarc opens libnvrtc.so.12 with dlopen, i.e. through LD_LIBRARY_PATH and the \
             ld.so cache; the pip package puts it in site-packages/nvidia/cuda_nvrtc/lib)"
        );
    }
}

#[test]
fn every_cuda_kernel_compiles_without_warnings() {
    require_nvrtc();
    let (major, minor) = nvrtc::version().expect("nvrtcVersion");
    let compiled = match cuda::compile_all_kernels() {
        Ok(c) => c,
        Err(e) => panic!("CUDA kernels failed the NVRTC check (NVRTC {major}.{minor}):\n{e}"),
    };
    eprintln!("NVRTC {major}.{minor}:");
    for (label, bytes) in &compiled {
        eprintln!("  {label:<40} {bytes:>7} bytes");
    }
    let expected = nvrtc::all_kernel_ids();
    // 3 word kernels once, 9 compute kernels x 3 storage types, for each target.
    assert_eq!(expected.len(), 3 + 9 * 3);
    assert_eq!(compiled.len(), expected.len() * nvrtc::CHECK_TARGETS.len());
    for (label, bytes) in &compiled {
        assert!(
            *bytes > 200,
            "{label}: suspiciously small output ({bytes} bytes)"
        );
    }
}

#[test]
fn cubins_are_elf_images_for_their_architecture() {
    require_nvrtc();
    let id = nvrtc::all_kernel_ids()[0];
    let c = nvrtc::compile(id, Target::Cubin(90)).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        &c.image[..4],
        b"\x7fELF",
        "{}: not an ELF image",
        id.label()
    );
    // The backend picks a CUBIN for an architecture NVRTC knows, PTX below an unknown one.
    assert_eq!(nvrtc::target_for_device(9, 0), Ok(Target::Cubin(90)));
    let archs = nvrtc::supported_archs().expect("supported archs");
    let newest = *archs.last().expect("at least one arch");
    assert_eq!(nvrtc::target_for_device(99, 9), Ok(Target::Ptx(newest)));
    assert!(nvrtc::target_for_device(1, 0).is_err());
}

#[test]
fn each_ptx_defines_its_entry_point_with_params_and_buffers() {
    require_nvrtc();
    for id in nvrtc::all_kernel_ids() {
        let c =
            nvrtc::compile(id, Target::Ptx(nvrtc::CHECK_ARCH)).unwrap_or_else(|e| panic!("{e}"));
        let entry = format!(".entry {}(", nvrtc::entry_point(id.op));
        assert!(
            c.ptx.contains(&entry),
            "{}: no `{entry}` in the PTX",
            id.label()
        );
        assert!(
            c.ptx
                .contains(&format!("{}_param_0", nvrtc::entry_point(id.op))),
            "{}: the entry point takes no params struct",
            id.label()
        );
    }
}

#[test]
fn a_broken_kernel_is_reported_with_the_nvrtc_log() {
    require_nvrtc();
    // The check must be able to fail: an unknown identifier is a compile error whose log
    // names it. (Uses the same NVRTC entry points as `compile`, through cudarc.)
    let err = cudarc::nvrtc::compile_ptx("extern \"C\" __global__ void k() { undefined_name(); }")
        .expect_err("an undefined identifier must not compile");
    assert!(format!("{err:?}").contains("undefined_name"), "{err:?}");
}

#[test]
fn an_nvrtc_warning_fails_the_check() {
    require_nvrtc();
    // A variable set but never used is a warning (the compile succeeds, the log is not empty):
    // the check must see it, so a kernel that gains a warning fails CI.
    let src = "extern \"C\" __global__ void k(unsigned int* p) { int unused = 3; p[0] = 1u; }";
    let c = nvrtc::compile_source("warning_probe", src, Target::Ptx(nvrtc::CHECK_ARCH))
        .unwrap_or_else(|e| panic!("{e}"));
    let lines = nvrtc::unexpected_log_lines(&c.log);
    assert!(
        !lines.is_empty(),
        "NVRTC reported no warning; log: {:?}",
        c.log
    );
    assert!(lines.iter().any(|l| l.contains("warning")), "{lines:?}");
}

#[test]
fn warnings_are_detected_by_the_log_filter() {
    let log = "kernel.cu(3): warning #177-D: variable \"x\" was declared but never referenced\n";
    assert_eq!(nvrtc::unexpected_log_lines(log).len(), 1);
    assert!(nvrtc::unexpected_log_lines("\n  \n").is_empty());
}

#[test]
fn every_cu_file_in_shaders_is_compiled_by_the_check() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("shaders");
    let mut known: Vec<String> = Op::ALL
        .iter()
        .map(|op| format!("{}.cu", op.name()))
        .collect();
    known.extend(nvrtc::SUPPORT_FILES.iter().map(|s| s.to_string()));
    for entry in std::fs::read_dir(&dir).expect("shaders/") {
        let name = entry
            .expect("dir entry")
            .file_name()
            .to_string_lossy()
            .into_owned();
        if name.ends_with(".cu") {
            assert!(
                known.contains(&name),
                "shaders/{name} is not part of any CUDA kernel"
            );
        }
    }
    for op in Op::ALL {
        assert!(
            dir.join(format!("{}.cu", op.name())).is_file(),
            "missing shaders/{}.cu",
            op.name()
        );
    }
}

/// `struct Params` fields as (name, type) with CUDA `float` spelled `f32`.
fn params_fields(src: &str, cuda: bool) -> Vec<(String, String)> {
    let start = src
        .find("struct Params {")
        .expect("a `struct Params` block");
    let body = &src[start + "struct Params {".len()..];
    let body = &body[..body.find('}').expect("end of struct Params")];
    body.lines()
        .map(|l| l.trim().trim_end_matches([',', ';']))
        .filter(|l| !l.is_empty() && !l.starts_with("//"))
        .map(|l| {
            if cuda {
                let (ty, name) = l.split_once(' ').expect("`type name`");
                let ty = if ty == "float" { "f32" } else { ty };
                (name.trim().to_string(), ty.to_string())
            } else {
                let (name, ty) = l.split_once(':').expect("`name: type`");
                (name.trim().to_string(), ty.trim().to_string())
            }
        })
        .collect()
}

#[test]
fn cuda_kernels_mirror_the_wgsl_params_and_buffers() {
    use oomprobe::kernels::source::wgsl_source;
    for id in nvrtc::all_kernel_ids() {
        let wgsl = wgsl_source(id);
        let cu = nvrtc::cuda_source(id);
        let wf = params_fields(&wgsl, false);
        let cf = params_fields(&cu, true);
        assert_eq!(
            cf,
            wf,
            "{}: CUDA Params differ from WGSL Params",
            id.label()
        );
        assert!(
            cf.iter().all(|(_, t)| t == "u32" || t == "f32"),
            "{}: only 4-byte fields keep the C layout equal to WGSL's",
            id.label()
        );
        assert_eq!(
            cf.len() * 4,
            params::params_bytes(id.op),
            "{}: size vs kernels::params",
            id.label()
        );
        // Buffers: WGSL bindings 1.. vs the CUDA entry point's arguments after Params.
        let wgsl_buffers = wgsl.matches("@binding(").count() - 1;
        let sig = format!("void {}(", nvrtc::entry_point(id.op));
        let at = cu.find(&sig).or_else(|| {
            // attention: the entry point is spelled through SOFTMAX_ENTRY.
            cu.find("void SOFTMAX_ENTRY(")
        });
        let at = at.unwrap_or_else(|| panic!("{}: no entry point in the CUDA source", id.label()));
        let args = &cu[at..];
        let args = &args[args.find('(').unwrap_or(0) + 1..args.find(')').unwrap_or(0)];
        let cuda_buffers = args.split(',').count() - 1;
        assert_eq!(cuda_buffers, wgsl_buffers, "{}: buffer count", id.label());
        assert_eq!(
            cuda_buffers,
            params::buffer_count(id.op),
            "{}: buffer count vs kernels::params::buffer_count",
            id.label()
        );
    }
}

/// The committed `shaders/ptx/*.ptx` are what the current `.cu` sources compile to (so a `.cu`
/// edit without `scripts/gen-ptx.sh` fails here), byte for byte. With `OOMPROBE_REGEN_PTX=1`
/// this test writes the files instead (what `scripts/gen-ptx.sh` does).
#[test]
fn committed_ptx_is_what_the_sources_compile_to() {
    require_nvrtc();
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("shaders/ptx");
    let regen = std::env::var_os("OOMPROBE_REGEN_PTX").is_some_and(|v| v == "1");
    let mut stale = Vec::new();
    for id in nvrtc::all_kernel_ids() {
        let fresh = ptx::generate(id).unwrap_or_else(|e| panic!("{e}"));
        let path = dir.join(ptx::file_name(id));
        if regen {
            std::fs::create_dir_all(&dir).expect("create shaders/ptx");
            std::fs::write(&path, &fresh).expect("write PTX");
            continue;
        }
        let committed = std::fs::read_to_string(&path).unwrap_or_default();
        if committed != fresh {
            stale.push(ptx::file_name(id));
        }
    }
    if !stale.is_empty() {
        let nvrtc_release = ptx::generate(nvrtc::all_kernel_ids()[0])
            .ok()
            .and_then(|t| {
                t.lines()
                    .find(|l| l.contains("release"))
                    .map(str::to_string)
            })
            .unwrap_or_default();
        panic!(
            "shaders/ptx is stale for {stale:?}: run scripts/gen-ptx.sh and commit the result.\n\
             (The files were generated by NVRTC {}; this NVRTC says `{}`: another NVRTC \
             release emits other code, install the pinned one with `pip install \
             nvidia-cuda-nvrtc-cu12==12.9.86`.)",
            ptx::GENERATOR_RELEASE,
            nvrtc_release.trim_start_matches(['/', ' '])
        );
    }
}

/// The embedded target assembles too: a CUBIN for sm_50 (the oldest card the embedded PTX
/// targets) runs NVRTC's assembler over the same code, inline `asm` included, which PTX
/// output alone does not check.
#[test]
fn every_kernel_assembles_for_the_embedded_architecture() {
    require_nvrtc();
    for id in nvrtc::all_kernel_ids() {
        let c =
            nvrtc::compile(id, Target::Cubin(ptx::EMBED_ARCH)).unwrap_or_else(|e| panic!("{e}"));
        let unexpected: Vec<String> = nvrtc::unexpected_log_lines(&c.log)
            .into_iter()
            .filter(|l| !l.contains(ptx::DEPRECATED_ARCH_WARNING))
            .collect();
        assert!(unexpected.is_empty(), "{}: {unexpected:?}", id.label());
        assert_eq!(&c.image[..4], b"\x7fELF", "{}", id.label());
    }
}
