//! oomprobe's integration tests, in one test binary (`cargo test --test it`), so the crate and
//! wgpu are linked once rather than once per file.
//!
//! Where a test lives: the folders mirror `src/`. A test that calls the library goes under the
//! module it tests (`plan/` for `src/plan/`, `backend/wgpu/` for `src/backend/wgpu.rs`, …); a
//! test that runs the `oomprobe` binary (`support::adapter::oomprobe`, or `assert_cmd`) and
//! reads what it prints goes under `cli/`, one file per command or per flag that cuts across
//! commands. `support/` holds the helpers the files share. The module tree below is the whole
//! list; a new file is one more `mod` line here (`layout` fails on a file left out).
//!
//! Running part of it: a test's name is its path, so `cargo test --test it plan::` runs the plan
//! tests, `cargo test --test it cli::probe::` one file, and `cargo test --test it -- --ignored`
//! the ignored ones (NVIDIA GPU, unlicensed snapshots, developer traces).
//!
//! What is not here: each module's unit tests sit in `src/` beside the code (`cargo test
//! --lib`); the fixtures the tests read are in `tests/fixtures/` (found through
//! `CARGO_MANIFEST_DIR`); proptest keeps its failing seeds in `tests/proptest-regressions/`,
//! which its default `FileFailurePersistence::SourceParallel` derives from this file's folder
//! (`plan/closed_forms.rs` → `tests/proptest-regressions/plan/closed_forms.txt`).
//!
//! The tests share one process and run on parallel threads: a test must not change what the
//! process shares (environment variables, the current directory) and must not depend on
//! running alone. A test that asserts on wall time takes `support::load::timed()`, and one that
//! loads every core takes `support::load::every_core()`, so the two never overlap.

mod layout;
mod support;

mod alloc {
    mod fragmentation_order;
}

mod backend {
    mod cuda {
        mod absent;
        mod kernels;
        mod nvrtc;
        mod ptx;
    }
    mod wgpu {
        mod alloc;
        mod kernels;
    }
}

mod cost {
    mod published;
}

mod cli {
    mod alloc_conf_fuzz;
    mod compare;
    mod devices;
    mod diagnose;
    mod diagnose_oom;
    mod estimate;
    mod estimate_chart;
    mod finetune;
    mod hostile_inputs;
    mod hub;
    mod layout_fuzz;
    mod oom_text_fuzz;
    mod parallel;
    mod probe;
    mod serve;
    mod snapshot;
    mod snapshot_big;
    mod snapshot_fuzz;
    mod terminal;
}

mod oom {
    mod message_corpus;
}

mod plan {
    mod autocast;
    mod closed_forms;
    mod distributed;
    mod parallel_props;
    mod published_memory;
    mod releases;
    mod step_order;
    mod validation;
}

mod probe {
    mod allocator;
    mod hazards;
}

mod report {
    mod exporters;
}

mod search {
    mod under_load;
}

mod serve {
    mod vllm_logs;
}

mod snapshot {
    mod parse_scale_export;
    mod real_files;
    mod shared_stacks;
}

mod workload {
    mod case_files;
    mod config_fuzz;
    mod hf {
        mod llm_configs;
        mod quantized_configs;
    }
}
