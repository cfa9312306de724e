//! Compute kernels over device tensors (matmul, softmax, attention, conv2d, ...) and `run_step` for plan steps.
//!
//! Every function here works across the chunks of big tensors: the work is cut into "units"
//! (elements, rows, heads, images, batches) and consecutive units whose data lies in one chunk
//! of every operand go to one dispatch, with element offsets relative to that chunk's buffer.
//! One unit's data must lie in a single chunk (`DeviceTensor` chunks hold whole rows of the
//! tensor's `row_elems`), otherwise the op returns a `BackendError` naming the tensor. Operands
//! read whole by every unit (a linear layer's weight, a conv's filters) must fit one chunk.
//!
//! Shapes are in elements, tensors dense row-major; see `kernels::params` for each kernel's
//! exact semantics and `kernels::reference` for the f64 references.
//!
//! One file per job: `chunks` (the splitter and the launch rules all ops share), one file per
//! op family (`matmul`, `rows`, `elementwise`, `attention`, `conv`), and `step`, which runs a
//! plan step's kernels.

mod attention;
mod chunks;
mod conv;
mod elementwise;
mod matmul;
mod rows;
mod step;

pub use attention::{attention_naive, flash_attention, AttentionDims};
pub use chunks::{
    dispatch_work, grid_1d, DISPATCH_WORK_ENV, MAX_DISPATCH_WORK, MAX_GROUPS_PER_DIM,
};
pub use conv::{conv2d, ConvDims};
pub use elementwise::{adam, gelu, relu};
pub use matmul::{matmul, MatmulDims};
pub use rows::{attention_probs, layer_norm, softmax, LAYER_NORM_EPS};
pub use step::{run_step, run_step_with};

/// Test doubles the ops' tests share: chunked tensors and a device that records launches.
#[cfg(test)]
mod testing {
    use crate::backend::{Backend, BackendError, BufferId};
    use crate::kernels::{KernelId, Op};
    use crate::plan::DType;
    use crate::tensor::{Chunk, DeviceTensor};

    /// A tensor of `elems` f32 cut into chunks of `chunk` elements (buffer ids 0, 1, ..).
    pub(super) fn chunked(elems: u64, chunk: u64, row: u64) -> DeviceTensor {
        let chunks = (0..elems.div_ceil(chunk))
            .map(|i| Chunk {
                buffer: BufferId(i),
                first_elem: i * chunk,
                elems: chunk.min(elems - i * chunk),
                bytes: 4 * chunk.min(elems - i * chunk),
            })
            .collect();
        DeviceTensor {
            name: "t".into(),
            dtype: DType::F32,
            elems,
            row_elems: row,
            chunks,
        }
    }

    /// A device that records each launch's kernel, params and grid, and runs nothing.
    pub(super) struct Launches {
        info: crate::backend::DeviceInfo,
        pub(super) seen: Vec<(Op, Vec<u8>, [u32; 3])>,
    }

    impl Launches {
        pub(super) fn new() -> Self {
            let info = crate::backend::mock::MockBackend::new(1 << 40)
                .info()
                .clone();
            Launches {
                info,
                seen: Vec::new(),
            }
        }
    }

    impl Backend for Launches {
        fn info(&self) -> &crate::backend::DeviceInfo {
            &self.info
        }
        fn memory(&self) -> crate::backend::MemoryInfo {
            Default::default()
        }
        fn alloc_buffer(&mut self, _: u64) -> Result<BufferId, crate::backend::AllocError> {
            Ok(BufferId(0))
        }
        fn free_buffer(&mut self, _: BufferId) {}
        fn write_buffer(&mut self, _: BufferId, _: u64, _: &[u8]) -> Result<(), BackendError> {
            Ok(())
        }
        fn read_buffer(&mut self, _: BufferId, _: u64, n: u64) -> Result<Vec<u8>, BackendError> {
            Ok(vec![0; n as usize])
        }
        fn dispatch(
            &mut self,
            kernel: KernelId,
            params: &[u8],
            _: &[BufferId],
            groups: [u32; 3],
        ) -> Result<(), BackendError> {
            self.seen.push((kernel.op, params.to_vec(), groups));
            Ok(())
        }
        fn synchronize(&mut self) -> Result<(), BackendError> {
            Ok(())
        }
        fn allocated_bytes(&self) -> u64 {
            0
        }
    }

    /// One chunk of `elems` f32 in rows of `row`.
    pub(super) fn whole(elems: u64, row: u64) -> DeviceTensor {
        chunked(elems, elems, row)
    }
}
