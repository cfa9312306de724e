//! How a framework runs its step, against the plan: Lightning's closure (the last step's
//! gradients live through the forward and go when the backward begins), a step function that
//! hands back only the loss (the logits go before the backward), and the CPU's dropout, whose
//! saved noise has the input's type where CUDA's native_dropout saves a 1-byte mask.

use oomprobe::plan::{EventKind, Phase, Plan, Role};
use oomprobe::scenario::Scenario;
use oomprobe::workload::{presets, DropoutMask, Grads, Outputs, Precision, Workload};

fn gpt2(batch: u64, seq: u64) -> Workload {
    let mut w = presets::get("gpt2").unwrap();
    w.batch = batch;
    w.seq = seq;
    w.precision = Precision::Fp32;
    w
}

fn plan(w: &Workload) -> Plan {
    Plan::for_value(w, Scenario::Batch, w.batch).unwrap()
}

/// Bytes live after the last event of `phase`.
fn live_after_phase(p: &Plan, phase: Phase) -> u64 {
    let last = p.events.iter().rposition(|e| e.phase == phase).unwrap();
    p.live_after(last + 1)
        .iter()
        .map(|&t| p.tensors[t].bytes)
        .sum()
}

fn role_bytes(p: &Plan, role: Role, phase: Phase) -> u64 {
    p.events
        .iter()
        .filter(|e| e.phase == phase)
        .filter_map(|e| match e.kind {
            EventKind::Alloc(t) if p.tensors[t].role == role => Some(p.tensors[t].bytes),
            _ => None,
        })
        .sum()
}

#[test]
fn until_backward_holds_the_gradients_through_the_forward_only() {
    let free = plan(&gpt2(4, 256));
    let mut w = gpt2(4, 256);
    w.grads = Grads::UntilBackward;
    let until = plan(&w);
    let grads = role_bytes(&until, Role::Gradients, Phase::Setup);
    // Every trainable parameter's gradient, before the step (GPT-2's head is tied).
    assert_eq!(grads, 4 * oomprobe::plan::build::param_count(&w).unwrap());
    assert_eq!(role_bytes(&free, Role::Gradients, Phase::Setup), 0);
    assert_eq!(
        live_after_phase(&until, Phase::Loss),
        live_after_phase(&free, Phase::Loss) + grads
    );
    // Freed as the backward begins: from there on the two plans hold the same bytes.
    let first_bwd = |p: &Plan| {
        p.events
            .iter()
            .position(|e| e.phase == Phase::Backward)
            .unwrap()
    };
    let (fb, ub) = (first_bwd(&free), first_bwd(&until));
    let frees = until.events[ub..]
        .iter()
        .take_while(
            |e| matches!(e.kind, EventKind::Free(t) if until.tensors[t].role == Role::Gradients),
        )
        .count();
    assert!(frees > 0);
    let live =
        |p: &Plan, i: usize| -> u64 { p.live_after(i).iter().map(|&t| p.tensors[t].bytes).sum() };
    assert_eq!(live(&until, ub + frees), live(&free, fb));
    assert_eq!(
        live_after_phase(&until, Phase::Backward),
        live_after_phase(&free, Phase::Backward)
    );
}

#[test]
fn dropped_outputs_free_the_logits_before_the_backward() {
    let (b, s, v) = (4u64, 256u64, 50257u64);
    // No cache: the logits are all the outputs hold.
    let mut w = gpt2(b, s);
    w.kv_cache = false;
    let kept = plan(&w);
    w.outputs = Outputs::Dropped;
    let dropped = plan(&w);
    let logits = |p: &Plan| p.tensors.iter().position(|t| t.name == "logits").unwrap();
    let freed_in = |p: &Plan| {
        let t = logits(p);
        p.events
            .iter()
            .find(|e| matches!(e.kind, EventKind::Free(x) if x == t))
            .unwrap()
            .phase
    };
    assert_eq!(freed_in(&dropped), Phase::Loss);
    assert_ne!(freed_in(&kept), Phase::Loss);
    // The peak is in the backward, at the logits' gradients: the logits are not there.
    let logits_bytes = b * s * v * 4;
    assert_eq!(dropped.tensors[logits(&dropped)].bytes, logits_bytes);
    assert_eq!(dropped.peak_bytes() + logits_bytes, kept.peak_bytes());
}

#[test]
fn cpu_dropout_keeps_noise_of_the_inputs_type() {
    let masks = |m: DropoutMask| -> (u64, u64) {
        let mut w = gpt2(2, 128);
        w.dropout_mask = m;
        w.attention = oomprobe::workload::Attention::Naive;
        let p = plan(&w);
        let of = |suffix: &str| -> u64 {
            p.tensors
                .iter()
                .filter(|t| t.name.ends_with(suffix))
                .map(|t| t.bytes)
                .sum()
        };
        (
            of("attn.drop_mask"),
            of(".drop_mask") - of("attn.drop_mask"),
        )
    };
    let (attn_bool, rest_bool) = masks(DropoutMask::Bool);
    let (attn_in, rest_in) = masks(DropoutMask::Input);
    let (b, s, h, a, l) = (2u64, 128u64, 768u64, 12u64, 12u64);
    assert_eq!(attn_bool, l * a * s * s * b);
    // Embedding, attention-output and MLP dropouts: 2 per layer plus one.
    assert_eq!(rest_bool, (2 * l + 1) * s * b * h);
    assert_eq!((attn_in, rest_in), (4 * attn_bool, 4 * rest_bool));
}
