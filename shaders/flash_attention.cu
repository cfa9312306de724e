// flash_attention: attention with an online softmax over K/V tiles held in shared memory;
// no seq x seq buffer exists. One thread per query row, WG_X rows per block.
// The CUDA twin of flash_attention.wgsl.
//
// For head h < heads, query i < seq (element indices relative to the bound buffers; head h of
// Q, O starts at <t>_off + h*seq*head_dim, of K, V at <t>_off + (h / kv_group)*seq*head_dim
// (grouped-query attention; kv_group 0 reads as 1), its stats at s_off + h*seq*2):
//   s_j  = scale * sum_d Q[i][d] * K[j][d]      for keys j < seq (j <= i when causal != 0)
//   mx   = max_j s_j,  sum = sum_j exp(s_j - mx)
//   O[i][d] = sum_j exp(s_j - mx) * V[j][d] / sum
//   S[i] = [mx, sum]   (two elements, format stats_fmt: 0 f32, 1 f16, 2 bf16)
// Q, K, V, O use the kernel's storage type. head_dim <= 256; keys per tile
// bc = min(64, 2048 / head_dim). Buffers: Q, K, V, O, S (O, S written).
// Grid: x = ceil(seq / WG_X) query blocks, y = heads.

struct Params {
    u32 heads;
    u32 seq;
    u32 head_dim;
    u32 causal;
    u32 q_off;
    u32 k_off;
    u32 v_off;
    u32 o_off;
    u32 s_off;
    u32 stats_fmt;
    float scale;
    u32 kv_group;
};

#define HD_MAX 256u
#define TILE 2048u
#define BC_MAX 64u

extern "C" __global__ void flash_attention(const Params P, const u32* q, const u32* k,
                                           const u32* v, u32* o, u32* st) {
    __shared__ float sk[TILE];
    __shared__ float sv[TILE];
    u32 hd = P.head_dim;
    u32 seq = P.seq;
    u32 head = blockIdx.y;
    u32 row0 = blockIdx.x * WG_X;
    u32 row = row0 + threadIdx.x;
    bool live = row < seq;
    u32 qb = P.q_off + head * seq * hd;
    u32 kvh = head / (P.kv_group > 1u ? P.kv_group : 1u);
    u32 kb = P.k_off + kvh * seq * hd;
    u32 vb = P.v_off + kvh * seq * hd;
    // Outside the documented range (head_dim in 1..=256) the per-thread arrays would overflow:
    // write nothing (the WGSL twin clamps array indices instead; the host never asks).
    if (hd == 0u || hd > HD_MAX) {
        return;
    }
    u32 bc = min(BC_MAX, TILE / hd);

    float qr[HD_MAX];
    float acc[HD_MAX];
    float sc[BC_MAX];
    for (u32 d = 0u; d < hd; d++) {
        acc[d] = 0.0f;
        qr[d] = 0.0f;
        if (live) {
            qr[d] = P.scale * load_elem(q, qb + row * hd + d);
        }
    }
    float mx = -3.0e38f;
    float sum = 0.0f;

    // Keys this block needs: all, or up to its last row when causal.
    u32 kv_end = seq;
    if (P.causal != 0u) {
        kv_end = min(seq, row0 + WG_X);
    }
    for (u32 j0 = 0u; j0 < kv_end; j0 += bc) {
        for (u32 e = threadIdx.x; e < bc * hd; e += WG_X) {
            u32 j = j0 + e / hd;
            float kv = 0.0f;
            float vv = 0.0f;
            if (j < seq) {
                kv = load_elem(k, kb + j * hd + e % hd);
                vv = load_elem(v, vb + j * hd + e % hd);
            }
            sk[e] = kv;
            sv[e] = vv;
        }
        __syncthreads();
        if (live) {
            u32 n = min(bc, seq - j0);
            if (P.causal != 0u) {
                n = min(n, row + 1u > j0 ? row + 1u - j0 : 0u);
            }
            float tmax = mx;
            for (u32 jj = 0u; jj < n; jj++) {
                float s = 0.0f;
                for (u32 d = 0u; d < hd; d++) {
                    s = fmaf(qr[d], sk[jj * hd + d], s);
                }
                sc[jj] = s;
                tmax = fmaxf(tmax, s);
            }
            if (n > 0u) {
                float corr = expf(mx - tmax);
                sum = sum * corr;
                for (u32 d = 0u; d < hd; d++) {
                    acc[d] = acc[d] * corr;
                }
                for (u32 jj = 0u; jj < n; jj++) {
                    float pj = expf(sc[jj] - tmax);
                    sum += pj;
                    for (u32 d = 0u; d < hd; d++) {
                        acc[d] = fmaf(pj, sv[jj * hd + d], acc[d]);
                    }
                }
                mx = tmax;
            }
        }
        __syncthreads();
    }
    if (live) {
        u32 ob = P.o_off + head * seq * hd + row * hd;
        float inv = 1.0f / sum;
        for (u32 d = 0u; d < hd; d++) {
            store_elem(o, ob + d, acc[d] * inv);
        }
        u32 sb = P.s_off + (head * seq + row) * 2u;
        fmt_store(st, sb, mx, P.stats_fmt);
        fmt_store(st, sb + 1u, sum, P.stats_fmt);
    }
}
