// common: included first in every CUDA kernel module (word and compute kernels).
// Before it, the host defines WG_X, WG_Y, WG_Z (the op's workgroup size = blockDim, from
// kernels::source::workgroup_size). Buffers are arrays of 32-bit words, as in WGSL
// (array<u32>); kernel parameters are `Params` (the op's struct from kernels::params, passed
// by value as the first argument) and then one word pointer per binding, in binding order.
// WGSL builtins: workgroup_id = blockIdx, num_workgroups = gridDim,
// local_invocation_id = threadIdx, workgroupBarrier() = __syncthreads().

typedef unsigned int u32;
typedef int i32;
typedef unsigned long long u64;

// The flat workgroup index of a 2D grid (wid.x + wid.y * num_workgroups.x).
__device__ __forceinline__ u32 flat_group() {
    return blockIdx.x + blockIdx.y * gridDim.x;
}
