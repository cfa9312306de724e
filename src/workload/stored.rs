//! Weights as a quantized checkpoint ships them (a config's `quantization_config`: MXFP4,
//! block-wise FP8, GPTQ, AWQ): which linears of each layer the method stores quantized, and the
//! bytes of those tensors; everything else (norms, biases, routers, embeddings, head) stays in
//! the config's dtype. Parameter counts do not change: they count the unquantized elements.
//! Also the bytes of bitsandbytes' layouts, which a 16-bit base is quantized to on load
//! (`quantized_bytes`: QLoRA's nf4, fp4, LLM.int8()).
//!
//! Layouts, per `[out, in]` weight:
//! - MXFP4 (transformers `integrations/mxfp4.py`, `Mxfp4GptOssExperts.__init__` at 93a1c40):
//!   `*_blocks` uint8 `[out, in/32, 16]` (two 4-bit values a byte) and `*_scales` uint8
//!   `[out, in/32]` (one e8m0 exponent per 32 inputs); gpt-oss's checkpoint holds exactly these
//!   (`gate_up_proj_blocks` `[E, 2F, H/32, 16]` U8, `_scales` `[E, 2F, H/32]` U8, biases BF16).
//! - FP8 (transformers `integrations/finegrained_fp8.py`, `FP8Linear`): float8_e4m3fn `[out,
//!   in]` and fp32 `weight_scale_inv` `[ceil(out/bn), ceil(in/bk)]`; DeepSeek-V3's checkpoint:
//!   `q_a_proj.weight` (1536, 7168) F8_E4M3 with `weight_scale_inv` (12, 56) F32,
//!   `kv_a_proj_with_mqa` (576, 7168) with (5, 56). Without `weight_block_size` (vLLM's
//!   per-tensor fp8) one fp32 scale per weight.
//! - GPTQ (AutoGPTQ / optimum `QuantLinear`): `qweight` int32 `[in·bits/32, out]`, `qzeros`
//!   int32 `[G, out·bits/32]`, `scales` fp16 `[G, out]`, `g_idx` int32 `[in]`, G = ceil(in /
//!   group_size) (one group when `group_size` is -1).
//! - AWQ GEMM (AutoAWQ `WQLinear_GEMM`): `qweight` int32 `[in, out·bits/32]`, `qzeros` int32
//!   `[G, out·bits/32]`, `scales` fp16 `[G, out]`.

use super::finetune::{Quant, QuantKind, Scope};
use super::layers::{LayerSpec, Mixer, MlpSpec, NormKind};

/// Bytes of one `[out, in]` weight stored as `kind` (a checkpoint format; bitsandbytes' are in
/// `quantized_bytes`). Biases are not included.
pub fn weight_bytes(kind: QuantKind, out: u64, inp: u64) -> u64 {
    let n = out.saturating_mul(inp);
    match kind {
        QuantKind::Mxfp4 { .. } => {
            let blocks = out.saturating_mul(inp.div_ceil(32));
            blocks.saturating_mul(17)
        }
        QuantKind::Fp8 {
            block: Some([bn, bk]),
            ..
        } => {
            let scales = out
                .div_ceil(bn.max(1))
                .saturating_mul(inp.div_ceil(bk.max(1)));
            n.saturating_add(scales.saturating_mul(4))
        }
        QuantKind::Fp8 { block: None, .. } => n.saturating_add(4),
        QuantKind::Gptq { bits, group, .. } => {
            let g = groups(inp, group);
            packed(inp, bits, out)
                .saturating_add(zeros_scales(g, out, bits))
                .saturating_add(inp.saturating_mul(4))
        }
        QuantKind::Awq { bits, group, .. } => {
            packed(out, bits, inp).saturating_add(zeros_scales(groups(inp, group), out, bits))
        }
        // bitsandbytes: counted by quantized_bytes.
        _ => n.saturating_mul(2),
    }
}

/// Groups along the input: ceil(in / group), one without a group size.
fn groups(inp: u64, group: Option<u64>) -> u64 {
    group.map_or(1, |g| inp.div_ceil(g.max(1)))
}

