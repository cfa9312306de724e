//! ResNet-50 plans from its real layer shapes.
//!
//! torchvision's ResNet (v1.5: the stride sits on the 3×3 conv of a bottleneck): stem conv 7×7/2
//! (pad 3) + BN + ReLU + max-pool 3×3/2 (pad 1); four stages of bottlenecks with widths
//! w, 2w, 4w, 8w (w = `hidden`, 64 for ResNet-50) and expansion 4, blocks per stage by depth
//! (`layers`: 14 → [1,1,1,1], 26 → [2,2,2,2], 50 → [3,4,6,3], 101 → [3,4,23,3],
//! 152 → [3,8,36,3]); the first block of each stage has a 1×1 projection (conv + BN) on the
//! shortcut; global average pool; a fully connected classifier over `vocab` classes.
//! Parameters: conv weights (no biases), BN gain and bias (2c), fc weights and bias: 25,557,032
//! for ResNet-50 with 1000 classes.
//!
//! Stored activations (every conv, BN and ReLU output, as the issue asks; torchvision's in-place
//! ReLU would share the BN output's storage, so real PyTorch holds less on those terms): the input
//! image; per conv its output, its BN output and (where one follows) its ReLU output; the
//! max-pool output; each block's output (ReLU after the residual add); the pooled features
//! [b, 32w], logits [b, C] in the compute type and fp32 log-probabilities [b, C]. Max-pool indices
//! (int64) are not counted. Workspace: the loss gradient [b, C] fp32 and two gradient buffers the
//! size of the largest activation (one layer's backward input and output).
//! Steps: Conv2d per conv, LayerNorm over each (n, c) plane standing in for BN, ReLU, the fc
//! matmul; the max-pool and the residual adds have no kernel.

use super::build::{prod, sum, Builder, PlanError};
use super::params::{compute_dtype, push_states};
use super::{DType, Role, Step, TensorIx};
use crate::workload::{Checkpoint, Workload};

/// Bottleneck blocks per stage for a ResNet depth.
pub fn stage_blocks(depth: u64) -> Result<[u64; 4], PlanError> {
    Ok(match depth {
        14 => [1, 1, 1, 1],
        26 => [2, 2, 2, 2],
        50 => [3, 4, 6, 3],
        101 => [3, 4, 23, 3],
        152 => [3, 8, 36, 3],
        _ => {
            return Err(PlanError::Invalid(format!(
                "ResNet depth (layers) must be 14, 26, 50, 101 or 152, not {depth}"
            )))
        }
    })
}

/// One convolution of the network.
#[derive(Debug, Clone)]
struct Conv {
    name: String,
    c_in: u64,
    c_out: u64,
    k: u64,
    stride: u64,
    pad: u64,
    h_in: u64,
    relu: bool,
}

impl Conv {
    fn h_out(&self) -> u64 {
        (self.h_in + 2 * self.pad).saturating_sub(self.k) / self.stride + 1
    }
    fn weight_elems(&self) -> Result<u64, PlanError> {
        prod(
            &[self.c_out, self.c_in, self.k, self.k],
            "a ResNet conv weight",
        )
    }
}

/// A block of the network: its convs in order; `residual` marks bottlenecks (conv3 + shortcut).
struct Block {
    convs: Vec<Conv>,
    downsample: Option<Conv>,
}

struct Net {
    stem: Conv,
    pool_h: u64,
    blocks: Vec<(String, Block)>,
    features: u64,
}

fn net(w: &Workload) -> Result<Net, PlanError> {
    let blocks_per = stage_blocks(w.layers)?;
    let w0 = w.hidden;
    let stem = Conv {
        name: "stem.conv1".into(),
        c_in: 3,
        c_out: w0,
        k: 7,
        stride: 2,
        pad: 3,
        h_in: w.image,
        relu: true,
    };
    let h1 = stem.h_out();
    let pool_h = (h1 + 2).saturating_sub(3) / 2 + 1;
    let (mut c_in, mut hh) = (w0, pool_h);
    let mut blocks = Vec::new();
    for (si, &n) in blocks_per.iter().enumerate() {
        let width = w0.checked_mul(1 << si).ok_or_else(|| PlanError::Overflow {
            what: "the ResNet width".into(),
        })?;
        let out_c = width.checked_mul(4).ok_or_else(|| PlanError::Overflow {
            what: "the ResNet width".into(),
        })?;
        for bi in 0..n {
            let stride = if bi == 0 && si > 0 { 2 } else { 1 };
            let p = format!("s{}.b{}", si + 1, bi);
            let c1 = Conv {
                name: format!("{p}.conv1"),
                c_in,
                c_out: width,
                k: 1,
                stride: 1,
                pad: 0,
                h_in: hh,
                relu: true,
            };
            let c2 = Conv {
                name: format!("{p}.conv2"),
                c_in: width,
                c_out: width,
                k: 3,
                stride,
                pad: 1,
                h_in: hh,
                relu: true,
            };
            let c3 = Conv {
                name: format!("{p}.conv3"),
                c_in: width,
                c_out: out_c,
                k: 1,
                stride: 1,
                pad: 0,
                h_in: c2.h_out(),
                relu: false,
            };
            let downsample = (bi == 0).then(|| Conv {
                name: format!("{p}.down"),
                c_in,
                c_out: out_c,
                k: 1,
                stride,
                pad: 0,
                h_in: hh,
                relu: false,
            });
            hh = c2.h_out();
            blocks.push((
                p,
                Block {
                    convs: vec![c1, c2, c3],
                    downsample,
                },
            ));
            c_in = out_c;
        }
    }
    Ok(Net {
        stem,
        pool_h,
        blocks,
        features: c_in,
    })
}

