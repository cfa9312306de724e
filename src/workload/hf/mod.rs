//! Read a Hugging Face config.json into a Workload: the model's shape, its layers
//! (`families`: one mapping per `model_type`), its weights' storage and the step's settings.
//!
//! config.json styles (by `model_type`, or GPT-2 by its `n_embd` key):
//! - GPT-2: `n_embd`, `n_layer`, `n_head`, `vocab_size`, `n_positions` (or `n_ctx`), `n_inner`
//!   (null → 4·n_embd), `resid_pdrop` (dropout when > 0).
//! - BERT (`"bert"`): `hidden_size`, `num_hidden_layers`, `num_attention_heads`,
//!   `intermediate_size`, `max_position_embeddings`, `vocab_size`, `hidden_dropout_prob`;
//!   `architectures` naming `BertForSequenceClassification`: the classifier head over
//!   `id2label`'s labels (2 when absent).
//! - The decoder LLMs: each `model_type` is a row of `table::FAMILIES` (field names and the
//!   transformers config class's defaults); the layers come from the fields transformers reads.
//! - ViT (`"vit"`): as BERT plus `image_size`, `patch_size`, `num_channels` (3), classes from
//!   `id2label` (default 1000).
//!
//! Other keys of a config.json are ignored (they carry tokenizer and training settings).
//! Python's `json` writes `Infinity`, `-Infinity` and `NaN` for non-finite floats: they are read.

pub mod families;
mod quant;
mod table;
pub mod vision;

use std::path::Path;

use serde_json::Value as Json;

use super::config::{field_err, ConfigError};
use super::flags::check_limit;
use super::presets::{self, vit_tokens};
use super::{Arch, Workload};

/// The GELU implementation a config's activation name stands for (`default` when absent).
fn gelu_of(
    path: &str,
    key: &str,
    v: Option<&Json>,
    default: &str,
) -> Result<super::Gelu, ConfigError> {
    let name = match v {
        None | Some(Json::Null) => default.to_string(),
        Some(Json::String(s)) => s.clone(),
        Some(x) => {
            return Err(field_err(
                path,
                key,
                format!("expected a string, found {x}"),
            ))
        }
    };
    match name.as_str() {
        // Hugging Face's NewGELUActivation and FastGELUActivation: the tanh formula in ops.
        "gelu_new" | "gelu_fast" => Ok(super::Gelu::Unfused),
        // One op: F.gelu (exact or approximate="tanh"); relu saves as little.
        "gelu" | "gelu_pytorch_tanh" | "relu" => Ok(super::Gelu::Fused),
        other => Err(field_err(
            path,
            key,
            format!("unsupported activation '{other}' (gelu_new, gelu_fast, gelu, gelu_pytorch_tanh, relu)"),
        )),
    }
}

/// Read a Hugging Face config.json. Sizes each within their limit can still overflow the plan
/// together: that check is the caller's (`resolve::load_config`), with [`read`]'s fields.
pub fn load_hf(path: &str, text: &str) -> Result<Workload, ConfigError> {
    read(path, text).map(|(w, _)| w)
}

