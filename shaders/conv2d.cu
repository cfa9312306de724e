// conv2d: direct NCHW convolution (square kernel, stride, zero padding), one thread per output.
// The CUDA twin of conv2d.wgsl.
//
// h_out = (h + 2*pad - kernel) / stride + 1, w_out likewise (computed on the host).
// For img < n, co < c_out, oy < h_out, ox < w_out:
//   Y[y_off + ((img*c_out + co)*h_out + oy)*w_out + ox] =
//     sum_{ci, ky, kx} X[x_off + ((img*c_in + ci)*h + iy)*w + ix]
//                    * W[w_off + ((co*c_in + ci)*kernel + ky)*kernel + kx]
//   with iy = oy*stride + ky - pad, ix = ox*stride + kx - pad (terms outside the image are 0).
// Buffers: X, W, Y (written). Flat output index
// (blockIdx.x + blockIdx.y * gridDim.x) * WG_X + threadIdx.x.

struct Params {
    u32 n;
    u32 c_in;
    u32 h;
    u32 w;
    u32 c_out;
    u32 kernel;
    u32 stride;
    u32 pad;
    u32 h_out;
    u32 w_out;
    u32 x_off;
    u32 w_off;
    u32 y_off;
    u32 _pad0;
    u32 _pad1;
    u32 _pad2;
};

extern "C" __global__ void conv2d(const Params P, const u32* x, const u32* wt, u32* y) {
    u32 e = flat_group() * WG_X + threadIdx.x;
    u32 plane = P.h_out * P.w_out;
    u32 total = P.n * P.c_out * plane;
    if (e >= total) {
        return;
    }
    u32 ox = e % P.w_out;
    u32 oy = (e / P.w_out) % P.h_out;
    u32 co = (e / plane) % P.c_out;
    u32 img = e / (plane * P.c_out);
    u32 kk = P.kernel;
    float acc = 0.0f;
    for (u32 ci = 0u; ci < P.c_in; ci++) {
        u32 xb = P.x_off + (img * P.c_in + ci) * P.h * P.w;
        u32 wb = P.w_off + (co * P.c_in + ci) * kk * kk;
        for (u32 ky = 0u; ky < kk; ky++) {
            // iy = oy*stride + ky - pad, in signed arithmetic.
            i32 iy = (i32)(oy * P.stride + ky) - (i32)P.pad;
            if (iy < 0 || iy >= (i32)P.h) {
                continue;
            }
            for (u32 kx = 0u; kx < kk; kx++) {
                i32 ix = (i32)(ox * P.stride + kx) - (i32)P.pad;
                if (ix < 0 || ix >= (i32)P.w) {
                    continue;
                }
                acc = fmaf(load_elem(x, xb + (u32)iy * P.w + (u32)ix),
                           load_elem(wt, wb + ky * kk + kx), acc);
            }
        }
    }
    store_elem(y, P.y_off + e, acc);
}
