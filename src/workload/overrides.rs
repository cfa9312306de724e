//! Apply command-line overrides to a workload, with checked parsing (exit 2 on bad input).
//!
//! The flag parsers (`count`, `parse_precision`, ..., also used by the config readers and the
//! layout and serving flags), and [`apply`]: every override over the base the caller loaded, each
//! parsed and checked. Every error is a `CliError::Usage` naming the flag. Things that are allowed
//! but worth a word (a `--seq` longer than the preset's context, ZeRO on one GPU) come back as
//! warnings for the caller to print. Loading the base and checking the result as a whole is
//! `crate::resolve`'s job.

use crate::error::CliError;

use super::args::WorkloadArgs;
use super::flags::*;
use super::presets::vit_tokens;
use super::{Arch, Attention, Checkpoint, Mode, Optimizer, Precision, Workload};

/// A resolved workload and the warnings a person should see.
#[derive(Debug, Clone, PartialEq)]
pub struct Resolved {
    pub workload: Workload,
    pub warnings: Vec<String>,
}

/// Apply `args`'s overrides to `w` (the preset or config the caller loaded), each parsed and
/// checked, with warnings. The shape as a whole is checked by the caller (`resolve`).
pub fn apply(args: &WorkloadArgs, mut w: Workload) -> Result<Resolved, CliError> {
    let mut warnings = Vec::new();
    let text = w.is_text_transformer();
    let shape_before = super::layers::Shape::of(&w);
    apply_shape(args, &mut w, text)?;
    apply_framework(args, &mut w)?;
    apply_head(args, &mut w)?;
    apply_numerics(args, &mut w, &mut warnings)?;
    apply_finetune(args, &mut w, &mut warnings)?;
    apply_layout(args, &mut w)?;
    apply_release(args, &mut w)?;
    finish(args, &mut w, &mut warnings, text, shape_before)?;
    Ok(Resolved {
        workload: w,
        warnings,
    })
}

/// `--framework`: LitGPT's model and LoRA, with its fine-tuning scripts' defaults (the chunked
/// head, the loop's held outputs, no KV cache), which the flags after it may override.
fn apply_framework(args: &WorkloadArgs, w: &mut Workload) -> Result<(), CliError> {
    use super::layers::Mixer;
    let Some(v) = &args.framework else {
        return Ok(());
    };
    w.framework = choice(
        "framework",
        v,
        &[
            ("transformers", super::Framework::Transformers),
            ("litgpt", super::Framework::Litgpt),
        ],
    )?;
    if w.framework.is_transformers() {
        return Ok(());
    }
    let attention_only = w.model.as_ref().is_none_or(|m| {
        m.layers
            .iter()
            .all(|l| matches!(l.mixer, Mixer::Attention(_)))
    });
    if !w.is_decoder_llm() || !attention_only {
        return Err(usage(
            "framework",
            format!(
                "litgpt is modelled for decoders of attention layers (LLaMA-style, phi, GPT-NeoX), not {}",
                w.name
            ),
        ));
    }
    w.loss_chunk = Some(128);
    w.outputs = super::Outputs::Next;
    w.kv_cache = false;
    Ok(())
}

/// `--head` and `--num-labels`: BERT's sequence-classification head in place of its masked-LM
/// head (transformers' `num_labels` is 2 unless a config says otherwise).
fn apply_head(args: &WorkloadArgs, w: &mut Workload) -> Result<(), CliError> {
    if let Some(v) = &args.head {
        let seq_cls = choice("head", v, &[("mlm", false), ("seq-cls", true)])?;
        if w.arch != Arch::Bert {
            return Err(usage(
                "head",
                format!(
                    "mlm and seq-cls are BERT's heads (BertForMaskedLM, BertForSequenceClassification), not {}'s",
                    w.name
                ),
            ));
        }
        w.labels = seq_cls.then(|| w.labels.unwrap_or(2));
    }
    if let Some(v) = &args.num_labels {
        let n = count("num-labels", v)?;
        if w.labels.is_none() {
            return Err(usage(
                "num-labels",
                "needs --head seq-cls (a BERT classifier)",
            ));
        }
        w.labels = Some(n);
    }
    Ok(())
}

