//! The family table: one row per `model_type` (field names, the config class's defaults and
//! the layer rules of `families`), each citing its transformers 5.24 config class. Adding a
//! family that brings no new mixer is adding a row here.

use super::families::{
    AttnKind, AttnRule, Bias, BlockRule, Def, Family, MambaKeys, MlpRule, MoeRule, Pattern,
    Placement, Shared, Windows, ATTN, DENSE, MAMBA_KEYS, MOE,
};
use crate::workload::layers::{BlockForm, Gating, NormKind, QkNorm};
use crate::workload::Arch;

/// The family of a `model_type`.
pub fn family(t: &str) -> Option<&'static Family> {
    FAMILIES.iter().find(|f| f.types.contains(&t))
}

const LLAMA_DEFAULTS: &[(&str, Def)] = &[
    ("tie_word_embeddings", Def::B(false)),
    ("attention_bias", Def::B(false)),
    ("mlp_bias", Def::B(false)),
];

const fn attention_family(
    types: &'static [&'static str],
    class: &'static str,
    arch: Arch,
    windows: Windows,
    defaults: &'static [(&'static str, Def)],
) -> Family {
    Family {
        types,
        class,
        arch,
        norm: NormKind::Rms,
        block: BlockForm::PreNorm,
        attn: ATTN,
        pattern: Pattern::Attention(windows),
        mlp: DENSE,
        mamba: MAMBA_KEYS,
        defaults,
        logit_scale: false,
        block_rule: BlockRule::Fixed,
        head_bias: false,
        act: None,
    }
}

/// DeepSeek-V3's row; GLM-5 and DeepSeek-V3.2 are the same layers with the indexer's fields.
const DEEPSEEK_V3: Family = Family {
        attn: AttnRule {
            kind: AttnKind::Mla,
            ..ATTN
        },
        mlp: MlpRule {
            moe: Some(MoeRule {
                experts: "n_routed_experts",
                shared: Shared::Count("n_shared_experts"),
                placement: Placement::FirstKDense,
                gating: Gating::Sigmoid,
                ..MOE
            }),
            ..DENSE
        },
        ..attention_family(
            &["deepseek_v3", "kimi_k2"],
            "DeepseekV3Config (MLA; first_k_dense_replace dense layers, then routed and shared experts; the MTP layers of num_nextn_predict_layers are not built by transformers)",
            Arch::Decoder,
            Windows::None,
            &[
                ("tie_word_embeddings", Def::B(false)),
                ("attention_bias", Def::B(false)),
                ("vocab_size", Def::U(129_280)),
                ("hidden_size", Def::U(7168)),
                ("intermediate_size", Def::U(18432)),
                ("moe_intermediate_size", Def::U(2048)),
                ("num_hidden_layers", Def::U(61)),
                ("num_attention_heads", Def::U(128)),
                ("n_shared_experts", Def::U(1)),
                ("n_routed_experts", Def::U(256)),
                ("num_experts_per_tok", Def::U(8)),
                ("first_k_dense_replace", Def::U(3)),
                ("moe_layer_freq", Def::U(1)),
                ("kv_lora_rank", Def::U(512)),
                ("q_lora_rank", Def::U(1536)),
                ("qk_rope_head_dim", Def::U(64)),
                ("qk_nope_head_dim", Def::U(128)),
                ("v_head_dim", Def::U(128)),
            ],
        )
    };

