//! Layout search: for a training workload on `--gpus N` cards of one memory size, the parallel
//! layouts (tensor × pipeline × data parallelism, the data-parallel ranks sharded by FSDP or
//! replicated by DDP, with and without full checkpointing) whose worst rank fits under
//! PyTorch's caching allocator, each with its per-rank peak, its max micro-batch (what the
//! allocator gets, and what the tensors alone would) and what the rank holds of model states and
//! activations. With a card from the table, each layout's ranks lose its non-PyTorch share and
//! one NCCL communicator per process group.

use serde::Serialize;

use crate::alloc::conf::AllocConf;
use crate::estimate::{breakdown, predicted_max, predicted_max_reserved, Card};
use crate::plan::build::PlanError;
use crate::plan::{ranks, Plan};
use crate::scenario::Scenario;
use crate::units::fmt_bytes;
use crate::workload::parallel::{self, Fsdp, Parallel};
use crate::workload::{Arch, Checkpoint, Workload};

/// One layout and what its worst rank holds.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LayoutFit {
    /// The layout as oomprobe's flags.
    pub flags: String,
    pub tp: u64,
    pub pp: u64,
    pub dp: u64,
    /// fsdp | ddp | none
    pub sharding: &'static str,
    pub sequence_parallel: bool,
    pub checkpoint: Checkpoint,
    /// The worst rank's peak at the workload's micro-batch (the tensors).
    pub peak_bytes: u64,
    /// What PyTorch's allocator may take on each card of this layout (the card's memory less
    /// what lives outside PyTorch: the CUDA context and the layout's NCCL communicators).
    pub usable_bytes: u64,
    pub worst_rank: u64,
    /// Parameters, gradients and optimizer state the worst rank holds at its peak.
    pub model_states_bytes: u64,
    /// Everything else at that peak (activations, attention, workspace, gathered weights).
    pub activations_bytes: u64,
    /// The workload's micro-batch fits under PyTorch's caching allocator.
    pub fits: bool,
    /// The largest micro-batch whose worst rank fits under PyTorch's caching allocator.
    pub max_micro_batch: Option<u64>,
    /// The largest by the tensors alone (no allocator rounding or caching).
    pub max_micro_batch_tensors: Option<u64>,
}

/// What the search found.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Layouts {
    pub gpus: u64,
    pub memory_bytes: u64,
    /// Layouts tried (every degree dividing what it splits).
    pub tried: usize,
    /// Layouts that fit at the workload's micro-batch.
    pub fitting: usize,
    /// The best few: fitting first, then by max micro-batch, then the fewest model-parallel
    /// GPUs.
    pub best: Vec<LayoutFit>,
}

/// Whether the search applies: a transformer trained on more than one GPU.
pub fn applies(w: &Workload) -> bool {
    w.gpus > 1 && w.is_text_transformer() && !w.inference() && w.arch != Arch::Bert
}

fn candidates(w: &Workload) -> Vec<Workload> {
    let mut out = Vec::new();
    let ckpts = if w.checkpoint == Checkpoint::Full {
        vec![Checkpoint::Full]
    } else {
        vec![w.checkpoint, Checkpoint::Full]
    };
    for tp in [1u64, 2, 4, 8] {
        for pp in [1u64, 2, 4, 8, 16] {
            if !w.gpus.is_multiple_of(tp * pp) {
                continue;
            }
            let dp = w.gpus / (tp * pp);
            let shardings: &[Option<Fsdp>] = if dp > 1 {
                &[Some(Fsdp::Full), None]
            } else {
                &[None]
            };
            for &fsdp in shardings {
                for &ck in &ckpts {
                    let mut c = w.clone();
                    c.zero = 0;
                    c.checkpoint = ck;
                    c.parallel = Parallel {
                        tp,
                        pp,
                        fsdp,
                        ddp_bucket_mb: (dp > 1 && fsdp.is_none()).then_some(25),
                        ..Parallel::default()
                    };
                    c.parallel.sequence_parallel = tp > 1;
                    if c.parallel.sequence_parallel && parallel::check(&c).is_err() {
                        c.parallel.sequence_parallel = false;
                    }
                    if parallel::check(&c).is_ok() {
                        out.push(c);
                    }
                }
            }
        }
    }
    out
}

