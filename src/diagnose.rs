//! Why a workload runs out of memory: which of the four causes dominates (model, batch,
//! sequence, stored activations), and what each remedy buys.
//!
//! Rules, in order, for a workload at its batch and sequence on `memory` bytes:
//! 1. all model states (weights + gradients + optimizer, at their own peak: held at once before
//!    the update) alone exceed memory → `model_too_large`;
//! 2. the whole plan fits → `fits`;
//! 3. the attention score terms (the s²-sized tensors: stored probabilities, dropout masks and
//!    outputs, and the naive-attention scores workspace) are at least half of everything that is
//!    not model state → `sequence_too_long`;
//! 4. even batch 1 does not fit → `activations_explode` (one sample's stored activations overflow
//!    what the model states leave; the seed's "drop the batch to 1 and it still OOMs" test);
//! 5. batch 1 fits: a deep transformer stack (≥ 24 layers) whose stored per-layer activations
//!    (the attention probabilities included) are ≥ 2/3 of the total and which full checkpointing would make fit at this batch →
//!    `activations_explode`; otherwise → `batch_too_large`.
//!
//! Remedies, each with its effect computed from the same plans: the max batch at this sequence,
//! the max sequence with flash attention, the max batch with full checkpointing, and the fewest
//! GPUs with ZeRO-1/2/3 at this batch and sequence.

use serde::{Deserialize, Serialize};

use crate::estimate::{breakdown, largest_true, predicted_max, Breakdown};
use crate::plan::build::PlanError;
use crate::plan::Plan;
use crate::scenario::Scenario;
use crate::units::{fmt_bytes, fmt_count};
use crate::workload::{Arch, Attention, Checkpoint, Workload};

/// JSON `cause` (contract names).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Cause {
    ModelTooLarge,
    BatchTooLarge,
    SequenceTooLong,
    ActivationsExplode,
    Fits,
}

impl Cause {
    pub fn name(self) -> &'static str {
        match self {
            Cause::ModelTooLarge => "model_too_large",
            Cause::BatchTooLarge => "batch_too_large",
            Cause::SequenceTooLong => "sequence_too_long",
            Cause::ActivationsExplode => "activations_explode",
            Cause::Fits => "fits",
        }
    }
}

/// One remedy and what it buys (JSON: name, effect; `value` is the computed number, if any).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Remedy {
    pub name: String,
    pub effect: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub value: Option<u64>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Diagnosis {
    pub schema_version: u32,
    pub workload: Workload,
    /// Additive (issue 44): total, active and vision-tower parameters.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub parameters: Option<crate::workload::layers::Counts>,
    pub memory_bytes: u64,
    /// Additive (issue 47): whether the step fits on `memory_bytes`, the tensors' peak and
    /// PyTorch's reserved peak against it, and the ratio.
    pub fit: crate::alloc::fit::Fit,
    pub breakdown: Breakdown,
    /// Additive (issue 47): params + gradients + optimizer state at their own peak (all held at
    /// once, before the update); `breakdown` has them at the step's peak.
    pub model_states_bytes: u64,
    pub cause: Cause,
    /// One sentence: why this cause.
    pub reason: String,
    pub remedies: Vec<Remedy>,
    /// With `--gpus N` (N > 1): the parallel layouts that fit on N such cards.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub layouts: Option<crate::layouts::Layouts>,
    /// A training step that does not fit: the combinations of changes that do, best first
    /// (`crate::ways`; over `--gpus N` cards, else up to 8).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ways: Option<crate::ways::Ways>,
}

/// The most GPUs the ZeRO remedy searches over.
const MAX_GPUS: u64 = 1 << 24;

fn fits(w: &Workload, memory: u64) -> Result<bool, PlanError> {
    match Plan::for_workload(w) {
        Ok(p) => Ok(p.peak_bytes() <= memory),
        Err(PlanError::Overflow { .. }) => Ok(false),
        Err(e) => Err(e),
    }
}

/// Bytes of the s²-sized attention terms live at the plan's peak (stored probabilities, dropout
/// masks and outputs, score temporaries and their gradients).
fn quadratic_bytes(plan: &Plan) -> u64 {
    let s = plan.workload.seq;
    let peak = plan.peak();
    plan.live_after(peak.event + 1)
        .into_iter()
        .map(|t| &plan.tensors[t])
        .filter(|t| t.shape.len() == 4 && t.shape.ends_with(&[s, s]))
        .fold(0u64, |a, t| a.saturating_add(t.bytes))
}

