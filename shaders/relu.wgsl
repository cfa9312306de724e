// relu: elementwise ReLU: Y = max(X, 0)
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
    return max(v, 0.0);
}

// The entry point comes from elementwise.wgsl.
