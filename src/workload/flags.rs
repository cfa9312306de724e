//! The workload flags' parsers (`--batch`, `--precision`, `--checkpoint`, ...): each value
//! parsed and checked, an error naming the flag (exit 2); also the size limits the config
//! readers apply to a file's fields.

use crate::error::CliError;
use crate::units::parse_count;

use super::{
    Attention, AutocastDevice, Checkpoint, DropoutMask, Gelu, Grads, Mode, Optimizer,
    OptimizerImpl, Outputs, Precision, StepKind,
};

/// A usage error naming `--flag`.
pub(crate) fn usage(flag: &str, msg: impl std::fmt::Display) -> CliError {
    CliError::usage(format!("--{flag}: {msg}"))
}

/// Parse a positive count for `--flag`, within the flag's limit (see [`limit`]).
pub fn count(flag: &str, v: &str) -> Result<u64, CliError> {
    let n = parse_count(v).map_err(|e| usage(flag, e))?;
    check_limit(flag, n).map_err(|e| usage(flag, e))
}

/// The most micro-batches a pipeline step may have (`--microbatches`).
pub const MAX_MICROBATCHES: u64 = 4096;

/// The most lengths `estimate --seq-lengths` takes (each is one step's plan, replayed).
pub const MAX_SEQ_LENGTHS: u64 = 4096;

/// The lengths of `--seq-lengths`: integers ≥ 1 separated by commas, spaces or new lines (a
/// file of one length per batch, as a data loader's log gives them), each within `--seq`'s
/// limit, at most [`MAX_SEQ_LENGTHS`] of them.
pub fn parse_seq_lengths(text: &str) -> Result<Vec<u64>, String> {
    let mut out = Vec::new();
    for (i, tok) in text
        .split(|c: char| c == ',' || c.is_whitespace())
        .filter(|t| !t.is_empty())
        .enumerate()
    {
        if i as u64 >= MAX_SEQ_LENGTHS {
            return Err(format!("more than {MAX_SEQ_LENGTHS} lengths"));
        }
        let v: u64 = tok.parse().map_err(|_| {
            format!(
                "'{}' is not a length (a whole number >= 1)",
                tok.escape_debug()
            )
        })?;
        if v == 0 {
            return Err("a length of 0".into());
        }
        out.push(check_limit("seq", v)?);
    }
    if out.is_empty() {
        return Err("no lengths".into());
    }
    Ok(out)
}

/// The largest value a size may take, by its flag name (a config field maps to the same
/// size): anything above is a typo (the deepest published models have ~130 layers). They also
/// bound the cost of a plan, which holds a few tensors and events per layer: `estimate
/// --memory` of 2,048 layers takes under a second and ~50 MB (10,000 took 11 s and 200 MB).
pub fn limit(size: &str) -> Option<u64> {
    Some(match size {
        "layers" => 2048,
        "hidden" | "patch" => 1 << 20,
        "image" => 1 << 16,
        "heads" => 1 << 16,
        "experts" => 1 << 12,
        "ffn" => 1 << 24,
        "vocab" | "seq" | "batch" | "gpus" | "loss-chunk" => 1 << 24,
        "params" => 1 << 50,
        // Layout degrees: a stage holds at least one layer, heads split over --tp, the
        // sequence over 2·--cp; the data-parallel degree within --gpus.
        "pp" | "chunks" => 2048,
        "tp" | "cp" => 1 << 16,
        "dp" => 1 << 24,
        // A pipeline's plan holds a copy of the stage's micro-batch per micro-batch
        // (Megatron's largest published runs use a few thousand).
        "microbatches" => MAX_MICROBATCHES,
        // DDP's bucket_cap_mb, in MiB: 1 TiB is past any card.
        "ddp" => 1 << 20,
        _ => return None,
    })
}

/// `n` if it is within the limit of `size`, else why not.
pub fn check_limit(size: &str, n: u64) -> Result<u64, String> {
    match limit(size) {
        Some(max) if n > max => Err(format!("{n} is absurd for {size} (at most {max})")),
        _ => Ok(n),
    }
}

