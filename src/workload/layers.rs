//! Models as layers: what each layer of a model is (its mixer, block form and MLP), read from
//! a config by `workload::families`, and what each layer weighs (parameters, active parameters,
//! and the cache or state it holds per token and per sequence when serving).
//!
//! The records follow the modeling code of Hugging Face transformers 5.24 and vLLM V1's KV-cache
//! specs (`vllm/v1/kv_cache_interface.py`: `FullAttentionSpec`, `SlidingWindowSpec`,
//! `ChunkedLocalAttentionSpec`, `MLAAttentionSpec`, `MambaSpec`). Every count here is pure
//! arithmetic over the record; `tests/fixtures/configs/param_counts*.json` hold the counts
//! transformers gives for real configs, and the tests compare them to the element.

use serde::{Deserialize, Serialize};

/// Which attention positions a layer's queries see.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind", content = "tokens")]
pub enum Window {
    /// Every earlier position (full causal attention).
    Full,
    /// The last `w` positions (`sliding_window`): a serving engine keeps only those.
    Sliding(u64),
    /// Positions in the query's own chunk of `c` (Llama 4's `attention_chunk_size`).
    Chunked(u64),
}

/// Norms over each head's q and k before attention.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum QkNorm {
    #[default]
    None,
    /// One RMSNorm of the head width shared by all heads (Qwen3, Gemma 3, GLM, gpt-oss none).
    PerHead,
    /// A norm over the whole projection (OLMo 2: q over heads·d, k over kv_heads·d).
    Full,
    /// Cohere's LayerNorm per head: weights [heads, d] and [kv_heads, d].
    PerHeadWeights,
    /// L2 normalisation without weights (Llama 4).
    L2,
}

/// Softmax attention over q, k, v projections (MHA, GQA, MQA).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Attn {
    pub heads: u64,
    pub kv_heads: u64,
    pub head_dim: u64,
    pub window: Window,
    /// Biases on q, k and v.
    pub qkv_bias: bool,
    /// A bias on the output projection.
    pub o_bias: bool,
    #[serde(default)]
    pub qk_norm: QkNorm,
    /// A learned sink logit per head (gpt-oss): `heads` parameters.
    #[serde(default)]
    pub sinks: bool,
    /// The query projection also makes a per-head output gate (Qwen3-Next's gated attention):
    /// q_proj is twice as wide.
    #[serde(default)]
    pub output_gate: bool,
    /// Share of the head width that is rotated (1 when all; GLM 0.5, Qwen3-Next 0.25; 0 for
    /// none, Llama 4's NoPE layers).
    #[serde(default = "one")]
    pub rotary_fraction: f64,
    /// tanh soft-capping of the scores.
    #[serde(default)]
    pub softcap: bool,
    /// q, k and v are slices of one projection's output (GPT-NeoX's and Falcon's
    /// `query_key_value`): the value, saved for attention's backward, keeps the whole output.
    #[serde(default)]
    pub fused_qkv: bool,
}

fn one() -> f64 {
    1.0
}

/// Multi-head latent attention (DeepSeek-V2/V3, Kimi K2): queries through a low-rank
/// bottleneck (or one projection), keys and values from one compressed latent per token.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Mla {
    pub heads: u64,
    /// None: one q projection (DeepSeek-V2-Lite).
    pub q_lora_rank: Option<u64>,
    pub kv_lora_rank: u64,
    pub qk_nope_head_dim: u64,
    pub qk_rope_head_dim: u64,
    pub v_head_dim: u64,
    /// Biases on the down projections (q_a, kv_a) and the output (`attention_bias`).
    pub bias: bool,
    /// DeepSeek sparse attention's lightning indexer (GLM-5, DeepSeek-V3.2): (heads, head
    /// width) of its queries; one key of that width per token.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub indexer: Option<(u64, u64)>,
}

/// Gated DeltaNet linear attention (Qwen3-Next, Qwen3.5): a constant recurrent state per
/// sequence, no KV cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeltaNet {
    pub k_heads: u64,
    pub v_heads: u64,
    pub head_k_dim: u64,
    pub head_v_dim: u64,
    /// The short causal convolution's kernel width.
    pub conv: u64,
}

