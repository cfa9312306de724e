// fill: word[i] = pattern(first_word + i, seed) for every 32-bit word of one chunk.
// Params: WordParams (kernels/params.rs). Binding 1 = data (read_write).
// Any dispatch shape works: groups are numbered x-major over a 2D grid and every thread
// walks the chunk with a grid-sized stride, so chunks beyond 65535 workgroups are covered.
// The pattern must match `ops::words::pattern` on the host bit for bit.

struct Params {
    first_word_lo: u32,
    first_word_hi: u32,
    len_words: u32,
    seed: u32,
}

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read_write> data: array<u32>;

// fmix32 and pattern come from word_pattern.wgsl.

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
    loop {
        if (i >= len) {
            break;
        }
        // 64-bit index = first_word + i, with carry into the high half.
        let lo = params.first_word_lo + i;
        let hi = params.first_word_hi + select(0u, 1u, lo < i);
        data[i] = pattern(lo, hi, params.seed);
        if (stride > len - i) {
            break;
        }
        i = i + stride;
    }
}
