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
//! Saved tensors as torchvision's code makes them (ReLU and the residual add are in place):
//! the input image (stem conv input); per conv its output (BN input) and its BN output, which
//! the in-place ReLU (and, after conv3, the in-place `+= identity` and ReLU) overwrite — so a
//! block's output is its conv3 BN output; the max-pool's int64 indices (its input is the stem's
//! BN output); the pooled features [b, 32w] (fc input). A projection shortcut saves its conv
//! output; its BN output is a temporary added into the main path and never saved. The caller
//! holds the logits [b, C]; the loss saves fp32 log-probabilities [b, C]. BN's per-channel
//! statistics are not counted.
//!
//! Backward walks the convs in reverse: each makes the gradient of its BN/ReLU output and of its
//! input, and its weight gradient appears; a block keeps its incoming gradient for the shortcut
//! and sums the two paths into a new tensor.
//!
//! Under autocast (`amp-*`; both CUDA's and CPU's lists put convolutions and linear layers on
//! the lower-precision list and batch norm, ReLU, pooling on none): every activation is 16-bit,
//! the conv weights and the fc are cast once (the weight-cast cache), the stem conv saves a
//! 16-bit copy of the fp32 image, and the loss computes fp32 log-probabilities from the 16-bit
//! logits (an fp32 copy first, except CUDA fp16's `half_to_float` log-softmax).
//!
//! Steps: Conv2d per conv, LayerNorm over each (n, c) plane standing in for BN, the fc matmul;
//! the in-place ReLUs, the max-pool and the residual adds have no kernel.