/// Trainable parameters: conv weights, BN (2c per BN), fc (features·C + C).
pub fn param_count(w: &Workload) -> Result<u64, PlanError> {
    let n = net(w)?;
    let e = "the ResNet parameter count";
    let mut total = sum(&[n.stem.weight_elems()?, 2 * n.stem.c_out], e)?;
    for (_, b) in &n.blocks {
        for c in b.convs.iter().chain(b.downsample.iter()) {
            total = sum(&[total, c.weight_elems()?, 2 * c.c_out], e)?;
        }
    }
    sum(&[total, prod(&[n.features, w.vocab], e)?, w.vocab], e)
}

/// Build a ResNet plan at the workload's batch and image size.
pub fn build(b: &mut Builder, w: &Workload) -> Result<(), PlanError> {
    let n = net(w)?;
    let c = compute_dtype(w.precision);
    let psi = param_count(w)?;
    let states = push_states(b, w, psi, 1)?;
    if w.checkpoint != Checkpoint::None {
        b.note("checkpointing is not modelled for ResNet: all activations are stored");
    }
    if w.zero == 3 && w.gpus > 1 {
        b.note("ZeRO-3 on ResNet: convs read the local weight shard (no gather buffer)");
    }
    let weights = states.params;
    let bsz = w.batch;
    let wshard = b.tensor(weights).elems();
    // Largest activation per sample (channels, side) for the backward workspace.
    let mut largest = (3u64, w.image);

    let conv = |b: &mut Builder,
                cv: &Conv,
                x: TensorIx,
                largest: &mut (u64, u64)|
     -> Result<TensorIx, PlanError> {
        let ho = cv.h_out();
        let shape = [bsz, cv.c_out, ho, ho];
        if cv.c_out.saturating_mul(ho * ho) > largest.0.saturating_mul(largest.1 * largest.1) {
            *largest = (cv.c_out, ho);
        }
        let y = b.push(
            &format!("{}.out", cv.name),
            Role::Activations,
            c,
            &shape,
            ho,
        )?;
        if cv.weight_elems()? <= wshard {
            b.step(Step::Conv2d {
                x,
                w: weights,
                y,
                n: bsz,
                c_in: cv.c_in,
                h: cv.h_in,
                w_in: cv.h_in,
                c_out: cv.c_out,
                kernel: cv.k,
                stride: cv.stride,
                pad: cv.pad,
            });
        }
        let bn = b.push(&format!("{}.bn", cv.name), Role::Activations, c, &shape, ho)?;
        b.step(Step::LayerNorm {
            x: y,
            y: bn,
            rows: bsz.saturating_mul(cv.c_out),
            cols: ho * ho,
        });
        if cv.relu {
            let r = b.push(
                &format!("{}.relu", cv.name),
                Role::Activations,
                c,
                &shape,
                ho,
            )?;
            b.step(Step::Relu {
                x: bn,
                y: r,
                elems: prod(&shape, "a ResNet activation")?,
            });
            Ok(r)
        } else {
            Ok(bn)
        }
    };

    let img = w.image;
    let image = b.push("image", Role::Activations, c, &[bsz, 3, img, img], img)?;
    let stem = conv(b, &n.stem, image, &mut largest)?;
    let _ = stem;
    let ph = n.pool_h;
    let mut x = b.push(
        "stem.pool",
        Role::Activations,
        c,
        &[bsz, n.stem.c_out, ph, ph],
        ph,
    )?;
    for (p, blk) in &n.blocks {
        let mut y = x;
        for cv in &blk.convs {
            y = conv(b, cv, y, &mut largest)?;
        }
        if let Some(ds) = &blk.downsample {
            conv(b, ds, x, &mut largest)?;
        }
        let last = &blk.convs[blk.convs.len() - 1];
        let ho = last.h_out();
        let shape = [bsz, last.c_out, ho, ho];
        let out = b.push(&format!("{p}.out"), Role::Activations, c, &shape, ho)?;
        b.step(Step::Relu {
            x: y,
            y: out,
            elems: prod(&shape, "a ResNet activation")?,
        });
        x = out;
    }
    let f = n.features;
    let pooled = b.push("avgpool", Role::Activations, c, &[bsz, f], f)?;
    let classes = w.vocab;
    let logits = b.push("logits", Role::Activations, c, &[bsz, classes], classes)?;
    if f.saturating_mul(classes) <= wshard {
        b.step(Step::Matmul {
            a: pooled,
            b: weights,
            c: logits,
            batch: 1,
            m: bsz,
            n: classes,
            k: f,
        });
    }
    let logprobs = b.push(
        "logprobs",
        Role::Activations,
        DType::F32,
        &[bsz, classes],
        classes,
    )?;
    if c == DType::F32 {
        b.step(Step::Softmax {
            x: logits,
            y: logprobs,
            rows: bsz,
            cols: classes,
        });
    }
    b.push(
        "ws.grad_logits",
        Role::Workspace,
        DType::F32,
        &[bsz, classes],
        classes,
    )?;
    let (lc, lh) = largest;
    b.push("ws.grad_act_in", Role::Workspace, c, &[bsz, lc, lh, lh], lh)?;
    b.push(
        "ws.grad_act_out",
        Role::Workspace,
        c,
        &[bsz, lc, lh, lh],
        lh,
    )?;
    Ok(())
}