/// Fewest GPUs with ZeRO stage `zero` at the workload's batch and sequence.
fn fewest_gpus(w: &Workload, zero: u8, memory: u64) -> Result<Option<u64>, PlanError> {
    let with = |n: u64| {
        let mut z = w.clone();
        z.zero = zero;
        z.gpus = n;
        z.parallel = Default::default();
        z
    };
    if !fits(&with(MAX_GPUS), memory)? {
        return Ok(None);
    }
    // Monotone decreasing in N: the largest N that does NOT fit, plus one.
    let not_fit = largest_true(|n| Ok::<_, PlanError>(n < MAX_GPUS && !fits(&with(n), memory)?))?;
    Ok(Some(not_fit.map_or(1, |n| n + 1)))
}

/// The adapters users reach for when full fine-tuning does not fit (decoder LLMs): LoRA r16 on
/// every linear over a 16-bit base, and QLoRA (nf4, double quantization, bf16 compute) with
/// checkpointing as `prepare_model_for_kbit_training` turns it on; each with the batch it buys.
fn finetune_remedies(w: &Workload, memory: u64) -> Result<Vec<Remedy>, PlanError> {
    use crate::workload::{Lora, Precision, Quant, QuantKind, Target};
    if !w.is_decoder_llm() || w.moe.is_some() || w.lora.is_some() || w.inference() {
        return Ok(Vec::new());
    }
    let mut base = w.clone();
    base.zero = 0;
    base.gpus = 1;
    base.parallel = Default::default();
    if !matches!(base.precision, Precision::Bf16 | Precision::Fp16) {
        base.precision = Precision::Bf16;
    }
    // Adapters under torchtitan's op-level checkpointing are not modelled: PEFT's runs
    // checkpoint whole layers.
    if base.checkpoint == Checkpoint::Ops {
        base.checkpoint = Checkpoint::Full;
    }
    base.lora = Some(Lora {
        rank: 16,
        targets: Target::ALL.to_vec(),
        alpha: None,
        dropout: 0.0,
    });
    let mut q = base.clone();
    q.quant = Some(Quant {
        kind: QuantKind::Nf4,
        double_quant: true,
        prepare: true,
        compute: Some(Precision::Bf16),
        ..Quant::bnb(QuantKind::Nf4)
    });
    q.checkpoint = Checkpoint::Full;
    let mut ck = base.clone();
    ck.checkpoint = Checkpoint::Full;
    let at = format!(" at seq {}", w.seq);
    let mut out = Vec::new();
    for (name, v) in [
        (
            format!("LoRA r16 all-linear ({} base)", base.precision.name()),
            base.clone(),
        ),
        (
            format!(
                "LoRA r16 all-linear ({} base, checkpointing)",
                base.precision.name()
            ),
            ck,
        ),
        ("QLoRA nf4 r16 all-linear (checkpointing)".to_string(), q),
    ] {
        let m = predicted_max(&v, Scenario::Batch, memory)?;
        out.push(Remedy {
            name,
            effect: match m {
                Some(x) => format!("max batch {x}{at}"),
                None => format!("no batch fits{at}"),
            },
            value: m,
        });
    }
    Ok(out)
}

/// Diagnose `w` (at its batch and sequence) on `memory` bytes.
/// (PyTorch's allocator with its default settings).
pub fn diagnose(w: &Workload, memory: u64) -> Result<Diagnosis, PlanError> {
    diagnose_on(w, memory, None, &crate::alloc::AllocConf::default())
}