/// Read a Hugging Face config.json into its workload and the fields that size it
/// (comma-separated), for the caller to name when the sizes overflow the plan together.
pub fn read(path: &str, text: &str) -> Result<(Workload, String), ConfigError> {
    let text = python_json(text);
    let v: Json = serde_json::from_str(&text).map_err(|e| ConfigError::Syntax {
        path: path.to_string(),
        format: "JSON",
        msg: e.to_string(),
    })?;
    let obj = v.as_object().ok_or_else(|| ConfigError::Syntax {
        path: path.into(),
        format: "JSON",
        msg: "expected an object".into(),
    })?;
    let fields = Fields { path, obj };
    let (kind, name) = kind_and_name(path, obj)?;
    let arch = match kind.as_str() {
        "gpt2" => Arch::Gpt2,
        "bert" => Arch::Bert,
        "vit" => Arch::Vit,
        other => return load_llm(path, obj, other, &name),
    };
    let mut w = presets::base(&name, arch);
    match arch {
        Arch::Gpt2 => gpt2_fields(&fields, &mut w)?,
        _ => encoder_fields(&fields, &mut w, arch)?,
    }
    if w.arch != Arch::Vit {
        w.seq = w.max_positions;
    }
    if let Some(a) = attention_of(path, obj)? {
        w.attention = a;
    }
    let heads_key = if arch == Arch::Gpt2 {
        "n_head"
    } else {
        "num_attention_heads"
    };
    if !w.hidden.is_multiple_of(w.heads) {
        return Err(field_err(
            path,
            heads_key,
            format!(
                "{} heads do not divide the hidden size {}",
                w.heads, w.hidden
            ),
        ));
    }
    let fields: Vec<&str> = HF_SIZES
        .iter()
        .map(|(k, _)| *k)
        .filter(|k| obj.get(*k).is_some_and(|v| v.is_u64()))
        .collect();
    Ok((w, fields.join(", ")))
}

/// The config's family (`model_type`, or GPT-2 for a bare `n_embd` config) and the model's name.
fn kind_and_name(
    path: &str,
    obj: &serde_json::Map<String, Json>,
) -> Result<(String, String), ConfigError> {
    let model_type = match obj.get("model_type") {
        None => None,
        Some(Json::String(s)) => Some(s.clone()),
        Some(x) => {
            return Err(field_err(
                path,
                "model_type",
                format!("expected a string, found {x}"),
            ))
        }
    };
    let kind = match model_type.as_deref() {
        Some(t) => t.to_string(),
        None if obj.contains_key("n_embd") => "gpt2".into(),
        None => {
            return Err(field_err(
                path,
                "model_type",
                "missing (required unless the config is GPT-2 style)",
            ))
        }
    };
    // The model's name: `_name_or_path`, else the file's (its folder's for a `config.json`),
    // with control characters escaped: it heads the report, and an escape sequence in a
    // downloaded config must not reach the terminal (issue 48, as error lines are).
    let name = match obj.get("_name_or_path") {
        Some(Json::String(s)) if !s.is_empty() => s.clone(),
        _ => {
            let p = Path::new(path);
            let stem = if p.file_name().is_some_and(|f| f == "config.json") {
                p.parent().and_then(|d| d.file_name())
            } else {
                p.file_stem()
            };
            stem.and_then(|s| s.to_str())
                .filter(|s| !s.is_empty())
                .map_or_else(|| kind.clone(), |s| s.to_string())
        }
    };
    Ok((kind, crate::error::one_line(&name)))
}

/// Whether a dropout probability key leaves dropout on (absent means on).
fn dropout_on(fields: &Fields, key: &str) -> Result<bool, ConfigError> {
    Ok(fields.f(key)?.is_none_or(|p| p > 0.0))
}

/// GPT-2's sizes, dropout, activation and KV cache (`n_embd`, `n_layer`, ...).
fn gpt2_fields(fields: &Fields, w: &mut Workload) -> Result<(), ConfigError> {
    let (path, obj) = (fields.path, fields.obj);
    let get_u = |key: &str| fields.u(key);
    let req_u = |key: &str| fields.req_u(key);
    let dropout = |key: &str| dropout_on(fields, key);
    w.hidden = req_u("n_embd")?;
    w.layers = req_u("n_layer")?;
    w.heads = req_u("n_head")?;
    w.vocab = req_u("vocab_size")?;
    w.max_positions = match get_u("n_positions")? {
        Some(n) => n,
        None => req_u("n_ctx")?,
    };
    w.ffn = match get_u("n_inner")? {
        Some(n) => n,
        None => w
            .hidden
            .checked_mul(4)
            .ok_or_else(|| field_err(path, "n_embd", "too large"))?,
    };
    w.dropout = dropout("resid_pdrop")?;
    w.gelu = gelu_of(
        path,
        "activation_function",
        obj.get("activation_function"),
        "gelu_new",
    )?;
    // GPT2Config's use_cache defaults to true, and transformers keeps it on in training.
    w.kv_cache = match obj.get("use_cache") {
        None | Some(Json::Null) => true,
        Some(Json::Bool(b)) => *b,
        Some(x) => {
            return Err(field_err(
                path,
                "use_cache",
                format!("expected true or false, found {x}"),
            ))
        }
    };
    Ok(())
}