pub fn parse_precision(v: &str) -> Result<Precision, CliError> {
    match v.to_ascii_lowercase().as_str() {
        "fp32" | "f32" | "float32" => Ok(Precision::Fp32),
        "fp16" | "f16" | "float16" => Ok(Precision::Fp16),
        "bf16" | "bfloat16" => Ok(Precision::Bf16),
        "mixed" | "deepspeed-fp16" | "megatron-fp16" => Ok(Precision::Mixed),
        "amp-fp16" | "autocast-fp16" => Ok(Precision::AmpFp16),
        "amp-bf16" | "autocast-bf16" => Ok(Precision::AmpBf16),
        "amp" | "autocast" => Err(usage(
            "precision",
            format!(
                "'{v}' is ambiguous: torch.autocast is amp-fp16 or amp-bf16; DeepSpeed/Megatron fp16 is mixed"
            ),
        )),
        _ => Err(usage(
            "precision",
            format!("unknown precision '{v}' (fp32, fp16, bf16, mixed, amp-fp16, amp-bf16)"),
        )),
    }
}

pub fn parse_optimizer(v: &str) -> Result<Optimizer, CliError> {
    match v.to_ascii_lowercase().as_str() {
        "adam" | "adamw" => Ok(Optimizer::Adam),
        "sgd" => Ok(Optimizer::Sgd),
        "sgd-momentum" | "momentum" => Ok(Optimizer::SgdMomentum),
        "adamw-8bit" | "adamw8bit" | "adam-8bit" | "adamw_8bit" | "adamw_bnb_8bit" => {
            Ok(Optimizer::AdamW8bit)
        }
        "paged-adamw-8bit" | "paged_adamw_8bit" | "pagedadamw8bit" => {
            Ok(Optimizer::PagedAdamW8bit)
        }
        "lion" => Ok(Optimizer::Lion),
        "adafactor" => Ok(Optimizer::Adafactor),
        "adafactor-beta1" | "adafactor_beta1" => Ok(Optimizer::AdafactorBeta1),
        "none" | "inference" => Ok(Optimizer::None),
        _ => Err(usage(
            "optimizer",
            format!("unknown optimizer '{v}' (adam, sgd, sgd-momentum, adamw-8bit, paged-adamw-8bit, lion, adafactor, adafactor-beta1, none)"),
        )),
    }
}

pub fn parse_attention(v: &str) -> Result<Attention, CliError> {
    match v.to_ascii_lowercase().as_str() {
        "eager" | "naive" => Ok(Attention::Naive),
        "sdpa" => Ok(Attention::Sdpa),
        "flash" | "flash_attention_2" | "flash-attention-2" => Ok(Attention::Flash),
        _ => Err(usage(
            "attention",
            format!("unknown attention '{v}' (eager, sdpa, flash; naive = eager)"),
        )),
    }
}

pub fn parse_autocast_device(v: &str) -> Result<AutocastDevice, CliError> {
    choice(
        "autocast-device",
        v,
        &[("cuda", AutocastDevice::Cuda), ("cpu", AutocastDevice::Cpu)],
    )
}

pub fn parse_checkpoint(v: &str) -> Result<Checkpoint, CliError> {
    let l = v.to_ascii_lowercase();
    match l.as_str() {
        "none" | "off" => Ok(Checkpoint::None),
        "full" => Ok(Checkpoint::Full),
        "sqrt" => Ok(Checkpoint::Sqrt),
        "ops" | "selective-op" => Ok(Checkpoint::Ops),
        _ => match l.strip_prefix("every:") {
            Some(k) => {
                let k = parse_count(k)
                    .map_err(|e| usage("checkpoint", format!("every:K needs K >= 1 ({e})")))?;
                let k = u32::try_from(k).map_err(|_| {
                    usage("checkpoint", format!("every:K: K = {k} is absurdly large"))
                })?;
                Ok(Checkpoint::Every(k))
            }
            None => Err(usage(
                "checkpoint",
                format!("unknown mode '{v}' (none, full, sqrt, every:K, ops)"),
            )),
        },
    }
}