/// Bytes of an int32 tensor packing `rows` values of `bits` each (32/bits a word) by `cols`.
fn packed(rows: u64, bits: u64, cols: u64) -> u64 {
    rows.saturating_mul(bits)
        .div_ceil(32)
        .saturating_mul(cols)
        .saturating_mul(4)
}

/// GPTQ's and AWQ's int32 `qzeros` `[g, out·bits/32]` and fp16 `scales` `[g, out]`.
fn zeros_scales(g: u64, out: u64, bits: u64) -> u64 {
    packed(out, bits, g).saturating_add(g.saturating_mul(out).saturating_mul(2))
}

/// Where a linear sits in a layer (what `Scope` selects).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Part {
    Mixer,
    Dense,
    Experts,
    Shared,
}

/// `count` linears `[out, in]` of one part.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Lin {
    part: Part,
    out: u64,
    inp: u64,
    count: u64,
}

fn lin(part: Part, out: u64, inp: u64) -> Lin {
    Lin {
        part,
        out,
        inp,
        count: 1,
    }
}

/// The mixer's projection weights (the modules a method's `nn.Linear` swap reaches; convolutions,
/// norms, sinks and biases are not among them).
fn mixer_linears(m: &Mixer, h: u64) -> Vec<Lin> {
    let l = |o, i| lin(Part::Mixer, o, i);
    match *m {
        Mixer::Attention(a) => {
            let q = a.heads * a.head_dim;
            let kv = a.kv_heads * a.head_dim;
            let qp = if a.output_gate { 2 * q } else { q };
            vec![l(qp, h), l(kv, h), l(kv, h), l(h, q)]
        }
        Mixer::Mla(m) => {
            let qk = m.heads * (m.qk_nope_head_dim + m.qk_rope_head_dim);
            let mut v = match m.q_lora_rank {
                Some(r) => vec![l(r, h), l(qk, r)],
                None => vec![l(qk, h)],
            };
            v.push(l(m.kv_lora_rank + m.qk_rope_head_dim, h));
            v.push(l(
                m.heads * (m.qk_nope_head_dim + m.v_head_dim),
                m.kv_lora_rank,
            ));
            v.push(l(h, m.heads * m.v_head_dim));
            if let Some((ih, id)) = m.indexer {
                v.push(l(ih * id, m.q_lora_rank.unwrap_or(h)));
                v.push(l(id, h));
            }
            v
        }
        Mixer::GatedDeltaNet(d) => {
            let key = d.k_heads * d.head_k_dim;
            let value = d.v_heads * d.head_v_dim;
            vec![l(2 * key + 2 * value, h), l(2 * d.v_heads, h), l(h, value)]
        }
        Mixer::Mamba2(m) => {
            let proj = 2 * m.inner() + 2 * m.groups * m.d_state + m.heads;
            vec![l(proj, h), l(h, m.inner())]
        }
        Mixer::None => Vec::new(),
    }
}

/// An MLP of width `f` (gate and up when gated, then down) as `part`, `count` times.
fn mlp_of(part: Part, f: u64, h: u64, gated: bool, count: u64) -> Vec<Lin> {
    let mut v = vec![lin(part, f, h)];
    if gated {
        v.push(lin(part, f, h));
    }
    v.push(lin(part, h, f));
    v.iter_mut().for_each(|l| l.count = count);
    v
}

/// The MLP's projection weights: a dense MLP's, or the routed and shared experts' (the router
/// and the shared expert's sigmoid gate are never quantized).
fn mlp_linears(m: &MlpSpec, h: u64) -> Vec<Lin> {
    match *m {
        MlpSpec::Dense { ffn, gated, .. } => mlp_of(Part::Dense, ffn, h, gated, 1),
        MlpSpec::Moe(e) => {
            let mut v = mlp_of(Part::Experts, e.expert_ffn, h, e.gated, e.experts);
            if e.shared_ffn > 0 {
                v.extend(mlp_of(Part::Shared, e.shared_ffn, h, e.gated, 1));
            }
            v
        }
        MlpSpec::None => Vec::new(),
    }
}

fn selected(s: Scope, p: Part) -> bool {
    match p {
        Part::Mixer => s.mixer,
        Part::Dense => s.dense,
        Part::Experts => s.experts,
        Part::Shared => s.shared,
    }
}

