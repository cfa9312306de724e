// matmul: batched, strided C = alpha * A·B in 64x64 output tiles (16x16 threads, 4x4 each).
// The CUDA twin of matmul.wgsl.
//
// For b < batch, i < m, j < n (all element indices relative to the bound buffers):
//   C[c_off + b*c_sb + i*c_sm + j] =
//       alpha * sum_{t<k} A[a_off + b*a_sb + i*a_sm + t*a_sk] * B[b_off + b*b_sb + t*b_sk + j*b_sn]
// Strides cover a shared B (b_sb = 0, a linear layer), a per-batch B, and a transposed B
// (QKᵀ: b_sk = 1, b_sn = head_dim). Accumulation in f32.
// Buffers: A, B, C (written). Grid: x = ceil(n/64), y = ceil(m/64), z = batch.

struct Params {
    u32 m;
    u32 n;
    u32 k;
    u32 batch;
    u32 a_off;
    u32 a_sb;
    u32 a_sm;
    u32 a_sk;
    u32 b_off;
    u32 b_sb;
    u32 b_sk;
    u32 b_sn;
    u32 c_off;
    u32 c_sb;
    u32 c_sm;
    float alpha;
};

#define TM 64u
#define TN 64u
#define TK 16u

extern "C" __global__ void matmul(const Params P, const u32* a, const u32* b, u32* c) {
    __shared__ float sa[1024]; // [TM rows][TK]
    __shared__ float sb[1024]; // [TK][TN cols]
    u32 row0 = blockIdx.y * TM;
    u32 col0 = blockIdx.x * TN;
    u32 bz = blockIdx.z;
    u32 a_base = P.a_off + bz * P.a_sb;
    u32 b_base = P.b_off + bz * P.b_sb;
    u32 lx = threadIdx.x;
    u32 ly = threadIdx.y;
    u32 flat = ly * 16u + lx;
    float acc[16];
    for (u32 r = 0u; r < 16u; r++) {
        acc[r] = 0.0f;
    }
    for (u32 k0 = 0u; k0 < P.k; k0 += TK) {
        for (u32 r = 0u; r < 4u; r++) {
            u32 e = flat + r * 256u;
            // A tile: row e / TK, column e % TK.
            u32 ar = row0 + e / TK;
            u32 ak = k0 + e % TK;
            float va = 0.0f;
            if (ar < P.m && ak < P.k) {
                va = load_elem(a, a_base + ar * P.a_sm + ak * P.a_sk);
            }
            sa[e] = va;
            // B tile: row e / TN, column e % TN.
            u32 bk = k0 + e / TN;
            u32 bc = col0 + e % TN;
            float vb = 0.0f;
            if (bk < P.k && bc < P.n) {
                vb = load_elem(b, b_base + bk * P.b_sk + bc * P.b_sn);
            }
            sb[e] = vb;
        }
        __syncthreads();
        for (u32 t = 0u; t < TK; t++) {
            float av[4];
            float bv[4];
            for (u32 q = 0u; q < 4u; q++) {
                av[q] = sa[(ly + 16u * q) * TK + t];
                bv[q] = sb[t * TN + lx + 16u * q];
            }
            for (u32 i = 0u; i < 4u; i++) {
                for (u32 j = 0u; j < 4u; j++) {
                    acc[i * 4u + j] = fmaf(av[i], bv[j], acc[i * 4u + j]);
                }
            }
        }
        __syncthreads();
    }
    u32 c_base = P.c_off + bz * P.c_sb;
    for (u32 i = 0u; i < 4u; i++) {
        u32 row = row0 + ly + 16u * i;
        for (u32 j = 0u; j < 4u; j++) {
            u32 col = col0 + lx + 16u * j;
            if (row < P.m && col < P.n) {
                store_elem(c, c_base + row * P.c_sm + col, P.alpha * acc[i * 4u + j]);
            }
        }
    }
}
