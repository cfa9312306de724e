//! Phi-3 (`Phi3ForCausalLM`): LLaMA's layer with one `qkv_proj` (q, k, v are slices of its
//! output) and one `gate_up_proj` (gate and up are the two halves of its output).

use super::spec::Spec;
use crate::workload::Workload;

pub(super) fn spec(w: &Workload) -> Spec {
    let mut s = Spec::llama(w);
    s.fused_qkv = true;
    s.fused_gate_up = true;
    s
}
