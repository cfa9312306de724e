//! `oomprobe diagnose`: which of the four causes of an OOM dominates, and what each remedy buys.

use crate::cli::DiagnoseArgs;
use crate::commands::estimate::{case_memory, memory_arg, plan_error};
use crate::diagnose::render;
use crate::error::{CliError, CliResult};
use crate::resolve::resolve;
use crate::term::out;

/// The card `--gpu` names (an unknown one exits 2, with `--oom` too).
fn card_arg(args: &DiagnoseArgs) -> CliResult<Option<&'static crate::alloc::cards::Card>> {
    match args.gpu.as_deref() {
        None => Ok(None),
        Some(id) => Ok(Some(crate::alloc::cards::get(id).ok_or_else(|| {
            CliError::usage(format!(
                "--gpu: no card '{id}' (one of: {})",
                crate::alloc::cards::ids()
            ))
        })?)),
    }
}

pub fn run(args: &DiagnoseArgs) -> CliResult<()> {
    // Every flag is checked before any work, whichever path runs.
    let card = card_arg(args)?;
    if let Some(file) = &args.oom {
        return oom(file, args);
    }
    if crate::commands::snapshot::wanted(&args.snapshot) {
        // The card the snapshot was recorded on (its OOM), or --memory; never this machine's.
        let memory = args.memory.as_deref().map(memory_arg).transpose()?;
        return crate::commands::snapshot::diagnose(&args.snapshot, memory, args.json);
    }
    let mut r = resolve(&args.workload, "gpt2")?;
    if let Some(c) = card {
        c.adopt(&mut r.workload);
    }
    if card.is_some() && args.memory.is_some() {
        return Err(CliError::usage(
            "--gpu and --memory both say what the card has: give one",
        ));
    }
    let memory = match (args.memory.as_deref(), card) {
        // The card's memory less what lives outside PyTorch on it (its CUDA context, NCCL).
        (_, Some(c)) => c.total.saturating_sub(c.non_pytorch_for(&r.workload)),
        (Some(m), None) => memory_arg(m)?,
        (None, None) => match case_memory(&args.workload)? {
            Some(m) => m,
            None => match crate::backend::open::detected_gpu() {
                Some((name, m)) => {
                    eprintln!(
                        "oomprobe: judging against {name}, {} (detected)",
                        crate::units::fmt_bytes(m)
                    );
                    m
                }
                None => return Err(CliError::usage(
                    "no GPU's memory is known here (no GPU adapter, or its API does not tell; a CPU adapter's heap is no card's): pass --memory SIZE",
                )),
            },
        },
    };
    if r.workload.mode == crate::workload::Mode::Serve {
        let d = crate::serve::text::diagnose(&r.workload, memory).map_err(plan_error)?;
        if args.json {
            let s = serde_json::to_string_pretty(&d).map_err(|e| CliError::run(e.to_string()))?;
            return out(&format!("{s}\n"));
        }
        return out(&crate::serve::text::diagnosis_text(&d));
    }
    // The allocator's settings from the environment, as `estimate` reads them.
    let (conf, _) = crate::alloc::conf::from_flag_or_env(None).map_err(CliError::usage)?;
    let d = crate::diagnose::diagnose_on(&r.workload, memory, card, &conf).map_err(plan_error)?;
    for w in &r.warnings {
        crate::error::warn(w);
    }
    if args.json {
        let s = serde_json::to_string_pretty(&d).map_err(|e| CliError::run(e.to_string()))?;
        out(&format!("{s}\n"))
    } else {
        out(&render(&d))
    }
}

/// Read an input the user named: a file or `-` (stdin), streamed.
fn open_input(file: &str) -> CliResult<Box<dyn std::io::BufRead>> {
    if file == "-" {
        return Ok(Box::new(std::io::BufReader::new(std::io::stdin())));
    }
    // A pipe or FIFO is streamed (a log piped in); a device or a directory is refused.
    let f = crate::input::open_stream(std::path::Path::new(file))
        .map_err(|e| CliError::usage(format!("cannot read {file}: {e}")))?;
    Ok(Box::new(std::io::BufReader::new(f)))
}

