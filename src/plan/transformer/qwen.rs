//! Qwen2 / Qwen2.5 and Qwen3 (`Qwen2ForCausalLM`, `Qwen3ForCausalLM`): LLaMA's layer. Qwen2's
//! q, k and v projections have biases (o has none); Qwen3 drops them and normalizes each
//! head's q and k with an RMSNorm over `head_dim` before the rotation.

use super::spec::Spec;
use crate::workload::{Arch, Workload};

pub(super) fn spec(w: &Workload) -> Spec {
    let mut s = Spec::llama(w);
    match w.arch {
        Arch::Qwen2 => {
            s.qkv_bias = w.attention_bias.unwrap_or(true);
            s.o_bias = false;
        }
        _ => s.qk_norm = true,
    }
    s
}
