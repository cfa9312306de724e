//! Plan::for_value: dispatch to the builder of the workload's architecture and scenario.
//!
//! The scenario decides which dimension x sets: `params` → the parameter count of a bare
//! (Dense) model whose plan holds only model states (and the optimizer step over them); `batch`
//! and `activations` → the batch; `seq` → the sequence length (text transformers only). All byte
//! counts use checked u64 arithmetic; an overflow is `PlanError::Overflow` naming the tensor, its
//! shape and the dimension that was set.

use super::{params, resnet, transformer, Plan};
use crate::scenario::Scenario;
use crate::workload::{presets, Arch, Workload};

pub use super::builder::{prod, sum, Builder, PlanError};

/// A model's parameters: the total, what one token runs through (the routed experts it does
/// not reach left out) and a multimodal wrapper's vision tower, from its layers when a config
/// described them, else from the uniform shape (every layer's experts alike).
pub fn parameters(w: &Workload) -> Result<crate::workload::layers::Counts, PlanError> {
    if let (Some(m), None) = (&w.model, &w.lora) {
        return Ok(m.counts());
    }
    let total = param_count(w)?;
    let inactive = match (w.moe, w.arch) {
        (Some(m), a) if a != Arch::Dense => {
            let mats: u64 = 3;
            let per_expert = mats.saturating_mul(w.hidden).saturating_mul(m.expert_ffn);
            m.experts
                .saturating_sub(m.top_k)
                .saturating_mul(per_expert)
                .saturating_mul(w.layers)
        }
        _ => 0,
    };
    Ok(crate::workload::layers::Counts {
        total,
        active: total.saturating_sub(inactive),
        vision: 0,
    })
}

/// "8.03B params", "671.03B params (37.55B active)", with a vision tower's share named.
pub fn params_text(w: &Workload) -> String {
    use crate::units::fmt_count;
    match parameters(w) {
        Err(_) => "? params".into(),
        Ok(c) => {
            let mut s = format!("{} params", fmt_count(c.total));
            let mut extra = Vec::new();
            if c.active < c.total {
                extra.push(format!("{} active", fmt_count(c.active)));
            }
            if c.vision > 0 {
                extra.push(format!("{} in the vision tower", fmt_count(c.vision)));
            }
            if !extra.is_empty() {
                s.push_str(&format!(" ({})", extra.join(", ")));
            }
            s
        }
    }
}

/// Total trainable parameters of a workload's model (Dense: its `params`).
pub fn param_count(w: &Workload) -> Result<u64, PlanError> {
    match w.arch {
        Arch::Dense => w
            .params
            .filter(|&p| p > 0)
            .ok_or_else(|| PlanError::Invalid("a dense workload needs --params N".into())),
        Arch::Resnet => resnet::param_count(w),
        _ => transformer::param_count(w),
    }
}

/// Check the shape fields the architecture uses.
/// Optimizer-in-backward as torchtune runs it: one device, gradients freed by each step (it
/// cannot accumulate them, `recipes/full_finetune_single_device.py` refuses
/// `gradient_accumulation_steps > 1`), on the parameters themselves (no master copy).
fn in_backward_allowed(w: &Workload) -> Result<(), PlanError> {
    use crate::workload::{Grads, Precision};
    let refuse = |why: &str| Err(PlanError::Invalid(format!("optimizer-in-backward {why}")));
    if w.gpus > 1 || w.zero > 0 || !w.parallel.is_single() {
        return refuse("is planned on one device only (torchtune's single-device recipes); drop the layout flags");
    }
    if w.grads == Grads::Keep {
        return refuse("frees each gradient as it is stepped: it cannot keep them (--grads keep, gradient accumulation)");
    }
    if w.precision == Precision::Mixed {
        return refuse("steps PyTorch's optimizers on the parameters themselves: --precision mixed keeps master weights it does not model");
    }
    Ok(())
}

