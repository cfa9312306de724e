//! Any layout either is refused by the layout check (the CLI's exit 2 naming the dimension) or
//! plans every one of its stages' ranks into a consistent timeline: no panic, no overflow of
//! what fits, each tensor allocated once and freed at most once.

use oomprobe::plan::Plan;
use oomprobe::workload::parallel::{self, Fsdp, Parallel, Schedule, TpHead};
use oomprobe::workload::{presets, Attention, Checkpoint, Precision};
use proptest::prelude::*;

/// A layout the check mostly accepts: the GPUs are dp × tp × pp × cp, each option only where
/// its degree is above 1 (the refusals have their own test in tests/it/cli/parallel.rs).
fn layout() -> impl Strategy<Value = (Parallel, u64, u8)> {
    (
        (
            prop::sample::select(vec![1u64, 2, 4]),
            any::<bool>(),
            prop::sample::select(vec![TpHead::Sharded, TpHead::Gathered, TpHead::Replicated]),
            prop::sample::select(vec![1u64, 2, 4]),
            0u64..9,
            prop::sample::select(vec![
                Schedule::Gpipe,
                Schedule::OneFOneB,
                Schedule::Interleaved,
            ]),
        ),
        (
            prop::sample::select(vec![1u64, 2]),
            prop::sample::select(vec![
                None,
                Some(Fsdp::Full),
                Some(Fsdp::Hybrid),
                Some(Fsdp::ShardGradOp),
            ]),
            any::<bool>(),
            prop::option::of(prop::sample::select(vec![1u64, 25])),
            any::<bool>(),
            any::<u64>(),
            any::<bool>(),
        ),
        prop::sample::select(vec![1u64, 2, 4]),
        0u8..4,
    )
        .prop_map(
            |((tp, sp, head, pp, m, sched), (cp, fsdp, raf, ddp, view, rank, pick), dp, zero)| {
                let gpus = dp * tp * pp * cp;
                let interleaved = pp > 1 && sched == Schedule::Interleaved;
                let p = Parallel {
                    tp,
                    sequence_parallel: sp && tp > 1,
                    tp_head: if tp > 1 { head } else { TpHead::Sharded },
                    pp,
                    microbatches: if pp > 1 { m } else { 0 },
                    schedule: if pp > 1 { sched } else { Schedule::OneFOneB },
                    chunks: if interleaved { 2 } else { 1 },
                    cp,
                    fsdp: if ddp.is_some() { None } else { fsdp },
                    reshard_after_forward: raf,
                    // FSDP1 on the draws that also pick a rank (either way on the others).
                    fsdp1: pick && ddp.is_none() && fsdp.is_some(),
                    // BACKWARD_POST on half of FSDP1's draws.
                    no_pre_prefetch: pick && view,
                    offload: false,
                    ddp_bucket_mb: ddp,
                    bucket_view: view && ddp.is_some(),
                    rank: pick.then_some(rank % gpus),
                };
                let zero = if p.fsdp.is_none() && tp * pp * cp == 1 {
                    zero
                } else {
                    0
                };
                (p, gpus, zero)
            },
        )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, .. ProptestConfig::default() })]
    #[test]
    fn a_layout_is_refused_or_planned(
        (p, gpus, zero) in layout(),
        model in prop::sample::select(vec!["tiny-gpt", "llama3-8b"]),
        ckpt in any::<bool>(),
        amp in any::<bool>(),
    ) {
        let mut w = presets::get(model).unwrap();
        if model == "llama3-8b" {
            w.layers = 4;
            w.hidden = 256;
            w.heads = 8;
            w.kv_heads = Some(4);
            w.ffn = 512;
            w.vocab = 1000;
            w.seq = 64;
            w.attention = Attention::Sdpa;
        }
        w.batch = 2;
        w.gpus = gpus;
        w.zero = zero;
        w.parallel = p;
        if ckpt {
            w.checkpoint = Checkpoint::Full;
        }
        if amp {
            w.precision = Precision::AmpBf16;
        }
        if parallel::check(&w).is_err() || oomprobe::plan::build::validate(&w).is_err() {
            return Ok(());
        }
        let plan = Plan::for_workload(&w);
        prop_assert!(plan.is_ok(), "{:?}: {:?}", w.parallel, plan.err());
        let plan = plan.unwrap();
        prop_assert!(plan.check_timeline().is_ok(), "{:?}: {:?}", w.parallel, plan.check_timeline());
        prop_assert!(plan.peak_bytes() > 0);
        // Every rank of every stage plans too (the worst one was only one of them).
        for r in w.stage_ranks() {
            let mut v = w.clone();
            v.parallel.rank = Some(r);
            let p = Plan::for_workload(&v).unwrap();
            prop_assert!(p.check_timeline().is_ok(), "rank {r} of {:?}", w.parallel);
            prop_assert!(p.peak_bytes() <= plan.peak_bytes() || w.parallel.rank.is_some());
        }
    }
}
