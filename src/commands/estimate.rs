//! `oomprobe estimate`: the breakdown by role of a workload at its batch and sequence, and with
//! `--memory` the predicted max of each scenario's dimension.

use serde::Serialize;

use crate::cli::EstimateArgs;
use crate::error::{CliError, CliResult};
use crate::estimate::{
    boundaries, breakdown, breakdown_table, describe, timeline_summary, Boundary, Breakdown,
    TimelineSummary,
};
use crate::plan::build::{param_count, PlanError};
use crate::plan::Plan;
use crate::report::step_chart::{Format, StepChart};
use crate::resolve::resolve;
use crate::term::out;
use crate::units::{fmt_bytes, fmt_count, parse_size};
use crate::workload::Workload;

/// `estimate --json` (contract: schema_version, workload, breakdown, boundaries).
#[derive(Debug, Serialize)]
pub struct EstimateReport {
    pub schema_version: u32,
    pub workload: Workload,
    pub param_count: u64,
    /// Additive (issue 44): the parameters in total, active per token (a mixture of experts'
    /// unrouted experts left out) and in a vision tower.
    pub parameters: crate::workload::layers::Counts,
    /// Additive (issue 33): with a parallel layout, the rank this plan is (the worst one
    /// unless `--rank` named it) and its place in the mesh.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rank: Option<crate::plan::ranks::RankInfo>,
    pub breakdown: Breakdown,
    /// Additive: where the peak sits in the step's timeline and the live-bytes curve.
    pub timeline: TimelineSummary,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub memory_bytes: Option<u64>,
    /// Additive: the GPU whose memory `memory_bytes` is, when it was detected (no `--memory`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub memory_detected_on: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub boundaries: Option<Vec<Boundary>>,
    /// Additive (issue 31): the step through PyTorch's caching allocator, two steps, on the card
    /// when `memory_bytes` is known (its first refused request in `allocator.failure`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub allocator: Option<crate::alloc::timeline::Replay>,
    /// The allocator's settings (PYTORCH_CUDA_ALLOC_CONF syntax, "" for PyTorch's defaults).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub alloc_conf: Option<String>,
    /// The most the allocator reserved (`max_memory_reserved`), and reserved − allocated then.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reserved_peak_bytes: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fragmentation_bytes: Option<u64>,
    /// Held outside PyTorch's allocator (`--non-pytorch`), and what the allocator may use.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub non_pytorch_bytes: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub card_usable_bytes: Option<u64>,
    /// Additive (issue 47): whether the step fits on the card, needed against usable and the
    /// ratio, when the card's memory is known.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fit: Option<crate::alloc::fit::Fit>,
    pub notes: Vec<String>,
    /// Additive (`--mode serve`): the serving engine's KV-cache sizing; the breakdown and
    /// timeline are then its profiling forward's.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub serving: Option<crate::serve::ServeSizing>,
}

/// A plan error at the command boundary: always bad input (exit 2).
pub fn plan_error(e: PlanError) -> CliError {
    CliError::usage(e.to_string())
}

/// The card memory a case file names, when `--config` is one (used when `--memory` is absent).
pub fn case_memory(args: &crate::workload::args::WorkloadArgs) -> CliResult<Option<u64>> {
    let Some(path) = &args.config else {
        return Ok(None);
    };
    if !crate::commands::case::is_case_file(path) {
        return Ok(None);
    }
    match crate::resolve::load_config(path).map_err(|e| CliError::usage(e.to_string()))? {
        crate::resolve::LoadedConfig::Case(c) => Ok(c.memory),
        crate::resolve::LoadedConfig::Hf(_) => Ok(None),
    }
}

/// Parse `--memory`.
pub fn memory_arg(v: &str) -> CliResult<u64> {
    parse_size(v).map_err(|e| CliError::usage(format!("--memory: {e}")))
}

