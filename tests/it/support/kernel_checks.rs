//! Kernel checks shared by `backend::wgpu::kernels` and `backend::cuda::kernels`: every
//! compute kernel against its f64 CPU reference, with fresh random inputs, outputs poisoned
//! with NaN first, f32 / f16 / bf16 storage, and tensors cut into many small chunks so kernels
//! run across buffer boundaries. Written once over `&mut dyn Backend`: each test file only
//! opens its device(s) (full limits, and buffers capped at `SMALL_CHUNK`) and calls these.

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use oomprobe::backend::Backend;
use oomprobe::kernels::reference::{self as r, max_rel_error, AdamConfig, ConvShape, MatmulShape};
use oomprobe::kernels::Storage;
use oomprobe::ops::compute::{self, AttentionDims, ConvDims, MatmulDims};
use oomprobe::plan::{DType, Step};
use oomprobe::tensor::{allocate, DeviceTensor};

/// NaN in f32 and in both f16 / bf16 halves: any element a kernel fails to write stays NaN.
pub const POISON: u32 = 0x7fc0_7fc0;
/// Chunk cap of the "small" device: tensors of a few KiB span several buffers.
pub const SMALL_CHUNK: u64 = 8192;

pub fn dtype(s: Storage) -> DType {
    match s {
        Storage::F32 => DType::F32,
        Storage::F16 => DType::F16,
        Storage::Bf16 => DType::Bf16,
    }
}

/// Error allowed for outputs stored in `s` (inputs are quantized before the reference runs,
/// so this covers f32 arithmetic plus one rounding of the output).
pub fn tol(s: Storage) -> f64 {
    match s {
        Storage::F32 => 1e-4,
        Storage::F16 => 2e-3,
        Storage::Bf16 => 1e-2,
    }
}

pub const ALL: [Storage; 3] = [Storage::F32, Storage::F16, Storage::Bf16];

pub fn rng() -> (SmallRng, u64) {
    let seed: u64 = rand::random();
    (SmallRng::seed_from_u64(seed), seed)
}

pub fn random(rng: &mut SmallRng, n: usize, lo: f64, hi: f64) -> Vec<f64> {
    (0..n).map(|_| rng.random_range(lo..hi)).collect()
}

/// A tensor of `values` (rounded to the type), `row_elems` per row.
pub fn upload(
    b: &mut dyn Backend,
    dt: DType,
    values: &[f64],
    row: u64,
) -> (DeviceTensor, Vec<f64>) {
    let s = dt.storage();
    let t = allocate(b, "in", dt, values.len() as u64, row).expect("allocate input");
    for c in &t.chunks {
        let lo = c.first_elem as usize;
        let mut bytes = r::encode(&values[lo..lo + c.elems as usize], s);
        bytes.resize(c.bytes as usize, 0);
        b.write_buffer(c.buffer, 0, &bytes).expect("upload");
    }
    (t, r::quantize(values, s))
}

/// A tensor of `elems` elements, every word poisoned.
pub fn poisoned(b: &mut dyn Backend, dt: DType, elems: usize, row: u64) -> DeviceTensor {
    let t = allocate(b, "out", dt, elems as u64, row).expect("allocate output");
    for c in &t.chunks {
        let bytes: Vec<u8> = std::iter::repeat_n(POISON.to_le_bytes(), c.words() as usize)
            .flatten()
            .collect();
        b.write_buffer(c.buffer, 0, &bytes).expect("poison");
    }
    t
}

pub fn download(b: &mut dyn Backend, t: &DeviceTensor) -> Vec<f64> {
    b.synchronize().expect("kernels ran");
    let mut out = Vec::with_capacity(t.elems as usize);
    for c in &t.chunks {
        let bytes = b.read_buffer(c.buffer, 0, c.bytes).expect("read back");
        let vals = r::decode(&bytes, t.dtype.storage());
        out.extend_from_slice(&vals[..c.elems as usize]);
    }
    out
}

pub fn free(b: &mut dyn Backend, ts: Vec<DeviceTensor>) {
    for t in ts {
        oomprobe::tensor::free_tensor(b, t);
    }
}

