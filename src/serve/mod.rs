//! Serving capacity: how many KV-cache blocks, tokens and max-length sequences fit on a card,
//! following vLLM's own startup sizing (vllm-project/vllm@e675dda67be278d21c4ec177b2baa8b7a0550920;
//! research with line citations in tests/fixtures/serving/VLLM_SIZING.md).
//!
//! `requested = ceil(total × gpu_memory_utilization)` (`vllm/v1/worker/utils.py:250-270`);
//! `KV = requested − weights − profile peak − Δnon_torch` (`vllm/v1/worker/gpu_worker.py:317-340`,
//! `vllm/utils/mem_utils.py:271-281`); `page = 2 × block_size × kv_heads_per_gpu × head_dim ×
//! dtype bytes` per layer (`vllm/v1/kv_cache_interface.py:79-87`); `blocks = ⌊⌊KV / page⌋ / L⌋`
//! (`vllm/v1/core/kv_cache_utils.py:829-844`); `tokens = blocks × block_size`; `concurrency =
//! blocks / ⌈max_model_len / block_size⌉` (`kv_cache_utils.py:792-810`). The profile peak is the
//! plan of the profiling forward (`gpu_model_runner.py:4713-4776`): weights are its params, the
//! peak above them is what PyTorch's peak counter sees.

pub mod cache;
pub mod engines;
pub mod pool;
pub mod text;

use serde::Serialize;

use crate::plan::build::PlanError;
use crate::plan::{Plan, Role};
use crate::workload::serve::{Engine, KvDtype, Serve};
use crate::workload::{Attention, Checkpoint, Mode, Optimizer, Precision, Workload};

/// The vLLM commit the sizing follows.
pub const VLLM_COMMIT: &str = "e675dda67be278d21c4ec177b2baa8b7a0550920";

const GIB: u64 = 1 << 30;

/// Δnon_torch: non-PyTorch memory that grows during the profiling run (cuBLAS workspaces, kernel
/// images loaded at first launch). vLLM HEAD snapshots after the CUDA context and NCCL exist
/// (`gpu_worker.py:213-234`), so only this growth is charged. Not measurable without CUDA:
/// **modelled** as 0.10 GiB, the value V0 printed for Llama-3-8B on one A100
/// (`vllm_logs.json` `v0-llama3-8b-a100-40gb`; the other TP = 1 prints were 0.35, 0.16 and
/// 0.03 GiB, and V0's counted more than HEAD's: its baseline preceded NCCL init).
pub const NON_TORCH_GROWTH: u64 = GIB / 10;

/// The scheduler limits the profiling forward runs at.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Limits {
    pub max_num_batched_tokens: u64,
    pub max_num_seqs: u64,
    /// Which of them came from vLLM's defaults (not the command line).
    pub batched_tokens_default: bool,
    pub num_seqs_default: bool,
}

/// vLLM's V1 engine defaults for `vllm serve` (the API server, what people run; the `LLM`
/// class's are larger): cards of 70 GiB and more (not A100) 8192 tokens / 1024 sequences,
/// others 2048 / 256; then `max_num_batched_tokens = min(max_num_seqs × max_model_len, ·)` and
/// `max_num_seqs = min(max_num_seqs, max_num_batched_tokens)` (`vllm/engine/arg_utils.py:1831-1850,
/// 1974-2010`). The card is taken as not an A100 (its name is not known from `--memory`).
pub fn resolve_limits(s: &Serve, total: u64) -> Limits {
    let big = total >= 70 * GIB;
    let (dt, ds) = match s.engine {
        // TensorRT-LLM's `max_num_tokens` 8192 and `max_batch_size` 2048 (its profiling run);
        // SGLang's `chunked_prefill_size` 8192 (2048 under 25,000 MiB) bounds its largest
        // forward (it runs no profile before sizing).
        Engine::Trtllm => (8192, 2048),
        Engine::Sglang if total < 25_000 << 20 => (2048, 1024),
        Engine::Sglang => (8192, 1024),
        Engine::Vllm if big => (8192, 1024),
        Engine::Vllm => (2048, 256),
    };
    let mut seqs = s.max_num_seqs.unwrap_or(ds);
    let tokens = match s.max_num_batched_tokens {
        Some(t) => t,
        None => dt.min(seqs.saturating_mul(s.max_model_len)),
    };
    if s.max_num_seqs.is_none() {
        seqs = seqs.min(tokens);
        if s.engine == Engine::Trtllm {
            // TensorRT-LLM's estimation requests are each min(max_num_tokens, max_seq_len − 1)
            // tokens long, as many as cover max_num_tokens (`_get_token_num_for_estimation`).
            let each = tokens.min(s.max_model_len.saturating_sub(1)).max(1);
            seqs = seqs.min(tokens.div_ceil(each));
        }
    }
    Limits {
        max_num_batched_tokens: tokens,
        max_num_seqs: seqs,
        batched_tokens_default: s.max_num_batched_tokens.is_none(),
        num_seqs_default: s.max_num_seqs.is_none(),
    }
}

