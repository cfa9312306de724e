//! f64 CPU references of every compute kernel (the semantics the WGSL and CUDA kernels must
//! match), plus the host side of the 16-bit element codecs. Used by tests and benches.
//!
//! All tensors are dense row-major `f64` slices; shapes follow `kernels::params`.

/// Strides of a batched matmul, in elements (see `params::MatmulParams`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MatmulShape {
    pub batch: usize,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub a_sb: usize,
    pub a_sm: usize,
    pub a_sk: usize,
    pub b_sb: usize,
    pub b_sk: usize,
    pub b_sn: usize,
    pub alpha: f64,
}

impl MatmulShape {
    /// Dense `A[batch][m][k]`; `B[k][n]` shared by every batch (`b_per_batch = false`) or
    /// `B[batch][k][n]`; with `b_transposed`, B is stored as `[(batch)][n][k]` (QKᵀ).
    pub fn dense(
        batch: usize,
        m: usize,
        n: usize,
        k: usize,
        b_per_batch: bool,
        b_transposed: bool,
    ) -> Self {
        let (b_sk, b_sn) = if b_transposed { (1, k) } else { (n, 1) };
        MatmulShape {
            batch,
            m,
            n,
            k,
            a_sb: m * k,
            a_sm: k,
            a_sk: 1,
            b_sb: if b_per_batch { k * n } else { 0 },
            b_sk,
            b_sn,
            alpha: 1.0,
        }
    }
}

/// `C[b][i][j] = alpha * Σ_t A[b*a_sb + i*a_sm + t*a_sk] * B[b*b_sb + t*b_sk + j*b_sn]`,
/// C dense `[batch][m][n]`.
pub fn matmul(a: &[f64], b: &[f64], s: &MatmulShape) -> Vec<f64> {
    let mut c = vec![0.0; s.batch * s.m * s.n];
    for bz in 0..s.batch {
        for i in 0..s.m {
            for j in 0..s.n {
                let mut acc = 0.0;
                for t in 0..s.k {
                    acc += a[bz * s.a_sb + i * s.a_sm + t * s.a_sk]
                        * b[bz * s.b_sb + t * s.b_sk + j * s.b_sn];
                }
                c[(bz * s.m + i) * s.n + j] = s.alpha * acc;
            }
        }
    }
    c
}

/// Row softmax of `scale * x` over `[rows][cols]`. With `causal = Some((q_row0, period))`,
/// row r is query `(q_row0 + r) % period` and columns past it are masked (output 0).
pub fn softmax(
    x: &[f64],
    rows: usize,
    cols: usize,
    scale: f64,
    causal: Option<(usize, usize)>,
) -> Vec<f64> {
    let mut y = vec![0.0; rows * cols];
    for r in 0..rows {
        let limit = match causal {
            Some((q0, period)) if period > 0 => cols.min((q0 + r) % period + 1),
            _ => cols,
        };
        let row = &x[r * cols..r * cols + limit];
        let mx = row
            .iter()
            .map(|v| v * scale)
            .fold(f64::NEG_INFINITY, f64::max);
        let sum: f64 = row.iter().map(|v| (v * scale - mx).exp()).sum();
        for (j, v) in row.iter().enumerate() {
            y[r * cols + j] = (v * scale - mx).exp() / sum;
        }
    }
    y
}

/// Naive attention over `bh` heads of `[seq][d]`: returns (scores, probs, out) where
/// `scores = qkᵀ/√d` (unmasked), `probs = softmax(scores)` with the causal mask, `out = probs·v`.
pub fn attention(
    q: &[f64],
    k: &[f64],
    v: &[f64],
    bh: usize,
    seq: usize,
    d: usize,
    causal: bool,
) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let mut qk = MatmulShape::dense(bh, seq, seq, d, true, true);
    qk.alpha = 1.0 / (d as f64).sqrt();
    let scores = matmul(q, k, &qk);
    let probs = softmax(&scores, bh * seq, seq, 1.0, causal.then_some((0, seq)));
    let out = matmul(&probs, v, &MatmulShape::dense(bh, seq, d, seq, true, false));
    (scores, probs, out)
}

