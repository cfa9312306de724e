// adam: one Adam step over `len` elements, in place (the CUDA twin of adam.wgsl).
//
// For i < len, with g = G[g_off + i]:
//   m = beta1 * M[m_off + i] + (1 - beta1) * g
//   v = beta2 * V[v_off + i] + (1 - beta2) * g * g
//   P[p_off + i] -= lr * (m / bc1) / (sqrt(v / bc2) + eps)
//   M[m_off + i] = m; V[v_off + i] = v
// bc1 = 1 - beta1^t and bc2 = 1 - beta2^t (bias corrections for step t, computed on the host).
// Each tensor has its own format code (p_fmt, g_fmt, m_fmt, v_fmt: 0 f32, 1 f16, 2 bf16) so
// mixed precision (16-bit grads, f32 master weights and moments) runs in one kernel; the
// kernel's storage type (prelude) is not used.
// Buffers: P, G, M, V (P, M, V written). One thread per element; flat index
// (blockIdx.x + blockIdx.y * gridDim.x) * WG_X + threadIdx.x.

struct Params {
    u32 len;
    u32 p_off;
    u32 g_off;
    u32 m_off;
    u32 v_off;
    u32 p_fmt;
    u32 g_fmt;
    u32 m_fmt;
    u32 v_fmt;
    float lr;
    float beta1;
    float beta2;
    float eps;
    float bc1;
    float bc2;
    u32 _pad;
};

extern "C" __global__ void adam(const Params P, u32* p, const u32* g, u32* m, u32* v) {
    u32 i = flat_group() * WG_X + threadIdx.x;
    if (i >= P.len) {
        return;
    }
    float gi = fmt_load(g, P.g_off + i, P.g_fmt);
    float mi = P.beta1 * fmt_load(m, P.m_off + i, P.m_fmt) + (1.0f - P.beta1) * gi;
    float vi = P.beta2 * fmt_load(v, P.v_off + i, P.v_fmt) + (1.0f - P.beta2) * gi * gi;
    float pi = fmt_load(p, P.p_off + i, P.p_fmt) - P.lr * (mi / P.bc1) / (sqrtf(vi / P.bc2) + P.eps);
    fmt_store(m, P.m_off + i, mi, P.m_fmt);
    fmt_store(v, P.v_off + i, vi, P.v_fmt);
    fmt_store(p, P.p_off + i, pi, P.p_fmt);
}