/// vLLM runs fp32 checkpoints in its preferred 16-bit type (`dtype=auto`,
/// `vllm/config/model.py:1814-1816`): bf16 on CUDA cards that have it.
pub fn serving_precision(p: Precision) -> Precision {
    match p {
        Precision::Fp16 | Precision::Mixed | Precision::AmpFp16 => Precision::Fp16,
        _ => Precision::Bf16,
    }
}

/// The vocabulary rounded up to vLLM's padding of 64 (`DEFAULT_VOCAB_PADDING_SIZE`,
/// `vllm/model_executor/layers/vocab_parallel_embedding.py:28, 75, 243-250`), then split over TP.
pub fn vocab_per_gpu(vocab: u64, tp: u64) -> u64 {
    vocab.div_ceil(64).saturating_mul(64).div_ceil(tp.max(1))
}

/// KV heads per GPU: `max(1, kv_heads // tp)` (`vllm/config/model.py:1156-1167`).
pub fn kv_heads_per_gpu(kv_heads: u64, tp: u64) -> u64 {
    (kv_heads / tp.max(1)).max(1)
}

/// One layer's bytes per block: `2 × block × kv_heads × head_dim × dtype bytes`.
pub fn page_bytes(block: u64, kv_heads: u64, head_dim: u64, dtype_bytes: u64) -> u64 {
    2 * block * kv_heads * head_dim * dtype_bytes
}

/// Blocks in `kv_bytes` of KV cache: `⌊⌊KV / page⌋ / L⌋`, 0 when there is none.
pub fn blocks_in(kv_bytes: i128, page: u64, layers: u64) -> u64 {
    if kv_bytes <= 0 || page == 0 || layers == 0 {
        return 0;
    }
    ((kv_bytes as u128 / page as u128) / layers as u128) as u64
}

/// vLLM's concurrency: `blocks / ⌈max_model_len / block⌉`.
pub fn concurrency(blocks: u64, max_model_len: u64, block: u64) -> f64 {
    blocks as f64 / max_model_len.div_ceil(block).max(1) as f64
}

