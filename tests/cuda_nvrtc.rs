//! NVRTC compile check (no GPU needed): every `shaders/*.cu` kernel compiles to PTX for every
//! storage type, without errors or unexpected warnings. Fails (does not skip) when NVRTC is
//! missing, saying how to install it.
#![cfg(feature = "cuda")]

use oomprobe::backend::cuda::{self, loader, nvrtc};
use oomprobe::kernels::Op;

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
fn every_cuda_kernel_compiles_to_ptx_without_warnings() {
    require_nvrtc();
    let (major, minor) = nvrtc::version().expect("nvrtcVersion");
    let compiled = match cuda::compile_all_kernels() {
        Ok(c) => c,
        Err(e) => panic!("CUDA kernels failed the NVRTC check (NVRTC {major}.{minor}):\n{e}"),
    };
    eprintln!("NVRTC {major}.{minor}, compute_{}:", nvrtc::CHECK_ARCH);
    for (label, bytes) in &compiled {
        eprintln!("  {label:<24} {bytes:>7} bytes of PTX");
    }
    let expected = nvrtc::all_kernel_ids();
    assert_eq!(compiled.len(), expected.len());
    // 3 word kernels once, 9 compute kernels x 3 storage types.
    assert_eq!(expected.len(), 3 + 9 * 3);
    for (label, bytes) in &compiled {
        assert!(
            *bytes > 200,
            "{label}: suspiciously small PTX ({bytes} bytes)"
        );
    }
}

#[test]
fn each_ptx_defines_its_entry_point_with_params_and_buffers() {
    require_nvrtc();
    for id in nvrtc::all_kernel_ids() {
        let c = nvrtc::compile(id, nvrtc::CHECK_ARCH).unwrap_or_else(|e| panic!("{e}"));
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
    let c = nvrtc::compile_source("warning_probe", src, nvrtc::CHECK_ARCH)
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
