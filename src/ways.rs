//! The ways out: combinations of changes that make a training step fit (precision, SDPA for
//! eager attention, optimizer, LoRA or QLoRA, checkpointing, FSDP over more cards, the micro-batch with gradient accumulation
//! to keep the global batch), each checked under PyTorch's caching allocator on the card and
//! ranked by what it costs in time (`crate::cost`, an estimate).
//!
//! Rules:
//! 1. A combination fits when its plan at micro-batch 1 fits under the allocator on every rank;
//!    its micro-batch is then the largest that fits, at most what keeps the global batch
//!    without accumulation, and the accumulation steps make up the rest.
//! 2. More cards are tried only while fewer do not fit without accumulation (a larger layout of
//!    the same changes costs more cards for nothing).
//! 3. Within one kind of training (full, LoRA, QLoRA), a way is dominated, and left out, by one
//!    as fast per card on no more cards whose changes are a subset of its own, or as many and
//!    reserving no more memory.
//! 4. Ranked by estimated tokens per second per GPU; `relative_cost` is the fastest's over
//!    this one's (1 for the fastest).
//!
//! Not searched yet: CPU offload (FSDP's `CPUOffloadPolicy`, ZeRO-Offload: the plan does not
//! model it), tensor and pipeline parallelism (the layout search under `--gpus N` has them),
//! selective checkpointing, shorter sequences.

use serde::Serialize;

use crate::alloc::timeline::{replay, STEPS};
use crate::alloc::{cards, AllocConf, Card};
use crate::plan::builder::PlanError;
use crate::plan::Plan;
use crate::units::fmt_bytes;
use crate::workload::parallel::{Fsdp, Parallel};
use crate::workload::{
    Attention, Checkpoint, Lora, Optimizer, Precision, Quant, QuantKind, Target, Workload,
};

/// One way out.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Way {
    /// What to change, as oomprobe's flags (the framework settings they stand for are in
    /// docs/src/finetune.md and docs/src/many-gpus.md); gradient accumulation as
    /// `gradient_accumulation_steps=K`.
    pub changes: Vec<String>,
    pub gpus: u64,
    pub fits: bool,
    /// The worst rank's tensors at the way's micro-batch, and what the allocator reserves.
    pub peak_bytes: u64,
    pub reserved_peak_bytes: u64,
    pub max_micro_batch: Option<u64>,
    pub micro_batch: u64,
    pub accumulation: u64,
    /// The fastest way's tokens/s per GPU over this one's (1 for the fastest).
    pub relative_cost: f64,
    /// Estimated (`crate::cost`); None where the card's peaks are not in the table.
    pub tokens_per_second_per_gpu: Option<f64>,
}

/// What the search found.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Ways {
    /// Sequences per optimizer step across the data-parallel ranks (the user's).
    pub global_batch: u64,
    pub memory_bytes: u64,
    pub tried: usize,
    pub fitting: usize,
    /// Best first.
    pub ways: Vec<Way>,
}

/// The largest card count tried when the question is about one card.
pub const MAX_GPUS: u64 = 8;

/// A candidate: the workload as changed, and its changes as flags.
struct Candidate {
    w: Workload,
    changes: Vec<String>,
}

fn adapters(w: &Workload) -> Vec<(Option<Lora>, Option<Quant>, Vec<String>)> {
    let mut out = vec![(None, None, Vec::new())];
    if w.is_decoder_llm() && w.moe.is_none() && w.lora.is_none() {
        let lora = Lora {
            rank: 16,
            targets: Target::ALL.to_vec(),
            alpha: None,
            dropout: 0.0,
        };
        let flags = vec!["--lora 16".to_string(), "--lora-targets all-linear".into()];
        out.push((Some(lora.clone()), None, flags.clone()));
        let q = Quant {
            kind: QuantKind::Nf4,
            double_quant: true,
            prepare: true,
            compute: Some(Precision::Bf16),
            ..Quant::bnb(QuantKind::Nf4)
        };
        let mut qf = flags;
        qf.push("--quant nf4".into());
        out.push((Some(lora), Some(q), qf));
    }
    out
}