/// The workload of one GPU's profiling forward: the tensor-parallel shard of the model (heads,
/// KV heads, MLP width and vocabulary split; norms and the residual width whole) over
/// `[1, max_num_batched_tokens]` tokens (vLLM flattens the batch), under no_grad, with flash
/// attention and no KV cache (the profile runs before the cache exists), its head computing
/// `min(tokens, max_num_seqs)` rows and the sampler after it.
pub fn profile_workload(w: &Workload, s: &Serve, limits: Limits) -> Workload {
    let tp = s.tp.max(1);
    let mut p = w.clone();
    p.mode = Mode::Inference;
    p.optimizer = Optimizer::None;
    // The engine sizes its pool from weights and the profile's activations; cuBLAS's
    // workspace is not planned there.
    p.cublas_workspace = Some(0);
    p.precision = serving_precision(w.precision);
    p.batch = 1;
    p.seq = limits.max_num_batched_tokens;
    p.attention = Attention::Flash;
    p.kv_cache = false;
    p.checkpoint = Checkpoint::None;
    p.dropout = false;
    p.zero = 0;
    p.gpus = 1;
    p.parallel = Default::default();
    p.head_dim = Some(w.head_dim());
    p.heads = w.heads / tp;
    p.kv_heads = Some(kv_heads_per_gpu(w.kv_heads(), tp));
    p.ffn = w.ffn.div_ceil(tp);
    if let Some(m) = p.moe.as_mut() {
        m.expert_ffn = m.expert_ffn.div_ceil(tp);
        m.shared_ffn = m.shared_ffn.div_ceil(tp);
    }
    p.vocab = vocab_per_gpu(w.vocab, tp);
    if let Some(m) = p.model.as_mut() {
        m.tp_local(tp, false);
        m.vocab = p.vocab;
    }
    p.serve = Some(Serve {
        max_num_batched_tokens: Some(limits.max_num_batched_tokens),
        max_num_seqs: Some(limits.max_num_seqs),
        ..s.clone()
    });
    p
}

/// Why vLLM would not start.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum Refusal {
    /// `available_memory <= 0`: "No available memory for the cache blocks."
    NoMemory,
    /// One `max_model_len` sequence needs more KV cache than there is
    /// (`kv_cache_utils.py:609-643`).
    TooShort {
        needed_bytes: u64,
        /// vLLM's estimate: the longest length that fits, a multiple of the block size.
        estimated_max_model_len: u64,
    },
}

/// A serving engine's startup sizing on one GPU of `total` bytes.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ServeSizing {
    pub engine: Engine,
    pub vllm_commit: &'static str,
    pub total_bytes: u64,
    pub gpu_memory_utilization: f64,
    /// `ceil(total × utilization)`.
    pub requested_bytes: u64,
    /// The model's weights on one GPU (its TP shard).
    pub weights_bytes: u64,
    /// The profiling forward's peak above the weights (activations, logits, sampler).
    pub profile_peak_bytes: u64,
    /// Δnon_torch (modelled: [`NON_TORCH_GROWTH`]).
    pub non_torch_bytes: u64,
    /// What is left for the KV cache (negative: nothing, vLLM refuses).
    pub kv_bytes: i64,
    pub limits: Limits,
    pub max_model_len: u64,
    pub block_size: u64,
    pub tp: u64,
    pub layers: u64,
    pub kv_heads_per_gpu: u64,
    pub head_dim: u64,
    pub kv_dtype_bytes: u64,
    /// One layer's bytes per block.
    pub page_bytes_per_layer: u64,
    /// KV bytes per token over all layers.
    pub bytes_per_token: u64,
    pub blocks: u64,
    pub tokens: u64,
    pub blocks_per_request: u64,
    pub concurrency: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub refusal: Option<Refusal>,
    /// The smallest utilization at which one `max_model_len` sequence fits (None: not even 1.0).
    pub util_to_fit: Option<f64>,
    /// Additive (issue 44): a request's cache at `max_model_len`, layer kind by layer kind
    /// (vLLM V1's spec per layer), for a model described layer by layer.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cache: Option<cache::CacheSizing>,
    pub notes: Vec<String>,
}

/// Size the KV cache from the parts, as vLLM does once it has measured them.
#[allow(clippy::too_many_arguments)]
pub fn size_from_parts(
    total: u64,
    util: f64,
    weights: u64,
    profile_peak: u64,
    non_torch: u64,
    page: u64,
    layers: u64,
    max_model_len: u64,
    block: u64,
) -> (i64, u64, Option<Refusal>, Option<f64>) {
    let requested = (total as f64 * util).ceil() as u64;
    let kv = requested as i128 - weights as i128 - profile_peak as i128 - non_torch as i128;
    let blocks = blocks_in(kv, page, layers);
    let per_request = max_model_len.div_ceil(block);
    let needed = (layers as u128 * page as u128 * per_request as u128) as u64;
    let refusal = if kv <= 0 {
        Some(Refusal::NoMemory)
    } else if needed as i128 > kv {
        let fit_blocks = blocks_in(kv, page, layers);
        Some(Refusal::TooShort {
            needed_bytes: needed,
            estimated_max_model_len: (fit_blocks * block).min(max_model_len),
        })
    } else {
        None
    };
    let least = weights as f64 + profile_peak as f64 + non_torch as f64 + needed as f64;
    // Three decimals, rounded up (a utilization that is printed must fit).
    let u = (least / total.max(1) as f64 * 1000.0).ceil() / 1000.0;
    (
        kv.clamp(i64::MIN as i128, i64::MAX as i128) as i64,
        blocks,
        refusal,
        (u <= 1.0).then_some(u),
    )
}