/// `oomprobe estimate`: a snapshot, the card list, every card, a serving sizing, or the breakdown.
pub fn run(args: &EstimateArgs) -> CliResult<()> {
    let picture = picture_format(args)?;
    if crate::commands::snapshot::wanted(&args.snapshot) {
        no_picture(args, "--snapshot")?;
        let memory = args.memory.as_deref().map(memory_arg).transpose()?;
        return crate::commands::snapshot::estimate(
            &args.snapshot,
            memory,
            args.json,
            args.export_snapshot.as_deref(),
        );
    }
    if args.gpu.as_deref() == Some("list") {
        no_picture(args, "--gpu list")?;
        return out(&crate::estimate::card_list(args.json));
    }
    let card_arg = card_arg(args)?;
    let r = resolve(&args.workload, "gpt2")?;
    let mut w = r.workload;
    if let Some(c) = card_arg {
        c.adopt(&mut w);
    }
    if args.gpu.as_deref() == Some("all") {
        no_picture(args, "--gpu all")?;
        for w in &r.warnings {
            crate::error::warn(w);
        }
        let (conf, _) = alloc_conf(args)?;
        let rows = crate::estimate::all_cards(&w, &conf).map_err(plan_error)?;
        return out(&crate::estimate::all_cards_text(&w, &rows, args.json));
    }
    let (memory, detected) = card_memory(args, card_arg)?;
    if w.mode == crate::workload::Mode::Serve {
        no_picture(args, "--mode serve")?;
        let m = memory.ok_or_else(|| {
            CliError::usage(
                "--mode serve needs the card's memory: pass --memory SIZE (no GPU detected)",
            )
        })?;
        for w in &r.warnings {
            crate::error::warn(w);
        }
        return serve(w, m, detected, args.json);
    }
    if let Some(v) = &args.seq_lengths {
        no_picture(args, "--seq-lengths")?;
        for w in &r.warnings {
            crate::error::warn(w);
        }
        return seq_lengths(args, &w, v, memory, card_arg);
    }
    let plan = Plan::for_workload(&w).map_err(plan_error)?;
    if let Some(path) = &args.export_snapshot {
        crate::commands::snapshot::export(&plan, path)?;
    }
    for w in &r.warnings {
        crate::error::warn(w);
    }
    let b = breakdown(&plan);
    let (conf, conf_from) = alloc_conf(args)?;
    let (card, non_pytorch) = card_of(args, &w, memory, card_arg, &conf)?;
    let replay = crate::alloc::timeline::replay(
        &plan,
        &conf,
        card.as_ref().map(|c| c.usable()),
        crate::alloc::timeline::STEPS,
        args.json || picture.is_some(),
    );
    let fit = card
        .as_ref()
        .map(|c| crate::alloc::fit::of_plan(&plan, &conf, &replay, c.usable()));
    let bounds = match memory {
        Some(m) => Some(boundaries(&w, m, card.as_ref()).map_err(plan_error)?),
        None => None,
    };
    if let (Some(path), Some(format)) = (&args.out, picture) {
        let name = card_arg.map(|c| c.name.to_string());
        let name = name.or_else(|| memory.map(|m| format!("a card of {}", fmt_bytes(m))));
        let usable = card.as_ref().map(|c| c.usable());
        let chart = StepChart::new(describe(&w), name.as_deref(), &plan, &conf, &replay, usable);
        let text = chart
            .render(format)
            .map_err(|e| CliError::run(format!("--out: {e}")))?;
        std::fs::write(path, text)
            .map_err(|e| CliError::usage(format!("--out {}: {e}", path.display())))?;
    }
    let report = EstimateReport {
        schema_version: crate::report::SCHEMA_VERSION,
        param_count: param_count(&w).map_err(plan_error)?,
        parameters: crate::plan::build::parameters(&w).map_err(plan_error)?,
        rank: crate::plan::ranks::info(&plan),
        workload: w,
        breakdown: b,
        timeline: timeline_summary(&plan),
        memory_bytes: memory,
        memory_detected_on: detected.clone(),
        boundaries: bounds,
        reserved_peak_bytes: Some(replay.reserved_peak_bytes),
        fragmentation_bytes: Some(replay.fragmentation_bytes),
        non_pytorch_bytes: card.as_ref().map(|c| c.non_pytorch),
        card_usable_bytes: card.as_ref().map(|c| c.usable()),
        fit,
        alloc_conf: Some(conf.text.clone()),
        allocator: Some(replay),
        notes: plan.notes.clone(),
        serving: None,
    };
    if args.json {
        let s = serde_json::to_string_pretty(&report).map_err(|e| CliError::run(e.to_string()))?;
        return out(&format!("{s}\n"));
    }
    out(&render_text(
        &report,
        &detected,
        memory,
        card_arg,
        &conf,
        conf_from,
        card.as_ref(),
        non_pytorch,
    ))
}

