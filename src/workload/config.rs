//! Read a Hugging Face config.json or an oomprobe TOML case file into a Workload.
//!
//! config.json styles (by `model_type`, or GPT-2 by its `n_embd` key):
//! - GPT-2: `n_embd`, `n_layer`, `n_head`, `vocab_size`, `n_positions` (or `n_ctx`), `n_inner`
//!   (null → 4·n_embd), `resid_pdrop` (dropout when > 0).
//! - BERT (`"bert"`): `hidden_size`, `num_hidden_layers`, `num_attention_heads`,
//!   `intermediate_size`, `max_position_embeddings`, `vocab_size`, `hidden_dropout_prob`.
//! - The decoder LLMs (`llama`, `mistral`, `qwen2`, `qwen3`, `gemma`, `gemma2`, `gemma3` /
//!   `gemma3_text` (a multimodal config's `text_config`), `phi3`, `mixtral`, `qwen2_moe`,
//!   `qwen3_moe`): `hidden_size`, `num_hidden_layers`, `num_attention_heads`,
//!   `num_key_value_heads` (absent: one per head, as transformers does), `head_dim`,
//!   `intermediate_size`, `vocab_size`, `max_position_embeddings`, `tie_word_embeddings`
//!   (the family's default when absent), `attention_bias`, `mlp_bias`, `torch_dtype` / `dtype`
//!   (the precision transformers 5 loads the weights in), `use_cache`, `attention_dropout`,
//!   `_attn_implementation` / `attn_implementation`, Gemma 2's `final_logit_softcapping` and
//!   `attn_logit_softcapping`; experts from `num_local_experts` / `num_experts`,
//!   `num_experts_per_tok`, `moe_intermediate_size`, `shared_expert_intermediate_size`.
//!   `rope_scaling`, `rope_theta`, `sliding_window` and `rms_norm_eps` are read and change no
//!   memory. The sequence defaults to the context, at most 4096 tokens.
//! - ViT (`"vit"`): as BERT plus `image_size`, `patch_size`, `num_channels` (3), classes from
//!   `id2label` (default 1000).
//!
//! Other keys of a config.json are ignored (they carry tokenizer and training settings).
//!
//! A case file (`.toml`) is strict: unknown keys, wrong types and missing required fields are
//! errors naming the field and the file. Format:
//! ```toml
//! name = "LLaMA-13B full training on an 80 GB card"   # required
//! description = "..."                                   # optional
//! memory = "80GB"                                       # optional SIZE
//! [workload]       # required: `model` or `params`, and any override key of the CLI
//! model = "llama-13b"
//! [[expect]]       # one or more; each may override workload keys
//! verdict = "oom"  # "oom" | "fits"
//! cause = "model_too_large"   # optional
//! ```

use std::path::{Path, PathBuf};

use serde_json::Value as Json;
use thiserror::Error;

use crate::cli::WorkloadArgs;
use crate::error::CliError;
use crate::plan::build::PlanError;
use crate::plan::Plan;
use crate::units::parse_size;

use super::overrides::check_limit;

use super::presets::{self, vit_tokens};
use super::{Arch, Workload};

#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum ConfigError {
    #[error("config file '{0}' not found")]
    NotFound(String),
    #[error("cannot read config file '{path}': {msg}")]
    Read { path: String, msg: String },
    #[error("config file '{path}' is not valid {format}: {msg}")]
    Syntax {
        path: String,
        format: &'static str,
        msg: String,
    },
    #[error("config file '{path}': field '{field}': {msg}")]
    Field {
        path: String,
        field: String,
        msg: String,
    },
}

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

/// What a config file holds.
#[derive(Debug, Clone)]
pub enum LoadedConfig {
    /// A Hugging Face config.json.
    Hf(Box<Workload>),
    /// An oomprobe case file.
    Case(Box<CaseFile>),
}

/// The outcome a case expects of one run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Verdict {
    Oom,
    Fits,
}

/// One `[[expect]]` run of a case.
#[derive(Debug, Clone)]
pub struct Expectation {
    /// The run's workload keys (strings as on the command line), applied over `[workload]`.
    pub overrides: WorkloadArgs,
    pub verdict: Verdict,
    /// diagnose's expected cause (model_too_large | batch_too_large | sequence_too_long |
    /// activations_explode | fits).
    pub cause: Option<String>,
}