/// `diagnose` on `memory` bytes of a card of the table (`card`: the layout search takes its
/// non-PyTorch share per layout), the allocator replayed with `conf`.
pub fn diagnose_on(
    w: &Workload,
    memory: u64,
    card: Option<&crate::alloc::cards::Card>,
    conf: &crate::alloc::AllocConf,
) -> Result<Diagnosis, PlanError> {
    let plan = Plan::for_workload(w)?;
    let fit = crate::alloc::fit::replayed(&plan, conf, memory);
    let b = breakdown(&plan);
    // All model states, gradients included (backward makes every one before the update).
    let states = plan.states_peak();
    let full_ckpt = {
        let mut c = w.clone();
        c.checkpoint = Checkpoint::Full;
        c
    };
    let (cause, mut reason) = cause_of(w, memory, &plan, &b, &full_ckpt)?;
    if let (Cause::Fits, Some(r)) = (cause, fit.reserved_bytes.filter(|_| !fit.fits)) {
        // The tensors fit; the headline says the allocator does not.
        reason.push_str(&format!(
            " by the tensors; PyTorch's allocator needs {}",
            fmt_bytes(r)
        ));
    }
    let remedies = remedies_for(w, memory, states, &full_ckpt)?;
    Ok(Diagnosis {
        schema_version: crate::report::SCHEMA_VERSION,
        parameters: crate::plan::build::parameters(w).ok(),
        workload: w.clone(),
        memory_bytes: memory,
        fit,
        breakdown: b,
        model_states_bytes: states,
        cause,
        reason,
        remedies,
        ways: if cause != Cause::Fits && w.is_text_transformer() && !w.inference() {
            Some(crate::ways::search(
                w,
                card.map_or(memory, |c| c.total),
                card,
                &crate::alloc::AllocConf::default(),
                if w.gpus > 1 {
                    w.gpus
                } else {
                    crate::ways::MAX_GPUS
                },
                6,
            )?)
        } else {
            None
        },
        layouts: if crate::layouts::applies(w) {
            Some(crate::layouts::search(
                w,
                card.map_or(memory, |c| c.total),
                card,
                6,
            )?)
        } else {
            None
        },
    })
}

/// The cause the plan's figures point to, and why, in the order the checks run.
fn cause_of(
    w: &Workload,
    memory: u64,
    plan: &Plan,
    b: &Breakdown,
    full_ckpt: &Workload,
) -> Result<(Cause, String), PlanError> {
    let states = plan.states_peak();
    let rest = b.non_states();
    let quad = quadratic_bytes(plan);
    let dense = w.arch == Arch::Dense;
    let batch1 = {
        let mut one = w.clone();
        one.batch = 1;
        one
    };
    Ok(if states > memory {
        (
            Cause::ModelTooLarge,
            format!(
                "all model states (params + grads + optimizer) alone need {} of {}",
                fmt_bytes(states),
                fmt_bytes(memory)
            ),
        )
    } else if b.total <= memory {
        (
            Cause::Fits,
            format!(
                "the step's peak {} fits in {}",
                fmt_bytes(b.total),
                fmt_bytes(memory)
            ),
        )
    } else if !dense && quad.saturating_mul(2) >= rest {
        (
            Cause::SequenceTooLong,
            format!(
                "attention scores (s² terms) take {} of {} activations at seq {}",
                fmt_bytes(quad),
                fmt_bytes(rest),
                w.seq
            ),
        )
    } else if !fits(&batch1, memory)? {
        (
            Cause::ActivationsExplode,
            format!(
                "even batch 1 does not fit: activations {} on top of {} of all model states",
                fmt_bytes(
                    Plan::for_workload(&batch1)?
                        .peak_bytes()
                        .saturating_sub(states)
                ),
                fmt_bytes(states)
            ),
        )
    } else if w.is_transformer()
        && w.layers >= 24
        && b.activations.saturating_add(b.attention).saturating_mul(3) >= b.total.saturating_mul(2)
        && w.checkpoint == Checkpoint::None
        && fits(full_ckpt, memory)?
    {
        (
            Cause::ActivationsExplode,
            format!(
                "{} layers of stored activations take {} of {}; checkpointing makes batch {} fit",
                w.layers,
                fmt_bytes(b.activations.saturating_add(b.attention)),
                fmt_bytes(b.total),
                w.batch
            ),
        )
    } else {
        (
            Cause::BatchTooLarge,
            format!(
                "batch 1 fits; batch {} needs {} of {}",
                w.batch,
                fmt_bytes(b.total),
                fmt_bytes(memory)
            ),
        )
    })
}