/// What flash attention computes: `out` as `attention`, and per row `[max, sum]` of the scaled
/// (and masked) scores, `sum = Σ exp(s - max)`. Returns (out, stats `[bh][seq][2]`).
pub fn flash_attention(
    q: &[f64],
    k: &[f64],
    v: &[f64],
    bh: usize,
    seq: usize,
    d: usize,
    causal: bool,
) -> (Vec<f64>, Vec<f64>) {
    let (scores, _, out) = attention(q, k, v, bh, seq, d, causal);
    let mut stats = vec![0.0; bh * seq * 2];
    for r in 0..bh * seq {
        let limit = if causal { r % seq + 1 } else { seq };
        let row = &scores[r * seq..r * seq + limit];
        let mx = row.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        stats[2 * r] = mx;
        stats[2 * r + 1] = row.iter().map(|s| (s - mx).exp()).sum();
    }
    (out, stats)
}

/// Shape of an NCHW convolution with a square kernel (see `params::Conv2dParams`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConvShape {
    pub n: usize,
    pub c_in: usize,
    pub h: usize,
    pub w: usize,
    pub c_out: usize,
    pub kernel: usize,
    pub stride: usize,
    pub pad: usize,
}

impl ConvShape {
    /// Output height and width; None when the kernel does not fit the padded input or the
    /// stride is 0.
    pub fn out_hw(&self) -> Option<(usize, usize)> {
        let u = |v: usize| v as u64;
        let (ho, wo) = super::params::conv_out_hw(
            u(self.h),
            u(self.w),
            u(self.kernel),
            u(self.stride),
            u(self.pad),
        )?;
        Some((ho as usize, wo as usize))
    }
}

/// `y[n][c_out][h_out][w_out]` of x `[n][c_in][h][w]` and weights `[c_out][c_in][k][k]`, zero
/// padding. Empty when the shape has no output.
pub fn conv2d(x: &[f64], wt: &[f64], s: &ConvShape) -> Vec<f64> {
    let Some((ho, wo)) = s.out_hw() else {
        return Vec::new();
    };
    let k = s.kernel;
    let mut y = vec![0.0; s.n * s.c_out * ho * wo];
    for img in 0..s.n {
        for co in 0..s.c_out {
            for oy in 0..ho {
                for ox in 0..wo {
                    let mut acc = 0.0;
                    for ci in 0..s.c_in {
                        for ky in 0..k {
                            let iy = (oy * s.stride + ky) as isize - s.pad as isize;
                            if iy < 0 || iy >= s.h as isize {
                                continue;
                            }
                            for kx in 0..k {
                                let ix = (ox * s.stride + kx) as isize - s.pad as isize;
                                if ix < 0 || ix >= s.w as isize {
                                    continue;
                                }
                                let xi =
                                    ((img * s.c_in + ci) * s.h + iy as usize) * s.w + ix as usize;
                                let wi = ((co * s.c_in + ci) * k + ky) * k + kx;
                                acc += x[xi] * wt[wi];
                            }
                        }
                    }
                    y[((img * s.c_out + co) * ho + oy) * wo + ox] = acc;
                }
            }
        }
    }
    y
}

pub fn relu(x: &[f64]) -> Vec<f64> {
    x.iter().map(|v| v.max(0.0)).collect()
}

/// GeLU, tanh form: `0.5 x (1 + tanh(√(2/π) (x + 0.044715 x³)))`.
pub fn gelu(x: &[f64]) -> Vec<f64> {
    let c = (2.0 / std::f64::consts::PI).sqrt();
    x.iter()
        .map(|&v| 0.5 * v * (1.0 + (c * (v + 0.044715 * v * v * v)).tanh()))
        .collect()
}

/// Layer norm over rows (unit gain, zero bias, population variance).
pub fn layer_norm(x: &[f64], rows: usize, cols: usize, eps: f64) -> Vec<f64> {
    let mut y = vec![0.0; rows * cols];
    for r in 0..rows {
        let row = &x[r * cols..(r + 1) * cols];
        let mean = row.iter().sum::<f64>() / cols as f64;
        let var = row.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / cols as f64;
        let inv = 1.0 / (var + eps).sqrt();
        for (j, v) in row.iter().enumerate() {
            y[r * cols + j] = (v - mean) * inv;
        }
    }
    y
}

/// Adam hyper-parameters; `t` is the (1-based) step number used for bias correction.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamConfig {
    pub lr: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub t: u32,
}

impl Default for AdamConfig {
    fn default() -> Self {
        AdamConfig {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            t: 1,
        }
    }
}

impl AdamConfig {
    /// Bias corrections `(1 - beta1^t, 1 - beta2^t)`.
    pub fn bias_corrections(&self) -> (f64, f64) {
        let t = self.t.max(1) as i32;
        (1.0 - self.beta1.powi(t), 1.0 - self.beta2.powi(t))
    }
}