/// Where torchao's float8 training is planned: decoder LLMs with dense layers, trained (or run)
/// in bf16 (`--precision bf16`, or `amp-bf16` under FSDP2's mixed precision, as torchtitan),
/// the whole model (no adapters or quantized base); the float8 all-gather under FSDP.
fn float8_allowed(w: &Workload) -> Result<(), PlanError> {
    use crate::workload::{Float8, Precision};
    let refuse = |why: &str| Err(PlanError::Unsupported(format!("--float8 {why}")));
    let bf16 = w.precision == Precision::Bf16
        || (w.precision == Precision::AmpBf16 && w.parallel.fsdp.is_some());
    if !w.is_decoder_llm() || w.moe.is_some() {
        return refuse(
            "is planned for the dense decoder LLMs (torchao converts their layers' nn.Linear)",
        );
    }
    if !bf16 {
        return refuse("is planned in bf16 (--precision bf16, or amp-bf16 with --fsdp: FSDP2's bf16 mixed precision)");
    }
    if w.lora.is_some() || w.quant.is_some() {
        return refuse("is planned for training the whole model (no adapters or quantized base)");
    }
    if w.float8 == Float8::TensorwiseAllGather && w.parallel.fsdp.is_none() {
        return refuse("tensorwise-all-gather is FSDP2's float8 all-gather: it needs --fsdp");
    }
    Ok(())
}

/// FSDP1 (`--fsdp-version 1`) where it is modelled: sharded (FULL_SHARD, SHARD_GRAD_OP,
/// HYBRID_SHARD), a base that trains or LoRA adapters beside it (`use_orig_params`); not a
/// quantized base.
fn fsdp1_allowed(w: &Workload) -> Result<(), PlanError> {
    let refuse = |why: &str| Err(PlanError::Unsupported(format!("--fsdp-version 1 {why}")));
    if w.parallel.fsdp.is_none() {
        return refuse("is a form of FSDP: it needs --fsdp full, hybrid or shard-grad-op");
    }
    if w.quant.is_some() {
        return refuse(
            "with a quantized base is not planned (FSDP1 flattens only floating parameters)",
        );
    }
    if w.float8 != crate::workload::Float8::Off {
        return refuse("with --float8 is not planned (torchao's float8 all-gather is FSDP2's)");
    }
    Ok(())
}

