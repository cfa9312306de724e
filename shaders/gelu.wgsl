// gelu: elementwise GeLU, tanh form: Y = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
// (the tanh argument is clamped to [-15, 15], where tanh is +-1 in f32, so no overflow)
//
// For i < len: Y[y_off + i] = f(X[x_off + i]) (element indices relative to the bound buffers).
// Bindings: 1 = X, 2 = Y (written; may alias X). One thread per element; the flat index is
// (wid.x + wid.y * num_workgroups.x) * WG_X + local index.

struct Params {
    len: u32,
    x_off: u32,
    y_off: u32,
    _pad: u32,
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

fn f(v: f32) -> f32 {
    let u = clamp(0.7978845608028654 * (v + 0.044715 * v * v * v), -15.0, 15.0);
    return 0.5 * v * (1.0 + tanh(u));
}

@compute @workgroup_size(WG_X, WG_Y, WG_Z)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_id) lid: vec3<u32>,
) {
    let i = (wid.x + wid.y * nwg.x) * WG_X + lid.x;
    if (i < P.len) {
        st_y(P.y_off + i, f(ld_x(P.x_off + i)));
    }
}