/// An oomprobe TOML case file.
#[derive(Debug, Clone)]
pub struct CaseFile {
    pub path: PathBuf,
    pub name: String,
    pub description: Option<String>,
    /// The card's memory in bytes.
    pub memory: Option<u64>,
    /// The `[workload]` keys as command-line arguments.
    pub base: WorkloadArgs,
    /// The resolved `[workload]`.
    pub workload: Workload,
    pub expects: Vec<Expectation>,
}

/// The causes diagnose names (JSON `cause`).
pub const CAUSES: [&str; 5] = [
    "model_too_large",
    "batch_too_large",
    "sequence_too_long",
    "activations_explode",
    "fits",
];

impl CaseFile {
    /// The command-line arguments of expectation `i`: `[workload]` with the run's keys over it.
    pub fn args_for(&self, i: usize) -> Option<WorkloadArgs> {
        let e = self.expects.get(i)?;
        Some(merge(&self.base, &e.overrides))
    }
    /// The resolved workload of expectation `i`.
    pub fn workload_for(&self, i: usize) -> Result<Workload, CliError> {
        let args = self.args_for(i).ok_or_else(|| {
            CliError::usage(format!("case '{}' has no expectation {i}", self.name))
        })?;
        super::overrides::resolve(&args, "gpt2").map(|r| r.workload)
    }
}

/// `over`'s fields where set, else `base`'s.
pub fn merge(base: &WorkloadArgs, over: &WorkloadArgs) -> WorkloadArgs {
    macro_rules! pick {
        ($($f:ident),*) => { WorkloadArgs { $($f: over.$f.clone().or_else(|| base.$f.clone()),)* serve: super::serve::merge(&base.serve, &over.serve), parallel: super::parallel::ParallelArgs::merge(&base.parallel, &over.parallel) } };
    }
    pick!(
        model,
        config,
        revision,
        batch,
        seq,
        layers,
        hidden,
        heads,
        ffn,
        vocab,
        image,
        params,
        precision,
        optimizer,
        attention,
        checkpoint,
        dropout,
        zero,
        gpus,
        mode,
        grads,
        outputs,
        dropout_mask,
        step,
        optimizer_impl,
        gelu,
        kv_cache,
        kv_heads,
        experts,
        experts_per_token,
        autocast_device,
        lora,
        lora_targets,
        lora_alpha,
        lora_dropout,
        quant,
        double_quant,
        quant_compute,
        kbit_prep
    )
}

/// The largest config.json or case file read (a real config.json is a few KB).
pub const MAX_CONFIG_BYTES: u64 = 16 << 20;

/// The most `[[expect]]` runs a case file may have.
pub const MAX_EXPECTS: usize = 256;

/// Load a config.json (any extension but `.toml`) or a case file (`.toml`).
pub fn load_config(path: &Path) -> Result<LoadedConfig, ConfigError> {
    let p = path.display().to_string();
    // What is not a regular file (a FIFO, a device) is refused before it is opened, and a huge
    // file without being read whole.
    let text = crate::input::read_text_capped(path, MAX_CONFIG_BYTES).map_err(|e| match e {
        crate::input::InputError::NotFound => ConfigError::NotFound(p.clone()),
        crate::input::InputError::TooLarge { .. } => ConfigError::Read {
            path: p.clone(),
            msg: format!(
                "larger than {} MiB: no config.json or case file is this large",
                MAX_CONFIG_BYTES >> 20
            ),
        },
        e => ConfigError::Read {
            path: p.clone(),
            msg: e.to_string(),
        },
    })?;
    // A UTF-8 byte-order mark (some Windows editors write one) is not part of the text.
    let text = text.strip_prefix('\u{feff}').unwrap_or(&text);
    if path
        .extension()
        .and_then(|e| e.to_str())
        .is_some_and(|e| e.eq_ignore_ascii_case("toml"))
    {
        load_case(path, text).map(|c| LoadedConfig::Case(Box::new(c)))
    } else {
        load_hf(&p, text).map(|w| LoadedConfig::Hf(Box::new(w)))
    }
}

fn field_err(path: &str, field: &str, msg: impl Into<String>) -> ConfigError {
    ConfigError::Field {
        path: path.to_string(),
        field: field.to_string(),
        msg: msg.into(),
    }
}