/// A Mamba-2 mixer (Nemotron-H, Bamba, Falcon-H1, Granite 4.0-H, Mamba-2): a constant
/// convolution and SSM state per sequence.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Mamba2 {
    pub heads: u64,
    pub head_dim: u64,
    pub d_state: u64,
    pub groups: u64,
    pub conv: u64,
    /// Biases on in_proj and out_proj (`use_bias`).
    pub bias: bool,
    /// A bias on the convolution (`use_conv_bias`).
    pub conv_bias: bool,
    /// The gated RMSNorm before out_proj (Mamba-2's `rmsnorm`; all of today's hybrids).
    pub norm: bool,
}

impl Mamba2 {
    /// The inner width, heads × head_dim.
    pub fn inner(&self) -> u64 {
        self.heads * self.head_dim
    }
    /// The convolution's channels: x, B and C.
    pub fn conv_dim(&self) -> u64 {
        self.inner() + 2 * self.groups * self.d_state
    }
}

/// What mixes positions in a layer.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum Mixer {
    Attention(Attn),
    Mla(Mla),
    GatedDeltaNet(DeltaNet),
    Mamba2(Mamba2),
    /// No mixer: an MLP-only block (Nemotron-H's `-` and `E` layers).
    None,
}

impl Mixer {
    /// The name used in notes and refusals.
    pub fn name(&self) -> &'static str {
        match self {
            Mixer::Attention(a) => match a.window {
                Window::Full => "full attention",
                Window::Sliding(_) => "sliding-window attention",
                Window::Chunked(_) => "chunked attention",
            },
            Mixer::Mla(_) => "multi-head latent attention (MLA)",
            Mixer::GatedDeltaNet(_) => "Gated DeltaNet",
            Mixer::Mamba2(_) => "Mamba-2",
            Mixer::None => "no mixer",
        }
    }

    /// The kernels the plan follows for a recurrent mixer (None for the others).
    pub fn kernels(&self) -> Option<&'static str> {
        match self {
            Mixer::GatedDeltaNet(_) => Some(
                "flash-linear-attention's chunk_gated_delta_rule, causal-conv1d and FusedRMSNormGated",
            ),
            Mixer::Mamba2(_) => Some("mamba_ssm's mamba_split_conv1d_scan_combined"),
            _ => None,
        }
    }
}

/// Where a layer's norms sit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BlockForm {
    /// A norm before the mixer and one before the MLP (LLaMA).
    PreNorm,
    /// Norms after the mixer and after the MLP, on the residual branch (OLMo 2).
    PostNorm,
    /// Norms before and after each (Gemma 2/3/4): four.
    Sandwich,
    /// One norm; mixer and MLP read it side by side and both add to the residual (Cohere,
    /// Phi, Falcon-7B).
    Parallel,
    /// A norm each for the mixer and the MLP, both over the layer's input, both added to the
    /// residual (GPT-NeoX's `use_parallel_residual`, Falcon's new decoder architecture).
    ParallelNorms,
}

/// How a router turns its logits into weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Gating {
    Softmax,
    Sigmoid,
}

/// A mixture of experts.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct MoeSpec {
    pub experts: u64,
    pub top_k: u64,
    pub expert_ffn: u64,
    /// The shared experts' total width (n_shared × their width), 0 for none.
    pub shared_ffn: u64,
    /// A sigmoid gate (h → 1) over the shared expert's output (Qwen2-MoE, Qwen3-Next).
    pub shared_gate: bool,
    /// A bias on the router's linear (gpt-oss).
    pub router_bias: bool,
    /// Biases on the experts' projections (gpt-oss).
    pub expert_bias: bool,
    pub gating: Gating,
    /// The experts are gated (SwiGLU); false: up, activation, down (Nemotron's relu²).
    pub gated: bool,
    /// gpt-oss's clamped SwiGLU, `(clamp(up) + 1) · g · σ(α·g)` with `g = clamp(gate)`: its
    /// backward saves the clamped gate, the sigmoid, `up + 1` and the GLU besides the product.
    #[serde(default)]
    pub clamped: bool,
    /// Every token goes through every expert, weighted by a score that is zero outside its top
    /// k (Llama 4's `Llama4TextMoe` in transformers).
    #[serde(default)]
    pub all_tokens: bool,
}

