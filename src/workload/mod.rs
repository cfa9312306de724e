//! Workloads: the model and training setup a plan is built from (presets, HF config.json,
//! oomprobe TOML case files, command-line overrides).

pub mod args;
pub mod case;
pub mod config;
pub mod finetune;
pub mod flags;
pub mod hf;
pub mod hub;
pub mod layers;
pub mod overrides;
pub mod parallel;
pub mod presets;
pub mod release;
pub mod serve;
pub mod stored;

use serde::{Deserialize, Serialize};

pub use finetune::{Lora, Quant, QuantKind, Scope, Target};
pub use release::Release;

/// Model family: decides the layer structure a plan builds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Arch {
    /// GPT-2 style decoder: learned positions, GeLU MLP, LayerNorm, dropout, tied head.
    Gpt2,
    /// BERT style encoder: GeLU MLP, LayerNorm, dropout, MLM head.
    Bert,
    /// LLaMA style decoder: SwiGLU MLP, RMSNorm, RoPE, no dropout, untied head, grouped-query
    /// attention where `kv_heads` says so.
    Llama,
    /// Mistral: LLaMA's layer (its sliding window is a mask: no memory change).
    Mistral,
    /// Qwen2 / Qwen2.5: LLaMA's layer with q, k, v biases.
    Qwen2,
    /// Qwen3: LLaMA's layer with RMSNorms over each head's q and k, and its own head width.
    Qwen3,
    /// Gemma: GeGLU MLP, embeddings scaled by √h, tied head, head width 256.
    Gemma,
    /// Gemma 2: Gemma with four norms per layer and tanh soft-capping of scores and logits.
    Gemma2,
    /// Gemma 3 (text): Gemma 2's layer with q/k norms instead of score soft-capping.
    Gemma3,
    /// Phi-3: LLaMA's layer with fused qkv and gate-up projections.
    Phi3,
    /// Mixtral: LLaMA's attention, a sparse mixture of SwiGLU experts.
    Mixtral,
    /// Qwen2-MoE: Qwen2's attention, routed experts plus a gated shared expert.
    Qwen2Moe,
    /// Qwen3-MoE: Qwen3's attention, routed experts.
    Qwen3Moe,
    /// A decoder described by its layers alone (`Workload::model`): DeepSeek, gpt-oss, Llama 4,
    /// Qwen3-Next, Nemotron-H, OLMo 2, Cohere and the other rows of `workload::hf::families`
    /// whose plan family is no older one.
    Decoder,
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
    /// bitsandbytes `AdamW8bit`: two uint8 states with an fp32 absmax per 256 elements;
    /// tensors under 4096 elements keep fp32 state (`optim/optimizer.py:414, 502-529`).
    #[serde(rename = "adamw-8bit")]
    AdamW8bit,
    /// bitsandbytes `PagedAdamW8bit`: the same bytes, in CUDA managed memory (outside PyTorch's
    /// caching allocator, evictable to the host under pressure).
    #[serde(rename = "paged-adamw-8bit")]
    PagedAdamW8bit,
    /// Lion (lion-pytorch, bitsandbytes): one momentum buffer.
    Lion,
    /// transformers' `Adafactor` as its Trainer builds it (`beta1=None`: no first moment):
    /// fp32 row and column second moments for each ≥2-D parameter, a full one for 1-D.
    Adafactor,
    /// transformers' `Adafactor` with `beta1` set (`optim_args="beta1=0.9"`): also an fp32
    /// first moment of every parameter (`exp_avg`).
    #[serde(rename = "adafactor-beta1")]
    AdafactorBeta1,
    /// Inference: weights only.
    None,
}

impl Optimizer {
    /// The value as `--optimizer` spells it.
    pub fn name(self) -> &'static str {
        match self {
            Optimizer::Adam => "adam",
            Optimizer::Sgd => "sgd",
            Optimizer::SgdMomentum => "sgd-momentum",
            Optimizer::AdamW8bit => "adamw-8bit",
            Optimizer::PagedAdamW8bit => "paged-adamw-8bit",
            Optimizer::Lion => "lion",
            Optimizer::Adafactor => "adafactor",
            Optimizer::AdafactorBeta1 => "adafactor-beta1",
            Optimizer::None => "none",
        }
    }
}

/// How attention runs (`--attention`), as transformers' `attn_implementation` names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Attention {
    /// `eager` (`naive` in JSON and on the command line too): q·kᵀ, softmax and probs·v as
    /// separate ops, the [b, a, s, s] probabilities saved for backward; K and V repeated to the
    /// query heads (`repeat_kv`) under grouped-query attention.
    Naive,
    /// `sdpa` (transformers' default): `F.scaled_dot_product_attention`, whose backend PyTorch
    /// picks by device, dtype and shape (`plan::transformer::sdpa_backend`).
    #[default]
    Sdpa,
    /// `flash_attention_2`: the flash-attn kernels (q, k, v, the output and per-row softmax
    /// statistics saved; K and V at the key/value head count).
    Flash,
}