/// BERT's and ViT's sizes, dropout and activation, then BERT's vocabulary or ViT's image.
/// A classifier's labels: `id2label`'s entries (None when the config has none).
fn labels(path: &str, obj: &serde_json::Map<String, Json>) -> Result<Option<u64>, ConfigError> {
    match obj.get("id2label") {
        Some(Json::Object(m)) if !m.is_empty() => check_limit("vocab", m.len() as u64)
            .map(Some)
            .map_err(|e| field_err(path, "id2label", e)),
        _ => Ok(None),
    }
}

fn encoder_fields(fields: &Fields, w: &mut Workload, arch: Arch) -> Result<(), ConfigError> {
    let (path, obj) = (fields.path, fields.obj);
    let get_u = |key: &str| fields.u(key);
    let req_u = |key: &str| fields.req_u(key);
    let dropout = |key: &str| dropout_on(fields, key);
    w.hidden = req_u("hidden_size")?;
    w.layers = req_u("num_hidden_layers")?;
    w.heads = req_u("num_attention_heads")?;
    w.ffn = req_u("intermediate_size")?;
    w.dropout = dropout("hidden_dropout_prob")?;
    w.gelu = gelu_of(path, "hidden_act", obj.get("hidden_act"), "gelu")?;
    match arch {
        Arch::Bert => {
            w.vocab = req_u("vocab_size")?;
            w.max_positions = req_u("max_position_embeddings")?;
            // A fine-tuned classifier's config names its class; its labels are `id2label`'s
            // (transformers' `num_labels`), 2 when absent.
            let seq_cls = obj
                .get("architectures")
                .and_then(Json::as_array)
                .is_some_and(|a| {
                    a.iter()
                        .any(|x| x.as_str() == Some("BertForSequenceClassification"))
                });
            if seq_cls {
                w.labels = Some(labels(path, obj)?.unwrap_or(2));
            }
        }
        Arch::Vit => {
            w.image = req_u("image_size")?;
            w.patch = req_u("patch_size")?;
            if let Some(c) = get_u("num_channels")? {
                if c != 3 {
                    return Err(field_err(
                        path,
                        "num_channels",
                        format!("only 3-channel images are modelled, not {c}"),
                    ));
                }
            }
            if w.image < w.patch {
                return Err(field_err(path, "image_size", "smaller than patch_size"));
            }
            w.vocab = labels(path, obj)?.unwrap_or(1000);
            w.seq = vit_tokens(w.image, w.patch);
            w.max_positions = w.seq;
        }
        _ => {}
    }
    Ok(())
}

/// JSON as Python's `json` writes it: the bare tokens `Infinity`, `-Infinity` and `NaN` (which
/// transformers' `to_json_string` leaves in, e.g. Mamba's `time_step_limit`) become numbers
/// serde reads (±1e308) and null; text inside strings is left alone.
fn python_json(text: &str) -> std::borrow::Cow<'_, str> {
    if !text.contains("Infinity") && !text.contains("NaN") {
        return std::borrow::Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len());
    let (mut in_str, mut esc) = (false, false);
    let mut rest = text;
    while let Some(ch) = rest.chars().next() {
        if in_str {
            out.push(ch);
            if esc {
                esc = false;
            } else if ch == '\\' {
                esc = true;
            } else if ch == '"' {
                in_str = false;
            }
            rest = &rest[ch.len_utf8()..];
            continue;
        }
        let swap = [
            ("-Infinity", "-1e308"),
            ("Infinity", "1e308"),
            ("NaN", "null"),
        ]
        .into_iter()
        .find(|(k, _)| rest.starts_with(k));
        if let Some((k, v)) = swap {
            out.push_str(v);
            rest = &rest[k.len()..];
            continue;
        }
        if ch == '"' {
            in_str = true;
        }
        out.push(ch);
        rest = &rest[ch.len_utf8()..];
    }
    std::borrow::Cow::Owned(out)
}