/// `--out FILE`: the picture's format from its extension (bad input when it names none).
fn picture_format(args: &EstimateArgs) -> CliResult<Option<Format>> {
    args.out
        .as_deref()
        .map(Format::of_path)
        .transpose()
        .map_err(|e| CliError::usage(format!("--out: {e}")))
}

/// `--out` draws a workload's training step: bad input with `what`.
fn no_picture(args: &EstimateArgs, what: &str) -> CliResult<()> {
    match args.out {
        Some(_) => Err(CliError::usage(format!(
            "--out draws a workload's step, not with {what}"
        ))),
        None => Ok(()),
    }
}

/// `--gpu ID`: the card from oomprobe's table (none for `all` or no `--gpu`).
fn card_arg(args: &EstimateArgs) -> CliResult<Option<&'static crate::alloc::cards::Card>> {
    let card_arg = match args.gpu.as_deref() {
        None | Some("all") => None,
        Some(id) => Some(crate::alloc::cards::get(id).ok_or_else(|| {
            CliError::usage(format!(
                "--gpu: no card '{id}' (one of: {}; or list, all)",
                crate::alloc::cards::ids()
            ))
        })?),
    };
    Ok(card_arg)
}

/// The card's memory (`--memory`, the `--gpu` card, a case file or the detected GPU) and name.
fn card_memory(
    args: &EstimateArgs,
    card_arg: Option<&'static crate::alloc::cards::Card>,
) -> CliResult<(Option<u64>, Option<String>)> {
    let mut detected = card_arg.map(|c| format!("{} (oomprobe's card table)", c.name));
    let memory = match args.memory.as_deref().map(memory_arg).transpose()? {
        Some(m) => Some(m),
        None if card_arg.is_some() => card_arg.map(|c| c.total),
        None => match case_memory(&args.workload)? {
            Some(m) => Some(m),
            // The GPU in front of you, when there is one (never a CPU adapter's heap).
            None => crate::backend::open::detected_gpu().map(|(name, m)| {
                detected = Some(name);
                m
            }),
        },
    };
    Ok((memory, detected))
}

