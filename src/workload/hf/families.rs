//! Families as data: one row per `model_type`, naming the config fields transformers reads, the
//! defaults of its config class, and the rules that turn them into layers
//! (`workload::layers::LayerSpec`). A family that brings no new mixer is a new row here, not
//! new plan code.
//!
//! Sources: the config classes and modeling files of transformers 5.24.0
//! (`src/transformers/models/<family>/configuration_<family>.py` and `modeling_<family>.py`),
//! named per row in `class`; the per-layer patterns are the ones those files compute
//! (`layer_types`, `sliding_window_pattern`, `first_k_dense_replace`, `mlp_only_layers`,
//! `decoder_sparse_step`, `interleave_moe_layer_step`, `full_attention_interval`,
//! `hybrid_override_pattern`, `attn_layer_indices`).

use serde_json::{Map, Value as Json};

use super::super::layers::{
    Attn, BlockForm, DeltaNet, Gating, LayerSpec, Mamba2, Mixer, Mla, MlpSpec, ModelSpec, MoeSpec,
    NormKind, QkNorm, Window,
};
use super::super::Arch;
use crate::workload::config::{field_err, ConfigError};

/// A default of a config class.
#[derive(Debug, Clone, Copy)]
pub enum Def {
    U(u64),
    B(bool),
    /// A share (a rotated fraction of a head).
    F(f64),
    /// The field defaults to None.
    Null,
}

