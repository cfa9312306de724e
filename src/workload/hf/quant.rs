//! A config.json's `quantization_config`: the stored format of the checkpoint's weights
//! (bitsandbytes' frozen base, or MXFP4, block-wise FP8, GPTQ and AWQ as shipped; their bytes
//! in `workload::stored`). Other methods are refused rather than counted at 16 bits.

use serde_json::Value as Json;

use super::super::config::{field_err, ConfigError};
use super::super::{Precision, Quant, QuantKind, Scope};

type Obj = serde_json::Map<String, Json>;

/// The methods read, for the refusal of any other.
const READ: &str = "bitsandbytes, mxfp4, fp8, gptq, awq";

/// The stored format a config's `quantization_config` names (None without one).
pub(super) fn read(path: &str, root: &Obj) -> Result<Option<Quant>, ConfigError> {
    let Some(Json::Object(q)) = root.get("quantization_config") else {
        return Ok(None);
    };
    let field = "quantization_config.quant_method";
    let Some(method) = q.get("quant_method").and_then(Json::as_str) else {
        return Ok(None);
    };
    let skip = skipped(path, q)?;
    let stored =
        |kind: QuantKind| -> Result<Option<Quant>, ConfigError> { Ok(Some(Quant::stored(kind))) };
    match method {
        "bitsandbytes" => bnb(path, q),
        // transformers swaps only the experts (`Mxfp4GptOssExperts`); attention stays 16-bit.
        "mxfp4" => stored(QuantKind::Mxfp4 {
            scope: and(Scope::EXPERTS, skip),
        }),
        "fp8" => stored(fp8(path, q, skip)?),
        "gptq" => stored(QuantKind::Gptq {
            bits: bits(path, q)?,
            group: group(path, q)?,
            scope: skip,
        }),
        "awq" => stored(QuantKind::Awq {
            bits: bits(path, q)?,
            group: group(path, q)?,
            scope: skip,
        }),
        "compressed-tensors" => Err(field_err(
            path,
            field,
            "compressed-tensors checkpoints are not read yet (their config_groups set a format per module): their stored bytes are unknown",
        )),
        other => Err(field_err(
            path,
            field,
            format!("'{other}' is not read ({READ} are): its stored bytes are unknown"),
        )),
    }
}

/// Both scopes.
fn and(a: Scope, b: Scope) -> Scope {
    Scope {
        mixer: a.mixer && b.mixer,
        dense: a.dense && b.dense,
        experts: a.experts && b.experts,
        shared: a.shared && b.shared,
    }
}

/// The linears `modules_to_not_convert` leaves quantized. Each entry is matched by its last
/// module names (after `model.layers.*.`): `self_attn` / `attn` / `linear_attn` / `mixer` keeps
/// the mixer in the config's dtype, `mlp` the whole MLP, `experts` the routed experts,
/// `shared_expert(s)` the shared ones; others (`lm_head`, `embed_tokens`, `gate`, `router`,
/// `e_score_correction_bias`, `visual`) name weights no method here quantizes anyway.
fn skipped(path: &str, q: &Obj) -> Result<Scope, ConfigError> {
    let key = "quantization_config.modules_to_not_convert";
    let mut s = Scope::LINEARS;
    let list = match q.get("modules_to_not_convert") {
        None | Some(Json::Null) => return Ok(s),
        Some(Json::Array(a)) => a,
        Some(x) => return Err(field_err(path, key, format!("expected a list, found {x}"))),
    };
    for m in list {
        let m = m
            .as_str()
            .ok_or_else(|| field_err(path, key, format!("expected module names, found {m}")))?;
        let last = m.trim_end_matches('.').rsplit('.').next().unwrap_or("");
        match last {
            "self_attn" | "attn" | "attention" | "linear_attn" | "mixer" => s.mixer = false,
            "mlp" | "block_sparse_moe" | "feed_forward" => {
                (s.dense, s.experts, s.shared) = (false, false, false)
            }
            "experts" => s.experts = false,
            "shared_expert" | "shared_experts" => s.shared = false,
            _ => {}
        }
    }
    Ok(s)
}

