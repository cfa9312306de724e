//! Model presets with their published shapes.
//!
//! Defaults every preset shares: batch 1, SDPA attention (transformers' default; eager for
//! Gemma 2, which has no SDPA path), no checkpointing, ZeRO off on one GPU, Adam. Precision:
//! fp32, except LLaMA-1 (mixed: trained in 16-bit with fp32 master weights) and today's LLMs
//! (bf16: their configs' `torch_dtype`, which transformers 5 loads them in). Dropout: on for
//! GPT-2 and BERT (p = 0.1 in their configs), off for the LLaMA-style decoders and ViT (their
//! published configs use 0.0). The decoder LLMs' sequence defaults to their context, at most
//! 4096 tokens (`LLM_SEQ`); shapes, parameter counts and sources are in `tests/fixtures/configs`. For ViT and ResNet, `vocab` holds the number of classes
//! (1000, ImageNet-1k). For ResNet, `layers` is the depth (14, 26, 50, 101, 152) and `hidden` the
//! stem width (64); sequence, head and FFN fields do not apply and are 0.

use thiserror::Error;

use super::{
    Arch, Attention, Checkpoint, Gelu, Grads, Mode, Moe, Optimizer, Precision, StepKind, Workload,
};

/// The longest default sequence of a decoder LLM preset or config (its context when shorter).
pub const LLM_SEQ: u64 = 4096;

/// Every preset name, in the order `--help` lists them.
pub const NAMES: [&str; 21] = [
    "gpt2",
    "gpt2-medium",
    "gpt2-large",
    "gpt2-xl",
    "bert-base",
    "bert-large",
    "vit-b16",
    "vit-l16",
    "llama-7b",
    "llama-13b",
    "llama3-8b",
    "mistral-7b",
    "qwen2.5-7b",
    "qwen2.5-0.5b",
    "mixtral-8x7b",
    "gemma2-9b",
    "phi3-mini",
    "resnet50",
    "tiny-gpt",
    "tiny-cnn",
    "dense",
];

#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("unknown model preset '{name}' (valid: {})", NAMES.join(", "))]
pub struct UnknownPreset {
    pub name: String,
}

/// The common defaults; callers fill in the shape.
pub fn base(name: &str, arch: Arch) -> Workload {
    Workload {
        name: name.to_string(),
        arch,
        batch: 1,
        seq: 0,
        layers: 0,
        hidden: 0,
        heads: 0,
        ffn: 0,
        vocab: 0,
        image: 0,
        patch: 0,
        params: None,
        max_positions: 0,
        precision: Precision::Fp32,
        optimizer: Optimizer::Adam,
        attention: Attention::Sdpa,
        checkpoint: Checkpoint::None,
        dropout: false,
        zero: 0,
        gpus: 1,
        parallel: Default::default(),
        tie_embeddings: None,
        mode: Mode::Train,
        grads: Grads::Free,
        outputs: Default::default(),
        dropout_mask: Default::default(),
        step: StepKind::Steady,
        optimizer_impl: None,
        optimizer_in_backward: false,
        float8: Default::default(),
        torch_version: None,
        attention_mask: false,
        labels: None,
        loss_chunk: None,
        framework: Default::default(),
        cublas_workspace: None,
        cuda_modules: Default::default(),
        gelu: Gelu::Fused,
        kv_cache: false,
        autocast_device: Default::default(),
        kv_heads: None,
        head_dim: None,
        attention_bias: None,
        mlp_bias: false,
        moe: None,
        logit_softcap: false,
        attn_softcap: false,
        lora: None,
        quant: None,
        serve: None,
        model: None,
    }
}

#[allow(clippy::too_many_arguments)]
fn text(
    name: &str,
    arch: Arch,
    layers: u64,
    hidden: u64,
    heads: u64,
    ffn: u64,
    vocab: u64,
    ctx: u64,
) -> Workload {
    let mut w = base(name, arch);
    w.layers = layers;
    w.hidden = hidden;
    w.heads = heads;
    w.ffn = ffn;
    w.vocab = vocab;
    w.max_positions = ctx;
    w.seq = ctx;
    w.dropout = arch != Arch::Llama;
    if arch == Arch::Gpt2 {
        // Hugging Face's GPT-2: activation_function "gelu_new" (the unfused tanh formula) and
        // use_cache true (a KV cache returned even in training).
        w.gelu = Gelu::Unfused;
        w.kv_cache = true;
    }
    if arch == Arch::Llama {
        w.precision = Precision::Mixed;
    }
    w
}

/// A decoder LLM of `arch` (LLaMA-style layers): `kv` key/value heads, bf16, its context `ctx`
/// and a default sequence of at most `LLM_SEQ`.
#[allow(clippy::too_many_arguments)]
fn llm(
    name: &str,
    arch: Arch,
    layers: u64,
    hidden: u64,
    heads: u64,
    kv: u64,
    ffn: u64,
    vocab: u64,
    ctx: u64,
) -> Workload {
    let mut w = base(name, arch);
    w.layers = layers;
    w.hidden = hidden;
    w.heads = heads;
    w.kv_heads = (kv != heads).then_some(kv);
    w.ffn = ffn;
    w.vocab = vocab;
    w.max_positions = ctx;
    w.seq = ctx.min(LLM_SEQ);
    w.precision = Precision::Bf16;
    w
}