/// Where a bias flag comes from.
#[derive(Debug, Clone, Copy)]
pub enum Bias {
    /// A config field (its default in the row's defaults, else false).
    Field(&'static str),
    /// Hard-coded in the modeling code.
    Fixed(bool),
}

/// The attention layers' mixer.
#[derive(Debug, Clone, Copy)]
pub enum AttnKind {
    /// q, k, v, o projections.
    Softmax,
    /// Multi-head latent attention (`q_lora_rank`, `kv_lora_rank`, `qk_nope_head_dim`,
    /// `qk_rope_head_dim`, `v_head_dim`).
    Mla,
}

/// How the attention layers are built.
#[derive(Debug, Clone, Copy)]
pub struct AttnRule {
    pub kind: AttnKind,
    pub qkv_bias: Bias,
    pub o_bias: Bias,
    /// The q/k norm, and the field that switches it on (None: always as given).
    pub qk_norm: QkNorm,
    pub qk_norm_flag: Option<&'static str>,
    pub sinks: bool,
    pub output_gate: bool,
    /// The field giving the rotated share of a head (`partial_rotary_factor`).
    pub rotary: Option<&'static str>,
    /// q, k and v come from one projection (`query_key_value`), split as views.
    pub fused_qkv: bool,
}

/// A row's attention rule with nothing special: softmax attention, biases from
/// `attention_bias`, no q/k norm.
pub(super) const ATTN: AttnRule = AttnRule {
    kind: AttnKind::Softmax,
    qkv_bias: Bias::Field("attention_bias"),
    o_bias: Bias::Field("attention_bias"),
    qk_norm: QkNorm::None,
    qk_norm_flag: None,
    sinks: false,
    output_gate: false,
    rotary: None,
    fused_qkv: false,
};

/// The field names of a Mamba-2 mixer (each family spells them its own way).
#[derive(Debug, Clone, Copy)]
pub struct MambaKeys {
    pub heads: &'static str,
    pub head_dim: &'static str,
    pub state: &'static str,
    pub groups: &'static str,
    pub conv: &'static str,
    pub bias: &'static str,
    pub conv_bias: &'static str,
    /// The expansion factor, for a head width given as "auto" or absent.
    pub expand: &'static str,
}

pub(super) const MAMBA_KEYS: MambaKeys = MambaKeys {
    heads: "mamba_n_heads",
    head_dim: "mamba_d_head",
    state: "mamba_d_state",
    groups: "mamba_n_groups",
    conv: "mamba_d_conv",
    bias: "mamba_proj_bias",
    conv_bias: "mamba_conv_bias",
    expand: "mamba_expand",
};

/// Which mixer each layer has.
#[derive(Debug, Clone, Copy)]
pub enum Pattern {
    /// Every layer attention; windows from `layer_types` when the config has it, else from
    /// `windows`.
    Attention(Windows),
    /// Qwen3-Next: Gated DeltaNet except every `full_attention_interval`-th layer
    /// (`layer_types` wins).
    DeltaNetHybrid,
    /// Nemotron-H: `hybrid_override_pattern`, one character a block: `M` Mamba-2, `*`
    /// attention, `-` MLP, `E` experts.
    NemotronH,
    /// Bamba / Granite 4.0-H: Mamba-2 except the `attn_layer_indices` (or `layer_types`).
    MambaHybrid,
    /// Mamba-2 only (`mamba2`): each block a norm and a mixer, no MLP.
    MambaOnly,
}

/// Where sliding or chunked windows sit when a config has no `layer_types`.
#[derive(Debug, Clone, Copy)]
pub enum Windows {
    /// Every layer full.
    None,
    /// Every layer slides when `sliding_window` is set (Mistral, Ministral's fallback).
    AllWhenSet,
    /// Qwen2: `use_sliding_window` and layer ≥ `max_window_layers`.
    Qwen2,
    /// Gemma 2: even layers slide.
    Alternate,
    /// Gemma 3 / Cohere 2: every `sliding_window_pattern`-th layer is full (default given).
    EveryNthFull(u64),
    /// Llama 4: the layers that use RoPE attend within `attention_chunk_size`
    /// (`no_rope_layers`, default every 4th layer without RoPE).
    Llama4Chunked,
}

/// Which layers have experts.
#[derive(Debug, Clone, Copy)]
pub enum Placement {
    /// Every layer.
    Every,
    /// Qwen-MoE: `(i + 1) % decoder_sparse_step == 0` and not in `mlp_only_layers`.
    SparseStep,
    /// DeepSeek / GLM: from `first_k_dense_replace` on (and `i % moe_layer_freq == 0`).
    FirstKDense,
    /// Llama 4: `moe_layers`, else every `interleave_moe_layer_step`-th.
    Interleave,
    /// Nemotron-H: the `E` blocks of the pattern.
    Pattern,
}

/// The shared experts.
#[derive(Debug, Clone, Copy)]
pub enum Shared {
    None,
    /// `n_shared_experts` of the routed experts' width (DeepSeek, GLM).
    Count(&'static str),
    /// One shared expert of this field's width.
    Width(&'static str),
    /// As `Width`, with a sigmoid gate (h → 1) on its output (Qwen2-MoE, Qwen3-Next).
    GatedWidth(&'static str),
}

/// The MLP rule.
#[derive(Debug, Clone, Copy)]
pub struct MlpRule {
    /// The dense MLP's width field (also of the dense layers among sparse ones).
    pub ffn: &'static str,
    pub gated: bool,
    pub bias: Bias,
    pub moe: Option<MoeRule>,
}

#[derive(Debug, Clone, Copy)]
pub struct MoeRule {
    pub experts: &'static str,
    pub top_k: &'static str,
    pub expert_ffn: &'static str,
    pub shared: Shared,
    pub placement: Placement,
    pub gating: Gating,
    pub router_bias: bool,
    pub expert_bias: bool,
    pub gated: bool,
    /// gpt-oss's clamped SwiGLU (`swiglu_limit`, `alpha`).
    pub clamped: bool,
    /// Every token through every expert (Llama 4).
    pub all_tokens: bool,
}

/// The MoE fields most families spell so (Mixtral's names, softmax top-k over every layer,
/// gated experts, no biases); a family states what differs.
pub(super) const MOE: MoeRule = MoeRule {
    experts: "num_local_experts",
    top_k: "num_experts_per_tok",
    expert_ffn: "moe_intermediate_size",
    shared: Shared::None,
    placement: Placement::Every,
    gating: Gating::Softmax,
    router_bias: false,
    expert_bias: false,
    gated: true,
    clamped: false,
    all_tokens: false,
};

pub(super) const DENSE: MlpRule = MlpRule {
    ffn: "intermediate_size",
    gated: true,
    bias: Bias::Field("mlp_bias"),
    moe: None,
};

/// One family.
#[derive(Debug, Clone, Copy)]
pub struct Family {
    pub types: &'static [&'static str],
    /// The transformers config class (and where the layer rules come from).
    pub class: &'static str,
    /// The plan family whose op sequence a layer follows (`Arch::Decoder`: built from the
    /// layer records alone).
    pub arch: Arch,
    pub norm: NormKind,
    pub block: BlockForm,
    pub attn: AttnRule,
    pub pattern: Pattern,
    pub mlp: MlpRule,
    pub mamba: MambaKeys,
    /// The config class's defaults for fields a file may leave out.
    pub defaults: &'static [(&'static str, Def)],
    /// The head multiplies or divides its logits by a constant (`ModelSpec::logit_scale`).
    pub logit_scale: bool,
    /// How the block form follows the config (else always `block`).
    pub block_rule: BlockRule,
    /// The head has a bias (Phi's `lm_head`): `vocab` more parameters.
    pub head_bias: bool,
    /// The field naming the activation of an ungated MLP, and its default (None: the plan's
    /// default, one fused op).
    pub act: Option<(&'static str, &'static str)>,
}

/// Where a block form depends on the config's flags.
#[derive(Debug, Clone, Copy)]
pub enum BlockRule {
    /// Always the family's `block`.
    Fixed,
    /// GPT-NeoX: `use_parallel_residual` (default true) gives a norm each to attention and the
    /// MLP, both over the layer's input; false, a pre-norm block (`GPTNeoXLayer.forward`).
    NeoX,
}

/// Typed reads over a config object with a family's defaults.
pub struct Cfg<'a> {
    pub path: &'a str,
    pub obj: &'a Map<String, Json>,
    pub fam: &'a Family,
}