impl Attention {
    /// The name users know it by (`eager` for `Naive`).
    pub fn name(self) -> &'static str {
        match self {
            Attention::Naive => "eager",
            Attention::Sdpa => "sdpa",
            Attention::Flash => "flash",
        }
    }
}

/// A mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Moe {
    /// Routed experts per layer (`num_local_experts`, `num_experts`).
    pub experts: u64,
    /// Experts each token is routed to (`num_experts_per_tok`).
    pub top_k: u64,
    /// Each expert's intermediate width (`moe_intermediate_size`, or `intermediate_size`).
    pub expert_ffn: u64,
    /// A shared expert's width that every token runs through (Qwen2-MoE's
    /// `shared_expert_intermediate_size`), 0 for none.
    #[serde(default)]
    pub shared_ffn: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "mode", content = "k")]
pub enum Checkpoint {
    None,
    Full,
    Sqrt,
    Every(u32),
    /// torchtitan's op-level selective checkpointing (`SelectiveAC`): every layer is
    /// checkpointed, but the outputs of its odd-numbered matmuls and of its attention kernel
    /// are kept from the forward (`plan::transformer::sac`).
    Ops,
}

/// What the step is: a training step (forward, loss, backward, optimizer) or an inference
/// forward under `no_grad`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    #[default]
    Train,
    Inference,
    /// A serving engine's startup (`--mode serve`): weights, one profiling forward at
    /// `max_num_batched_tokens`, then the KV cache in what is left (`crate::serve`).
    Serve,
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
    /// Lightning's automatic optimization: its closure runs the forward, then `zero_grad`, then
    /// the backward, so the last step's gradients live through this step's forward.
    #[serde(rename = "until-backward")]
    UntilBackward,
}

/// What a dropout keeps for its backward.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DropoutMask {
    /// `native_dropout` (CUDA, XPU, ...): a 1-byte bool mask.
    #[default]
    Bool,
    /// The CPU's `at::dropout` (`_dropout_impl` in aten/src/ATen/native/Dropout.cpp): the
    /// noise `empty_like(input).bernoulli_()`, in the input's type.
    Input,
}

impl DropoutMask {
    pub fn is_bool(&self) -> bool {
        *self == DropoutMask::Bool
    }
}

/// Whose model classes and adapters build a decoder LLM's step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Framework {
    /// transformers' model classes, PEFT's LoRA (fp32 adapters over a 16-bit base, each with
    /// its own dropout).
    #[default]
    Transformers,
    /// LitGPT's `GPT` and its LoRA (`validation/litgpt_notes.md`, LitGPT 5895df10 and 0cc02afa):
    /// one fused qkv linear whose value view keeps the whole output saved when every head has
    /// its own key and value; keys and values expanded to every query head when grouped; the
    /// adapters in the model's type, q, k and v under one LoRA module (one dropout, and
    /// `zero_pad`'s `index_copy`, which saves its source, unless all three are adapted).
    Litgpt,
}

impl Framework {
    pub fn is_transformers(&self) -> bool {
        *self == Framework::Transformers
    }
}

/// What the training loop holds of the model's outputs (logits, a kept KV cache) while the
/// backward runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Outputs {
    /// `out = model(**batch); out.loss.backward()`: the outputs live until the step is over
    /// (the loop of Hugging Face's course and of validation/measure.py).
    #[default]
    Kept,
    /// Only the loss leaves the step function (Hugging Face Trainer's `compute_loss`,
    /// Lightning's `training_step` returning `.loss`): the logits go before the backward.
    Dropped,
    /// The loop's variable holds the outputs until the next step's forward returns and rebinds
    /// it (LitGPT: `logits = model(input_ids)`, `validation/published/RESEARCH.md`), and with
    /// them the autograd graph: a steady step begins with the previous one's outputs and
    /// whatever its graph holds outside saved tensors (`Quant::holds_input`) still live.
    Next,
}

impl Outputs {
    pub fn is_kept(&self) -> bool {
        *self == Outputs::Kept
    }
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
    /// transformers' own `AdamW` (`optim="adamw_hf"`, its Trainer's default in the 4.16 era,
    /// removed in 5): a for-loop whose `denom = exp_avg_sq.sqrt().add_(eps)` is its only
    /// temporary, one parameter tensor at a time.
    Transformers,
}

/// torchao's float8 training (`--float8`): each decoder layer's `nn.Linear` a `Float8Linear`
/// (the head left in the compute type, as torchtitan's `filter_fqns = ["output"]`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Float8 {
    #[default]
    Off,
    /// One scale per tensor (`Float8LinearConfig.from_recipe_name("tensorwise")`).
    Tensorwise,
    /// Tensorwise with FSDP2 all-gathering the weights in float8
    /// (`enable_fsdp_float8_all_gather`).
    TensorwiseAllGather,
    /// One scale per row (`"rowwise"`).
    Rowwise,
}

