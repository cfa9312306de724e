//! Plans: for one workload, scenario and value x, the timeline of one step: the tensors it
//! allocates and frees in order and the kernel steps that write and read them. Pure and
//! backend-free: the estimate (the timeline's peak) and the probe (its replay) both come from the
//! same plan.

pub mod autocast;
pub mod build;
pub mod builder;
pub mod params;
pub mod ranks;
pub mod resnet;
pub mod timeline;
pub mod transformer;

pub use timeline::{CurvePoint, Event, EventKind, Peak, Phase};

use serde::{Deserialize, Serialize};

/// What a tensor is for (the breakdown's rows).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    Params,
    Gradients,
    Optimizer,
    Activations,
    Attention,
    Workspace,
}

impl Role {
    pub const ALL: [Role; 6] = [
        Role::Params,
        Role::Gradients,
        Role::Optimizer,
        Role::Activations,
        Role::Attention,
        Role::Workspace,
    ];
    pub fn name(self) -> &'static str {
        match self {
            Role::Params => "params",
            Role::Gradients => "gradients",
            Role::Optimizer => "optimizer",
            Role::Activations => "activations",
            Role::Attention => "attention",
            Role::Workspace => "workspace",
        }
    }
}

/// Element type of a tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    F32,
    F16,
    Bf16,
    /// 1-byte elements (dropout masks).
    U8,
    /// 8-byte integers (max-pool indices).
    I64,
}

impl DType {
    pub fn bytes(self) -> u64 {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::Bf16 => 2,
            DType::U8 => 1,
            DType::I64 => 8,
        }
    }
    /// The kernel storage type for compute over this tensor (U8 masks are only filled).
    pub fn storage(self) -> crate::kernels::Storage {
        use crate::kernels::Storage;
        match self {
            DType::F32 | DType::U8 | DType::I64 => Storage::F32,
            DType::F16 => Storage::F16,
            DType::Bf16 => Storage::Bf16,
        }
    }
}

/// Index of a tensor in `Plan::tensors`.
pub type TensorIx = usize;

/// One tensor of the step (allocated once and freed at most once in the timeline).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TensorSpec {
    pub name: String,
    pub role: Role,
    pub dtype: DType,
    /// Logical shape; `elems()` is its product.
    pub shape: Vec<u64>,
    /// Exact bytes (elems × dtype bytes), computed with checked arithmetic.
    pub bytes: u64,
    /// Elements in one row: chunks of a big tensor never split a row, so row-wise kernels
    /// (matmul rows, softmax, layer norm) work across chunk boundaries.
    pub row_elems: u64,
    /// The CUDA stream whose context allocates it: the caching allocator keeps a pool per
    /// stream, and a freed block is reused only by its own stream's allocations.
    #[serde(default, skip_serializing_if = "Stream::is_compute")]
    pub stream: Stream,
    /// Bytes of each PyTorch tensor this one stands for, when it stands for several: a piece's
    /// parameters, gradients and optimizer states are one tensor here and one per parameter in
    /// PyTorch, so the caching allocator is asked for `bytes / part_bytes` blocks of
    /// `part_bytes` and one of the rest (0: one block).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub part_bytes: u64,
}

fn is_zero(v: &u64) -> bool {
    *v == 0
}

/// The streams a step allocates on (PyTorch's caching allocator: `Block::stream`, and
/// `get_free_block` searches the allocating stream's blocks only).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Stream {
    /// The default (compute) stream: activations, parameters, gradients, optimizer state.
    #[default]
    Compute,
    /// FSDP2's all-gather copy-in stream: each unit's all-gather input and output
    /// (`foreach_all_gather` under `all_gather_copy_in_stream`).
    AllGather,
    /// FSDP2's reduce-scatter stream: each unit's reduce-scatter output, which the sharded
    /// gradients are views of (`foreach_reduce`, `reduce_output` under `reduce_scatter_stream`).
    ReduceScatter,
}

impl Stream {
    /// The stream id the allocator model keys its pools by.
    pub fn id(self) -> i64 {
        match self {
            Stream::Compute => 0,
            Stream::AllGather => 1,
            Stream::ReduceScatter => 2,
        }
    }
    pub fn is_compute(&self) -> bool {
        *self == Stream::Compute
    }
}

impl TensorSpec {
    pub fn elems(&self) -> u64 {
        self.bytes / self.dtype.bytes()
    }
    /// The blocks the caching allocator is asked for, in order (see `part_bytes`).
    pub fn blocks(&self) -> impl Iterator<Item = u64> {
        let (part, whole, rest) = if self.part_bytes == 0 || self.part_bytes >= self.bytes {
            (self.bytes, 1, 0)
        } else {
            let p = self.part_bytes;
            (p, self.bytes / p, self.bytes % p)
        };
        std::iter::repeat_n(part, whole as usize).chain((rest > 0).then_some(rest))
    }
}