pub fn parse_dropout(v: &str) -> Result<bool, CliError> {
    on_off("dropout", v)
}

/// An on/off value of `--flag` (also true/false, yes/no, 1/0).
pub(crate) fn on_off(flag: &str, v: &str) -> Result<bool, CliError> {
    match v.to_ascii_lowercase().as_str() {
        "on" | "true" | "yes" | "1" => Ok(true),
        "off" | "false" | "no" | "0" => Ok(false),
        _ => Err(usage(flag, format!("expected on or off, not '{v}'"))),
    }
}

pub fn parse_zero(v: &str) -> Result<u8, CliError> {
    match v.trim() {
        "0" => Ok(0),
        "1" => Ok(1),
        "2" => Ok(2),
        "3" => Ok(3),
        _ => Err(usage(
            "zero",
            format!("ZeRO stage must be 0, 1, 2 or 3, not '{v}'"),
        )),
    }
}

/// Parse one of a flag's named values.
pub(crate) fn choice<T: Copy>(flag: &str, v: &str, values: &[(&str, T)]) -> Result<T, CliError> {
    let l = v.to_ascii_lowercase();
    values
        .iter()
        .find(|(n, _)| *n == l)
        .map(|&(_, t)| t)
        .ok_or_else(|| {
            let names: Vec<&str> = values.iter().map(|(n, _)| *n).collect();
            usage(flag, format!("unknown value '{v}' ({})", names.join(", ")))
        })
}

pub fn parse_mode(v: &str) -> Result<Mode, CliError> {
    choice(
        "mode",
        v,
        &[
            ("train", Mode::Train),
            ("inference", Mode::Inference),
            ("serve", Mode::Serve),
        ],
    )
}

pub fn parse_grads(v: &str) -> Result<Grads, CliError> {
    choice(
        "grads",
        v,
        &[
            ("free", Grads::Free),
            ("keep", Grads::Keep),
            ("until-backward", Grads::UntilBackward),
        ],
    )
}

pub fn parse_dropout_mask(v: &str) -> Result<DropoutMask, CliError> {
    choice(
        "dropout-mask",
        v,
        &[("bool", DropoutMask::Bool), ("input", DropoutMask::Input)],
    )
}

pub fn parse_outputs(v: &str) -> Result<Outputs, CliError> {
    choice(
        "outputs",
        v,
        &[
            ("kept", Outputs::Kept),
            ("dropped", Outputs::Dropped),
            ("next", Outputs::Next),
        ],
    )
}

pub fn parse_step(v: &str) -> Result<StepKind, CliError> {
    choice(
        "step",
        v,
        &[("steady", StepKind::Steady), ("first", StepKind::First)],
    )
}

pub fn parse_optimizer_impl(v: &str) -> Result<OptimizerImpl, CliError> {
    choice(
        "optimizer-impl",
        v,
        &[
            ("foreach", OptimizerImpl::Foreach),
            ("fused", OptimizerImpl::Fused),
            ("for-loop", OptimizerImpl::ForLoop),
            ("transformers", OptimizerImpl::Transformers),
        ],
    )
}

pub fn parse_gelu(v: &str) -> Result<Gelu, CliError> {
    choice(
        "gelu",
        v,
        &[("fused", Gelu::Fused), ("unfused", Gelu::Unfused)],
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seq_lengths_are_read_from_lists_and_files_within_bounds() {
        assert_eq!(
            parse_seq_lengths("512,1024 2048\n16\n"),
            Ok(vec![512, 1024, 2048, 16])
        );
        assert!(parse_seq_lengths("").is_err());
        assert!(parse_seq_lengths("12,0").is_err());
        assert!(parse_seq_lengths("12,x\u{1b}")
            .unwrap_err()
            .contains("\\u{1b}"));
        assert!(parse_seq_lengths(&"1 ".repeat(MAX_SEQ_LENGTHS as usize + 1)).is_err());
        let over = limit("seq").unwrap() + 1;
        assert!(parse_seq_lengths(&format!("16,{over}"))
            .unwrap_err()
            .contains("at most"));
    }
}
