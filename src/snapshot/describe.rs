//! Text for people: a snapshot's report (the recorded OOM first, then each device's peak and
//! what is live at it), its diagnosis against the card, and the replays on this device.

use crate::estimate::share;
use crate::units::fmt_bytes;

use super::replay::{ReplayReport, ScaleSummary, ScaledRun};
use super::report::{DeviceReport, OomReport};
use super::verdict::{SnapshotDiagnosis, SnapshotEstimate};

/// The recorded OOM as the headline.
pub fn oom(o: &OomReport) -> String {
    let mut s = format!(
        "recorded OOM on cuda:{}: {} requested{}\n",
        o.device,
        fmt_bytes(o.requested_bytes),
        o.device_free_bytes
            .map(|f| format!(" with {} free on the device", fmt_bytes(f)))
            .unwrap_or_default()
    );
    s.push_str(&format!(
        "  at that moment: {} reserved by PyTorch's allocator, {} allocated to tensors\n",
        fmt_bytes(o.reserved_bytes),
        fmt_bytes(o.allocated_bytes)
    ));
    if let Some(u) = o.usable_bytes {
        s.push_str(&format!(
            "  the card's usable memory: {} ({} B = reserved + free)\n",
            fmt_bytes(u),
            u
        ));
    }
    s.push_str(&format!("  asked by: {}\n", o.frame));
    if !o.stack.is_empty() {
        s.push_str(&format!("  stack: {}\n", o.stack.join(" <- ")));
    }
    s.push_str(&format!(
        "  replay: {}\n",
        o.verdict.describe(o.usable_bytes)
    ));
    s
}

/// One device's peak and what is live at it.
pub fn device(d: &DeviceReport) -> String {
    let mut s = format!(
        "cuda:{}: peak {} ({} B) in {} (event {} of {}, allocating {})\n",
        d.device,
        fmt_bytes(d.peak_bytes),
        d.peak_bytes,
        d.peak_phase.map_or("-", |p| p.name()),
        d.peak_event,
        d.events,
        d.peak_frame.as_deref().unwrap_or("-")
    );
    s.push_str(&format!(
        "  peaks: reserved {}, allocated {}; at dump: {} reserved in {} segments, {} allocated; {} trace entries; before the trace: {}\n",
        fmt_bytes(d.peak_reserved_bytes),
        fmt_bytes(d.peak_allocated_bytes),
        fmt_bytes(d.reserved_at_dump_bytes),
        d.segments,
        fmt_bytes(d.allocated_at_dump_bytes),
        d.trace_entries,
        fmt_bytes(d.before_trace_bytes)
    ));
    let mut t = comfy_table::Table::new();
    t.load_preset(comfy_table::presets::NOTHING);
    t.set_header(vec!["live at the peak", "bytes", "size", "share"]);
    for r in &d.at_peak {
        t.add_row(vec![
            r.label.clone(),
            r.bytes.to_string(),
            fmt_bytes(r.bytes),
            share(r.bytes, d.peak_bytes),
        ]);
    }
    t.add_row(vec![
        "total".into(),
        d.peak_bytes.to_string(),
        fmt_bytes(d.peak_bytes),
        "100%".into(),
    ]);
    s.push_str(&format!("{t}\n"));
    s
}

