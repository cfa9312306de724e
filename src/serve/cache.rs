//! The serving cache per layer, as vLLM V1's KV-cache specs allocate it
//! (vllm-project/vllm@e675dda67be278d21c4ec177b2baa8b7a0550920, `vllm/v1/kv_cache_interface.py`):
//!
//! - `FullAttentionSpec`: `page = 2 × block × kv_heads × head_dim × dtype`; a request of
//!   `max_model_len` tokens holds `⌈len / block⌉` pages (`max_memory_usage_bytes`).
//! - `SlidingWindowSpec`: the window's tokens, `min(window − 1 + max_num_batched_tokens, len)`,
//!   in `⌈· / block⌉ + 1` pages (the extra page: a window that straddles two blocks).
//! - `ChunkedLocalAttentionSpec`: `min(chunk + max_num_batched_tokens, len)` tokens.
//! - `MLAAttentionSpec`: one latent of `kv_lora_rank + qk_rope_head_dim` per token (no factor 2,
//!   one "head"), plus DeepSeek sparse attention's indexer key where there is one.
//! - `MambaSpec`: the recurrent state, one page per request whatever its length (conv state
//!   `(kernel − 1) × conv_dim` in the model's type, SSM or delta-rule state in
//!   `mamba_ssm_cache_dtype`, the model's type by default).
//!
//! A request's bytes are the sum over layers; concurrency is the KV pool over that. vLLM's hybrid
//! allocator pads every group's page to one size and shares blocks between groups: that
//! rounding is not modelled (it moves concurrency by a few percent at most for the families
//! here); the bytes per request and their parts are the closed form the tests hold.

use serde::Serialize;

use crate::workload::layers::{Mixer, ModelSpec, Window};

/// One kind of layer's share of a request's cache.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct CachePart {
    /// full | sliding_window | chunked | mla | mamba | gated_deltanet.
    pub kind: &'static str,
    pub layers: u64,
    /// Tokens each such layer keeps for one `max_model_len` request (0 for a recurrent state).
    pub tokens: u64,
    /// Bytes of one such layer per request.
    pub bytes_per_layer: u64,
    /// Bytes of these layers per request.
    pub bytes: u64,
}

/// A request's cache at `max_model_len`, layer kind by layer kind.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct CacheSizing {
    pub max_model_len: u64,
    pub bytes_per_request: u64,
    /// What one more token costs in the layers whose cache grows with the length.
    pub bytes_per_token: u64,
    pub parts: Vec<CachePart>,
}

/// The engine settings the cache follows.
#[derive(Debug, Clone, Copy)]
pub struct CacheSettings {
    pub block: u64,
    pub max_model_len: u64,
    pub max_num_batched_tokens: u64,
    /// Bytes of a cached element (the model's 16-bit type, or 1 under fp8).
    pub dtype: u64,
    /// Bytes of a recurrent state element.
    pub state_dtype: u64,
    /// Tensor-parallel degree: heads split, at least one key/value head per GPU.
    pub tp: u64,
}

/// A request's cache on one GPU of `tp`.
pub fn sizing(m: &ModelSpec, c: CacheSettings) -> CacheSizing {
    let tp = c.tp.max(1);
    let block = c.block.max(1);
    let pages = |tokens: u64| tokens.div_ceil(block);
    let mut parts: Vec<CachePart> = Vec::new();
    let mut per_token = 0;
    for l in &m.layers {
        let (kind, tokens, bytes) = match l.mixer {
            Mixer::Attention(a) => {
                let kvh = (a.kv_heads / tp).max(1);
                let page = 2 * block * kvh * a.head_dim * c.dtype;
                let (kind, tokens, n) = match a.window {
                    Window::Full => ("full", c.max_model_len, pages(c.max_model_len)),
                    Window::Sliding(w) => {
                        let t =
                            (w.saturating_sub(1) + c.max_num_batched_tokens).min(c.max_model_len);
                        ("sliding_window", t, pages(t) + 1)
                    }
                    Window::Chunked(w) => {
                        let t = (w + c.max_num_batched_tokens).min(c.max_model_len);
                        ("chunked", t, pages(t))
                    }
                };
                if a.window == Window::Full {
                    per_token += page / block;
                }
                (kind, tokens, n * page)
            }
            Mixer::Mla(a) => {
                let width = a.kv_lora_rank + a.qk_rope_head_dim + a.indexer.map_or(0, |(_, d)| d);
                let page = block * width * c.dtype;
                per_token += page / block;
                ("mla", c.max_model_len, pages(c.max_model_len) * page)
            }
            Mixer::Mamba2(_) | Mixer::GatedDeltaNet(_) => {
                let mut s = *l;
                if let Mixer::Mamba2(x) = &mut s.mixer {
                    x.heads = (x.heads / tp).max(1);
                    x.groups = (x.groups / tp).max(1);
                }
                if let Mixer::GatedDeltaNet(d) = &mut s.mixer {
                    d.k_heads = (d.k_heads / tp).max(1);
                    d.v_heads = (d.v_heads / tp).max(1);
                }
                let kind = if matches!(l.mixer, Mixer::Mamba2(_)) {
                    "mamba"
                } else {
                    "gated_deltanet"
                };
                (kind, 0, s.cache_bytes(0, c.dtype, c.state_dtype))
            }
            Mixer::None => continue,
        };
        match parts
            .iter_mut()
            .find(|p| p.kind == kind && p.bytes_per_layer == bytes && p.tokens == tokens)
        {
            Some(p) => {
                p.layers += 1;
                p.bytes += bytes;
            }
            None => parts.push(CachePart {
                kind,
                layers: 1,
                tokens,
                bytes_per_layer: bytes,
                bytes,
            }),
        }
    }
    CacheSizing {
        max_model_len: c.max_model_len,
        bytes_per_request: parts.iter().map(|p| p.bytes).sum(),
        bytes_per_token: per_token,
        parts,
    }
}

