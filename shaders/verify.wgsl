// verify: count the words of one chunk and those that differ from pattern(first_word + i, seed).
// Params: WordParams. Binding 1 = data (read), binding 2 = result [words_seen, mismatches]
// (atomic u32, zeroed by the caller). Each workgroup reduces in shared memory first, then adds
// once per counter. Grid-stride over a 2D grid, as in fill.wgsl.

struct Params {
    first_word_lo: u32,
    first_word_hi: u32,
    len_words: u32,
    seed: u32,
}

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read> data: array<u32>;
@group(0) @binding(2) var<storage, read_write> result: array<atomic<u32>>;

var<workgroup> seen_sh: array<u32, 256>;
var<workgroup> bad_sh: array<u32, 256>;

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
    var seen = 0u;
    var bad = 0u;
    loop {
        if (i >= len) {
            break;
        }
        let lo = params.first_word_lo + i;
        let hi = params.first_word_hi + select(0u, 1u, lo < i);
        seen = seen + 1u;
        if (data[i] != pattern(lo, hi, params.seed)) {
            bad = bad + 1u;
        }
        if (stride > len - i) {
            break;
        }
        i = i + stride;
    }
    seen_sh[local] = seen;
    bad_sh[local] = bad;
    workgroupBarrier();
    for (var s = 128u; s > 0u; s = s >> 1u) {
        if (local < s) {
            seen_sh[local] = seen_sh[local] + seen_sh[local + s];
            bad_sh[local] = bad_sh[local] + bad_sh[local + s];
        }
        workgroupBarrier();
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
