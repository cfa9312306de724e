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
@group(0) @binding(1) var<storage, read_write> x: array<u32>;
@group(0) @binding(2) var<storage, read_write> y: array<atomic<u32>>;

fn ld_x(i: u32) -> f32 {
    return unpack_elem(x[i / EPW], i);
}

fn st_y(i: u32, v: f32) {
    if (EPW == 1u) {
        atomicStore(&y[i], elem_bits(v));
        return;
    }
    let w = i / EPW;
    atomicAnd(&y[w], elem_keep(i));
    atomicOr(&y[w], elem_bits(v) << elem_shift(i));
}

var<workgroup> red: array<f32, WG_X>;

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