/// One Adam step in place over p, m, v with gradients g.
pub fn adam(p: &mut [f64], g: &[f64], m: &mut [f64], v: &mut [f64], cfg: &AdamConfig) {
    let (bc1, bc2) = cfg.bias_corrections();
    for i in 0..p.len() {
        m[i] = cfg.beta1 * m[i] + (1.0 - cfg.beta1) * g[i];
        v[i] = cfg.beta2 * v[i] + (1.0 - cfg.beta2) * g[i] * g[i];
        p[i] -= cfg.lr * (m[i] / bc1) / ((v[i] / bc2).sqrt() + cfg.eps);
    }
}

/// f32 to IEEE half bits, round to nearest even (overflow to infinity, NaN kept).
pub fn f16_bits(x: f32) -> u16 {
    let b = x.to_bits();
    let sign = ((b >> 16) & 0x8000) as u16;
    let exp = ((b >> 23) & 0xff) as i32;
    let man = b & 0x7f_ffff;
    if exp == 0xff {
        return sign | 0x7c00 | if man != 0 { 0x200 } else { 0 };
    }
    let e = exp - 127 + 15;
    if e >= 0x1f {
        return sign | 0x7c00;
    }
    if e <= 0 {
        if e < -10 {
            return sign;
        }
        let m = man | 0x80_0000;
        let shift = (14 - e) as u32;
        let half = 1u32 << (shift - 1);
        let rem = m & ((1u32 << shift) - 1);
        let mut s = m >> shift;
        if rem > half || (rem == half && s & 1 == 1) {
            s += 1;
        }
        return sign | s as u16;
    }
    let mut h = ((e as u32) << 10) | (man >> 13);
    let rem = man & 0x1fff;
    if rem > 0x1000 || (rem == 0x1000 && h & 1 == 1) {
        h += 1;
    }
    sign | h as u16
}

/// IEEE half bits to f32 (exact).
pub fn f16_value(h: u16) -> f32 {
    let sign = ((h as u32) & 0x8000) << 16;
    let exp = ((h >> 10) & 0x1f) as u32;
    let man = (h & 0x3ff) as u32;
    let bits = if exp == 0 {
        if man == 0 {
            sign
        } else {
            // Subnormal: man * 2^-24.
            let v = man as f32 * (1.0 / 16_777_216.0);
            return if sign != 0 { -v } else { v };
        }
    } else if exp == 0x1f {
        sign | 0x7f80_0000 | (man << 13)
    } else {
        sign | ((exp + 112) << 23) | (man << 13)
    };
    f32::from_bits(bits)
}

/// f32 to bf16 bits, round to nearest even (NaN to a quiet NaN).
pub fn bf16_bits(x: f32) -> u16 {
    let b = x.to_bits();
    if (b & 0x7fff_ffff) > 0x7f80_0000 {
        return 0x7fc0;
    }
    ((b + 0x7fff + ((b >> 16) & 1)) >> 16) as u16
}

/// bf16 bits to f32 (exact).
pub fn bf16_value(h: u16) -> f32 {
    f32::from_bits((h as u32) << 16)
}

/// Encode values as a storage type's bytes (little-endian; 16-bit types two per word).
pub fn encode(values: &[f64], storage: super::Storage) -> Vec<u8> {
    use super::Storage;
    let mut out = Vec::with_capacity(values.len() * storage.bytes() as usize);
    for &v in values {
        match storage {
            Storage::F32 => out.extend_from_slice(&(v as f32).to_le_bytes()),
            Storage::F16 => out.extend_from_slice(&f16_bits(v as f32).to_le_bytes()),
            Storage::Bf16 => out.extend_from_slice(&bf16_bits(v as f32).to_le_bytes()),
        }
    }
    out
}

/// Decode a storage type's bytes to values (a trailing partial element is ignored).
pub fn decode(bytes: &[u8], storage: super::Storage) -> Vec<f64> {
    use super::Storage;
    match storage {
        Storage::F32 => bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]) as f64)
            .collect(),
        Storage::F16 => bytes
            .chunks_exact(2)
            .map(|c| f16_value(u16::from_le_bytes([c[0], c[1]])) as f64)
            .collect(),
        Storage::Bf16 => bytes
            .chunks_exact(2)
            .map(|c| bf16_value(u16::from_le_bytes([c[0], c[1]])) as f64)
            .collect(),
    }
}

