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
// Bindings 1 (x) and 2 (y), ld_x and st_y come from row_io.wgsl.

fn f(v: f32) -> f32 {
    let u = clamp(0.7978845608028654 * (v + 0.044715 * v * v * v), -15.0, 15.0);
    return 0.5 * v * (1.0 + tanh(u));
}

// The entry point comes from elementwise.wgsl.