impl Cfg<'_> {
    fn default(&self, key: &str) -> Option<Def> {
        self.fam
            .defaults
            .iter()
            .find(|(k, _)| *k == key)
            .map(|(_, d)| *d)
    }
    /// A non-negative integer, the default when absent, None when null (or defaulting to None).
    pub fn u0(&self, key: &str) -> Result<Option<u64>, ConfigError> {
        match self.obj.get(key) {
            None => Ok(match self.default(key) {
                Some(Def::U(n)) => Some(n),
                _ => None,
            }),
            Some(Json::Null) => Ok(None),
            Some(x) => {
                let n = x.as_u64().ok_or_else(|| {
                    field_err(
                        self.path,
                        key,
                        format!("expected a non-negative integer, found {x}"),
                    )
                })?;
                // Each size within its flag's limit (windows as a sequence, MLP widths as --ffn); any other count (heads, ranks, states,
                // expert counts) at most 65536, checked before any layer is built.
                let size =
                    super::hf_size(key).or(if key.contains("window") || key.contains("chunk") {
                        Some("seq")
                    } else if key.contains("intermediate_size") {
                        Some("ffn")
                    } else {
                        None
                    });
                let max = size
                    .and_then(crate::workload::flags::limit)
                    .unwrap_or(1 << 16);
                if n > max {
                    return Err(field_err(
                        self.path,
                        key,
                        format!("{n} is absurd (at most {max})"),
                    ));
                }
                Ok(Some(n))
            }
        }
    }
    /// A positive integer (absent: the default).
    pub fn u(&self, key: &str) -> Result<Option<u64>, ConfigError> {
        match self.u0(key)? {
            Some(0) => Err(field_err(self.path, key, "must be greater than zero")),
            v => Ok(v),
        }
    }
    pub fn req(&self, key: &str) -> Result<u64, ConfigError> {
        self.u(key)?.ok_or_else(|| {
            field_err(
                self.path,
                key,
                format!("missing, and {} has no default for it", self.fam.class),
            )
        })
    }
    pub fn b(&self, key: &str) -> Result<bool, ConfigError> {
        match self.obj.get(key) {
            None | Some(Json::Null) => Ok(matches!(self.default(key), Some(Def::B(true)))),
            Some(Json::Bool(b)) => Ok(*b),
            Some(x) => Err(field_err(
                self.path,
                key,
                format!("expected true or false, found {x}"),
            )),
        }
    }
    /// The rotated share of a head: `key` (`partial_rotary_factor`) at the top (transformers 4)
    /// or inside `rope_parameters` (transformers 5), else a rotated width (`rotary_dim`,
    /// MiniMax-M2's file) over the head's.
    fn rotary_fraction(&self, key: &str, head_dim: u64) -> Result<f64, ConfigError> {
        let nested = self
            .obj
            .get("rope_parameters")
            .and_then(|r| r.get(key))
            .and_then(Json::as_f64);
        // transformers 5 moves an older spelling (GPT-NeoX's `rotary_pct`) into
        // `rope_parameters.partial_rotary_factor`.
        let nested = nested.or_else(|| {
            self.obj
                .get("rope_parameters")
                .and_then(|r| r.get("partial_rotary_factor"))
                .and_then(Json::as_f64)
        });
        let frac = match (self.f(key)?.or(nested), self.f("rotary_dim")?) {
            (Some(f), _) => f,
            (None, Some(w)) => w / head_dim.max(1) as f64,
            // The config class's default (Phi 0.5, GPT-NeoX 0.25), else every dimension.
            (None, None) => match self.default(key) {
                Some(Def::F(f)) => f,
                _ => 1.0,
            },
        };
        if !(frac > 0.0 && frac <= 1.0) {
            return Err(field_err(
                self.path,
                key,
                format!("rotates {frac} of a head; expected a share in (0, 1]"),
            ));
        }
        Ok(frac)
    }
    pub fn f(&self, key: &str) -> Result<Option<f64>, ConfigError> {
        match self.obj.get(key) {
            None | Some(Json::Null) => Ok(None),
            Some(x) => x
                .as_f64()
                .map(Some)
                .ok_or_else(|| field_err(self.path, key, format!("expected a number, found {x}"))),
        }
    }
    fn bias(&self, b: Bias) -> Result<bool, ConfigError> {
        match b {
            Bias::Fixed(v) => Ok(v),
            Bias::Field(k) => self.b(k),
        }
    }
    /// A list of strings (`layer_types`), None when absent.
    fn strings(&self, key: &str) -> Result<Option<Vec<String>>, ConfigError> {
        match self.obj.get(key) {
            None | Some(Json::Null) => Ok(None),
            Some(Json::Array(a)) => a
                .iter()
                .map(|x| {
                    x.as_str().map(str::to_string).ok_or_else(|| {
                        field_err(self.path, key, format!("expected strings, found {x}"))
                    })
                })
                .collect::<Result<Vec<_>, _>>()
                .map(Some),
            Some(x) => Err(field_err(
                self.path,
                key,
                format!("expected a list, found {x}"),
            )),
        }
    }
    /// A list of layer indices (`mlp_only_layers`, `attn_layer_indices`, `moe_layers`), or a
    /// list of 0/1 flags (`no_rope_layers`).
    fn indices(&self, key: &str) -> Result<Option<Vec<u64>>, ConfigError> {
        match self.obj.get(key) {
            None | Some(Json::Null) => Ok(None),
            Some(Json::Array(a)) => a
                .iter()
                .map(|x| {
                    x.as_u64().ok_or_else(|| {
                        field_err(self.path, key, format!("expected integers, found {x}"))
                    })
                })
                .collect::<Result<Vec<_>, _>>()
                .map(Some),
            Some(x) => Err(field_err(
                self.path,
                key,
                format!("expected a list, found {x}"),
            )),
        }
    }
}