/// `--torch-version` and `--attention-mask`: the release's own defaults where no flag says
/// otherwise (gradients kept, cuBLAS's workspace outside the pool and eager attention before
/// 2.0, every kernel loaded with the context before 1.13), and BERT's additive mask.
fn apply_release(args: &WorkloadArgs, w: &mut Workload) -> Result<(), CliError> {
    if let Some(v) = &args.attention_mask {
        w.attention_mask = on_off("attention-mask", v)?;
        if w.arch != Arch::Bert {
            return Err(usage(
                "attention-mask",
                format!(
                    "applies to BERT's eager attention (GPT-2 always adds its causal mask), not {}",
                    w.name
                ),
            ));
        }
    }
    let Some(v) = &args.torch_version else {
        return Ok(());
    };
    let r: super::Release = v.parse().map_err(|e| usage("torch-version", e))?;
    w.torch_version = Some(r);
    if r.zero_grad_keeps() && args.grads.is_none() && w.grads == super::Grads::Free {
        w.grads = super::Grads::Keep;
    }
    if !r.blas_in_pool() && args.cublas_workspace.is_none() {
        w.cublas_workspace = Some(0);
    }
    if !r.lazy_modules() && args.cuda_modules.is_none() {
        w.cuda_modules = super::ModuleLoading::Eager;
    }
    if !r.has_sdpa() && w.attention == Attention::Sdpa {
        if args.attention.is_some() {
            return Err(usage(
                "attention",
                format!("sdpa needs PyTorch 2.0 or later, not {r} (--torch-version)"),
            ));
        }
        w.attention = Attention::Naive;
    }
    Ok(())
}

/// The shape flags (`--batch` through `--params`), each refused where the model has no such part.
fn apply_shape(args: &WorkloadArgs, w: &mut Workload, text: bool) -> Result<(), CliError> {
    let name = w.name.clone();
    let arch = w.arch;
    let not_for = |flag: &str, why: &str| usage(flag, format!("does not apply to {name}: {why}"));
    if let Some(v) = &args.batch {
        w.batch = count("batch", v)?;
    }
    if let Some(v) = &args.layers {
        let n = count("layers", v)?;
        if arch == Arch::Dense {
            return Err(not_for("layers", "a bare parameter count has no layers"));
        }
        w.layers = n;
    }
    if let Some(v) = &args.hidden {
        if arch == Arch::Dense {
            return Err(not_for("hidden", "a bare parameter count has no layers"));
        }
        w.hidden = count("hidden", v)?;
    }
    for (flag, val, field) in [("heads", &args.heads, 0), ("ffn", &args.ffn, 1)] {
        if let Some(v) = val {
            if !w.is_transformer() {
                return Err(not_for(flag, "it is not a transformer"));
            }
            let n = count(flag, v)?;
            if field == 0 {
                w.heads = n;
            } else {
                w.ffn = n;
                // A mixture of experts' width is each expert's.
                if let Some(m) = w.moe.as_mut() {
                    m.expert_ffn = n;
                }
            }
        }
    }
    if let Some(v) = &args.vocab {
        if arch == Arch::Dense {
            return Err(not_for("vocab", "a bare parameter count has no vocabulary"));
        }
        w.vocab = count("vocab", v)?;
    }
    if let Some(v) = &args.image {
        let n = count("image", v)?;
        match arch {
            Arch::Resnet => w.image = n,
            Arch::Vit => {
                if n < w.patch {
                    return Err(usage(
                        "image",
                        format!("{n} px is smaller than the {} px patch", w.patch),
                    ));
                }
                w.image = n;
                w.seq = vit_tokens(n, w.patch);
                w.max_positions = w.seq;
            }
            _ => return Err(not_for("image", "it does not read images")),
        }
    }
    if let Some(v) = &args.seq {
        if !text {
            return Err(not_for(
                "seq",
                if arch == Arch::Vit {
                    "a ViT's sequence is (image/patch)² + 1; use --image"
                } else {
                    "it has no sequence"
                },
            ));
        }
        w.seq = count("seq", v)?;
    }
    if let Some(v) = &args.params {
        if arch != Arch::Dense {
            return Err(usage(
                "params",
                format!("a bare parameter count cannot be combined with the {name} model (resize it with --layers/--hidden)"),
            ));
        }
        w.params = Some(count("params", v)?);
    }
    Ok(())
}

