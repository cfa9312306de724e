//! Analytic estimate: the breakdown by role and the exact predicted max of each scenario.
//!
//! `predicted_max` is exact: the plan total is monotone non-decreasing in each scenario's
//! dimension, so an exponential search (1, 2, 4, ...) brackets the boundary and a binary search
//! finds the largest x whose plan fits, in O(log x) plans. The params scenario is exact to one
//! parameter. A plan whose size overflows u64 counts as not fitting.

use serde::{Deserialize, Serialize};

use crate::plan::build::PlanError;
use crate::plan::{CurvePoint, Peak, Phase, Plan, Role};
use crate::scenario::Scenario;
use crate::units::fmt_bytes;
use crate::workload::{Arch, Checkpoint, Gelu, Grads, OptimizerImpl, StepKind, Workload};

/// Bytes per role (JSON contract: these field names).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Breakdown {
    pub params: u64,
    pub gradients: u64,
    pub optimizer: u64,
    pub activations: u64,
    pub attention: u64,
    pub workspace: u64,
    pub total: u64,
}

impl Breakdown {
    /// Weights + gradients + optimizer state.
    pub fn model_states(&self) -> u64 {
        self.params
            .saturating_add(self.gradients)
            .saturating_add(self.optimizer)
    }
    /// Activations + attention + workspace.
    pub fn non_states(&self) -> u64 {
        self.activations
            .saturating_add(self.attention)
            .saturating_add(self.workspace)
    }
    /// (label, bytes) rows in contract order.
    pub fn rows(&self) -> [(&'static str, u64); 6] {
        [
            ("params", self.params),
            ("gradients", self.gradients),
            ("optimizer", self.optimizer),
            ("activations", self.activations),
            ("attention", self.attention),
            ("workspace", self.workspace),
        ]
    }
}

/// The breakdown by role at the plan's peak (`total` is the peak).
pub fn breakdown(plan: &Plan) -> Breakdown {
    breakdown_of(&plan.peak())
}

/// The breakdown by role of one moment of the timeline.
pub fn breakdown_of(peak: &Peak) -> Breakdown {
    let r = |role| peak.by_role.get(role);
    Breakdown {
        params: r(Role::Params),
        gradients: r(Role::Gradients),
        optimizer: r(Role::Optimizer),
        activations: r(Role::Activations),
        attention: r(Role::Attention),
        workspace: r(Role::Workspace),
        total: peak.bytes,
    }
}

/// Where the peak sits in the step, and the live-bytes curve (`estimate --json`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TimelineSummary {
    /// The phase of the peak (setup, forward, loss, backward, optimizer).
    pub peak_phase: Option<Phase>,
    /// The index of the event that reached the peak.
    pub peak_event: usize,
    /// The tensor whose allocation reached the peak.
    pub peak_tensor: Option<String>,
    pub events: usize,
    /// The most model-state bytes live at once (every gradient made, before the update).
    pub model_states_bytes: u64,
    /// Activation bytes live when backward starts (saved by forward and loss, held outputs).
    pub saved_bytes: u64,
    /// Live bytes after every allocation and free.
    pub curve: Vec<CurvePoint>,
}

/// The timeline summary of a plan.
pub fn timeline_summary(plan: &Plan) -> TimelineSummary {
    let peak = plan.peak();
    let peak_tensor = plan.peak_tensor(&peak).map(str::to_string);
    TimelineSummary {
        peak_phase: peak.phase,
        peak_event: peak.event,
        peak_tensor,
        events: plan.events.len(),
        model_states_bytes: plan.states_peak(),
        saved_bytes: plan.saved_bytes(),
        curve: plan.curve(),
    }
}

/// Whether the plan at x fits in `memory`: Ok(None) when its size overflows.
fn total_at(w: &Workload, scenario: Scenario, x: u64) -> Result<Option<u64>, PlanError> {
    match Plan::for_value(w, scenario, x) {
        Ok(p) => Ok(Some(p.peak_bytes())),
        Err(PlanError::Overflow { .. }) => Ok(None),
        Err(e) => Err(e),
    }
}