/// Every family a config.json may name, in one table.
pub const FAMILIES: &[Family] = &[
    attention_family(
        &["llama"],
        "LlamaConfig",
        Arch::Llama,
        Windows::None,
        LLAMA_DEFAULTS,
    ),
    attention_family(
        &["mistral"],
        "MistralConfig (sliding_window 4096 by default; null in v0.2 and later files)",
        Arch::Mistral,
        Windows::AllWhenSet,
        &[
            ("tie_word_embeddings", Def::B(false)),
            ("sliding_window", Def::U(4096)),
            ("vocab_size", Def::U(32000)),
        ],
    ),
    attention_family(
        &["ministral", "ministral3"],
        "MinistralConfig / Ministral3Config (layer_types; sliding_window)",
        Arch::Decoder,
        Windows::AllWhenSet,
        &[("tie_word_embeddings", Def::B(false)), ("vocab_size", Def::U(131072))],
    ),
    Family {
        attn: AttnRule {
            qkv_bias: Bias::Fixed(true),
            o_bias: Bias::Fixed(false),
            ..ATTN
        },
        ..attention_family(
            &["qwen2"],
            "Qwen2Config (q, k, v biases hard-coded in Qwen2Attention)",
            Arch::Qwen2,
            Windows::Qwen2,
            &[("tie_word_embeddings", Def::B(false))],
        )
    },
    Family {
        attn: AttnRule {
            qk_norm: QkNorm::PerHead,
            ..ATTN
        },
        ..attention_family(
            &["qwen3"],
            "Qwen3Config (q_norm, k_norm over head_dim)",
            Arch::Qwen3,
            Windows::Qwen2,
            &[("tie_word_embeddings", Def::B(false)), ("attention_bias", Def::B(false))],
        )
    },
    Family {
        ..attention_family(
            &["smollm3"],
            "SmolLM3Config (no_rope_layers change no memory)",
            Arch::Decoder,
            Windows::Qwen2,
            &[
                ("tie_word_embeddings", Def::B(true)),
                ("vocab_size", Def::U(128256)),
            ],
        )
    },
    Family {
        logit_scale: true,
        ..attention_family(
            &["granite"],
            "GraniteConfig (the residual and attention multipliers change no memory; `logits / logits_scaling` makes a second logits tensor)",
            Arch::Decoder,
            Windows::None,
            LLAMA_DEFAULTS,
        )
    },
    Family {
        block: BlockForm::PostNorm,
        attn: AttnRule {
            qk_norm: QkNorm::Full,
            ..ATTN
        },
        ..attention_family(
            &["olmo2", "olmo3"],
            "Olmo2Config / Olmo3Config (post_attention_layernorm and post_feedforward_layernorm on the branch outputs; q_norm over heads·d, k_norm over kv_heads·d)",
            Arch::Decoder,
            Windows::None,
            &[("tie_word_embeddings", Def::B(false)), ("vocab_size", Def::U(50304))],
        )
    },
    Family {
        logit_scale: true,
        norm: NormKind::LayerNoBias,
        block: BlockForm::Parallel,
        attn: AttnRule {
            qk_norm: QkNorm::PerHeadWeights,
            qk_norm_flag: Some("use_qk_norm"),
            ..ATTN
        },
        ..attention_family(
            &["cohere"],
            "CohereConfig (one CohereLayerNorm, attention and MLP in parallel)",
            Arch::Decoder,
            Windows::None,
            &[
                ("tie_word_embeddings", Def::B(true)),
                ("vocab_size", Def::U(256000)),
                ("use_qk_norm", Def::B(false)),
            ],
        )
    },
    Family {
        logit_scale: true,
        norm: NormKind::LayerNoBias,
        block: BlockForm::Parallel,
        ..attention_family(
            &["cohere2"],
            "Cohere2Config (every sliding_window_pattern-th layer full)",
            Arch::Decoder,
            Windows::EveryNthFull(4),
            &[
                ("tie_word_embeddings", Def::B(true)),
                ("vocab_size", Def::U(256000)),
                ("sliding_window", Def::U(4096)),
            ],
        )
    },
    Family {
        norm: NormKind::Layer,
        block: BlockForm::Parallel,
        attn: AttnRule {
            qkv_bias: Bias::Fixed(true),
            o_bias: Bias::Fixed(true),
            qk_norm: QkNorm::PerHead,
            qk_norm_flag: Some("qk_layernorm"),
            rotary: Some("partial_rotary_factor"),
            ..ATTN
        },
        mlp: MlpRule {
            gated: false,
            bias: Bias::Fixed(true),
            ..DENSE
        },
        head_bias: true,
        act: Some(("hidden_act", "gelu_new")),
        ..attention_family(
            &["phi"],
            "PhiConfig (one LayerNorm, attention and fc1/fc2 MLP in parallel, every linear biased, the head too; partial_rotary_factor 0.5 by default)",
            Arch::Decoder,
            Windows::None,
            &[
                ("tie_word_embeddings", Def::B(false)),
                ("vocab_size", Def::U(51200)),
                ("partial_rotary_factor", Def::F(0.5)),
            ],
        )
    },
    Family {
        norm: NormKind::Layer,
        block_rule: BlockRule::NeoX,
        attn: AttnRule {
            qkv_bias: Bias::Field("attention_bias"),
            o_bias: Bias::Field("attention_bias"),
            rotary: Some("rotary_pct"),
            fused_qkv: true,
            ..ATTN
        },
        mlp: MlpRule {
            gated: false,
            bias: Bias::Fixed(true),
            ..DENSE
        },
        act: Some(("hidden_act", "gelu")),
        ..attention_family(
            &["gpt_neox"],
            "GPTNeoXConfig (query_key_value split as views; use_parallel_residual: input_layernorm and post_attention_layernorm both over the layer's input; rotary_pct 0.25 by default)",
            Arch::Decoder,
            Windows::None,
            &[
                ("tie_word_embeddings", Def::B(false)),
                ("attention_bias", Def::B(true)),
                ("use_parallel_residual", Def::B(true)),
                ("vocab_size", Def::U(50432)),
                ("rotary_pct", Def::F(0.25)),
            ],
        )
    },
    Family {
        mlp: MlpRule {
            bias: Bias::Fixed(false),
            ..DENSE
        },
        ..attention_family(
            &["gemma"],
            "GemmaConfig (GeGLU, embeddings × √h)",
            Arch::Gemma,
            Windows::None,
            &[("tie_word_embeddings", Def::B(true)), ("head_dim", Def::U(256))],
        )
    },
    Family {
        block: BlockForm::Sandwich,
        ..attention_family(
            &["gemma2"],
            "Gemma2Config (even layers slide)",
            Arch::Gemma2,
            Windows::Alternate,
            &[
                ("tie_word_embeddings", Def::B(true)),
                ("head_dim", Def::U(256)),
                ("sliding_window", Def::U(4096)),
            ],
        )
    },
    Family {
        block: BlockForm::Sandwich,
        attn: AttnRule {
            qk_norm: QkNorm::PerHead,
            ..ATTN
        },
        ..attention_family(
            &["gemma3_text", "gemma3"],
            "Gemma3TextConfig (every sliding_window_pattern-th layer full; vocab 262208)",
            Arch::Gemma3,
            Windows::EveryNthFull(6),
            &[
                ("tie_word_embeddings", Def::B(true)),
                ("vocab_size", Def::U(262_208)),
                ("hidden_size", Def::U(2304)),
                ("intermediate_size", Def::U(9216)),
                ("num_hidden_layers", Def::U(26)),
                ("num_attention_heads", Def::U(8)),
                ("num_key_value_heads", Def::U(4)),
                ("head_dim", Def::U(256)),
                ("max_position_embeddings", Def::U(131_072)),
                ("sliding_window", Def::U(4096)),
                ("attention_bias", Def::B(false)),
            ],
        )
    },
    Family {
        attn: AttnRule {
            qkv_bias: Bias::Fixed(false),
            o_bias: Bias::Fixed(false),
            ..ATTN
        },
        mlp: MlpRule {
            bias: Bias::Fixed(false),
            ..DENSE
        },
        ..attention_family(
            &["phi3"],
            "Phi3Config (fused qkv_proj and gate_up_proj)",
            Arch::Phi3,
            Windows::None,
            &[("tie_word_embeddings", Def::B(false))],
        )
    },
    Family {
        mlp: MlpRule {
            moe: Some(MoeRule {
                expert_ffn: "intermediate_size",
                ..MOE
            }),
            ..DENSE
        },
        ..attention_family(
            &["mixtral"],
            "MixtralConfig",
            Arch::Mixtral,
            Windows::AllWhenSet,
            &[("tie_word_embeddings", Def::B(false))],
        )
    },
    Family {
        attn: AttnRule {
            qkv_bias: Bias::Field("qkv_bias"),
            o_bias: Bias::Fixed(false),
            ..ATTN
        },
        mlp: MlpRule {
            moe: Some(MoeRule {
                experts: "num_experts",
                shared: Shared::GatedWidth("shared_expert_intermediate_size"),
                placement: Placement::SparseStep,
                ..MOE
            }),
            ..DENSE
        },
        ..attention_family(
            &["qwen2_moe"],
            "Qwen2MoeConfig (qkv_bias true)",
            Arch::Qwen2Moe,
            Windows::Qwen2,
            &[
                ("tie_word_embeddings", Def::B(false)),
                ("qkv_bias", Def::B(true)),
                ("decoder_sparse_step", Def::U(1)),
            ],
        )
    },
    Family {
        attn: AttnRule {
            qk_norm: QkNorm::PerHead,
            ..ATTN
        },
        mlp: MlpRule {
            moe: Some(MoeRule {
                experts: "num_experts",
                placement: Placement::SparseStep,
                ..MOE
            }),
            ..DENSE
        },
        ..attention_family(
            &["qwen3_moe"],
            "Qwen3MoeConfig (mlp_only_layers, decoder_sparse_step)",
            Arch::Qwen3Moe,
            Windows::Qwen2,
            &[
                ("tie_word_embeddings", Def::B(false)),
                ("attention_bias", Def::B(false)),
                ("decoder_sparse_step", Def::U(1)),
            ],
        )
    },
    DEEPSEEK_V3,
    Family {
        types: &["glm_moe_dsa", "deepseek_v32"],
        class: "GlmMoeDsaConfig / DeepseekV32Config (DeepSeek-V3's layers; MLA with the sparse-attention indexer of index_n_heads × index_head_dim)",
        ..DEEPSEEK_V3
    },
    Family {
        attn: AttnRule {
            kind: AttnKind::Mla,
            ..ATTN
        },
        mlp: MlpRule {
            moe: Some(MoeRule {
                experts: "n_routed_experts",
                shared: Shared::Count("n_shared_experts"),
                placement: Placement::FirstKDense,
                ..MOE
            }),
            ..DENSE
        },
        ..attention_family(
            &["deepseek_v2"],
            "DeepseekV2Config (MLA, q_lora_rank null in V2-Lite; experts where i ≥ first_k_dense_replace and i % moe_layer_freq == 0)",
            Arch::Decoder,
            Windows::None,
            &[
                ("tie_word_embeddings", Def::B(false)),
                ("attention_bias", Def::B(false)),
                ("q_lora_rank", Def::U(1536)),
                ("kv_lora_rank", Def::U(512)),
                ("qk_rope_head_dim", Def::U(64)),
                ("qk_nope_head_dim", Def::U(128)),
                ("v_head_dim", Def::U(128)),
                ("first_k_dense_replace", Def::U(0)),
                ("moe_layer_freq", Def::U(1)),
                ("n_shared_experts", Def::Null),
            ],
        )
    },
    Family {
        attn: AttnRule {
            o_bias: Bias::Fixed(false),
            qk_norm: QkNorm::PerHead,
            qk_norm_flag: Some("use_qk_norm"),
            rotary: Some("partial_rotary_factor"),
            ..ATTN
        },
        mlp: MlpRule {
            moe: Some(MoeRule {
                experts: "n_routed_experts",
                shared: Shared::Count("n_shared_experts"),
                placement: Placement::FirstKDense,
                gating: Gating::Sigmoid,
                ..MOE
            }),
            ..DENSE
        },
        ..attention_family(
            &["glm4_moe"],
            "Glm4MoeConfig (q, k, v biases from attention_bias, o without; partial rotary; the MTP layer is not built)",
            Arch::Decoder,
            Windows::None,
            &[
                ("tie_word_embeddings", Def::B(false)),
                ("attention_bias", Def::B(false)),
                ("use_qk_norm", Def::B(false)),
                ("first_k_dense_replace", Def::U(1)),
                ("moe_layer_freq", Def::U(1)),
                ("n_shared_experts", Def::U(1)),
            ],
        )
    },
    Family {
        attn: AttnRule {
            sinks: true,
            ..ATTN
        },
        mlp: MlpRule {
            moe: Some(MoeRule {
                expert_ffn: "intermediate_size",
                router_bias: true,
                expert_bias: true,
                clamped: true,
                ..MOE
            }),
            ..DENSE
        },
        ..attention_family(
            &["gpt_oss"],
            "GptOssConfig (sinks, biases everywhere; layer_types alternate sliding 128 and full)",
            Arch::Decoder,
            Windows::None,
            &[
                ("tie_word_embeddings", Def::B(false)),
                ("attention_bias", Def::B(true)),
                ("num_local_experts", Def::U(128)),
                ("num_experts_per_tok", Def::U(4)),
                ("head_dim", Def::U(64)),
                ("sliding_window", Def::U(128)),
            ],
        )
    },
    Family {
        attn: AttnRule {
            qk_norm: QkNorm::L2,
            qk_norm_flag: Some("use_qk_norm"),
            ..ATTN
        },
        mlp: MlpRule {
            ffn: "intermediate_size_mlp",
            moe: Some(MoeRule {
                expert_ffn: "intermediate_size",
                shared: Shared::Width("intermediate_size"),
                placement: Placement::Interleave,
                gating: Gating::Sigmoid,
                all_tokens: true,
                ..MOE
            }),
            ..DENSE
        },
        ..attention_family(
            &["llama4_text", "llama4"],
            "Llama4TextConfig (chunked attention in the RoPE layers; MoE every interleave_moe_layer_step-th layer with a shared expert; dense layers intermediate_size_mlp)",
            Arch::Decoder,
            Windows::Llama4Chunked,
            &[
                ("tie_word_embeddings", Def::B(false)),
                ("attention_bias", Def::B(false)),
                ("use_qk_norm", Def::B(true)),
                ("interleave_moe_layer_step", Def::U(1)),
                ("num_local_experts", Def::U(16)),
                ("num_experts_per_tok", Def::U(1)),
                ("attention_chunk_size", Def::U(8192)),
                ("vocab_size", Def::U(202_048)),
                ("head_dim", Def::U(128)),
            ],
        )
    },
    Family {
        attn: AttnRule {
            qk_norm: QkNorm::Full,
            qk_norm_flag: Some("use_qk_norm"),
            rotary: Some("partial_rotary_factor"),
            ..ATTN
        },
        mlp: MlpRule {
            moe: Some(MoeRule {
                expert_ffn: "intermediate_size",
                gating: Gating::Sigmoid,
                ..MOE
            }),
            ..DENSE
        },
        ..attention_family(
            &["minimax_m2"],
            "MiniMaxM2Config (q/k RMSNorm over the whole projection, sigmoid routing)",
            Arch::Decoder,
            Windows::None,
            &[
                ("tie_word_embeddings", Def::B(false)),
                ("attention_bias", Def::B(false)),
                ("use_qk_norm", Def::B(true)),
            ],
        )
    },
    Family {
        logit_scale: true,
        mlp: MlpRule {
            moe: Some(MoeRule {
                expert_ffn: "intermediate_size",
                shared: Shared::Width("shared_intermediate_size"),
                ..MOE
            }),
            ..DENSE
        },
        ..attention_family(
            &["granitemoe", "granitemoeshared"],
            "GraniteMoeConfig / GraniteMoeSharedConfig (shared_intermediate_size)",
            Arch::Decoder,
            Windows::None,
            LLAMA_DEFAULTS,
        )
    },
    Family {
        attn: AttnRule {
            qk_norm: QkNorm::PerHead,
            output_gate: true,
            rotary: Some("partial_rotary_factor"),
            ..ATTN
        },
        pattern: Pattern::DeltaNetHybrid,
        mlp: MlpRule {
            moe: Some(MoeRule {
                experts: "num_experts",
                shared: Shared::GatedWidth("shared_expert_intermediate_size"),
                placement: Placement::SparseStep,
                ..MOE
            }),
            ..DENSE
        },
        ..attention_family(
            &["qwen3_next", "qwen3_5_moe", "qwen3_5_moe_text"],
            "Qwen3NextConfig (Gated DeltaNet, every full_attention_interval-th layer gated full attention)",
            Arch::Decoder,
            Windows::None,
            &[
                ("tie_word_embeddings", Def::B(false)),
                ("attention_bias", Def::B(false)),
                ("decoder_sparse_step", Def::U(1)),
                ("full_attention_interval", Def::U(4)),
                ("linear_conv_kernel_dim", Def::U(4)),
                ("linear_key_head_dim", Def::U(128)),
                ("linear_value_head_dim", Def::U(128)),
                ("linear_num_key_heads", Def::U(16)),
                ("linear_num_value_heads", Def::U(32)),
            ],
        )
    },
    Family {
        attn: AttnRule {
            qk_norm: QkNorm::PerHead,
            output_gate: true,
            rotary: Some("partial_rotary_factor"),
            ..ATTN
        },
        pattern: Pattern::DeltaNetHybrid,
        ..attention_family(
            &["qwen3_5", "qwen3_5_text"],
            "Qwen3_5TextConfig (Qwen3-Next's layers with a dense MLP)",
            Arch::Decoder,
            Windows::None,
            &[
                ("tie_word_embeddings", Def::B(false)),
                ("attention_bias", Def::B(false)),
                ("full_attention_interval", Def::U(4)),
                ("linear_conv_kernel_dim", Def::U(4)),
                ("linear_key_head_dim", Def::U(128)),
                ("linear_value_head_dim", Def::U(128)),
                ("linear_num_key_heads", Def::U(16)),
                ("linear_num_value_heads", Def::U(32)),
            ],
        )
    },
    Family {
        pattern: Pattern::NemotronH,
        mlp: MlpRule {
            gated: false,
            moe: Some(MoeRule {
                experts: "n_routed_experts",
                shared: Shared::Width("moe_shared_expert_intermediate_size"),
                placement: Placement::Pattern,
                gating: Gating::Sigmoid,
                gated: false,
                ..MOE
            }),
            ..DENSE
        },
        mamba: MambaKeys {
            heads: "mamba_num_heads",
            head_dim: "mamba_head_dim",
            state: "ssm_state_size",
            groups: "n_groups",
            conv: "conv_kernel",
            bias: "use_bias",
            conv_bias: "use_conv_bias",
            expand: "expand",
        },
        ..attention_family(
            &["nemotron_h"],
            "NemotronHConfig (hybrid_override_pattern: M Mamba-2, * attention, - MLP (relu², not gated), E experts; one norm per block)",
            Arch::Decoder,
            Windows::None,
            &[
                ("tie_word_embeddings", Def::B(false)),
                // The class's own default, not hidden / heads; `attention_head_dim` in the
                // shipped files is not read by transformers 5.24 (Nemotron-Nano-9B-v2: 4480
                // / 40 = 112, but its attention is 40 × 128 wide).
                ("head_dim", Def::U(128)),
                ("attention_bias", Def::B(false)),
                ("mlp_bias", Def::B(false)),
                ("use_bias", Def::B(false)),
                ("use_conv_bias", Def::B(true)),
                ("conv_kernel", Def::U(4)),
                ("n_groups", Def::U(8)),
                ("ssm_state_size", Def::U(128)),
                ("mamba_head_dim", Def::U(64)),
                ("mamba_num_heads", Def::U(128)),
            ],
        )
    },
    Family {
        pattern: Pattern::MambaHybrid,
        ..attention_family(
            &["bamba"],
            "BambaConfig (attn_layer_indices; Mamba-2 elsewhere)",
            Arch::Decoder,
            Windows::None,
            &[
                ("tie_word_embeddings", Def::B(false)),
                ("attention_bias", Def::B(false)),
                ("mamba_n_heads", Def::U(128)),
                ("mamba_d_state", Def::U(256)),
                ("mamba_n_groups", Def::U(1)),
                ("mamba_d_conv", Def::U(4)),
                ("mamba_expand", Def::U(2)),
                ("mamba_conv_bias", Def::B(true)),
                ("mamba_proj_bias", Def::B(false)),
            ],
        )
    },
    Family {
        logit_scale: true,
        pattern: Pattern::MambaHybrid,
        mlp: MlpRule {
            ffn: "shared_intermediate_size",
            moe: Some(MoeRule {
                expert_ffn: "intermediate_size",
                shared: Shared::Width("shared_intermediate_size"),
                ..MOE
            }),
            ..DENSE
        },
        ..attention_family(
            &["granitemoehybrid"],
            "GraniteMoeHybridConfig (layer_types mamba / attention; experts with a shared MLP, or the shared MLP alone when num_local_experts is 0)",
            Arch::Decoder,
            Windows::None,
            &[
                ("tie_word_embeddings", Def::B(false)),
                ("attention_bias", Def::B(false)),
                ("mamba_n_heads", Def::U(128)),
                ("mamba_d_state", Def::U(256)),
                ("mamba_n_groups", Def::U(1)),
                ("mamba_d_conv", Def::U(4)),
                ("mamba_expand", Def::U(2)),
                ("mamba_conv_bias", Def::B(true)),
                ("mamba_proj_bias", Def::B(false)),
            ],
        )
    },
    Family {
        pattern: Pattern::MambaOnly,
        mamba: MambaKeys {
            heads: "num_heads",
            head_dim: "head_dim",
            state: "state_size",
            groups: "n_groups",
            conv: "conv_kernel",
            bias: "use_bias",
            conv_bias: "use_conv_bias",
            expand: "expand",
        },
        ..attention_family(
            &["mamba2"],
            "Mamba2Config (a norm and a mixer per block, no MLP)",
            Arch::Decoder,
            Windows::None,
            &[
                ("tie_word_embeddings", Def::B(true)),
                ("num_heads", Def::U(128)),
                ("head_dim", Def::U(64)),
                ("state_size", Def::U(128)),
                ("n_groups", Def::U(8)),
                ("conv_kernel", Def::U(4)),
                ("expand", Def::U(2)),
                ("use_bias", Def::B(false)),
                ("use_conv_bias", Def::B(true)),
                ("vocab_size", Def::U(32768)),
            ],
        )
    },
];