/// The profiling forward's plan on one GPU (a serving workload at `total` bytes).
pub fn profile_plan(w: &Workload, total: u64) -> Result<Plan, PlanError> {
    let s = serve_of(w)?;
    let limits = resolve_limits(s, total);
    Plan::for_workload(&profile_workload(w, s, limits))
}

fn serve_of(w: &Workload) -> Result<&Serve, PlanError> {
    w.serve
        .as_ref()
        .ok_or_else(|| PlanError::Invalid("serving sizing needs --mode serve".into()))
}

/// vLLM's startup sizing of `w` (a `--mode serve` workload) on one GPU of `total` bytes, with
/// the profiling forward's plan.
pub fn size(w: &Workload, total: u64) -> Result<(ServeSizing, Plan), PlanError> {
    size_with(w, total, NON_TORCH_GROWTH)
}

/// [`size`] with `non_torch` bytes of Δnon_torch (a probe has none: no PyTorch, no cuBLAS).
pub fn size_with(
    w: &Workload,
    total: u64,
    non_torch: u64,
) -> Result<(ServeSizing, Plan), PlanError> {
    let s = serve_of(w)?;
    let limits = resolve_limits(s, total);
    let pw = profile_workload(w, s, limits);
    let plan = Plan::for_workload(&pw)?;
    let weights = plan.bytes_by_role(Role::Params);
    let profile_peak = plan.peak_bytes().saturating_sub(weights);
    let dtype_bytes = match s.kv_cache_dtype {
        KvDtype::Fp8 => 1,
        KvDtype::Auto => crate::plan::params::compute_dtype(pw.precision).bytes(),
    };
    let kvh = kv_heads_per_gpu(w.kv_heads(), s.tp);
    let d = w.head_dim();
    let page = page_bytes(s.block_size, kvh, d, dtype_bytes);
    let layers = w.layers;
    let mut per_token = page / s.block_size.max(1) * layers;
    let cache = w.model.as_ref().map(|m| {
        cache::sizing(
            m,
            cache::CacheSettings {
                block: s.block_size,
                max_model_len: s.max_model_len,
                max_num_batched_tokens: limits.max_num_batched_tokens,
                dtype: dtype_bytes,
                state_dtype: dtype_bytes,
                tp: s.tp,
            },
        )
    });
    let hybrid = w.model.as_ref().is_some_and(|m| cache::is_hybrid(m));
    if let (true, Some(c)) = (hybrid, &cache) {
        per_token = c.bytes_per_token;
    }
    let util = if s.engine == Engine::Sglang && s.util_default {
        engines::sglang_default_fraction(total, s.tp)
    } else {
        s.gpu_memory_utilization
    };
    let (requested, kv, blocks, tokens, refusal, util_to_fit) = match (s.engine, &cache) {
        (Engine::Vllm, Some(c)) if hybrid => {
            let z = hybrid_sizing(
                total,
                util,
                weights + profile_peak + non_torch,
                c,
                s.block_size,
            );
            (
                (total as f64 * util).ceil() as u64,
                z.0,
                z.1,
                z.1 * s.block_size,
                z.2,
                z.3,
            )
        }
        (Engine::Vllm, _) => {
            let (kv, blocks, refusal, u) = size_from_parts(
                total,
                util,
                weights,
                profile_peak,
                non_torch,
                page,
                layers,
                s.max_model_len,
                s.block_size,
            );
            let requested = (total as f64 * util).ceil() as u64;
            (requested, kv, blocks, blocks * s.block_size, refusal, u)
        }
        (Engine::Sglang, _) => {
            let z = engines::sglang(
                total,
                util,
                weights,
                per_token,
                s.block_size,
                s.max_model_len,
            );
            z.parts()
        }
        (Engine::Trtllm, _) => {
            let rest = weights + profile_peak + non_torch;
            let z = engines::trtllm(total, util, rest, per_token, s.block_size, s.max_model_len);
            z.parts()
        }
    };
    let notes = sizing_notes(
        s,
        &limits,
        total,
        util,
        non_torch,
        profile_peak,
        tokens,
        kvh,
    );
    let sizing = ServeSizing {
        engine: s.engine,
        vllm_commit: VLLM_COMMIT,
        total_bytes: total,
        gpu_memory_utilization: util,
        requested_bytes: requested,
        weights_bytes: weights,
        profile_peak_bytes: profile_peak,
        non_torch_bytes: non_torch,
        kv_bytes: kv,
        limits,
        max_model_len: s.max_model_len,
        block_size: s.block_size,
        tp: s.tp,
        layers,
        kv_heads_per_gpu: kvh,
        head_dim: d,
        kv_dtype_bytes: dtype_bytes,
        page_bytes_per_layer: page,
        bytes_per_token: per_token,
        blocks,
        tokens,
        blocks_per_request: s.max_model_len.div_ceil(s.block_size),
        concurrency: match (&cache, hybrid) {
            (Some(c), true) if kv > 0 => kv as f64 / c.bytes_per_request.max(1) as f64,
            (Some(_), true) => 0.0,
            _ => concurrency(blocks, s.max_model_len, s.block_size),
        },
        cache,
        refusal,
        util_to_fit,
        notes,
    };
    Ok((sizing, plan))
}

