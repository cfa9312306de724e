//! Fine-tuning settings: PEFT LoRA adapters (`--lora`) over a frozen base, bitsandbytes'
//! quantized bases (`--quant`), as transformers and PEFT load and run them, and the formats
//! checkpoints ship quantized (a config's `quantization_config`: MXFP4, block-wise FP8, GPTQ,
//! AWQ; their bytes in `workload::stored`).

use serde::{Deserialize, Serialize};

/// A linear layer LoRA can adapt, by PEFT's module name in the LLaMA-style decoders.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Target {
    #[serde(rename = "q_proj")]
    Q,
    #[serde(rename = "k_proj")]
    K,
    #[serde(rename = "v_proj")]
    V,
    #[serde(rename = "o_proj")]
    O,
    #[serde(rename = "gate_proj")]
    Gate,
    #[serde(rename = "up_proj")]
    Up,
    #[serde(rename = "down_proj")]
    Down,
}

impl Target {
    /// Every linear of a layer: PEFT's `all-linear` (which leaves out `lm_head`,
    /// `tuners_utils.py:2382-2417` at peft 5d602fd).
    pub const ALL: [Target; 7] = [
        Target::Q,
        Target::K,
        Target::V,
        Target::O,
        Target::Gate,
        Target::Up,
        Target::Down,
    ];
    /// PEFT's default for the LLaMA family (`TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING`:
    /// `["q_proj", "v_proj"]`, `utils/constants.py:85`).
    pub const DEFAULT: [Target; 2] = [Target::Q, Target::V];

    pub fn name(self) -> &'static str {
        match self {
            Target::Q => "q_proj",
            Target::K => "k_proj",
            Target::V => "v_proj",
            Target::O => "o_proj",
            Target::Gate => "gate_proj",
            Target::Up => "up_proj",
            Target::Down => "down_proj",
        }
    }

    /// `q`, `q_proj` (and PEFT's fused names for Phi-3: `qkv_proj`, `gate_up_proj`).
    pub fn parse(v: &str) -> Option<Vec<Target>> {
        let v = v.trim().to_ascii_lowercase();
        let one = match v.trim_end_matches("_proj") {
            "q" => Target::Q,
            "k" => Target::K,
            "v" => Target::V,
            "o" => Target::O,
            "gate" => Target::Gate,
            "up" => Target::Up,
            "down" => Target::Down,
            "qkv" => return Some(vec![Target::Q, Target::K, Target::V]),
            "gate_up" => return Some(vec![Target::Gate, Target::Up]),
            _ => return None,
        };
        Some(vec![one])
    }
}

/// PEFT `LoraConfig` as it shapes memory.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Lora {
    /// `r`: each adapted `[out, in]` linear gains `lora_A` `[r, in]` and `lora_B` `[out, r]`.
    pub rank: u64,
    /// The adapted linears of every layer, sorted.
    pub targets: Vec<Target>,
    /// `lora_alpha`: a scale only (no memory effect); reported as given.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub alpha: Option<f64>,
    /// `lora_dropout`: above 0 each adapter drops its own copy of the input (and saves the
    /// 1-byte mask where the input needs a gradient).
    #[serde(default)]
    pub dropout: f64,
}

impl Lora {
    pub fn adapts(&self, t: Target) -> bool {
        self.targets.contains(&t)
    }
    /// The targets as `--lora-targets` prints them.
    pub fn targets_label(&self) -> String {
        if self.targets.len() == Target::ALL.len() {
            return "all-linear".into();
        }
        let v: Vec<&str> = self.targets.iter().map(|t| t.name()).collect();
        v.join(",")
    }
}

/// How the frozen base's linear weights are stored: bitsandbytes' layouts (loaded from a 16-bit
/// model, `--quant`), or a checkpoint's own quantized tensors (`quantization_config`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum QuantKind {
    /// 4-bit NormalFloat (`bnb_4bit_quant_type="nf4"`, QLoRA).
    Nf4,
    /// 4-bit float (`"fp4"`, transformers' default quant type).
    Fp4,
    /// `load_in_8bit`: LLM.int8() with int8 weights and fp32 row scales.
    Int8,
    /// OCP MX FP4 (`quant_method: "mxfp4"`, gpt-oss): the experts' weights as 4-bit values in
    /// blocks of 32 along the input, one uint8 e8m0 scale per block.
    Mxfp4 { scope: Scope },
    /// FP8 e4m3 weights (`quant_method: "fp8"`) with an fp32 `weight_scale_inv` per
    /// `[rows, cols]` block (`weight_block_size`), or one per tensor when `block` is None.
    Fp8 {
        block: Option<[u64; 2]>,
        scope: Scope,
    },
    /// GPTQ (`quant_method: "gptq"`): packed int32 `qweight`, `qzeros`, fp16 `scales` per group
    /// of `group` inputs (None: one group, `group_size: -1`) and an int32 `g_idx`.
    Gptq {
        bits: u64,
        group: Option<u64>,
        scope: Scope,
    },
    /// AWQ GEMM (`quant_method: "awq"`): packed int32 `qweight`, `qzeros`, fp16 `scales`.
    Awq {
        bits: u64,
        group: Option<u64>,
        scope: Scope,
    },
}