pub fn validate(w: &Workload) -> Result<(), PlanError> {
    let need = |v: u64, what: &str| {
        if v == 0 {
            Err(PlanError::Invalid(format!(
                "{what} must be greater than zero"
            )))
        } else {
            Ok(())
        }
    };
    need(w.batch, "batch")?;
    need(w.gpus, "gpus")?;
    if w.zero > 3 {
        return Err(PlanError::Invalid(format!(
            "ZeRO stage {} does not exist (0..3)",
            w.zero
        )));
    }
    if let crate::workload::Checkpoint::Every(0) = w.checkpoint {
        return Err(PlanError::Invalid("checkpoint every:K needs K >= 1".into()));
    }
    if w.optimizer_in_backward && !w.inference() {
        in_backward_allowed(w)?;
    }
    if w.parallel.fsdp1 {
        fsdp1_allowed(w)?;
    }
    // (A bare parameter count, the params scenario's model, has no linears to convert.)
    if !w.float8.is_off() && w.arch != Arch::Dense {
        float8_allowed(w)?;
    }
    match w.arch {
        Arch::Dense => {
            param_count(w)?;
        }
        Arch::Resnet => {
            need(w.layers, "layers (ResNet depth)")?;
            need(w.hidden, "hidden (ResNet stem width)")?;
            need(w.image, "image")?;
            need(w.vocab, "classes (vocab)")?;
            resnet::stage_blocks(w.layers)?;
        }
        _ => {
            if let Some(m) = w.model.as_ref().filter(|_| !w.inference()) {
                let adapted = m
                    .first_mla()
                    .map(|_| "multi-head latent attention")
                    .or_else(|| m.recurrent_mixer().map(|r| r.name()));
                if let (Some(mixer), Some(_)) = (adapted, &w.lora) {
                    return Err(PlanError::Invalid(format!(
                        "{}: LoRA on {mixer} layers is not planned yet (PEFT's targets there are the mixer's own projections); full fine-tuning and inference are",
                        w.name
                    )));
                }
            }
            need(w.layers, "layers")?;
            need(w.hidden, "hidden")?;
            need(w.heads, "heads")?;
            need(w.ffn, "ffn")?;
            need(w.vocab, "vocab")?;
            need(w.seq, "seq")?;
            if w.head_dim.is_none() && !w.hidden.is_multiple_of(w.heads) {
                return Err(PlanError::Invalid(format!(
                    "heads ({}) must divide hidden ({})",
                    w.heads, w.hidden
                )));
            }
            if let Some(kv) = w.kv_heads {
                need(kv, "kv-heads")?;
                if !w.heads.is_multiple_of(kv) {
                    return Err(PlanError::Invalid(format!(
                        "kv-heads ({kv}) must divide heads ({}): each key/value head serves a whole group of query heads",
                        w.heads
                    )));
                }
            }
            if matches!(w.arch, Arch::Mixtral | Arch::Qwen2Moe | Arch::Qwen3Moe) {
                let m = w.moe.ok_or_else(|| {
                    PlanError::Invalid(format!("{} needs its experts (zero given)", w.name))
                })?;
                need(m.experts, "experts")?;
                need(m.expert_ffn, "the experts' ffn")?;
                if m.top_k == 0 || m.top_k > m.experts {
                    return Err(PlanError::Invalid(format!(
                        "experts per token ({}) must be between 1 and the {} experts",
                        m.top_k, m.experts
                    )));
                }
            }
            if w.arch == Arch::Vit {
                need(w.patch, "patch")?;
                if w.image < w.patch {
                    return Err(PlanError::Invalid(format!(
                        "image ({}) must be at least the patch size ({})",
                        w.image, w.patch
                    )));
                }
            }
        }
    }
    Ok(())
}

/// PyTorch's cuBLAS workspace on CUDA, default `CUBLAS_WORKSPACE_CONFIG=:4096:2:16:8`, that
/// is 8 MiB and 128 KiB (`parseChosenWorkspaceSize`, pytorch 26a3905
/// `aten/src/ATen/cuda/CublasHandlePool.cpp`; 32 MiB on Hopper, `Card::blas_workspace`).
pub const CUBLAS_WORKSPACE: u64 = 4096 * 1024 * 2 + 16 * 1024 * 8;

/// The step's matmuls run through cuBLAS, whose workspace for the (handle, stream) pair PyTorch
/// allocates through its caching allocator at the first matmul and keeps
/// (`setWorkspaceForHandle`): one block for the process, there before a steady step begins.
/// None on the CPU, for a bare parameter count (no matmul), with `--cublas-workspace 0`, and
/// not planned for a serving engine (`serve::profile_workload` sets 0).
fn blas_workspace(b: &mut Builder, w: &Workload) -> Result<(), PlanError> {
    let bytes = w.cublas_workspace.unwrap_or(CUBLAS_WORKSPACE);
    if w.arch == Arch::Dense
        || w.mode == crate::workload::Mode::Serve
        || w.autocast_device != crate::plan::autocast::Device::Cuda
        || bytes == 0
    {
        return Ok(());
    }
    // (Byte rows: a probe may split it into chunks of any size.)
    b.push(
        "cublas.workspace",
        super::Role::Workspace,
        super::DType::U8,
        &[bytes],
        1,
    )?;
    Ok(())
}