/// The largest x such that `fits(x)`, for a monotone predicate (true up to a point, then false);
/// None if `fits(1)` is false. Exponential bracketing, then binary search.
pub fn largest_true<E>(mut fits: impl FnMut(u64) -> Result<bool, E>) -> Result<Option<u64>, E> {
    if !fits(1)? {
        return Ok(None);
    }
    let mut lo = 1u64;
    let mut hi;
    loop {
        if lo == u64::MAX {
            return Ok(Some(lo));
        }
        let next = lo.saturating_mul(2);
        if fits(next)? {
            lo = next;
        } else {
            hi = next;
            break;
        }
    }
    // Invariant: fits(lo), !fits(hi).
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if fits(mid)? {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    Ok(Some(lo))
}

/// The largest value of the scenario's dimension whose plan total fits in `memory_bytes`;
/// None when even x = 1 does not fit.
pub fn predicted_max(
    w: &Workload,
    scenario: Scenario,
    memory_bytes: u64,
) -> Result<Option<u64>, PlanError> {
    largest_true(|x| Ok(total_at(w, scenario, x)?.is_some_and(|t| t <= memory_bytes)))
}

/// One predicted boundary (JSON contract: scenario, dimension, max).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Boundary {
    pub scenario: Scenario,
    pub dimension: String,
    /// The tensors' peak fits in the memory. None (null) when even 1 does not fit.
    pub max: Option<u64>,
    /// Additive (issue 31): PyTorch's caching allocator, replayed for two steps, never needs
    /// more than the card leaves it (the memory less what lives outside PyTorch): the max
    /// PyTorch gets.
    #[serde(default)]
    pub max_reserved: Option<u64>,
}

pub use crate::alloc::Card;

/// The largest value whose plan the caching allocator serves for two steps on `card`.
pub fn predicted_max_reserved(
    w: &Workload,
    scenario: Scenario,
    card: &Card,
) -> Result<Option<u64>, PlanError> {
    let usable = card.usable();
    largest_true(|x| match Plan::for_value(w, scenario, x) {
        // The tensors alone are a lower bound of what the allocator reserves.
        Ok(p) if p.peak_bytes() > usable => Ok(false),
        Ok(p) => Ok(crate::alloc::timeline::replay(
            &p,
            &card.conf,
            Some(usable),
            crate::alloc::timeline::STEPS,
            false,
        )
        .fits()),
        Err(PlanError::Overflow { .. }) => Ok(false),
        Err(e) => Err(e),
    })
}

/// Boundaries of every scenario sensible for the workload; with `card`, the caching
/// allocator's too.
pub fn boundaries(
    w: &Workload,
    memory_bytes: u64,
    card: Option<&Card>,
) -> Result<Vec<Boundary>, PlanError> {
    crate::plan::build::scenarios_for(w)
        .into_iter()
        .map(|s| {
            Ok(Boundary {
                scenario: s,
                dimension: s.dimension().to_string(),
                max: predicted_max(w, s, memory_bytes)?,
                max_reserved: card
                    .map(|c| predicted_max_reserved(w, s, c))
                    .transpose()?
                    .flatten(),
            })
        })
        .collect()
}

