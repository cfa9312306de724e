//! Kernel throughput on the adapter at hand: matmul, naive vs flash attention, conv2d (GFLOP/s,
//! shown by criterion as Gelem/s: one element = one floating-point operation) and fill (GB/s).
//!
//! Shapes are modest so `cargo bench --bench kernels` finishes in a few minutes on lavapipe;
//! set `OOMPROBE_BENCH_SCALE=4` (or more) on a real GPU for shapes that fill it.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use std::time::Duration;

use oomprobe::backend::wgpu::{AdapterSelector, WgpuBackend};
use oomprobe::backend::Backend;
use oomprobe::kernels::reference::encode;
use oomprobe::kernels::Storage;
use oomprobe::ops::compute::{self, AttentionDims, ConvDims, MatmulDims};
use oomprobe::ops::words;
use oomprobe::plan::DType;
use oomprobe::tensor::{allocate, free_tensor, DeviceTensor};

fn open() -> WgpuBackend {
    match WgpuBackend::open(AdapterSelector::Auto) {
        Ok(b) => b,
        Err(e) => panic!(
            "no wgpu adapter ({e}): install a GPU driver or the software Vulkan driver \
             (apt-get install -y mesa-vulkan-drivers libvulkan1)"
        ),
    }
}

fn scale() -> u64 {
    std::env::var("OOMPROBE_BENCH_SCALE")
        .ok()
        .and_then(|s| s.parse().ok())
        .filter(|&s| s >= 1)
        .unwrap_or(1)
}

/// A tensor of `elems` elements holding a smooth pattern in [-1, 1].
fn tensor(b: &mut WgpuBackend, dt: DType, elems: u64, row: u64) -> DeviceTensor {
    let t = allocate(b, "bench", dt, elems, row).expect("allocate");
    for c in &t.chunks {
        let vals: Vec<f64> = (0..c.elems)
            .map(|i| (((c.first_elem + i) % 97) as f64 / 48.0) - 1.0)
            .collect();
        let mut bytes = encode(&vals, dt.storage());
        bytes.resize(c.bytes as usize, 0);
        b.write_buffer(c.buffer, 0, &bytes).expect("upload");
    }
    t
}

fn dtype(s: Storage) -> DType {
    match s {
        Storage::F32 => DType::F32,
        Storage::F16 => DType::F16,
        Storage::Bf16 => DType::Bf16,
    }
}

fn bench_matmul(c: &mut Criterion, b: &mut WgpuBackend) {
    let mut g = c.benchmark_group("matmul");
    let s = scale();
    for (st, n) in [
        (Storage::F32, 256 * s),
        (Storage::F32, 512 * s),
        (Storage::F16, 512 * s),
    ] {
        let dt = dtype(st);
        let ta = tensor(b, dt, n * n, n);
        let tb = tensor(b, dt, n * n, n);
        let tc = tensor(b, dt, n * n, n);
        let dims = MatmulDims {
            batch: 1,
            m: n,
            n,
            k: n,
            b_per_batch: false,
            b_transposed: false,
            alpha: 1.0,
        };
        g.throughput(Throughput::Elements(2 * n * n * n));
        g.bench_function(BenchmarkId::new(st.name(), format!("{n}x{n}x{n}")), |it| {
            it.iter(|| {
                compute::matmul(b, &ta, &tb, &tc, &dims).expect("matmul");
                b.synchronize().expect("sync");
            })
        });
        for t in [ta, tb, tc] {
            free_tensor(b, t);
        }
    }
    g.finish();
}