use super::autocast::Device;
use super::builder::{prod, sum, Builder, PlanError};
use super::params::{compute_dtype, Piece, States};
use super::{DType, Phase, Role, Step, TensorIx};
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
            };
            let c2 = Conv {
                name: format!("{p}.conv2"),
                c_in: width,
                c_out: width,
                k: 3,
                stride,
                pad: 1,
                h_in: hh,
            };
            let c3 = Conv {
                name: format!("{p}.conv3"),
                c_in: width,
                c_out: out_c,
                k: 1,
                stride: 1,
                pad: 0,
                h_in: c2.h_out(),
            };
            let downsample = (bi == 0).then(|| Conv {
                name: format!("{p}.down"),
                c_in,
                c_out: out_c,
                k: 1,
                stride,
                pad: 0,
                h_in: hh,
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

/// Parameter groups: each conv with its BN (weight + 2c), then the classifier.
pub fn pieces(w: &Workload) -> Result<Vec<Piece>, PlanError> {
    let n = net(w)?;
    let e = "the ResNet parameter count";
    let mut out = Vec::new();
    let mut conv = |c: &Conv| -> Result<(), PlanError> {
        out.push(Piece::new(
            c.name.clone(),
            sum(&[c.weight_elems()?, 2 * c.c_out], e)?,
        ));
        Ok(())
    };
    conv(&n.stem)?;
    for (_, b) in &n.blocks {
        for c in b.convs.iter().chain(b.downsample.iter()) {
            conv(c)?;
        }
    }
    out.push(Piece::new(
        "fc",
        sum(&[prod(&[n.features, w.vocab], e)?, w.vocab], e)?,
    ));
    Ok(out)
}

/// Trainable parameters: conv weights, BN (2c per BN), fc (features·C + C).
pub fn param_count(w: &Workload) -> Result<u64, PlanError> {
    let elems: Vec<u64> = pieces(w)?.iter().map(|p| p.elems).collect();
    sum(&elems, "the ResNet parameter count")
}

/// One conv's forward record: its saved output and BN output, and shapes for its backward.
struct ConvFrame {
    piece: String,
    saved: Vec<TensorIx>,
    in_shape: [u64; 4],
    out_shape: [u64; 4],
}

struct R<'a> {
    b: &'a mut Builder,
    w: &'a Workload,
    states: States,
    bsz: u64,
    c: DType,
    /// Training saves each conv output for backward; inference (no_grad) frees it after BN.
    train: bool,
}

impl R<'_> {
    fn act(&mut self, name: &str, shape: [u64; 4], role: Role) -> Result<TensorIx, PlanError> {
        let c = self.c;
        self.b.push(name, role, c, &shape, shape[3])
    }

    /// conv → BN (→ in-place ReLU): allocates the conv output and the BN output (the layer's
    /// output). `keep_bn` false: the BN output is a temporary the caller frees (a shortcut).
    fn conv(&mut self, cv: &Conv, x: TensorIx) -> Result<(ConvFrame, TensorIx), PlanError> {
        let ho = cv.h_out();
        let bsz = self.bsz;
        let shape = [bsz, cv.c_out, ho, ho];
        let y = self.act(&format!("{}.out", cv.name), shape, Role::Activations)?;
        let we = cv.weight_elems()?;
        let wt = match self.states.cast(self.b, &cv.name, (we, 0, we))? {
            Some(t) => t,
            None => self.states.weights(&cv.name),
        };
        // Under ZeRO-3 a conv reads the local shard; one smaller than its weight runs no kernel.
        if cv.weight_elems()? <= self.b.tensor(wt).elems() {
            self.b.step(Step::Conv2d {
                x,
                w: wt,
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
        let bn = self.act(&format!("{}.bn", cv.name), shape, Role::Activations)?;
        self.b.step(Step::LayerNorm {
            x: y,
            y: bn,
            rows: bsz.saturating_mul(cv.c_out),
            cols: ho * ho,
        });
        let saved = if self.train {
            vec![y]
        } else {
            self.b.free(y);
            Vec::new()
        };
        Ok((
            ConvFrame {
                piece: cv.name.clone(),
                saved,
                in_shape: [bsz, cv.c_in, cv.h_in, cv.h_in],
                out_shape: shape,
            },
            bn,
        ))
    }

    /// Backward through one conv: the gradient of its BN/ReLU output, then of its input; its
    /// weight gradient appears; its saved tensors are freed. Consumes `g` unless `keep_g`.
    /// The stem (`input_grad` false) makes no gradient for the image.
    fn backward(
        &mut self,
        fr: ConvFrame,
        g: TensorIx,
        keep_g: bool,
        input_grad: bool,
    ) -> Result<Option<TensorIx>, PlanError> {
        let w = self.w;
        self.states.gradient(self.b, &fr.piece, w)?;
        let g_bn = self.act(
            &format!("{}.grad_bn", fr.piece),
            fr.out_shape,
            Role::Workspace,
        )?;
        if !keep_g {
            self.b.free(g);
        }
        let g_in = if input_grad {
            Some(self.act(
                &format!("{}.grad_in", fr.piece),
                fr.in_shape,
                Role::Workspace,
            )?)
        } else {
            None
        };
        self.b.free(g_bn);
        self.b.free_all(fr.saved);
        Ok(g_in)
    }
}

/// One bottleneck block's forward, kept for its backward.
struct BlockRec {
    convs: Vec<ConvFrame>,
    down: Option<ConvFrame>,
    input: TensorIx,
    outputs: Vec<TensorIx>,
}

impl R<'_> {
    /// The stem: the image (under autocast an fp32 input held beside its 16-bit copy), its
    /// conv and max-pool. The stem's frame (with what its backward needs saved), the pool's
    /// output and the inputs held to the step's end.
    fn stem(&mut self, n: &Net) -> Result<(ConvFrame, TensorIx, Vec<TensorIx>), PlanError> {
        let (bsz, train) = (self.bsz, self.train);
        let img = self.w.image;
        let ac = super::params::autocast(self.w);
        // Under autocast the pixels stay an fp32 input (held, not saved): the stem conv saves its
        // 16-bit copy.
        let mut inputs = Vec::new();
        let image = if ac.is_some() {
            let shape = [bsz, 3, img, img];
            inputs.push(
                self.b
                    .push("input.image", Role::Workspace, DType::F32, &shape, img)?,
            );
            self.act("image.cast", shape, Role::Activations)?
        } else {
            self.act("image", [bsz, 3, img, img], Role::Activations)?
        };
        let (stem_fr, stem_out) = self.conv(&n.stem, image)?;
        let ph = n.pool_h;
        let pool_shape = [bsz, n.stem.c_out, ph, ph];
        let pool_out = self.act("stem.pool", pool_shape, Role::Activations)?;
        // Frames in forward order; `None` marks a block boundary handled below.
        let mut stem_saved = vec![image];
        stem_saved.extend(stem_fr.saved.iter().copied());
        stem_saved.push(stem_out);
        if train {
            let idx = self.b.push(
                "stem.pool_indices",
                Role::Activations,
                DType::I64,
                &pool_shape,
                ph,
            )?;
            stem_saved.push(idx);
        } else {
            self.b.free_all(std::mem::take(&mut stem_saved));
        }
        let stem_fr = ConvFrame {
            saved: stem_saved,
            ..stem_fr
        };
        Ok((stem_fr, pool_out, inputs))
    }

    /// The bottleneck blocks' forward from `x`: what each block's backward needs, and the last
    /// block's output.
    fn blocks_forward(
        &mut self,
        n: &Net,
        mut x: TensorIx,
    ) -> Result<(Vec<BlockRec>, TensorIx), PlanError> {
        let train = self.train;
        let mut blocks: Vec<BlockRec> = Vec::new();
        for (_, blk) in &n.blocks {
            let mut frames = Vec::new();
            let mut outputs = Vec::new();
            let mut y = x;
            for cv in &blk.convs {
                let (fr, out) = self.conv(cv, y)?;
                if !train && y != x {
                    // no_grad: the previous conv's output dies once the next one has read it.
                    self.b.free(y);
                }
                frames.push(fr);
                outputs.push(out);
                y = out;
            }
            let down = match &blk.downsample {
                Some(ds) => {
                    let (fr, bn) = self.conv(ds, x)?;
                    // The shortcut's BN output is added in place into conv3's and freed.
                    self.b.free(bn);
                    Some(fr)
                }
                None => None,
            };
            if !train {
                self.b.free(x);
            }
            blocks.push(BlockRec {
                convs: frames,
                down,
                input: x,
                outputs: outputs.clone(),
            });
            x = y;
        }
        Ok((blocks, x))
    }

    /// The blocks' backward, last block first, from the gradient `g` of the last block's output:
    /// the gradient of the first block's input.
    fn blocks_backward(
        &mut self,
        mut blocks: Vec<BlockRec>,
        mut g: TensorIx,
    ) -> Result<TensorIx, PlanError> {
        while let Some(blk) = blocks.pop() {
            // The block's output (its conv3 BN output) goes with conv3's frame; the incoming
            // gradient stays alive for the shortcut.
            let g_block = g;
            let mut outputs = blk.outputs;
            let mut gm = g_block;
            let mut first = true;
            let mut convs = blk.convs;
            while let Some(fr) = convs.pop() {
                let out = outputs.pop();
                let gi = self.backward(fr, gm, first, true)?.unwrap_or(gm);
                if let Some(o) = out {
                    self.b.free(o);
                }
                first = false;
                gm = gi;
            }
            let g_short = match blk.down {
                Some(fr) => self.backward(fr, g_block, true, true)?.unwrap_or(g_block),
                None => g_block,
            };
            let in_shape = self.b.tensor(blk.input).shape.clone();
            let sh = [in_shape[0], in_shape[1], in_shape[2], in_shape[3]];
            let g_sum = self.act("grad.block_in", sh, Role::Workspace)?;
            self.b.free(gm);
            if g_short != g_block {
                self.b.free(g_short);
            }
            self.b.free(g_block);
            g = g_sum;
        }
        Ok(g)
    }
}

/// Build a ResNet step's timeline at the workload's batch and image size.
pub fn build(b: &mut Builder, w: &Workload) -> Result<(), PlanError> {
    let n = net(w)?;
    let c = compute_dtype(w.precision);
    let train = !w.inference();
    let states = States::setup(b, w, &pieces(w)?)?;
    if w.checkpoint != Checkpoint::None {
        b.note("checkpointing is not modelled for ResNet: all activations are stored");
    }
    if w.zero == 3 && w.gpus > 1 {
        b.note("ZeRO-3 on ResNet: convs read the local weight shard (no gather buffer)");
    }
    let bsz = w.batch;
    let mut r = R {
        b,
        w,
        states,
        bsz,
        c,
        train,
    };
    r.b.phase(Phase::Forward);
    let (stem_fr, pool_out, inputs) = r.stem(&n)?;
    let (blocks, x) = r.blocks_forward(&n, pool_out)?;
    let ac = super::params::autocast(w);
    let f = n.features;
    let pooled = r.b.push("avgpool", Role::Activations, c, &[bsz, f], f)?;
    let classes = w.vocab;
    let logits =
        r.b.push("logits", Role::Activations, c, &[bsz, classes], classes)?;
    let fe = f.saturating_mul(classes);
    let wt = match r
        .states
        .cast(r.b, "fc", (fe, classes, fe.saturating_add(classes)))?
    {
        Some(t) => t,
        None => r.states.weights("fc"),
    };
    if f.saturating_mul(classes) <= r.b.tensor(wt).elems() {
        r.b.step(Step::Matmul {
            a: pooled,
            b: wt,
            c: logits,
            batch: 1,
            m: bsz,
            n: classes,
            k: f,
        });
    }
    if !train {
        r.states.autocast_exit(r.b, |_| true);
        r.b.free_all([x, pooled, logits]);
        r.b.free_all(inputs);
        return Ok(());
    }
    r.b.phase(Phase::Loss);
    // F.cross_entropy on the logits as they are: fp32 log-probabilities (from an fp32 copy
    // under autocast, except CUDA fp16's one-kernel `half_to_float`); without autocast the
    // log-softmax runs in the logits' type.
    let half_to_float = ac.is_some_and(|a| a.device == Device::Cuda && c == DType::F16);
    let lp_dtype = if ac.is_some() { DType::F32 } else { c };
    let shape = [bsz, classes];
    let (logprobs, kept) = r.b.loss_log_softmax(
        logits,
        bsz,
        classes,
        ac.is_some() && !half_to_float,
        lp_dtype,
        w.softmax_saves_input(),
    )?;
    r.states.autocast_exit(r.b, |_| false);
    r.states.begin_backward(r.b);
    let g_lp =
        r.b.push("grad.logprobs", Role::Workspace, lp_dtype, &shape, classes)?;
    let gl_dtype = if half_to_float { c } else { lp_dtype };
    let mut g_logits =
        r.b.push("grad.logits", Role::Workspace, gl_dtype, &shape, classes)?;
    r.b.free_all([g_lp, logprobs]);
    r.b.free_all(kept);
    if gl_dtype != c {
        // ToCopyBackward0 of the fp32 copy: the logits' own type.
        let g =
            r.b.push("grad.logits_16", Role::Workspace, c, &shape, classes)?;
        r.b.free(g_logits);
        g_logits = g;
    }
    r.states.gradient(r.b, "fc", w)?;
    let g_pool = r.b.push("grad.pooled", Role::Workspace, c, &[bsz, f], f)?;
    r.b.free_all([g_logits, pooled]);
    // avgpool backward: the gradient of the last block's output.
    let last_shape = blocks
        .last()
        .and_then(|b| b.convs.last())
        .map(|fr| fr.out_shape)
        .unwrap_or([bsz, f, 1, 1]);
    let g = r.act("grad.features", last_shape, Role::Workspace)?;
    r.b.free(g_pool);
    let g = r.blocks_backward(blocks, g)?;
    // Max-pool backward, then the stem; the block input of the first block is the pool output.
    r.b.free(pool_out);
    let g_stem = r.act("grad.stem_out", stem_fr.out_shape, Role::Workspace)?;
    r.b.free(g);
    r.backward(stem_fr, g_stem, false, false)?;
    let w_ = r.w;
    r.b.free(logits);
    r.b.free_all(inputs);
    r.states.optimizer_step(r.b, w_)?;
    Ok(())
}
