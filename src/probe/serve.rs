//! `probe --mode serve`: one probe (in a child) that allocates the weights, runs the profiling
//! forward's kernels, frees its transients and allocates the KV block pool until the device
//! refuses; the blocks it held beside vLLM's predicted count.

use serde::Serialize;

use crate::backend::DeviceInfo;
use crate::cli::{ComputeMode, ProbeArgs};
use crate::error::{CliError, CliResult};
use crate::report::model::{ProbeRecord, ToolInfo, SCHEMA_VERSION};
use crate::scenario::Scenario;
use crate::serve::pool::{probe_plan, Pool};
use crate::serve::text::{gib, thousands};
use crate::serve::{concurrency, ServeSizing};
use crate::workload::Workload;

use super::child::{ChildRequest, ProbeTimeout};
use super::{capacity, session, Compute};

/// What the device held.
#[derive(Debug, Clone, Serialize)]
pub struct Measured {
    /// Whether the profiling forward (weights, activations, logits, sampler) was held.
    pub profile_fit: bool,
    /// KV blocks the device held past the forward before it refused (or the plan ended at the
    /// card's total).
    pub device_blocks: u64,
    /// vLLM's pool on this device: the predicted count where the device held it, else what it
    /// held.
    pub blocks: u64,
    pub tokens: u64,
    pub concurrency: f64,
    /// Blocks per round: the measured counts are multiples of it.
    pub granularity_blocks: u64,
    pub pool: Pool,
}

/// `probe --mode serve --json`.
#[derive(Debug, Serialize)]
pub struct ServeProbeReport {
    pub schema_version: u32,
    pub tool: ToolInfo,
    pub device: DeviceInfo,
    pub budget_bytes: Option<u64>,
    pub workload: Workload,
    pub predicted: ServeSizing,
    pub measured: Measured,
    pub probe: ProbeRecord,
    pub notes: Vec<String>,
}

/// Run the serving probe of `w` (a `--mode serve` workload).
pub fn run(
    args: &ProbeArgs,
    w: Workload,
    budget: Option<u64>,
    timeout: ProbeTimeout,
) -> CliResult<()> {
    let (choice, info) = session::select_device(
        &args.device.backend,
        args.device.device.as_deref(),
        &args.device.allocator(),
    )?;
    let (budget, warning) =
        capacity::host_guard(&info, budget, args.force, capacity::ram_available());
    if let Some(wn) = warning {
        crate::error::warn(wn);
    }
    let cap = capacity::decide(&info, budget);
    let total = cap.budget.or(cap.predict_against).ok_or_else(|| {
        CliError::usage("the device does not tell its memory: pass --budget SIZE")
    })?;
    let compute = match args.compute {
        Some(ComputeMode::Touch) => Compute::Touch,
        _ => Compute::Full,
    };
    let (_, predicted, pool) =
        probe_plan(&w, total).map_err(crate::commands::estimate::plan_error)?;
    let req = ChildRequest {
        workload: w.clone(),
        scenario: Scenario::Batch,
        value: total,
        compute,
        device: choice,
        budget: cap.budget,
        snapshot: None,
        room: None,
    };
    let rec = session::isolation(!args.no_isolate, timeout)?.run(&req);
    let failed = (!rec.outcome.is_fit()).then(|| rec.failed_at.as_ref().map_or(0, |f| f.event));
    let profile_fit = failed.is_none_or(|e| e >= pool.first_event);
    let device_blocks = pool.blocks_held(failed);
    let blocks = device_blocks.min(predicted.blocks);
    let measured = Measured {
        profile_fit,
        device_blocks,
        blocks,
        tokens: blocks * predicted.block_size,
        concurrency: concurrency(blocks, predicted.max_model_len, predicted.block_size),
        granularity_blocks: pool.blocks_per_round,
        pool,
    };
    let mut notes = cap.notes.clone();
    notes.push(
        "measured: what the device held (weights and the profile's tensors written and verified, the forward's kernels run with --compute full, then the KV pool); the profile peak, non-torch growth and vLLM's count are the model's"
            .into(),
    );
    let report = ServeProbeReport {
        schema_version: SCHEMA_VERSION,
        tool: ToolInfo::default(),
        device: info,
        budget_bytes: cap.budget,
        workload: w,
        predicted,
        measured,
        probe: rec,
        notes,
    };
    if args.json {
        let s = serde_json::to_string_pretty(&report).map_err(|e| CliError::run(e.to_string()))?;
        crate::term::out(&format!("{s}\n"))?;
    } else {
        crate::term::out(&text(&report))?;
    }
    let o = report.probe.outcome;
    if !report.measured.profile_fit || (!o.is_fit() && !is_refusal(o)) {
        return Err(CliError::run(format!(
            "serve probe ended on {}: {}",
            o.name(),
            report.probe.detail.clone().unwrap_or_default()
        )));
    }
    Ok(())
}

/// The device said no (what ends the pool), as opposed to a probe error.
fn is_refusal(o: crate::report::Outcome) -> bool {
    use crate::report::Outcome;
    matches!(
        o,
        Outcome::OutOfMemory | Outcome::Budget | Outcome::ExceedsLimit
    )
}

fn text(r: &ServeProbeReport) -> String {
    let (z, m) = (&r.predicted, &r.measured);
    let mut t = format!(
        "serve probe on {} ({}), {} GiB{}\n{}\n",
        r.device.name,
        r.device.backend.as_str(),
        gib(z.total_bytes as i64),
        if r.budget_bytes.is_some() {
            " (budget)"
        } else {
            ""
        },
        crate::serve::text::model_line(&r.workload)
    );
    t.push_str(&format!(
        "  profiling forward ({} tokens, {} sampled rows): {}\n",
        z.limits.max_num_batched_tokens,
        z.limits.max_num_batched_tokens.min(z.limits.max_num_seqs),
        if m.profile_fit { "held" } else { "refused" }
    ));
    let end = if r.probe.outcome.is_fit() {
        "the plan's end at the card's total".to_string()
    } else {
        format!("the device's refusal ({})", r.probe.outcome.name())
    };
    t.push_str(&format!(
        "  KV pool: the device held {} blocks past the forward (the card's total after the weights: {} by the plan's bytes), up to {end}, in rounds of {}\n",
        m.device_blocks, m.pool.cap_blocks, m.granularity_blocks
    ));
    t.push_str(&format!(
        "{:<44} {:>12} {:>12}\n",
        "", "predicted", "measured"
    ));
    t.push_str(&format!(
        "{:<44} {:>12} {:>12}\n",
        "# GPU blocks", z.blocks, m.blocks
    ));
    t.push_str(&format!(
        "{:<44} {:>12} {:>12}\n",
        "GPU KV cache size (tokens)",
        thousands(z.tokens),
        thousands(m.tokens)
    ));
    t.push_str(&format!(
        "{:<44} {:>11.2}x {:>11.2}x\n",
        format!(
            "Maximum concurrency at {} tokens",
            thousands(z.max_model_len)
        ),
        z.concurrency,
        m.concurrency
    ));
    if let Some(l) = crate::serve::text::refusal_line(z) {
        t.push_str(&format!("{l}\n"));
    }
    for n in &r.notes {
        t.push_str(&format!("note: {n}\n"));
    }
    t
}
