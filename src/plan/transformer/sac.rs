//! Op-level selective activation checkpointing as torchtitan builds it: what each layer's
//! forward keeps, and the layers the policy is modelled for.
//!
//! Source: pytorch/torchtitan b5bcd76, `torchtitan/distributed/activation_checkpoint.py`,
//! `SelectiveAC._wrap_block` over `torch.utils.checkpoint.create_selective_checkpoint_contexts`.
//! Every transformer block is checkpointed (non-reentrant). Its policy marks `MUST_SAVE` the
//! outputs of the ops `_get_default_save_ops` lists (functorch's compute-intensive ops: `mm`,
//! `addmm`, `bmm`, the SDPA flash/efficient/cuDNN kernels, `_scaled_mm`; and `linear`, `max`,
//! `topk`, the collectives), except every second `mm`/`linear` counted in the block's forward
//! (one count per checkpoint call). Everything else is recomputed in backward.
//!
//! For a LLaMA-style layer (bias-free q, k, v, o; gate, up, down) the matmuls run q(1) k(2)
//! v(3) o(4) gate(5) up(6) down(7): the forward keeps the outputs of q_proj, v_proj, gate_proj
//! and down_proj, and the attention kernel's output and logsumexp, beside the block's input
//! (the checkpoint). The recomputation takes the kept tensors back instead of making them
//! (`Builder::stash_begin`). Measured against PyTorch on the CPU with the CPU's flash kernel
//! standing in for CUDA's: `validation/measure_sac.py`, `tests/fixtures/sac_measured.json`.

use super::spec::{Mlp, Spec};
use crate::plan::build::PlanError;
use crate::workload::layers::{Mixer, MlpSpec};
use crate::workload::{Attention, Precision, Workload};

/// Why `--checkpoint ops` is not planned for `w` (None: it is).
pub(super) fn refusal(w: &Workload, spec: &Spec) -> Option<&'static str> {
    let layered = w.model.as_ref().map_or(&[][..], |m| &m.layers[..]);
    if !w.is_decoder_llm() {
        Some("is modelled for the decoder LLMs (LLaMA-style layers)")
    } else if w.attention != Attention::Sdpa {
        Some("is modelled with --attention sdpa, whose kernels torchtitan's list names")
    } else if w.moe.is_some()
        || layered.iter().any(|l| {
            !matches!(l.mixer, Mixer::Attention(_))
                || !matches!(l.mlp, MlpSpec::Dense { gated: true, .. })
        })
    {
        Some("is modelled for attention layers with a dense gated MLP (no experts or other mixers)")
    } else if spec.fused_qkv || spec.fused_gate_up || spec.mlp != Mlp::Gated {
        Some("is modelled for separate q, k, v projections and a gated MLP")
    } else if spec.qkv_bias || spec.o_bias || spec.mlp_bias {
        Some("is modelled for bias-free projections (with a bias a linear is an addmm, always saved)")
    } else if w.lora.is_some() || w.quant.is_some() {
        Some("is modelled for full training (adapters add matmuls to the count)")
    } else if w.parallel.tp > 1 || w.parallel.cp > 1 {
        Some("is modelled without tensor or context parallelism")
    } else if w.precision.is_autocast() && w.parallel.fsdp.is_none() {
        Some("is modelled without torch.autocast (amp-* with --fsdp is FSDP2's mixed precision)")
    } else if w.precision == Precision::Mixed {
        Some("is modelled for fp32, fp16, bf16 and FSDP2's mixed precision")
    } else {
        None
    }
}

/// The check a plan makes before it is built.
pub(super) fn allowed(w: &Workload, spec: &Spec) -> Result<(), PlanError> {
    match refusal(w, spec) {
        Some(why) => Err(PlanError::Unsupported(format!(
            "--checkpoint ops (torchtitan's selective checkpointing) {why}"
        ))),
        None => Ok(()),
    }
}

/// The tensors layer `i`'s checkpointed forward keeps: the odd matmuls' outputs and the
/// attention kernel's output and logsumexp.
pub(super) fn kept(i: u64) -> Vec<String> {
    [
        "q_proj",
        "v_proj",
        "ctx",
        "attn.stats",
        "mlp.gate",
        "mlp.out",
    ]
    .iter()
    .map(|n| format!("L{i}.{n}"))
    .collect()
}
