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

/// How a model's numbers are stored (`--precision`). Which framework setting is which:
///
/// | value      | framework setting                                                     |
/// |------------|-----------------------------------------------------------------------|
/// | `fp32`     | plain PyTorch                                                         |
/// | `fp16`     | `model.half()` (every state, gradient and activation in fp16)         |
/// | `bf16`     | `model.bfloat16()`                                                    |
/// | `mixed`    | DeepSpeed `"fp16": {"enabled": true}`, Megatron `--fp16`: fp16 weights and gradients, fp32 master weights and Adam state (16 B/param) |
/// | `amp-fp16` | `torch.autocast("cuda", dtype=torch.float16)` + `GradScaler`: `accelerate --mixed_precision fp16`, Lightning `16-mixed`, HF Trainer `fp16=True` |
/// | `amp-bf16` | `torch.autocast("cuda", dtype=torch.bfloat16)`: `accelerate --mixed_precision bf16`, Lightning `bf16-mixed`, HF Trainer `bf16=True` |
///
/// Under `amp-*` params, gradients and optimizer state stay fp32 and each op's output type
/// follows PyTorch's autocast op lists (`plan::autocast`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    Fp32,
    Fp16,
    Bf16,
    /// 16-bit compute with fp32 master weights (DeepSpeed/Megatron mixed precision).
    Mixed,
    /// torch.autocast with float16 (fp32 params, grads and optimizer state).
    #[serde(rename = "amp-fp16")]
    AmpFp16,
    /// torch.autocast with bfloat16 (fp32 params, grads and optimizer state).
    #[serde(rename = "amp-bf16")]
    AmpBf16,
}

impl Precision {
    /// The value as `--precision` spells it.
    pub fn name(self) -> &'static str {
        match self {
            Precision::Fp32 => "fp32",
            Precision::Fp16 => "fp16",
            Precision::Bf16 => "bf16",
            Precision::Mixed => "mixed",
            Precision::AmpFp16 => "amp-fp16",
            Precision::AmpBf16 => "amp-bf16",
        }
    }
    /// torch.autocast (fp32 states, per-op dtypes).
    pub fn is_autocast(self) -> bool {
        matches!(self, Precision::AmpFp16 | Precision::AmpBf16)
    }
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

/// What the step is: a training step (forward, loss, backward, optimizer) or an inference
/// forward under `no_grad`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    #[default]
    Train,
    Inference,
}

/// What happens to weight gradients between steps.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Grads {
    /// PyTorch's default `zero_grad(set_to_none=True)`: gradients appear during backward and
    /// are freed after the optimizer step.
    #[default]
    Free,
    /// Gradient accumulation (or `set_to_none=False`): gradients exist before the step.
    Keep,
}

/// Which training step: the first (no optimizer state yet: Adam creates it in `step()`) or a
/// steady-state one (optimizer state present throughout).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum StepKind {
    #[default]
    Steady,
    First,
}

/// How the optimizer update is implemented (it decides its temporaries).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum OptimizerImpl {
    /// `torch.optim` with `foreach=True` (PyTorch's default on CUDA): Adam holds a temporary the
    /// size of all parameters (`_foreach_sqrt` of the second moments) during the update.
    Foreach,
    /// Fused kernels (`fused=True`, DeepSpeed's FusedAdam): no temporaries.
    Fused,
    /// The for-loop implementation (`foreach=False`, PyTorch's default on CPU): two temporaries
    /// the size of one parameter tensor at a time.
    ForLoop,
}

/// GELU as the model implements it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Gelu {
    /// One op (`gelu`, `gelu_pytorch_tanh`): saves its input only.
    #[default]
    Fused,
    /// Hugging Face's `gelu_new` tanh formula in separate ops: saves three more [b, s, ffn]
    /// tensors (tanh output, 0.5·x and 1 + tanh).
    Unfused,
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
    #[serde(default)]
    pub mode: Mode,
    #[serde(default)]
    pub grads: Grads,
    #[serde(default)]
    pub step: StepKind,
    /// None: the precision's default (fused for `mixed`, DeepSpeed's FusedAdam; foreach
    /// otherwise, PyTorch's CUDA default).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub optimizer_impl: Option<OptimizerImpl>,
    #[serde(default)]
    pub gelu: Gelu,
    /// Hugging Face's `use_cache` left on in training: each layer's key and value are kept in
    /// the returned cache.
    #[serde(default)]
    pub kv_cache: bool,
    /// Whose autocast op lists decide per-op types under `amp-*`: CUDA's (what a prediction
    /// uses) or CPU's (what the CPU validation measures).
    #[serde(default, skip_serializing_if = "is_cuda")]
    pub autocast_device: crate::plan::autocast::Device,
}

fn is_cuda(d: &crate::plan::autocast::Device) -> bool {
    *d == crate::plan::autocast::Device::Cuda
}

impl Workload {
    /// An inference forward (`--mode inference`, or `--optimizer none`).
    pub fn inference(&self) -> bool {
        self.mode == Mode::Inference || self.optimizer == Optimizer::None
    }
    /// The optimizer implementation in effect.
    pub fn optimizer_impl(&self) -> OptimizerImpl {
        self.optimizer_impl.unwrap_or(match self.precision {
            Precision::Mixed => OptimizerImpl::Fused,
            _ => OptimizerImpl::Foreach,
        })
    }
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