/// The estimate as text: whether it fits, workload, peak, breakdown, notes, allocator summary and boundaries.
#[allow(clippy::too_many_arguments)]
fn render_text(
    report: &EstimateReport,
    detected: &Option<String>,
    memory: Option<u64>,
    card_arg: Option<&'static crate::alloc::cards::Card>,
    conf: &crate::alloc::AllocConf,
    conf_from: &'static str,
    card: Option<&crate::estimate::Card>,
    non_pytorch: Option<u64>,
) -> String {
    let tl = &report.timeline;
    let at = match (&tl.peak_phase, &tl.peak_tensor) {
        (Some(p), Some(t)) => format!(
            "peak in {} (event {} of {}, allocating {t})",
            p.name(),
            tl.peak_event,
            tl.events
        ),
        (Some(p), None) => format!("peak in {}", p.name()),
        _ => "empty plan".into(),
    };
    let on = match (&detected, memory) {
        (Some(name), Some(m)) if card_arg.is_some() => format!(", on {name}, {}", fmt_bytes(m)),
        (Some(name), Some(m)) => format!(", on {name}, {} (detected)", fmt_bytes(m)),
        _ => String::new(),
    };
    let headline = report
        .fit
        .as_ref()
        .map_or(String::new(), |f| crate::alloc::fit::headline(f) + "\n");
    let mut text = format!(
        "{headline}{}{on}\n{at}; by role at the peak:\n{}\n",
        describe(&report.workload),
        breakdown_table(&report.breakdown, tl.model_states_bytes)
    );
    for n in &report.notes {
        text.push_str(&format!("note: {n}\n"));
    }
    if let Some(r) = &report.allocator {
        text.push_str(&crate::alloc::render::summary(r, conf, conf_from, card));
        if card_arg.is_some() && non_pytorch.is_none() && report.workload.gpus > 1 {
            let n = report.workload.communicators();
            text.push_str(&format!(
                "  outside PyTorch: the card's {} and {n} NCCL {}' buffers ({} each per rank, \
                 derived; NCCL allocates them, not oomprobe's plan; --non-pytorch to set it)\n",
                fmt_bytes(card_arg.map_or(0, |c| c.non_pytorch)),
                if n == 1 {
                    "communicator"
                } else {
                    "communicators"
                },
                fmt_bytes(crate::alloc::cards::NCCL_COMMUNICATOR)
            ));
        }
    }
    if let (Some(m), Some(bs)) = (memory, &report.boundaries) {
        text.push_str(&format!(
            "\npredicted boundaries on {} ({m} bytes):\n",
            fmt_bytes(m)
        ));
        let show = |v: Option<u64>, dim: &str| match v {
            Some(x) if dim == "params" => format!("{x} ({})", fmt_count(x)),
            Some(x) => x.to_string(),
            None => "none (even 1 does not fit)".into(),
        };
        for bd in bs {
            text.push_str(&format!(
                "  {:<12} max {:<7} = {} with PyTorch's allocator; {} by the tensors alone\n",
                bd.scenario.name(),
                bd.dimension,
                show(bd.max_reserved, &bd.dimension),
                show(bd.max, &bd.dimension),
            ));
        }
    }
    text
}

/// The allocator's settings in force (`--alloc-conf`, else the environment) and where they came
/// from; a bad one is bad input naming its source.
fn alloc_conf(args: &EstimateArgs) -> CliResult<(crate::alloc::AllocConf, &'static str)> {
    crate::alloc::conf::from_flag_or_env(args.alloc_conf.as_deref()).map_err(CliError::usage)
}

/// The card the allocator is judged on: `memory` less what lives outside PyTorch
/// (`--non-pytorch`, else the `--gpu` card's figure for `w`), and the `--non-pytorch` given.
fn card_of(
    args: &EstimateArgs,
    w: &Workload,
    memory: Option<u64>,
    card_arg: Option<&'static crate::alloc::cards::Card>,
    conf: &crate::alloc::AllocConf,
) -> CliResult<(Option<crate::estimate::Card>, Option<u64>)> {
    let non_pytorch = args
        .non_pytorch
        .as_deref()
        .map(|v| parse_size(v).map_err(|e| CliError::usage(format!("--non-pytorch: {e}"))))
        .transpose()?;
    let card = memory.map(|m| crate::estimate::Card {
        total: m,
        non_pytorch: non_pytorch.unwrap_or(card_arg.map_or(0, |c| c.non_pytorch_for(w))),
        conf: conf.clone(),
    });
    if let (Some(c), Some(n)) = (&card, non_pytorch) {
        if n >= c.total {
            return Err(CliError::usage(format!(
                "--non-pytorch {} leaves nothing of --memory {}",
                fmt_bytes(n),
                fmt_bytes(c.total)
            )));
        }
    }
    Ok((card, non_pytorch))
}

/// The most bytes a `--seq-lengths @FILE` may have.
const LENGTHS_FILE_CAP: u64 = 1 << 20;