/// The notes a sizing prints: what is modelled and what is not, per engine.
#[allow(clippy::too_many_arguments)]
fn sizing_notes(
    s: &Serve,
    limits: &Limits,
    total: u64,
    util: f64,
    non_torch: u64,
    profile_peak: u64,
    tokens: u64,
    kvh: u64,
) -> Vec<String> {
    let mut notes = vec![
        if non_torch == NON_TORCH_GROWTH {
            format!(
                "Δnon_torch {} GiB is modelled (cuBLAS and kernel growth during the profile run; V0 printed 0.03 to 0.35 GiB)",
                text::gib(NON_TORCH_GROWTH as i64)
            )
        } else {
            format!(
                "Δnon_torch {} GiB (PyTorch's cuBLAS and kernel growth has no part in a probe; estimate models {} GiB)",
                text::gib(non_torch as i64),
                text::gib(NON_TORCH_GROWTH as i64)
            )
        },
        "outside total × utilization (not charged by vLLM, but on the card): the CUDA context and NCCL buffers (before the snapshot) and CUDA graphs (captured after the KV cache is allocated, gpu_worker.py:449-451; not modelled: run with --enforce-eager or leave room)".to_string(),
    ];
    if s.engine == Engine::Vllm && (limits.batched_tokens_default || limits.num_seqs_default) {
        notes.push(format!(
            "max_num_batched_tokens {} and max_num_seqs {}: vLLM's `vllm serve` defaults for a card {} 70 GiB (the LLM class uses {}); the profile forward runs at that many tokens",
            limits.max_num_batched_tokens,
            limits.max_num_seqs,
            if total >= 70 * GIB { "of at least" } else { "under" },
            if total >= 70 * GIB { "16384 / 1024" } else { "8192 / 256" },
        ));
    }
    match s.engine {
        Engine::Vllm => {}
        Engine::Sglang => {
            notes.remove(0);
            notes[0] = format!(
                "SGLang: KV = mem_fraction_static {util} x the free memory before the weights (taken as the whole card: the CUDA context and other processes not counted) − weights; no profiling forward: activations, CUDA graphs and the req_to_token pool must fit in the other {:.1}%",
                (1.0 - util) * 100.0
            );
            if s.util_default {
                notes.push(format!(
                    "mem_fraction_static {util}: SGLang 0.5.2's default for a card of this size (server_args.py:452-498; other versions differ, see SGLANG_TRTLLM_SIZING.md)"
                ));
            }
            let reserve = total as f64 * (1.0 - util);
            if profile_peak as f64 > reserve {
                notes.push(format!(
                    "the largest forward ({} tokens) peaks at {} GiB above the weights, more than the {} GiB SGLang leaves outside the pool: it would run out of memory at run time",
                    limits.max_num_batched_tokens,
                    text::gib(profile_peak as i64),
                    text::gib(reserve as i64)
                ));
            }
        }
        Engine::Trtllm => {
            notes.push(format!(
                "the profiling run is modelled as vLLM's forward ({} tokens in {} requests, each request's last token sampled through a top-k/top-p sort); TensorRT-LLM's own sampler may hold less",
                limits.max_num_batched_tokens, limits.max_num_seqs
            ));
            notes[1] = format!(
                "TensorRT-LLM (PyTorch backend): KV = free_gpu_memory_fraction {util} x (total − weights − the profiling run's peak at {} tokens − non-torch); CUDA graphs, NCCL and the CUDA context fall in its non-torch part (only the modelled growth is counted); blocks = ceil(tokens / {}), so the pool may exceed the fraction by one block",
                limits.max_num_batched_tokens, s.block_size
            );
            if tokens < s.max_model_len {
                notes.push(format!(
                    "TensorRT-LLM would not refuse: it shrinks max_seq_len to {} (what the blocks hold)",
                    tokens
                ));
            }
        }
    }
    if s.tp > 1 {
        notes.push(format!(
            "tensor parallel {}: sizes are per GPU (weights sharded, norms replicated, {kvh} KV head(s) per GPU); the sampler is modelled over the GPU's vocabulary shard",
            s.tp
        ));
    }
    notes
}