/// Every combination of the axes, each as the workload it makes (one data-parallel rank's
/// view: `gpus` cards sharded by FSDP).
fn candidates(w: &Workload, max_gpus: u64) -> Vec<(Candidate, u64)> {
    let mut out = Vec::new();
    // Eager attention stores the [b, a, s, s] scores: SDPA's kernels do not.
    let attentions = if w.attention == Attention::Naive {
        vec![w.attention, Attention::Sdpa]
    } else {
        vec![w.attention]
    };
    let precisions = if matches!(w.precision, Precision::Fp32) {
        vec![w.precision, Precision::AmpBf16, Precision::Bf16]
    } else {
        vec![w.precision]
    };
    let gpu_counts: Vec<u64> = (0..)
        .map(|k| 1u64 << k)
        .take_while(|&g| g <= max_gpus.max(1))
        .collect();
    for (lora, quant, adapter_flags) in adapters(w) {
        let full = lora.is_none();
        let optimizers = if full {
            vec![
                w.optimizer,
                Optimizer::AdamW8bit,
                Optimizer::PagedAdamW8bit,
                Optimizer::Adafactor,
            ]
        } else {
            vec![w.optimizer]
        };
        let ckpts = if quant.is_some() || w.checkpoint == Checkpoint::Full {
            vec![Checkpoint::Full]
        } else {
            vec![w.checkpoint, Checkpoint::Full]
        };
        for (&precision, &attention) in precisions
            .iter()
            .flat_map(|p| attentions.iter().map(move |a| (p, a)))
        {
            for (oi, &opt) in optimizers.iter().enumerate() {
                if oi > 0 && opt == w.optimizer {
                    continue;
                }
                for &ck in &ckpts {
                    let counts: &[u64] = if full { &gpu_counts } else { &[1] };
                    for &g in counts {
                        let mut c = w.clone();
                        c.precision = if quant.is_some() || lora.is_some() {
                            match precision {
                                Precision::Fp16 => Precision::Fp16,
                                _ => Precision::Bf16,
                            }
                        } else {
                            precision
                        };
                        c.optimizer = opt;
                        c.attention = attention;
                        c.checkpoint = ck;
                        c.lora = lora.clone();
                        c.quant = quant;
                        c.zero = 0;
                        c.gpus = g;
                        c.parallel = Parallel {
                            fsdp: (g > 1).then_some(Fsdp::Full),
                            ..Parallel::default()
                        };
                        let mut changes = adapter_flags.clone();
                        if c.precision != w.precision {
                            changes.push(format!("--precision {}", c.precision.name()));
                        }
                        if attention != w.attention {
                            changes.push("--attention sdpa".into());
                        }
                        if opt != w.optimizer {
                            changes.push(format!("--optimizer {}", opt.name()));
                        }
                        // QLoRA's `prepare_model_for_kbit_training` turns checkpointing on;
                        // said anyway, so the flags read as what the run does.
                        if ck != w.checkpoint {
                            changes.push("--checkpoint full".into());
                        }
                        if g > 1 {
                            changes.push(format!("--gpus {g} --fsdp full"));
                        }
                        out.push((Candidate { w: c, changes }, g));
                    }
                }
            }
        }
    }
    out
}

/// Whether `w` fits on `card` under the allocator: (fits, tensors' peak, reserved peak).
fn check(w: &Workload, card: &Card) -> Result<Option<Need>, PlanError> {
    let plan = match Plan::for_workload(w) {
        Ok(p) => p,
        // A way a setting is not modelled under (op-level checkpointing under autocast) is not
        // offered.
        Err(PlanError::Overflow { .. } | PlanError::Unsupported(_)) => return Ok(None),
        Err(e) => return Err(e),
    };
    let usable = card.usable();
    let peak = plan.peak_bytes();
    if peak > usable {
        return Ok(None);
    }
    let r = replay(&plan, &card.conf, Some(usable), STEPS, false);
    Ok(r.fits().then_some((peak, r.reserved_peak_bytes)))
}

/// The card a candidate runs on: `total`, less the table card's share outside PyTorch for the
/// candidate's layout (its NCCL communicators too).
fn card_for(w: &Workload, total: u64, table: Option<&cards::Card>, conf: &AllocConf) -> Card {
    Card {
        total,
        non_pytorch: table.map_or(0, |k| k.non_pytorch_for(w)),
        conf: conf.clone(),
    }
}

/// What a fitting step needs: (the tensors' peak, the allocator's reserved peak).
type Need = (u64, u64);

/// The largest micro-batch up to `wanted` that fits (monotone in the micro-batch), with what it
/// needs; None when not even 1 fits. Each size is checked once.
fn largest_fitting(
    wanted: u64,
    mut fits_at: impl FnMut(u64) -> Result<Option<Need>, PlanError>,
) -> Result<Option<(u64, Need)>, PlanError> {
    let Some(mut at) = fits_at(1)? else {
        return Ok(None);
    };
    if wanted == 1 {
        return Ok(Some((1, at)));
    }
    if let Some(p) = fits_at(wanted)? {
        return Ok(Some((wanted, p)));
    }
    let (mut lo, mut hi) = (1u64, wanted);
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        match fits_at(mid)? {
            Some(p) => {
                lo = mid;
                at = p;
            }
            None => hi = mid,
        }
    }
    Ok(Some((lo, at)))
}

