//! SGLang's and TensorRT-LLM's KV-cache sizing beside vLLM's (research with citations:
//! tests/fixtures/serving/SGLANG_TRTLLM_SIZING.md).
//!
//! - SGLang (`profile_max_num_token`, `model_runner.py` of sglang 0.4.3 to 0.5.23, the same
//!   formula throughout): with P the free memory before the weights load, `KV = f × P − weights`
//!   (f = `mem_fraction_static`), no profiling forward; `tokens = ⌊KV / cell⌋` with
//!   `cell = kv_heads_per_rank × head_dim × L × 2 × dtype bytes`, rounded down to whole pages
//!   (`page_size` 1 by default). It refuses only when no token fits ("Not enough memory. Please
//!   try to increase --mem-fraction-static."); longer requests are rejected at run time.
//! - TensorRT-LLM, PyTorch backend (`KvCacheCreator`, `_torch/pyexecutor/_util.py`): a profiling
//!   run at `max_num_tokens` (8192), then `KV = f × (total − weights − peak − non-torch)` with f =
//!   `free_gpu_memory_fraction` (0.9); `tokens = ⌊KV / bytes_per_token⌋`, `blocks = ⌈tokens /
//!   tokens_per_block⌉` (32): the printed count is `blocks × tokens_per_block`, a ceiling. It does
//!   not refuse a `max_seq_len` that does not fit: it shrinks it to what the blocks hold.

use super::Refusal;

const MIB: u64 = 1 << 20;

/// SGLang 0.5.2's default `mem_fraction_static` (`server_args.py:452-498`): the card's memory
/// less a reserve by its size, `round((gpu_mem − reserved) / gpu_mem, 3)`, gpu_mem in MiB:
/// `(2.8 + tp/10) GiB` under 35 GiB, `(9.5 + tp/2) GiB` under 90, `(12 + tp/2) GiB` under 160,
/// 32 GiB above. (0.5.23 sizes the reserve from the chunked prefill and CUDA graphs; 0.4.x
/// used a table by TP size: the research file lists both.)
pub fn sglang_default_fraction(total: u64, tp: u64) -> f64 {
    let mib = (total / MIB) as f64;
    let tp = tp.max(1) as f64;
    let reserved = if mib < 35.0 * 1024.0 {
        (2.8 + tp / 10.0) * 1024.0
    } else if mib < 90.0 * 1024.0 {
        (9.5 + tp / 2.0) * 1024.0
    } else if mib < 160.0 * 1024.0 {
        (12.0 + tp / 2.0) * 1024.0
    } else {
        32.0 * 1024.0
    };
    (((mib - reserved) / mib) * 1000.0).round() / 1000.0
}

/// What an engine's sizing gives: (budget it takes, KV bytes, blocks, tokens, refusal, the
/// fraction at which one `max_model_len` request fits).
pub struct Sized {
    pub requested: u64,
    pub kv: i64,
    pub blocks: u64,
    pub tokens: u64,
    pub refusal: Option<Refusal>,
    pub fraction_to_fit: Option<f64>,
}

/// The parts as `size_with` takes them apart.
type Parts = (u64, i64, u64, u64, Option<Refusal>, Option<f64>);

impl Sized {
    /// (requested, KV bytes, blocks, tokens, refusal, fraction to fit).
    pub fn parts(self) -> Parts {
        (
            self.requested,
            self.kv,
            self.blocks,
            self.tokens,
            self.refusal,
            self.fraction_to_fit,
        )
    }
}

/// SGLang on a card of `total` bytes (P = total: nothing else on the card, the CUDA context
/// not counted), `cell` KV bytes per token over all layers, pages of `page` tokens.
pub fn sglang(total: u64, f: f64, weights: u64, cell: u64, page: u64, max_model_len: u64) -> Sized {
    let requested = (total as f64 * f) as u64;
    let kv = requested as i128 - weights as i128;
    let tokens = if kv > 0 && cell > 0 {
        let t = (kv as u128 / cell as u128) as u64;
        t / page.max(1) * page.max(1)
    } else {
        0
    };
    let least = weights as f64 + (cell as f64 * max_model_len as f64);
    let u = (least / total.max(1) as f64 * 1000.0).ceil() / 1000.0;
    Sized {
        requested,
        kv: kv.clamp(i64::MIN as i128, i64::MAX as i128) as i64,
        blocks: tokens / page.max(1),
        tokens,
        refusal: (tokens == 0).then_some(Refusal::NoMemory),
        fraction_to_fit: (u <= 1.0).then_some(u),
    }
}

