//! Parallel layouts: the degrees a training job is split by (`--fsdp`, `--ddp`, `--tp` with
//! `--sequence-parallel`, `--pp` with `--microbatches` and `--schedule`, `--cp`, `--dp`), each
//! rank's place in them (`--rank`), the checks that a layout fits the model, and the local
//! shape one rank's plan is built from.
//!
//! Ranks are numbered as torchtitan lays out its device mesh (`pp, dp, cp, tp`, tensor
//! parallelism innermost, so a TP group shares a node):
//! rank = ((pp_i·dp + dp_i)·cp + cp_i)·tp + tp_i. `--batch` is what one rank's forward sees
//! (the micro-batch); a pipeline runs `--microbatches` of them per step.

use serde::{Deserialize, Serialize};

use super::{Attention, Workload};

/// FSDP's sharding of the model states over the data-parallel ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Fsdp {
    /// `fully_shard` over every data-parallel rank (FSDP2; FSDP1's FULL_SHARD).
    Full,
    /// Sharded within a node of `HYBRID_GROUP` GPUs, replicated across nodes (HSDP).
    Hybrid,
    /// Parameters kept unsharded from forward to backward (FSDP1's SHARD_GRAD_OP; FSDP2's
    /// `reshard_after_forward=False`).
    ShardGradOp,
}

/// The embedding and output head under tensor parallelism.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TpHead {
    /// Split by vocabulary, logits and loss too (Megatron's vocabulary-parallel
    /// cross-entropy, torchtitan's `loss_parallel`).
    #[default]
    Sharded,
    /// Split by vocabulary, the logits all-gathered to full size for the loss
    /// (`ColwiseParallel(output_layouts=Replicate())`).
    Gathered,
    /// Whole on every rank: only the layers are split.
    Replicated,
}

/// GPUs one hybrid shard group spans (one node).
pub const HYBRID_GROUP: u64 = 8;

/// A pipeline schedule.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Schedule {
    /// All forwards, then all backwards: a stage holds every micro-batch's activations.
    Gpipe,
    /// One forward, one backward (PipeDream-flush): stage i holds min(pp − i, M) of them.
    #[default]
    #[serde(rename = "1f1b")]
    OneFOneB,
    /// Interleaved 1F1B over `chunks` virtual stages per rank (Megatron's virtual pipeline):
    /// stage i holds the activations of pp − i micro-batches of each chunk plus
    /// (pp − 1)/chunks more, as Narayanan et al. (2021) §2.2 count them.
    Interleaved,
}

impl Schedule {
    pub fn name(self) -> &'static str {
        match self {
            Schedule::Gpipe => "gpipe",
            Schedule::OneFOneB => "1f1b",
            Schedule::Interleaved => "interleaved",
        }
    }
}

fn one() -> u64 {
    1
}
fn yes() -> bool {
    true
}

/// How one training job is split across its GPUs. The default is one GPU.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Parallel {
    /// Tensor-parallel degree: attention heads, key/value heads, the MLP's width and the
    /// vocabulary split over `tp` ranks (Megatron's column- and row-parallel linears).
    #[serde(default = "one")]
    pub tp: u64,
    /// Sequence parallelism (with `tp`): the residual stream, norms and dropouts sharded over
    /// the sequence between the tensor-parallel regions.
    #[serde(default)]
    pub sequence_parallel: bool,
    /// The embedding and output head under `tp`.
    #[serde(default)]
    pub tp_head: TpHead,
    /// Pipeline stages: each rank holds `layers / pp` layers.
    #[serde(default = "one")]
    pub pp: u64,
    /// Micro-batches per step through the pipeline (0: as many as stages).
    #[serde(default)]
    pub microbatches: u64,
    #[serde(default)]
    pub schedule: Schedule,
    /// Virtual stages per rank under the interleaved schedule.
    #[serde(default = "one")]
    pub chunks: u64,
    /// Context-parallel degree: the sequence split over `cp` ranks, keys and values passed
    /// round a ring.
    #[serde(default = "one")]
    pub cp: u64,
    /// FSDP sharding (None: states replicated, or ZeRO's flat buffers with `zero`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fsdp: Option<Fsdp>,
    /// FSDP2's `reshard_after_forward` (the root module keeps its parameters either way).
    #[serde(default = "yes")]
    pub reshard_after_forward: bool,
    /// FSDP1 (`FullyShardedDataParallel`, flat parameters per wrapped unit) rather than FSDP2
    /// (`fully_shard`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub fsdp1: bool,
    /// FSDP1's `backward_prefetch` other than torch's BACKWARD_PRE (`--backward-prefetch post`
    /// or `none`): the unit before is gathered only after this one's post-backward has
    /// resharded it, so one unit is gathered at a time in the backward.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub no_pre_prefetch: bool,
    /// FSDP's CPU offload: the sharded parameters, gradients and optimizer state live in host
    /// memory; the GPU holds what is gathered and computed.
    #[serde(default)]
    pub offload: bool,
    /// DDP with buckets of this many MiB (`bucket_cap_mb`; PyTorch's default 25).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ddp_bucket_mb: Option<u64>,
    /// DDP's `gradient_as_bucket_view`: gradients are views into the buckets.
    #[serde(default)]
    pub bucket_view: bool,
    /// The rank whose plan is built (None: the worst one).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rank: Option<u64>,
}