#[track_caller]
pub fn check(what: &str, seed: u64, got: &[f64], want: &[f64], tol: f64) {
    let e = max_rel_error(got, want, 1e-6);
    eprintln!("{what}: max relative error {e:.2e}");
    assert!(
        e < tol,
        "{what}: max relative error {e:e} >= {tol:e} (seed {seed}); first values got {:?} want {:?}",
        &got[..got.len().min(4)],
        &want[..want.len().min(4)]
    );
}

/// Matmul in its three forms (shared B, per-batch B, transposed per-batch B), every storage
/// type, on full-size buffers and on 8 KiB chunks.
pub fn matmul_matches_reference(full: &mut dyn Backend, chunked: &mut dyn Backend) {
    let (mut g, seed) = rng();
    for small in [false, true] {
        let b: &mut dyn Backend = if small { &mut *chunked } else { &mut *full };
        for s in ALL {
            let dt = dtype(s);
            for (per_batch, trans) in [(false, false), (true, false), (true, true)] {
                // Per-batch A of 70x45 f32 is 12.6 KB: on the small device one batch spans
                // chunks and the op cuts rows within each batch.
                let (batch, m, n, k) = (3usize, 70usize, 29usize, 45usize);
                let a = random(&mut g, batch * m * k, -1.0, 1.0);
                let bb = random(&mut g, if per_batch { batch } else { 1 } * k * n, -1.0, 1.0);
                let (ta, qa) = upload(b, dt, &a, k as u64);
                let b_row = if trans { k } else { n } as u64;
                let (tb, qb) = upload(b, dt, &bb, if per_batch { (k * n) as u64 } else { b_row });
                let tc = poisoned(b, dt, batch * m * n, n as u64);
                let dims = MatmulDims {
                    batch: batch as u64,
                    m: m as u64,
                    n: n as u64,
                    k: k as u64,
                    b_per_batch: per_batch,
                    b_transposed: trans,
                    alpha: 0.5,
                };
                compute::matmul(b, &ta, &tb, &tc, &dims).expect("matmul");
                let got = download(b, &tc);
                let mut shape = MatmulShape::dense(batch, m, n, k, per_batch, trans);
                shape.alpha = 0.5;
                let want = r::matmul(&qa, &qb, &shape);
                let what =
                    format!("matmul {s:?} per_batch={per_batch} trans={trans} small={small}");
                if small {
                    assert!(
                        ta.chunks.len() > 2 && tc.chunks.len() > 1,
                        "{what}: chunked"
                    );
                }
                check(&what, seed, &got, &want, tol(s));
                free(b, vec![ta, tb, tc]);
            }
        }
    }
}

/// A shared B bigger than one chunk cannot be bound: a clear error, not a panic.
pub fn matmul_with_b_past_one_chunk_is_an_error(b: &mut dyn Backend) {
    let (k, n) = (64usize, 64usize); // 16 KiB of f32 B, chunks of 8 KiB
    let (ta, _) = upload(b, DType::F32, &vec![1.0; 4 * k], k as u64);
    let (tb, _) = upload(b, DType::F32, &vec![1.0; k * n], n as u64);
    let tc = poisoned(b, DType::F32, 4 * n, n as u64);
    let dims = MatmulDims {
        batch: 1,
        m: 4,
        n: n as u64,
        k: k as u64,
        b_per_batch: false,
        b_transposed: false,
        alpha: 1.0,
    };
    let e = compute::matmul(b, &ta, &tb, &tc, &dims).expect_err("B spans chunks");
    assert!(e.to_string().contains("chunk boundary"), "{e}");
    free(b, vec![ta, tb, tc]);
}

/// Softmax (odd row length, so 16-bit rows share words) and layer norm, plain and chunked.
pub fn row_kernels_match_reference(full: &mut dyn Backend, chunked: &mut dyn Backend) {
    let (mut g, seed) = rng();
    for small in [false, true] {
        let b: &mut dyn Backend = if small { &mut *chunked } else { &mut *full };
        for s in ALL {
            let dt = dtype(s);
            let (rows, cols) = (61usize, 77usize);
            let x = random(&mut g, rows * cols, -6.0, 6.0);
            let (tx, qx) = upload(b, dt, &x, cols as u64);
            let ty = poisoned(b, dt, rows * cols, cols as u64);
            compute::softmax(b, &tx, &ty, rows as u64, cols as u64).expect("softmax");
            let got = download(b, &ty);
            let want = r::softmax(&qx, rows, cols, 1.0, None);
            check(
                &format!("softmax {s:?} small={small}"),
                seed,
                &got,
                &want,
                tol(s),
            );

            let tz = poisoned(b, dt, rows * cols, cols as u64);
            compute::layer_norm(b, &tx, &tz, rows as u64, cols as u64).expect("layer norm");
            let got = download(b, &tz);
            let want = r::layer_norm(&qx, rows, cols, 1e-5);
            check(
                &format!("layer_norm {s:?} small={small}"),
                seed,
                &got,
                &want,
                tol(s),
            );
            if small {
                assert!(tx.chunks.len() > 1, "chunked");
            }
            free(b, vec![tx, ty, tz]);
        }
    }
}

