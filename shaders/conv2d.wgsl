// conv2d: direct NCHW convolution (square kernel, stride, zero padding), one thread per output.
//
// h_out = (h + 2*pad - kernel) / stride + 1, w_out likewise (computed on the host).
// For img < n, co < c_out, oy < h_out, ox < w_out:
//   Y[y_off + ((img*c_out + co)*h_out + oy)*w_out + ox] =
//     sum_{ci, ky, kx} X[x_off + ((img*c_in + ci)*h + iy)*w + ix]
//                    * W[w_off + ((co*c_in + ci)*kernel + ky)*kernel + kx]
//   with iy = oy*stride + ky - pad, ix = ox*stride + kx - pad (terms outside the image are 0).
// Bindings: 1 = X, 2 = W, 3 = Y (written). Flat output index
// (wid.x + wid.y * num_workgroups.x) * WG_X + local index.

struct Params {
    n: u32,
    c_in: u32,
    h: u32,
    w: u32,
    c_out: u32,
    kernel: u32,
    stride: u32,
    pad: u32,
    h_out: u32,
    w_out: u32,
    x_off: u32,
    w_off: u32,
    y_off: u32,
    _pad0: u32,
    _pad1: u32,
    _pad2: u32,
}

@group(0) @binding(0) var<uniform> P: Params;
@group(0) @binding(1) var<storage, read_write> x: array<u32>;
@group(0) @binding(2) var<storage, read_write> wt: array<u32>;
@group(0) @binding(3) var<storage, read_write> y: array<atomic<u32>>;

fn ld_x(i: u32) -> f32 {
    return unpack_elem(x[i / EPW], i);
}

fn ld_w(i: u32) -> f32 {
    return unpack_elem(wt[i / EPW], i);
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

@compute @workgroup_size(WG_X, WG_Y, WG_Z)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_id) lid: vec3<u32>,
) {
    let e = (wid.x + wid.y * nwg.x) * WG_X + lid.x;
    let plane = P.h_out * P.w_out;
    let total = P.n * P.c_out * plane;
    if (e >= total) {
        return;
    }
    let ox = e % P.w_out;
    let oy = (e / P.w_out) % P.h_out;
    let co = (e / plane) % P.c_out;
    let img = e / (plane * P.c_out);
    let kk = P.kernel;
    var acc = 0.0;
    for (var ci = 0u; ci < P.c_in; ci++) {
        let xb = P.x_off + (img * P.c_in + ci) * P.h * P.w;
        let wb = P.w_off + (co * P.c_in + ci) * kk * kk;
        for (var ky = 0u; ky < kk; ky++) {
            // iy = oy*stride + ky - pad, in signed arithmetic.
            let iy = i32(oy * P.stride + ky) - i32(P.pad);
            if (iy < 0 || iy >= i32(P.h)) {
                continue;
            }
            for (var kx = 0u; kx < kk; kx++) {
                let ix = i32(ox * P.stride + kx) - i32(P.pad);
                if (ix < 0 || ix >= i32(P.w)) {
                    continue;
                }
                acc = fma(ld_x(xb + u32(iy) * P.w + u32(ix)), ld_w(wb + ky * kk + kx), acc);
            }
        }
    }
    st_y(P.y_off + e, acc);
}