/// The numerics and training-step flags (`--precision` through `--kv-cache`), with warnings.
fn apply_numerics(
    args: &WorkloadArgs,
    w: &mut Workload,
    warnings: &mut Vec<String>,
) -> Result<(), CliError> {
    let name = w.name.clone();
    let not_for = |flag: &str, why: &str| usage(flag, format!("does not apply to {name}: {why}"));
    if let Some(v) = &args.precision {
        w.precision = parse_precision(v)?;
    }
    if let Some(v) = &args.optimizer {
        w.optimizer = parse_optimizer(v)?;
    }
    if let Some(v) = &args.attention {
        w.attention = parse_attention(v)?;
        if !w.is_transformer() {
            warnings.push(format!(
                "--attention does not apply to {name} (no attention layers); ignored"
            ));
        }
    }
    if let Some(v) = &args.kv_heads {
        let n = count("kv-heads", v)?;
        if !w.is_decoder_llm() {
            return Err(not_for(
                "kv-heads",
                "its attention has one key/value head per query head (grouped-query attention is for the LLaMA-style decoders)",
            ));
        }
        w.kv_heads = Some(n);
    }
    for (flag, val) in [
        ("experts", &args.experts),
        ("experts-per-token", &args.experts_per_token),
    ] {
        if let Some(v) = val {
            let n = count(flag, v)?;
            let Some(m) = w.moe.as_mut() else {
                return Err(not_for(flag, "it has no mixture of experts"));
            };
            if flag == "experts" {
                m.experts = n;
                m.top_k = m.top_k.min(n);
            } else {
                m.top_k = n;
            }
        }
    }
    if let Some(v) = &args.autocast_device {
        w.autocast_device = parse_autocast_device(v)?;
    }
    if let Some(v) = &args.checkpoint {
        w.checkpoint = parse_checkpoint(v)?;
        if !w.is_transformer() && w.checkpoint != Checkpoint::None {
            warnings.push(format!(
                "--checkpoint is not modelled for {name}; all activations are stored"
            ));
        }
    }
    if let Some(v) = &args.dropout {
        w.dropout = parse_dropout(v)?;
    }
    if let Some(v) = &args.zero {
        w.zero = parse_zero(v)?;
    }
    if let Some(v) = &args.gpus {
        w.gpus = count("gpus", v)?;
    }
    if let Some(v) = &args.mode {
        w.mode = parse_mode(v)?;
        if w.mode == Mode::Train && w.optimizer == Optimizer::None {
            return Err(usage(
                "mode",
                "train needs an optimizer (--optimizer none means an inference forward)",
            ));
        }
    }
    if let Some(v) = &args.grads {
        w.grads = parse_grads(v)?;
    }
    if let Some(v) = &args.step {
        w.step = parse_step(v)?;
    }
    if let Some(v) = &args.dropout_mask {
        w.dropout_mask = parse_dropout_mask(v)?;
    }
    if let Some(v) = &args.outputs {
        w.outputs = parse_outputs(v)?;
    }
    if let Some(v) = &args.optimizer_impl {
        w.optimizer_impl = Some(parse_optimizer_impl(v)?);
    }
    if let Some(v) = &args.gelu {
        w.gelu = parse_gelu(v)?;
    }
    if let Some(v) = &args.cuda_modules {
        w.cuda_modules = match v.to_ascii_lowercase().as_str() {
            "lazy" => super::ModuleLoading::Lazy,
            "eager" | "default" => super::ModuleLoading::Eager,
            _ => {
                return Err(usage(
                    "cuda-modules",
                    format!("expected lazy or eager, not '{}'", v.escape_debug()),
                ))
            }
        };
    }
    if let Some(v) = &args.cublas_workspace {
        let bytes = match v.trim() {
            "0" | "off" | "none" => 0,
            v => crate::units::parse_size(v).map_err(|e| usage("cublas-workspace", e))?,
        };
        if bytes > 1 << 40 {
            return Err(usage("cublas-workspace", format!("{v} is more than 1 TiB")));
        }
        w.cublas_workspace = Some(bytes);
    }
    if let Some(v) = &args.loss_chunk {
        w.loss_chunk = match v.trim() {
            "0" | "off" => None,
            v => Some(super::flags::count("loss-chunk", v)?),
        };
    }
    if let Some(v) = &args.float8 {
        w.float8 = match v.to_ascii_lowercase().as_str() {
            "off" | "none" => super::Float8::Off,
            "tensorwise" => super::Float8::Tensorwise,
            "tensorwise-all-gather" => super::Float8::TensorwiseAllGather,
            "rowwise" => super::Float8::Rowwise,
            _ => {
                return Err(usage(
                    "float8",
                    format!(
                        "expected off, tensorwise, tensorwise-all-gather or rowwise, not '{}'",
                        v.escape_debug()
                    ),
                ))
            }
        };
    }
    if let Some(v) = &args.optimizer_in_backward {
        w.optimizer_in_backward = parse_dropout(v).map_err(|_| {
            usage(
                "optimizer-in-backward",
                format!("expected on or off, not '{v}'"),
            )
        })?;
    }
    if let Some(v) = &args.kv_cache {
        w.kv_cache = parse_dropout(v)
            .map_err(|_| usage("kv-cache", format!("expected on or off, not '{v}'")))?;
    }
    Ok(())
}

