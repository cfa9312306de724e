// gelu: elementwise GeLU, tanh form: Y = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
// (the tanh argument is clamped to [-15, 15], where tanh is +-1 in f32, so no overflow).
// The CUDA twin of gelu.wgsl.
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
    float u = fminf(fmaxf(0.7978845608028654f * (v + 0.044715f * v * v * v), -15.0f), 15.0f);
    return 0.5f * v * (1.0f + tanhf(u));
}

extern "C" __global__ void gelu(const Params P, const u32* x, u32* y) {
    u32 i = flat_group() * WG_X + threadIdx.x;
    if (i < P.len) {
        store_elem(y, P.y_off + i, f(load_elem(x, P.x_off + i)));
    }
}