/// `diagnose --oom FILE`: every message in the input, judged.
fn oom(file: &str, args: &DiagnoseArgs) -> CliResult<()> {
    if args.memory.is_some() {
        return Err(CliError::usage(
            "--memory does not go with --oom: the message says what the card had",
        ));
    }
    if args.gpu.is_some() {
        return Err(CliError::usage(
            "--gpu does not go with --oom: the message says what the card had",
        ));
    }
    let recorded = if crate::commands::snapshot::wanted(&args.snapshot) {
        let v = crate::commands::snapshot::recorded_ooms(&args.snapshot)?;
        if v.is_empty() {
            return Err(CliError::usage(format!(
                "{}: the snapshot recorded no OOM to compare the message with",
                args.snapshot.snapshot[0].display()
            )));
        }
        v
    } else {
        Vec::new()
    };
    let input = open_input(file)?;
    let scanned = crate::oom::scan::scan_bounded(input)
        .map_err(|e| CliError::usage(format!("cannot read {file}: {e}")))?;
    let name = if file == "-" { "stdin" } else { file };
    if scanned.messages_dropped > 0 {
        crate::error::warn(format!(
            "{name}: {} more distinct out-of-memory messages were counted, not kept (the first {} are)",
            scanned.messages_dropped,
            crate::oom::scan::MAX_MESSAGES
        ));
    }
    if let Some(at) = scanned.stopped_at {
        crate::error::warn(format!(
            "{name}: read the first {} only; the rest was not searched",
            crate::units::fmt_bytes(at)
        ));
    }
    let messages = scanned.messages;
    if messages.is_empty() {
        return Err(CliError::usage(format!(
            "no out-of-memory message found in {name}"
        )));
    }
    let judged: Vec<_> = messages
        .iter()
        .map(|m| (m, crate::oom::judge::judge(m)))
        .collect();
    // With a workload: each message against it, on the memory PyTorch had there.
    let given = args.workload.model.is_some() || args.workload.config.is_some();
    let mut checks = Vec::new();
    if given {
        let r = resolve(&args.workload, "gpt2")?;
        for w in &r.warnings {
            crate::error::warn(w);
        }
        for (m, _) in &judged {
            checks.push(crate::message_check::check(&r.workload, m).map_err(plan_error)?);
        }
    }
    // With a workload: the ways out on the card the last message names (its total capacity).
    let ways = match (&checks.is_empty(), judged.last()) {
        (false, Some((m, j))) => ways_for(&args.workload, m, j)?,
        _ => None,
    };
    // With a snapshot: each message against the OOM it recorded (the best-matching device).
    let matches: Vec<Option<crate::message_check::SnapshotMatch>> = judged
        .iter()
        .map(|(m, _)| {
            let mut all: Vec<_> = recorded
                .iter()
                .map(|o| crate::message_check::against_snapshot(m, o))
                .collect();
            let pick = all.iter().position(|x| x.same_oom).unwrap_or(0);
            (pick < all.len()).then(|| all.swap_remove(pick))
        })
        .collect();
    if args.json {
        let entries: Vec<_> = judged
            .iter()
            .enumerate()
            .map(|(i, (m, j))| {
                let mut v =
                    serde_json::to_value(crate::oom::explain::entry(m, j)).unwrap_or_default();
                if let (Some(Some(c)), Some(o)) = (checks.get(i), v.as_object_mut()) {
                    o.insert(
                        "workload_check".into(),
                        serde_json::to_value(c).unwrap_or_default(),
                    );
                }
                if let (Some(Some(x)), Some(o)) = (matches.get(i), v.as_object_mut()) {
                    o.insert(
                        "snapshot_check".into(),
                        serde_json::to_value(x).unwrap_or_default(),
                    );
                }
                v
            })
            .collect();
        let mut doc = serde_json::json!({
            "schema_version": 1,
            "source": name,
            "messages": entries,
        });
        if let (Some(w), Some(o)) = (&ways, doc.as_object_mut()) {
            o.insert("ways".into(), serde_json::to_value(w).unwrap_or_default());
        }
        let s = serde_json::to_string_pretty(&doc).map_err(|e| CliError::run(e.to_string()))?;
        return out(&format!("{s}\n"));
    }
    let mut text = String::new();
    let shown = crate::oom::explain::TEXT_MESSAGES;
    if judged.len() > 1 {
        text += &format!(
            "{} distinct out-of-memory messages in {name}{}\n\n",
            judged.len(),
            if judged.len() > shown {
                format!("; the last {shown} follow (--json lists all)")
            } else {
                String::new()
            }
        );
    }
    let skip = judged.len().saturating_sub(shown);
    for (i, (m, j)) in judged.iter().enumerate().skip(skip) {
        if i > skip {
            text.push('\n');
        }
        let mut extra = match checks.get(i) {
            Some(Some(c)) => crate::message_check::lines(c),
            Some(None) => {
                vec![
                    "workload: the message lacks the reserved and free figures to check it against"
                        .into(),
                ]
            }
            None => Vec::new(),
        };
        if let Some(Some(x)) = matches.get(i) {
            extra.extend(x.lines.iter().cloned());
        }
        text += &crate::oom::explain::text(m, j, &extra);
    }
    if let Some(w) = &ways {
        text.push('\n');
        text += &crate::ways::render(w);
    }
    out(&text)
}

/// The ways out for the workload on the card message `m` names: its total capacity, and the
/// card of the table that total is (for what lives outside PyTorch and the card's peaks).
/// None when the message gives no total or the workload is no training transformer.
fn ways_for(
    args: &crate::workload::args::WorkloadArgs,
    m: &crate::oom::Message,
    j: &crate::oom::judge::Judgement,
) -> CliResult<Option<crate::ways::Ways>> {
    let Some(total) = m.total.as_ref().map(|t| t.bytes) else {
        return Ok(None);
    };
    let w = resolve(args, "gpt2")?.workload;
    if !w.is_text_transformer() || w.inference() {
        return Ok(None);
    }
    let card = j
        .card
        .as_ref()
        .and_then(|c| c.ids.first())
        .and_then(|id| crate::alloc::cards::get(id));
    let max = if w.gpus > 1 {
        w.gpus
    } else {
        crate::ways::MAX_GPUS
    };
    crate::ways::search(&w, total, card, &crate::alloc::AllocConf::default(), max, 6)
        .map(Some)
        .map_err(plan_error)
}