/// A one-line description of a workload for people.
pub fn describe(w: &Workload) -> String {
    let psi = crate::plan::build::params_text(w);
    let prec = w.precision.name();
    // Inference holds no optimizer and runs in eval mode (no dropout): the plan has neither.
    let opt = match w.optimizer {
        _ if w.inference() => "no optimizer (inference)",
        o => o.name(),
    };
    let mut s = match w.arch {
        Arch::Dense => format!("{}: {psi} (model states only)", w.name),
        Arch::Resnet => format!(
            "{}: ResNet-{}, width {}, {} px, {} classes, batch {}, {psi}",
            w.name, w.layers, w.hidden, w.image, w.vocab, w.batch
        ),
        _ => {
            let kv = match w.kv_heads {
                Some(1) => " (multi-query: 1 key/value head)".to_string(),
                Some(g) => format!(" ({g} key/value heads)"),
                None => String::new(),
            };
            let moe = w.moe.map_or(String::new(), |m| {
                format!(
                    ", {} experts (top {}, ffn {}{})",
                    m.experts,
                    m.top_k,
                    m.expert_ffn,
                    if m.shared_ffn > 0 {
                        format!(", shared {}", m.shared_ffn)
                    } else {
                        String::new()
                    }
                )
            });
            format!(
            "{}: {} layers, hidden {}, {} heads{kv}, ffn {}{moe}, {} {}, batch {}, seq {}, {psi}",
            w.name,
            w.layers,
            w.hidden,
            w.heads,
            w.ffn,
            w.vocab,
            if w.arch == Arch::Vit { "classes" } else { "vocab" },
            w.batch,
            w.seq
        )
        }
    };
    s.push_str(&format!(", {prec}, {opt}"));
    if w.inference() {
        s.push_str(", inference forward");
    } else {
        if w.optimizer == crate::workload::Optimizer::Adam {
            s.push_str(match w.optimizer_impl() {
                OptimizerImpl::Foreach => " (foreach)",
                OptimizerImpl::Fused => " (fused)",
                OptimizerImpl::ForLoop => " (for-loop)",
                OptimizerImpl::Transformers => " (transformers' for-loop AdamW)",
            });
        }
        match w.grads {
            Grads::Keep => s.push_str(", gradients kept"),
            Grads::UntilBackward => s.push_str(", gradients kept until the backward"),
            Grads::Free => {}
        }
        match w.outputs {
            crate::workload::Outputs::Dropped => {
                s.push_str(", outputs dropped before the backward")
            }
            crate::workload::Outputs::Next => {
                s.push_str(", outputs and their graph held until the next forward returns")
            }
            crate::workload::Outputs::Kept => {}
        }
        if w.step == StepKind::First {
            s.push_str(", first step");
        }
        if w.optimizer_in_backward {
            s.push_str(", stepped in the backward");
        }
        if !w.float8.is_off() {
            s.push_str(&format!(", float8 {}", w.float8.name()));
        }
    }
    if !w.framework.is_transformers() {
        s.push_str(", LitGPT's GPT and LoRA");
    }
    if let Some(q) = &w.quant {
        s.push_str(&format!(
            ", {} {}{}",
            q.kind.name(),
            if q.kind.is_bnb() {
                "base"
            } else {
                "weights as stored"
            },
            if q.double_quant {
                " (double quant)"
            } else {
                ""
            }
        ));
        if q.head {
            s.push_str(" and head");
        }
        if q.holds_input {
            s.push_str(", bitsandbytes before 0.44 (each 4-bit input held by the graph)");
        }
    }
    if let Some(l) = &w.lora {
        s.push_str(&format!(
            ", LoRA r{} on {}{}",
            l.rank,
            l.targets_label(),
            if l.dropout > 0.0 {
                format!(" (dropout {})", l.dropout)
            } else {
                String::new()
            }
        ));
    }
    if w.gelu == Gelu::Unfused && w.is_transformer() {
        s.push_str(", unfused gelu_new");
    }
    // transformers turns the cache off under gradient checkpointing in training.
    if w.kv_cache && (w.inference() || w.checkpoint == Checkpoint::None) {
        s.push_str(", KV cache kept");
    }
    if w.is_transformer() {
        s.push_str(&format!(
            ", {} attention",
            crate::plan::transformer::attention_summary(w)
        ));
        match w.checkpoint {
            Checkpoint::None => {}
            Checkpoint::Full => s.push_str(", full checkpointing"),
            Checkpoint::Sqrt => s.push_str(", sqrt checkpointing"),
            Checkpoint::Every(k) => s.push_str(&format!(", checkpoint every {k}")),
            Checkpoint::Ops => s.push_str(", op-level selective checkpointing"),
        }
        if w.dropout && !w.inference() {
            s.push_str(", dropout");
            if w.dropout_mask == crate::workload::DropoutMask::Input {
                s.push_str(" (the CPU's noise masks)");
            }
        }
    }
    if w.zero > 0 {
        s.push_str(&format!(", ZeRO-{} over {} GPUs", w.zero, w.gpus));
    }
    s
}

/// Share of `part` in `total` as a percentage string.
pub fn share(part: u64, total: u64) -> String {
    if total == 0 {
        "-".into()
    } else {
        format!("{:.1}%", part as f64 * 100.0 / total as f64)
    }
}

/// The breakdown at the peak as a table for people; `all_states` adds a row with every model
/// state (gradients included) when it differs from the states live at the peak.
pub fn breakdown_table(b: &Breakdown, all_states: u64) -> comfy_table::Table {
    let mut t = comfy_table::Table::new();
    t.load_preset(comfy_table::presets::NOTHING);
    t.set_header(vec!["role", "bytes", "size", "share"]);
    for (name, bytes) in b.rows() {
        t.add_row(vec![
            name.to_string(),
            bytes.to_string(),
            fmt_bytes(bytes),
            share(bytes, b.total),
        ]);
    }
    let ms = b.model_states();
    t.add_row(vec![
        "model states".into(),
        ms.to_string(),
        format!("{} ({:.2} GB)", fmt_bytes(ms), ms as f64 / 1e9),
        share(ms, b.total),
    ]);
    if all_states != ms {
        t.add_row(vec![
            "all model states".into(),
            all_states.to_string(),
            format!(
                "{} ({:.2} GB)",
                fmt_bytes(all_states),
                all_states as f64 / 1e9
            ),
            "-".into(),
        ]);
    }
    t.add_row(vec![
        "total".into(),
        b.total.to_string(),
        format!("{} ({:.2} GB)", fmt_bytes(b.total), b.total as f64 / 1e9),
        "100%".into(),
    ]);
    t
}

