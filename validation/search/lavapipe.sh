#!/bin/bash
# Issue 10's lavapipe runs: the measuring search under a real OOM (an address-space limit on a
# CPU adapter) and the default suite, measure against gallop. Run from the repository root after
# `cargo build --release`, with nothing else running; results go to validation/search/OUT/.
# The runs of 2026-11-30 are in validation/search/2026-11-30/ (the README quotes them).
# RUNS="as4g-params as4g-seq" runs only the runs named.
set -u
B=./target/release/oomprobe
O=validation/search/${1:-out}
mkdir -p "$O"
run() {
  name=$1; shift
  [ -z "${RUNS:-}" ] || [[ " $RUNS " == *" $name "* ]] || return 0
  s=$(date +%s); "$@" --quiet --out "$O/$name.json" > "$O/$name.txt" 2>&1; echo "$name rc=$? $(( $(date +%s) - s )) s" >> "$O/times.txt"
}
run as4g-params prlimit --as=4294967296 $B probe --scenario params
run as4g-batch-tiny prlimit --as=4294967296 $B probe --scenario batch --model tiny-gpt
run as4g-seq prlimit --as=4294967296 $B probe --scenario seq
run as2g-seq prlimit --as=2147483648 $B probe --scenario seq
run suite-budget512-measure $B probe --budget 512MiB
run suite-budget512-gallop $B probe --budget 512MiB --search gallop
run suite-as2g-measure prlimit --as=2147483648 $B probe
run suite-as2g-gallop prlimit --as=2147483648 $B probe --search gallop
