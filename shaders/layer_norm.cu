// layer_norm: per-row normalisation with unit gain and zero bias, one workgroup (block) per
// row. The CUDA twin of layer_norm.wgsl.
//
// For each row r < rows: mean = (1/cols) sum_j x_j, var = (1/cols) sum_j (x_j - mean)^2,
//   Y[y_off + r*cols + j] = (X[x_off + r*cols + j] - mean) / sqrt(var + eps)
// Buffers: X, Y (written; may alias X). Rows: blockIdx.x + blockIdx.y * gridDim.x.

struct Params {
    u32 rows;
    u32 cols;
    u32 x_off;
    u32 y_off;
    float eps;
    u32 _pad0;
    u32 _pad1;
    u32 _pad2;
};

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

extern "C" __global__ void layer_norm(const Params P, const u32* x, u32* y) {
    __shared__ float red[WG_X];
    u32 row = flat_group();
    if (row >= P.rows) {
        return;
    }
    u32 t = threadIdx.x;
    u32 xb = P.x_off + row * P.cols;
    u32 yb = P.y_off + row * P.cols;
    float n = (float)P.cols;
    float s = 0.0f;
    for (u32 j = t; j < P.cols; j += WG_X) {
        s += load_elem(x, xb + j);
    }
    float mean = reduce_sum(red, s, t) / n;
    float q = 0.0f;
    for (u32 j = t; j < P.cols; j += WG_X) {
        float d = load_elem(x, xb + j) - mean;
        q += d * d;
    }
    float var_ = reduce_sum(red, q, t) / n;
    float inv = rsqrtf(var_ + P.eps);
    for (u32 j = t; j < P.cols; j += WG_X) {
        store_elem(y, yb + j, (load_elem(x, xb + j) - mean) * inv);
    }
}