// --- `estimate --gpu list|all`: the card table and the workload on every card ---

/// `estimate --gpu list`.
pub fn card_list(json: bool) -> String {
    use crate::alloc::cards::CARDS;
    if json {
        let v: Vec<_> = CARDS
            .iter()
            .map(|c| {
                serde_json::json!({"id": c.id, "name": c.name, "arch": c.arch,
                    "total_bytes": c.total, "non_pytorch_bytes": c.non_pytorch,
                    "card_usable_bytes": c.total - c.non_pytorch, "source": c.source})
            })
            .collect();
        return format!("{}\n", serde_json::Value::Array(v));
    }
    let mut s = format!(
        "{:<11} {:<24} {:<7} {:>12} {:>12}  source\n",
        "id", "card", "arch", "CUDA total", "non-PyTorch"
    );
    for c in CARDS {
        s.push_str(&format!(
            "{:<11} {:<24} {:<7} {:>12} {:>12}  {}\n",
            c.id,
            c.name,
            c.arch,
            fmt_bytes(c.total),
            fmt_bytes(c.non_pytorch),
            c.source
        ));
    }
    s
}

/// One card's row of `estimate --gpu all`.
#[derive(Debug, Clone, serde::Serialize)]
pub struct CardRow {
    pub card: &'static str,
    pub total_bytes: u64,
    pub non_pytorch_bytes: u64,
    pub card_usable_bytes: u64,
    pub reserved_peak_bytes: u64,
    pub fits: bool,
    pub boundaries: Vec<Boundary>,
}

/// The workload on every card of the table. A plan does not depend on the card, so plans are
/// built once per value and shared ([`Plans`]); the cards' allocator replays run on the
/// machine's cores. Each card's row is what `estimate --gpu CARD` says.
pub fn all_cards(
    w: &crate::workload::Workload,
    conf: &crate::alloc::AllocConf,
) -> Result<Vec<CardRow>, crate::plan::build::PlanError> {
    let plan = crate::plan::Plan::for_workload(w)?;
    let cards = crate::alloc::cards::CARDS;
    let plans = Plans::new(w);
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .clamp(1, cards.len().max(1));
    let row = |c: &crate::alloc::cards::Card| -> Result<CardRow, PlanError> {
        let card = Card {
            total: c.total,
            non_pytorch: c.non_pytorch_for(w),
            conf: conf.clone(),
        };
        let usable = card.usable();
        let r = crate::alloc::timeline::replay(&plan, conf, Some(usable), 2, false);
        let mut boundaries = Vec::new();
        for s in crate::plan::build::scenarios_for(w) {
            let max = largest_true(|x| Ok(plans.peak(s, x)?.is_some_and(|t| t <= c.total)))?;
            let max_reserved = match max {
                None => None,
                Some(_) => largest_true(|x| plans.serves(s, x, &card.conf, usable))?,
            };
            boundaries.push(Boundary {
                scenario: s,
                dimension: s.dimension().to_string(),
                max,
                max_reserved,
            });
        }
        Ok(CardRow {
            card: c.id,
            total_bytes: c.total,
            non_pytorch_bytes: card.non_pytorch,
            card_usable_bytes: usable,
            reserved_peak_bytes: r.reserved_peak_bytes,
            fits: r.fits(),
            boundaries,
        })
    };
    let chunk = cards.len().div_ceil(threads).max(1);
    let parts: Vec<Result<Vec<CardRow>, PlanError>> = std::thread::scope(|scope| {
        let handles: Vec<_> = cards
            .chunks(chunk)
            .map(|part| scope.spawn(|| part.iter().map(&row).collect()))
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
            .collect()
    });
    let mut rows = Vec::with_capacity(cards.len());
    for part in parts {
        rows.extend(part?);
    }
    Ok(rows)
}

/// A plan shared between threads; None where its sizes overflow.
type SharedPlan = Option<std::sync::Arc<Plan>>;

/// A workload's plans by (scenario, value), built once and shared by the cards of
/// `--gpu all` (and their threads); None where the plan's sizes overflow.
struct Plans<'a> {
    w: &'a crate::workload::Workload,
    built: std::sync::Mutex<std::collections::HashMap<(Scenario, u64), SharedPlan>>,
}

impl<'a> Plans<'a> {
    fn new(w: &'a crate::workload::Workload) -> Self {
        Plans {
            w,
            built: Default::default(),
        }
    }