/// What each layer's mixer is, before its shape is read.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Kind {
    Attn(Window),
    /// Attention without rotary positions (Llama 4's NoPE layers: full, no q/k norm).
    NoPe,
    DeltaNet,
    Mamba,
    /// A block with no mixer (Nemotron-H's `-` and `E`).
    Mlp {
        moe: bool,
    },
}

/// Llama 4's RoPE flag per layer (`no_rope_layers`: 1 rotates, 0 is a NoPE layer), by default
/// every `no_rope_layer_interval`-th layer (4) without.
fn llama4_rope(c: &Cfg, n: u64) -> Result<Vec<u64>, ConfigError> {
    Ok(match c.indices("no_rope_layers")? {
        Some(v) if !v.is_empty() => v,
        _ => {
            let every = c.u("no_rope_layer_interval")?.unwrap_or(4);
            (0..n).map(|i| u64::from((i + 1) % every != 0)).collect()
        }
    })
}

/// The kinds of the `n` layers.
fn kinds(c: &Cfg, n: u64) -> Result<Vec<Kind>, ConfigError> {
    let sliding = c.u("sliding_window")?;
    let chunk = c.u("attention_chunk_size")?;
    let window_of = |t: &str, i: usize| -> Result<Kind, ConfigError> {
        Ok(match t {
            "full_attention" | "attention" => Kind::Attn(Window::Full),
            "sliding_attention" => match sliding {
                Some(w) => Kind::Attn(Window::Sliding(w)),
                None => Kind::Attn(Window::Full),
            },
            "chunked_attention" => match chunk {
                Some(w) => Kind::Attn(Window::Chunked(w)),
                None => Kind::Attn(Window::Full),
            },
            // "linear_attention" is a Mamba-2 mixer in the Mamba hybrids' files (transformers
            // 5's spelling of their old "mamba"), Gated DeltaNet in Qwen3-Next's.
            "linear_attention" if !matches!(c.fam.pattern, Pattern::DeltaNetHybrid) => Kind::Mamba,
            "linear_attention" => Kind::DeltaNet,
            "mamba" => Kind::Mamba,
            "indexed_attention" => Kind::Attn(Window::Full),
            other => {
                return Err(field_err(
                    c.path,
                    &format!("layer_types[{i}]"),
                    format!("unknown layer type '{other}' (full_attention, sliding_attention, chunked_attention, linear_attention, mamba, attention)"),
                ))
            }
        })
    };
    if let Some(types) = c.strings("layer_types")? {
        if types.len() as u64 != n && !matches!(c.fam.pattern, Pattern::NemotronH) {
            return Err(field_err(
                c.path,
                "layer_types",
                format!("{} entries for {n} layers", types.len()),
            ));
        }
        if !matches!(c.fam.pattern, Pattern::NemotronH) {
            let mut kinds = types
                .iter()
                .enumerate()
                .map(|(i, t)| window_of(t, i))
                .collect::<Result<Vec<_>, _>>()?;
            if matches!(c.fam.pattern, Pattern::Attention(Windows::Llama4Chunked)) {
                // Llama 4 takes RoPE from `no_rope_layers`, whatever the layer's type.
                for (k, flag) in kinds.iter_mut().zip(llama4_rope(c, n)?) {
                    if flag == 0 {
                        *k = Kind::NoPe;
                    }
                }
            }
            return Ok(kinds);
        }
    }
    let n_us = n as usize;
    Ok(match c.fam.pattern {
        Pattern::Attention(win) => {
            let slide = |on: bool| match (on, sliding) {
                (true, Some(w)) => Kind::Attn(Window::Sliding(w)),
                _ => Kind::Attn(Window::Full),
            };
            match win {
                Windows::None => vec![Kind::Attn(Window::Full); n_us],
                Windows::AllWhenSet => vec![slide(true); n_us],
                Windows::Qwen2 => {
                    let on = c.b("use_sliding_window")?;
                    let from = c.u0("max_window_layers")?.unwrap_or(0);
                    (0..n).map(|i| slide(on && i >= from)).collect()
                }
                Windows::Alternate => (0..n).map(|i| slide(i % 2 == 0)).collect(),
                Windows::EveryNthFull(d) => {
                    let p = c.u("sliding_window_pattern")?.unwrap_or(d);
                    (0..n).map(|i| slide((i + 1) % p != 0)).collect()
                }
                Windows::Llama4Chunked => {
                    let flags = llama4_rope(c, n)?;
                    (0..n_us)
                        .map(|i| match (flags.get(i).copied().unwrap_or(1), chunk) {
                            (1, Some(w)) => Kind::Attn(Window::Chunked(w)),
                            (1, None) => Kind::Attn(Window::Full),
                            _ => Kind::NoPe,
                        })
                        .collect()
                }
            }
        }
        Pattern::DeltaNetHybrid => {
            let every = c.req("full_attention_interval")?;
            (0..n)
                .map(|i| {
                    if (i + 1) % every == 0 {
                        Kind::Attn(Window::Full)
                    } else {
                        Kind::DeltaNet
                    }
                })
                .collect()
        }
        Pattern::NemotronH => {
            let p = match c.obj.get("hybrid_override_pattern") {
                Some(Json::String(s)) => s.clone(),
                _ if c.obj.contains_key("layers_block_type") => nemotron_blocks(c)?,
                _ => {
                    return Err(field_err(
                        c.path,
                        "hybrid_override_pattern",
                        "missing: NemotronH needs one character per block (M, *, -, E)",
                    ))
                }
            };
            if p.chars().count() as u64 != n {
                return Err(field_err(
                    c.path,
                    "hybrid_override_pattern",
                    format!("{} characters for {n} layers", p.chars().count()),
                ));
            }
            p.chars()
                .enumerate()
                .map(|(i, ch)| match ch {
                    'M' => Ok(Kind::Mamba),
                    '*' => Ok(Kind::Attn(Window::Full)),
                    '-' => Ok(Kind::Mlp { moe: false }),
                    'E' => Ok(Kind::Mlp { moe: true }),
                    other => Err(field_err(
                        c.path,
                        "hybrid_override_pattern",
                        format!("unknown block '{other}' at {i} (M, *, -, E)"),
                    )),
                })
                .collect::<Result<Vec<_>, _>>()?
        }
        Pattern::MambaHybrid => {
            let attn = c.indices("attn_layer_indices")?.unwrap_or_default();
            (0..n)
                .map(|i| {
                    if attn.contains(&i) {
                        Kind::Attn(Window::Full)
                    } else {
                        Kind::Mamba
                    }
                })
                .collect()
        }
        Pattern::MambaOnly => vec![Kind::Mamba; n_us],
    })
}

