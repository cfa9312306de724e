// matmul: batched, strided C = alpha * A·B in 64x64 output tiles (16x16 threads, 4x4 each).
//
// For b < batch, i < m, j < n (all element indices relative to the bound buffers):
//   C[c_off + b*c_sb + i*c_sm + j] =
//       alpha * sum_{t<k} A[a_off + b*a_sb + i*a_sm + t*a_sk] * B[b_off + b*b_sb + t*b_sk + j*b_sn]
// Strides cover a shared B (b_sb = 0, a linear layer), a per-batch B, and a transposed B
// (QKᵀ: b_sk = 1, b_sn = head_dim). Accumulation in f32.
// Bindings: 1 = A, 2 = B, 3 = C (written). Grid: x = ceil(n/64), y = ceil(m/64), z = batch.

struct Params {
    m: u32,
    n: u32,
    k: u32,
    batch: u32,
    a_off: u32,
    a_sb: u32,
    a_sm: u32,
    a_sk: u32,
    b_off: u32,
    b_sb: u32,
    b_sk: u32,
    b_sn: u32,
    c_off: u32,
    c_sb: u32,
    c_sm: u32,
    alpha: f32,
}

@group(0) @binding(0) var<uniform> P: Params;
@group(0) @binding(1) var<storage, read_write> a: array<u32>;
@group(0) @binding(2) var<storage, read_write> b: array<u32>;
@group(0) @binding(3) var<storage, read_write> c: array<atomic<u32>>;

fn ld_a(i: u32) -> f32 {
    return unpack_elem(a[i / EPW], i);
}

fn ld_b(i: u32) -> f32 {
    return unpack_elem(b[i / EPW], i);
}

fn st_c(i: u32, v: f32) {
    if (EPW == 1u) {
        atomicStore(&c[i], elem_bits(v));
        return;
    }
    let w = i / EPW;
    atomicAnd(&c[w], elem_keep(i));
    atomicOr(&c[w], elem_bits(v) << elem_shift(i));
}

const TM: u32 = 64u;
const TN: u32 = 64u;
const TK: u32 = 16u;

var<workgroup> sa: array<f32, 1024>; // [TM rows][TK]
var<workgroup> sb: array<f32, 1024>; // [TK][TN cols]

@compute @workgroup_size(WG_X, WG_Y, WG_Z)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let row0 = wid.y * TM;
    let col0 = wid.x * TN;
    let bz = wid.z;
    let a_base = P.a_off + bz * P.a_sb;
    let b_base = P.b_off + bz * P.b_sb;
    let flat = lid.y * 16u + lid.x;
    var acc: array<f32, 16>;
    for (var r = 0u; r < 16u; r++) {
        acc[r] = 0.0;
    }
    for (var k0 = 0u; k0 < P.k; k0 += TK) {
        for (var r = 0u; r < 4u; r++) {
            let e = flat + r * 256u;
            // A tile: row e / TK, column e % TK.
            let ar = row0 + e / TK;
            let ak = k0 + e % TK;
            var va = 0.0;
            if (ar < P.m && ak < P.k) {
                va = ld_a(a_base + ar * P.a_sm + ak * P.a_sk);
            }
            sa[e] = va;
            // B tile: row e / TN, column e % TN.
            let bk = k0 + e / TN;
            let bc = col0 + e % TN;
            var vb = 0.0;
            if (bk < P.k && bc < P.n) {
                vb = ld_b(b_base + bk * P.b_sk + bc * P.b_sn);
            }
            sb[e] = vb;
        }
        workgroupBarrier();
        for (var t = 0u; t < TK; t++) {
            var av: array<f32, 4>;
            var bv: array<f32, 4>;
            for (var q = 0u; q < 4u; q++) {
                av[q] = sa[(lid.y + 16u * q) * TK + t];
                bv[q] = sb[t * TN + lid.x + 16u * q];
            }
            for (var i = 0u; i < 4u; i++) {
                for (var j = 0u; j < 4u; j++) {
                    acc[i * 4u + j] = fma(av[i], bv[j], acc[i * 4u + j]);
                }
            }
        }
        workgroupBarrier();
    }
    let c_base = P.c_off + bz * P.c_sb;
    for (var i = 0u; i < 4u; i++) {
        let row = row0 + lid.y + 16u * i;
        for (var j = 0u; j < 4u; j++) {
            let col = col0 + lid.x + 16u * j;
            if (row < P.m && col < P.n) {
                st_c(c_base + row * P.c_sm + col, P.alpha * acc[i * 4u + j]);
            }
        }
    }
}
