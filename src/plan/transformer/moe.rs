//! Mixtral, Qwen2-MoE and Qwen3-MoE (`MixtralForCausalLM`, `Qwen2MoeForCausalLM`,
//! `Qwen3MoeForCausalLM`): the attention of LLaMA, Qwen2 and Qwen3, and a sparse MoE block in
//! place of the MLP: a router (`gate`, [E, h]), top-k routing, experts stored as two 3-D
//! parameters (`gate_up_proj` [E, 2f, h], `down_proj` [E, h, f]) and run as transformers 5.24
//! does by default (`grouped_mm_experts_forward`, integrations/moe.py): tokens gathered and
//! sorted by expert into [T·k, h], one grouped matmul for gate-up and one for down, the
//! outputs weighted and summed back per token. Qwen2-MoE adds a shared expert (a SwiGLU of
//! `shared_expert_intermediate_size`) with a sigmoid gate that every token runs through.

use super::spec::{Mlp, Spec};
use crate::workload::{Arch, Workload};

pub(super) fn spec(w: &Workload) -> Spec {
    let mut s = Spec::llama(w);
    match w.arch {
        Arch::Qwen2Moe => {
            s.qkv_bias = w.attention_bias.unwrap_or(true);
            s.o_bias = false;
        }
        Arch::Qwen3Moe => s.qk_norm = true,
        _ => {}
    }
    s.mlp = Mlp::Moe;
    s
}