/// transformers 5's NemotronH files spell the pattern as `layers_block_type` (a list of
/// linear_attention / full_attention / mlp / moe): the same blocks as the pattern's M * - E.
fn nemotron_blocks(c: &Cfg) -> Result<String, ConfigError> {
    let blocks = c.strings("layers_block_type")?.unwrap_or_default();
    blocks
        .iter()
        .enumerate()
        .map(|(i, b)| match b.as_str() {
            "linear_attention" | "mamba" => Ok('M'),
            "full_attention" | "attention" => Ok('*'),
            "mlp" => Ok('-'),
            "moe" => Ok('E'),
            other => Err(field_err(
                c.path,
                &format!("layers_block_type[{i}]"),
                format!("unknown block '{other}' (linear_attention, full_attention, mlp, moe)"),
            )),
        })
        .collect()
}

/// The number of layers: `num_hidden_layers`, or the length of a Nemotron-H pattern.
fn layer_count(c: &Cfg) -> Result<u64, ConfigError> {
    if let Some(n) = c.u("num_hidden_layers")? {
        return Ok(n);
    }
    if matches!(c.fam.pattern, Pattern::NemotronH) {
        let n = match c.obj.get("hybrid_override_pattern") {
            Some(Json::String(s)) => s.chars().count() as u64,
            _ => nemotron_blocks(c)?.chars().count() as u64,
        };
        if n > 0 {
            return Ok(n);
        }
    }
    c.req("num_hidden_layers")
}