/// Every `model_type` a config.json may have: GPT-2, BERT, ViT and each family's types.
pub fn model_types() -> Vec<&'static str> {
    let mut v = vec!["gpt2", "bert", "vit"];
    v.extend(table::FAMILIES.iter().flat_map(|f| f.types.iter().copied()));
    v
}

/// Why a `model_type` is refused: what transformers' model of that name needs that is not
/// modelled, or that it is unknown. Never another family's name: a look-alike plans the wrong
/// model without a word.
fn refusal(t: &str) -> String {
    if let Some((_, why)) = table::NOT_MODELLED.iter().find(|(k, _)| *k == t) {
        return format!("model_type '{t}' is not modelled yet: it needs {why}");
    }
    format!(
        "unsupported model_type '{t}': oomprobe models the layers of {} families ({}); a family whose layers it cannot read is refused rather than planned as another",
        table::FAMILIES.len() + 3,
        model_types().join(", ")
    )
}

/// Typed reads of a config.json object's fields; each error names the field and the file.
struct Fields<'a> {
    path: &'a str,
    obj: &'a serde_json::Map<String, Json>,
}

impl Fields<'_> {
    /// A positive integer within its size's limit, or None when absent or null.
    fn u(&self, key: &str) -> Result<Option<u64>, ConfigError> {
        let path = self.path;
        match self.obj.get(key) {
            None | Some(Json::Null) => Ok(None),
            Some(x) => match x.as_u64() {
                Some(0) => Err(field_err(path, key, "must be greater than zero")),
                Some(n) => hf_size(key)
                    .map_or(Ok(n), |size| check_limit(size, n))
                    .map(Some)
                    .map_err(|e| field_err(path, key, e)),
                None => Err(field_err(
                    path,
                    key,
                    format!("expected a positive integer, found {x}"),
                )),
            },
        }
    }
    fn req_u(&self, key: &str) -> Result<u64, ConfigError> {
        self.u(key)?
            .ok_or_else(|| field_err(self.path, key, "missing (required)"))
    }
    fn f(&self, key: &str) -> Result<Option<f64>, ConfigError> {
        match self.obj.get(key) {
            None | Some(Json::Null) => Ok(None),
            Some(x) => x
                .as_f64()
                .map(Some)
                .ok_or_else(|| field_err(self.path, key, format!("expected a number, found {x}"))),
        }
    }
}

