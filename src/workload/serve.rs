//! The serving engine's settings (`--mode serve`): vLLM's engine arguments, parsed and checked.

use serde::{Deserialize, Serialize};

use clap::Args;

use crate::error::CliError;
use crate::units::parse_count;

use super::{Mode, Workload};

/// `--mode serve`'s engine arguments (vLLM's names; see README "Serving").
#[derive(Debug, Args, Clone, Default, PartialEq, Eq)]
pub struct ServeArgs {
    /// vllm | sglang | trtllm: whose startup sizing is followed (default vllm).
    #[arg(long, value_name = "E", allow_hyphen_values = true)]
    pub engine: Option<String>,
    /// The engine's memory fraction in (0, 1]: vLLM's --gpu-memory-utilization (default 0.9),
    /// SGLang's --mem-fraction-static (default by card size), TensorRT-LLM's
    /// free_gpu_memory_fraction (default 0.9, below 1).
    #[arg(long, value_name = "F", allow_hyphen_values = true)]
    pub gpu_memory_utilization: Option<String>,
    /// Tokens per request (default: the config's max_position_embeddings, rope scaling applied).
    #[arg(long, value_name = "N", allow_hyphen_values = true)]
    pub max_model_len: Option<String>,
    /// Sequences per scheduler step (default: vLLM's API-server default for the card).
    #[arg(long, value_name = "N", allow_hyphen_values = true)]
    pub max_num_seqs: Option<String>,
    /// Tokens per scheduler step, the profiling forward's size (default: vLLM's API-server
    /// default for the card).
    #[arg(long, value_name = "N", allow_hyphen_values = true)]
    pub max_num_batched_tokens: Option<String>,
    /// Tokens per KV block: vLLM's 1 8 16 32 64 128 256 (default 16), SGLang's page_size
    /// (default 1), TensorRT-LLM's tokens_per_block (default 32).
    #[arg(long, value_name = "N", allow_hyphen_values = true)]
    pub block_size: Option<String>,
    /// auto (the model's dtype) | fp8 (1 byte per element).
    #[arg(long, value_name = "D", allow_hyphen_values = true)]
    pub kv_cache_dtype: Option<String>,
    /// Tensor-parallel GPUs: with --mode serve the engine's weights and KV heads split over them;
    /// in training Megatron-style column/row-parallel layers (see --tp-head,
    /// --sequence-parallel). Sizes are per GPU.
    #[arg(long, value_name = "N", allow_hyphen_values = true)]
    pub tp: Option<String>,
}

/// The serving engine whose sizing is followed (`--engine`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Engine {
    #[default]
    Vllm,
    Sglang,
    Trtllm,
}

impl Engine {
    pub fn name(self) -> &'static str {
        match self {
            Engine::Vllm => "vllm",
            Engine::Sglang => "sglang",
            Engine::Trtllm => "trtllm",
        }
    }
}

/// The KV cache's element type (`--kv-cache-dtype`): `auto` is the model's dtype; vLLM stores
/// every fp8 variant as `torch.uint8`, 1 byte (`vllm/utils/torch_utils.py@e675dda:33-45`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum KvDtype {
    #[default]
    Auto,
    Fp8,
}

/// The engine arguments. `None`: the engine's default, which for the scheduler limits depends
/// on the card (resolved by `serve::resolve_limits`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Serve {
    pub engine: Engine,
    /// vLLM's `--gpu-memory-utilization` (0, 1], default 0.9 (`vllm/config/cache.py:50`).
    pub gpu_memory_utilization: f64,
    /// Tokens per request; default the config's derived length (`max_position_embeddings`).
    pub max_model_len: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_num_seqs: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_num_batched_tokens: Option<u64>,
    /// Tokens per KV block, default 16 on CUDA (`vllm/platforms/cuda.py:160-161`).
    pub block_size: u64,
    pub kv_cache_dtype: KvDtype,
    /// Tensor-parallel degree: weights and KV heads split over this many GPUs.
    pub tp: u64,
    /// The fraction was not given: SGLang's default `mem_fraction_static` is sized from the
    /// card (`serve::engines`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub util_default: bool,
}

/// Block sizes vLLM accepts (`vllm/config/cache.py@e675dda:23`).
pub const BLOCK_SIZES: [u64; 7] = [1, 8, 16, 32, 64, 128, 256];