/// The causal attention softmax over rows that start mid-sequence (a chunk boundary).
pub fn causal_attention_probs_match_reference(b: &mut dyn Backend) {
    let (mut g, seed) = rng();

    for s in ALL {
        let dt = dtype(s);
        let (rows, seq) = (4 * 40usize, 40usize); // 160-byte rows: 51 rows per 8 KiB chunk
        let x = random(&mut g, rows * seq, -3.0, 3.0);
        let (tx, qx) = upload(b, dt, &x, seq as u64);
        let ty = poisoned(b, dt, rows * seq, seq as u64);
        compute::attention_probs(b, &tx, &ty, rows as u64, seq as u64, 0.7, true)
            .expect("attention probs");
        let got = download(b, &ty);
        let want = r::softmax(&qx, rows, seq, 0.7, Some((0, seq)));
        check(&format!("attention probs {s:?}"), seed, &got, &want, tol(s));
        free(b, vec![tx, ty]);
    }
}

/// ReLU and GeLU over an odd number of elements that stops short of the tensor's end: the
/// elements past it (including the other half of a shared 16-bit word) stay untouched.
pub fn elementwise_match_reference_and_write_only_their_range(
    full: &mut dyn Backend,
    chunked: &mut dyn Backend,
) {
    let (mut g, seed) = rng();
    for small in [false, true] {
        let b: &mut dyn Backend = if small { &mut *chunked } else { &mut *full };
        for s in ALL {
            let dt = dtype(s);
            let (total, n) = (5001usize, 4999usize);
            let mut x = random(&mut g, total, -5.0, 5.0);
            x[0] = 30.0; // tanh argument far past its clamp
            x[1] = -30.0;
            let (tx, qx) = upload(b, dt, &x, 1);
            for (name, want) in [("relu", r::relu(&qx[..n])), ("gelu", r::gelu(&qx[..n]))] {
                let ty = poisoned(b, dt, total, 1);
                if name == "relu" {
                    compute::relu(b, &tx, &ty, n as u64).expect("relu");
                } else {
                    compute::gelu(b, &tx, &ty, n as u64).expect("gelu");
                }
                let got = download(b, &ty);
                check(
                    &format!("{name} {s:?} small={small}"),
                    seed,
                    &got[..n],
                    &want,
                    tol(s),
                );
                assert!(
                    got[n..].iter().all(|v| v.is_nan()),
                    "{name} {s:?}: wrote past len"
                );
                free(b, vec![ty]);
            }
            free(b, vec![tx]);
        }
    }
}

pub fn attention_inputs(
    b: &mut dyn Backend,
    g: &mut SmallRng,
    dt: DType,
    bh: usize,
    seq: usize,
    d: usize,
    row: u64,
) -> ([DeviceTensor; 3], [Vec<f64>; 3]) {
    let n = bh * seq * d;
    let (tq, q) = upload(b, dt, &random(g, n, -1.5, 1.5), row);
    let (tk, k) = upload(b, dt, &random(g, n, -1.5, 1.5), row);
    let (tv, v) = upload(b, dt, &random(g, n, -1.0, 1.0), row);
    ([tq, tk, tv], [q, k, v])
}

