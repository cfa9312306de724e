// Workgroup reductions of row kernels (softmax, attention, layer_norm), prepended by
// kernels::source. Every thread of the workgroup calls them with its value and local index.

var<workgroup> red: array<f32, WG_X>;

fn reduce_max(v: f32, t: u32) -> f32 {
    red[t] = v;
    workgroupBarrier();
    for (var s = WG_X / 2u; s > 0u; s = s / 2u) {
        if (t < s) {
            red[t] = max(red[t], red[t + s]);
        }
        workgroupBarrier();
    }
    let r = red[0];
    workgroupBarrier();
    return r;
}

fn reduce_sum(v: f32, t: u32) -> f32 {
    red[t] = v;
    workgroupBarrier();
    for (var s = WG_X / 2u; s > 0u; s = s / 2u) {
        if (t < s) {
            red[t] = red[t] + red[t + s];
        }
        workgroupBarrier();
    }
    let r = red[0];
    workgroupBarrier();
    return r;
}
