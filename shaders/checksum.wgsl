// checksum: the wrapping 64-bit sum of the 32-bit words of one chunk, and the word count.
// Params: WordParams (only len_words is used). Binding 1 = data (read), binding 2 = result
// [sum_lo, sum_hi, words_seen, unused] (atomic u32, zeroed by the caller; sum_hi wraps, so the
// result is the sum mod 2^64). Per-thread (lo, hi) pairs with carries, a shared-memory tree
// reduction per workgroup, then one set of atomics per workgroup: the carry out of the low
// word is detected from atomicAdd's old value. Grid-stride over a 2D grid, as in fill.wgsl.

struct Params {
    first_word_lo: u32,
    first_word_hi: u32,
    len_words: u32,
    seed: u32,
}

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read> data: array<u32>;
@group(0) @binding(2) var<storage, read_write> result: array<atomic<u32>>;

var<workgroup> lo_sh: array<u32, 256>;
var<workgroup> hi_sh: array<u32, 256>;
var<workgroup> n_sh: array<u32, 256>;

@compute @workgroup_size(256)
fn main(
    @builtin(workgroup_id) wg: vec3<u32>,
    @builtin(local_invocation_index) local: u32,
    @builtin(num_workgroups) groups: vec3<u32>,
) {
    let group = wg.x + wg.y * groups.x + wg.z * groups.x * groups.y;
    let stride = groups.x * groups.y * groups.z * 256u;
    var i = group * 256u + local;
    let len = params.len_words;
    var lo = 0u;
    var hi = 0u;
    var n = 0u;
    loop {
        if (i >= len) {
            break;
        }
        let s = lo + data[i];
        hi = hi + select(0u, 1u, s < lo);
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
    workgroupBarrier();
    for (var s = 128u; s > 0u; s = s >> 1u) {
        if (local < s) {
            let a = lo_sh[local];
            let b = lo_sh[local + s];
            let sum = a + b;
            lo_sh[local] = sum;
            hi_sh[local] = hi_sh[local] + hi_sh[local + s] + select(0u, 1u, sum < a);
            n_sh[local] = n_sh[local] + n_sh[local + s];
        }
        workgroupBarrier();
    }
    if (local == 0u && n_sh[0] != 0u) {
        let add = lo_sh[0];
        let old = atomicAdd(&result[0], add);
        let carry = select(0u, 1u, old + add < old);
        atomicAdd(&result[1], hi_sh[0] + carry);
        atomicAdd(&result[2], n_sh[0]);
    }
}
