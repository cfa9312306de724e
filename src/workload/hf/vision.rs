//! The vision tower of a multimodal wrapper (`vision_config`): its parameters and its
//! projector's into the text model, counted beside the text model. Its activations are not
//! planned (the step plans the text model; a note says so).
//!
//! One function per tower, each the parameter shapes of transformers 5.24's modeling code:
//! SigLIP (`siglip_vision_model`: Gemma 3, with `Gemma3MultiModalProjector`), Llama 4's
//! (`llama4_vision_model`, `Llama4MultiModalProjector`), Pixtral (`pixtral`: Mistral 3 and
//! Ministral 3, with `Mistral3MultiModalProjector`'s patch merger) and Qwen3.5's
//! (`qwen3_5`: a Qwen3-VL style tower with its merger). A wrapper whose file leaves
//! `vision_config` out gets its config class's default tower, as transformers builds it.

use serde_json::{Map, Value as Json};

use super::super::layers::Tower;
use crate::workload::config::{field_err, ConfigError};

/// A tower config's fields over its class's defaults.
struct V<'a> {
    path: &'a str,
    obj: Option<&'a Map<String, Json>>,
    defaults: &'a [(&'a str, u64)],
}

impl V<'_> {
    fn u(&self, key: &str) -> Result<u64, ConfigError> {
        match self.obj.and_then(|o| o.get(key)) {
            None | Some(Json::Null) => self
                .defaults
                .iter()
                .find(|(k, _)| *k == key)
                .map(|(_, v)| *v)
                .ok_or_else(|| field_err(self.path, &format!("vision_config.{key}"), "missing")),
            Some(x) => x.as_u64().ok_or_else(|| {
                field_err(
                    self.path,
                    &format!("vision_config.{key}"),
                    format!("expected a non-negative integer, found {x}"),
                )
            }),
        }
    }
    fn b(&self, key: &str, default: bool) -> bool {
        self.obj
            .and_then(|o| o.get(key))
            .and_then(Json::as_bool)
            .unwrap_or(default)
    }
}

/// SigLIP's defaults as Gemma 3 ships them (`SiglipVisionConfig`, overridden by
/// `Gemma3Config`'s default vision config).
const SIGLIP: &[(&str, u64)] = &[
    ("hidden_size", 768),
    ("intermediate_size", 3072),
    ("num_hidden_layers", 12),
    ("num_channels", 3),
    ("image_size", 224),
    ("patch_size", 16),
];

const LLAMA4: &[(&str, u64)] = &[
    ("hidden_size", 768),
    ("intermediate_size", 5632),
    ("num_hidden_layers", 34),
    ("num_channels", 3),
    ("image_size", 448),
    ("patch_size", 14),
    ("vision_output_dim", 7680),
    ("projector_input_dim", 4096),
    ("projector_output_dim", 4096),
];

const PIXTRAL: &[(&str, u64)] = &[
    ("hidden_size", 1024),
    ("intermediate_size", 4096),
    ("num_hidden_layers", 24),
    ("num_channels", 3),
    ("patch_size", 14),
];

const QWEN3_5: &[(&str, u64)] = &[
    ("depth", 27),
    ("hidden_size", 1152),
    ("intermediate_size", 4304),
    ("in_channels", 3),
    ("patch_size", 16),
    ("temporal_patch_size", 2),
    ("spatial_merge_size", 2),
    ("out_hidden_size", 3584),
    ("num_position_embeddings", 2304),
];

/// A ViT layer with biased q, k, v, o, a biased two-layer MLP and two LayerNorms.
fn vit_layer(h: u64, f: u64) -> u64 {
    4 * (h * h + h) + (h * f + f) + (f * h + h) + 4 * h
}

fn siglip(v: &V, text_hidden: u64) -> Result<u64, ConfigError> {
    let (h, f) = (v.u("hidden_size")?, v.u("intermediate_size")?);
    let (p, img, ch) = (v.u("patch_size")?, v.u("image_size")?, v.u("num_channels")?);
    let patches = (img / p.max(1)).pow(2);
    let mut n = ch * p * p * h + h + patches * h + v.u("num_hidden_layers")? * vit_layer(h, f);
    n += 2 * h;
    if v.b("vision_use_head", true) {
        // The attention-pooling head: probe, in_proj, out_proj, LayerNorm and an MLP.
        n += h + 3 * h * h + 3 * h + h * h + h + 2 * h + h * f + f + f * h + h;
    }
    // Gemma3MultiModalProjector: mm_input_projection_weight and mm_soft_emb_norm.
    Ok(n + h * text_hidden + h)
}