/// Read a decoder LLM's config.json (see the module doc).
fn load_llm(
    path: &str,
    root: &serde_json::Map<String, Json>,
    model_type: &str,
    name: &str,
) -> Result<(Workload, String), ConfigError> {
    // A multimodal wrapper keeps its language model in `text_config` (its own `model_type`, or
    // the wrapper's text type when the file leaves it to transformers) and a vision tower in
    // `vision_config`.
    let (obj, text_type) = match root.get("text_config") {
        Some(Json::Object(t)) => {
            let own = t.get("model_type").and_then(Json::as_str);
            (t, own.unwrap_or_else(|| wrapper_text_type(model_type)))
        }
        _ => (root, model_type),
    };
    let fam = table::family(text_type)
        .or_else(|| table::family(model_type))
        .ok_or_else(|| field_err(path, "model_type", refusal(text_type)))?;
    let c = families::Cfg { path, obj, fam };
    if let Some(Json::Number(n)) = fam.mlp.moe.and_then(|m| obj.get(m.experts)) {
        if n.as_u64() == Some(0) && fam.arch != Arch::Decoder {
            return Err(field_err(
                path,
                fam.mlp.moe.map_or("", |m| m.experts),
                "zero experts: a mixture of experts needs at least one",
            ));
        }
    }
    let mut model = families::model(&c, text_type)?;
    if !std::ptr::eq(obj, root) {
        // transformers 5 ties a wrapper's head by the wrapper's own flag (its class's default
        // when the file leaves it out), not the text config's.
        model.tied = match root.get("tie_word_embeddings") {
            Some(Json::Bool(b)) => *b,
            _ => !matches!(model_type, "llama4" | "qwen3_5" | "qwen3_5_moe"),
        };
    }
    model.vision = vision::tower(path, root, model_type, model.hidden)?;
    let arch = fam.arch;
    let get_s = |key: &str| -> Result<Option<String>, ConfigError> {
        match root.get(key).or_else(|| obj.get(key)) {
            None | Some(Json::Null) => Ok(None),
            Some(Json::String(s)) => Ok(Some(s.clone())),
            Some(x) => Err(field_err(
                path,
                key,
                format!("expected a string, found {x}"),
            )),
        }
    };
    let mut w = presets::base(name, arch);
    w.hidden = model.hidden;
    w.layers = model.layers.len() as u64;
    w.vocab = model.vocab;
    w.max_positions = max_positions(&c)?;
    w.heads = 0;
    w.seq = w.max_positions.min(presets::LLM_SEQ);
    reference_shape(&mut w, &model, c.u("head_dim")?.is_some());
    w.dropout = c.f("attention_dropout")?.is_some_and(|p| p > 0.0);
    w.tie_embeddings = Some(model.tied);
    w.mlp_bias = c.b("mlp_bias")?;
    if let Some((key, default)) = fam.act {
        w.gelu = gelu_of(path, key, obj.get(key), default)?;
    }
    w.kv_cache = match obj.get("use_cache") {
        None | Some(Json::Null) => true,
        _ => c.b("use_cache")?,
    };
    for key in ["rms_norm_eps", "rope_theta"] {
        c.f(key)?;
    }
    w.precision = match get_s("torch_dtype")?.or(get_s("dtype")?).as_deref() {
        None | Some("bfloat16") => super::Precision::Bf16,
        Some("float16") => super::Precision::Fp16,
        Some("float32") => super::Precision::Fp32,
        Some(other) => {
            return Err(field_err(
                path,
                "torch_dtype",
                format!("unsupported dtype '{other}' (float32, float16, bfloat16)"),
            ))
        }
    };
    w.quant = quant::read(path, root)?;
    if arch == Arch::Gemma2 {
        w.attention = super::Attention::Naive;
        w.logit_softcap = c.f("final_logit_softcapping")?.is_some();
        w.attn_softcap = c.f("attn_logit_softcapping")?.is_some();
    } else if arch == Arch::Gemma3 {
        w.logit_softcap = c.f("final_logit_softcapping")?.is_some();
    }
    if let Some(a) = attention_of(path, root)? {
        w.attention = a;
    }
    w.model = Some(Box::new(model));
    let fields = "hidden_size, num_hidden_layers, intermediate_size, vocab_size";
    Ok((w, fields.to_string()))
}

/// The text model type a wrapper's `text_config` stands for when it names none (the wrapper
/// config class's default sub-config).
fn wrapper_text_type(t: &str) -> &str {
    match t {
        "gemma3" => "gemma3_text",
        "llama4" => "llama4_text",
        "mistral3" => "mistral",
        "qwen3_5" => "qwen3_5_text",
        "qwen3_5_moe" => "qwen3_5_moe_text",
        other => other,
    }
}