/// The feed-forward part of a layer.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum MlpSpec {
    Dense {
        ffn: u64,
        gated: bool,
        bias: bool,
    },
    Moe(MoeSpec),
    /// No MLP (a mixer-only block).
    None,
}

/// The normalisation a family uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum NormKind {
    /// RMSNorm: a gain.
    Rms,
    /// LayerNorm with gain and bias.
    Layer,
    /// LayerNorm with a gain only (Cohere, OLMo's non-parametric ones are not modelled).
    LayerNoBias,
}

impl NormKind {
    pub fn params(self, width: u64) -> u64 {
        match self {
            NormKind::Layer => 2 * width,
            NormKind::Rms | NormKind::LayerNoBias => width,
        }
    }
}

/// One layer. The mixer and the MLP are objects of their own (`{"kind": "mla", ...}`): flattened,
/// their fields collide (MLA's `bias` beside a dense MLP's).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LayerSpec {
    pub mixer: Mixer,
    pub block: BlockForm,
    pub mlp: MlpSpec,
}

/// Weights outside the text model: a vision tower and its projector (multimodal wrappers).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Tower {
    /// The tower's `model_type` (siglip_vision_model, pixtral, llama4_vision_model, ...).
    pub kind: String,
    /// Its parameters and the projector's into the text model.
    pub params: u64,
}

/// A model as its config describes it, layer by layer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelSpec {
    /// The config's `model_type` (of the text model inside a wrapper).
    pub family: String,
    pub hidden: u64,
    pub vocab: u64,
    pub norm: NormKind,
    pub tied: bool,
    /// Extra parameters of the embedding and head (Gemma 3n's per-layer embeddings, ...).
    #[serde(default)]
    pub extra_params: u64,
    /// The head scales its logits (Cohere's `logit_scale`, Granite's `logits_scaling`): a
    /// second [b, s, V] tensor while the first lives.
    #[serde(default)]
    pub logit_scale: bool,
    pub layers: Vec<LayerSpec>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vision: Option<Tower>,
}

/// Parameter elements of one layer's parts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct LayerParams {
    /// The mixer with its norms.
    pub mixer: u64,
    /// The MLP (router, experts, shared experts) with its norms.
    pub mlp: u64,
    /// Of `mlp`: the routed experts' weights that a token does not use (experts − top_k).
    pub inactive: u64,
    /// The largest single parameter tensor of the mixer and of the MLP.
    pub mixer_largest: u64,
    pub mlp_largest: u64,
}

fn attn_params(a: &Attn, h: u64) -> (u64, u64) {
    let q = a.heads * a.head_dim;
    let kv = a.kv_heads * a.head_dim;
    let qp = if a.output_gate { 2 * q } else { q };
    let mut n = h * (qp + 2 * kv) + q * h;
    if a.qkv_bias {
        n += qp + 2 * kv;
    }
    if a.o_bias {
        n += h;
    }
    n += match a.qk_norm {
        QkNorm::None | QkNorm::L2 => 0,
        QkNorm::PerHead => 2 * a.head_dim,
        QkNorm::Full | QkNorm::PerHeadWeights => q + kv,
    };
    if a.sinks {
        n += a.heads;
    }
    (n, h * qp.max(q))
}

