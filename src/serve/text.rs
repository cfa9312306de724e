//! The serving sizing as text, in vLLM's own log lines where vLLM prints them.

use super::{Refusal, ServeSizing};
use crate::units::fmt_bytes;

/// vLLM's `format_gib`: bytes in GiB rounded to 2 decimals (`vllm/utils/mem_utils.py:23-24`).
pub fn gib(bytes: i64) -> String {
    format!("{:.2}", bytes as f64 / (1u64 << 30) as f64)
}

/// A count with thousands separators, as vLLM prints tokens (`{:,}`).
pub fn thousands(n: u64) -> String {
    let s = n.to_string();
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// The line vLLM would fail with, if it refuses to start.
pub fn refusal_line(z: &ServeSizing) -> Option<String> {
    use crate::workload::serve::Engine;
    match (z.engine, z.refusal.as_ref()?) {
        (Engine::Sglang, _) => {
            return Some(
                "SGLang would not start: Not enough memory. Please try to increase --mem-fraction-static."
                    .into(),
            )
        }
        (Engine::Trtllm, _) => {
            return Some(
                "TensorRT-LLM would not start: not one KV-cache block fits after the weights and the profiling run"
                    .into(),
            )
        }
        (Engine::Vllm, _) => {}
    }
    Some(match z.refusal.as_ref()? {
        Refusal::NoMemory => "vLLM would not start: No available memory for the cache blocks. Try increasing `gpu_memory_utilization` when initializing the engine.".to_string(),
        Refusal::TooShort {
            needed_bytes,
            estimated_max_model_len,
        } => format!(
            "vLLM would not start: to serve at least one request with the model's max seq len ({}), {} GiB KV cache is needed, which is larger than the available KV cache memory ({} GiB). Based on the available memory, the estimated maximum model length is {}.",
            z.max_model_len,
            gib(*needed_bytes as i64),
            gib(z.kv_bytes),
            estimated_max_model_len
        ),
    })
}

/// What it would take to start: the utilization that fits, or that none does.
pub fn fit_line(z: &ServeSizing) -> String {
    use crate::workload::serve::Engine;
    let flag = match z.engine {
        Engine::Vllm => "--gpu-memory-utilization",
        Engine::Sglang => "--mem-fraction-static (oomprobe's --gpu-memory-utilization)",
        Engine::Trtllm => "free_gpu_memory_fraction (oomprobe's --gpu-memory-utilization)",
    };
    match z.util_to_fit {
        Some(u) => format!(
            "one {}-token request fits at {flag} {u:.3} or more",
            z.max_model_len
        ),
        None => format!(
            "one {}-token request does not fit on {} at any utilization",
            z.max_model_len,
            fmt_bytes(z.total_bytes)
        ),
    }
}

/// One line naming the served model.
pub fn model_line(w: &crate::workload::Workload) -> String {
    let psi = crate::plan::build::params_text(w);
    format!(
        "{}: {} layers, hidden {}, {} heads ({} key/value), head width {}, ffn {}, {} vocab, {psi}, {}",
        w.name,
        w.layers,
        w.hidden,
        w.heads,
        w.kv_heads(),
        w.head_dim(),
        w.ffn,
        w.vocab,
        super::serving_precision(w.precision).name()
    )
}

/// The serving block of `estimate --mode serve`.
pub fn text(z: &ServeSizing) -> String {
    use crate::workload::serve::Engine;
    let l = &z.limits;
    let source = match z.engine {
        Engine::Vllm => format!("vllm@{}", &z.vllm_commit[..7]),
        Engine::Sglang => "sglang 0.4.3-0.5.23's profile_max_num_token".into(),
        Engine::Trtllm => "TensorRT-LLM's PyTorch-backend KvCacheCreator".into(),
    };
    let mut t = format!(
        "serving with {} (sizing of {source}), per GPU of {} GiB, tp {}:\n",
        z.engine.name(),
        gib(z.total_bytes as i64),
        z.tp
    );
    t.push_str(&format!(
        "  max_model_len {}, max_num_batched_tokens {}, max_num_seqs {}, block_size {}, KV dtype {} B\n",
        z.max_model_len, l.max_num_batched_tokens, l.max_num_seqs, z.block_size, z.kv_dtype_bytes
    ));
    t.push_str(&match z.engine {
        Engine::Vllm => format!(
            "  requested memory   {:>9} GiB  = ceil({} GiB x {})\n",
            gib(z.requested_bytes as i64),
            gib(z.total_bytes as i64),
            z.gpu_memory_utilization
        ),
        Engine::Sglang => format!(
            "  weights + KV pool  {:>9} GiB  = {} GiB x mem_fraction_static {}\n",
            gib(z.requested_bytes as i64),
            gib(z.total_bytes as i64),
            z.gpu_memory_utilization
        ),
        Engine::Trtllm => format!(
            "  KV budget          {:>9} GiB  = free_gpu_memory_fraction {} x what the profile left\n",
            gib(z.requested_bytes as i64),
            z.gpu_memory_utilization
        ),
    });
    let charged = if z.engine == Engine::Sglang {
        "not charged: SGLang runs no profile"
    } else {
        "charged"
    };
    t.push_str(&format!(
        "  model weights      {:>9} GiB\n  profile peak       {:>9} GiB  (forward at {} tokens, logits and sampler for {} rows; {charged})\n",
        gib(z.weights_bytes as i64),
        gib(z.profile_peak_bytes as i64),
        l.max_num_batched_tokens,
        l.max_num_batched_tokens.min(l.max_num_seqs),
    ));
    if z.engine != Engine::Sglang {
        t.push_str(&format!(
            "  non-torch growth   {:>9} GiB  (modelled)\n",
            gib(z.non_torch_bytes as i64)
        ));
    }
    match z.cache.as_ref().filter(|c| c.parts.iter().any(|p| p.kind != "full")) {
        Some(c) => {
            t.push_str(&format!(
                "  cache per request  {} at {} tokens, layer by layer (vLLM V1's spec per layer):\n",
                fmt_bytes(c.bytes_per_request),
                c.max_model_len
            ));
            for p in &c.parts {
                let what = match p.kind {
                    "mamba" | "gated_deltanet" => "a constant state".to_string(),
                    _ => format!("{} tokens", p.tokens),
                };
                t.push_str(&format!(
                    "    {:<3} {:<15} {} each ({what}), {}\n",
                    p.layers,
                    p.kind,
                    fmt_bytes(p.bytes_per_layer),
                    fmt_bytes(p.bytes)
                ));
            }
        }
        None => t.push_str(&format!(
            "  KV per block       {} per layer = 2 x {} tokens x {} KV heads x {} x {} B; {} per token over {} layers\n",
            fmt_bytes(z.page_bytes_per_layer),
            z.block_size,
            z.kv_heads_per_gpu,
            z.head_dim,
            z.kv_dtype_bytes,
            fmt_bytes(z.bytes_per_token),
            z.layers
        )),
    }
    match z.engine {
        Engine::Vllm => {
            t.push_str(&format!(
                "Available KV cache memory: {} GiB\n",
                gib(z.kv_bytes)
            ));
            t.push_str(&format!("# GPU blocks: {}\n", z.blocks));
            t.push_str(&format!(
                "GPU KV cache size: {} tokens\n",
                thousands(z.tokens)
            ));
            t.push_str(&format!(
                "Maximum concurrency for {} tokens per request: {:.2}x\n",
                thousands(z.max_model_len),
                z.concurrency
            ));
        }
        Engine::Sglang => {
            // model_runner.py: K and V each hold (tokens + page_size) slots.
            let half = (z.tokens + z.block_size) as f64 * (z.bytes_per_token / 2) as f64
                / (1u64 << 30) as f64;
            t.push_str(&format!(
                "KV Cache is allocated. #tokens: {}, K size: {half:.2} GB, V size: {half:.2} GB\nmax_total_num_tokens={}\nMaximum concurrency for {} tokens per request: {:.2}x (oomprobe's: tokens / length)\n",
                z.tokens,
                z.tokens,
                thousands(z.max_model_len),
                z.tokens as f64 / z.max_model_len.max(1) as f64
            ));
        }
        Engine::Trtllm => {
            let bytes = z.tokens as f64 * z.bytes_per_token as f64 / (1u64 << 30) as f64;
            t.push_str(&format!(
                "[MemUsageChange] Allocated {bytes:.2} GiB for max tokens in paged KV cache ({}).\n# blocks: {} of {} tokens\nMaximum concurrency for {} tokens per request: {:.2}x (oomprobe's: blocks / blocks per request)\n",
                z.tokens,
                z.blocks,
                z.block_size,
                thousands(z.max_model_len),
                z.concurrency
            ));
        }
    }
    if let Some(r) = refusal_line(z) {
        t.push_str(&format!("{r}\n{}\n", fit_line(z)));
    }
    for n in &z.notes {
        t.push_str(&format!("note: {n}\n"));
    }
    t
}

/// `diagnose --mode serve`: the verdict and what each remedy gives.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ServeDiagnosis {
    pub schema_version: u32,
    pub workload: crate::workload::Workload,
    /// fits | refuses_to_start
    pub cause: &'static str,
    pub sizing: super::ServeSizing,
    pub remedies: Vec<Remedy>,
}

