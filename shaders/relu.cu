// relu: elementwise ReLU: Y = max(X, 0) (the CUDA twin of relu.wgsl).
//
// For i < len: Y[y_off + i] = f(X[x_off + i]) (element indices relative to the bound buffers).
// Buffers: X, Y (written; may alias X). One thread per element; the flat index is
// (blockIdx.x + blockIdx.y * gridDim.x) * WG_X + threadIdx.x.

struct Params {
    u32 len;
    u32 x_off;
    u32 y_off;
    u32 _pad;
};

__device__ __forceinline__ float f(float v) {
    return fmaxf(v, 0.0f);
}

extern "C" __global__ void relu(const Params P, const u32* x, u32* y) {
    u32 i = flat_group() * WG_X + threadIdx.x;
    if (i < P.len) {
        store_elem(y, P.y_off + i, f(load_elem(x, P.x_off + i)));
    }
}