impl Default for Parallel {
    fn default() -> Self {
        Parallel {
            tp: 1,
            sequence_parallel: false,
            tp_head: TpHead::Sharded,
            pp: 1,
            microbatches: 0,
            schedule: Schedule::OneFOneB,
            chunks: 1,
            cp: 1,
            fsdp: None,
            reshard_after_forward: true,
            fsdp1: false,
            no_pre_prefetch: false,
            offload: false,
            ddp_bucket_mb: None,
            bucket_view: false,
            rank: None,
        }
    }
}

impl Parallel {
    /// One GPU, nothing split (what a workload without layout flags is).
    pub fn is_single(&self) -> bool {
        *self == Parallel::default()
    }
    /// GPUs one model replica spans (tp · pp · cp).
    pub fn model_parallel(&self) -> u64 {
        self.tp.saturating_mul(self.pp).saturating_mul(self.cp)
    }
    /// Micro-batches per step in effect.
    pub fn microbatches(&self) -> u64 {
        if self.microbatches == 0 {
            self.pp
        } else {
            self.microbatches
        }
    }
    /// Whether the parameters stay unsharded from forward to backward.
    pub fn keeps_unsharded(&self) -> bool {
        self.fsdp == Some(Fsdp::ShardGradOp) || !self.reshard_after_forward
    }
}

/// One rank's coordinates in the mesh.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Coords {
    pub rank: u64,
    pub dp: u64,
    pub pp: u64,
    pub cp: u64,
    pub tp: u64,
}

/// The most micro-batch passes of a layer a pipeline's plans may hold (micro-batches × layers):
/// each stage's plan copies its layers' tensors per micro-batch, ~8 KB of plan per layer pass
/// (131,072 passes: ~1 GB and ~3 s; llama3-8b's 32 layers take 4,096 micro-batches).
pub const MAX_PIPELINE_LAYER_PASSES: u64 = 1 << 17;

/// Why a layout does not fit: the dimension it names and what is wrong.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("--{flag}: {msg}")]
pub struct LayoutError {
    pub flag: &'static str,
    pub msg: String,
}

fn err(flag: &'static str, msg: impl Into<String>) -> LayoutError {
    LayoutError {
        flag,
        msg: msg.into(),
    }
}