/// Whether layer `i` of `n` has experts.
fn has_experts(c: &Cfg, rule: &MoeRule, i: u64, n: u64) -> Result<bool, ConfigError> {
    Ok(match rule.placement {
        Placement::Every | Placement::Pattern => true,
        Placement::SparseStep => {
            let step = c.u("decoder_sparse_step")?.unwrap_or(1);
            let only = c.indices("mlp_only_layers")?.unwrap_or_default();
            !only.contains(&i) && (i + 1).is_multiple_of(step)
        }
        Placement::FirstKDense => {
            let k = c.u0("first_k_dense_replace")?.unwrap_or(0);
            let freq = c.u("moe_layer_freq")?.unwrap_or(1);
            i >= k && i.is_multiple_of(freq)
        }
        Placement::Interleave => match c.indices("moe_layers")? {
            Some(v) => v.contains(&i),
            None => {
                let step = c.u("interleave_moe_layer_step")?.unwrap_or(1);
                (step - 1..n).step_by(step as usize).any(|j| j == i)
            }
        },
    })
}

fn moe_of(c: &Cfg, rule: &MoeRule) -> Result<MoeSpec, ConfigError> {
    let experts = c.req(rule.experts)?;
    // DeepseekV2Config leaves num_experts_per_tok None by default: transformers then routes
    // to every expert.
    let top_k = c.u(rule.top_k)?.unwrap_or(experts);
    if top_k > experts {
        return Err(field_err(
            c.path,
            rule.top_k,
            format!("{top_k} is more than the {experts} experts"),
        ));
    }
    let expert_ffn = c.req(rule.expert_ffn)?;
    let (shared_ffn, shared_gate) = match rule.shared {
        Shared::None => (0, false),
        Shared::Count(k) => (c.u0(k)?.unwrap_or(0) * expert_ffn, false),
        Shared::Width(k) => (c.u0(k)?.unwrap_or(0), false),
        Shared::GatedWidth(k) => {
            let w = c.u0(k)?.unwrap_or(0);
            (w, w > 0)
        }
    };
    Ok(MoeSpec {
        experts,
        top_k,
        expert_ffn,
        shared_ffn,
        shared_gate,
        router_bias: rule.router_bias,
        expert_bias: rule.expert_bias,
        gating: rule.gating,
        gated: rule.gated,
        clamped: rule.clamped,
        all_tokens: rule.all_tokens,
    })
}