fn mla_params(m: &Mla, h: u64) -> (u64, u64) {
    let qk = m.qk_nope_head_dim + m.qk_rope_head_dim;
    let bias = u64::from(m.bias);
    let q = match m.q_lora_rank {
        Some(r) => h * r + bias * r + r + r * m.heads * qk,
        None => h * m.heads * qk,
    };
    let kv_a = m.kv_lora_rank + m.qk_rope_head_dim;
    let kv = h * kv_a
        + bias * kv_a
        + m.kv_lora_rank
        + m.kv_lora_rank * m.heads * (m.qk_nope_head_dim + m.v_head_dim);
    let o = m.heads * m.v_head_dim * h + bias * h;
    // The indexer: wq_b (from the q latent, or the hidden state), wk, its key LayerNorm and
    // the per-head weights.
    let indexer = m.indexer.map_or(0, |(ih, id)| {
        ih * id * m.q_lora_rank.unwrap_or(h) + id * h + 2 * id + ih * h
    });
    let largest = [
        m.q_lora_rank
            .map_or(h * m.heads * qk, |r| (h * r).max(r * m.heads * qk)),
        h * kv_a,
        m.kv_lora_rank * m.heads * (m.qk_nope_head_dim + m.v_head_dim),
        m.heads * m.v_head_dim * h,
    ]
    .into_iter()
    .max()
    .unwrap_or(0);
    (q + kv + o + indexer, largest)
}

fn deltanet_params(d: &DeltaNet, h: u64) -> (u64, u64) {
    let key = d.k_heads * d.head_k_dim;
    let value = d.v_heads * d.head_v_dim;
    let qkvz = h * (2 * key + 2 * value);
    let ba = h * 2 * d.v_heads;
    let conv = (2 * key + value) * d.conv;
    // dt_bias and A_log per value head, the gated norm's gain over a head, out_proj.
    let n = qkvz + ba + conv + 2 * d.v_heads + d.head_v_dim + value * h;
    (n, qkvz)
}

fn mamba2_params(m: &Mamba2, h: u64) -> (u64, u64) {
    let inner = m.inner();
    let proj = 2 * inner + 2 * m.groups * m.d_state + m.heads;
    let mut n = h * proj + m.conv_dim() * m.conv + 3 * m.heads + inner * h;
    if m.bias {
        n += proj + h;
    }
    if m.conv_bias {
        n += m.conv_dim();
    }
    if m.norm {
        n += inner;
    }
    (n, h * proj)
}

fn mlp_params(m: &MlpSpec, h: u64) -> (u64, u64, u64) {
    match *m {
        MlpSpec::None => (0, 0, 0),
        MlpSpec::Dense { ffn, gated, bias } => {
            let mats = if gated { 3 } else { 2 };
            let b = if bias { (mats - 1) * ffn + h } else { 0 };
            (mats * h * ffn + b, 0, h * ffn)
        }
        MlpSpec::Moe(e) => {
            let mats = if e.gated { 3 } else { 2 };
            let per_expert = mats * h * e.expert_ffn
                + if e.expert_bias {
                    (mats - 1) * e.expert_ffn + h
                } else {
                    0
                };
            let router = e.experts * h + if e.router_bias { e.experts } else { 0 };
            let shared = if e.shared_ffn > 0 {
                mats * h * e.shared_ffn + if e.shared_gate { h } else { 0 }
            } else {
                0
            };
            let total = router + e.experts * per_expert + shared;
            let inactive = e.experts.saturating_sub(e.top_k) * per_expert;
            let largest = e.experts * (mats - 1) * h * e.expert_ffn;
            (total, inactive, largest)
        }
    }
}

impl LayerSpec {
    /// The norms the block form puts around a present mixer and MLP.
    fn norms(&self) -> u64 {
        let parts =
            u64::from(self.mixer != Mixer::None) + u64::from(!matches!(self.mlp, MlpSpec::None));
        match self.block {
            BlockForm::PreNorm | BlockForm::PostNorm => parts,
            BlockForm::Sandwich => 2 * parts,
            BlockForm::Parallel => 1,
            BlockForm::ParallelNorms => 2,
        }
    }

    /// The width of the scores' contraction of an attention mixer (heads × query head width):
    /// what the s² FLOPs scale with; None for recurrent mixers and none.
    pub fn query_width(&self) -> Option<u64> {
        match &self.mixer {
            Mixer::Attention(a) => Some(a.heads * a.head_dim),
            Mixer::Mla(m) => Some(m.heads * (m.qk_nope_head_dim + m.qk_rope_head_dim)),
            _ => None,
        }
    }