/// `estimate --snapshot`.
pub fn estimate(e: &SnapshotEstimate) -> String {
    let others = e.devices_in_file.len().saturating_sub(e.devices.len());
    let mut s = format!(
        "snapshot {} ({}; {} granularity): {}{}\n",
        e.file,
        e.format,
        e.granularity.name(),
        match e.devices.len() {
            1 => format!("cuda:{}", e.device),
            n => format!(
                "{n} devices ({})",
                e.devices
                    .iter()
                    .map(|d| format!("cuda:{}", d.device))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        },
        if others > 0 {
            format!(" of {} in the file", e.devices_in_file.len())
        } else {
            String::new()
        }
    );
    if let Some(o) = &e.oom {
        s.push_str(&oom(o));
    }
    for d in &e.devices {
        s.push_str(&device(d));
    }
    if let (Some(m), Some(f)) = (e.memory_bytes, e.fits) {
        s.push_str(&format!(
            "on {}: cuda:{} {}\n",
            fmt_bytes(m),
            e.device,
            if f { "fits" } else { "does not fit" }
        ));
    }
    if let Some(sm) = &e.scale {
        s.push_str(&summary(sm));
        if let Some(m) = e.memory_bytes {
            s.push_str(&format!(
                "predicted max batch on {}: {}\n",
                fmt_bytes(m),
                e.predicted_max_batch
                    .map_or("none".into(), |x| x.to_string())
            ));
        }
    }
    notes(&mut s, &e.notes);
    s
}

/// `diagnose --snapshot`.
pub fn diagnose(d: &SnapshotDiagnosis) -> String {
    let e = &d.estimate;
    let main = &e.devices[0];
    let mut s = String::new();
    if let Some(o) = &e.oom {
        s.push_str(&oom(o));
    }
    s.push_str(&format!(
        "cause: {} — cuda:{}'s peak is {} on {} ({}; model states: {})\n",
        d.cause,
        main.device,
        fmt_bytes(main.peak_bytes),
        fmt_bytes(d.memory_bytes),
        d.memory_from,
        fmt_bytes(d.judged[0].states_bytes)
    ));
    for j in &d.judged[1..] {
        s.push_str(&format!(
            "  cuda:{}: {} — peak {}\n",
            j.device,
            j.cause,
            fmt_bytes(j.peak_bytes)
        ));
    }
    s.push_str(&format!(
        "live at cuda:{}'s peak, by stack frame:\n",
        main.device
    ));
    for (f, b) in &d.live_at_peak_by_frame {
        s.push_str(&format!("  {:>12}  {f}\n", fmt_bytes(*b)));
    }
    if let Some(x) = e.predicted_max_batch {
        s.push_str(&format!(
            "max batch on {} (scaled): {x}\n",
            fmt_bytes(d.memory_bytes)
        ));
    }
    notes(&mut s, &e.notes);
    s
}

fn notes(s: &mut String, notes: &[String]) {
    for n in notes {
        s.push_str(&format!("note: {n}\n"));
    }
}

/// `probe --snapshot`: one device replayed as recorded.
pub fn replay(r: &ReplayReport, budget: Option<u64>) -> String {
    let p = &r.probe;
    let mut s = format!(
        "snapshot {} cuda:{} ({} granularity): {} allocations, {} events\ntrace peak     {} ({} B)\n",
        r.file,
        r.device,
        r.granularity.name(),
        r.allocations,
        r.events,
        fmt_bytes(r.trace_peak_bytes),
        r.trace_peak_bytes
    );
    if let Some(o) = &r.recorded_oom {
        s.push_str(&format!(
            "recorded OOM   {} requested at {}{}\n",
            fmt_bytes(o.requested_bytes),
            o.frame,
            o.device_free_bytes
                .map(|f| format!(" ({} free on the device)", fmt_bytes(f)))
                .unwrap_or_default()
        ));
    }
    if let Some(b) = budget {
        s.push_str(&format!("budget         {}\n", fmt_bytes(b)));
    }
    if r.fits {
        s.push_str(&format!(
            "replay         fits: peak held {} ({} B), every byte written and verified, {:.2} s\n",
            fmt_bytes(p.bytes_allocated),
            p.bytes_allocated,
            p.seconds
        ));
    } else {
        let at = p
            .failed_at
            .map(|f| {
                format!(
                    " at event {} ({}, {} live, {} requested)",
                    f.event,
                    f.phase.name(),
                    fmt_bytes(f.live_bytes),
                    fmt_bytes(f.requested_bytes)
                )
            })
            .unwrap_or_default();
        s.push_str(&format!(
            "replay         does not fit: {}{at}\n               frame: {}\n",
            p.outcome.name(),
            r.failed_frame.as_deref().unwrap_or("-")
        ));
    }
    notes(&mut s, &r.notes);
    s
}

/// The scaling model in words.
pub fn summary(sm: &ScaleSummary) -> String {
    let mut s = format!(
        "scaling from batch {} and {} (assumption: {})\n  {} allocations: {} scaling, {} fixed ({} matched, {} only at batch {})\n  at batch {}'s peak: fixed {}, scaling {}\n",
        sm.batches.0,
        sm.batches.1,
        sm.assumption,
        sm.allocations,
        sm.scaling,
        sm.fixed,
        sm.matched,
        sm.unmatched_fixed,
        sm.batches.1,
        sm.batches.1,
        fmt_bytes(sm.peak_fixed_bytes),
        fmt_bytes(sm.peak_scaling_bytes)
    );
    if let Some(c) = &sm.check {
        s.push_str(&format!(
            "  check at batch {} ({}): predicted peak {} B, the trace's own {} B ({:+.2} %)\n",
            c.batch,
            c.file,
            c.predicted_peak_bytes,
            c.trace_peak_bytes,
            c.error * 100.0
        ));
    }
    s
}

/// `probe --snapshot A --snapshot B --batch-of ...`: the scaled search.
pub fn scaled(r: &ScaledRun) -> String {
    let mut s = summary(&r.summary);
    let opt = |v: Option<u64>| v.map_or("-".to_string(), |x| x.to_string());
    s.push_str(&format!(
        "capacity {}: predicted max batch {}, probed max batch {} (first fail {}{}), {} probes, {:.1} s\n",
        r.capacity_bytes.map_or("unknown".into(), fmt_bytes),
        opt(r.predicted_max),
        opt(r.max_fit),
        opt(r.first_fail),
        r.fail_reason
            .map(|o| format!(": {}", o.name()))
            .unwrap_or_default(),
        r.probes.len(),
        r.seconds
    ));
    notes(&mut s, &r.notes);
    s
}