/// Naive attention: the stored scores and probabilities and the output.
pub fn naive_attention_matches_reference(full: &mut dyn Backend, chunked: &mut dyn Backend) {
    let (mut g, seed) = rng();
    for small in [false, true] {
        let b: &mut dyn Backend = if small { &mut *chunked } else { &mut *full };
        for s in [Storage::F32, Storage::F16] {
            for causal in [false, true] {
                let dt = dtype(s);
                let (bh, seq, d) = (3usize, 33usize, 16usize);
                let ([tq, tk, tv], [q, k, v]) =
                    attention_inputs(b, &mut g, dt, bh, seq, d, (seq * d) as u64);
                let ts = poisoned(b, dt, bh * seq * seq, seq as u64);
                let tp = poisoned(b, dt, bh * seq * seq, seq as u64);
                let to = poisoned(b, dt, bh * seq * d, d as u64);
                let dims = AttentionDims {
                    batch_heads: bh as u64,
                    seq: seq as u64,
                    head_dim: d as u64,
                    causal,
                    kv_group: 1,
                };
                compute::attention_naive(b, &tq, &tk, &tv, &ts, &tp, &to, &dims)
                    .expect("attention");
                let (ws, wp, _) = r::attention(&q, &k, &v, bh, seq, d, causal);
                let what = format!("attention {s:?} causal={causal} small={small}");
                check(
                    &format!("{what} scores"),
                    seed,
                    &download(b, &ts),
                    &ws,
                    tol(s),
                );
                let gp = download(b, &tp);
                check(&format!("{what} probs"), seed, &gp, &wp, tol(s));
                // The output from the probabilities as stored (16-bit probs are rounded).
                let wo = r::matmul(&gp, &v, &MatmulShape::dense(bh, seq, d, seq, true, false));
                check(&format!("{what} out"), seed, &download(b, &to), &wo, tol(s));
                free(b, vec![tq, tk, tv, ts, tp, to]);
            }
        }
    }
}

/// Flash attention against the reference output and row statistics: several query blocks
/// and key tiles, head dims that make full and partial tiles.
pub fn flash_attention_matches_reference(full: &mut dyn Backend, chunked: &mut dyn Backend) {
    let (mut g, seed) = rng();
    for small in [false, true] {
        let b: &mut dyn Backend = if small { &mut *chunked } else { &mut *full };
        let cases = [
            (Storage::F32, 32usize),
            (Storage::F32, 80),
            (Storage::F16, 32),
            (Storage::Bf16, 24),
        ];
        for (s, d) in cases {
            // Each head of q, k, v must lie in one chunk: on the small device, heads of
            // 60 x 32 f32 (7.5 KiB) fill one 8 KiB chunk each; 80-wide heads do not fit.
            let seq = if small { 60usize } else { 70 };
            if small && seq * d * 4 > SMALL_CHUNK as usize {
                continue;
            }
            for causal in [false, true] {
                let dt = dtype(s);
                let bh = 3usize;
                let hs = (seq * d) as u64;
                let ([tq, tk, tv], [q, k, v]) = attention_inputs(b, &mut g, dt, bh, seq, d, hs);
                let to = poisoned(b, dt, bh * seq * d, hs);
                let tst = poisoned(b, DType::F32, bh * seq * 2, 2 * seq as u64);
                let dims = AttentionDims {
                    batch_heads: bh as u64,
                    seq: seq as u64,
                    head_dim: d as u64,
                    causal,
                    kv_group: 1,
                };
                compute::flash_attention(b, &tq, &tk, &tv, &to, &tst, &dims).expect("flash");
                let (wo, wst) = r::flash_attention(&q, &k, &v, bh, seq, d, causal);
                let what = format!("flash {s:?} d={d} causal={causal} small={small}");
                check(&format!("{what} out"), seed, &download(b, &to), &wo, tol(s));
                // Stats in f32; the scaled scores come from quantized q, k only.
                check(
                    &format!("{what} stats"),
                    seed,
                    &download(b, &tst),
                    &wst,
                    1e-4,
                );
                free(b, vec![tq, tk, tv, to, tst]);
            }
        }
    }
}

