//! What a training step costs in time, estimated: its FLOPs (forward, backward, recompute)
//! against the card's dense peak at the fraction training reaches, the collectives of its layout
//! against the link, and offload traffic over PCIe. An estimate, fitted and checked on published
//! throughput (docs/src/validation.md, "The cost model"): it ranks ways out, it is no benchmark.
//!
//! The FLOPs are the convention torchtitan and llm-foundry report MFU with: per token
//! `6·N + 12·L·w·s` (N the parameters a token multiplies through, embeddings left out; L the
//! attention layers, w their query width, s the sequence), and a recomputed forward adds
//! `2·N + 4·L·w·s` per token. Collectives overlap compute (FSDP's prefetch) and only their
//! excess shows; tensor-parallel all-reduces do not overlap; a pipeline adds its bubble.

pub mod peaks;

use serde::Serialize;

use crate::plan::builder::PlanError;
use crate::workload::{Checkpoint, Precision, Workload};

pub use peaks::Peak;

/// The shape of a step that the cost depends on (per data-parallel rank).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Shape {
    /// Parameters a token multiplies through (active experts only; the LM head, not the input
    /// embedding).
    pub matmul_params: u64,
    /// All parameters (what FSDP gathers and reduces).
    pub params: u64,
    /// Attention layers and their query width (heads × head_dim).
    pub attn_layers: u64,
    pub attn_width: u64,
    pub hidden: u64,
    pub layers: u64,
    pub seq: u64,
    /// Sequences per micro-batch and micro-batches per step (gradient accumulation or the
    /// pipeline's).
    pub micro_batch: u64,
    pub accumulation: u64,
    /// Of the forward, the share recomputed in backward (0 none, 1 full checkpointing).
    pub recompute: f64,
    /// 16-bit compute (bf16/fp16, pure or autocast) or fp32.
    pub half: bool,
    /// Data-parallel ranks that shard the parameters (FSDP / ZeRO-3), 1 for none.
    pub shard: u64,
    /// Data-parallel ranks that replicate (DDP / ZeRO-1/2): an all-reduce of the gradients.
    pub replicate: u64,
    pub tp: u64,
    pub pp: u64,
    /// The optimizer step runs on the host: gradients down and parameters up over PCIe.
    pub offload: bool,
    /// Backward computes the weights' gradients (false for a frozen base under LoRA: 4·N
    /// per token instead of 6·N).
    pub weight_grads: bool,
}

/// The cost of one step on one GPU.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Cost {
    /// Model FLOPs per token (no recompute) and executed FLOPs per step per GPU.
    pub flops_per_token: f64,
    pub step_flops: f64,
    pub compute_seconds: f64,
    pub comm_seconds: f64,
    /// Of `comm_seconds`, what compute does not hide.
    pub exposed_comm_seconds: f64,
    pub offload_seconds: f64,
    pub bubble_seconds: f64,
    pub step_seconds: f64,
    pub tokens_per_second_per_gpu: f64,
    /// The fraction of the card's peak the compute is assumed to reach.
    pub efficiency: f64,
}

/// The fitted fraction of the dense 16-bit peak that training kernels reach on a card of
/// generation `arch`, at hidden width `hidden`: `E_ARCH · h / (h + H0)` (narrow models reach
/// less). Fitted on llm-foundry's A100 and H100 tables (validation/throughput/fit.py).
pub fn efficiency(arch: &str, hidden: u64) -> f64 {
    let top = match arch {
        "Ampere" => E_AMPERE,
        "Hopper" => E_HOPPER,
        _ => E_OTHER,
    };
    let h = hidden as f64;
    top * h / (h + H0)
}

/// Fitted (validation/throughput/fit.py on the build rows).
pub const E_AMPERE: f64 = 0.758;
pub const E_HOPPER: f64 = 0.509;
/// Cards no published row was fitted on (Ada, ...): Ampere's, unchecked.
pub const E_OTHER: f64 = E_AMPERE;
pub const H0: f64 = 525.0;

/// The bandwidth between nodes, per GPU, bytes/s (400 Gb/s InfiniBand or RoCE per GPU).
pub const INTER_NODE: f64 = 50e9;
/// GPUs that share a node's NVLink.
pub const GPUS_PER_NODE: u64 = 8;

impl Shape {
    /// Model FLOPs per token, forward and backward (no recompute).
    pub fn flops_per_token(&self) -> f64 {
        let passes = if self.weight_grads { 6.0 } else { 4.0 };
        passes * self.matmul_params as f64 + 12.0 * self.attn_flops_unit()
    }

    fn attn_flops_unit(&self) -> f64 {
        self.attn_layers as f64 * self.attn_width as f64 * self.seq as f64
    }

