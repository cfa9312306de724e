#!/usr/bin/env bash
# Build what scripts/gpu-check.sh carries to a GPU machine, here (no GPU, no CUDA toolkit
# needed): the release `oomprobe` binary and the release test executables that touch a device,
# stripped, in one folder.
#
#   scripts/gpu-pack.sh [DIR]        (default: target/gpu-pack)
#
# DIR/oomprobe and DIR/tests/{kernels,backend_alloc,cuda_kernels,cuda_ptx}. Measured on
# 2026-11-30: 26 MiB in all (oomprobe 10.0 MiB, each wgpu test 6.2 MiB, cuda_kernels 1.9 MiB,
# cuda_ptx 1.4 MiB), well under the 64 MiB a device run may carry. Prints the total.
set -euo pipefail
dir=${1:-target/gpu-pack}
tests=(kernels backend_alloc cuda_kernels cuda_ptx)
args=()
for t in "${tests[@]}"; do args+=(--test "$t"); done
cargo build --release --bin oomprobe
# `--message-format json` names each test executable; the newest build of each wins.
exes=$(cargo test --release --no-run "${args[@]}" --message-format json 2>/dev/null |
  python3 -c 'import json,sys
for l in sys.stdin:
    m=json.loads(l)
    if m.get("reason")=="compiler-artifact" and m.get("executable") and m["target"]["kind"]==["test"]:
        print(m["target"]["name"], m["executable"])')
rm -rf "$dir" && mkdir -p "$dir/tests"
cp target/release/oomprobe "$dir/oomprobe"
while read -r name exe; do cp "$exe" "$dir/tests/$name"; done <<<"$exes"
strip "$dir/oomprobe" "$dir"/tests/* 2>/dev/null || true
for t in "${tests[@]}"; do [ -x "$dir/tests/$t" ] || { echo "missing test executable $t" >&2; exit 1; }; done
du -sh "$dir"