/// Flash and naive attention agree on the same inputs (f32).
pub fn flash_equals_naive_attention(b: &mut dyn Backend) {
    let (mut g, seed) = rng();

    let (bh, seq, d) = (2usize, 130usize, 64usize);
    let ([tq, tk, tv], _) = attention_inputs(b, &mut g, DType::F32, bh, seq, d, d as u64);
    let ts = poisoned(b, DType::F32, bh * seq * seq, seq as u64);
    let tp = poisoned(b, DType::F32, bh * seq * seq, seq as u64);
    let tn = poisoned(b, DType::F32, bh * seq * d, d as u64);
    let tf = poisoned(b, DType::F32, bh * seq * d, d as u64);
    let tst = poisoned(b, DType::F32, bh * seq * 2, 2);
    let dims = AttentionDims {
        batch_heads: bh as u64,
        seq: seq as u64,
        head_dim: d as u64,
        causal: true,
        kv_group: 1,
    };
    compute::attention_naive(b, &tq, &tk, &tv, &ts, &tp, &tn, &dims).expect("naive");
    compute::flash_attention(b, &tq, &tk, &tv, &tf, &tst, &dims).expect("flash");
    let naive = download(b, &tn);
    check("flash vs naive", seed, &download(b, &tf), &naive, 1e-4);
    free(b, vec![tq, tk, tv, ts, tp, tn, tf, tst]);
}

/// Grouped-query flash attention (`kv_group` query heads per key/value head, K and V at the
/// key/value head count) equals flash attention over K and V repeated to every query head, as
/// transformers' `repeat_kv` does; on the small device too, where a run of heads spans chunks.
pub fn grouped_flash_matches_repeated_kv(full: &mut dyn Backend, chunked: &mut dyn Backend) {
    let (mut g, seed) = rng();
    for small in [false, true] {
        let b: &mut dyn Backend = if small { &mut *chunked } else { &mut *full };
        for group in [2usize, 4] {
            let (bh, seq, d) = (8usize, 40usize, 16usize);
            let kvh = bh / group;
            let hs = (seq * d) as u64;
            let (tq, q) = upload(b, DType::F32, &random(&mut g, bh * seq * d, -1.5, 1.5), hs);
            let (tk, k) = upload(b, DType::F32, &random(&mut g, kvh * seq * d, -1.5, 1.5), hs);
            let (tv, v) = upload(b, DType::F32, &random(&mut g, kvh * seq * d, -1.0, 1.0), hs);
            let rep = |x: &[f64]| -> Vec<f64> {
                (0..bh)
                    .flat_map(|h| {
                        let k0 = (h / group) * seq * d;
                        x[k0..k0 + seq * d].to_vec()
                    })
                    .collect()
            };
            let to = poisoned(b, DType::F32, bh * seq * d, hs);
            let tst = poisoned(b, DType::F32, bh * seq * 2, 2 * seq as u64);
            let dims = AttentionDims {
                batch_heads: bh as u64,
                seq: seq as u64,
                head_dim: d as u64,
                causal: true,
                kv_group: group as u64,
            };
            compute::flash_attention(b, &tq, &tk, &tv, &to, &tst, &dims).expect("flash");
            let (wo, wst) = r::flash_attention(&q, &rep(&k), &rep(&v), bh, seq, d, true);
            let what = format!("grouped flash g={group} small={small}");
            check(&format!("{what} out"), seed, &download(b, &to), &wo, 1e-4);
            check(
                &format!("{what} stats"),
                seed,
                &download(b, &tst),
                &wst,
                1e-4,
            );
            free(b, vec![tq, tk, tv, to, tst]);
        }
    }
}

/// conv2d with stride and padding, and a 1x1 convolution, images spread over chunks.
pub fn conv2d_matches_reference(full: &mut dyn Backend, chunked: &mut dyn Backend) {
    let (mut g, seed) = rng();
    for small in [false, true] {
        let b: &mut dyn Backend = if small { &mut *chunked } else { &mut *full };
        for s in ALL {
            let dt = dtype(s);
            for (kernel, stride, pad) in [(3usize, 2usize, 1usize), (1, 1, 0), (5, 1, 2)] {
                let shape = ConvShape {
                    n: 5,
                    c_in: 3,
                    h: 13,
                    w: 11,
                    c_out: 4,
                    kernel,
                    stride,
                    pad,
                };
                let (ho, wo) = shape.out_hw().expect("output");
                let img = shape.c_in * shape.h * shape.w;
                let (tx, qx) = upload(b, dt, &random(&mut g, shape.n * img, -1.0, 1.0), img as u64);
                let wlen = shape.c_out * shape.c_in * kernel * kernel;
                let (tw, qw) = upload(b, dt, &random(&mut g, wlen, -1.0, 1.0), wlen as u64);
                let y_img = shape.c_out * ho * wo;
                let ty = poisoned(b, dt, shape.n * y_img, y_img as u64);
                let dims = ConvDims {
                    n: shape.n as u64,
                    c_in: shape.c_in as u64,
                    h: shape.h as u64,
                    w: shape.w as u64,
                    c_out: shape.c_out as u64,
                    kernel: kernel as u64,
                    stride: stride as u64,
                    pad: pad as u64,
                };
                compute::conv2d(b, &tx, &tw, &ty, &dims).expect("conv2d");
                let want = r::conv2d(&qx, &qw, &shape);
                let what = format!("conv2d {s:?} k={kernel} s={stride} p={pad} small={small}");
                check(&what, seed, &download(b, &ty), &want, tol(s));
                free(b, vec![tx, tw, ty]);
            }
        }
    }
}