/// A positive integer field of `quantization_config`, if present.
fn uint(path: &str, q: &Obj, key: &str) -> Result<Option<u64>, ConfigError> {
    match q.get(key) {
        None | Some(Json::Null) => Ok(None),
        Some(x) => x.as_u64().filter(|&n| n > 0).map(Some).ok_or_else(|| {
            field_err(
                path,
                &format!("quantization_config.{key}"),
                format!("expected a positive integer, found {x}"),
            )
        }),
    }
}

/// Block-wise FP8 (transformers' `FineGrainedFP8Config`, DeepSeek-V3's `weight_block_size`
/// `[128, 128]`); none: one scale per tensor.
fn fp8(path: &str, q: &Obj, scope: Scope) -> Result<QuantKind, ConfigError> {
    let key = "quantization_config.weight_block_size";
    let block = match q.get("weight_block_size") {
        None | Some(Json::Null) => None,
        Some(Json::Array(a)) if a.len() == 2 => {
            let dims: Vec<u64> = a
                .iter()
                .filter_map(Json::as_u64)
                .filter(|&n| n > 0)
                .collect();
            match dims[..] {
                [r, c] => Some([r, c]),
                _ => return Err(field_err(path, key, "expected two positive integers")),
            }
        }
        Some(x) => {
            return Err(field_err(
                path,
                key,
                format!("expected [rows, cols], found {x}"),
            ))
        }
    };
    Ok(QuantKind::Fp8 { block, scope })
}

/// Weight bits (2, 3, 4 or 8) from `bits` (or AutoAWQ's `w_bit`).
fn bits(path: &str, q: &Obj) -> Result<u64, ConfigError> {
    let b = match uint(path, q, "bits")? {
        Some(b) => Some(b),
        None => uint(path, q, "w_bit")?,
    };
    match b {
        Some(b @ (2 | 3 | 4 | 8)) => Ok(b),
        Some(b) => Err(field_err(
            path,
            "quantization_config.bits",
            format!("{b}-bit weights are not read (2, 3, 4, 8)"),
        )),
        None => Err(field_err(
            path,
            "quantization_config.bits",
            "missing (required)",
        )),
    }
}

/// `group_size` (or AutoAWQ's `q_group_size`); -1 or absent: one group per output column.
fn group(path: &str, q: &Obj) -> Result<Option<u64>, ConfigError> {
    let key = ["group_size", "q_group_size"]
        .into_iter()
        .find(|k| q.get(*k).is_some_and(|v| !v.is_null()));
    let Some(key) = key else { return Ok(None) };
    if q[key].as_i64() == Some(-1) {
        return Ok(None);
    }
    uint(path, q, key)
}

/// A bitsandbytes `quantization_config` (as transformers writes it for `load_in_4bit` /
/// `load_in_8bit` checkpoints): the quantized base it loads. transformers' defaults
/// (`BitsAndBytesConfig`, 5.24 `utils/quantization_config.py:444-478`): quant type fp4, no double
/// quantization, compute fp32.
fn bnb(path: &str, q: &Obj) -> Result<Option<Quant>, ConfigError> {
    let flag = |k: &str| q.get(k).and_then(Json::as_bool).unwrap_or(false);
    let kind = if flag("load_in_4bit") {
        match q
            .get("bnb_4bit_quant_type")
            .and_then(Json::as_str)
            .unwrap_or("fp4")
        {
            "nf4" => QuantKind::Nf4,
            "fp4" => QuantKind::Fp4,
            other => {
                return Err(field_err(
                    path,
                    "quantization_config.bnb_4bit_quant_type",
                    format!("unknown 4-bit type '{other}' (nf4, fp4)"),
                ))
            }
        }
    } else if flag("load_in_8bit") {
        QuantKind::Int8
    } else {
        return Ok(None);
    };
    let compute = match q.get("bnb_4bit_compute_dtype").and_then(Json::as_str) {
        Some("bfloat16") => Some(Precision::Bf16),
        Some("float16") => Some(Precision::Fp16),
        Some("float32") | None => Some(Precision::Fp32),
        Some(other) => {
            return Err(field_err(
                path,
                "quantization_config.bnb_4bit_compute_dtype",
                format!("unsupported dtype '{other}' (float32, float16, bfloat16)"),
            ))
        }
    };
    Ok(Some(Quant {
        kind,
        double_quant: kind.is_4bit() && flag("bnb_4bit_use_double_quant"),
        compute: compute.filter(|_| kind.is_4bit()),
        ..Quant::bnb(kind)
    }))
}