/// Whether a model's cache is not the uniform full-attention one (its layers differ, or one
/// is not full softmax attention): serving then sizes it layer by layer.
pub fn is_hybrid(m: &ModelSpec) -> bool {
    m.layers
        .iter()
        .any(|l| !matches!(l.mixer, Mixer::Attention(a) if a.window == Window::Full))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workload::layers::{Attn, BlockForm, LayerSpec, Mla, MlpSpec, NormKind, QkNorm};

    fn attn(window: Window) -> LayerSpec {
        LayerSpec {
            mixer: Mixer::Attention(Attn {
                heads: 8,
                kv_heads: 4,
                head_dim: 256,
                window,
                qkv_bias: false,
                o_bias: false,
                qk_norm: QkNorm::PerHead,
                sinks: false,
                output_gate: false,
                rotary_fraction: 1.0,
                softcap: false,
                fused_qkv: false,
            }),
            block: BlockForm::Sandwich,
            mlp: MlpSpec::Dense {
                ffn: 1024,
                gated: true,
                bias: false,
            },
        }
    }

    fn model(layers: Vec<LayerSpec>) -> ModelSpec {
        ModelSpec {
            logit_scale: false,
            family: "t".into(),
            hidden: 2048,
            vocab: 1000,
            norm: NormKind::Rms,
            tied: true,
            extra_params: 0,
            layers,
            vision: None,
        }
    }

    const SET: CacheSettings = CacheSettings {
        block: 16,
        max_model_len: 32768,
        max_num_batched_tokens: 8192,
        dtype: 2,
        state_dtype: 2,
        tp: 1,
    };

    #[test]
    fn sliding_layers_hold_their_window_in_blocks() {
        // Gemma 3's pattern: five sliding layers (window 1024) to one full.
        let mut layers = vec![attn(Window::Sliding(1024)); 5];
        layers.push(attn(Window::Full));
        let z = sizing(&model(layers), SET);
        let page = 2 * 16 * 4 * 256 * 2;
        let sliding = ((1023 + 8192_u64).div_ceil(16) + 1) * page;
        let full = 32768 / 16 * page;
        assert_eq!(z.bytes_per_request, 5 * sliding + full);
        assert_eq!(z.parts.len(), 2);
        assert_eq!(z.bytes_per_token, page / 16);
        // Below the window the sliding layers hold what full ones would (plus a block).
        let short = sizing(
            &model(vec![attn(Window::Sliding(1024))]),
            CacheSettings {
                max_model_len: 512,
                ..SET
            },
        );
        assert_eq!(short.bytes_per_request, (512 / 16 + 1) * page);
    }

    #[test]
    fn mla_holds_one_latent_per_token() {
        let l = LayerSpec {
            mixer: Mixer::Mla(Mla {
                heads: 128,
                q_lora_rank: Some(1536),
                kv_lora_rank: 512,
                qk_nope_head_dim: 128,
                qk_rope_head_dim: 64,
                v_head_dim: 128,
                bias: false,
                indexer: None,
            }),
            ..attn(Window::Full)
        };
        let z = sizing(&model(vec![l; 61]), SET);
        assert_eq!(z.bytes_per_request, 61 * 32768 * 576 * 2);
        assert_eq!(z.bytes_per_token, 61 * 576 * 2);
    }
}
