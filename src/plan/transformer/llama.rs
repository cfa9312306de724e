//! LLaMA and Mistral (`LlamaForCausalLM`, `MistralForCausalLM`): RMSNorm, RoPE, q, k, v, o
//! without biases (`attention_bias` adds them), grouped-query attention by
//! `num_key_value_heads`, SwiGLU MLP, untied head. Mistral's sliding window is a mask over the
//! same [b, a, s, s] scores in eager attention and SDPA: no memory of its own.

use super::spec::Spec;
use crate::workload::Workload;

pub(super) fn spec(w: &Workload) -> Spec {
    Spec::llama(w)
}