    /// This layer's parameters in a model of width `h` with norms `norm`.
    pub fn params(&self, h: u64, norm: NormKind) -> LayerParams {
        let (mixer, mixer_largest) = match &self.mixer {
            Mixer::Attention(a) => attn_params(a, h),
            Mixer::Mla(m) => mla_params(m, h),
            Mixer::GatedDeltaNet(d) => deltanet_params(d, h),
            Mixer::Mamba2(m) => mamba2_params(m, h),
            Mixer::None => (0, 0),
        };
        let (mlp, inactive, mlp_largest) = mlp_params(&self.mlp, h);
        let norms = self.norms() * norm.params(h);
        // The mixer takes the first norm (the parallel block's one), the MLP the rest.
        let mixer_norms = if self.mixer == Mixer::None {
            0
        } else {
            norm.params(h)
                * if self.block == BlockForm::Sandwich {
                    2
                } else {
                    1
                }
        };
        LayerParams {
            mixer: mixer + mixer_norms,
            mlp: mlp + norms - mixer_norms,
            inactive,
            mixer_largest,
            mlp_largest,
        }
    }

    /// Cache bytes one sequence of `len` tokens holds in this layer when serving, per element
    /// byte `dtype` (KV, latent, or recurrent state), before the engine's block rounding; the
    /// state of a recurrent mixer does not grow with `len`. `state_dtype`: the SSM / recurrent
    /// state's bytes (vLLM's `mamba_ssm_cache_dtype`, the model's type by default).
    pub fn cache_bytes(&self, len: u64, dtype: u64, state_dtype: u64) -> u64 {
        match &self.mixer {
            Mixer::Attention(a) => {
                let tokens = match a.window {
                    Window::Full => len,
                    Window::Sliding(w) | Window::Chunked(w) => len.min(w),
                };
                2 * a.kv_heads * a.head_dim * dtype * tokens
            }
            Mixer::Mla(m) => {
                let index = m.indexer.map_or(0, |(_, id)| id);
                (m.kv_lora_rank + m.qk_rope_head_dim + index) * dtype * len
            }
            Mixer::Mamba2(m) => {
                (m.conv - 1) * m.conv_dim() * dtype + m.heads * m.head_dim * m.d_state * state_dtype
            }
            Mixer::GatedDeltaNet(d) => {
                let conv_dim = 2 * d.k_heads * d.head_k_dim + d.v_heads * d.head_v_dim;
                (d.conv - 1) * conv_dim * dtype
                    + d.v_heads * d.head_k_dim * d.head_v_dim * state_dtype
            }
            Mixer::None => 0,
        }
    }
}

/// A model's parameters: total and what one token uses.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Counts {
    pub total: u64,
    /// Total less the routed experts a token does not reach (equal to total without experts).
    pub active: u64,
    /// The vision tower's and projector's share of `total`.
    pub vision: u64,
}

impl ModelSpec {
    /// Embedding (and an untied head), every layer, the final norm and any vision tower.
    pub fn counts(&self) -> Counts {
        let h = self.hidden;
        let emb = self.vocab * h;
        let head = if self.tied { 0 } else { emb };
        let mut total = emb + head + self.norm.params(h) + self.extra_params;
        let mut inactive: u64 = 0;
        for l in &self.layers {
            let p = l.params(h, self.norm);
            total = total.saturating_add(p.mixer).saturating_add(p.mlp);
            inactive = inactive.saturating_add(p.inactive);
        }
        let vision = self.vision.as_ref().map_or(0, |v| v.params);
        total += vision;
        Counts {
            total,
            active: total - inactive,
            vision,
        }
    }