/// Families transformers defines that are not rows yet, with what each would need.
pub const NOT_MODELLED: &[(&str, &str)] = &[
    (
        "falcon",
        "its own attention (measured on the CPU, validation/families_notes.md): a causal mask materialized for every layer, which SDPA converts and saves, key/value heads broadcast rather than repeated, and eager scores kept beside their masked sum",
    ),
    ("jamba", "Mamba-1 mixers (a selective scan with a per-channel state), not Mamba-2"),
    ("falcon_h1", "attention and Mamba-2 side by side in one layer, with µP multipliers"),
    ("zamba2", "a shared attention block reused across Mamba-2 layers"),
    ("lfm2", "short convolution mixers"),
    ("gemma3n", "per-layer embeddings, AltUp and Laurel blocks"),
    (
        "gemma4",
        "per-layer embeddings (hidden_size_per_layer_input), per-layer head widths (per_layer_config) and key/value sharing across layers",
    ),
    (
        "gemma4_text",
        "per-layer embeddings (hidden_size_per_layer_input), per-layer head widths (per_layer_config) and key/value sharing across layers",
    ),
    ("mamba", "Mamba-1 mixers"),
    ("rwkv", "RWKV time-mixing"),
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_type_is_one_row() {
        let mut seen = std::collections::HashSet::new();
        for f in FAMILIES {
            for t in f.types {
                assert!(seen.insert(*t), "{t} twice");
            }
        }
        for (t, _) in NOT_MODELLED {
            assert!(family(t).is_none(), "{t} is a row and refused");
        }
    }
}
