//! Rank plans and the layout search: the worst rank of Llama-3-70B under tp 8 × pp 4 with 16
//! micro-batches (one plan per stage, each composed of its micro-batches), and `diagnose
//! --gpus 8`'s search over Llama-3-8B's layouts on 80 GiB (32 layouts, each judged under the
//! caching allocator with its max micro-batch searched), and `estimate --gpu all` of
//! Llama-3-8B on 16 pipeline stages with 1024 and 4096 micro-batches (every card of the table,
//! each boundary under the caching allocator; target ≤ 1 s each), and `diagnose`'s search of
//! the ways out for Llama-3-70B on 8 H100 (issue 47: target ≤ 1 s).

use criterion::{criterion_group, criterion_main, Criterion};
use oomprobe::plan::Plan;
use oomprobe::workload::parallel::Fsdp;
use oomprobe::workload::{presets, Precision};

fn bench(c: &mut Criterion) {
    let mut w = presets::get("llama3-8b").unwrap();
    w.layers = 80;
    w.hidden = 8192;
    w.heads = 64;
    w.ffn = 28672;
    w.precision = Precision::AmpBf16;
    w.seq = 4096;
    w.batch = 1;
    w.gpus = 64;
    w.parallel.tp = 8;
    w.parallel.sequence_parallel = true;
    w.parallel.pp = 4;
    w.parallel.microbatches = 16;
    w.parallel.fsdp = Some(Fsdp::Full);
    let mut g = c.benchmark_group("layouts");
    g.sample_size(10);
    g.bench_function("70B tp8 pp4 x16 micro-batches, worst of 4 stages", |b| {
        b.iter(|| Plan::for_workload(&w).unwrap().peak_bytes())
    });
    let mut d = presets::get("llama3-8b").unwrap();
    d.precision = Precision::AmpBf16;
    d.seq = 4096;
    d.batch = 1;
    d.gpus = 8;
    g.bench_function("llama3-8b layout search on 8 x 80 GiB", |b| {
        b.iter(|| {
            oomprobe::layouts::search(&d, 80 << 30, None, 6)
                .unwrap()
                .fitting
        })
    });
    for m in [1024, 4096] {
        let mut p = presets::get("llama3-8b").unwrap();
        p.gpus = 16;
        p.parallel.pp = 16;
        p.parallel.microbatches = m;
        let conf = oomprobe::alloc::AllocConf::default();
        g.bench_function(
            format!("estimate --gpu all, pp16 x{m} micro-batches"),
            |b| b.iter(|| oomprobe::estimate::all_cards(&p, &conf).unwrap().len()),
        );
    }
    let mut big = w.clone();
    big.parallel = Default::default();
    big.gpus = 8;
    big.precision = Precision::Bf16;
    let h100 = oomprobe::alloc::cards::get("h100-sxm").unwrap();
    g.bench_function("ways out, 70B on 8 x h100-sxm", |b| {
        b.iter(|| {
            oomprobe::ways::search(
                &big,
                h100.total,
                Some(h100),
                &oomprobe::alloc::AllocConf::default(),
                8,
                6,
            )
            .unwrap()
            .fitting
        })
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
