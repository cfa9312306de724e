// layer_norm: per-row normalisation with unit gain and zero bias, one workgroup per row.
//
// For each row r < rows: mean = (1/cols) sum_j x_j, var = (1/cols) sum_j (x_j - mean)^2,
//   Y[y_off + r*cols + j] = (X[x_off + r*cols + j] - mean) / sqrt(var + eps)
// Bindings: 1 = X, 2 = Y (written; may alias X). Grid: rows = wid.x + wid.y * num_workgroups.x.

struct Params {
    rows: u32,
    cols: u32,
    x_off: u32,
    y_off: u32,
    eps: f32,
    _pad0: u32,
    _pad1: u32,
    _pad2: u32,
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
    let n = f32(P.cols);
    var s = 0.0;
    for (var j = t; j < P.cols; j += WG_X) {
        s += ld_x(xb + j);
    }
    let mean = reduce_sum(s, t) / n;
    var q = 0.0;
    for (var j = t; j < P.cols; j += WG_X) {
        let d = ld_x(xb + j) - mean;
        q += d * d;
    }
    let var_ = reduce_sum(q, t) / n;
    let inv = inverseSqrt(var_ + P.eps);
    for (var j = t; j < P.cols; j += WG_X) {
        st_y(yb + j, (ld_x(xb + j) - mean) * inv);
    }
}
