#!/usr/bin/env bash
# Regenerate the PTX embedded in the binary (shaders/ptx/<op>_<storage>.ptx) from shaders/*.cu.
# Run after editing any .cu file, and commit the result; CI fails while the files are stale
# (tests/it/backend/cuda/nvrtc.rs, committed_ptx_is_what_the_sources_compile_to).
#
# Needs NVRTC, the release the files were generated with (another release emits other code):
#   pip install nvidia-cuda-nvrtc-cu12==12.9.86
# The PTX targets compute_50 and its `.version` line is pinned to 7.0 (see
# src/backend/cuda/ptx.rs for why both are safe and what driver they need).
set -euo pipefail
cd "$(dirname "$0")/.."
OOMPROBE_REGEN_PTX=1 scripts/nvrtc-check.sh committed_ptx_is_what_the_sources_compile_to
ls -l shaders/ptx