impl Workload {
    /// The data-parallel degree: the GPUs over the model-parallel ones.
    pub fn dp(&self) -> u64 {
        (self.gpus / self.parallel.model_parallel().max(1)).max(1)
    }
    /// The degree model states are sharded over, 1 when they are replicated: FSDP's shard
    /// group, the data-parallel ranks times the context-parallel ones (torchtitan's
    /// `dp_shard_cp` mesh: context-parallel ranks hold the same parameters), within one node
    /// for hybrid sharding.
    pub fn shard_degree(&self) -> u64 {
        let group = self.dp().saturating_mul(self.parallel.cp.max(1));
        match self.parallel.fsdp {
            None => 1,
            Some(Fsdp::Hybrid) => group.min(HYBRID_GROUP),
            Some(_) => group,
        }
    }
    /// The process groups (NCCL communicators) one rank is in: one per degree above 1, one
    /// where more than one GPU runs without a layout.
    pub fn communicators(&self) -> u64 {
        let p = &self.parallel;
        let n = [self.dp(), p.tp, p.pp, p.cp]
            .iter()
            .filter(|&&d| d > 1)
            .count() as u64;
        if self.gpus > 1 {
            n.max(1)
        } else {
            0
        }
    }
    /// The coordinates of `rank`.
    pub fn coords(&self, rank: u64) -> Coords {
        let p = &self.parallel;
        let (tp, cp, dp) = (p.tp.max(1), p.cp.max(1), self.dp());
        Coords {
            rank,
            tp: rank % tp,
            cp: (rank / tp) % cp,
            dp: (rank / (tp * cp)) % dp,
            pp: rank / (tp * cp * dp),
        }
    }
    /// One rank of each pipeline stage (ranks of one stage hold the same).
    pub fn stage_ranks(&self) -> Vec<u64> {
        let per_stage = self.gpus / self.parallel.pp.max(1);
        (0..self.parallel.pp.max(1))
            .map(|i| i * per_stage)
            .collect()
    }
}

/// Check a layout against the model: each degree divides what it splits and the degrees
/// multiply to the GPUs.
pub fn check(w: &Workload) -> Result<(), LayoutError> {
    let p = &w.parallel;
    let mp = p.model_parallel();
    if mp == 0 {
        return Err(err("tp", "degrees must be at least 1"));
    }
    if !w.gpus.is_multiple_of(mp) {
        return Err(err(
            "gpus",
            format!(
                "{} GPUs do not divide into tp {} × pp {} × cp {} = {mp}",
                w.gpus, p.tp, p.pp, p.cp
            ),
        ));
    }
    if p.is_single() && w.zero == 0 {
        return Ok(());
    }
    check_sharding(w)?;
    check_tp(w)?;
    check_pp(w)?;
    check_cp(w)?;
    if w.inference() && !p.is_single() && (p.fsdp.is_some() || p.ddp_bucket_mb.is_some()) {
        return Err(err("fsdp", "FSDP and DDP are training layouts"));
    }
    Ok(())
}

/// The sharding flags against each other, `--rank` against the GPUs, and the modelled families.
fn check_sharding(w: &Workload) -> Result<(), LayoutError> {
    let p = &w.parallel;
    if p.offload {
        return Err(err(
            "offload",
            "FSDP's CPU offload is not modelled yet (the sharded states and the optimizer step move to the host)",
        ));
    }
    if p.fsdp.is_some() && w.zero > 0 {
        return Err(err(
            "fsdp",
            "FSDP and ZeRO are two names for one sharding: give one",
        ));
    }
    if p.fsdp.is_some() && p.ddp_bucket_mb.is_some() {
        return Err(err("ddp", "DDP replicates what FSDP shards: give one"));
    }
    if w.zero > 0 && (p.tp > 1 || p.pp > 1 || p.cp > 1) {
        return Err(err(
            "zero",
            "ZeRO's flat buffers are modelled over data parallelism only: use --fsdp with --tp, --pp or --cp",
        ));
    }
    if let Some(r) = p.rank {
        if r >= w.gpus {
            return Err(err(
                "rank",
                format!(
                    "rank {r} is not among the {} GPUs (0..{})",
                    w.gpus,
                    w.gpus - 1
                ),
            ));
        }
    }
    if (p.tp > 1 || p.pp > 1 || p.cp > 1) && !w.is_decoder_llm() && w.arch != super::Arch::Gpt2 {
        return Err(err(
            if p.tp > 1 {
                "tp"
            } else if p.pp > 1 {
                "pp"
            } else {
                "cp"
            },
            format!(
                "tensor, pipeline and context parallelism are modelled for GPT-2 and the LLaMA-style decoders, not {}",
                w.name
            ),
        ));
    }
    Ok(())
}