/// Bytes of `elems` parameters of which `lins` (those `q.kind`'s scope selects) are stored quantized,
/// the rest at `rest` bytes each.
fn block_bytes(q: &Quant, elems: u64, lins: &[Lin], rest: u64) -> u64 {
    let mut bytes = 0u64;
    let mut weights = 0u64;
    for l in lins.iter().filter(|l| selected(q.kind.scope(), l.part)) {
        let one = weight_bytes(q.kind, l.out, l.inp);
        bytes = bytes.saturating_add(one.saturating_mul(l.count));
        weights = weights.saturating_add(l.out.saturating_mul(l.inp).saturating_mul(l.count));
    }
    bytes.saturating_add(elems.saturating_sub(weights).saturating_mul(rest))
}

/// The stored bytes of layer `l`'s mixer and MLP (each with its norms) in a model of width `h`
/// with norms `norm`: the linears `q` quantizes in its format, the rest at `rest` bytes each.
pub fn layer_bytes(q: &Quant, l: &LayerSpec, h: u64, norm: NormKind, rest: u64) -> (u64, u64) {
    let p = l.params(h, norm);
    (
        block_bytes(q, p.mixer, &mixer_linears(&l.mixer, h), rest),
        block_bytes(q, p.mlp, &mlp_linears(&l.mlp, h), rest),
    )
}