/// The serving flags, then the training layout flags (refused when serving, which splits by `--tp`).
fn apply_layout(args: &WorkloadArgs, w: &mut Workload) -> Result<(), CliError> {
    super::serve::apply(w, &args.serve, args.config.as_deref())?;
    if w.mode == Mode::Serve {
        if args.parallel != Default::default() {
            return Err(CliError::usage(
                "--fsdp, --ddp, --pp, --cp, --dp and the other layout flags are training's: a serving engine splits by --tp",
            ));
        }
    } else {
        super::parallel::apply(
            w,
            &args.parallel,
            args.serve.tp.as_deref(),
            args.gpus.is_some(),
        )?;
    }
    Ok(())
}

/// The result's last checks and notes: inference drops the optimizer, Gemma 2 refuses sdpa, etc.
fn finish(
    args: &WorkloadArgs,
    w: &mut Workload,
    warnings: &mut Vec<String>,
    text: bool,
    shape_before: super::layers::Shape,
) -> Result<(), CliError> {
    let name = w.name.clone();
    // An inference forward steps no optimizer: the workload says none, in the text and the JSON.
    if w.inference() && w.optimizer != Optimizer::None {
        if let Some(o) = &args.optimizer {
            warnings.push(format!(
                "--optimizer {o} does not apply to --mode {} (no optimizer step); ignored",
                if w.mode == Mode::Serve {
                    "serve"
                } else {
                    "inference"
                }
            ));
        }
        w.optimizer = Optimizer::None;
        w.optimizer_impl = None;
    }
    // transformers' Gemma 2 has no SDPA path (`_supports_sdpa = False`): what would run is not
    // what was asked, so say so instead of planning it.
    if w.arch == super::Arch::Gemma2 && w.attention == Attention::Sdpa {
        return Err(CliError::usage(format!(
            "attention sdpa for {name}: transformers does not run Gemma 2 with sdpa (it soft-caps the attention scores, \
             `_supports_sdpa = False`): use eager (its default) or flash (flash-attn 2.6+ caps \
             in the kernel)"
        )));
    }
    if let Some(note) = super::layers::resync(w, shape_before) {
        warnings.push(note);
    }
    if text && w.max_positions > 0 && w.seq > w.max_positions {
        warnings.push(format!(
            "seq {} is longer than {name}'s context of {} tokens (allowed: a preset's context is a default, not a cap)",
            w.seq, w.max_positions
        ));
    }
    if w.zero > 0 && w.gpus == 1 {
        warnings.push(format!(
            "ZeRO stage {} with --gpus 1 shards nothing",
            w.zero
        ));
    }
    Ok(())
}

/// A probability in [0, 1).
fn probability(flag: &str, v: &str) -> Result<f64, CliError> {
    match v.trim().parse::<f64>() {
        Ok(p) if (0.0..1.0).contains(&p) => Ok(p),
        _ => Err(usage(
            flag,
            format!("expected a probability in [0, 1), not '{v}'"),
        )),
    }
}

/// `--lora*` and `--quant*`: the adapters and the quantized base (PEFT's and bitsandbytes'
/// defaults where a flag is absent; a config's `quantization_config` may have set `quant`).
fn apply_finetune(
    args: &WorkloadArgs,
    w: &mut Workload,
    warnings: &mut Vec<String>,
) -> Result<(), CliError> {
    apply_lora(args, w)?;
    apply_quant(args, w)?;
    check_finetune(args, w, warnings)
}