    fn get(&self, s: Scenario, x: u64) -> Result<SharedPlan, PlanError> {
        let cached = |m: &Self| {
            m.built
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .get(&(s, x))
                .cloned()
        };
        if let Some(p) = cached(self) {
            return Ok(p);
        }
        // Built outside the lock: two threads may build the same plan once each.
        let p = match Plan::for_value(self.w, s, x) {
            Ok(p) => Some(std::sync::Arc::new(p)),
            Err(PlanError::Overflow { .. }) => None,
            Err(e) => return Err(e),
        };
        self.built
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert((s, x), p.clone());
        Ok(p)
    }

    /// The tensors' peak at `x`.
    fn peak(&self, s: Scenario, x: u64) -> Result<Option<u64>, PlanError> {
        Ok(self.get(s, x)?.map(|p| p.peak_bytes()))
    }

    /// PyTorch's caching allocator serves the plan at `x` for two steps within `usable`.
    fn serves(
        &self,
        s: Scenario,
        x: u64,
        conf: &crate::alloc::AllocConf,
        usable: u64,
    ) -> Result<bool, PlanError> {
        Ok(match self.get(s, x)? {
            // The tensors alone are a lower bound of what the allocator reserves.
            Some(p) if p.peak_bytes() <= usable => crate::alloc::timeline::replay(
                &p,
                conf,
                Some(usable),
                crate::alloc::timeline::STEPS,
                false,
            )
            .fits(),
            _ => false,
        })
    }
}

/// `estimate --gpu all` as a table (or JSON).
pub fn all_cards_text(w: &crate::workload::Workload, rows: &[CardRow], json: bool) -> String {
    if json {
        return format!(
            "{}\n",
            serde_json::to_string_pretty(&serde_json::json!({
                "schema_version": crate::report::SCHEMA_VERSION,
                "workload": w,
                "cards": rows,
            }))
            .unwrap_or_default()
        );
    }
    let mut s = format!(
        "{}\nmax with PyTorch's caching allocator (2 steps) on each card; in brackets, by the tensors alone\n",
        describe(w)
    );
    let dims: Vec<String> = rows
        .first()
        .map(|r| {
            r.boundaries
                .iter()
                .map(|b| format!("{} ({})", b.scenario.name(), b.dimension))
                .collect()
        })
        .unwrap_or_default();
    s.push_str(&format!(
        "{:<11} {:>11} {:>11} {:>11}  {:<5}",
        "card", "CUDA total", "usable", "reserved", "fits"
    ));
    for d in &dims {
        s.push_str(&format!(" {d:>22}"));
    }
    s.push('\n');
    for r in rows {
        s.push_str(&format!(
            "{:<11} {:>11} {:>11} {:>11}  {:<5}",
            r.card,
            fmt_bytes(r.total_bytes),
            fmt_bytes(r.card_usable_bytes),
            fmt_bytes(r.reserved_peak_bytes),
            if r.fits { "yes" } else { "no" }
        ));
        for b in &r.boundaries {
            let v = |x: Option<u64>| {
                x.map_or("-".to_string(), |x| {
                    if b.dimension == "params" {
                        crate::units::fmt_count(x)
                    } else {
                        x.to_string()
                    }
                })
            };
            s.push_str(&format!(
                " {:>22}",
                format!("{} [{}]", v(b.max_reserved), v(b.max))
            ));
        }
        s.push('\n');
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn largest_true_is_exact() {
        for limit in [1u64, 2, 3, 7, 8, 1000, 123_456_789, u64::MAX - 1, u64::MAX] {
            let mut calls = 0;
            let r: Result<_, ()> = largest_true(|x| {
                calls += 1;
                Ok(x <= limit)
            });
            assert_eq!(r.unwrap(), Some(limit));
            assert!(calls <= 130, "{calls} calls");
        }
        let r: Result<_, ()> = largest_true(|_| Ok(false));
        assert_eq!(r.unwrap(), None);
    }

    #[test]
    fn dense_boundary_is_exact() {
        let mut w = crate::workload::presets::get("dense").unwrap();
        // PyTorch's default Adam on CUDA (foreach): 16 B/param of states + a 4 B/param
        // temporary during the update.
        assert_eq!(
            predicted_max(&w, Scenario::Params, 80_000_000_000).unwrap(),
            Some(4_000_000_000)
        );
        // Fused Adam: 16 B/param.
        w.optimizer_impl = Some(crate::workload::OptimizerImpl::Fused);
        assert_eq!(
            predicted_max(&w, Scenario::Params, 80_000_000_000).unwrap(),
            Some(5_000_000_000)
        );
        assert_eq!(
            predicted_max(&w, Scenario::Params, 80_000_000_015).unwrap(),
            Some(5_000_000_000)
        );
        assert_eq!(predicted_max(&w, Scenario::Params, 15).unwrap(), None);
    }
}