/// Tensor parallelism: `--tp` divides heads and widths; `--sequence-parallel`/`--tp-head` need it.
fn check_tp(w: &Workload) -> Result<(), LayoutError> {
    let p = &w.parallel;
    if p.tp > 1 {
        let kv = w.kv_heads();
        if !w.heads.is_multiple_of(p.tp) {
            return Err(err(
                "tp",
                format!(
                    "tp {} does not divide the {} attention heads",
                    p.tp, w.heads
                ),
            ));
        }
        if !kv.is_multiple_of(p.tp) {
            return Err(err(
                "tp",
                format!(
                    "tp {} does not divide the {kv} key/value heads (each rank needs whole ones)",
                    p.tp
                ),
            ));
        }
        if !w.ffn.is_multiple_of(p.tp) {
            return Err(err(
                "tp",
                format!("tp {} does not divide the MLP's width {}", p.tp, w.ffn),
            ));
        }
        if let Some(m) = w.moe {
            if !m.expert_ffn.is_multiple_of(p.tp) || !m.shared_ffn.is_multiple_of(p.tp) {
                return Err(err(
                    "tp",
                    format!("tp {} does not divide the experts' width", p.tp),
                ));
            }
        }
        if p.sequence_parallel
            && (!w.is_decoder_llm()
                || matches!(w.arch, super::Arch::Gemma2 | super::Arch::Gemma3)
                || w.lora.is_some())
        {
            return Err(err(
                "sequence-parallel",
                format!(
                    "modelled for the LLaMA-style decoders without sandwich norms or adapters, not {}",
                    w.name
                ),
            ));
        }
        if p.sequence_parallel && !w.seq.is_multiple_of(p.tp) {
            return Err(err(
                "sequence-parallel",
                format!("tp {} does not divide seq {}", p.tp, w.seq),
            ));
        }
    } else if p.sequence_parallel {
        return Err(err("sequence-parallel", "needs --tp 2 or more"));
    } else if p.tp_head != TpHead::Sharded {
        return Err(err("tp-head", "needs --tp 2 or more"));
    }
    Ok(())
}

/// Pipeline parallelism: the (virtual) stages divide the layers; micro-batches need a pipeline.
fn check_pp(w: &Workload) -> Result<(), LayoutError> {
    let p = &w.parallel;
    if p.pp > 1 {
        if p.pp > w.layers {
            return Err(err(
                "pp",
                format!(
                    "{} stages for {} layers: at most one stage per layer",
                    p.pp, w.layers
                ),
            ));
        }
        let per = p.pp.saturating_mul(p.chunks.max(1));
        if !w.layers.is_multiple_of(per) {
            return Err(err(
                "pp",
                format!(
                    "{} {} do not divide the {} layers",
                    per,
                    if p.chunks > 1 {
                        "virtual stages"
                    } else {
                        "stages"
                    },
                    w.layers
                ),
            ));
        }
        if p.schedule == Schedule::Interleaved && p.chunks < 2 {
            return Err(err("schedule", "interleaved needs --chunks 2 or more"));
        }
    }
    if p.pp > 1 && p.microbatches().saturating_mul(w.layers) > MAX_PIPELINE_LAYER_PASSES {
        return Err(err(
            "microbatches",
            format!(
                "{} micro-batches through {} layers is past what a plan holds (micro-batches × layers at most {MAX_PIPELINE_LAYER_PASSES}: at most {} micro-batches here)",
                p.microbatches(),
                w.layers,
                MAX_PIPELINE_LAYER_PASSES / w.layers.max(1)
            ),
        ));
    }
    if p.microbatches > 0 && p.pp == 1 {
        return Err(err(
            "microbatches",
            "micro-batches are a pipeline's: add --pp",
        ));
    }
    Ok(())
}

/// Context parallelism: seq divides into 2·cp chunks and the attention is a kernel it runs on.
fn check_cp(w: &Workload) -> Result<(), LayoutError> {
    let p = &w.parallel;
    if p.cp > 1 {
        if !w.seq.is_multiple_of(2 * p.cp) {
            return Err(err(
                "cp",
                format!(
                    "cp {} needs seq divisible by 2·cp = {} (load-balanced chunks), not {}",
                    p.cp,
                    2 * p.cp,
                    w.seq
                ),
            ));
        }
        if w.attention == Attention::Naive {
            return Err(err(
                "cp",
                "context parallelism runs on SDPA's flash or memory-efficient kernels: use --attention sdpa or flash",
            ));
        }
    }
    Ok(())
}