/// `--lora` and its `--lora-*` companions (refused without `--lora RANK`).
fn apply_lora(args: &WorkloadArgs, w: &mut Workload) -> Result<(), CliError> {
    use crate::workload::{Lora, Target};
    let lora_flags = [
        ("lora-targets", &args.lora_targets),
        ("lora-alpha", &args.lora_alpha),
        ("lora-dropout", &args.lora_dropout),
    ];
    if let Some(v) = &args.lora {
        let rank = count("lora", v)?;
        let mut targets = Target::DEFAULT.to_vec();
        if let Some(t) = &args.lora_targets {
            targets = Vec::new();
            for part in t.split(',').filter(|p| !p.trim().is_empty()) {
                if matches!(part.trim(), "all-linear" | "all_linear" | "all") {
                    targets.extend(Target::ALL);
                    continue;
                }
                let Some(ts) = Target::parse(part) else {
                    return Err(usage(
                        "lora-targets",
                        format!("unknown module '{}' (q, k, v, o, gate, up, down, or all-linear; lm_head and embeddings are not adapted)", part.trim()),
                    ));
                };
                targets.extend(ts);
            }
            if targets.is_empty() {
                return Err(usage("lora-targets", "names no module"));
            }
        }
        targets.sort_unstable();
        targets.dedup();
        let alpha = match &args.lora_alpha {
            Some(a) => Some(
                a.trim()
                    .parse::<f64>()
                    .ok()
                    .filter(|x| x.is_finite() && *x > 0.0)
                    .ok_or_else(|| {
                        usage(
                            "lora-alpha",
                            format!("expected a positive number, not '{a}'"),
                        )
                    })?,
            ),
            None => None,
        };
        let dropout = match &args.lora_dropout {
            Some(p) => probability("lora-dropout", p)?,
            None => 0.0,
        };
        w.lora = Some(Lora {
            rank,
            targets,
            alpha,
            dropout,
        });
    } else if let Some((flag, _)) = lora_flags.iter().find(|(_, v)| v.is_some()) {
        return Err(usage(flag, "needs --lora RANK"));
    }
    Ok(())
}

/// `--quant`, `--kbit-prep`, `--double-quant` and `--quant-compute`: the bitsandbytes base.
fn apply_quant(args: &WorkloadArgs, w: &mut Workload) -> Result<(), CliError> {
    use crate::workload::{Quant, QuantKind};
    if let Some(v) = &args.quant {
        let kind = choice(
            "quant",
            v,
            &[
                ("nf4", QuantKind::Nf4),
                ("fp4", QuantKind::Fp4),
                ("int8", QuantKind::Int8),
            ],
        )?;
        let mut q = Quant::bnb(kind);
        if !w.framework.is_transformers() {
            // LitGPT: Fabric's BitsandbytesPrecision converts every linear, the head too, and
            // nothing upcasts the rest (no PEFT k-bit preparation); its configs' bnb.nf4 has no
            // double quantization (bnb.nf4-dq does); Fabric quantizes each weight from fp16.
            q.prepare = false;
            q.head = true;
            q.double_quant = false;
            q.from_fp16 = true;
        }
        w.quant = Some(q);
    }
    if let Some(v) = &args.kbit_prep {
        let on = parse_dropout(v)
            .map_err(|_| usage("kbit-prep", format!("expected on or off, not '{v}'")))?;
        match w.quant.as_mut() {
            Some(q) if q.kind.is_bnb() => q.prepare = on,
            _ => return Err(usage("kbit-prep", "needs --quant nf4|fp4|int8")),
        }
    }
    if let Some(v) = &args.double_quant {
        let on = parse_dropout(v)
            .map_err(|_| usage("double-quant", format!("expected on or off, not '{v}'")))?;
        match w.quant.as_mut() {
            Some(q) if q.kind.is_4bit() => q.double_quant = on,
            Some(_) => return Err(usage("double-quant", "applies to 4-bit bases (nf4, fp4)")),
            None => return Err(usage("double-quant", "needs --quant nf4|fp4")),
        }
    }
    if let Some(v) = &args.quant_compute {
        let p = choice(
            "quant-compute",
            v,
            &[
                ("bf16", Precision::Bf16),
                ("fp16", Precision::Fp16),
                ("fp32", Precision::Fp32),
            ],
        )?;
        match w.quant.as_mut() {
            Some(q) if q.kind.is_4bit() => q.compute = Some(p),
            Some(_) => return Err(usage("quant-compute", "applies to 4-bit bases (nf4, fp4)")),
            None => return Err(usage("quant-compute", "needs --quant nf4|fp4")),
        }
    }
    if let Some(v) = &args.bnb_version {
        let old = bnb_before_044(v)?;
        match w.quant.as_mut() {
            Some(q) if q.kind.is_4bit() => q.holds_input = old,
            Some(_) => return Err(usage("bnb-version", "applies to 4-bit bases (nf4, fp4)")),
            None => return Err(usage("bnb-version", "needs --quant nf4|fp4")),
        }
    }
    if let Some(v) = &args.quant_head {
        let on = parse_dropout(v)
            .map_err(|_| usage("quant-head", format!("expected on or off, not '{v}'")))?;
        match w.quant.as_mut() {
            Some(q) if q.kind.is_bnb() => q.head = on,
            _ => return Err(usage("quant-head", "needs --quant nf4|fp4|int8")),
        }
    }
    Ok(())
}