fn mamba_of(c: &Cfg, h: u64) -> Result<Mamba2, ConfigError> {
    let k = c.fam.mamba;
    let heads = c.req(k.heads)?;
    let head_dim = match c.obj.get(k.head_dim) {
        Some(Json::String(s)) if s == "auto" => None,
        _ => c.u(k.head_dim)?,
    };
    let head_dim = match head_dim {
        Some(d) => d,
        None => {
            let expand = c.req(k.expand)?;
            (expand * h) / heads
        }
    };
    Ok(Mamba2 {
        heads,
        head_dim,
        d_state: c.req(k.state)?,
        groups: c.req(k.groups)?,
        conv: c.req(k.conv)?,
        bias: c.b(k.bias)?,
        conv_bias: c.b(k.conv_bias)?,
        norm: true,
    })
}

fn attention_of(c: &Cfg, window: Window, h: u64) -> Result<Mixer, ConfigError> {
    let r = &c.fam.attn;
    let heads = c.req("num_attention_heads")?;
    if let AttnKind::Mla = r.kind {
        return Ok(Mixer::Mla(Mla {
            heads,
            q_lora_rank: c.u("q_lora_rank")?,
            kv_lora_rank: c.req("kv_lora_rank")?,
            qk_nope_head_dim: c.req("qk_nope_head_dim")?,
            qk_rope_head_dim: c.req("qk_rope_head_dim")?,
            v_head_dim: c.req("v_head_dim")?,
            bias: c.b("attention_bias")?,
            indexer: match c.u("index_n_heads")? {
                Some(ih) => Some((ih, c.req("index_head_dim")?)),
                None => None,
            },
        }));
    }
    let kv_heads = c.u("num_key_value_heads")?.unwrap_or(heads);
    if !heads.is_multiple_of(kv_heads) {
        return Err(field_err(
            c.path,
            "num_key_value_heads",
            format!("{kv_heads} does not divide num_attention_heads {heads} (each key/value head serves a whole group of query heads)"),
        ));
    }
    let head_dim = match c.u("head_dim")? {
        Some(d) => d,
        None if h.is_multiple_of(heads) => h / heads,
        // transformers' `getattr(config, "head_dim", hidden_size // num_attention_heads)`.
        None if c.fam.arch == Arch::Decoder => h / heads,
        None => {
            return Err(field_err(
                c.path,
                "num_attention_heads",
                format!(
                    "{heads} heads do not divide the hidden size {h} (and no head_dim is given)"
                ),
            ))
        }
    };
    let qk_norm = match r.qk_norm_flag {
        Some(flag) if !c.b(flag)? => QkNorm::None,
        _ => r.qk_norm,
    };
    let rotary_fraction = match r.rotary {
        Some(k) => c.rotary_fraction(k, head_dim)?,
        None => 1.0,
    };
    Ok(Mixer::Attention(Attn {
        heads,
        kv_heads,
        head_dim,
        window,
        qkv_bias: c.bias(r.qkv_bias)?,
        o_bias: c.bias(r.o_bias)?,
        qk_norm,
        sinks: r.sinks,
        output_gate: r.output_gate,
        rotary_fraction,
        softcap: c.f("attn_logit_softcapping")?.is_some(),
        fused_qkv: r.fused_qkv,
    }))
}