impl Plan {
    /// The plan of `workload` under `scenario` with the varied dimension set to `x`.
    pub fn for_value(workload: &Workload, scenario: Scenario, x: u64) -> Result<Plan, PlanError> {
        if x == 0 {
            return Err(PlanError::Invalid(format!(
                "{} must be greater than zero",
                scenario.dimension()
            )));
        }
        let mut w = workload.clone();
        match scenario {
            Scenario::Params => {
                w.arch = Arch::Dense;
                w.params = Some(x);
            }
            Scenario::Batch | Scenario::Activations => {
                if w.arch == Arch::Dense {
                    return Err(PlanError::Unsupported(format!(
                        "the {} scenario needs a model with layers (a bare parameter count has no activations)",
                        scenario.name()
                    )));
                }
                w.batch = x;
            }
            Scenario::Seq => {
                if !w.is_text_transformer() {
                    return Err(PlanError::Unsupported(format!(
                        "the seq scenario needs a text transformer (gpt2, bert, the LLaMA-style decoders), not {}",
                        w.name
                    )));
                }
                w.seq = x;
            }
        }
        validate(&w)?;
        let at = match w.arch {
            Arch::Dense => format!("with {x} params"),
            Arch::Resnet => format!("at batch={}", w.batch),
            _ => format!("at batch={}, seq={}", w.batch, w.seq),
        };
        let with_dim = |e: PlanError| match e {
            PlanError::Overflow { what } => PlanError::Overflow {
                what: format!("{at}, {what}"),
            },
            other => other,
        };
        let one = |w: &Workload| -> Result<Plan, PlanError> {
            let mut b = Builder::default();
            // A rank computes with its shard of the shape (tensor and context parallelism).
            let local = crate::workload::parallel::local_shape(w);
            blas_workspace(&mut b, w)?;
            match w.arch {
                Arch::Dense => params::build_dense(&mut b, &local, x).map_err(with_dim)?,
                Arch::Resnet => resnet::build(&mut b, &local).map_err(with_dim)?,
                _ => transformer::build(&mut b, &local).map_err(with_dim)?,
            }
            Ok(b.finish(w.clone(), scenario, x))
        };
        if w.parallel.is_single() {
            return one(&w);
        }
        super::ranks::plan(&w, one)
    }

    /// The plan of a workload at its own batch and sequence (Dense: at its parameter count).
    pub fn for_workload(w: &Workload) -> Result<Plan, PlanError> {
        match w.arch {
            Arch::Dense => Plan::for_value(w, Scenario::Params, param_count(w)?),
            _ => Plan::for_value(w, Scenario::Batch, w.batch),
        }
    }

    /// The value x a scenario starts from for this workload (its params, batch or seq).
    pub fn current_value(w: &Workload, scenario: Scenario) -> Result<u64, PlanError> {
        Ok(match scenario {
            Scenario::Params => param_count(w)?,
            Scenario::Batch | Scenario::Activations => w.batch,
            Scenario::Seq => w.seq,
        })
    }
}

/// The scenarios that make sense for a workload (estimate's boundaries, the probe suite).
pub fn scenarios_for(w: &Workload) -> Vec<Scenario> {
    match w.arch {
        Arch::Dense => vec![Scenario::Params],
        Arch::Resnet | Arch::Vit => vec![Scenario::Params, Scenario::Batch],
        _ => vec![
            Scenario::Params,
            Scenario::Batch,
            Scenario::Seq,
            Scenario::Activations,
        ],
    }
}

/// The default workload of a scenario (design.md's table): params → a dense fp32 Adam model
/// (1B parameters to start from); batch → resnet50 at 224 px; seq → one GPT-2-small layer
/// (hidden 768, 12 heads) at batch 1 with naive attention; activations → gpt2 (12 layers) at
/// seq 1024, no checkpointing. The probe scales these for small budgets.
pub fn default_workload(scenario: Scenario) -> Workload {
    let get = |n: &str| presets::get(n).unwrap_or_else(|_| presets::base(n, Arch::Dense));
    match scenario {
        Scenario::Params => get("dense"),
        Scenario::Batch => get("resnet50"),
        Scenario::Seq => {
            let mut w = get("gpt2");
            w.name = "gpt2-block".into();
            w.layers = 1;
            w.batch = 1;
            w
        }
        Scenario::Activations => {
            let mut w = get("gpt2");
            w.seq = 1024;
            w
        }
    }
}
