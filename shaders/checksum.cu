// checksum: the wrapping 64-bit sum of the 32-bit words of one chunk, and the word count.
// The CUDA twin of checksum.wgsl. Params: WordParams (only len_words is used). Buffers: data
// (read), result [sum_lo, sum_hi, words_seen, unused] (u32, zeroed by the caller; sum_hi
// wraps, so the result is the sum mod 2^64). Per-thread (lo, hi) pairs with carries, a
// shared-memory tree reduction per block, then one set of atomics per block: the carry out
// of the low word is detected from atomicAdd's old value. Grid-stride as in fill.cu.

struct Params {
    u32 first_word_lo;
    u32 first_word_hi;
    u32 len_words;
    u32 seed;
};

// The word kernels are written for 256-thread blocks (as the WGSL @workgroup_size(256)).
static_assert(WG_X == 256u && WG_Y == 1u && WG_Z == 1u, "word kernels need 256x1x1 blocks");

extern "C" __global__ void checksum(const Params P, const u32* data, u32* result) {
    __shared__ u32 lo_sh[256];
    __shared__ u32 hi_sh[256];
    __shared__ u32 n_sh[256];
    // Groups numbered x-major over the grid; every thread walks the chunk with a grid-sized
    // stride (u32 arithmetic wraps exactly as in WGSL).
    u32 local = threadIdx.x;
    u32 group = blockIdx.x + blockIdx.y * gridDim.x + blockIdx.z * gridDim.x * gridDim.y;
    u32 stride = gridDim.x * gridDim.y * gridDim.z * 256u;
    u32 i = group * 256u + local;
    u32 len = P.len_words;
    u32 lo = 0u;
    u32 hi = 0u;
    u32 n = 0u;
    for (;;) {
        if (i >= len) {
            break;
        }
        u32 s = lo + data[i];
        hi = hi + (s < lo ? 1u : 0u);
        lo = s;
        n = n + 1u;
        if (stride > len - i) {
            break;
        }
        i = i + stride;
    }
    lo_sh[local] = lo;
    hi_sh[local] = hi;
    n_sh[local] = n;
    __syncthreads();
    for (u32 s = 128u; s > 0u; s = s >> 1u) {
        if (local < s) {
            u32 a = lo_sh[local];
            u32 b = lo_sh[local + s];
            u32 sum = a + b;
            lo_sh[local] = sum;
            hi_sh[local] = hi_sh[local] + hi_sh[local + s] + (sum < a ? 1u : 0u);
            n_sh[local] = n_sh[local] + n_sh[local + s];
        }
        __syncthreads();
    }
    if (local == 0u && n_sh[0] != 0u) {
        u32 add = lo_sh[0];
        u32 old = atomicAdd(&result[0], add);
        u32 carry = (old + add < old) ? 1u : 0u;
        atomicAdd(&result[1], hi_sh[0] + carry);
        atomicAdd(&result[2], n_sh[0]);
    }
}
