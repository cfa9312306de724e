//! Probes needed by oomprobe's search (from the prediction: one granule, then gallop, bisect,
//! confirm the pair) against a Lightning-style search (double from 2 until failure, then bisect)
//! on the same threshold oracles. Prints one row per case and the totals; `cargo bench --bench
//! search`. Probe counts are what matter: on a device one probe costs seconds.

use oomprobe::report::Outcome;
use oomprobe::search::{find_boundary, lightning_style, SearchSpace};

fn count(
    boundary: u64,
    f: impl Fn(&mut dyn FnMut(u64) -> Outcome) -> (Option<u64>, usize),
) -> usize {
    let mut oracle = |x: u64| {
        if x <= boundary {
            Outcome::Fit
        } else {
            Outcome::OutOfMemory
        }
    };
    let (max_fit, probes) = f(&mut oracle);
    assert_eq!(
        max_fit,
        Some(boundary),
        "both searches must find the boundary"
    );
    probes
}

fn main() {
    let space = SearchSpace::unit(1 << 22);
    let boundaries = [3u64, 11, 97, 1013, 4908, 50_000];
    // Prediction quality: the prediction as a fraction of the true boundary.
    let accuracies = [
        ("exact", 1.0),
        ("+3%", 1.03),
        ("-3%", 0.97),
        ("+20%", 1.2),
        ("-20%", 0.8),
        ("2x", 2.0),
    ];
    println!(
        "{:>10} {:>10} {:>10} {:>10}",
        "boundary", "prediction", "oomprobe", "lightning"
    );
    let (mut ours_total, mut theirs_total) = (0usize, 0usize);
    for &b in &boundaries {
        for (label, k) in accuracies {
            let start = ((b as f64) * k).round().max(1.0) as u64;
            let ours = count(b, |o| {
                let r = find_boundary(space, start, o);
                (r.max_fit, r.probes.len())
            });
            let theirs = count(b, |o| {
                let r = lightning_style(space, 2, o);
                (r.max_fit, r.probes.len())
            });
            ours_total += ours;
            theirs_total += theirs;
            println!("{b:>10} {label:>10} {ours:>10} {theirs:>10}");
        }
    }
    println!(
        "{:>10} {:>10} {ours_total:>10} {theirs_total:>10}   (oomprobe's counts include the 2-probe confirmation)",
        "total", ""
    );
}
