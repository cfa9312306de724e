//! Gemma, Gemma 2 and Gemma 3 text (`GemmaForCausalLM`, `Gemma2ForCausalLM`,
//! `Gemma3ForCausalLM`): embeddings multiplied by √hidden, Gemma's RMSNorm (x̂·(1 + w) in fp32),
//! a GeGLU MLP (`gelu_pytorch_tanh`), tied head, `head_dim` of its own. Gemma 2 and 3 add norms
//! after the attention and the MLP; Gemma 2 soft-caps the scores (`attn_logit_softcapping`,
//! eager only) and the logits (`final_logit_softcapping`) with tanh; Gemma 3 normalizes q and k
//! instead of capping the scores.

use super::spec::{Norm, Spec};
use crate::workload::{Arch, Workload};

pub(super) fn spec(w: &Workload) -> Spec {
    let mut s = Spec::llama(w);
    s.norm = Norm::RmsGemma;
    s.embed_scale = true;
    s.sandwich_norms = matches!(w.arch, Arch::Gemma2 | Arch::Gemma3);
    s.qk_norm = w.arch == Arch::Gemma3;
    s
}
