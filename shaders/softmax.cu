// softmax: numerically stable row softmax, one workgroup (block) per row.
// The CUDA twin of softmax.wgsl.
//
// For each row r < rows (element indices relative to the bound buffers):
//   v_j = scale * X[x_off + r*cols + j]
//   Y[y_off + r*cols + j] = exp(v_j - max_j v) / sum_j exp(v_j - max_j v)
// With MASKED (the `attention` op, see attention.cu) and q_period > 0, row r is query
// q = (q_row0 + r) % q_period and only columns j <= q take part (causal mask); masked
// columns are written as 0. The plain `softmax` op ignores q_row0 / q_period.
// The host defines MASKED (false for softmax; attention.cu sets it true before this file).
// Buffers: X, Y (written; may alias X). Rows: blockIdx.x + blockIdx.y * gridDim.x.
// The entry point is named after the op (SOFTMAX_ENTRY: softmax or attention).

struct Params {
    u32 rows;
    u32 cols;
    u32 x_off;
    u32 y_off;
    float scale;
    u32 q_row0;
    u32 q_period;
    u32 _pad;
};

#ifndef SOFTMAX_ENTRY
#define SOFTMAX_ENTRY softmax
#endif

__device__ float reduce_max(float* red, float v, u32 t) {
    red[t] = v;
    __syncthreads();
    for (u32 s = WG_X / 2u; s > 0u; s = s / 2u) {
        if (t < s) {
            red[t] = fmaxf(red[t], red[t + s]);
        }
        __syncthreads();
    }
    float r = red[0];
    __syncthreads();
    return r;
}

__device__ float reduce_sum(float* red, float v, u32 t) {
    red[t] = v;
    __syncthreads();
    for (u32 s = WG_X / 2u; s > 0u; s = s / 2u) {
        if (t < s) {
            red[t] = red[t] + red[t + s];
        }
        __syncthreads();
    }
    float r = red[0];
    __syncthreads();
    return r;
}

extern "C" __global__ void SOFTMAX_ENTRY(const Params P, const u32* x, u32* y) {
    __shared__ float red[WG_X];
    u32 row = flat_group();
    if (row >= P.rows) {
        return;
    }
    u32 t = threadIdx.x;
    u32 xb = P.x_off + row * P.cols;
    u32 yb = P.y_off + row * P.cols;
    u32 limit = P.cols;
    if (MASKED && P.q_period > 0u) {
        limit = min(P.cols, (P.q_row0 + row) % P.q_period + 1u);
    }
    float mx = -3.0e38f;
    for (u32 j = t; j < limit; j += WG_X) {
        mx = fmaxf(mx, P.scale * load_elem(x, xb + j));
    }
    mx = reduce_max(red, mx, t);
    float s = 0.0f;
    for (u32 j = t; j < limit; j += WG_X) {
        s += expf(P.scale * load_elem(x, xb + j) - mx);
    }
    s = reduce_sum(red, s, t);
    float inv = 1.0f / s;
    for (u32 j = t; j < P.cols; j += WG_X) {
        float v = 0.0f;
        if (j < limit) {
            v = expf(P.scale * load_elem(x, xb + j) - mx) * inv;
        }
        store_elem(y, yb + j, v);
    }
}