fn vit(name: &str, layers: u64, hidden: u64, heads: u64, ffn: u64) -> Workload {
    let mut w = base(name, Arch::Vit);
    w.layers = layers;
    w.hidden = hidden;
    w.heads = heads;
    w.ffn = ffn;
    w.vocab = 1000;
    w.image = 224;
    w.patch = 16;
    w.seq = vit_tokens(224, 16);
    w.max_positions = w.seq;
    w
}

/// Tokens of a ViT: one per patch plus the class token ((224/16)² + 1 = 197).
pub fn vit_tokens(image: u64, patch: u64) -> u64 {
    let side = image.checked_div(patch).unwrap_or(0);
    side.saturating_mul(side).saturating_add(1)
}

fn resnet(name: &str, depth: u64, width: u64, image: u64, classes: u64) -> Workload {
    let mut w = base(name, Arch::Resnet);
    w.layers = depth;
    w.hidden = width;
    w.image = image;
    w.vocab = classes;
    w
}

/// The preset called `name`.
pub fn get(name: &str) -> Result<Workload, UnknownPreset> {
    let w = match name {
        "gpt2" => text(name, Arch::Gpt2, 12, 768, 12, 3072, 50257, 1024),
        "gpt2-medium" => text(name, Arch::Gpt2, 24, 1024, 16, 4096, 50257, 1024),
        "gpt2-large" => text(name, Arch::Gpt2, 36, 1280, 20, 5120, 50257, 1024),
        "gpt2-xl" => text(name, Arch::Gpt2, 48, 1600, 25, 6400, 50257, 1024),
        "bert-base" => text(name, Arch::Bert, 12, 768, 12, 3072, 30522, 512),
        "bert-large" => text(name, Arch::Bert, 24, 1024, 16, 4096, 30522, 512),
        "vit-b16" => vit(name, 12, 768, 12, 3072),
        "vit-l16" => vit(name, 24, 1024, 16, 4096),
        "llama-7b" => text(name, Arch::Llama, 32, 4096, 32, 11008, 32000, 2048),
        "llama-13b" => text(name, Arch::Llama, 40, 5120, 40, 13824, 32000, 2048),
        // Today's LLMs, from their published config.json (tests/fixtures/configs).
        "llama3-8b" => llm(name, Arch::Llama, 32, 4096, 32, 8, 14336, 128256, 8192),
        "mistral-7b" => llm(name, Arch::Mistral, 32, 4096, 32, 8, 14336, 32768, 32768),
        "qwen2.5-7b" => llm(name, Arch::Qwen2, 28, 3584, 28, 4, 18944, 152064, 131072),
        "qwen2.5-0.5b" => {
            let mut w = llm(name, Arch::Qwen2, 24, 896, 14, 2, 4864, 151936, 32768);
            w.tie_embeddings = Some(true);
            w
        }
        "mixtral-8x7b" => {
            let mut w = llm(name, Arch::Mixtral, 32, 4096, 32, 8, 14336, 32000, 32768);
            w.moe = Some(Moe {
                experts: 8,
                top_k: 2,
                expert_ffn: 14336,
                shared_ffn: 0,
            });
            w
        }
        "gemma2-9b" => {
            let mut w = llm(name, Arch::Gemma2, 42, 3584, 16, 8, 14336, 256000, 8192);
            w.head_dim = Some(256);
            w.logit_softcap = true;
            w.attn_softcap = true;
            // transformers' Gemma 2 has no SDPA path (`_supports_sdpa = False`): eager.
            w.attention = Attention::Naive;
            w
        }
        "phi3-mini" => llm(name, Arch::Phi3, 32, 3072, 32, 32, 8192, 32064, 4096),
        "resnet50" => resnet(name, 50, 64, 224, 1000),
        // Small presets for tests: a 2-layer GPT and a 14-layer ResNet at 32 px.
        "tiny-gpt" => text(name, Arch::Gpt2, 2, 64, 4, 256, 512, 64),
        "tiny-cnn" => resnet(name, 14, 8, 32, 10),
        // A bare parameter count (params scenario), fp32 Adam, 1B parameters.
        "dense" => {
            let mut w = base(name, Arch::Dense);
            w.params = Some(1_000_000_000);
            w
        }
        _ => {
            return Err(UnknownPreset {
                name: name.to_string(),
            })
        }
    };
    Ok(w)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_name_resolves() {
        for n in NAMES {
            assert_eq!(get(n).unwrap().name, n);
        }
        let e = get("gpt5").unwrap_err().to_string();
        assert!(e.contains("gpt5") && e.contains("llama-13b"), "{e}");
    }

    #[test]
    fn vit_has_197_tokens() {
        assert_eq!(get("vit-b16").unwrap().seq, 197);
    }
}