/// A real kernel the probe runs in `--compute full` mode over the plan's tensors. Shapes are in
/// elements; every tensor index must hold at least the elements the step touches.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Step {
    /// c[batch][m][n] = a[batch][m][k] · b[k][n] (b shared across the batch, e.g. a linear layer
    /// over `batch*m` rows).
    Matmul {
        a: TensorIx,
        b: TensorIx,
        c: TensorIx,
        batch: u64,
        m: u64,
        n: u64,
        k: u64,
    },
    /// Row softmax of x[rows][cols] into y.
    Softmax {
        x: TensorIx,
        y: TensorIx,
        rows: u64,
        cols: u64,
    },
    /// Naive attention for `batch_heads` heads: scores = q·kᵀ/√d, probs = softmax(scores)
    /// (both [bh][seq][seq], stored), out = probs·v. q, k, v, out: [bh][seq][head_dim].
    Attention {
        q: TensorIx,
        k: TensorIx,
        v: TensorIx,
        scores: TensorIx,
        probs: TensorIx,
        out: TensorIx,
        batch_heads: u64,
        seq: u64,
        head_dim: u64,
        causal: bool,
    },
    /// Tiled attention with online softmax: no N×N buffer; `stats` holds [bh][seq][2]
    /// (row max, row sum) for the backward pass. Query head `i` reads key/value head
    /// `i / kv_group`.
    FlashAttention {
        q: TensorIx,
        k: TensorIx,
        v: TensorIx,
        out: TensorIx,
        stats: TensorIx,
        batch_heads: u64,
        seq: u64,
        head_dim: u64,
        causal: bool,
        /// Query heads per key/value head (grouped-query attention: k and v hold
        /// `batch_heads / kv_group` heads); 0 or 1 for one each.
        #[serde(default)]
        kv_group: u64,
    },
    /// Layer norm over rows of x[rows][cols] into y (unit gain, zero bias).
    LayerNorm {
        x: TensorIx,
        y: TensorIx,
        rows: u64,
        cols: u64,
    },
    Gelu {
        x: TensorIx,
        y: TensorIx,
        elems: u64,
    },
    Relu {
        x: TensorIx,
        y: TensorIx,
        elems: u64,
    },
    /// NCHW conv: x[n][c_in][h][w] * w[c_out][c_in][kh][kw] -> y[n][c_out][h_out][w_out].
    Conv2d {
        x: TensorIx,
        w: TensorIx,
        y: TensorIx,
        n: u64,
        c_in: u64,
        h: u64,
        w_in: u64,
        c_out: u64,
        kernel: u64,
        stride: u64,
        pad: u64,
    },
    /// One Adam update of params p with gradients g and moments m, v (all `elems` long).
    Adam {
        p: TensorIx,
        g: TensorIx,
        m: TensorIx,
        v: TensorIx,
        elems: u64,
    },
}

impl Step {
    /// The same kernel over other tensors (`f` maps each index).
    pub fn map_tensors(&self, f: impl Fn(TensorIx) -> TensorIx) -> Step {
        let mut s = self.clone();
        match &mut s {
            Step::Matmul { a, b, c, .. } => {
                *a = f(*a);
                *b = f(*b);
                *c = f(*c);
            }
            Step::Softmax { x, y, .. }
            | Step::LayerNorm { x, y, .. }
            | Step::Gelu { x, y, .. }
            | Step::Relu { x, y, .. } => {
                *x = f(*x);
                *y = f(*y);
            }
            Step::Attention {
                q,
                k,
                v,
                scores,
                probs,
                out,
                ..
            } => {
                for t in [q, k, v, scores, probs, out] {
                    *t = f(*t);
                }
            }
            Step::FlashAttention {
                q,
                k,
                v,
                out,
                stats,
                ..
            } => {
                for t in [q, k, v, out, stats] {
                    *t = f(*t);
                }
            }
            Step::Conv2d { x, w, y, .. } => {
                *x = f(*x);
                *w = f(*w);
                *y = f(*y);
            }
            Step::Adam { p, g, m, v, .. } => {
                for t in [p, g, m, v] {
                    *t = f(*t);
                }
            }
        }
        s
    }
    /// The tensors a kernel reads or writes.
    pub fn tensors(&self) -> Vec<TensorIx> {
        match *self {
            Step::Matmul { a, b, c, .. } => vec![a, b, c],
            Step::Softmax { x, y, .. }
            | Step::LayerNorm { x, y, .. }
            | Step::Gelu { x, y, .. }
            | Step::Relu { x, y, .. } => vec![x, y],
            Step::Attention {
                q,
                k,
                v,
                scores,
                probs,
                out,
                ..
            } => vec![q, k, v, scores, probs, out],
            Step::FlashAttention {
                q,
                k,
                v,
                out,
                stats,
                ..
            } => vec![q, k, v, out, stats],
            Step::Conv2d { x, w, y, .. } => vec![x, w, y],
            Step::Adam { p, g, m, v, .. } => vec![p, g, m, v],
        }
    }
}

/// The timeline of one step at one value of the varied dimension.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Plan {
    pub workload: crate::workload::Workload,
    pub scenario: crate::scenario::Scenario,
    /// The value of the varied dimension (params, batch or seq).
    pub value: u64,
    /// Every tensor the step allocates, in first-allocation order.
    pub tensors: Vec<TensorSpec>,
    /// Kernels, referenced by `EventKind::Kernel`.
    pub steps: Vec<Step>,
    /// The step in order: allocations, frees and kernel launches, by phase.
    pub events: Vec<Event>,
    /// Notes a person should see (e.g. "image scaled to 64 px for the CPU adapter").
    pub notes: Vec<String>,
}

impl Plan {
    /// Bytes per role at the step's peak.
    pub fn bytes_by_role(&self, role: Role) -> u64 {
        self.peak().by_role.get(role)
    }
    /// Bytes of every tensor the step ever allocates, summed (an upper bound of the peak).
    pub fn allocated_bytes(&self) -> u64 {
        self.tensors
            .iter()
            .map(|t| t.bytes)
            .fold(0u64, |a, b| a.saturating_add(b))
    }
}