/// The context a config states, as vLLM derives `max_model_len` from it
/// (`vllm/config/model.py`, `_get_and_verify_max_len`): the smallest of the length keys present,
/// 2048 when none is; a `rope_scaling` factor stretches it except for the types that state their
/// own length (`su`, `longrope`, `llama3`, `yarn` with `original_max_position_embeddings` as
/// the base).
fn max_positions(c: &families::Cfg) -> Result<u64, ConfigError> {
    const KEYS: [&str; 8] = [
        "max_position_embeddings",
        "n_positions",
        "max_seq_len",
        "seq_length",
        "model_max_length",
        "max_sequence_length",
        "max_seq_length",
        "seq_len",
    ];
    let mut len: Option<u64> = None;
    for k in KEYS {
        if let Some(Json::Number(n)) = c.obj.get(k) {
            if let Some(v) = n.as_u64().filter(|v| *v > 0) {
                len = Some(len.map_or(v, |l| l.min(v)));
            }
        }
    }
    if len.is_none() {
        len = c.u("max_position_embeddings")?;
    }
    Ok(len.unwrap_or(2048))
}

/// The builder's uniform shape from a model's layers: the first attention layer's heads and
/// widths (MLA's query/key width as the head width, one key/value head per head), the first
/// dense MLP's width, the first mixture's experts. The plan's parameters come from the layers
/// themselves (`plan::transformer::count`); these widths size the activations.
fn reference_shape(w: &mut Workload, m: &super::layers::ModelSpec, head_dim_given: bool) {
    use super::layers::{Mixer, MlpSpec};
    for l in &m.layers {
        match l.mixer {
            Mixer::Attention(a) => {
                w.heads = a.heads;
                w.kv_heads = (a.kv_heads != a.heads).then_some(a.kv_heads);
                let derived = w.hidden.checked_div(a.heads) == Some(a.head_dim)
                    && w.hidden.is_multiple_of(a.heads);
                w.head_dim = (head_dim_given || !derived).then_some(a.head_dim);
                w.attention_bias = Some(a.qkv_bias);
                break;
            }
            Mixer::Mla(a) => {
                w.heads = a.heads;
                w.kv_heads = None;
                w.head_dim = Some(a.qk_nope_head_dim + a.qk_rope_head_dim);
                w.attention_bias = Some(a.bias);
                break;
            }
            _ => {}
        }
    }
    if w.heads == 0 {
        // No attention layer (Mamba-2 only): the mixer's heads stand in.
        for l in &m.layers {
            if let Mixer::Mamba2(s) = l.mixer {
                w.heads = s.heads;
                w.head_dim = Some(s.head_dim);
                break;
            }
        }
    }
    for l in &m.layers {
        if let MlpSpec::Dense { ffn, .. } = l.mlp {
            w.ffn = ffn;
            break;
        }
    }
    for l in &m.layers {
        if let MlpSpec::Moe(e) = l.mlp {
            w.moe = Some(super::Moe {
                experts: e.experts,
                top_k: e.top_k,
                expert_ffn: e.expert_ffn,
                shared_ffn: e.shared_ffn,
            });
            if w.ffn == 0 {
                w.ffn = e.expert_ffn;
            }
            break;
        }
    }
    if w.ffn == 0 {
        w.ffn = w.hidden;
    }
}

/// The attention a config.json asks for (`_attn_implementation` or `attn_implementation`).
fn attention_of(
    path: &str,
    obj: &serde_json::Map<String, Json>,
) -> Result<Option<super::Attention>, ConfigError> {
    for key in ["_attn_implementation", "attn_implementation"] {
        match obj.get(key) {
            None | Some(Json::Null) => continue,
            Some(Json::String(s)) => {
                return match s.as_str() {
                    "eager" => Ok(Some(super::Attention::Naive)),
                    "sdpa" => Ok(Some(super::Attention::Sdpa)),
                    "flash_attention_2" | "flash_attention_3" => Ok(Some(super::Attention::Flash)),
                    other => Err(field_err(
                        path,
                        key,
                        format!("unsupported attention '{other}' (eager, sdpa, flash_attention_2)"),
                    )),
                }
            }
            Some(x) => {
                return Err(field_err(
                    path,
                    key,
                    format!("expected a string, found {x}"),
                ))
            }
        }
    }
    Ok(None)
}