/// A pipeline stage's share of the model: its layers and whether it embeds or has the head.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stage {
    pub index: u64,
    pub of: u64,
    pub lo: u64,
    pub hi: u64,
}

impl Stage {
    pub fn first(&self) -> bool {
        self.index == 0
    }
    pub fn last(&self) -> bool {
        self.index + 1 == self.of
    }
    /// Micro-batches whose activations the stage holds at once under `p`'s schedule.
    pub fn in_flight(&self, p: &Parallel) -> u64 {
        let m = p.microbatches();
        match p.schedule {
            Schedule::Gpipe => m,
            Schedule::OneFOneB => (self.of - self.index).min(m),
            Schedule::Interleaved => {
                // Narayanan et al. 2021: (1 + (pp − 1)/(pp·v)) of 1F1B's, in micro-batches of
                // one chunk (a chunk holds layers / (pp·v)): per chunk pp − i, plus the warm-up's
                // extra (pp − 1) · ... over all chunks; counted here in whole-stage micro-batches.
                let v = p.chunks.max(1);
                let chunk_mbs = (self.of - self.index).saturating_mul(v) + (self.of - 1);
                chunk_mbs.div_ceil(v).min(m)
            }
        }
    }
}

/// The stage `w`'s rank `rank` runs (the whole model without a pipeline).
pub fn stage(w: &Workload, rank: u64) -> Stage {
    let pp = w.parallel.pp.max(1);
    let i = w.coords(rank).pp.min(pp - 1);
    let per = w.layers / pp;
    Stage {
        index: i,
        of: pp,
        lo: i * per,
        hi: if i + 1 == pp { w.layers } else { (i + 1) * per },
    }
}

/// The shape one tensor-parallel rank computes with: heads, key/value heads, the MLP's and
/// experts' widths and the vocabulary over `tp` (vocabulary-parallel embedding and head, as
/// Megatron and torchtitan shard them), the head width kept; the sequence over `cp`.
pub fn local_shape(w: &Workload) -> Workload {
    let p = &w.parallel;
    let mut l = w.clone();
    if p.tp > 1 {
        let t = p.tp;
        l.head_dim = Some(w.head_dim());
        l.heads = w.heads / t;
        l.kv_heads = Some(w.kv_heads() / t);
        l.ffn = w.ffn / t;
        if p.tp_head != TpHead::Replicated {
            l.vocab = w.vocab.div_ceil(t);
        }
        if let Some(m) = l.moe.as_mut() {
            m.expert_ffn /= t;
            m.shared_ffn /= t;
        }
        if let Some(m) = l.model.as_mut() {
            m.tp_local(t, p.tp_head != TpHead::Replicated);
        }
    }
    if p.cp > 1 {
        l.seq = w.seq / p.cp;
    }
    l
}