impl QuantKind {
    pub fn name(self) -> &'static str {
        match self {
            QuantKind::Nf4 => "nf4",
            QuantKind::Fp4 => "fp4",
            QuantKind::Int8 => "int8",
            QuantKind::Mxfp4 { .. } => "mxfp4",
            QuantKind::Fp8 { .. } => "fp8",
            QuantKind::Gptq { .. } => "gptq",
            QuantKind::Awq { .. } => "awq",
        }
    }
    /// bitsandbytes' 4-bit types (nf4, fp4).
    pub fn is_4bit(self) -> bool {
        matches!(self, QuantKind::Nf4 | QuantKind::Fp4)
    }
    /// A bitsandbytes layout (a QLoRA-style frozen base), not a checkpoint's own format.
    pub fn is_bnb(self) -> bool {
        matches!(self, QuantKind::Nf4 | QuantKind::Fp4 | QuantKind::Int8)
    }
    /// The linears stored in this format (bitsandbytes: every linear of each layer).
    pub fn scope(self) -> Scope {
        match self {
            QuantKind::Mxfp4 { scope }
            | QuantKind::Fp8 { scope, .. }
            | QuantKind::Gptq { scope, .. }
            | QuantKind::Awq { scope, .. } => scope,
            _ => Scope::LINEARS,
        }
    }
}

/// Which linears of a decoder layer a checkpoint's method stores quantized (the rest, with
/// norms, biases, routers, embeddings and head, stays in the config's dtype).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Scope {
    /// The mixer's projections (attention q/k/v/o, MLA's, the recurrent mixers' in/out).
    pub mixer: bool,
    /// A dense MLP's projections.
    pub dense: bool,
    /// The routed experts' projections.
    pub experts: bool,
    /// The shared experts' projections.
    pub shared: bool,
}

impl Scope {
    /// Every linear of a layer but the router (bitsandbytes, FP8, GPTQ, AWQ).
    pub const LINEARS: Scope = Scope {
        mixer: true,
        dense: true,
        experts: true,
        shared: true,
    };
    /// The routed experts only (MXFP4: transformers swaps only `GptOssExperts`).
    pub const EXPERTS: Scope = Scope {
        mixer: false,
        dense: false,
        experts: true,
        shared: false,
    };
}

impl Default for Scope {
    fn default() -> Scope {
        Scope::LINEARS
    }
}

/// A quantized base (`BitsAndBytesConfig`), loaded the way QLoRA recipes load it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Quant {
    pub kind: QuantKind,
    /// `bnb_4bit_use_double_quant`: the per-64 absmax quantized to 8 bits with an fp32 absmax
    /// per 256 blocks.
    #[serde(default)]
    pub double_quant: bool,
    /// `bnb_4bit_compute_dtype` (the dequantized weight's type in each matmul); None: the
    /// workload's precision (fp32 for `fp32`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compute: Option<super::Precision>,
    /// PEFT's `prepare_model_for_kbit_training` in training (`--kbit-prep`, on by default):
    /// every non-quantized parameter upcast to fp32, so the residual stream runs in fp32, and
    /// gradient checkpointing on. Off: as LitGPT and torchtune train a 4-bit base (the rest
    /// stays in the precision's type).
    #[serde(default = "yes")]
    pub prepare: bool,
    /// The 4-bit layers keep their input on the autograd context (bitsandbytes before 0.44,
    /// `--bnb-version`): `MatMul4Bit.forward` sets `ctx.tensors = (A, B)` (0.42.0
    /// `autograd/_functions.py:516-525`), a plain attribute that PyTorch's engine does not
    /// release once the node has run, so each input lives as long as the autograd graph does.
    /// 0.44 keeps `(None, B)`.
    #[serde(default, skip_serializing_if = "super::is_false")]
    pub holds_input: bool,
    /// The output head quantized too (`--quant-head`): Lightning Fabric's
    /// `BitsandbytesPrecision` without `ignore_modules` converts every `nn.Linear`, as LitGPT
    /// uses it; transformers keeps `lm_head` unquantized (`get_keys_to_not_convert`).
    #[serde(default, skip_serializing_if = "super::is_false")]
    pub head: bool,
    /// The 4-bit weights were quantized from fp16: Lightning Fabric's `BitsandbytesPrecision`
    /// casts each weight to fp16 before `quantize_4bit` (`_Linear4bit.quantize`, lightning
    /// 2.3.0 `fabric/plugins/precision/bitsandbytes.py:334`), so `dequantize_4bit` returns fp16
    /// and `MatMul4Bit`'s `.to(A.dtype)` (bitsandbytes 0.42.0 `autograd/_functions.py:517`,
    /// and its backward's) copies it into a bf16 compute type: two dequantized weights at once.
    #[serde(default, skip_serializing_if = "super::is_false")]
    pub from_fp16: bool,
}

impl Quant {
    /// A checkpoint stored in `kind` (not bitsandbytes).
    pub fn stored(kind: QuantKind) -> Quant {
        Quant {
            kind,
            double_quant: false,
            compute: None,
            prepare: false,
            holds_input: false,
            head: false,
            from_fp16: false,
        }
    }

    /// A bitsandbytes base of `kind` as QLoRA recipes load it: double quantization on for
    /// 4-bit, the precision's compute type, PEFT's k-bit preparation, today's bitsandbytes.
    pub fn bnb(kind: QuantKind) -> Quant {
        Quant {
            kind,
            double_quant: kind.is_4bit(),
            compute: None,
            prepare: true,
            holds_input: false,
            head: false,
            from_fp16: false,
        }
    }
}

fn yes() -> bool {
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_parse_as_peft_names() {
        assert_eq!(Target::parse("q"), Some(vec![Target::Q]));
        assert_eq!(Target::parse("down_proj"), Some(vec![Target::Down]));
        assert_eq!(
            Target::parse("qkv_proj"),
            Some(vec![Target::Q, Target::K, Target::V])
        );
        assert_eq!(Target::parse("lm_head"), None);
    }
}
