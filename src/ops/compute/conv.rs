//! Direct NCHW convolution, image by image.

use bytemuck::bytes_of;

use crate::backend::{Backend, BackendError};
use crate::kernels::params::Conv2dParams;
use crate::kernels::{KernelId, Op};
use crate::tensor::DeviceTensor;

use super::chunks::*;

/// An NCHW convolution: `x[n][c_in][h][w] * w[c_out][c_in][kernel][kernel] -> y`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConvDims {
    pub n: u64,
    pub c_in: u64,
    pub h: u64,
    pub w: u64,
    pub c_out: u64,
    pub kernel: u64,
    pub stride: u64,
    pub pad: u64,
}

impl ConvDims {
    /// Output height and width; None when the kernel does not fit or the stride is 0.
    pub fn out_hw(&self) -> Option<(u64, u64)> {
        if self.stride == 0 || self.kernel == 0 {
            return None;
        }
        let hp = (self.h + 2 * self.pad).checked_sub(self.kernel)?;
        let wp = (self.w + 2 * self.pad).checked_sub(self.kernel)?;
        Some((hp / self.stride + 1, wp / self.stride + 1))
    }
}

/// Direct convolution, image by image (one image of x and of y must each lie in one chunk;
/// the filters in one chunk).
pub fn conv2d(
    backend: &mut dyn Backend,
    x: &DeviceTensor,
    w: &DeviceTensor,
    y: &DeviceTensor,
    d: &ConvDims,
) -> Result<(), BackendError> {
    let storage = common_storage("conv2d", &[x, w, y])?;
    let kernel = KernelId::new(Op::Conv2d, storage);
    let (ho, wo) = d
        .out_hw()
        .ok_or_else(|| err(format!("conv2d: no output for {d:?}")))?;
    if d.n == 0 || d.c_out == 0 {
        return Ok(());
    }
    let x_img = d.c_in * d.h * d.w;
    let y_img = d.c_out * ho * wo;
    let w_all = d.c_out * d.c_in * d.kernel * d.kernel;
    let wg = kernel.workgroup_size()[0] as u64;
    let per_img = y_img * d.c_in * d.kernel * d.kernel;
    let max_imgs = (MAX_FLAT_UNITS / y_img.max(1))
        .max(1)
        .min(units_within(per_img));
    let ops = [
        opnd(x, 0, x_img, x_img),
        opnd(w, 0, 0, w_all),
        opnd(y, 0, y_img, y_img),
    ];
    for r in split(&ops, d.n, max_imgs)? {
        let p = Conv2dParams {
            n: r.units as u32,
            c_in: u32_of(d.c_in, "c_in")?,
            h: u32_of(d.h, "h")?,
            w: u32_of(d.w, "w")?,
            c_out: u32_of(d.c_out, "c_out")?,
            kernel: u32_of(d.kernel, "kernel")?,
            stride: u32_of(d.stride, "stride")?,
            pad: u32_of(d.pad, "pad")?,
            h_out: ho as u32,
            w_out: wo as u32,
            x_off: r.at[0].1,
            w_off: r.at[1].1,
            y_off: r.at[2].1,
            _pad: [0; 3],
        };
        let grid = grid_1d((r.units * y_img).div_ceil(wg))?;
        let bufs = [r.at[0].0, r.at[1].0, r.at[2].0];
        backend.dispatch(kernel, bytes_of(&p), &bufs, grid)?;
    }
    Ok(())
}