    fn recompute_per_token(&self) -> f64 {
        self.recompute * (2.0 * self.matmul_params as f64 + 4.0 * self.attn_flops_unit())
    }

    fn gpus(&self) -> u64 {
        self.shard.max(1) * self.replicate.max(1) * self.tp.max(1) * self.pp.max(1)
    }

    /// The step's cost on card `peak`.
    pub fn cost(&self, peak: &Peak) -> Cost {
        let tokens = (self.micro_batch * self.seq * self.accumulation.max(1)) as f64;
        let split = (self.tp.max(1) * self.pp.max(1)) as f64;
        let per_token = self.flops_per_token() + self.recompute_per_token();
        let step_flops = tokens * per_token / split;
        let efficiency = efficiency(peak.arch, self.hidden);
        let flops_rate = if self.half { peak.half } else { peak.fp32 } * efficiency;
        let compute = step_flops / flops_rate;
        let elem = if self.half { 2.0 } else { 4.0 };
        let link = |ranks: u64| {
            if ranks * split as u64 <= GPUS_PER_NODE {
                peak.link
            } else {
                peak.link.min(INTER_NODE)
            }
        };
        let ring = |n: u64| (n.max(1) - 1) as f64 / n.max(1) as f64;
        let shard_bytes = self.params as f64 * elem / split;
        // FSDP: all-gather for forward and again for backward, reduce-scatter of the gradients.
        let fsdp = 3.0 * shard_bytes * ring(self.shard) / link(self.shard);
        // DDP: one all-reduce (reduce-scatter + all-gather) of the gradients.
        let ddp = 2.0 * shard_bytes * ring(self.replicate) / link(self.replicate);
        let overlapped = fsdp + ddp;
        // TP: two all-reduces of the activations per layer forward, two backward.
        let act = (self.micro_batch * self.seq * self.hidden) as f64 * elem;
        let tp_layers = (self.layers / self.pp.max(1)) as f64;
        let tp = 4.0 * tp_layers * 2.0 * act * ring(self.tp) / peak.link
            * self.accumulation.max(1) as f64;
        let offload = if self.offload {
            2.0 * self.params as f64 * elem / (split * self.shard.max(1) as f64) / peak.pcie
        } else {
            0.0
        };
        let exposed = (overlapped - compute).max(0.0) + tp;
        let busy = compute + exposed + offload;
        // 1F1B / GPipe: (p - 1) idle slots over m micro-batches.
        let bubble = if self.pp > 1 {
            busy * (self.pp - 1) as f64 / self.accumulation.max(1) as f64
        } else {
            0.0
        };
        let step = busy + bubble;
        Cost {
            flops_per_token: self.flops_per_token(),
            step_flops,
            compute_seconds: compute,
            comm_seconds: overlapped + tp,
            exposed_comm_seconds: exposed,
            offload_seconds: offload,
            bubble_seconds: bubble,
            step_seconds: step,
            tokens_per_second_per_gpu: tokens
                * self.replicate.max(1) as f64
                * self.shard.max(1) as f64
                / step
                / self.gpus() as f64,
            efficiency,
        }
    }
}

/// The share of `w`'s forward that its checkpointing recomputes in backward. Op-level
/// selective checkpointing recomputes a LLaMA layer's k, o and up projections and no attention
/// core: their share of the layer's matmul FLOPs per token (`ops_share`).
pub fn recompute_share(w: &Workload) -> f64 {
    let layers = w.layers;
    match w.checkpoint {
        Checkpoint::Ops => ops_share(w),
        Checkpoint::None => 0.0,
        // checkpoint_sequential recomputes every segment: a whole forward.
        Checkpoint::Full | Checkpoint::Sqrt => 1.0,
        Checkpoint::Every(k) => {
            if layers == 0 || k == 0 {
                0.0
            } else {
                (layers.div_ceil(u64::from(k)) as f64 / layers as f64).min(1.0)
            }
        }
    }
}

/// The share of a LLaMA layer's forward FLOPs per token that torchtitan's op-level policy
/// recomputes: k_proj, o_proj and up_proj, of the seven projections and the causal attention
/// core (about 2·s·(query width) multiply-adds per token).
fn ops_share(w: &Workload) -> f64 {
    let (h, f, s) = (w.hidden as f64, w.ffn as f64, w.seq as f64);
    let qw = (w.heads * w.head_dim()) as f64;
    let kvw = (w.kv_heads() * w.head_dim()) as f64;
    let recomputed = h * kvw + qw * h + h * f;
    let all = 2.0 * h * qw + 2.0 * h * kvw + 3.0 * h * f + 2.0 * s * qw;
    if all > 0.0 {
        recomputed / all
    } else {
        0.0
    }
}