/// Adam in f32, in bf16, and mixed (f16 grads, f32 params and moments), across chunks.
pub fn adam_matches_reference(full: &mut dyn Backend, chunked: &mut dyn Backend) {
    let (mut g, seed) = rng();
    for small in [false, true] {
        let b: &mut dyn Backend = if small { &mut *chunked } else { &mut *full };
        for (pt, gt) in [
            (DType::F32, DType::F32),
            (DType::Bf16, DType::Bf16),
            (DType::F32, DType::F16),
        ] {
            let n = 3001usize;
            let (tp, mut p) = upload(b, pt, &random(&mut g, n, -1.0, 1.0), 1);
            let (tg, gq) = upload(b, gt, &random(&mut g, n, -0.1, 0.1), 1);
            let (tm, mut m) = upload(b, pt, &random(&mut g, n, -0.01, 0.01), 1);
            let (tv, mut v) = upload(b, pt, &random(&mut g, n, 0.0, 1e-4), 1);
            let cfg = AdamConfig {
                t: 3,
                lr: 1e-2,
                ..AdamConfig::default()
            };
            compute::adam(b, &tp, &tg, &tm, &tv, n as u64, &cfg).expect("adam");
            let (gp, gm, gv) = (download(b, &tp), download(b, &tm), download(b, &tv));
            r::adam(&mut p, &gq, &mut m, &mut v, &cfg);
            let s = pt.storage();
            let what = format!("adam {pt:?}/{gt:?} small={small}");
            check(&format!("{what} p"), seed, &gp, &p, tol(s));
            check(&format!("{what} m"), seed, &gm, &m, tol(s));
            check(&format!("{what} v"), seed, &gv, &v, tol(s));
            free(b, vec![tp, tg, tm, tv]);
        }
    }
}

/// `run_step` dispatches plan steps onto the plan's tensors by index.
pub fn run_step_runs_plan_steps(b: &mut dyn Backend) {
    let (mut g, seed) = rng();

    let (rows, k, n) = (40usize, 24usize, 16usize);
    let (tx, qx) = upload(
        b,
        DType::F32,
        &random(&mut g, rows * k, -1.0, 1.0),
        k as u64,
    );
    let (tw, qw) = upload(b, DType::F32, &random(&mut g, k * n, -1.0, 1.0), n as u64);
    let ty = poisoned(b, DType::F32, rows * n, n as u64);
    let tz = poisoned(b, DType::F32, rows * n, n as u64);
    let tensors = vec![tx, tw, ty, tz];
    let steps = [
        Step::Matmul {
            a: 0,
            b: 1,
            c: 2,
            batch: 2,
            m: 20,
            n: n as u64,
            k: k as u64,
        },
        Step::Gelu {
            x: 2,
            y: 3,
            elems: (rows * n) as u64,
        },
    ];
    for s in &steps {
        compute::run_step(b, s, &tensors).expect("step");
    }
    let y = r::matmul(&qx, &qw, &MatmulShape::dense(2, 20, n, k, false, false));
    check("run_step matmul", seed, &download(b, &tensors[2]), &y, 1e-4);
    check(
        "run_step gelu",
        seed,
        &download(b, &tensors[3]),
        &r::gelu(&y),
        1e-4,
    );
    let bad = Step::Relu {
        x: 0,
        y: 9,
        elems: 1,
    };
    assert!(compute::run_step(b, &bad, &tensors).is_err());
    free(b, tensors);
}