impl Float8 {
    pub fn is_off(&self) -> bool {
        *self == Float8::Off
    }
    pub fn name(self) -> &'static str {
        match self {
            Float8::Off => "off",
            Float8::Tensorwise => "tensorwise",
            Float8::TensorwiseAllGather => "tensorwise-all-gather",
            Float8::Rowwise => "rowwise",
        }
    }
}

/// `CUDA_MODULE_LOADING` (`--cuda-modules`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ModuleLoading {
    /// Kernels loaded at first use: the default of CUDA 12.2+ on Linux (12.3+ everywhere), and
    /// set by PyTorch itself since 1.13 with CUDA 11.7+ (pytorch#86509).
    #[default]
    Lazy,
    /// Every kernel of every library loaded with the context: PyTorch before 1.13, CUDA before
    /// 11.7, or `CUDA_MODULE_LOADING=EAGER`.
    Eager,
}

impl ModuleLoading {
    pub fn is_lazy(&self) -> bool {
        *self == ModuleLoading::Lazy
    }
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
    #[serde(default, skip_serializing_if = "DropoutMask::is_bool")]
    pub dropout_mask: DropoutMask,
    /// ZeRO stage 0..=3 and the data-parallel degree it shards over.
    pub zero: u8,
    pub gpus: u64,
    /// How the job is split over its GPUs (FSDP, DDP, tensor, pipeline, context parallelism)
    /// and which rank's plan is built.
    #[serde(default, skip_serializing_if = "parallel::Parallel::is_single")]
    pub parallel: parallel::Parallel,
    /// Whether the output head shares the token embedding. `None`: the architecture's default
    /// (GPT-2 and BERT tied, LLaMA untied). Set from a config.json's `tie_word_embeddings`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tie_embeddings: Option<bool>,
    #[serde(default)]
    pub mode: Mode,
    #[serde(default)]
    pub grads: Grads,
    #[serde(default, skip_serializing_if = "Outputs::is_kept")]
    pub outputs: Outputs,
    #[serde(default)]
    pub step: StepKind,
    /// None: the precision's default (fused for `mixed`, DeepSpeed's FusedAdam; foreach
    /// otherwise, PyTorch's CUDA default).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub optimizer_impl: Option<OptimizerImpl>,
    /// How the CUDA stack loads its kernels (`CUDA_MODULE_LOADING`): what the process holds
    /// outside PyTorch on a card of the table follows it.
    #[serde(default, skip_serializing_if = "ModuleLoading::is_lazy")]
    pub cuda_modules: ModuleLoading,
    /// torchtune's `optimizer_in_bwd`: one optimizer per parameter, stepped from the
    /// parameter's post-accumulate-grad hook, its gradient freed right after (no gradient
    /// outlives its own update).
    #[serde(default, skip_serializing_if = "is_false")]
    pub optimizer_in_backward: bool,
    /// torchao's float8 training (`convert_to_float8_training`) of the decoder layers' linears.
    #[serde(default, skip_serializing_if = "Float8::is_off")]
    pub float8: Float8,
    /// The PyTorch release whose behaviour the plan follows where it differs from today's
    /// (`--torch-version`). None: the release the plans are measured against (2.x).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub torch_version: Option<Release>,
    /// BERT's eager attention adds an attention mask, in the embeddings' type, to the scores
    /// (`--attention-mask on`): transformers before 5 always did (a mask of ones when the
    /// batch had none), and padded batches do. Under autocast it promotes the scores to fp32.
    #[serde(default, skip_serializing_if = "is_false")]
    pub attention_mask: bool,
    /// BERT with a sequence-classification head (`BertForSequenceClassification`, `--head
    /// seq-cls`): the pooler (the first token's dense and tanh), dropout and a classifier over
    /// this many labels in place of the masked-LM head. None: the model's own head.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub labels: Option<u64>,
    /// LitGPT's chunked head and loss (`--loss-chunk`): the tokens of each logits chunk.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loss_chunk: Option<u64>,
    /// Whose model classes and LoRA build the step (`--framework`).
    #[serde(default, skip_serializing_if = "Framework::is_transformers")]
    pub framework: Framework,
    /// cuBLAS's workspace in bytes (`--cublas-workspace`, `CUBLAS_WORKSPACE_CONFIG`'s total);
    /// None: PyTorch's default for the card (`plan::build::CUBLAS_WORKSPACE`, 32 MiB on
    /// Hopper).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cublas_workspace: Option<u64>,
    #[serde(default)]
    pub gelu: Gelu,
    /// Hugging Face's `use_cache` left on in training: each layer's key and value are kept in
    /// the returned cache.
    #[serde(default)]
    pub kv_cache: bool,
    /// Whose autocast op lists decide per-op types under `amp-*`: CUDA's (what a prediction
    /// uses) or CPU's (what the CPU validation measures).
    #[serde(default, skip_serializing_if = "is_cuda")]
    pub autocast_device: AutocastDevice,
    /// Key/value heads (`num_key_value_heads`: grouped-query attention when fewer than
    /// `heads`, multi-query with 1). None: one per query head.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_heads: Option<u64>,
    /// Each head's width where a config sets it apart from hidden / heads (`head_dim`: Gemma,
    /// Qwen3). None: hidden / heads.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub head_dim: Option<u64>,
    /// Biases on the q, k, v (and o) projections (`attention_bias`). None: the family's
    /// default (Qwen2's q, k, v have them; LLaMA's none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attention_bias: Option<bool>,
    /// Biases on the MLP's projections (`mlp_bias`).
    #[serde(default, skip_serializing_if = "is_false")]
    pub mlp_bias: bool,
    /// A mixture of experts in place of the dense MLP.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub moe: Option<Moe>,
    /// tanh soft-capping of the output logits (Gemma 2's `final_logit_softcapping`).
    #[serde(default, skip_serializing_if = "is_false")]
    pub logit_softcap: bool,
    /// tanh soft-capping of the attention scores (Gemma 2's `attn_logit_softcapping`; eager
    /// attention only).
    #[serde(default, skip_serializing_if = "is_false")]
    pub attn_softcap: bool,
    /// LoRA adapters over a frozen base (`--lora`): only the adapters train.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lora: Option<Lora>,
    /// A quantized frozen base: bitsandbytes' (`--quant`, a config's `quantization_config`) or
    /// a checkpoint's own format (MXFP4, FP8, GPTQ, AWQ; inference and serving only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub quant: Option<Quant>,
    /// The serving engine's settings (`--mode serve`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub serve: Option<serve::Serve>,
    /// The model layer by layer, as its config describes it (a config.json's decoders): the
    /// parameter count, serving's cache per layer and the per-layer MLPs come from it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<Box<layers::ModelSpec>>,
}