/// Whether bitsandbytes `v` (X.Y or X.Y.Z) predates 0.44, where `MatMul4Bit` stopped keeping
/// its input on the autograd context; 4-bit layers arrived in 0.39.0.
fn bnb_before_044(v: &str) -> Result<bool, CliError> {
    let bad = || {
        usage(
            "bnb-version",
            format!("expected a version like 0.42.0, not '{v}'"),
        )
    };
    let parts: Vec<&str> = v.trim().split('.').collect();
    if !(2..=3).contains(&parts.len()) {
        return Err(bad());
    }
    let mut nums = Vec::with_capacity(3);
    for p in &parts {
        nums.push(p.parse::<u64>().map_err(|_| bad())?);
    }
    let (major, minor) = (nums[0], nums[1]);
    if (major, minor) < (0, 39) {
        return Err(usage(
            "bnb-version",
            format!("bitsandbytes {v} has no 4-bit layers (they arrived in 0.39.0)"),
        ));
    }
    Ok((major, minor) < (0, 44))
}

/// Whether adapters or a quantized base fit the workload, and PEFT's k-bit gradient checkpointing.
fn check_finetune(
    args: &WorkloadArgs,
    w: &mut Workload,
    warnings: &mut Vec<String>,
) -> Result<(), CliError> {
    if let Some(q) = w.quant.filter(|q| !q.kind.is_bnb()) {
        return stored_base(w, q.kind);
    }
    if w.lora.is_none() && w.quant.is_none() {
        return Ok(());
    }
    let what = if w.lora.is_some() { "lora" } else { "quant" };
    if w.mode == Mode::Serve {
        return Err(usage(
            what,
            "serving adapters or a bitsandbytes base is not modelled (--mode serve sizes a 16-bit or fp8-KV model)",
        ));
    }
    let name = w.name.clone();
    let not_for = |flag: &str, why: &str| usage(flag, format!("does not apply to {name}: {why}"));
    if !w.is_decoder_llm() {
        return Err(not_for(
            what,
            "LoRA and quantized bases are modelled for the LLaMA-style decoders",
        ));
    }
    if w.moe.is_some() {
        return Err(not_for(
            what,
            "adapters over a mixture of experts are not modelled yet",
        ));
    }
    if w.precision.is_autocast() || w.precision == Precision::Mixed {
        return Err(usage(
            what,
            format!("--precision {} with adapters is not modelled yet: use bf16 or fp16 (a 16-bit base, fp32 adapters) or fp32", w.precision.name()),
        ));
    }
    if w.zero > 0 {
        return Err(usage(what, "ZeRO over adapters is not modelled"));
    }
    if w.quant.is_some() && w.lora.is_none() && !w.inference() {
        return Err(usage(
            "quant",
            "a quantized base trains only through adapters: add --lora RANK (or --mode inference)",
        ));
    }
    if w.quant.is_some_and(|q| q.head) && w.tied_head() {
        return Err(not_for(
            "quant-head",
            "its head is the token embedding (tied), which bitsandbytes leaves unquantized",
        ));
    }
    if w.quant.is_some_and(|q| q.prepare)
        && !w.inference()
        && args.checkpoint.is_none()
        && w.checkpoint == Checkpoint::None
    {
        // PEFT's prepare_model_for_kbit_training turns on gradient checkpointing by default.
        w.checkpoint = Checkpoint::Full;
        warnings.push("--quant: gradient checkpointing on, as prepare_model_for_kbit_training sets it (--checkpoint none to turn it off)".into());
    }
    Ok(())
}

/// A checkpoint stored in its own quantized format (a config's mxfp4, fp8, gptq or awq
/// `quantization_config`): its weights are sized for inference and serving; training it (PEFT
/// over GPTQ/AWQ layers, FP8 or MXFP4 training kernels) is not modelled, so it is refused.
fn stored_base(w: &Workload, kind: crate::workload::QuantKind) -> Result<(), CliError> {
    let m = kind.name();
    if w.lora.is_none() && w.inference() {
        return Ok(());
    }
    Err(usage(
        if w.lora.is_some() { "lora" } else { "mode" },
        format!("training a checkpoint stored as {m} is not modelled: use --mode inference or serve, or the unquantized model's config (with --lora, or --quant nf4 for QLoRA)"),
    ))
}