fn bench_attention(c: &mut Criterion, b: &mut WgpuBackend) {
    let mut g = c.benchmark_group("attention");
    let s = scale();
    let (bh, d) = (4 * s, 64u64);
    for seq in [256 * s, 512 * s] {
        let dims = AttentionDims {
            batch_heads: bh,
            seq,
            head_dim: d,
            causal: false,
            kv_group: 1,
        };
        let n = bh * seq * d;
        let (tq, tk, tv) = (
            tensor(b, DType::F32, n, seq * d),
            tensor(b, DType::F32, n, seq * d),
            tensor(b, DType::F32, n, seq * d),
        );
        let to = tensor(b, DType::F32, n, seq * d);
        let scores = tensor(b, DType::F32, bh * seq * seq, seq);
        let probs = tensor(b, DType::F32, bh * seq * seq, seq);
        let stats = tensor(b, DType::F32, bh * seq * 2, seq * 2);
        // QKᵀ and PV: 2·seq²·d each per head (softmax not counted).
        g.throughput(Throughput::Elements(4 * bh * seq * seq * d));
        let label = format!("bh{bh}_seq{seq}_d{d}");
        g.bench_function(BenchmarkId::new("naive", &label), |it| {
            it.iter(|| {
                compute::attention_naive(b, &tq, &tk, &tv, &scores, &probs, &to, &dims)
                    .expect("naive");
                b.synchronize().expect("sync");
            })
        });
        g.bench_function(BenchmarkId::new("flash", &label), |it| {
            it.iter(|| {
                compute::flash_attention(b, &tq, &tk, &tv, &to, &stats, &dims).expect("flash");
                b.synchronize().expect("sync");
            })
        });
        for t in [tq, tk, tv, to, scores, probs, stats] {
            free_tensor(b, t);
        }
    }
    g.finish();
}

fn bench_conv(c: &mut Criterion, b: &mut WgpuBackend) {
    let mut g = c.benchmark_group("conv2d");
    let s = scale();
    let d = ConvDims {
        n: 4 * s,
        c_in: 32,
        h: 32,
        w: 32,
        c_out: 32,
        kernel: 3,
        stride: 1,
        pad: 1,
    };
    let (ho, wo) = d.out_hw().expect("shape");
    let tx = tensor(b, DType::F32, d.n * d.c_in * d.h * d.w, d.c_in * d.h * d.w);
    let w_len = d.c_out * d.c_in * d.kernel * d.kernel;
    let tw = tensor(b, DType::F32, w_len, w_len);
    let ty = tensor(b, DType::F32, d.n * d.c_out * ho * wo, d.c_out * ho * wo);
    g.throughput(Throughput::Elements(
        2 * d.n * d.c_out * ho * wo * d.c_in * d.kernel * d.kernel,
    ));
    let label = format!("n{}_c{}_{}x{}_k3", d.n, d.c_in, d.h, d.w);
    g.bench_function(BenchmarkId::new("f32", label), |it| {
        it.iter(|| {
            compute::conv2d(b, &tx, &tw, &ty, &d).expect("conv2d");
            b.synchronize().expect("sync");
        })
    });
    for t in [tx, tw, ty] {
        free_tensor(b, t);
    }
    g.finish();
}

fn bench_fill(c: &mut Criterion, b: &mut WgpuBackend) {
    let mut g = c.benchmark_group("fill");
    let bytes = (64u64 << 20) * scale();
    let t = allocate(b, "fill", DType::F32, bytes / 4, 1).expect("allocate");
    g.throughput(Throughput::Bytes(bytes));
    g.bench_function(
        BenchmarkId::new("words", format!("{}MiB", bytes >> 20)),
        |it| {
            it.iter(|| {
                words::fill_tensor(b, &t, 7).expect("fill");
                b.synchronize().expect("sync");
            })
        },
    );
    free_tensor(b, t);
    g.finish();
}

fn kernels(c: &mut Criterion) {
    let mut b = open();
    eprintln!("adapter: {} ({:?})", b.info().name, b.info().device_type);
    bench_fill(c, &mut b);
    bench_matmul(c, &mut b);
    bench_attention(c, &mut b);
    bench_conv(c, &mut b);
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .sample_size(10)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(4));
    targets = kernels
}
criterion_main!(benches);