/// vLLM's sizing of a cache whose layers differ (sliding, chunked, MLA, recurrent state):
/// (KV bytes, blocks of the layers that grow with the length, refusal, utilization to fit).
/// A request needs its bytes per request ([`cache::sizing`]); the blocks are what the pool holds
/// of the growing layers' pages.
fn hybrid_sizing(
    total: u64,
    util: f64,
    rest: u64,
    c: &cache::CacheSizing,
    block: u64,
) -> (i64, u64, Option<Refusal>, Option<f64>) {
    let requested = (total as f64 * util).ceil() as u64;
    let kv = requested as i128 - rest as i128;
    let per_block = c.bytes_per_token.saturating_mul(block).max(1);
    let blocks = if kv > 0 {
        (kv as u128 / per_block as u128) as u64
    } else {
        0
    };
    let needed = c.bytes_per_request;
    let refusal = if kv <= 0 {
        Some(Refusal::NoMemory)
    } else if needed as i128 > kv {
        let fixed = needed.saturating_sub(c.bytes_per_token.saturating_mul(c.max_model_len));
        let room = (kv as u64).saturating_sub(fixed);
        let tokens = room / c.bytes_per_token.max(1) / block * block;
        Some(Refusal::TooShort {
            needed_bytes: needed,
            estimated_max_model_len: tokens.min(c.max_model_len),
        })
    } else {
        None
    };
    let least = rest as f64 + needed as f64;
    let u = (least / total.max(1) as f64 * 1000.0).ceil() / 1000.0;
    (
        kv.clamp(i64::MIN as i128, i64::MAX as i128) as i64,
        blocks,
        refusal,
        (u <= 1.0).then_some(u),
    )
}

/// The same workload with some serving settings changed (diagnose's remedies).
pub fn with(w: &Workload, f: impl FnOnce(&mut Serve)) -> Workload {
    let mut w = w.clone();
    if let Some(s) = w.serve.as_mut() {
        f(s);
    }
    w
}

#[cfg(test)]
mod tests;
