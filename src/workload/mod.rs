//! Workloads: the model and training setup a plan is built from (presets, HF config.json,
//! oomprobe TOML case files, command-line overrides).

pub mod config;
pub mod overrides;
pub mod presets;

use serde::{Deserialize, Serialize};

/// Model family: decides the layer structure a plan builds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Arch {
    /// GPT-2 style decoder: learned positions, GeLU MLP, LayerNorm, dropout, tied head.
    Gpt2,
    /// BERT style encoder: GeLU MLP, LayerNorm, dropout, MLM head.
    Bert,
    /// LLaMA style decoder: SwiGLU MLP, RMSNorm, no dropout, untied head.
    Llama,
    /// Vision transformer: patch embedding, class token, GeLU MLP, LayerNorm.
    Vit,
    /// ResNet-50 style bottleneck CNN.
    Resnet,
    /// A bare parameter count (params scenario): model states only, no layers.
    Dense,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    Fp32,
    Fp16,
    Bf16,
    /// 16-bit compute with fp32 master weights (mixed precision).
    Mixed,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Optimizer {
    Adam,
    Sgd,
    SgdMomentum,
    /// Inference: weights only.
    None,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Attention {
    Naive,
    Flash,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "mode", content = "k")]
pub enum Checkpoint {
    None,
    Full,
    Sqrt,
    Every(u32),
}

/// Everything a plan needs to know. Sizes are u64; zero is rejected when parsing.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Workload {
    /// Preset or config name, e.g. "gpt2", "resnet50", "custom".
    pub name: String,
    pub arch: Arch,
    pub batch: u64,
    /// Sequence length (tokens). For ViT it is derived from `image` and `patch`.
    pub seq: u64,
    pub layers: u64,
    pub hidden: u64,
    pub heads: u64,
    pub ffn: u64,
    pub vocab: u64,
    /// Image side in pixels (ViT, ResNet).
    pub image: u64,
    /// Patch side in pixels (ViT).
    pub patch: u64,
    /// Plain parameter count (Dense arch, params scenario); otherwise derived from the shape.
    pub params: Option<u64>,
    /// The preset's context length (a default, not a cap).
    pub max_positions: u64,
    pub precision: Precision,
    pub optimizer: Optimizer,
    pub attention: Attention,
    pub checkpoint: Checkpoint,
    pub dropout: bool,
    /// ZeRO stage 0..=3 and the data-parallel degree it shards over.
    pub zero: u8,
    pub gpus: u64,
    /// Whether the output head shares the token embedding. `None`: the architecture's default
    /// (GPT-2 and BERT tied, LLaMA untied). Set from a config.json's `tie_word_embeddings`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tie_embeddings: Option<bool>,
}

impl Workload {
    /// Whether the output head shares the token embedding (see `tie_embeddings`).
    pub fn tied_head(&self) -> bool {
        self.tie_embeddings
            .unwrap_or(matches!(self.arch, Arch::Gpt2 | Arch::Bert))
    }
    /// A transformer that reads token sequences (GPT-2, BERT, LLaMA): `--seq` applies.
    pub fn is_text_transformer(&self) -> bool {
        matches!(self.arch, Arch::Gpt2 | Arch::Bert | Arch::Llama)
    }
    /// Any transformer stack (text or ViT).
    pub fn is_transformer(&self) -> bool {
        self.is_text_transformer() || self.arch == Arch::Vit
    }
}