/// `estimate --seq-lengths`: steps of varying length through one allocator.
fn seq_lengths(
    args: &EstimateArgs,
    w: &Workload,
    v: &str,
    memory: Option<u64>,
    card_arg: Option<&'static crate::alloc::cards::Card>,
) -> CliResult<()> {
    use crate::alloc::sequence;
    let text = match v.strip_prefix('@') {
        Some(path) => crate::input::read_text_capped(std::path::Path::new(path), LENGTHS_FILE_CAP)
            .map_err(|e| CliError::usage(format!("--seq-lengths: {e}")))?,
        None => v.to_string(),
    };
    let lengths = crate::workload::flags::parse_seq_lengths(&text)
        .map_err(|e| CliError::usage(format!("--seq-lengths: {e}")))?;
    if w.mode != crate::workload::Mode::Train {
        return Err(CliError::usage(
            "--seq-lengths replays training steps: not with --mode inference or serve",
        ));
    }
    let mut plans: std::collections::BTreeMap<u64, Plan> = Default::default();
    for &s in &lengths {
        if let std::collections::btree_map::Entry::Vacant(e) = plans.entry(s) {
            let mut at = w.clone();
            at.seq = s;
            at.step = crate::workload::StepKind::Steady;
            e.insert(Plan::for_workload(&at).map_err(plan_error)?);
        }
    }
    let (conf, _) = alloc_conf(args)?;
    let usable = card_of(args, w, memory, card_arg, &conf)?
        .0
        .map(|c| c.usable());
    let steps: Vec<(u64, &Plan)> = lengths.iter().map(|s| (*s, &plans[s])).collect();
    let bad = |e: sequence::SequenceError| CliError::usage(format!("--seq-lengths: {e}"));
    let unlimited = sequence::replay(&steps, &conf, None).map_err(bad)?;
    let seq = match usable {
        Some(_) => sequence::replay(&steps, &conf, usable).map_err(bad)?,
        None => unlimited.clone(),
    };
    let (longest, plan) = plans.iter().next_back().expect("at least one length");
    let alone =
        crate::alloc::timeline::replay(plan, &conf, None, crate::alloc::timeline::STEPS, false);
    if args.json {
        let doc = serde_json::json!({
            "schema_version": crate::report::SCHEMA_VERSION,
            "workload": w,
            "alloc_conf": conf.text,
            "card_usable_bytes": usable,
            "longest": longest,
            "longest_alone_reserved_peak_bytes": alone.reserved_peak_bytes,
            "unlimited": unlimited,
            "sequence": seq,
        });
        let s = serde_json::to_string_pretty(&doc).map_err(|e| CliError::run(e.to_string()))?;
        return out(&format!("{s}\n"));
    }
    let mut described = w.clone();
    described.seq = *longest;
    out(&format!(
        "{}\n{}",
        describe(&described),
        sequence::text(&seq, &unlimited, &alone, usable)
    ))
}

/// `estimate --mode serve`: the serving sizing on a card of `memory` bytes.
fn serve(w: Workload, memory: u64, detected: Option<String>, json: bool) -> CliResult<()> {
    let (z, plan) = crate::serve::size(&w, memory).map_err(plan_error)?;
    let report = EstimateReport {
        schema_version: crate::report::SCHEMA_VERSION,
        param_count: param_count(&w).map_err(plan_error)?,
        parameters: crate::plan::build::parameters(&w).map_err(plan_error)?,
        rank: crate::plan::ranks::info(&plan),
        workload: w,
        breakdown: breakdown(&plan),
        timeline: timeline_summary(&plan),
        memory_bytes: Some(memory),
        memory_detected_on: detected.clone(),
        boundaries: None,
        allocator: None,
        alloc_conf: None,
        reserved_peak_bytes: None,
        fragmentation_bytes: None,
        non_pytorch_bytes: None,
        card_usable_bytes: None,
        fit: None,
        notes: plan.notes.clone(),
        serving: Some(z),
    };
    if json {
        let s = serde_json::to_string_pretty(&report).map_err(|e| CliError::run(e.to_string()))?;
        return out(&format!("{s}\n"));
    }
    let on = detected.map_or(String::new(), |n| format!(" (detected: {n})"));
    let mut text = format!("{}{on}\n", crate::serve::text::model_line(&report.workload));
    if let Some(z) = &report.serving {
        text.push_str(&crate::serve::text::text(z));
    }
    out(&text)
}