/// The block form of every layer.
fn block_form(c: &Cfg) -> Result<BlockForm, ConfigError> {
    Ok(match c.fam.block_rule {
        BlockRule::Fixed => c.fam.block,
        BlockRule::NeoX if c.b("use_parallel_residual")? => BlockForm::ParallelNorms,
        BlockRule::NeoX => BlockForm::PreNorm,
    })
}

/// The layers of a decoder config of family `c.fam`, hidden width `h`, `n` layers.
pub fn layers(c: &Cfg, h: u64, n: u64) -> Result<Vec<LayerSpec>, ConfigError> {
    let kinds = kinds(c, n)?;
    let rule = &c.fam.mlp;
    let dense = |c: &Cfg| -> Result<MlpSpec, ConfigError> {
        Ok(MlpSpec::Dense {
            ffn: c.req(rule.ffn)?,
            gated: rule.gated,
            bias: c.bias(rule.bias)?,
        })
    };
    let block = block_form(c)?;
    let mut out = Vec::with_capacity(kinds.len());
    for (i, k) in kinds.into_iter().enumerate() {
        let i = i as u64;
        let mixer = match k {
            Kind::Attn(w) => attention_of(c, w, h)?,
            Kind::NoPe => match attention_of(c, Window::Full, h)? {
                Mixer::Attention(a) => Mixer::Attention(Attn {
                    rotary_fraction: 0.0,
                    qk_norm: QkNorm::None,
                    ..a
                }),
                m => m,
            },
            Kind::DeltaNet => Mixer::GatedDeltaNet(DeltaNet {
                k_heads: c.req("linear_num_key_heads")?,
                v_heads: c.req("linear_num_value_heads")?,
                head_k_dim: c.req("linear_key_head_dim")?,
                head_v_dim: c.req("linear_value_head_dim")?,
                conv: c.req("linear_conv_kernel_dim")?,
            }),
            Kind::Mamba => Mixer::Mamba2(mamba_of(c, h)?),
            Kind::Mlp { .. } => Mixer::None,
        };
        let mlp = match (c.fam.pattern, k) {
            // Nemotron-H: a block is a mixer or an MLP.
            (Pattern::NemotronH, Kind::Mlp { moe: true }) => match &rule.moe {
                Some(m) => MlpSpec::Moe(moe_of(c, m)?),
                None => dense(c)?,
            },
            (Pattern::NemotronH, Kind::Mlp { moe: false }) => dense(c)?,
            (Pattern::NemotronH, _) | (Pattern::MambaOnly, _) => MlpSpec::None,
            _ => match &rule.moe {
                Some(m) if c.u0(m.experts)?.unwrap_or(0) == 0 => dense(c)?,
                Some(m) if has_experts(c, m, i, n)? => MlpSpec::Moe(moe_of(c, m)?),
                _ => dense(c)?,
            },
        };
        out.push(LayerSpec { mixer, block, mlp });
    }
    Ok(out)
}

/// The model of a decoder config: its layers, embedding and head.
pub fn model(c: &Cfg, model_type: &str) -> Result<ModelSpec, ConfigError> {
    let hidden = c.req("hidden_size")?;
    let n = layer_count(c)?;
    let vocab = c.req("vocab_size")?;
    Ok(ModelSpec {
        family: model_type.to_string(),
        hidden,
        vocab,
        norm: c.fam.norm,
        tied: c.b("tie_word_embeddings")?,
        extra_params: if c.fam.head_bias { vocab } else { 0 },
        logit_scale: c.fam.logit_scale,
        layers: layers(c, hidden, n)?,
        vision: None,
    })
}