/// TensorRT-LLM's PyTorch backend: `f × (total − weights − peak − non_torch)` of KV cache.
pub fn trtllm(
    total: u64,
    f: f64,
    rest: u64,
    bytes_per_token: u64,
    tokens_per_block: u64,
    max_model_len: u64,
) -> Sized {
    let free = total as i128 - rest as i128;
    let kv = (free as f64 * f) as i128;
    let tpb = tokens_per_block.max(1);
    let (blocks, tokens) = if kv > 0 && bytes_per_token > 0 {
        let t = (kv as u128 / bytes_per_token as u128) as u64;
        let b = t.div_ceil(tpb);
        (b, b * tpb)
    } else {
        (0, 0)
    };
    // The fraction at which the blocks hold one max_model_len sequence.
    let u = if free > 0 {
        let need = max_model_len.div_ceil(tpb) as f64 * tpb as f64 * bytes_per_token as f64;
        ((need / free as f64) * 1000.0).ceil() / 1000.0
    } else {
        f64::INFINITY
    };
    Sized {
        requested: kv.max(0) as u64,
        kv: kv.clamp(i64::MIN as i128, i64::MAX as i128) as i64,
        blocks,
        tokens,
        refusal: (blocks == 0).then_some(Refusal::NoMemory),
        fraction_to_fit: (u < 1.0).then_some(u),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    #[test]
    fn sglang_default_fraction_follows_server_args() {
        // H100 80 GB (81,559 MiB) TP 1: reserve (12 + 0.5) GiB... under 90 GiB: 9.5 + 0.5.
        let h100 = 81_559 * MIB;
        assert_eq!(sglang_default_fraction(h100, 1), 0.874);
        // RTX 4090 (24 GiB): (2.8 + 0.1) GiB reserved.
        assert_eq!(sglang_default_fraction(24 * GIB, 1), 0.879);
        // H200 (141 GiB): (12 + 0.5) GiB.
        assert_eq!(sglang_default_fraction(143_771 * MIB, 1), 0.911);
    }

    #[test]
    fn sglang_tokens_are_the_fraction_less_the_weights_over_the_cell() {
        // Llama-3.1-8B bf16 on 80 GiB at 0.9: 72 GiB − 14.96 GiB over 128 KiB per token.
        let weights = 16_060_522_496;
        let z = sglang(80 * GIB, 0.9, weights, 131_072, 1, 131_072);
        let expect = ((80 * GIB) as f64 * 0.9) as u64 - weights;
        assert_eq!(z.tokens, expect / 131_072);
        assert!(z.refusal.is_none());
        // Nothing left: SGLang's refusal.
        let z = sglang(16 * GIB, 0.9, weights, 131_072, 1, 8192);
        assert_eq!(z.tokens, 0);
        assert_eq!(z.refusal, Some(Refusal::NoMemory));
    }

    fn gib(x: f64) -> u64 {
        (x * GIB as f64) as u64
    }

    #[test]
    fn published_sglang_logs_reproduce() {
        // S2: Llama-3.1-8B-Instruct on an H100, TP 1, f 0.88 (SGLang's docs notebook): avail
        // mem 78.81 GiB before the weights, 63.72 after; 128 KiB per token. Printed #tokens
        // 444,500; the rounding of the printed GiB allows ±46.
        let z = sglang(gib(78.81), 0.88, gib(78.81 - 63.72), 131_072, 1, 8192);
        assert!(z.tokens.abs_diff(444_500) <= 46, "{}", z.tokens);
        // S1: QwQ-32B on 4 × L4, TP 4, f 0.85: 21.63 GiB before, 6.09 after; 2 KV heads
        // per rank x 128 x 64 layers x 2 x 2 B = 65,536 B per token. Printed 46,611 (±94).
        let z = sglang(gib(21.63), 0.85, gib(21.63 - 6.09), 65_536, 1, 8192);
        assert!(z.tokens.abs_diff(46_611) <= 94, "{}", z.tokens);
    }

    #[test]
    fn published_trtllm_logs_reproduce() {
        // T1 (TensorRT-LLM's docs, memory.md): 70.48 GiB available, 0.9, 262,144 B per token,
        // 64 tokens per block: 4,060 blocks, 259,840 tokens (a floor would give 4,059).
        let z = trtllm(gib(70.48), 0.9, 0, 262_144, 64, 4096);
        assert_eq!((z.blocks, z.tokens), (4_060, 259_840));
        // T4 (DGX Spark, gpt-oss-120b, 1.1.0rc3): (119.70 − 113.65 + 0.56) GiB x 0.9 at
        // 73,728 B per token; printed 86,711 tokens -> 86,720 in blocks of 32 (±131 rounding).
        let z = trtllm(gib(119.70 - 113.65 + 0.56), 0.9, 0, 73_728, 32, 131_072);
        assert!(z.tokens.abs_diff(86_720) <= 160, "{}", z.tokens);
        assert_eq!(z.tokens % 32, 0);
    }

    #[test]
    fn trtllm_blocks_are_a_ceiling() {
        // 10 GiB free after the profile, 0.9 of it, 128 KiB per token, 32 per block.
        let z = trtllm(20 * GIB, 0.9, 10 * GIB, 131_072, 32, 8192);
        let tokens = (((10 * GIB) as f64 * 0.9) as u64) / 131_072;
        assert_eq!(z.blocks, tokens.div_ceil(32));
        assert_eq!(z.tokens, z.blocks * 32);
        assert!(z.tokens >= tokens);
    }
}