/// One remedy and what it gives (diagnose's contract: `name`, `effect`).
#[derive(Debug, Clone, serde::Serialize)]
pub struct Remedy {
    pub name: String,
    pub effect: String,
}

/// Diagnose serving workload `w` on a card of `total` bytes.
pub fn diagnose(
    w: &crate::workload::Workload,
    total: u64,
) -> Result<ServeDiagnosis, crate::plan::build::PlanError> {
    use crate::workload::serve::KvDtype;
    let (z, _) = super::size(w, total)?;
    let gives = |v: &super::ServeSizing| match v.refusal {
        None => format!(
            "{} blocks, {} tokens, {:.2}x at {} tokens",
            v.blocks,
            thousands(v.tokens),
            v.concurrency,
            thousands(v.max_model_len)
        ),
        Some(_) => "still refuses to start".into(),
    };
    let mut remedies = Vec::new();
    if let Some(Refusal::TooShort {
        estimated_max_model_len,
        ..
    }) = z.refusal
    {
        if estimated_max_model_len > 0 {
            let (v, _) = super::size(
                &super::with(w, |s| s.max_model_len = estimated_max_model_len),
                total,
            )?;
            remedies.push(Remedy {
                name: format!("--max-model-len {estimated_max_model_len}"),
                effect: gives(&v),
            });
        }
    }
    if z.refusal.is_some() {
        if let Some(u) = z.util_to_fit {
            let (v, _) = super::size(&super::with(w, |s| s.gpu_memory_utilization = u), total)?;
            remedies.push(Remedy {
                name: format!("--gpu-memory-utilization {u:.3}"),
                effect: gives(&v),
            });
        }
    }
    if z.kv_dtype_bytes > 1 {
        let (v, _) = super::size(&super::with(w, |s| s.kv_cache_dtype = KvDtype::Fp8), total)?;
        remedies.push(Remedy {
            name: "--kv-cache-dtype fp8".into(),
            effect: gives(&v),
        });
    }
    let tp = z.tp * 2;
    if w.heads.is_multiple_of(tp) {
        let (v, _) = super::size(&super::with(w, |s| s.tp = tp), total)?;
        remedies.push(Remedy {
            name: format!("--tp {tp}"),
            effect: format!("per GPU: {}", gives(&v)),
        });
    }
    Ok(ServeDiagnosis {
        schema_version: crate::report::SCHEMA_VERSION,
        workload: w.clone(),
        cause: if z.refusal.is_some() {
            "refuses_to_start"
        } else {
            "fits"
        },
        sizing: z,
        remedies,
    })
}

/// The diagnosis as text.
pub fn diagnosis_text(d: &ServeDiagnosis) -> String {
    let z = &d.sizing;
    let mut t = format!("{}\n", model_line(&d.workload));
    match refusal_line(z) {
        Some(r) => t.push_str(&format!("{r}\n{}\n", fit_line(z))),
        None => t.push_str(&format!(
            "fits: {} GiB of KV cache, {} blocks, {} tokens, {:.2}x concurrency at {} tokens\n",
            gib(z.kv_bytes),
            z.blocks,
            thousands(z.tokens),
            z.concurrency,
            thousands(z.max_model_len)
        )),
    }
    t.push_str("remedies:\n");
    for r in &d.remedies {
        t.push_str(&format!("  {:<34} {}\n", r.name, r.effect));
    }
    t
}
