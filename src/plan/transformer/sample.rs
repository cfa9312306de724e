//! A serving engine's profiling forward ends in logits for each request's last token and the
//! sampler's temporaries over them (vLLM's `_dummy_sampler_run`), not logits for every token.

use crate::plan::build::{Builder, PlanError};
use crate::plan::{DType, Role, TensorIx};
use crate::workload::Workload;

/// Rows the head computes in a serving profile: one per request, `min(tokens, max_num_seqs)`
/// (`vllm/v1/worker/gpu_model_runner.py@e675dda:4319-4322, 4542-4546`); None outside serving.
pub fn rows(w: &Workload, tokens: u64) -> Option<u64> {
    let s = w.serve.as_ref()?;
    Some(tokens.min(s.max_num_seqs.unwrap_or(tokens)).max(1))
}

/// The sampler over `[rows, vocab]` logits at its peak, which is `apply_top_k_top_p`'s
/// scatter (`vllm/v1/sample/ops/topk_topp_sampler.py@e675dda:243-283`; the dummy run uses
/// top_k = V − 1 and top_p = 0.9, so it sorts, `gpu_model_runner.py:4549-4600`): besides the
/// caller's 16-bit logits, the fp32 copy (`sampler.py:90`), the sorted values (fp32) and
/// indices (int64), the top-k mask (bool), the softmax of the sorted values (fp32, the
/// cumsum writes into it), the top-p mask (bool) and the scatter's output (fp32): 26 B per
/// element on top of the logits. All are gone when the sampler returns.
pub fn sampler(b: &mut Builder, rows: u64, vocab: u64) -> Result<(), PlanError> {
    let shape = [rows, vocab];
    let mut live: Vec<TensorIx> = Vec::new();
    for (name, dtype) in [
        ("sampler.logits_f32", DType::F32),
        ("sampler.sorted", DType::F32),
        ("sampler.sorted_idx", DType::I64),
        ("sampler.top_k_mask", DType::U8),
        ("sampler.probs_sorted", DType::F32),
        ("sampler.top_p_mask", DType::U8),
        ("sampler.scattered", DType::F32),
    ] {
        live.push(b.push(name, Role::Workspace, dtype, &shape, vocab)?);
    }
    b.free_all(live);
    Ok(())
}