/// The layout flags (`--tp` is shared with `--mode serve`, where it splits the engine).
#[derive(Debug, clap::Args, Clone, Default, PartialEq, Eq)]
pub struct ParallelArgs {
    /// full | hybrid | shard-grad-op | none: FSDP's sharding of parameters, gradients and
    /// optimizer state over the data-parallel GPUs (FSDP2's fully_shard per layer and root).
    #[arg(long, value_name = "S", allow_hyphen_values = true)]
    pub fsdp: Option<String>,
    /// on | off: FSDP2's reshard_after_forward [on].
    #[arg(long, value_name = "on|off", allow_hyphen_values = true)]
    pub reshard_after_forward: Option<String>,
    /// 1 | 2: FSDP1's FullyShardedDataParallel (a flat parameter per wrapped unit, gathered
    /// in place; Accelerate's, Lightning's and LitGPT's FSDP) or FSDP2's fully_shard [2].
    #[arg(long, value_name = "1|2", allow_hyphen_values = true)]
    pub fsdp_version: Option<String>,
    /// pre | post | none: FSDP1's backward_prefetch [pre, torch's BACKWARD_PRE, as Lightning
    /// passes it]; post (BACKWARD_POST) and none (Accelerate's and the Trainer's default) gather
    /// the unit before only once this one has resharded.
    #[arg(long, value_name = "P", allow_hyphen_values = true)]
    pub backward_prefetch: Option<String>,
    /// on | off: FSDP's CPU offload of the sharded states (the GPU holds what is gathered).
    #[arg(long, value_name = "on|off", allow_hyphen_values = true)]
    pub offload: Option<String>,
    /// DDP with gradient buckets of MB MiB [25, PyTorch's bucket_cap_mb].
    #[arg(long, value_name = "MB", num_args = 0..=1, default_missing_value = "25")]
    pub ddp: Option<String>,
    /// on | off: DDP's gradient_as_bucket_view [off].
    #[arg(long, value_name = "on|off", allow_hyphen_values = true)]
    pub bucket_view: Option<String>,
    /// sharded | gathered | replicated: the embedding and head under --tp: split by vocabulary
    /// with a vocabulary-parallel loss [sharded], split with the logits gathered for the loss,
    /// or whole on every rank.
    #[arg(long, value_name = "H", allow_hyphen_values = true)]
    pub tp_head: Option<String>,
    /// With --tp: the residual stream, norms and dropouts sharded over the sequence.
    #[arg(long, value_name = "on|off", num_args = 0..=1, default_missing_value = "on")]
    pub sequence_parallel: Option<String>,
    /// Pipeline stages (each holds layers / N).
    #[arg(long, value_name = "N", allow_hyphen_values = true)]
    pub pp: Option<String>,
    /// Micro-batches of --batch per step through the pipeline [as many as stages].
    #[arg(long, value_name = "M", allow_hyphen_values = true)]
    pub microbatches: Option<String>,
    /// gpipe | 1f1b | interleaved: the pipeline schedule [1f1b].
    #[arg(long, value_name = "S", allow_hyphen_values = true)]
    pub schedule: Option<String>,
    /// Virtual stages per rank with --schedule interleaved.
    #[arg(long, value_name = "V", allow_hyphen_values = true)]
    pub chunks: Option<String>,
    /// Context-parallel degree: the sequence split over N GPUs (ring attention).
    #[arg(long, value_name = "N", allow_hyphen_values = true)]
    pub cp: Option<String>,
    /// Data-parallel degree (sets --gpus to dp · tp · pp · cp when --gpus is not given).
    #[arg(long, value_name = "N", allow_hyphen_values = true)]
    pub dp: Option<String>,
    /// The rank whose plan is built and probed [the worst one].
    #[arg(long, value_name = "R", allow_hyphen_values = true)]
    pub rank: Option<String>,
}

impl ParallelArgs {
    /// `over`'s flags where set, else `base`'s.
    pub fn merge(base: &ParallelArgs, over: &ParallelArgs) -> ParallelArgs {
        macro_rules! pick {
            ($($f:ident),*) => { ParallelArgs { $($f: over.$f.clone().or_else(|| base.$f.clone()),)* } };
        }
        pick!(
            fsdp,
            reshard_after_forward,
            fsdp_version,
            backward_prefetch,
            offload,
            ddp,
            bucket_view,
            tp_head,
            sequence_parallel,
            pp,
            microbatches,
            schedule,
            chunks,
            cp,
            dp,
            rank
        )
    }
    /// The slot of a case file's key (`None`: not a layout key).
    pub fn slot(&mut self, key: &str) -> Option<&mut Option<String>> {
        Some(match key {
            "fsdp" => &mut self.fsdp,
            "reshard_after_forward" => &mut self.reshard_after_forward,
            "fsdp_version" => &mut self.fsdp_version,
            "backward_prefetch" => &mut self.backward_prefetch,
            "offload" => &mut self.offload,
            "ddp" => &mut self.ddp,
            "bucket_view" => &mut self.bucket_view,
            "sequence_parallel" => &mut self.sequence_parallel,
            "tp_head" => &mut self.tp_head,
            "pp" => &mut self.pp,
            "microbatches" => &mut self.microbatches,
            "schedule" => &mut self.schedule,
            "chunks" => &mut self.chunks,
            "cp" => &mut self.cp,
            "dp" => &mut self.dp,
            "rank" => &mut self.rank,
            _ => return None,
        })
    }
}

fn usage(flag: &str, msg: impl std::fmt::Display) -> crate::error::CliError {
    crate::error::CliError::usage(format!("--{flag}: {msg}"))
}

