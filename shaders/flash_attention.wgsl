// flash_attention: attention with an online softmax over K/V tiles held in workgroup memory;
// no seq x seq buffer exists. One thread per query row, WG_X rows per workgroup.
//
// For head h < heads, query i < seq (element indices relative to the bound buffers; head h of
// Q, O starts at <t>_off + h*seq*head_dim, of K, V at <t>_off + (h / kv_group)*seq*head_dim
// (grouped-query attention; kv_group 0 reads as 1), its stats at s_off + h*seq*2):
//   s_j  = scale * sum_d Q[i][d] * K[j][d]      for keys j < seq (j <= i when causal != 0)
//   mx   = max_j s_j,  sum = sum_j exp(s_j - mx)
//   O[i][d] = sum_j exp(s_j - mx) * V[j][d] / sum
//   S[i] = [mx, sum]   (two elements, format stats_fmt: 0 f32, 1 f16, 2 bf16)
// Q, K, V, O use the kernel's storage type. head_dim <= 256; keys per tile
// bc = min(64, 2048 / head_dim). Bindings: 1 = Q, 2 = K, 3 = V, 4 = O, 5 = S (O, S written).
// Grid: x = ceil(seq / WG_X) query blocks, y = heads.

struct Params {
    heads: u32,
    seq: u32,
    head_dim: u32,
    causal: u32,
    q_off: u32,
    k_off: u32,
    v_off: u32,
    o_off: u32,
    s_off: u32,
    stats_fmt: u32,
    scale: f32,
    kv_group: u32,
}

@group(0) @binding(0) var<uniform> P: Params;
@group(0) @binding(1) var<storage, read_write> q: array<u32>;
@group(0) @binding(2) var<storage, read_write> k: array<u32>;
@group(0) @binding(3) var<storage, read_write> v: array<u32>;
@group(0) @binding(4) var<storage, read_write> o: array<atomic<u32>>;
@group(0) @binding(5) var<storage, read_write> st: array<atomic<u32>>;

fn ld_q(i: u32) -> f32 {
    return unpack_elem(q[i / EPW], i);
}

fn ld_k(i: u32) -> f32 {
    return unpack_elem(k[i / EPW], i);
}

fn ld_v(i: u32) -> f32 {
    return unpack_elem(v[i / EPW], i);
}

fn st_o(i: u32, x: f32) {
    if (EPW == 1u) {
        atomicStore(&o[i], elem_bits(x));
        return;
    }
    let w = i / EPW;
    atomicAnd(&o[w], elem_keep(i));
    atomicOr(&o[w], elem_bits(x) << elem_shift(i));
}

fn st_s(i: u32, x: f32) {
    let f = P.stats_fmt;
    let w = i / fmt_epw(f);
    if (f == FMT_F32) {
        atomicStore(&st[w], fmt_bits(x, f));
        return;
    }
    atomicAnd(&st[w], fmt_keep(i, f));
    atomicOr(&st[w], fmt_bits(x, f) << fmt_shift(i, f));
}

const HD_MAX: u32 = 256u;
const TILE: u32 = 2048u;
const BC_MAX: u32 = 64u;

var<workgroup> sk: array<f32, TILE>;
var<workgroup> sv: array<f32, TILE>;

@compute @workgroup_size(WG_X, WG_Y, WG_Z)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let hd = P.head_dim;
    let seq = P.seq;
    let head = wid.y;
    let row0 = wid.x * WG_X;
    let row = row0 + lid.x;
    let live = row < seq;
    let qb = P.q_off + head * seq * hd;
    let kvh = head / max(P.kv_group, 1u);
    let kb = P.k_off + kvh * seq * hd;
    let vb = P.v_off + kvh * seq * hd;
    let bc = min(BC_MAX, TILE / hd);

    var qr: array<f32, HD_MAX>;
    var acc: array<f32, HD_MAX>;
    var sc: array<f32, BC_MAX>;
    for (var d = 0u; d < hd; d++) {
        acc[d] = 0.0;
        qr[d] = 0.0;
        if (live) {
            qr[d] = P.scale * ld_q(qb + row * hd + d);
        }
    }
    var mx = -3.0e38;
    var sum = 0.0;

    // Keys this workgroup needs: all, or up to its last row when causal.
    var kv_end = seq;
    if (P.causal != 0u) {
        kv_end = min(seq, row0 + WG_X);
    }
    for (var j0 = 0u; j0 < kv_end; j0 += bc) {
        for (var e = lid.x; e < bc * hd; e += WG_X) {
            let j = j0 + e / hd;
            var kv = 0.0;
            var vv = 0.0;
            if (j < seq) {
                kv = ld_k(kb + j * hd + e % hd);
                vv = ld_v(vb + j * hd + e % hd);
            }
            sk[e] = kv;
            sv[e] = vv;
        }
        workgroupBarrier();
        if (live) {
            var n = min(bc, seq - j0);
            if (P.causal != 0u) {
                n = min(n, select(0u, row + 1u - j0, row + 1u > j0));
            }
            var tmax = mx;
            for (var jj = 0u; jj < n; jj++) {
                var s = 0.0;
                for (var d = 0u; d < hd; d++) {
                    s = fma(qr[d], sk[jj * hd + d], s);
                }
                sc[jj] = s;
                tmax = max(tmax, s);
            }
            if (n > 0u) {
                let corr = exp(mx - tmax);
                sum = sum * corr;
                for (var d = 0u; d < hd; d++) {
                    acc[d] = acc[d] * corr;
                }
                for (var jj = 0u; jj < n; jj++) {
                    let pj = exp(sc[jj] - tmax);
                    sum += pj;
                    for (var d = 0u; d < hd; d++) {
                        acc[d] = fma(pj, sv[jj * hd + d], acc[d]);
                    }
                }
                mx = tmax;
            }
        }
        workgroupBarrier();
    }
    if (live) {
        let ob = P.o_off + head * seq * hd + row * hd;
        let inv = 1.0 / sum;
        for (var d = 0u; d < hd; d++) {
            st_o(ob + d, acc[d] * inv);
        }
        let sb = P.s_off + (head * seq + row) * 2u;
        st_s(sb, mx);
        st_s(sb + 1u, sum);
    }
}
