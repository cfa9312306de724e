//! The runs a `probe` invocation makes: the default suite (design.md's table) or the user's
//! workload, and the scaling that keeps every default meaningful on a small budget.

use crate::plan::build::default_workload;
use crate::scenario::Scenario;
use crate::workload::{Arch, Attention, Checkpoint, Workload};

/// One boundary search to run.
#[derive(Debug, Clone, PartialEq)]
pub struct RunSpec {
    pub scenario: Scenario,
    /// Tells runs of one scenario apart ("naive", "flash", "checkpoint none", ...).
    pub variant: Option<String>,
    pub workload: Workload,
    /// What was changed from the default and why.
    pub notes: Vec<String>,
}

/// The smallest predicted boundary a default run should have; below it the default is scaled.
pub fn wanted_minimum(scenario: Scenario) -> u64 {
    match scenario {
        Scenario::Params => 1 << 20,
        Scenario::Batch | Scenario::Activations => 4,
        Scenario::Seq => 512,
    }
}

/// The default runs of one scenario (design.md's table), before scaling.
pub fn default_runs(scenario: Scenario) -> Vec<RunSpec> {
    let base = default_workload(scenario);
    let spec = |variant: &str, w: Workload| RunSpec {
        scenario,
        variant: Some(variant.to_string()),
        workload: w,
        notes: Vec::new(),
    };
    match scenario {
        Scenario::Params => vec![spec("fp32 adam", base)],
        Scenario::Batch => vec![spec(&base.name.clone(), base)],
        Scenario::Seq => {
            // One attention block: a tiny vocabulary keeps the embedding and the logits from
            // hiding the s² score matrices this scenario is about.
            let mut naive = base;
            naive.vocab = 64;
            naive.attention = Attention::Naive;
            let mut flash = naive.clone();
            flash.attention = Attention::Flash;
            let mut runs = vec![spec("naive", naive), spec("flash", flash)];
            for r in &mut runs {
                r.notes
                    .push("one GPT-2-small layer, vocabulary cut to 64 tokens".into());
            }
            runs
        }
        Scenario::Activations => {
            let mut none = base;
            none.checkpoint = Checkpoint::None;
            let mut full = none.clone();
            full.checkpoint = Checkpoint::Full;
            vec![spec("checkpoint none", none), spec("checkpoint full", full)]
        }
    }
}

/// Shrink steps for a default workload, mildest first. Each returns the new workload and a note.
fn shrink_steps(w: &Workload, scenario: Scenario) -> Vec<(Workload, String)> {
    let mut steps = Vec::new();
    match w.arch {
        Arch::Resnet => {
            let mut cur = w.clone();
            for img in [160u64, 112, 64, 32] {
                if img < cur.image {
                    cur.image = img;
                    steps.push((cur.clone(), format!("image scaled to {img} px")));
                }
            }
            for width in [32u64, 16, 8] {
                if width < cur.hidden {
                    cur.hidden = width;
                    steps.push((cur.clone(), format!("stem width scaled to {width}")));
                }
            }
        }
        Arch::Dense => {}
        _ => {
            let mut cur = w.clone();
            if cur.vocab > 4096 {
                cur.vocab = 4096;
                steps.push((cur.clone(), "vocabulary cut to 4096 tokens".into()));
            }
            // The seq scenario varies the sequence itself; the others may shorten it.
            if scenario != Scenario::Seq {
                for seq in [512u64, 256] {
                    if seq < cur.seq {
                        cur.seq = seq;
                        steps.push((cur.clone(), format!("sequence cut to {seq}")));
                    }
                }
            }
            for hidden in [512u64, 384, 256, 128, 64] {
                if hidden < cur.hidden {
                    let head_dim = 64.min(hidden);
                    cur.hidden = hidden;
                    cur.heads = (hidden / head_dim).max(1);
                    cur.ffn = 4 * hidden;
                    steps.push((
                        cur.clone(),
                        format!("width scaled to hidden {hidden} ({} heads)", cur.heads),
                    ));
                }
            }
        }
    }
    steps
}