/// Values as the storage type holds them (each rounded through the format).
pub fn quantize(values: &[f64], storage: super::Storage) -> Vec<f64> {
    decode(&encode(values, storage), storage)
}

/// Largest error of `got` against `want`, relative to the larger of `max |want|` and `floor`:
/// `max_i |got_i - want_i| / max(max_i |want_i|, floor)`. Infinite when a value is not finite
/// or the lengths differ, so unwritten (NaN-poisoned) outputs always fail.
pub fn max_rel_error(got: &[f64], want: &[f64], floor: f64) -> f64 {
    if got.len() != want.len() {
        return f64::INFINITY;
    }
    let scale = want.iter().fold(floor, |a, w| a.max(w.abs()));
    let mut worst = 0.0f64;
    for (g, w) in got.iter().zip(want) {
        if !g.is_finite() || !w.is_finite() {
            return f64::INFINITY;
        }
        worst = worst.max((g - w).abs() / scale);
    }
    worst
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::Storage;

    #[test]
    fn matmul_shapes_agree() {
        // A 2x3 · B 3x2 by hand, B given plain and transposed.
        let a = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
        let b = [1.0, 0.0, 0.0, 1.0, 1.0, 1.0];
        let bt = [1.0, 0.0, 1.0, 0.0, 1.0, 1.0];
        let want = vec![4.0, 5.0, 10.0, 11.0];
        assert_eq!(
            matmul(&a, &b, &MatmulShape::dense(1, 2, 2, 3, false, false)),
            want
        );
        assert_eq!(
            matmul(&a, &bt, &MatmulShape::dense(1, 2, 2, 3, false, true)),
            want
        );
        // Shared B over a batch of 2 equals two separate products.
        let a2: Vec<f64> = a.iter().chain(a.iter()).copied().collect();
        let c = matmul(&a2, &b, &MatmulShape::dense(2, 2, 2, 3, false, false));
        assert_eq!(&c[..4], &want[..]);
        assert_eq!(&c[4..], &want[..]);
    }

    #[test]
    fn softmax_rows_sum_to_one_and_mask() {
        let x = [1.0, 2.0, 3.0, 1000.0, 1000.0, 1000.0];
        let y = softmax(&x, 2, 3, 1.0, None);
        assert!((y[..3].iter().sum::<f64>() - 1.0).abs() < 1e-12);
        assert!((y[3] - 1.0 / 3.0).abs() < 1e-12, "large inputs stay finite");
        let m = softmax(&x, 2, 3, 1.0, Some((0, 3)));
        assert_eq!(m[0], 1.0);
        assert_eq!(&m[1..3], &[0.0, 0.0]);
        assert!((m[3] - 0.5).abs() < 1e-12 && m[5] == 0.0);
    }

    #[test]
    fn flash_matches_attention_and_stats_rebuild_probs() {
        let (bh, seq, d) = (2, 5, 3);
        let q: Vec<f64> = (0..bh * seq * d).map(|i| (i as f64 * 0.37).sin()).collect();
        let k: Vec<f64> = (0..bh * seq * d).map(|i| (i as f64 * 0.21).cos()).collect();
        let v: Vec<f64> = (0..bh * seq * d).map(|i| (i as f64 * 0.13).sin()).collect();
        for causal in [false, true] {
            let (scores, probs, out) = attention(&q, &k, &v, bh, seq, d, causal);
            let (fout, stats) = flash_attention(&q, &k, &v, bh, seq, d, causal);
            assert_eq!(out, fout);
            for r in 0..bh * seq {
                for j in 0..seq {
                    let p = if causal && j > r % seq {
                        0.0
                    } else {
                        (scores[r * seq + j] - stats[2 * r]).exp() / stats[2 * r + 1]
                    };
                    assert!((p - probs[r * seq + j]).abs() < 1e-12);
                }
            }
        }
    }

    #[test]
    fn conv_identity_kernel_and_padding() {
        let s = ConvShape {
            n: 1,
            c_in: 1,
            h: 3,
            w: 3,
            c_out: 1,
            kernel: 3,
            stride: 1,
            pad: 1,
        };
        let x: Vec<f64> = (1..=9).map(f64::from).collect();
        let mut wt = vec![0.0; 9];
        wt[4] = 1.0;
        assert_eq!(conv2d(&x, &wt, &s), x);
        // All-ones kernel: the corner sums its 2x2 neighbourhood.
        let y = conv2d(&x, &[1.0; 9], &s);
        assert_eq!(y[0], 1.0 + 2.0 + 4.0 + 5.0);
        let s2 = ConvShape {
            stride: 2,
            pad: 0,
            ..s
        };
        assert_eq!(s2.out_hw(), Some((1, 1)));
        assert_eq!(conv2d(&x, &[1.0; 9], &s2), vec![45.0]);
        assert_eq!(
            ConvShape {
                kernel: 5,
                pad: 0,
                ..s
            }
            .out_hw(),
            None
        );
    }

    #[test]
    fn elementwise_and_layer_norm() {
        assert_eq!(relu(&[-1.0, 0.5]), vec![0.0, 0.5]);
        let g = gelu(&[0.0, 1.0, -1.0, 10.0]);
        assert_eq!(g[0], 0.0);
        assert!((g[1] - 0.841192).abs() < 1e-5 && (g[2] + 0.158808).abs() < 1e-5);
        assert!((g[3] - 10.0).abs() < 1e-9);
        let y = layer_norm(&[1.0, 2.0, 3.0, 4.0], 1, 4, 0.0);
        assert!(y.iter().sum::<f64>().abs() < 1e-12);
        assert!((y.iter().map(|v| v * v).sum::<f64>() / 4.0 - 1.0).abs() < 1e-12);
    }

    #[test]
    fn adam_first_step_moves_by_lr() {
        // At t = 1 the bias-corrected step is lr * g / (|g| + eps) ≈ lr * sign(g).
        let cfg = AdamConfig::default();
        let (mut p, g, mut m, mut v) = (vec![1.0, 1.0], [0.5, -2.0], vec![0.0; 2], vec![0.0; 2]);
        adam(&mut p, &g, &mut m, &mut v, &cfg);
        assert!((p[0] - (1.0 - 1e-3)).abs() < 1e-9 && (p[1] - (1.0 + 1e-3)).abs() < 1e-9);
        assert!((m[0] - 0.05).abs() < 1e-12 && (v[1] - 0.004).abs() < 1e-12);
    }

    #[test]
    fn half_codecs_round_to_nearest_even() {
        assert_eq!(f16_bits(1.0), 0x3c00);
        assert_eq!(f16_bits(-2.0), 0xc000);
        assert_eq!(f16_bits(65504.0), 0x7bff);
        assert_eq!(f16_bits(1e6), 0x7c00);
        assert_eq!(f16_bits(5.960_464_5e-8), 0x0001); // smallest subnormal
                                                      // 1 + 2^-11 is halfway between 1 and 1 + 2^-10: ties to even (1.0).
        assert_eq!(f16_bits(1.0 + 2f32.powi(-11)), 0x3c00);
        assert_eq!(f16_bits(1.0 + 3.0 * 2f32.powi(-11)), 0x3c02);
        for h in [0x0001u16, 0x03ff, 0x0400, 0x3555, 0x7bff, 0xbc00] {
            assert_eq!(f16_bits(f16_value(h)), h, "{h:#x}");
        }
        assert!(f16_value(0x7e00).is_nan());
        assert_eq!(bf16_bits(1.0), 0x3f80);
        assert_eq!(bf16_bits(f32::from_bits(0x3f80_8000)), 0x3f80); // tie to even
        assert_eq!(bf16_bits(f32::from_bits(0x3f81_8000)), 0x3f82);
        assert_eq!(bf16_value(0x4049), f32::from_bits(0x4049_0000));
        assert_eq!(bf16_bits(f32::NAN), 0x7fc0);
        let vals = [0.1, -3.5, 1000.25];
        for s in [Storage::F32, Storage::F16, Storage::Bf16] {
            let q = quantize(&vals, s);
            assert!(max_rel_error(&q, &vals, 1e-6) < 1e-2, "{s:?}");
            assert_eq!(encode(&vals, s).len(), 3 * s.bytes() as usize);
        }
    }

    #[test]
    fn error_measure_catches_poison() {
        assert_eq!(max_rel_error(&[1.0, 2.0], &[1.0, 2.0], 1e-6), 0.0);
        assert!((max_rel_error(&[1.0, 2.1], &[1.0, 2.0], 1e-6) - 0.05).abs() < 1e-12);
        assert!(max_rel_error(&[f64::NAN], &[1.0], 1e-6).is_infinite());
        assert!(max_rel_error(&[1.0], &[1.0, 2.0], 1e-6).is_infinite());
    }
}
