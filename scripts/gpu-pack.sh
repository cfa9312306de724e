#!/usr/bin/env bash
# Build what scripts/gpu-check.sh carries to a GPU machine, here (no GPU, no CUDA toolkit
# needed): the release `oomprobe` binary and the release integration-test executable (which
# holds the tests that touch a device: gpu-check.sh picks them by name), stripped, in one
# folder.
#
#   scripts/gpu-pack.sh [DIR]        (default: target/gpu-pack)
#
# DIR/oomprobe and DIR/tests/it. Measured on 2026-11-30, when each test file was its own
# executable: 26 MiB in all for oomprobe and four of them; the one `it` executable holds the
# crate and wgpu once, well under the 64 MiB a device run may carry. Prints the total.
set -euo pipefail
dir=${1:-target/gpu-pack}
tests=(it)
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