/// Bytes of one bitsandbytes-quantized `[out, in]` weight with `n = out·in` elements.
///
/// 4-bit (`quantize_4bit`, bitsandbytes 95f9af3 `functional.py:884-987`, `_ops.py:232-235`):
/// the packed `uint8 [(n+1)/2, 1]`, one absmax per 64-element block (fp32; or with double
/// quantization uint8 plus an fp32 absmax per 256 blocks, an fp32 offset and the 256-entry fp32
/// code table copied per weight, `functional.py:677, 939-940`), and the 16-entry fp32 code of
/// the 4-bit type (`get_4bit_type`, `:854`). 8-bit (`Int8Params._quantize`,
/// `nn/modules.py:737-747`): int8 `[out, in]` plus an fp32 scale per output row.
///
/// A checkpoint's own formats: [`weight_bytes`].
pub fn quantized_bytes(kind: QuantKind, double_quant: bool, out: u64, inp: u64) -> u64 {
    let n = out.saturating_mul(inp);
    match kind {
        QuantKind::Int8 => n.saturating_add(out.saturating_mul(4)),
        QuantKind::Nf4 | QuantKind::Fp4 => {
            let blocks = n.div_ceil(64);
            let packed = n.div_ceil(2);
            let code = 16 * 4;
            let stats = if double_quant {
                // uint8 absmax + fp32 offset + fp32 absmax per 256 blocks + the fp32 map.
                blocks + 4 + 4 * blocks.div_ceil(256) + 256 * 4
            } else {
                4 * blocks
            };
            packed.saturating_add(stats).saturating_add(code)
        }
        _ => weight_bytes(kind, out, inp),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantized_layout_follows_bitsandbytes_source() {
        // Measured on this CPU (tests/fixtures/finetune/RESEARCH.md §b): a 256×256 nf4 weight
        // with double quantization is [32768, 1] uint8 + absmax [1024] uint8 + code [16] fp32
        // + offset [] fp32 + state2.absmax [4] fp32 + state2.code [256] fp32.
        assert_eq!(
            quantized_bytes(QuantKind::Nf4, true, 256, 256),
            32768 + 1024 + 64 + 4 + 16 + 1024
        );
        // Without double quantization: fp32 absmax per 64.
        assert_eq!(
            quantized_bytes(QuantKind::Nf4, false, 256, 256),
            32768 + 4096 + 64
        );
        // The 28 linears of the 4-layer measured model (h 256, kv 64, ffn 688): quant state
        // (everything but the packed weights) 74,528 B.
        let shapes = [
            (256, 256),
            (64, 256),
            (64, 256),
            (256, 256),
            (688, 256),
            (688, 256),
            (256, 688),
        ];
        let state: u64 = shapes
            .iter()
            .map(|&(o, i)| quantized_bytes(QuantKind::Nf4, true, o, i) - (o * i).div_ceil(2))
            .sum::<u64>()
            * 4;
        assert_eq!(state, 74_528);
        // LLM.int8(): int8 weight + fp32 row scale.
        assert_eq!(
            quantized_bytes(QuantKind::Int8, false, 4096, 4096),
            4096 * 4096 + 4096 * 4
        );
    }
    use crate::workload::layers::{Attn, BlockForm, Gating, MoeSpec, QkNorm, Window};

    #[test]
    fn formats_follow_the_checkpoint_tensors() {
        // DeepSeek-V3 q_a_proj: (1536, 7168) F8_E4M3 + (12, 56) F32.
        let fp8 = QuantKind::Fp8 {
            block: Some([128, 128]),
            scope: Scope::LINEARS,
        };
        assert_eq!(weight_bytes(fp8, 1536, 7168), 11_010_048 + 2_688);
        // kv_a_proj_with_mqa: 576 rows round up to 5 scale rows.
        assert_eq!(weight_bytes(fp8, 576, 7168), 4_128_768 + 1_120);
        // gpt-oss down_proj of one expert: blocks [2880, 90, 16] + scales [2880, 90].
        assert_eq!(
            weight_bytes(
                QuantKind::Mxfp4 {
                    scope: Scope::EXPERTS
                },
                2880,
                2880
            ),
            2880 * 90 * 16 + 2880 * 90
        );
        // GPTQ 4-bit g128 [3584 → 18944]: qweight [448, 18944] + qzeros [28, 2368] + scales
        // [28, 18944] fp16 + g_idx [3584].
        let gptq = QuantKind::Gptq {
            bits: 4,
            group: Some(128),
            scope: Scope::LINEARS,
        };
        let want = 448 * 18944 * 4 + 28 * 2368 * 4 + 28 * 18944 * 2 + 3584 * 4;
        assert_eq!(weight_bytes(gptq, 18944, 3584), want);
        // AWQ: the same less g_idx (qweight [3584, 2368]).
        let awq = QuantKind::Awq {
            bits: 4,
            group: Some(128),
            scope: Scope::LINEARS,
        };
        assert_eq!(weight_bytes(awq, 18944, 3584), want - 3584 * 4);
        // group_size -1: one group.
        let pc = QuantKind::Gptq {
            bits: 8,
            group: None,
            scope: Scope::LINEARS,
        };
        assert_eq!(
            weight_bytes(pc, 64, 256),
            64 * 256 + 64 * 4 / 4 + 64 * 2 + 256 * 4
        );
    }

    fn moe_layer() -> LayerSpec {
        LayerSpec {
            mixer: Mixer::Attention(Attn {
                heads: 64,
                kv_heads: 8,
                head_dim: 64,
                window: Window::Full,
                qkv_bias: true,
                o_bias: true,
                qk_norm: QkNorm::None,
                sinks: true,
                output_gate: false,
                rotary_fraction: 1.0,
                softcap: false,
                fused_qkv: false,
            }),
            block: BlockForm::PreNorm,
            mlp: MlpSpec::Moe(MoeSpec {
                experts: 32,
                top_k: 4,
                expert_ffn: 2880,
                shared_ffn: 0,
                shared_gate: false,
                router_bias: true,
                expert_bias: true,
                gating: Gating::Softmax,
                gated: true,
                clamped: true,
                all_tokens: false,
            }),
        }
    }

    #[test]
    fn mxfp4_quantizes_only_the_experts() {
        // A gpt-oss-20b layer: attention and router bf16, experts MXFP4 with bf16 biases.
        let l = moe_layer();
        let q = Quant::stored(QuantKind::Mxfp4 {
            scope: Scope::EXPERTS,
        });
        let p = l.params(2880, NormKind::Rms);
        let (mixer, mlp) = layer_bytes(&q, &l, 2880, NormKind::Rms, 2);
        assert_eq!(mixer, 2 * p.mixer);
        let experts = 32 * (5760 + 2880) * 90 * 17;
        let bf16 = (32 * 2880 + 32) + 32 * (5760 + 2880) + 2880;
        assert_eq!(mlp, experts + 2 * bf16);
    }
}