/// Scale a default run down until its predicted boundary reaches `wanted_minimum` against
/// `capacity`. Leaves the run as it is when it already does, or when nothing smaller helps.
pub fn scale_for_capacity(mut run: RunSpec, capacity: Option<u64>) -> RunSpec {
    let Some(cap) = capacity else { return run };
    let want = wanted_minimum(run.scenario);
    let predicted = |w: &Workload| {
        crate::estimate::predicted_max(w, run.scenario, cap)
            .ok()
            .flatten()
            .unwrap_or(0)
    };
    if predicted(&run.workload) >= want {
        return run;
    }
    let mut applied = Vec::new();
    for (w, note) in shrink_steps(&run.workload, run.scenario) {
        applied.push(note);
        run.workload = w;
        if predicted(&run.workload) >= want {
            break;
        }
    }
    // Each kind of change (image, vocabulary, sequence, width) is named once, at its last value.
    let mut last_of_kind: Vec<String> = Vec::new();
    for note in applied {
        let kind = note.split_whitespace().next().unwrap_or("").to_string();
        last_of_kind.retain(|n| !n.starts_with(&kind));
        last_of_kind.push(note);
    }
    let applied = last_of_kind;
    if !applied.is_empty() {
        run.notes.push(format!(
            "scaled down to fit {}: {}",
            crate::units::fmt_bytes(cap),
            applied.join(", ")
        ));
    }
    run
}

/// The runs for `probe`: the user's workload when one was given, else the default suite.
/// `user` is Some when --model or --config was passed.
pub fn plan_runs(
    scenarios: &[Scenario],
    user: Option<&Workload>,
    capacity: Option<u64>,
) -> Vec<RunSpec> {
    let scenarios: Vec<Scenario> = if scenarios.is_empty() {
        match user {
            Some(w) => crate::plan::build::scenarios_for(w),
            None => Scenario::ALL.to_vec(),
        }
    } else {
        scenarios.to_vec()
    };
    let mut runs = Vec::new();
    for s in scenarios {
        match user {
            Some(w) => runs.push(RunSpec {
                scenario: s,
                variant: None,
                workload: w.clone(),
                notes: Vec::new(),
            }),
            None => {
                // Scale the first variant; the others share its shape so they compare.
                let mut variants = default_runs(s).into_iter();
                let Some(first) = variants.next() else {
                    continue;
                };
                let first = scale_for_capacity(first, capacity);
                runs.push(first.clone());
                for mut other in variants {
                    let (attention, checkpoint) =
                        (other.workload.attention, other.workload.checkpoint);
                    other.workload = first.workload.clone();
                    other.workload.attention = attention;
                    other.workload.checkpoint = checkpoint;
                    other.notes = first.notes.clone();
                    runs.push(other);
                }
            }
        }
    }
    runs
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_default_keeps_a_boundary_above_one_on_a_small_budget() {
        for cap in [256u64 << 20, 512 << 20] {
            for run in plan_runs(&[], None, Some(cap)) {
                let max = crate::estimate::predicted_max(&run.workload, run.scenario, cap)
                    .unwrap()
                    .unwrap_or(0);
                assert!(
                    max > 1,
                    "{:?} {:?} at {cap}: predicted {max}",
                    run.scenario,
                    run.variant
                );
            }
        }
    }

    #[test]
    fn variants_of_a_scenario_share_one_shape() {
        let runs = plan_runs(&[Scenario::Activations], None, Some(512 << 20));
        assert_eq!(runs.len(), 2);
        assert_eq!(runs[0].workload.hidden, runs[1].workload.hidden);
        assert_eq!(runs[0].workload.seq, runs[1].workload.seq);
        assert_ne!(runs[0].workload.checkpoint, runs[1].workload.checkpoint);
        assert_eq!(runs[0].notes.len(), 1, "{:?}", runs[0].notes);
        assert!(
            !runs[0].notes[0].contains("hidden 512"),
            "only the last width: {:?}",
            runs[0].notes
        );
    }
}