fn usage(flag: &str, msg: impl std::fmt::Display) -> CliError {
    CliError::usage(format!("--{flag}: {msg}"))
}

/// `over`'s serving flags where set, else `base`'s (case files).
pub fn merge(base: &ServeArgs, over: &ServeArgs) -> ServeArgs {
    let pick = |o: &Option<String>, b: &Option<String>| o.clone().or_else(|| b.clone());
    ServeArgs {
        engine: pick(&over.engine, &base.engine),
        gpu_memory_utilization: pick(&over.gpu_memory_utilization, &base.gpu_memory_utilization),
        max_model_len: pick(&over.max_model_len, &base.max_model_len),
        max_num_seqs: pick(&over.max_num_seqs, &base.max_num_seqs),
        max_num_batched_tokens: pick(&over.max_num_batched_tokens, &base.max_num_batched_tokens),
        block_size: pick(&over.block_size, &base.block_size),
        kv_cache_dtype: pick(&over.kv_cache_dtype, &base.kv_cache_dtype),
        tp: pick(&over.tp, &base.tp),
    }
}

/// Whether any serving flag was given.
pub fn any(a: &ServeArgs) -> bool {
    [
        &a.engine,
        &a.gpu_memory_utilization,
        &a.max_model_len,
        &a.max_num_seqs,
        &a.max_num_batched_tokens,
        &a.block_size,
        &a.kv_cache_dtype,
    ]
    .iter()
    .any(|o| o.is_some())
}

/// The longest `max_model_len` vLLM derives from a config: `max_position_embeddings`, times the
/// rope-scaling factor except for the types that already extend it (`su`, `longrope`,
/// `llama3`); YaRN scales `original_max_position_embeddings` (`vllm/config/model.py@e675dda:1950-1990`).
pub fn derived_max_len(max_positions: u64, rope_scaling: Option<&serde_json::Value>) -> u64 {
    let Some(r) = rope_scaling.filter(|r| r.is_object()) else {
        return max_positions;
    };
    let kind = r
        .get("rope_type")
        .or_else(|| r.get("type"))
        .and_then(|t| t.as_str())
        .unwrap_or("");
    if matches!(kind, "su" | "longrope" | "llama3" | "default" | "mrope") {
        return max_positions;
    }
    let factor = r.get("factor").and_then(|f| f.as_f64()).unwrap_or(1.0);
    let base = if kind == "yarn" {
        r.get("original_max_position_embeddings")
            .and_then(|v| v.as_u64())
            .unwrap_or(max_positions)
    } else {
        max_positions
    };
    ((base as f64) * factor.max(1.0)) as u64
}

/// The `rope_scaling` object of a Hugging Face config.json, if `path` is one and it has one
/// (its `text_config`'s for a multimodal config). Every other key is skipped unread, so a
/// config with a million unknown keys costs one pass (issue 35), not a second full tree.
fn rope_scaling_of(path: &std::path::Path) -> Option<serde_json::Value> {
    #[derive(serde::Deserialize)]
    struct Rope {
        #[serde(default)]
        rope_scaling: Option<serde_json::Value>,
        #[serde(default)]
        text_config: Option<Box<Rope>>,
    }
    let text = crate::input::read_text_capped(path, super::config::MAX_CONFIG_BYTES).ok()?;
    let v: Rope = serde_json::from_str(&text).ok()?;
    match v.text_config {
        Some(t) => t.rope_scaling,
        None => v.rope_scaling,
    }
    .filter(|r| !r.is_null())
}