fn flags(c: &Workload) -> String {
    let p = &c.parallel;
    let mut f = Vec::new();
    if p.tp > 1 {
        f.push(format!("--tp {}", p.tp));
        if p.sequence_parallel {
            f.push("--sequence-parallel".into());
        }
    }
    if p.pp > 1 {
        f.push(format!("--pp {}", p.pp));
    }
    match (p.fsdp, p.ddp_bucket_mb) {
        (Some(_), _) => f.push("--fsdp full".into()),
        (None, Some(_)) => f.push("--ddp".into()),
        _ => {}
    }
    if c.checkpoint == Checkpoint::Full {
        f.push("--checkpoint full".into());
    }
    if f.is_empty() {
        "(one GPU's plan on each)".into()
    } else {
        f.join(" ")
    }
}

/// Search the layouts of `w` on its `gpus` cards of `memory` bytes (a card of the table: its
/// total, less its non-PyTorch share per layout); the `limit` best are kept.
pub fn search(
    w: &Workload,
    memory: u64,
    table: Option<&crate::alloc::cards::Card>,
    limit: usize,
) -> Result<Layouts, PlanError> {
    let cands = candidates(w);
    let mut all = Vec::new();
    for c in &cands {
        let plan = match Plan::for_workload(c) {
            Ok(p) => p,
            // A layout a setting is not modelled under (op-level checkpointing with tensor
            // parallelism) is not offered.
            Err(PlanError::Overflow { .. } | PlanError::Unsupported(_)) => continue,
            Err(e) => return Err(e),
        };
        let card = Card {
            total: memory,
            non_pytorch: table.map_or(0, |k| k.non_pytorch_for(c)),
            conf: AllocConf::default(),
        };
        let usable = card.usable();
        let b = breakdown(&plan);
        let states = b.model_states();
        let fits = b.total <= usable
            && crate::alloc::timeline::replay(
                &plan,
                &card.conf,
                Some(usable),
                crate::alloc::timeline::STEPS,
                false,
            )
            .fits();
        let p = &c.parallel;
        all.push(LayoutFit {
            flags: flags(c),
            tp: p.tp,
            pp: p.pp,
            dp: c.dp(),
            sharding: match (p.fsdp, p.ddp_bucket_mb) {
                (Some(_), _) => "fsdp",
                (None, Some(_)) => "ddp",
                _ => "none",
            },
            sequence_parallel: p.sequence_parallel,
            checkpoint: c.checkpoint,
            peak_bytes: b.total,
            usable_bytes: usable,
            worst_rank: ranks::rank_of(&plan).unwrap_or(0),
            model_states_bytes: states,
            activations_bytes: b.total.saturating_sub(states),
            fits,
            max_micro_batch: predicted_max_reserved(c, Scenario::Batch, &card)?,
            max_micro_batch_tensors: predicted_max(c, Scenario::Batch, usable)?,
        });
    }
    let fitting = all.iter().filter(|l| l.fits).count();
    // Samples one forward sees across the GPUs: the micro-batch times the replicas.
    let samples = |l: &LayoutFit| l.max_micro_batch.map(|m| m.saturating_mul(l.dp));
    all.sort_by(|a, b| {
        b.fits
            .cmp(&a.fits)
            .then(samples(b).cmp(&samples(a)))
            .then((a.tp * a.pp).cmp(&(b.tp * b.pp)))
            .then(a.peak_bytes.cmp(&b.peak_bytes))
    });
    all.truncate(limit);
    Ok(Layouts {
        gpus: w.gpus,
        memory_bytes: memory,
        tried: cands.len(),
        fitting,
        best: all,
    })
}

/// The search as a person reads it.
pub fn render(l: &Layouts, batch: u64) -> String {
    let mut s = format!(
        "layouts on {} GPUs of {} ({} tried, {} fit at micro-batch {batch} with PyTorch's allocator):\n",
        l.gpus,
        fmt_bytes(l.memory_bytes),
        l.tried,
        l.fitting
    );
    if l.best.iter().all(|x| x.max_micro_batch.is_none()) {
        s.push_str("  none fits, even at micro-batch 1: more GPUs, or a smaller model\n");
        return s;
    }
    let wide = l.best.iter().map(|x| x.flags.len()).max().unwrap_or(0);
    for x in &l.best {
        s.push_str(&format!(
            "  {:<4} {:<wide$}  dp {:<3} rank {:<3} peak {} (states {}, activations {}), max micro-batch {} ({} by the tensors)\n",
            if x.fits { "fits" } else { "-" },
            x.flags,
            x.dp,
            x.worst_rank,
            fmt_bytes(x.peak_bytes),
            fmt_bytes(x.model_states_bytes),
            fmt_bytes(x.activations_bytes),
            x.max_micro_batch.map_or("none".into(), |m| m.to_string()),
            x.max_micro_batch_tensors
                .map_or("none".into(), |m| m.to_string())
        ));
    }
    s
}