    /// One tensor-parallel rank's share (Megatron's split, as `parallel::local_shape` does for
    /// the uniform shape): heads, key/value heads (at least one), MLP, expert and shared widths,
    /// the recurrent mixers' heads and, when `vocab`, the vocabulary over `t`; norms replicated.
    pub fn tp_local(&mut self, t: u64, vocab: bool) {
        if t <= 1 {
            return;
        }
        if vocab {
            self.vocab = self.vocab.div_ceil(t);
        }
        for l in &mut self.layers {
            match &mut l.mixer {
                Mixer::Attention(a) => {
                    a.heads /= t;
                    a.kv_heads = (a.kv_heads / t).max(1);
                }
                Mixer::Mla(m) => m.heads /= t,
                Mixer::GatedDeltaNet(d) => {
                    d.k_heads = (d.k_heads / t).max(1);
                    d.v_heads /= t;
                }
                Mixer::Mamba2(m) => {
                    m.heads /= t;
                    m.groups = (m.groups / t).max(1);
                }
                Mixer::None => {}
            }
            match &mut l.mlp {
                MlpSpec::Dense { ffn, .. } => *ffn /= t,
                MlpSpec::Moe(e) => {
                    e.expert_ffn /= t;
                    e.shared_ffn /= t;
                }
                MlpSpec::None => {}
            }
        }
        if let Some(v) = &mut self.vision {
            v.params /= t;
        }
    }

    /// The mixers a plan of this model meets, each once, in layer order.
    pub fn mixer_kinds(&self) -> Vec<&'static str> {
        let mut v: Vec<&'static str> = Vec::new();
        for l in &self.layers {
            let n = l.mixer.name();
            if l.mixer != Mixer::None && !v.contains(&n) {
                v.push(n);
            }
        }
        v
    }

    /// The first recurrent mixer (Gated DeltaNet, Mamba-2), if any: the plan follows its CUDA
    /// kernels, which the CPU harness cannot measure.
    pub fn recurrent_mixer(&self) -> Option<Mixer> {
        self.layers
            .iter()
            .map(|l| l.mixer)
            .find(|m| matches!(m, Mixer::GatedDeltaNet(_) | Mixer::Mamba2(_)))
    }

    /// The first multi-head latent attention layer, if any.
    pub fn first_mla(&self) -> Option<&Mla> {
        self.layers.iter().find_map(|l| match &l.mixer {
            Mixer::Mla(m) => Some(m),
            _ => None,
        })
    }

    /// Layer runs: (first index, count, the layer) for each stretch of identical layers.
    pub fn runs(&self) -> Vec<(usize, usize, &LayerSpec)> {
        let mut out: Vec<(usize, usize, &LayerSpec)> = Vec::new();
        for (i, l) in self.layers.iter().enumerate() {
            match out.last_mut() {
                Some((_, n, last)) if *last == l => *n += 1,
                _ => out.push((i, 1, l)),
            }
        }
        out
    }
}

/// The uniform shape flags a command line may change over a config's layers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shape {
    layers: u64,
    hidden: u64,
    heads: u64,
    kv_heads: u64,
    ffn: u64,
    vocab: u64,
    experts: Option<(u64, u64, u64)>,
}

impl Shape {
    pub fn of(w: &super::Workload) -> Shape {
        Shape {
            layers: w.layers,
            hidden: w.hidden,
            heads: w.heads,
            kv_heads: w.kv_heads(),
            ffn: w.ffn,
            vocab: w.vocab,
            experts: w.moe.map(|m| (m.experts, m.top_k, m.expert_ffn)),
        }
    }
}

