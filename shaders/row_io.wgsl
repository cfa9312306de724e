// Row and elementwise kernels' I/O (softmax, attention, layer_norm, relu, gelu), prepended by
// kernels::source after the codec: X (binding 1, read as packed words) and Y (binding 2,
// written whole words or half words with atomics so 16-bit neighbours are never clobbered).

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