fn llama4(v: &V, text_hidden: u64) -> Result<u64, ConfigError> {
    let (h, f) = (v.u("hidden_size")?, v.u("intermediate_size")?);
    let (p, img, ch) = (v.u("patch_size")?, v.u("image_size")?, v.u("num_channels")?);
    let positions = (img / p.max(1)).pow(2) + 1;
    let mut n = h + positions * h + ch * p * p * h + 4 * h;
    n += v.u("num_hidden_layers")? * vit_layer(h, f);
    // The pixel-shuffle adapter's two linears, then the projector into the text model.
    let (pin, pout) = (v.u("projector_input_dim")?, v.u("projector_output_dim")?);
    n += f * pin + pin * pout;
    Ok(n + v.u("vision_output_dim")? * text_hidden)
}

fn pixtral(v: &V, root: &Map<String, Json>, text_hidden: u64) -> Result<u64, ConfigError> {
    let (h, f) = (v.u("hidden_size")?, v.u("intermediate_size")?);
    let (p, ch) = (v.u("patch_size")?, v.u("num_channels")?);
    let layer = 2 * h + 3 * h * f + 4 * h * h;
    let mut n = ch * p * p * h + h + v.u("num_hidden_layers")? * layer;
    let merge = root
        .get("spatial_merge_size")
        .and_then(Json::as_u64)
        .unwrap_or(2);
    let feature_layers = match root.get("vision_feature_layer") {
        Some(Json::Array(a)) => a.len() as u64,
        _ => 1,
    };
    let bias = root
        .get("multimodal_projector_bias")
        .and_then(Json::as_bool)
        .unwrap_or(false);
    let hin = h * feature_layers;
    // Mistral3MultiModalProjector: RMSNorm, the patch merger, two linears.
    n += hin + hin * hin * merge * merge + hin * text_hidden + text_hidden * text_hidden;
    if bias {
        n += 2 * text_hidden;
    }
    Ok(n)
}

fn qwen3_5(v: &V) -> Result<u64, ConfigError> {
    let (h, f) = (v.u("hidden_size")?, v.u("intermediate_size")?);
    let (p, t, ch) = (
        v.u("patch_size")?,
        v.u("temporal_patch_size")?,
        v.u("in_channels")?,
    );
    let m = v.u("spatial_merge_size")?;
    let out = v.u("out_hidden_size")?;
    let mut n = ch * t * p * p * h + h + v.u("num_position_embeddings")? * h;
    n += v.u("depth")? * vit_layer(h, f);
    let merged = h * m * m;
    n += 2 * h + merged * merged + merged + out * merged + out;
    Ok(n)
}

/// The tower a wrapper config describes (None for a text-only config), with `text_hidden` the
/// text model's width.
pub fn tower(
    path: &str,
    root: &Map<String, Json>,
    wrapper: &str,
    text_hidden: u64,
) -> Result<Option<Tower>, ConfigError> {
    let obj = match root.get("vision_config") {
        Some(Json::Object(o)) => Some(o),
        Some(Json::Null) | None if root.contains_key("text_config") => None,
        _ => return Ok(None),
    };
    let kind = obj
        .and_then(|o| o.get("model_type"))
        .and_then(Json::as_str)
        .map(str::to_string)
        .unwrap_or_else(|| {
            match wrapper {
                "gemma3" => "siglip_vision_model",
                "llama4" => "llama4_vision_model",
                "mistral3" | "ministral3" => "pixtral",
                "qwen3_5" | "qwen3_5_moe" => "qwen3_5",
                other => other,
            }
            .to_string()
        });
    let v = |defaults| V {
        path,
        obj,
        defaults,
    };
    let params = match kind.as_str() {
        "siglip_vision_model" => siglip(&v(SIGLIP), text_hidden)?,
        "llama4_vision_model" => llama4(&v(LLAMA4), text_hidden)?,
        "pixtral" => pixtral(&v(PIXTRAL), root, text_hidden)?,
        "qwen3_5" | "qwen3_5_moe" | "qwen3_5_vision" | "qwen3_5_moe_vision" => {
            qwen3_5(&v(QWEN3_5))?
        }
        // A wrapper without a tower config of its own and with no default tower.
        _ if obj.is_none() => return Ok(None),
        other => {
            return Err(field_err(
                path,
                "vision_config.model_type",
                format!("vision tower '{other}' is not modelled (siglip_vision_model, llama4_vision_model, pixtral, qwen3_5)"),
            ))
        }
    };
    Ok(Some(Tower { kind, params }))
}
