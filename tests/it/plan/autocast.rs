//! torch.autocast plans (`--precision amp-fp16|amp-bf16`) against closed forms derived from
//! PyTorch's CUDA op lists (`plan::autocast`) and Hugging Face's model code: what differs from
//! fp32 and between CUDA's and CPU's lists is counted by hand here, per tensor.

use oomprobe::plan::autocast::Device;
use oomprobe::plan::build::param_count;
use oomprobe::plan::{Phase, Plan};
use oomprobe::workload::{presets, Attention, Gelu, Mode, Precision, Workload};

fn model(name: &str, precision: Precision, device: Device) -> Workload {
    let mut w = presets::get(name).unwrap();
    // The softmax dtypes under test are eager attention's.
    w.attention = Attention::Naive;
    w.batch = 2;
    if w.arch != oomprobe::workload::Arch::Vit {
        w.seq = 128;
    }
    w.precision = precision;
    w.autocast_device = device;
    w.gelu = Gelu::Fused;
    w.kv_cache = false;
    w.dropout = false;
    w
}

fn saved(w: &Workload) -> u64 {
    Plan::for_workload(w).unwrap().saved_bytes()
}

/// Bytes of live tensors whose names start with `prefix` when backward starts.
fn live_at_backward(plan: &Plan, prefix: &str) -> u64 {
    let start = plan
        .events
        .iter()
        .position(|e| e.phase >= Phase::Backward)
        .unwrap();
    plan.live_after(start)
        .into_iter()
        .filter(|&t| plan.tensors[t].name.starts_with(prefix))
        .map(|t| plan.tensors[t].bytes)
        .sum()
}

#[test]
fn gpt2_layer_under_cuda_autocast() {
    // One GPT-2 layer (fused GELU, no dropout) under CUDA autocast saves, per [b,s,h] element:
    // LN1 input 4 (fp32 residual), c_attn's 16-bit copy of the LN1 output 2, q, k, v 2+2+2,
    // the context 2, LN2 input 4, fc1's copy of LN2's output 2; per [b,s,f]: fc1 output 2,
    // GELU output 2; per [b,a,s,s]: the fp32 softmax output 4 (scores + the fp32 causal mask
    // promote) and its 16-bit `.type(value.dtype)` copy 2. fp32 saves 64·sbh + 4·as²b.
    for p in [Precision::AmpFp16, Precision::AmpBf16] {
        let mut w = model("gpt2", p, Device::Cuda);
        let (b, s, h, a, f) = (w.batch, w.seq, w.hidden, w.heads, w.ffn);
        let full = saved(&w);
        w.layers -= 1;
        let one = full - saved(&w);
        assert_eq!(
            one,
            s * b * h * 20 + s * b * f * 4 + a * s * s * b * 6,
            "{p:?}"
        );
    }
}

#[test]
fn weight_cast_cache_holds_half_the_matmul_weights() {
    // Every matmul weight (not biases, norms or position embeddings) is saved as its 16-bit
    // copy when backward starts: GPT-2 small 2 · (12 · (4h² + 2hf) + V·h) bytes.
    let w = model("gpt2", Precision::AmpFp16, Device::Cuda);
    let (h, f, v, l) = (w.hidden, w.ffn, w.vocab, w.layers);
    let plan = Plan::for_workload(&w).unwrap();
    plan.check_timeline().unwrap();
    let casts = live_at_backward(&plan, "cast.");
    assert_eq!(casts, 2 * (l * (4 * h * h + 2 * h * f) + v * h));
    // ≈ half the fp32 parameter bytes (the rest: biases, LayerNorms, positions).
    let p = param_count(&w).unwrap() * 4;
    assert!(casts * 2 < p && casts * 2 > p * 98 / 100, "{casts} vs {p}");
    // All of them are gone after backward; the states are fp32 (16 B/param with Adam).
    assert_eq!(plan.states_peak(), param_count(&w).unwrap() * 16);
    let end = plan.live_at_end();
    assert!(end
        .iter()
        .all(|&t| !plan.tensors[t].name.starts_with("cast.")));
}

#[test]
fn inference_holds_the_cast_weights_until_autocast_exits() {
    // Under no_grad the cache still fills (parameters require grad) and lives until the
    // forward's autocast region ends: params + their 16-bit copies at the head's matmul.
    let mut w = model("gpt2", Precision::AmpBf16, Device::Cuda);
    w.mode = Mode::Inference;
    let amp = Plan::for_workload(&w).unwrap().peak_bytes();
    w.precision = Precision::Fp32;
    let fp32 = Plan::for_workload(&w).unwrap().peak_bytes();
    let p = param_count(&w).unwrap() * 4;
    assert!(amp > p + p * 45 / 100, "amp inference {amp} vs params {p}");
    assert!(amp > fp32, "{amp} {fp32}");
}