/// What would make it fit: a smaller batch, flash attention, checkpointing, fine-tuning
/// remedies when the model states alone are too large, and the GPUs each ZeRO stage needs.
fn remedies_for(
    w: &Workload,
    memory: u64,
    states: u64,
    full_ckpt: &Workload,
) -> Result<Vec<Remedy>, PlanError> {
    let dense = w.arch == Arch::Dense;
    let mut remedies = Vec::new();
    if !dense && states > memory {
        remedies.push(Remedy {
            name: "smaller batch or sequence".into(),
            effect: format!(
                "none helps: all model states alone need {}",
                fmt_bytes(states)
            ),
            value: None,
        });
    } else if !dense {
        let at = if w.is_text_transformer() {
            format!(" at seq {}", w.seq)
        } else {
            String::new()
        };
        let m = predicted_max(w, Scenario::Batch, memory)?;
        remedies.push(Remedy {
            name: "smaller batch".into(),
            effect: match m {
                Some(x) => format!("max batch {x}{at}"),
                None => format!("no batch fits{at}"),
            },
            value: m,
        });
        if w.is_text_transformer() && w.attention == Attention::Naive {
            let mut f = w.clone();
            f.attention = Attention::Flash;
            let naive = predicted_max(w, Scenario::Seq, memory)?;
            let flash = predicted_max(&f, Scenario::Seq, memory)?;
            let show = |x: Option<u64>| x.map_or("none".to_string(), |v| v.to_string());
            remedies.push(Remedy {
                name: "flash attention".into(),
                effect: format!(
                    "max seq {} at batch {} (naive: {})",
                    show(flash),
                    w.batch,
                    show(naive)
                ),
                value: flash,
            });
        }
        if w.is_transformer() && w.checkpoint == Checkpoint::None {
            let m = predicted_max(full_ckpt, Scenario::Batch, memory)?;
            remedies.push(Remedy {
                name: "checkpointing (full)".into(),
                effect: match m {
                    Some(x) => format!("max batch {x}{at} with full recompute"),
                    None => format!("no batch fits{at} even with full recompute"),
                },
                value: m,
            });
        }
    }
    if states > memory {
        remedies.extend(finetune_remedies(w, memory)?);
    }
    let finetune = w.lora.is_some() || w.quant.is_some_and(|q| q.kind.is_bnb());
    for zero in (1..=3u8).filter(|_| !finetune) {
        let n = fewest_gpus(w, zero, memory)?;
        remedies.push(Remedy {
            name: format!("ZeRO-{zero}"),
            effect: match n {
                Some(1) => "fits on 1 GPU".into(),
                Some(n) => format!("fits on {n} GPUs"),
                None => "no GPU count is enough (what is not sharded does not fit)".into(),
            },
            value: n,
        });
    }
    Ok(remedies)
}

/// The report a person reads in ten seconds: whether it fits first, then why.
pub fn render(d: &Diagnosis) -> String {
    let b = &d.breakdown;
    let mut s = String::new();
    s.push_str(&format!("{}\n", crate::alloc::fit::headline(&d.fit)));
    s.push_str(&format!("{}\n", crate::estimate::describe(&d.workload)));
    s.push_str(&format!(
        "memory {}; at the step's peak: model states {} (params {}, grads {}, optimizer {}), activations {}, attention {}, workspace {}, total {}\n",
        fmt_bytes(d.memory_bytes),
        fmt_bytes(b.model_states()),
        fmt_bytes(b.params),
        fmt_bytes(b.gradients),
        fmt_bytes(b.optimizer),
        fmt_bytes(b.activations),
        fmt_bytes(b.attention),
        fmt_bytes(b.workspace),
        fmt_bytes(b.total)
    ));
    if d.model_states_bytes != b.model_states() {
        s.push_str(&format!(
            "all model states {} (params + grads + optimizer, held at once before the update)\n",
            fmt_bytes(d.model_states_bytes)
        ));
    }
    s.push_str(&format!("cause: {} — {}\n", d.cause.name(), d.reason));
    s.push_str("remedies:\n");
    for r in &d.remedies {
        s.push_str(&format!("  {:<22} {}\n", r.name, r.effect));
    }
    if let Some(l) = &d.layouts {
        s.push_str(&crate::layouts::render(l, d.workload.batch));
    }
    if let Some(w) = &d.ways {
        s.push_str(&crate::ways::render(w));
    }
    if d.workload.arch == Arch::Dense {
        if let Ok(p) = crate::plan::build::param_count(&d.workload) {
            s.push_str(&format!("({} parameters)\n", fmt_count(p)));
        }
    }
    s
}
