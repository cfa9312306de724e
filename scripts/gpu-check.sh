#!/usr/bin/env bash
# Every GPU check in one go, on a machine with a GPU. Builds nothing: it takes the folder
# `scripts/gpu-pack.sh` makes here (no GPU or CUDA toolkit needed to make it).
#
#   scripts/gpu-check.sh OUT_DIR [BIN_DIR]      (BIN_DIR default: target/gpu-pack)
#
# Carried to the GPU machine: BIN_DIR (the stripped release `oomprobe` and the release
# integration-test executable `tests/it`, whose device tests are picked by name below; under
# the 64 MiB a device run may carry) and this script; nothing else. No NVRTC and no CUDA
# toolkit: the CUDA kernels are inside the binaries as PTX (shaders/ptx, compute_50, PTX ISA
# 7.0) and the NVIDIA driver JIT-compiles them, so the machine needs only its driver (libcuda,
# CUDA 11.2 / r460 or newer). The CUDA runs set OOMPROBE_CUDA_EMBEDDED=1 so that they use the
# embedded PTX even where an NVRTC happens to be installed: the driver-only path is checked.
#
# Time budget: every step runs under `timeout`, and the limits add up to 550 s (about 9 min):
# devices 2×15 s, the PTX check 10 s, kernel tests 3×60 s, the default suite 100 s on Vulkan and
# 120 s on CUDA (there tensors go through the caching allocator model, two steps a probe), the
# batch scenario with --allocator direct 60 s beside it (on an H200
# each probe writes and verifies at most ~140 GB at several TB/s: the cost is the child's start,
# context and allocation, about 1-3 s a probe, some 25 probes a suite), the spill check 40 s,
# compare 10 s. A step that runs out says `rc=124` and the next one still runs.
set -uo pipefail
export OOMPROBE_CUDA_EMBEDDED=1
out=${1:?usage: scripts/gpu-check.sh OUT_DIR [BIN_DIR]}
bin=${2:-target/gpu-pack}
mkdir -p "$out"
exe="$bin/oomprobe"
[ -x "$exe" ] || { echo "no oomprobe binary at $exe" >&2; exit 2; }

run() { # name, seconds, command...
  local name=$1 limit=$2; shift 2
  echo "== $name: $*" | tee -a "$out/summary.log"
  local t0=$(date +%s)
  timeout --signal=TERM --kill-after=5 "$limit" "$@" >"$out/$name.log" 2>&1
  local rc=$?
  echo "   rc=$rc in $(( $(date +%s) - t0 )) s" | tee -a "$out/summary.log"
  tail -n 40 "$out/$name.log"
}

nvidia-smi >"$out/nvidia-smi.txt" 2>&1 || true
run devices 15 "$exe" devices
run devices-json 15 "$exe" devices --json

# The embedded PTX parses and lists every kernel (no device needed), then the kernel tests on
# wgpu's adapter and on CUDA through the driver's JIT.
it="$bin/tests/it"
if [ -x "$it" ]; then
  run test-cuda_ptx 10 "$it" backend::cuda::ptx:: --test-threads=1
  run test-kernels 60 "$it" backend::wgpu::kernels:: --test-threads=1
  run test-backend_alloc 60 "$it" backend::wgpu::alloc:: --test-threads=1
  run test-cuda_kernels 60 "$it" backend::cuda::kernels:: --include-ignored --test-threads=1
fi

# The default suite on each backend the card offers: prediction error and fill ratio per row
# are in the JSON (predicted_max, max_fit, fill_ratio) and the table.
run suite-vulkan 100 "$exe" probe --backend vulkan --json --out "$out/suite-vulkan.json" --quiet
if "$exe" devices --json 2>/dev/null | grep -q '"backend": *"cuda"'; then
  run suite-cuda 120 "$exe" probe --backend cuda --json --out "$out/suite-cuda.json" --quiet
  # The same card, each tensor its own cuMemAlloc: the gap to suite-cuda's batch row is what
  # PyTorch's segments cost there.
  run batch-cuda-direct 60 "$exe" probe --backend cuda --allocator direct --scenario batch --json --out "$out/batch-cuda-direct.json" --quiet
  run compare 10 "$exe" compare "$out/suite-vulkan.json" "$out/suite-cuda.json" --format markdown --out "$out/compare.md"
fi
# The spill check forced on a fit near the boundary (it runs by itself only when a step's peak
# is at least half the card): the first and last buffers timed, VK_EXT_memory_budget read.
OOMPROBE_SPILL_CHECK=always run spill-vulkan 40 "$exe" probe --backend vulkan --scenario params --json --out "$out/spill-vulkan.json" --quiet
echo "logs in $out"