#[test]
fn bert_softmax_and_head_norm_follow_the_device_lists() {
    // BERT's eager attention calls softmax without a dtype and adds no mask here: CUDA's
    // fp32_set_opt_dtype list makes the probabilities fp32 (saved) and probs·V casts them back
    // (saved), 4 + 2 bytes per score; CPU's lists leave them 16-bit (2). The MLM head's
    // LayerNorm reads a 16-bit GELU output: CUDA (layer_norm on the fp32 list) saves an fp32
    // copy of it and casts the fp32 output for the decoder (+2 bytes per [b,s,h] element).
    let cuda = model("bert-base", Precision::AmpBf16, Device::Cuda);
    let cpu = model("bert-base", Precision::AmpBf16, Device::Cpu);
    let (b, s, h, a, l) = (cuda.batch, cuda.seq, cuda.hidden, cuda.heads, cuda.layers);
    assert_eq!(
        saved(&cuda) - saved(&cpu),
        l * 4 * a * s * s * b + 2 * b * s * h
    );
}

#[test]
fn gelu_new_pow_runs_in_fp32_on_cuda_only() {
    // gelu_new under CUDA autocast: pow is on the fp32 list, so it saves an fp32 copy of its
    // input and tanh, 1 + tanh and the product are fp32 (the product cast back for c_proj):
    // 4 + 4 + 2 + 4 + 2 = 16 bytes per [b,s,f] element; CPU's lists keep all five 16-bit (10).
    let mut cuda = model("gpt2", Precision::AmpFp16, Device::Cuda);
    cuda.gelu = Gelu::Unfused;
    let mut cpu = cuda.clone();
    cpu.autocast_device = Device::Cpu;
    let (b, s, f, l) = (cuda.batch, cuda.seq, cuda.ffn, cuda.layers);
    assert_eq!(saved(&cuda) - saved(&cpu), l * 6 * b * s * f);
}

#[test]
fn vit_softmax_is_fp32_in_every_precision() {
    // ViT's eager attention asks for `softmax(..., dtype=float32).to(query.dtype)`: fp32
    // probabilities plus a 16-bit copy even in a pure fp16 model (model.half()); autocast's
    // lists give the same there.
    let w = model("vit-b16", Precision::Fp16, Device::Cuda);
    let plan = Plan::for_workload(&w).unwrap();
    let probs: Vec<_> = plan
        .tensors
        .iter()
        .filter(|t| t.name.ends_with(".attn.probs"))
        .collect();
    assert_eq!(probs.len() as u64, w.layers);
    assert!(probs.iter().all(|t| t.dtype == oomprobe::plan::DType::F32));
}

#[test]
fn autocast_step_is_a_consistent_timeline_everywhere() {
    for name in [
        "gpt2",
        "bert-base",
        "vit-b16",
        "llama-7b",
        "resnet50",
        "tiny-gpt",
    ] {
        for p in [Precision::AmpFp16, Precision::AmpBf16] {
            for dev in [Device::Cuda, Device::Cpu] {
                for ckpt in [false, true] {
                    let mut w = presets::get(name).unwrap();
                    w.attention = Attention::Naive;
                    w.batch = 1;
                    if name == "llama-7b" {
                        w.layers = 2;
                        w.seq = 64;
                    }
                    w.precision = p;
                    w.autocast_device = dev;
                    if ckpt {
                        w.checkpoint = oomprobe::workload::Checkpoint::Full;
                    }
                    let plan = Plan::for_workload(&w).unwrap();
                    plan.check_timeline().unwrap();
                    // Every cast copy is freed by the end of the step.
                    let end = plan.live_at_end();
                    assert!(
                        end.iter()
                            .all(|&t| !plan.tensors[t].name.starts_with("cast.")),
                        "{name} {p:?} {dev:?} ckpt {ckpt}"
                    );
                    // Autocast holds more than a pure 16-bit model, less than fp32's
                    // activations plus nothing cast (fp32 states, 16-bit activations).
                    let mut pure = w.clone();
                    pure.precision = if p == Precision::AmpFp16 {
                        Precision::Fp16
                    } else {
                        Precision::Bf16
                    };
                    assert!(plan.peak_bytes() > Plan::for_workload(&pure).unwrap().peak_bytes());
                }
            }
        }
    }
}