/// Apply `--mode serve`'s flags to `w` (after `--mode` is parsed): serve flags without the
/// mode, bad values and a model that cannot serve are usage errors (exit 2).
pub fn apply(
    w: &mut Workload,
    a: &ServeArgs,
    config: Option<&std::path::Path>,
) -> Result<(), CliError> {
    if w.mode != Mode::Serve {
        if any(a) {
            return Err(CliError::usage(
                "--engine, --gpu-memory-utilization, --max-model-len, --max-num-seqs, --max-num-batched-tokens, --block-size and --kv-cache-dtype go with --mode serve",
            ));
        }
        return Ok(());
    }
    if !w.is_decoder_llm() {
        return Err(usage(
            "mode",
            format!(
                "serve needs a decoder LLM (LLaMA, Mistral, Qwen, Gemma, Phi-3, Mixtral, Qwen-MoE), not {}",
                w.name
            ),
        ));
    }
    let engine = match a.engine.as_deref().map(str::to_ascii_lowercase).as_deref() {
        None | Some("vllm") => Engine::Vllm,
        Some("sglang") => Engine::Sglang,
        Some("trtllm" | "tensorrt-llm") => Engine::Trtllm,
        Some(v) => {
            return Err(usage(
                "engine",
                format!("unknown engine '{v}' (vllm, sglang, trtllm)"),
            ))
        }
    };
    // The fraction flag is each engine's own: vLLM's gpu_memory_utilization, SGLang's
    // mem_fraction_static, TensorRT-LLM's free_gpu_memory_fraction (which must stay below 1).
    let util = match &a.gpu_memory_utilization {
        None => 0.9,
        Some(v) => {
            let u: f64 = v.trim().parse().map_err(|_| {
                usage(
                    "gpu-memory-utilization",
                    format!("expected a number in (0, 1], not '{v}'"),
                )
            })?;
            if !(u > 0.0 && u <= 1.0) {
                return Err(usage(
                    "gpu-memory-utilization",
                    format!("{v} is outside (0, 1] (vLLM validates gt=0, le=1)"),
                ));
            }
            if engine == Engine::Trtllm && u >= 1.0 {
                return Err(usage(
                    "gpu-memory-utilization",
                    "TensorRT-LLM's free_gpu_memory_fraction must be below 1",
                ));
            }
            u
        }
    };
    let derived = derived_max_len(w.max_positions, config.and_then(rope_scaling_of).as_ref());
    let max_model_len = match &a.max_model_len {
        None => derived,
        Some(v) => {
            let n = parse_count(v).map_err(|e| usage("max-model-len", e))?;
            if derived > 0 && n > derived {
                return Err(usage(
                    "max-model-len",
                    format!(
                        "{n} is greater than the derived max_model_len ({derived}, from max_position_embeddings={} and rope scaling); vLLM refuses it unless VLLM_ALLOW_LONG_MAX_MODEL_LEN=1",
                        w.max_positions
                    ),
                ));
            }
            n
        }
    };
    if max_model_len == 0 {
        return Err(usage(
            "max-model-len",
            "the model's context length is unknown: pass --max-model-len N",
        ));
    }
    let opt_count = |flag: &str, v: &Option<String>| -> Result<Option<u64>, CliError> {
        v.as_deref()
            .map(|v| parse_count(v).map_err(|e| usage(flag, e)))
            .transpose()
    };
    let max_num_seqs = opt_count("max-num-seqs", &a.max_num_seqs)?;
    let max_num_batched_tokens = opt_count("max-num-batched-tokens", &a.max_num_batched_tokens)?;
    // SGLang's page_size 1; TensorRT-LLM's tokens_per_block 32 (PyTorch backend); vLLM's 16.
    let block_size = opt_count("block-size", &a.block_size)?.unwrap_or(match engine {
        Engine::Vllm => 16,
        Engine::Sglang => 1,
        Engine::Trtllm => 32,
    });
    if engine == Engine::Vllm && !BLOCK_SIZES.contains(&block_size) {
        return Err(usage(
            "block-size",
            format!("{block_size} is not one of vLLM's block sizes (1, 8, 16, 32, 64, 128, 256)"),
        ));
    }
    let kv_cache_dtype = match a
        .kv_cache_dtype
        .as_deref()
        .map(str::to_ascii_lowercase)
        .as_deref()
    {
        None | Some("auto") => KvDtype::Auto,
        Some("fp8" | "fp8_e4m3" | "fp8_e5m2") => KvDtype::Fp8,
        Some(v) => {
            return Err(usage(
                "kv-cache-dtype",
                format!("unknown value '{v}' (auto, fp8)"),
            ))
        }
    };
    let tp = opt_count("tp", &a.tp)?.unwrap_or(1);
    if !w.heads.is_multiple_of(tp) {
        return Err(usage(
            "tp",
            format!("{tp} does not divide the {} attention heads", w.heads),
        ));
    }
    w.serve = Some(Serve {
        engine,
        gpu_memory_utilization: util,
        max_model_len,
        max_num_seqs,
        max_num_batched_tokens,
        block_size,
        kv_cache_dtype,
        tp,
        util_default: a.gpu_memory_utilization.is_none(),
    });
    Ok(())
}