/// The shape of a transformer workload's step on one data-parallel rank.
pub fn shape_of(w: &Workload) -> Result<Shape, PlanError> {
    // The base's weights as the matmuls see them: a 4-bit base is dequantized to its compute
    // type for each matmul, and the adapters' FLOPs are a rounding error (rank ≪ width).
    let mut dense = w.clone();
    dense.quant = None;
    dense.lora = None;
    let pieces = crate::plan::transformer::pieces(&dense)?;
    let params: u64 = pieces.iter().map(|p| p.elems).sum();
    let embed: u64 = pieces
        .iter()
        .filter(|p| p.name == "embed" || p.name == "embed.rest")
        .map(|p| p.elems)
        .sum();
    let head = if pieces.iter().any(|p| p.name == "head") {
        0
    } else {
        w.vocab.saturating_mul(w.hidden)
    };
    let (inactive, attn_layers, attn_width) = match &w.model {
        Some(m) => {
            let inactive = m
                .layers
                .iter()
                .map(|l| l.params(m.hidden, m.norm).inactive)
                .sum::<u64>();
            let attn: Vec<u64> = m.layers.iter().filter_map(|l| l.query_width()).collect();
            let width = attn.iter().max().copied().unwrap_or(0);
            (inactive, attn.len() as u64, width)
        }
        None => {
            let inactive = w.moe.map_or(0, |m| {
                w.layers * m.experts.saturating_sub(m.top_k) * 3 * w.hidden * m.expert_ffn
            });
            (inactive, w.layers, w.heads * w.head_dim())
        }
    };
    let p = &w.parallel;
    let dp = w.gpus.max(1) / (p.tp.max(1) * p.pp.max(1) * p.cp.max(1)).max(1);
    let sharded = p.fsdp.is_some() || w.zero >= 3;
    Ok(Shape {
        matmul_params: (params - embed.min(params) + head).saturating_sub(inactive),
        params,
        attn_layers,
        attn_width,
        hidden: w.hidden,
        layers: w.layers,
        seq: w.seq,
        micro_batch: w.batch,
        accumulation: p.microbatches(),
        recompute: recompute_share(w),
        half: !matches!(w.precision, Precision::Fp32),
        shard: if sharded { dp.max(1) } else { 1 },
        replicate: if sharded { 1 } else { dp.max(1) },
        tp: p.tp.max(1),
        pp: p.pp.max(1),
        offload: p.offload,
        weight_grads: w.lora.is_none(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn full_checkpointing_costs_a_third_more_compute() {
        let s = Shape {
            matmul_params: 7_000_000_000,
            params: 7_500_000_000,
            attn_layers: 32,
            attn_width: 4096,
            hidden: 4096,
            layers: 32,
            seq: 2048,
            micro_batch: 1,
            accumulation: 1,
            recompute: 0.0,
            half: true,
            shard: 1,
            replicate: 1,
            tp: 1,
            pp: 1,
            offload: false,
            weight_grads: true,
        };
        let p = peaks::get("a100-80gb").unwrap();
        let none = s.cost(p);
        let full = Shape {
            recompute: 1.0,
            ..s
        }
        .cost(p);
        let r = full.compute_seconds / none.compute_seconds;
        assert!((r - 4.0 / 3.0).abs() < 1e-9, "{r}");
        assert!(full.tokens_per_second_per_gpu < none.tokens_per_second_per_gpu);
    }

    #[test]
    fn llama3_8b_multiplies_through_its_weights_less_the_input_embedding() {
        let w = crate::workload::presets::get("llama3-8b").expect("a preset");
        let s = shape_of(&w).unwrap();
        // 8,030,261,248 parameters less the 128256 × 4096 input embedding (the untied head
        // stays): torchtitan's `num_params` for its MFU.
        assert_eq!(s.params, 8_030_261_248);
        assert_eq!(s.matmul_params, 8_030_261_248 - 128_256 * 4096);
        assert_eq!((s.attn_layers, s.attn_width), (32, 4096));
    }

    #[test]
    fn every_kth_layer_recomputes_its_share() {
        let mut w = crate::workload::presets::get("llama3-8b").expect("a preset");
        let mut share = |c| {
            w.checkpoint = c;
            recompute_share(&w)
        };
        assert_eq!(share(Checkpoint::Every(2)), 0.5);
        assert_eq!(share(Checkpoint::None), 0.0);
        assert_eq!(share(Checkpoint::Full), 1.0);
        // k (1024 wide), o (4096) and up (14336) of q, k, v, o, gate, up, down and the
        // attention core at s 2048: between a quarter and a half of a whole forward.
        let ops = share(Checkpoint::Ops);
        assert!(ops > 0.25 && ops < 0.5, "{ops}");
    }
}
