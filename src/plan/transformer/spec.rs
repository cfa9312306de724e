//! What a transformer family's layers are made of: one `Spec` per family, each written in a
//! small file of its own beside this one (`gpt2.rs`, `llama.rs`, ...). The shared layer
//! builders in `plan::transformer` read only the spec, so a new family is one new file and one
//! line in `plan::transformer`'s `spec_of` (which calls each family's file, so this one calls
//! none of them).

use crate::workload::Workload;

/// A normalization layer as the family's code writes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Norm {
    /// `nn.LayerNorm`: its backward saves the input (and per-row mean and rstd, not modelled).
    Layer,
    /// transformers' `LlamaRMSNorm`: `x.to(float32)`, `x * rsqrt(mean(x²) + eps)`, then
    /// `weight * x̂.to(input_dtype)`. Saved: the fp32 input (a copy when the input is 16-bit),
    /// the per-row rsqrt, and x̂ in the input's type (the gain's backward needs it).
    Rms,
    /// Gemma's RMSNorm: `x̂ · (1 + weight.float())` in fp32, then `type_as(x)`: x̂ saved in fp32.
    RmsGemma,
    /// `CohereLayerNorm` (transformers 5.24 `modeling_cohere.py`): in fp32, `x − mean` made
    /// twice (the variance's `pow` and the product each save their own), the per-row rsqrt,
    /// x̂ (the gain's backward); the input itself is not saved. A gain, no bias.
    Centered,
}

/// The MLP block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mlp {
    /// fc1, GELU (`Workload::gelu`), fc2.
    Gelu,
    /// `down(act(gate(x)) * up(x))`: SwiGLU (LLaMA) or GeGLU (Gemma).
    Gated,
    /// A sparse mixture of gated experts (`Workload::moe`).
    Moe,
}

/// What turns the input into the first layer's input.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Embed {
    /// Token (and learned position) embeddings: fp32 rows of the tables.
    Tokens,
    /// BERT: token + position + token-type embeddings, then a LayerNorm.
    TokensNorm,
    /// ViT: a patch convolution, the class token and positions.
    Patches,
}

/// What the last layer's output feeds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Head {
    /// Final norm and a language-model head over every position.
    Lm,
    /// BERT's masked-LM head: dense, GELU, LayerNorm, decoder.
    Mlm,
    /// ViT: final norm and a classifier over the class token.
    Classifier,
    /// BERT's sequence classification (`BertForSequenceClassification`): the pooler's dense
    /// and tanh over the first token, dropout and a classifier over `Workload::labels`.
    Pooled,
}

/// How a model's code runs attention's softmax (Hugging Face transformers 5.24,
/// `eager_attention_forward` of each model), which decides the probabilities' type together with
/// autocast's lists.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SoftmaxCode {
    /// `softmax(..., dtype=torch.float32)` (ViT, LLaMA): fp32 probabilities whatever the input.
    pub fp32: bool,
    /// The scores get `+ attention_mask` first, a mask in the embeddings' type (GPT-2's causal
    /// mask): under autocast that promotes the 16-bit scores to fp32.
    pub mask_promotes: bool,
    /// The probabilities are cast back to the values' type right after the softmax
    /// (`.type(value.dtype)` in GPT-2, `.to(query.dtype)` in ViT and LLaMA); BERT does not, so
    /// under autocast its dropout runs on fp32 probabilities and the matmul casts them.
    pub cast_back: bool,
}

/// One family's layer structure.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Spec {
    pub norm: Norm,
    pub mlp: Mlp,
    pub embed: Embed,
    pub head: Head,
    /// Learned position embeddings of `max(max_positions, seq)` rows (GPT-2, BERT).
    pub learned_positions: bool,
    /// One projection makes q, k and v (GPT-2's `c_attn`, Phi-3's `qkv_proj`): one reader of
    /// the norm's output (under autocast, one cast copy instead of three).
    pub fused_qkv: bool,
    /// One projection makes gate and up (Phi-3's `gate_up_proj`).
    pub fused_gate_up: bool,
    /// Biases on q, k, v.
    pub qkv_bias: bool,
    /// A bias on the output projection.
    pub o_bias: bool,
    /// Biases on the MLP's projections.
    pub mlp_bias: bool,
    /// RMSNorms over each head's q and k before the rotation (Qwen3, Gemma 3).
    pub qk_norm: bool,
    /// Rotary position embeddings: q and k rotated with cos/sin tables [b, s, head_dim] that
    /// the model computes once per forward and every layer's rotation saves.
    pub rope: bool,
    /// A causal decoder (masked scores; SDPA's `is_causal`).
    pub causal: bool,
    pub softmax: SoftmaxCode,
    /// Gemma 2/3: norms after the attention and after the MLP too (four per layer).
    pub sandwich_norms: bool,
    /// Gemma: the embedding output is multiplied by √hidden (a new tensor).
    pub embed_scale: bool,
    /// Post-LN (BERT), built with the pre-LN layer's tensors: the MLP adds its output to the
    /// normed attention output, so under no_grad the residual sum goes once normed.
    pub post_ln: bool,
    /// The model's code keeps what it returns until it returns (transformers 5's `BertModel`
    /// its `embedding_output`, the encoder loop each layer's input, `BertLayer` the
    /// attention's probabilities), as the decoder LLMs' do.
    pub holds_returns: bool,
}

impl Spec {
    /// The layer GPT-2, BERT and ViT share: LayerNorm, separate q, k, v with biases, a GELU
    /// MLP with biases, no rotation, no learned positions; each family sets the rest.
    pub fn layer_norm_family(embed: Embed, head: Head, softmax: SoftmaxCode) -> Spec {
        Spec {
            norm: Norm::Layer,
            mlp: Mlp::Gelu,
            embed,
            head,
            learned_positions: false,
            fused_qkv: false,
            fused_gate_up: false,
            qkv_bias: true,
            o_bias: true,
            mlp_bias: true,
            qk_norm: false,
            rope: false,
            causal: false,
            softmax,
            sandwich_norms: false,
            embed_scale: false,
            post_ln: false,
            holds_returns: false,
        }
    }

    /// The LLaMA layer every decoder family starts from: RMSNorm, RoPE, separate q, k, v
    /// without biases (unless `attention_bias`), a SwiGLU MLP, fp32 softmax cast back.
    pub fn llama(w: &Workload) -> Spec {
        let bias = w.attention_bias.unwrap_or(false);
        Spec {
            norm: Norm::Rms,
            mlp: Mlp::Gated,
            embed: Embed::Tokens,
            head: Head::Lm,
            learned_positions: false,
            fused_qkv: false,
            fused_gate_up: false,
            qkv_bias: bias,
            o_bias: bias,
            mlp_bias: w.mlp_bias,
            qk_norm: false,
            rope: true,
            causal: true,
            softmax: SoftmaxCode {
                fp32: true,
                mask_promotes: false,
                cast_back: true,
            },
            sandwich_norms: false,
            embed_scale: false,
            post_ln: false,
            holds_returns: false,
        }
    }

    /// Parameters of one norm over `width` elements.
    pub fn norm_params(&self, width: u64) -> u64 {
        match self.norm {
            Norm::Layer => 2 * width,
            Norm::Rms | Norm::RmsGemma | Norm::Centered => width,
        }
    }
}
