//! `--torch-version` and `--attention-mask`: what an older PyTorch (and transformers 4's BERT)
//! keeps, each against its closed form: before 1.11 every softmax saves its input as well
//! (pytorch/pytorch#64000), before 2.0 gradients are kept between steps and cuBLAS's workspace
//! is outside the caching allocator, before 1.13 kernels load eagerly; an additive mask in the embeddings' type makes the
//! softmax's input fp32 under autocast.

use crate::support::flags::workload;
use oomprobe::plan::Plan;
use oomprobe::workload::{Attention, Grads, ModuleLoading};

const BERT: &str = "--model bert-base --attention eager --batch 2 --seq 128 --layers 4";

fn saved(flags: &str) -> u64 {
    Plan::for_workload(&workload(flags)).unwrap().saved_bytes()
}

/// One [b, a, s, s] tensor of `bytes`-wide elements per layer.
fn scores_per_layers(bytes: u64) -> u64 {
    4 * 2 * 12 * 128 * 128 * bytes
}

#[test]
fn before_1_11_each_layer_saves_its_softmax_input() {
    for head in ["--head mlm", "--head seq-cls"] {
        let new = saved(&format!("{BERT} {head}"));
        // fp32: the scores themselves.
        let old = saved(&format!("{BERT} {head} --torch-version 1.10"));
        // The MLM head's log-softmax keeps its [b·s, V] input too (the caller holds the
        // logits meanwhile, so only the saved count moves by the layers').
        assert_eq!(old - new, scores_per_layers(4), "{head}");
        // 1.11 is as today.
        assert_eq!(saved(&format!("{BERT} {head} --torch-version 1.11.0")), new);
    }
    // CUDA autocast: softmax is on the fp32 list, so the input it saves is an fp32 copy of
    // the 16-bit scores; with transformers 4's mask, the promoted fp32 sum. Either way fp32.
    for mask in ["off", "on"] {
        let f = format!("{BERT} --head seq-cls --precision amp-fp16 --attention-mask {mask}");
        let new = saved(&f);
        let old = saved(&format!("{f} --torch-version 1.10"));
        assert_eq!(old - new, scores_per_layers(4), "mask {mask}");
    }
}

#[test]
fn the_release_sets_its_defaults_unless_a_flag_says_otherwise() {
    let w = workload(&format!("{BERT} --torch-version 1.13"));
    assert_eq!(w.grads, Grads::Keep);
    assert_eq!(w.cublas_workspace, Some(0));
    assert_eq!(w.cuda_modules, ModuleLoading::Lazy);
    let w = workload(&format!("{BERT} --torch-version 1.12"));
    assert_eq!(w.cuda_modules, ModuleLoading::Eager);
    let w = workload(&format!("{BERT} --torch-version 1.12 --cuda-modules lazy"));
    assert_eq!(w.cuda_modules, ModuleLoading::Lazy);
    let w = workload(&format!(
        "{BERT} --torch-version 1.13 --grads free --cublas-workspace 4MiB"
    ));
    assert_eq!(w.grads, Grads::Free);
    assert_eq!(w.cublas_workspace, Some(4 << 20));
    // No SDPA before 2.0: transformers ran eager attention.
    let w = workload("--model gpt2 --torch-version 1.12");
    assert_eq!(w.attention, Attention::Naive);
    let w = workload("--model gpt2 --torch-version 2.1");
    assert_eq!(w.attention, Attention::Sdpa);
    assert_eq!(w.grads, Grads::Free);
    assert_eq!(w.cublas_workspace, None);
}

#[test]
fn before_1_11_the_log_softmax_keeps_the_logits_the_caller_let_go() {
    // Only the loss leaves the step (the Trainer): today the logits go before the backward;
    // before 1.11 the log-softmax's saved input keeps them until the loss's backward.
    // At the backward's start the loss's gradient is made: the logits are alive then only if
    // something kept them.
    let f = "--model gpt2 --attention eager --batch 1 --seq 64 --layers 2 --outputs dropped \
             --grads free --cublas-workspace 0";
    let at_backward = |f: &str| {
        let p = Plan::for_workload(&workload(f)).unwrap();
        let first = p
            .events
            .iter()
            .position(|e| e.phase == oomprobe::plan::Phase::Backward)
            .unwrap();
        p.live_before(first)
    };
    let logits = 64 * 50257 * 4;
    let new = at_backward(f);
    let old = at_backward(&format!("{f} --torch-version 1.10"));
    // The layers' softmax inputs too: 2 layers of [1, 12, 64, 64] fp32.
    let scores = 2 * 12 * 64 * 64 * 4;
    assert_eq!(old, new + logits + scores, "{old} vs {new}");
}