/// Bring a workload's layers in line with shape flags given over a config (`--layers`,
/// `--hidden`, `--heads`, `--kv-heads`, `--ffn`, `--vocab`, `--experts`,
/// `--experts-per-token`): `--layers` keeps the config's pattern (cut, or repeated from the
/// start); a width flag sets that width in every layer that has it. Returns a note when it did
/// anything.
pub fn resync(w: &mut super::Workload, before: Shape) -> Option<String> {
    let now = Shape::of(w);
    if now == before {
        return None;
    }
    let m = w.model.as_mut()?;
    let pattern = m.layers.clone();
    m.layers = (0..now.layers as usize)
        .map(|i| pattern[i % pattern.len()])
        .collect();
    m.hidden = now.hidden;
    m.vocab = now.vocab;
    for l in &mut m.layers {
        match &mut l.mixer {
            Mixer::Attention(a) => {
                if now.heads != before.heads {
                    a.heads = now.heads;
                    if now.kv_heads == before.kv_heads {
                        a.kv_heads = a.kv_heads.min(now.heads);
                    }
                    a.head_dim = w.head_dim.unwrap_or(now.hidden / now.heads.max(1));
                } else if now.hidden != before.hidden && w.head_dim.is_none() {
                    a.head_dim = now.hidden / now.heads.max(1);
                }
                if now.kv_heads != before.kv_heads {
                    a.kv_heads = now.kv_heads;
                }
            }
            Mixer::Mla(a) if now.heads != before.heads => a.heads = now.heads,
            _ => {}
        }
        match &mut l.mlp {
            MlpSpec::Dense { ffn, .. } if now.ffn != before.ffn => *ffn = now.ffn,
            MlpSpec::Moe(e) => {
                if let (Some((x, k, f)), Some(b)) = (now.experts, before.experts) {
                    if x != b.0 {
                        e.experts = x;
                    }
                    if k != b.1 {
                        e.top_k = k;
                    }
                    e.top_k = e.top_k.min(e.experts);
                    if f != b.2 {
                        e.expert_ffn = f;
                    }
                }
            }
            _ => {}
        }
    }
    if m.runs().len() < 2 {
        return None;
    }
    Some(format!(
        "the shape flags are applied to every layer of {}'s config ({}): its per-layer pattern is kept",
        w.name,
        m.mixer_kinds().join(", ")
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn llama_layer(h: u64, heads: u64, kv: u64, ffn: u64) -> LayerSpec {
        LayerSpec {
            mixer: Mixer::Attention(Attn {
                heads,
                kv_heads: kv,
                head_dim: h / heads,
                window: Window::Full,
                qkv_bias: false,
                o_bias: false,
                qk_norm: QkNorm::None,
                sinks: false,
                output_gate: false,
                rotary_fraction: 1.0,
                softcap: false,
                fused_qkv: false,
            }),
            block: BlockForm::PreNorm,
            mlp: MlpSpec::Dense {
                ffn,
                gated: true,
                bias: false,
            },
        }
    }

    #[test]
    fn llama3_8b_from_layers() {
        // Llama-3.1-8B: 8,030,261,248 parameters (tests/fixtures/configs/param_counts.json).
        let m = ModelSpec {
            logit_scale: false,
            family: "llama".into(),
            hidden: 4096,
            vocab: 128256,
            norm: NormKind::Rms,
            tied: false,
            extra_params: 0,
            layers: vec![llama_layer(4096, 32, 8, 14336); 32],
            vision: None,
        };
        let c = m.counts();
        assert_eq!(c.total, 8_030_261_248);
        assert_eq!(c.active, c.total);
        assert_eq!(m.runs().len(), 1);
    }

    #[test]
    fn window_caps_the_cache_and_state_is_constant() {
        let mut l = llama_layer(4096, 32, 8, 14336);
        let full = l.cache_bytes(32768, 2, 2);
        assert_eq!(full, 2 * 8 * 128 * 2 * 32768);
        if let Mixer::Attention(a) = &mut l.mixer {
            a.window = Window::Sliding(1024);
        }
        assert_eq!(l.cache_bytes(32768, 2, 2) * 32, full);
        assert_eq!(l.cache_bytes(512, 2, 2), 2 * 8 * 128 * 2 * 512);
        let m = LayerSpec {
            mixer: Mixer::Mamba2(Mamba2 {
                heads: 128,
                head_dim: 64,
                d_state: 128,
                groups: 8,
                conv: 4,
                bias: false,
                conv_bias: true,
                norm: true,
            }),
            block: BlockForm::PreNorm,
            mlp: MlpSpec::None,
        };
        assert_eq!(m.cache_bytes(10, 2, 2), m.cache_bytes(100_000, 2, 2));
    }
}
