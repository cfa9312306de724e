//! The caching allocator model's speed: a 100k-event timeline (50k allocations of mixed sizes,
//! small and large, and their frees in a stack-and-random order) replayed from an empty
//! allocator, default and expandable segments; and a GPT-2 training plan for two steps.

use criterion::{criterion_group, criterion_main, Criterion};
use oomprobe::alloc::{conf::parse, AllocConf, Allocator, ModelDevice};
use rand::{rngs::SmallRng, Rng, SeedableRng};

/// 100,000 events: (true, size) allocates, (false, k) frees the k-th live block.
fn events() -> Vec<(bool, u64)> {
    let mut rng = SmallRng::seed_from_u64(31);
    let mut out = Vec::with_capacity(100_000);
    let mut live = 0u64;
    let mut allocs = 0;
    while out.len() < 100_000 {
        let alloc = live == 0 || (allocs < 50_000 && rng.random_bool(0.55));
        if alloc && allocs < 50_000 {
            let size = match rng.random_range(0..4) {
                0 => rng.random_range(1..1 << 20),
                1 => rng.random_range(1 << 20..10 << 20),
                2 => rng.random_range(10 << 20..200 << 20),
                _ => 4 << 20,
            };
            out.push((true, size));
            live += 1;
            allocs += 1;
        } else {
            out.push((false, rng.random_range(0..live)));
            live -= 1;
        }
    }
    out
}

fn run(conf: &AllocConf, ev: &[(bool, u64)]) -> u64 {
    let mut a = Allocator::new(conf.clone());
    let mut d = ModelDevice::unlimited();
    let mut live = Vec::new();
    for &(alloc, x) in ev {
        if alloc {
            live.push(a.malloc(&mut d, x, 0, None).expect("no limit"));
        } else {
            let id = live.swap_remove(x as usize);
            a.free(id);
        }
    }
    a.stats().reserved_peak
}

fn bench(c: &mut Criterion) {
    let ev = events();
    let native = AllocConf::default();
    let expandable = parse("expandable_segments:True").unwrap();
    c.bench_function("allocator 100k events, native", |b| {
        b.iter(|| run(&native, &ev))
    });
    c.bench_function("allocator 100k events, expandable", |b| {
        b.iter(|| run(&expandable, &ev))
    });
    let mut w = oomprobe::workload::presets::get("gpt2").unwrap();
    w.batch = 8;
    let plan = oomprobe::plan::Plan::for_workload(&w).unwrap();
    c.bench_function("gpt2 b8 training plan, 2 steps", |b| {
        b.iter(|| oomprobe::alloc::timeline::replay(&plan, &native, None, 2, false))
    });
}

criterion_group!(benches, bench);
criterion_main!(benches);
