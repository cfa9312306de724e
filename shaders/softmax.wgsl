// softmax: numerically stable row softmax, one workgroup per row.
//
// For each row r < rows (element indices relative to the bound buffers):
//   v_j = scale * X[x_off + r*cols + j]
//   Y[y_off + r*cols + j] = exp(v_j - max_j v) / sum_j exp(v_j - max_j v)
// With MASKED (the `attention` op, see attention.wgsl) and q_period > 0, row r is query
// q = (q_row0 + r) % q_period and only columns j <= q take part (causal mask); masked
// columns are written as 0. The plain `softmax` op ignores q_row0 / q_period.
// Bindings: 1 = X, 2 = Y (written; may alias X). Grid: rows = wid.x + wid.y * num_workgroups.x.

struct Params {
    rows: u32,
    cols: u32,
    x_off: u32,
    y_off: u32,
    scale: f32,
    q_row0: u32,
    q_period: u32,
    _pad: u32,
}

@group(0) @binding(0) var<uniform> P: Params;
// Bindings 1 (x) and 2 (y), ld_x and st_y come from row_io.wgsl.

// reduce_sum and reduce_max come from row_reduce.wgsl.

@compute @workgroup_size(WG_X, WG_Y, WG_Z)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_id) lid: vec3<u32>,
) {
    let row = wid.x + wid.y * nwg.x;
    if (row >= P.rows) {
        return;
    }
    let t = lid.x;
    let xb = P.x_off + row * P.cols;
    let yb = P.y_off + row * P.cols;
    var limit = P.cols;
    if (MASKED && P.q_period > 0u) {
        limit = min(P.cols, (P.q_row0 + row) % P.q_period + 1u);
    }
    var mx = -3.0e38;
    for (var j = t; j < limit; j += WG_X) {
        mx = max(mx, P.scale * ld_x(xb + j));
    }
    mx = reduce_max(mx, t);
    var s = 0.0;
    for (var j = t; j < limit; j += WG_X) {
        s += exp(P.scale * ld_x(xb + j) - mx);
    }
    s = reduce_sum(s, t);
    let inv = 1.0 / s;
    for (var j = t; j < P.cols; j += WG_X) {
        var v = 0.0;
        if (j < limit) {
            v = exp(P.scale * ld_x(xb + j) - mx) * inv;
        }
        st_y(yb + j, v);
    }
}