/// Apply the layout flags (and a training `--tp`) to `w`; `gpus_given`: `--gpus` was set.
pub fn apply(
    w: &mut Workload,
    a: &ParallelArgs,
    tp: Option<&str>,
    gpus_given: bool,
) -> Result<(), crate::error::CliError> {
    use super::flags::{choice, count, on_off};
    let p = &mut w.parallel;
    if let Some(v) = tp {
        p.tp = count("tp", v)?;
    }
    if let Some(v) = &a.fsdp {
        p.fsdp = choice(
            "fsdp",
            v,
            &[
                ("full", Some(Fsdp::Full)),
                ("hybrid", Some(Fsdp::Hybrid)),
                ("shard-grad-op", Some(Fsdp::ShardGradOp)),
                ("none", None),
                ("full-shard", Some(Fsdp::Full)),
                ("hybrid-shard", Some(Fsdp::Hybrid)),
                ("no-shard", None),
            ],
        )?;
    }
    if let Some(v) = &a.reshard_after_forward {
        p.reshard_after_forward = on_off("reshard-after-forward", v)?;
    }
    if let Some(v) = &a.fsdp_version {
        p.fsdp1 = choice("fsdp-version", v, &[("1", true), ("2", false)])?;
    }
    if let Some(v) = &a.backward_prefetch {
        p.no_pre_prefetch = choice(
            "backward-prefetch",
            v,
            &[("pre", false), ("post", true), ("none", true)],
        )?;
        if !p.fsdp1 {
            return Err(usage(
                "backward-prefetch",
                "is FSDP1's: it needs --fsdp-version 1 (FSDP2 always prefetches)",
            ));
        }
    }
    if let Some(v) = &a.offload {
        p.offload = on_off("offload", v)?;
    }
    if let Some(v) = &a.ddp {
        p.ddp_bucket_mb = Some(count("ddp", v)?);
    }
    if let Some(v) = &a.bucket_view {
        p.bucket_view = on_off("bucket-view", v)?;
    }
    if let Some(v) = &a.tp_head {
        p.tp_head = choice(
            "tp-head",
            v,
            &[
                ("sharded", TpHead::Sharded),
                ("gathered", TpHead::Gathered),
                ("replicated", TpHead::Replicated),
            ],
        )?;
    }
    if let Some(v) = &a.sequence_parallel {
        p.sequence_parallel = on_off("sequence-parallel", v)?;
    }
    if let Some(v) = &a.pp {
        p.pp = count("pp", v)?;
    }
    if let Some(v) = &a.microbatches {
        p.microbatches = count("microbatches", v)?;
    }
    if let Some(v) = &a.schedule {
        p.schedule = choice(
            "schedule",
            v,
            &[
                ("gpipe", Schedule::Gpipe),
                ("1f1b", Schedule::OneFOneB),
                ("interleaved", Schedule::Interleaved),
                ("interleaved-1f1b", Schedule::Interleaved),
            ],
        )?;
    }
    if let Some(v) = &a.chunks {
        p.chunks = count("chunks", v)?;
        if p.schedule != Schedule::Interleaved && p.chunks > 1 {
            return Err(usage(
                "chunks",
                "virtual stages go with --schedule interleaved",
            ));
        }
    }
    if let Some(v) = &a.cp {
        p.cp = count("cp", v)?;
    }
    if let Some(v) = &a.rank {
        p.rank = Some(
            v.trim()
                .parse::<u64>()
                .map_err(|_| usage("rank", format!("expected a rank 0, 1, ..., not '{v}'")))?,
        );
    }
    let mp = p.model_parallel();
    if let Some(v) = &a.dp {
        let dp = count("dp", v)?;
        let world = dp.saturating_mul(mp);
        if gpus_given && w.gpus != world {
            return Err(usage(
                "dp",
                format!(
                    "dp {dp} × tp {} × pp {} × cp {} = {world}, but --gpus is {}",
                    p.tp, p.pp, p.cp, w.gpus
                ),
            ));
        }
        w.gpus = world;
    } else if !gpus_given && mp > w.gpus {
        // A model-parallel layout alone spans its own GPUs.
        w.gpus = mp;
    }
    check(w).map_err(|e| crate::error::CliError::usage(e.to_string()))
}