/// Read a Hugging Face config.json.
pub fn load_hf(path: &str, text: &str) -> Result<Workload, ConfigError> {
    let v: Json = serde_json::from_str(text).map_err(|e| ConfigError::Syntax {
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
    let get_u = |key: &str| fields.u(key);
    let req_u = |key: &str| fields.req_u(key);
    let get_f = |key: &str| fields.f(key);
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
    // The model's name: `_name_or_path`, else the file's (its folder's for a `config.json`).
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
    let dropout =
        |key: &str| -> Result<bool, ConfigError> { Ok(get_f(key)?.is_none_or(|p| p > 0.0)) };
    let arch = match kind.as_str() {
        "gpt2" => Arch::Gpt2,
        "bert" => Arch::Bert,
        "vit" => Arch::Vit,
        other => match llm_arch(other) {
            Some(a) => return load_llm(path, obj, a, &name),
            None => {
                return Err(field_err(
                    path,
                    "model_type",
                    format!(
                        "unsupported model_type '{other}' (supported: {}){}",
                        MODEL_TYPES.join(", "),
                        nearest_type(other)
                            .map(|t| format!("; the nearest family is '{t}': try --model with a preset, or set \"model_type\": \"{t}\" if the layers are the same"))
                            .unwrap_or_default()
                    ),
                ))
            }
        },
    };
    let mut w = presets::base(&name, arch);
    match arch {
        Arch::Gpt2 => {
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
        }
        _ => {
            w.hidden = req_u("hidden_size")?;
            w.layers = req_u("num_hidden_layers")?;
            w.heads = req_u("num_attention_heads")?;
            w.ffn = req_u("intermediate_size")?;
            w.dropout = dropout("hidden_dropout_prob")?;
            w.gelu = gelu_of(path, "hidden_act", obj.get("hidden_act"), "gelu")?;
        }
    }
    match arch {
        Arch::Bert => {
            w.vocab = req_u("vocab_size")?;
            w.max_positions = req_u("max_position_embeddings")?;
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
            w.vocab = match obj.get("id2label") {
                Some(Json::Object(m)) if !m.is_empty() => check_limit("vocab", m.len() as u64)
                    .map_err(|e| field_err(path, "id2label", e))?,
                _ => 1000,
            };
            w.seq = vit_tokens(w.image, w.patch);
            w.max_positions = w.seq;
        }
        _ => {}
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
    // Sizes each within their limit can still overflow together: name the fields.
    if let Err(e @ PlanError::Overflow { .. }) = Plan::for_workload(&w) {
        let fields: Vec<&str> = HF_SIZES
            .iter()
            .map(|(k, _)| *k)
            .filter(|k| obj.get(*k).is_some_and(|v| v.is_u64()))
            .collect();
        return Err(field_err(
            path,
            &fields.join(", "),
            format!("together too large: {e}"),
        ));
    }
    Ok(w)
}

/// Every `model_type` a config.json may have.
pub const MODEL_TYPES: [&str; 15] = [
    "gpt2",
    "bert",
    "vit",
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "gemma",
    "gemma2",
    "gemma3",
    "gemma3_text",
    "phi3",
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
];

/// The decoder LLM family of a `model_type`.
fn llm_arch(t: &str) -> Option<Arch> {
    Some(match t {
        "llama" => Arch::Llama,
        "mistral" => Arch::Mistral,
        "qwen2" => Arch::Qwen2,
        "qwen3" => Arch::Qwen3,
        "gemma" => Arch::Gemma,
        "gemma2" => Arch::Gemma2,
        "gemma3" | "gemma3_text" => Arch::Gemma3,
        "phi3" => Arch::Phi3,
        "mixtral" => Arch::Mixtral,
        "qwen2_moe" => Arch::Qwen2Moe,
        "qwen3_moe" => Arch::Qwen3Moe,
        _ => return None,
    })
}

/// The supported `model_type` closest to an unsupported one: a supported type it starts with
/// (`qwen2_vl` → `qwen2`, `llama4` → `llama`), a known relative, or the nearest by edits.
fn nearest_type(t: &str) -> Option<&'static str> {
    let t = t.to_ascii_lowercase();
    let known = [
        ("mistral3", "mistral"),
        ("ministral", "mistral"),
        ("phi", "phi3"),
        ("phimoe", "mixtral"),
        ("deepseek", "qwen3_moe"),
        ("olmoe", "qwen3_moe"),
        ("granite", "llama"),
        ("yi", "llama"),
        ("internlm", "llama"),
        ("baichuan", "llama"),
        ("gpt_neox", "gpt2"),
        ("gptj", "gpt2"),
        ("roberta", "bert"),
        ("deit", "vit"),
    ];
    if let Some((_, to)) = known.iter().find(|(k, _)| t.starts_with(k)) {
        return Some(to);
    }
    if let Some(m) = MODEL_TYPES
        .iter()
        .filter(|m| t.starts_with(*m))
        .max_by_key(|m| m.len())
    {
        return Some(m);
    }
    let dist = |a: &str, b: &str| {
        let (a, b): (Vec<char>, Vec<char>) = (a.chars().collect(), b.chars().collect());
        let mut row: Vec<usize> = (0..=b.len()).collect();
        for i in 1..=a.len() {
            let mut prev = row[0];
            row[0] = i;
            for j in 1..=b.len() {
                let cur = row[j];
                row[j] = (row[j] + 1)
                    .min(row[j - 1] + 1)
                    .min(prev + usize::from(a[i - 1] != b[j - 1]));
                prev = cur;
            }
        }
        row[b.len()]
    };
    MODEL_TYPES
        .iter()
        .map(|m| (dist(&t, m), *m))
        .filter(|(d, _)| *d <= 3)
        .min()
        .map(|(_, m)| m)
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
    fn b(&self, key: &str) -> Result<Option<bool>, ConfigError> {
        match self.obj.get(key) {
            None | Some(Json::Null) => Ok(None),
            Some(Json::Bool(b)) => Ok(Some(*b)),
            Some(x) => Err(field_err(
                self.path,
                key,
                format!("expected true or false, found {x}"),
            )),
        }
    }
}

/// Read a decoder LLM's config.json (see the module doc).
/// A bitsandbytes `quantization_config` (as transformers writes it for `load_in_4bit` /
/// `load_in_8bit` checkpoints): the quantized base it loads. transformers' defaults
/// (`BitsAndBytesConfig`, 5.24 `utils/quantization_config.py:444-478`): quant type fp4, no double
/// quantization, compute fp32. Other methods (GPTQ, AWQ, FP8) are not read: their weights are
/// counted in the config's dtype.
fn bnb_quant(
    path: &str,
    root: &serde_json::Map<String, Json>,
) -> Result<Option<super::Quant>, ConfigError> {
    let Some(Json::Object(q)) = root.get("quantization_config") else {
        return Ok(None);
    };
    if q.get("quant_method").and_then(Json::as_str) != Some("bitsandbytes") {
        return Ok(None);
    }
    let flag = |k: &str| q.get(k).and_then(Json::as_bool).unwrap_or(false);
    let kind = if flag("load_in_4bit") {
        match q
            .get("bnb_4bit_quant_type")
            .and_then(Json::as_str)
            .unwrap_or("fp4")
        {
            "nf4" => super::QuantKind::Nf4,
            "fp4" => super::QuantKind::Fp4,
            other => {
                return Err(field_err(
                    path,
                    "quantization_config.bnb_4bit_quant_type",
                    format!("unknown 4-bit type '{other}' (nf4, fp4)"),
                ))
            }
        }
    } else if flag("load_in_8bit") {
        super::QuantKind::Int8
    } else {
        return Ok(None);
    };
    let compute = match q.get("bnb_4bit_compute_dtype").and_then(Json::as_str) {
        Some("bfloat16") => Some(super::Precision::Bf16),
        Some("float16") => Some(super::Precision::Fp16),
        Some("float32") | None => Some(super::Precision::Fp32),
        Some(other) => {
            return Err(field_err(
                path,
                "quantization_config.bnb_4bit_compute_dtype",
                format!("unsupported dtype '{other}' (float32, float16, bfloat16)"),
            ))
        }
    };
    Ok(Some(super::Quant {
        kind,
        double_quant: kind.is_4bit() && flag("bnb_4bit_use_double_quant"),
        compute: compute.filter(|_| kind.is_4bit()),
        prepare: true,
    }))
}

fn load_llm(
    path: &str,
    root: &serde_json::Map<String, Json>,
    arch: Arch,
    name: &str,
) -> Result<Workload, ConfigError> {
    // A multimodal Gemma 3 keeps its language model's shape in `text_config`.
    let obj = match root.get("text_config") {
        Some(Json::Object(t)) if arch == Arch::Gemma3 => t,
        _ => root,
    };
    let fields = Fields { path, obj };
    let get_u = |key: &str| fields.u(key);
    let req_u = |key: &str| fields.req_u(key);
    let get_b = |key: &str| fields.b(key);
    let get_f = |key: &str| fields.f(key);
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
    w.hidden = req_u("hidden_size")?;
    w.layers = req_u("num_hidden_layers")?;
    w.heads = req_u("num_attention_heads")?;
    w.vocab = req_u("vocab_size")?;
    w.max_positions = get_u("max_position_embeddings")?.unwrap_or(2048);
    w.seq = w.max_positions.min(presets::LLM_SEQ);
    w.head_dim = get_u("head_dim")?;
    if let Some(kv) = get_u("num_key_value_heads")? {
        if !w.heads.is_multiple_of(kv) {
            return Err(field_err(
                path,
                "num_key_value_heads",
                format!(
                    "{kv} does not divide num_attention_heads {} (each key/value head serves a whole group of query heads)",
                    w.heads
                ),
            ));
        }
        w.kv_heads = (kv != w.heads).then_some(kv);
    }
    if w.head_dim.is_none() && !w.hidden.is_multiple_of(w.heads) {
        return Err(field_err(
            path,
            "num_attention_heads",
            format!(
                "{} heads do not divide the hidden size {} (and no head_dim is given)",
                w.heads, w.hidden
            ),
        ));
    }
    w.ffn = req_u("intermediate_size")?;
    w.dropout = get_f("attention_dropout")?.is_some_and(|p| p > 0.0);
    w.tie_embeddings = get_b("tie_word_embeddings")?;
    w.attention_bias = get_b("attention_bias")?;
    if arch == Arch::Qwen2Moe {
        // Qwen2-MoE reads `qkv_bias` (true by default).
        w.attention_bias = get_b("qkv_bias")?.or(Some(true));
    }
    if matches!(arch, Arch::Qwen2 | Arch::Phi3) {
        // Hard-coded in transformers: Qwen2's q, k, v have biases, Phi-3 has none.
        w.attention_bias = None;
    }
    w.mlp_bias = get_b("mlp_bias")?.unwrap_or(false);
    w.kv_cache = get_b("use_cache")?.unwrap_or(true);
    for key in ["rms_norm_eps", "rope_theta"] {
        get_f(key)?;
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
    w.quant = bnb_quant(path, root)?;
    if arch == Arch::Gemma2 {
        w.attention = super::Attention::Naive;
        w.logit_softcap = get_f("final_logit_softcapping")?.is_some();
        w.attn_softcap = get_f("attn_logit_softcapping")?.is_some();
    } else if arch == Arch::Gemma3 {
        w.logit_softcap = get_f("final_logit_softcapping")?.is_some();
    }
    if let Some(a) = attention_of(path, root)? {
        w.attention = a;
    }
    if matches!(arch, Arch::Mixtral | Arch::Qwen2Moe | Arch::Qwen3Moe) {
        let key = if arch == Arch::Mixtral {
            "num_local_experts"
        } else {
            "num_experts"
        };
        let experts = match obj.get(key) {
            Some(Json::Number(n)) if n.as_u64() == Some(0) => {
                return Err(field_err(
                    path,
                    key,
                    "zero experts: a mixture of experts needs at least one",
                ))
            }
            _ => req_u(key)?,
        };
        let top_k = req_u("num_experts_per_tok")?;
        if top_k > experts {
            return Err(field_err(
                path,
                "num_experts_per_tok",
                format!("{top_k} is more than the {experts} experts"),
            ));
        }
        let expert_ffn = match arch {
            Arch::Mixtral => w.ffn,
            _ => req_u("moe_intermediate_size")?,
        };
        let shared_ffn = if arch == Arch::Qwen2Moe {
            get_u("shared_expert_intermediate_size")?.unwrap_or(0)
        } else {
            0
        };
        if get_u("decoder_sparse_step")?.is_some_and(|k| k != 1) {
            return Err(field_err(
                path,
                "decoder_sparse_step",
                "only every layer sparse (1) is modelled",
            ));
        }
        if matches!(obj.get("mlp_only_layers"), Some(Json::Array(a)) if !a.is_empty()) {
            return Err(field_err(
                path,
                "mlp_only_layers",
                "dense layers among sparse ones are not modelled",
            ));
        }
        w.moe = Some(super::Moe {
            experts,
            top_k,
            expert_ffn,
            shared_ffn,
        });
    }
    // Sizes each within their limit can still overflow together: name the fields.
    if let Err(e @ PlanError::Overflow { .. }) = Plan::for_workload(&w) {
        return Err(field_err(
            path,
            "hidden_size, num_hidden_layers, intermediate_size, vocab_size",
            format!("together too large: {e}"),
        ));
    }
    Ok(w)
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

fn hf_size(key: &str) -> Option<&'static str> {
    match key {
        "patch_size" => Some("patch"),
        _ => HF_SIZES.iter().find(|(k, _)| *k == key).map(|(_, s)| *s),
    }
}

/// Workload keys of a case file and how each is typed.
const STRING_KEYS: [&str; 13] = [
    "precision",
    "optimizer",
    "attention",
    "checkpoint",
    "model",
    "mode",
    "grads",
    "outputs",
    "dropout_mask",
    "step",
    "optimizer_impl",
    "gelu",
    "autocast_device",
];
const NUMBER_KEYS: [&str; 14] = [
    "batch",
    "seq",
    "layers",
    "hidden",
    "heads",
    "ffn",
    "vocab",
    "image",
    "params",
    "zero",
    "gpus",
    "kv_heads",
    "experts",
    "experts_per_token",
];

fn set_arg(args: &mut WorkloadArgs, key: &str, v: String) {
    let slot = match key {
        "model" => &mut args.model,
        "batch" => &mut args.batch,
        "seq" => &mut args.seq,
        "layers" => &mut args.layers,
        "hidden" => &mut args.hidden,
        "heads" => &mut args.heads,
        "ffn" => &mut args.ffn,
        "vocab" => &mut args.vocab,
        "image" => &mut args.image,
        "params" => &mut args.params,
        "precision" => &mut args.precision,
        "optimizer" => &mut args.optimizer,
        "attention" => &mut args.attention,
        "checkpoint" => &mut args.checkpoint,
        "dropout" => &mut args.dropout,
        "kv_cache" => &mut args.kv_cache,
        "mode" => &mut args.mode,
        "grads" => &mut args.grads,
        "outputs" => &mut args.outputs,
        "dropout_mask" => &mut args.dropout_mask,
        "step" => &mut args.step,
        "optimizer_impl" => &mut args.optimizer_impl,
        "gelu" => &mut args.gelu,
        "zero" => &mut args.zero,
        "kv_heads" => &mut args.kv_heads,
        "experts" => &mut args.experts,
        "experts_per_token" => &mut args.experts_per_token,
        "autocast_device" => &mut args.autocast_device,
        _ => &mut args.gpus,
    };
    *slot = Some(v);
}

/// Read one workload key of a case file into `args`; `Ok(false)` if `key` is not a workload key.
fn workload_key(
    path: &str,
    field: &str,
    key: &str,
    v: &toml::Value,
    args: &mut WorkloadArgs,
) -> Result<bool, ConfigError> {
    use toml::Value as T;
    if STRING_KEYS.contains(&key) {
        match v {
            T::String(s) => set_arg(args, key, s.clone()),
            other => {
                return Err(field_err(
                    path,
                    field,
                    format!("expected a string, found {}", other.type_str()),
                ))
            }
        }
    } else if NUMBER_KEYS.contains(&key) {
        match v {
            T::Integer(i) if *i > 0 || key == "zero" && *i == 0 => {
                set_arg(args, key, i.to_string())
            }
            T::Integer(i) => {
                return Err(field_err(
                    path,
                    field,
                    format!("must be greater than zero, found {i}"),
                ))
            }
            T::Float(f) if *f >= 1.0 && f.fract() == 0.0 && *f < 1.8e19 => {
                set_arg(args, key, format!("{}", *f as u64))
            }
            T::String(s) => set_arg(args, key, s.clone()),
            other => {
                return Err(field_err(
                    path,
                    field,
                    format!("expected a positive integer, found {}", other.type_str()),
                ))
            }
        }
    } else if key == "dropout" || key == "kv_cache" {
        match v {
            T::Boolean(b) => set_arg(args, key, if *b { "on" } else { "off" }.to_string()),
            other => {
                return Err(field_err(
                    path,
                    field,
                    format!("expected true or false, found {}", other.type_str()),
                ))
            }
        }
    } else if key == "tp" || args.parallel.slot(key).is_some() {
        // The layout: numbers, names and on/off as their flags take them.
        let text = match v {
            T::String(s) => s.clone(),
            T::Integer(i) => i.to_string(),
            T::Boolean(b) => if *b { "on" } else { "off" }.to_string(),
            other => {
                return Err(field_err(
                    path,
                    field,
                    format!(
                        "expected a number, a name or a boolean, found {}",
                        other.type_str()
                    ),
                ))
            }
        };
        match args.parallel.slot(key) {
            Some(slot) => *slot = Some(text),
            None => args.serve.tp = Some(text),
        }
    } else {
        return Ok(false);
    }
    Ok(true)
}

/// Check that `args` resolves; a failure names the table and the file.
fn check_args(path: &str, table: &str, args: &WorkloadArgs) -> Result<Workload, ConfigError> {
    super::overrides::resolve(args, "gpt2")
        .map(|r| r.workload)
        .map_err(|e| field_err(path, table, e.to_string()))
}

/// Read an oomprobe case file.
pub fn load_case(file: &Path, text: &str) -> Result<CaseFile, ConfigError> {
    let path = file.display().to_string();
    let path = path.as_str();
    let root: toml::Table = toml::from_str(text).map_err(|e| ConfigError::Syntax {
        path: path.into(),
        format: "TOML",
        msg: e.to_string().lines().next().unwrap_or("").to_string(),
    })?;
    for key in root.keys() {
        if !["name", "description", "memory", "workload", "expect"].contains(&key.as_str()) {
            return Err(field_err(
                path,
                key,
                "unknown key (name, description, memory, [workload], [[expect]])",
            ));
        }
    }
    let string = |key: &str| -> Result<Option<String>, ConfigError> {
        match root.get(key) {
            None => Ok(None),
            Some(toml::Value::String(s)) => Ok(Some(s.clone())),
            Some(v) => Err(field_err(
                path,
                key,
                format!("expected a string, found {}", v.type_str()),
            )),
        }
    };
    let name = string("name")?.ok_or_else(|| field_err(path, "name", "missing (required)"))?;
    let description = string("description")?;
    let memory = match root.get("memory") {
        None => None,
        Some(toml::Value::String(s)) => {
            Some(parse_size(s).map_err(|e| field_err(path, "memory", e.to_string()))?)
        }
        Some(toml::Value::Integer(i)) if *i > 0 => Some(*i as u64),
        Some(v) => {
            return Err(field_err(
                path,
                "memory",
                format!("expected a SIZE such as \"80GB\", found {}", v.type_str()),
            ))
        }
    };
    let wt = match root.get("workload") {
        None => return Err(field_err(path, "workload", "missing (required table)")),
        Some(toml::Value::Table(t)) => t,
        Some(v) => {
            return Err(field_err(
                path,
                "workload",
                format!("expected a table, found {}", v.type_str()),
            ))
        }
    };
    let mut base = WorkloadArgs::default();
    for (k, v) in wt {
        let field = format!("workload.{k}");
        if !workload_key(path, &field, k, v, &mut base)? {
            return Err(field_err(path, &field, "unknown key"));
        }
    }
    if base.model.is_none() && base.params.is_none() {
        return Err(field_err(
            path,
            "workload.model",
            "missing (required unless workload.params is given)",
        ));
    }
    let workload = check_args(path, "workload", &base)?;
    let list = match root.get("expect") {
        None => {
            return Err(field_err(
                path,
                "expect",
                "missing: at least one [[expect]] table is required",
            ))
        }
        Some(toml::Value::Array(a)) if !a.is_empty() => a,
        Some(v) => {
            return Err(field_err(
                path,
                "expect",
                format!(
                    "expected one or more [[expect]] tables, found {}",
                    v.type_str()
                ),
            ))
        }
    };
    if list.len() > MAX_EXPECTS {
        return Err(field_err(
            path,
            "expect",
            format!(
                "{} [[expect]] runs; at most {MAX_EXPECTS} (split the case into files)",
                list.len()
            ),
        ));
    }
    let mut expects = Vec::new();
    for (i, e) in list.iter().enumerate() {
        let t = e.as_table().ok_or_else(|| {
            field_err(
                path,
                &format!("expect[{i}]"),
                format!("expected a table, found {}", e.type_str()),
            )
        })?;
        let mut overrides = WorkloadArgs::default();
        let mut verdict = None;
        let mut cause = None;
        for (k, v) in t {
            let field = format!("expect[{i}].{k}");
            match (k.as_str(), v) {
                ("verdict", toml::Value::String(s)) => {
                    verdict = Some(match s.as_str() {
                        "oom" => Verdict::Oom,
                        "fits" => Verdict::Fits,
                        _ => {
                            return Err(field_err(
                                path,
                                &field,
                                format!("'{s}' is not a verdict (oom, fits)"),
                            ))
                        }
                    })
                }
                ("cause", toml::Value::String(s)) => {
                    if !CAUSES.contains(&s.as_str()) {
                        return Err(field_err(
                            path,
                            &field,
                            format!("'{s}' is not a cause ({})", CAUSES.join(", ")),
                        ));
                    }
                    cause = Some(s.clone());
                }
                ("verdict" | "cause", v) => {
                    return Err(field_err(
                        path,
                        &field,
                        format!("expected a string, found {}", v.type_str()),
                    ))
                }
                _ => {
                    if !workload_key(path, &field, k, v, &mut overrides)? {
                        return Err(field_err(path, &field, "unknown key"));
                    }
                }
            }
        }
        let verdict = verdict.ok_or_else(|| {
            field_err(path, &format!("expect[{i}].verdict"), "missing (required)")
        })?;
        check_args(path, &format!("expect[{i}]"), &merge(&base, &overrides))?;
        expects.push(Expectation {
            overrides,
            verdict,
            cause,
        });
    }
    Ok(CaseFile {
        path: file.to_path_buf(),
        name,
        description,
        memory,
        base,
        workload,
        expects,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const CASE: &str = r#"
name = "LLaMA-13B full training on an 80 GB card"
memory = "80GB"
[workload]
model = "llama-13b"
precision = "mixed"
optimizer = "adam"
batch = 1
seq = 2048
[[expect]]
verdict = "oom"
cause = "model_too_large"
[[expect]]
batch = 8
seq = 512
dropout = false
verdict = "fits"
"#;

    #[test]
    fn case_file_parses() {
        let c = load_case(Path::new("c.toml"), CASE).unwrap();
        assert_eq!(c.memory, Some(80_000_000_000));
        assert_eq!(c.expects.len(), 2);
        assert_eq!(c.expects[0].cause.as_deref(), Some("model_too_large"));
        let w1 = c.workload_for(1).unwrap();
        assert_eq!((w1.batch, w1.seq), (8, 512));
        assert_eq!(c.workload_for(0).unwrap().seq, 2048);
    }

    #[test]
    fn case_file_errors_name_the_field() {
        let bad = CASE.replace("batch = 8", "batchh = 8");
        let e = load_case(Path::new("c.toml"), &bad)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("expect[1].batchh") && e.contains("c.toml"),
            "{e}"
        );
        let bad = CASE.replace("batch = 1\n", "batch = \"x\"\n");
        let e = load_case(Path::new("c.toml"), &bad)
            .unwrap_err()
            .to_string();
        assert!(e.contains("'workload'") && e.contains("--batch"), "{e}");
        let bad = CASE.replace("seq = 2048", "seq = true");
        let e = load_case(Path::new("c.toml"), &bad)
            .unwrap_err()
            .to_string();
        assert!(e.contains("workload.seq"), "{e}");
        let bad = CASE.replace("name = ", "title = ");
        let e = load_case(Path::new("c.toml"), &bad)
            .unwrap_err()
            .to_string();
        assert!(e.contains("'title'"), "{e}");
        let bad = CASE.replace("verdict = \"oom\"\n", "");
        let e = load_case(Path::new("c.toml"), &bad)
            .unwrap_err()
            .to_string();
        assert!(e.contains("expect[0].verdict"), "{e}");
    }

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
        assert!(e.contains("nearest family is 'qwen2'"), "{e}");
    }
}
