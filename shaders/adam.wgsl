// adam: one Adam step over `len` elements, in place.
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
// Bindings: 1 = P, 2 = G, 3 = M, 4 = V (P, M, V written). One thread per element; flat index
// (wid.x + wid.y * num_workgroups.x) * WG_X + local index.

struct Params {
    len: u32,
    p_off: u32,
    g_off: u32,
    m_off: u32,
    v_off: u32,
    p_fmt: u32,
    g_fmt: u32,
    m_fmt: u32,
    v_fmt: u32,
    lr: f32,
    beta1: f32,
    beta2: f32,
    eps: f32,
    bc1: f32,
    bc2: f32,
    _pad: u32,
}

@group(0) @binding(0) var<uniform> P: Params;
@group(0) @binding(1) var<storage, read_write> p: array<atomic<u32>>;
@group(0) @binding(2) var<storage, read_write> g: array<u32>;
@group(0) @binding(3) var<storage, read_write> m: array<atomic<u32>>;
@group(0) @binding(4) var<storage, read_write> v: array<atomic<u32>>;

fn ld_g(i: u32) -> f32 {
    return fmt_unpack(g[i / fmt_epw(P.g_fmt)], i, P.g_fmt);
}

fn ld_p(i: u32) -> f32 {
    return fmt_unpack(atomicLoad(&p[i / fmt_epw(P.p_fmt)]), i, P.p_fmt);
}

fn ld_m(i: u32) -> f32 {
    return fmt_unpack(atomicLoad(&m[i / fmt_epw(P.m_fmt)]), i, P.m_fmt);
}

fn ld_v(i: u32) -> f32 {
    return fmt_unpack(atomicLoad(&v[i / fmt_epw(P.v_fmt)]), i, P.v_fmt);
}

fn st_p(i: u32, x: f32) {
    let f = P.p_fmt;
    let w = i / fmt_epw(f);
    if (f == FMT_F32) {
        atomicStore(&p[w], fmt_bits(x, f));
        return;
    }
    atomicAnd(&p[w], fmt_keep(i, f));
    atomicOr(&p[w], fmt_bits(x, f) << fmt_shift(i, f));
}

fn st_m(i: u32, x: f32) {
    let f = P.m_fmt;
    let w = i / fmt_epw(f);
    if (f == FMT_F32) {
        atomicStore(&m[w], fmt_bits(x, f));
        return;
    }
    atomicAnd(&m[w], fmt_keep(i, f));
    atomicOr(&m[w], fmt_bits(x, f) << fmt_shift(i, f));
}

fn st_v(i: u32, x: f32) {
    let f = P.v_fmt;
    let w = i / fmt_epw(f);
    if (f == FMT_F32) {
        atomicStore(&v[w], fmt_bits(x, f));
        return;
    }
    atomicAnd(&v[w], fmt_keep(i, f));
    atomicOr(&v[w], fmt_bits(x, f) << fmt_shift(i, f));
}

@compute @workgroup_size(WG_X, WG_Y, WG_Z)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_id) lid: vec3<u32>,
) {
    let i = (wid.x + wid.y * nwg.x) * WG_X + lid.x;
    if (i >= P.len) {
        return;
    }
    let gi = ld_g(P.g_off + i);
    let mi = P.beta1 * ld_m(P.m_off + i) + (1.0 - P.beta1) * gi;
    let vi = P.beta2 * ld_v(P.v_off + i) + (1.0 - P.beta2) * gi * gi;
    let pi = ld_p(P.p_off + i) - P.lr * (mi / P.bc1) / (sqrt(vi / P.bc2) + P.eps);
    st_m(P.m_off + i, mi);
    st_v(P.v_off + i, vi);
    st_p(P.p_off + i, pi);
}
