// verify: count the words of one chunk and those that differ from pattern(first_word + i,
// seed). The CUDA twin of verify.wgsl. Params: WordParams. Buffers: data (read), result
// [words_seen, mismatches] (u32, zeroed by the caller). Each block reduces in shared memory
// first, then adds once per counter. Grid-stride as in fill.cu. Block: 256 threads.

struct Params {
    u32 first_word_lo;
    u32 first_word_hi;
    u32 len_words;
    u32 seed;
};

// The word kernels are written for 256-thread blocks (as the WGSL @workgroup_size(256)).
static_assert(WG_X == 256u && WG_Y == 1u && WG_Z == 1u, "word kernels need 256x1x1 blocks");

// fmix32 and pattern come from word_pattern.cu.

extern "C" __global__ void verify(const Params P, const u32* data, u32* result) {
    __shared__ u32 seen_sh[256];
    __shared__ u32 bad_sh[256];
    // Groups numbered x-major over the grid; every thread walks the chunk with a grid-sized
    // stride (u32 arithmetic wraps exactly as in WGSL).
    u32 local = threadIdx.x;
    u32 group = blockIdx.x + blockIdx.y * gridDim.x + blockIdx.z * gridDim.x * gridDim.y;
    u32 stride = gridDim.x * gridDim.y * gridDim.z * 256u;
    u32 i = group * 256u + local;
    u32 len = P.len_words;
    u32 seen = 0u;
    u32 bad = 0u;
    for (;;) {
        if (i >= len) {
            break;
        }
        u32 lo = P.first_word_lo + i;
        u32 hi = P.first_word_hi + (lo < i ? 1u : 0u);
        seen = seen + 1u;
        if (data[i] != pattern(lo, hi, P.seed)) {
            bad = bad + 1u;
        }
        if (stride > len - i) {
            break;
        }
        i = i + stride;
    }
    seen_sh[local] = seen;
    bad_sh[local] = bad;
    __syncthreads();
    for (u32 s = 128u; s > 0u; s = s >> 1u) {
        if (local < s) {
            seen_sh[local] = seen_sh[local] + seen_sh[local + s];
            bad_sh[local] = bad_sh[local] + bad_sh[local + s];
        }
        __syncthreads();
    }
    if (local == 0u) {
        if (seen_sh[0] != 0u) {
            atomicAdd(&result[0], seen_sh[0]);
        }
        if (bad_sh[0] != 0u) {
            atomicAdd(&result[1], bad_sh[0]);
        }
    }
}