/// Search the ways out for `w` (its `batch` per rank times its data-parallel ranks is the
/// global batch kept) on cards of `total` bytes (`table`: which card, for its share outside
/// PyTorch and its peaks), over at most `max_gpus` cards; the `limit` best are kept.
pub fn search(
    w: &Workload,
    total: u64,
    table: Option<&cards::Card>,
    conf: &AllocConf,
    max_gpus: u64,
    limit: usize,
) -> Result<Ways, PlanError> {
    let global = w.batch.max(1).saturating_mul(w.dp().max(1));
    let peak = table.and_then(|t| crate::cost::peaks::get(t.id));
    let cands = candidates(w, max_gpus);
    let tried = cands.len();
    let mut found: Vec<Way> = Vec::new();
    // Changes (less the card count) that already fit without accumulation on fewer cards.
    let mut settled: Vec<Vec<String>> = Vec::new();
    for (c, g) in cands {
        let key: Vec<String> = c
            .changes
            .iter()
            .filter(|f| !f.starts_with("--gpus"))
            .cloned()
            .collect();
        if settled.contains(&key) {
            continue;
        }
        // What lives outside PyTorch depends on the layout (its communicators), not the batch.
        let card = card_for(&c.w, total, table, conf);
        let fits_at = |m: u64| -> Result<Option<Need>, PlanError> {
            let mut x = c.w.clone();
            x.batch = m;
            check(&x, &card)
        };
        let Some((micro, at)) = largest_fitting(global.div_ceil(g).max(1), fits_at)? else {
            continue;
        };
        let accumulation = global.div_ceil(micro * g).max(1);
        if accumulation == 1 {
            settled.push(key);
        }
        let mut changes = c.changes.clone();
        if micro != w.batch {
            changes.push(format!("--batch {micro}"));
        }
        if accumulation > 1 {
            changes.push(format!("gradient_accumulation_steps={accumulation}"));
        }
        let tps = peak.and_then(|p| {
            let mut x = c.w.clone();
            x.batch = micro;
            let mut s = crate::cost::shape_of(&x).ok()?;
            s.accumulation = accumulation;
            Some(s.cost(p).tokens_per_second_per_gpu)
        });
        found.push(Way {
            changes,
            gpus: g,
            fits: true,
            peak_bytes: at.0,
            reserved_peak_bytes: at.1,
            max_micro_batch: Some(micro),
            micro_batch: micro,
            accumulation,
            relative_cost: 1.0,
            tokens_per_second_per_gpu: tps,
        });
    }
    let fitting = found.len();
    let speed = |w: &Way| w.tokens_per_second_per_gpu.unwrap_or(0.0);
    found.sort_by(|a, b| {
        speed(b)
            .total_cmp(&speed(a))
            .then(a.gpus.cmp(&b.gpus))
            .then(a.changes.len().cmp(&b.changes.len()))
    });
    // Full fine-tuning, LoRA and QLoRA train different things: each is weighed on its own.
    let kind = |w: &Way| -> Vec<String> {
        w.changes
            .iter()
            .filter(|f| f.starts_with("--lora") || f.starts_with("--quant"))
            .cloned()
            .collect()
    };
    // Rule 3: keep a way only if no way before it (faster or as fast) needs no more cards and
    // either no more changes or as many and no more memory.
    let mut kept: Vec<Way> = Vec::new();
    for way in found {
        let dominated = kept.iter().any(|k| {
            kind(k) == kind(&way)
                && k.gpus <= way.gpus
                && speed(k) >= speed(&way)
                && (k.changes.iter().all(|f| way.changes.contains(f))
                    || (k.changes.len() <= way.changes.len()
                        && k.reserved_peak_bytes <= way.reserved_peak_bytes))
        });
        if !dominated {
            kept.push(way);
        }
    }
    let best = kept.first().map_or(0.0, speed);
    for k in &mut kept {
        let s = speed(k);
        k.relative_cost = if s > 0.0 { best / s } else { 1.0 };
    }
    kept.truncate(limit);
    Ok(Ways {
        global_batch: global,
        memory_bytes: total,
        tried,
        fitting,
        ways: kept,
    })
}

/// Ways the text shows (`--json` has every one kept).
pub const SHOWN: usize = 3;

/// The ways as a person reads them: the best [`SHOWN`].
pub fn render(ways: &Ways) -> String {
    let more = if ways.ways.len() > SHOWN {
        format!(
            "; the best {SHOWN} of {}, --json lists all",
            ways.ways.len()
        )
    } else {
        String::new()
    };
    let mut s = format!(
        "ways out ({} combinations tried, {} fit{more}; global batch {} kept; time estimated, see docs/src/validation.md \"The cost model\"):\n",
        ways.tried, ways.fitting, ways.global_batch
    );
    if ways.ways.is_empty() {
        s.push_str(&format!(
            "  none fits on {} cards of {}: a smaller model, or more cards than {MAX_GPUS}\n",
            MAX_GPUS,
            fmt_bytes(ways.memory_bytes)
        ));
        return s;
    }
    for (i, w) in ways.ways.iter().take(SHOWN).enumerate() {
        let speed =
            w.tokens_per_second_per_gpu
                .map_or("speed unknown for this card".to_string(), |t| {
                    format!(
                        "~{t:.0} tokens/s per GPU, ×{:.2} the fastest's time",
                        w.relative_cost
                    )
                });
        s.push_str(&format!(
            "  {}. {} — {} GPU{}, micro-batch {}, peak {} (reserved {}), {speed}\n",
            i + 1,
            if w.changes.is_empty() {
                "(as given)".to_string()
            } else {
                w.changes.join(" ")
            },
            w.gpus,
            if w.gpus == 1 { "" } else { "s" },
            w.micro_batch,
            fmt_bytes(w.peak_bytes),
            fmt_bytes(w.reserved_peak_bytes),
        ));
    }
    s
}