fn is_false(b: &bool) -> bool {
    !*b
}

fn is_cuda(d: &AutocastDevice) -> bool {
    *d == AutocastDevice::Cuda
}

impl Workload {
    /// Whether the softmaxes save their input too (`Release::softmax_saves_input`).
    pub fn softmax_saves_input(&self) -> bool {
        self.torch_version.is_some_and(Release::softmax_saves_input)
    }
    /// An inference forward (`--mode inference`, or `--optimizer none`).
    pub fn inference(&self) -> bool {
        matches!(self.mode, Mode::Inference | Mode::Serve) || self.optimizer == Optimizer::None
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
        self.tie_embeddings.unwrap_or(matches!(
            self.arch,
            Arch::Gpt2 | Arch::Bert | Arch::Gemma | Arch::Gemma2 | Arch::Gemma3
        ))
    }
    /// A transformer that reads token sequences (GPT-2, BERT, the LLaMA-style decoders):
    /// `--seq` applies.
    pub fn is_text_transformer(&self) -> bool {
        matches!(self.arch, Arch::Gpt2 | Arch::Bert) || self.is_decoder_llm()
    }
    /// One of the LLaMA-style decoders (RMSNorm, RoPE, gated MLP or experts): LLaMA, Mistral,
    /// Qwen, Gemma, Phi-3, Mixtral and the Qwen MoEs.
    pub fn is_decoder_llm(&self) -> bool {
        matches!(
            self.arch,
            Arch::Llama
                | Arch::Mistral
                | Arch::Qwen2
                | Arch::Qwen3
                | Arch::Gemma
                | Arch::Gemma2
                | Arch::Gemma3
                | Arch::Phi3
                | Arch::Mixtral
                | Arch::Qwen2Moe
                | Arch::Qwen3Moe
                | Arch::Decoder
        )
    }
    /// Key/value heads in effect.
    pub fn kv_heads(&self) -> u64 {
        self.kv_heads.unwrap_or(self.heads)
    }
    /// Each head's width in effect.
    pub fn head_dim(&self) -> u64 {
        self.head_dim
            .unwrap_or_else(|| self.hidden.checked_div(self.heads).unwrap_or(0))
    }
    /// Any transformer stack (text or ViT).
    pub fn is_transformer(&self) -> bool {
        self.is_text_transformer() || self.arch == Arch::Vit
    }
}

/// The device type whose autocast op lists apply.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AutocastDevice {
    /// `AutocastCUDA` (what predictions use).
    #[default]
    Cuda,
    /// `AutocastCPU` (what the CPU validation measures).
    Cpu,
}