/// The size (flag name) each config.json field sets, for its limit.
const HF_SIZES: [(&str, &str); 19] = [
    ("n_embd", "hidden"),
    ("n_layer", "layers"),
    ("n_head", "heads"),
    ("n_inner", "ffn"),
    ("n_positions", "seq"),
    ("n_ctx", "seq"),
    ("vocab_size", "vocab"),
    ("hidden_size", "hidden"),
    ("num_hidden_layers", "layers"),
    ("num_attention_heads", "heads"),
    ("num_key_value_heads", "heads"),
    ("intermediate_size", "ffn"),
    ("max_position_embeddings", "seq"),
    ("image_size", "image"),
    ("head_dim", "hidden"),
    ("num_local_experts", "experts"),
    ("num_experts", "experts"),
    ("moe_intermediate_size", "ffn"),
    ("shared_expert_intermediate_size", "ffn"),
];

pub(super) fn hf_size(key: &str) -> Option<&'static str> {
    match key {
        "patch_size" => Some("patch"),
        _ => HF_SIZES.iter().find(|(k, _)| *k == key).map(|(_, s)| *s),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hf_styles() {
        let g = load_hf("g.json", r#"{"model_type":"gpt2","n_embd":768,"n_layer":12,"n_head":12,"n_positions":1024,"vocab_size":50257,"n_inner":null}"#).unwrap();
        assert_eq!((g.arch, g.ffn, g.seq), (Arch::Gpt2, 3072, 1024));
        let v = load_hf("v.json", r#"{"model_type":"vit","hidden_size":768,"num_hidden_layers":12,"num_attention_heads":12,"intermediate_size":3072,"image_size":224,"patch_size":16}"#).unwrap();
        assert_eq!((v.seq, v.vocab), (197, 1000));
        let e = load_hf("b.json", r#"{"model_type":"bert","hidden_size":"768"}"#)
            .unwrap_err()
            .to_string();
        assert!(e.contains("'hidden_size'") && e.contains("b.json"), "{e}");
        let l = load_hf("l.json", r#"{"model_type":"llama","hidden_size":4096,"num_hidden_layers":32,"num_attention_heads":32,"num_key_value_heads":8,"intermediate_size":11008,"vocab_size":32000}"#).unwrap();
        assert_eq!((l.arch, l.kv_heads(), l.seq), (Arch::Llama, 8, 2048));
        let e = load_hf("l.json", r#"{"model_type":"llama","hidden_size":4096,"num_hidden_layers":32,"num_attention_heads":32,"num_key_value_heads":7,"intermediate_size":11008,"vocab_size":32000}"#).unwrap_err().to_string();
        assert!(e.contains("num_key_value_heads"), "{e}");
        let e = load_hf("q.json", r#"{"model_type":"qwen2_vl"}"#)
            .unwrap_err()
            .to_string();
        // No look-alike is suggested: qwen2_vl is refused, naming the families it knows.
        assert!(e.contains("'qwen2_vl'") && !e.contains("nearest"), "{e}");
    }

    #[test]
    fn a_name_with_control_characters_is_escaped() {
        let cfg = r#"{"model_type":"gpt2","n_embd":64,"n_layer":2,"n_head":2,"vocab_size":100,"n_positions":64,"_name_or_path":"\u001b]0;pwn\u0007x\ny"}"#;
        let w = load_hf("g.json", cfg).unwrap();
        assert_eq!(w.name, "\\u{1b}]0;pwn\\u{7}x\\ny");
        // The file's folder stands in for a missing name, escaped too.
        let cfg = r#"{"model_type":"gpt2","n_embd":64,"n_layer":2,"n_head":2,"vocab_size":100,"n_positions":64}"#;
        let w = load_hf("d\u{1b}[31m/config.json", cfg).unwrap();
        assert_eq!(w.name, "d\\u{1b}[31m");
    }
}
