#!/usr/bin/env bash
# Every GPU check in one go, on a machine with a GPU. Builds nothing: it takes a prebuilt
# `oomprobe` binary and prebuilt test executables (see README "Checking on a GPU machine").
#
#   scripts/gpu-check.sh OUT_DIR [BIN_DIR]
#
# BIN_DIR (default: target/release) holds `oomprobe`; test executables are looked up under
# BIN_DIR/tests/ (copy target/debug/deps/{kernels,backend_alloc,cuda_kernels}-* there).
# Writes logs and JSON results to OUT_DIR.
#
# Carried to the GPU machine: that BIN_DIR (the `oomprobe` binary and the test executables)
# and this script; nothing else. No NVRTC and no CUDA toolkit: the CUDA kernels are inside the
# binaries as PTX (shaders/ptx, compute_50, PTX ISA 7.0) and the NVIDIA driver JIT-compiles
# them, so the machine needs only its driver (libcuda, CUDA 11.2 / r460 or newer). The CUDA
# runs set OOMPROBE_CUDA_EMBEDDED=1 so that they use the embedded PTX even where an NVRTC
# happens to be installed: the driver-only path is the one checked.
set -uo pipefail
export OOMPROBE_CUDA_EMBEDDED=1
out=${1:?usage: scripts/gpu-check.sh OUT_DIR [BIN_DIR]}
bin=${2:-target/release}
mkdir -p "$out"
exe="$bin/oomprobe"
[ -x "$exe" ] || { echo "no oomprobe binary at $exe" >&2; exit 2; }

run() { # name, command...
  local name=$1; shift
  echo "== $name: $*" | tee -a "$out/summary.log"
  local t0=$(date +%s)
  "$@" >"$out/$name.log" 2>&1
  local rc=$?
  echo "   rc=$rc in $(( $(date +%s) - t0 )) s" | tee -a "$out/summary.log"
  tail -n 40 "$out/$name.log"
}

nvidia-smi >"$out/nvidia-smi.txt" 2>&1 || true
run devices "$exe" devices
run devices-json "$exe" devices --json

# Kernel tests (wgpu on the GPU, and CUDA where the test binary exists).
for t in "$bin"/tests/kernels-* "$bin"/tests/backend_alloc-*; do
  [ -x "$t" ] && run "test-$(basename "${t%-*}")" "$t" --test-threads=1
done
for t in "$bin"/tests/cuda_kernels-*; do
  [ -x "$t" ] && run "test-cuda_kernels" "$t" --include-ignored --test-threads=1
done
for t in "$bin"/benches/kernels-*; do
  [ -x "$t" ] && run "bench-kernels" "$t" --bench
done

# The default suite on each backend the card offers.
run suite-vulkan "$exe" probe --backend vulkan --json --out "$out/suite-vulkan.json" --quiet
if "$exe" devices --json 2>/dev/null | grep -q '"backend": *"cuda"'; then
  run suite-cuda "$exe" probe --backend cuda --json --out "$out/suite-cuda.json" --quiet
  run compare "$exe" compare "$out/suite-vulkan.json" "$out/suite-cuda.json" --format markdown --out "$out/compare.md"
fi
echo "logs in $out"
