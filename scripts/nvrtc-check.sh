#!/usr/bin/env bash
# Compile every CUDA kernel (shaders/*.cu, every storage type) to PTX with NVRTC and print the
# PTX sizes. Needs no GPU, only NVRTC: `pip install nvidia-cuda-nvrtc-cu12`. The pip package
# puts libnvrtc.so.12 under site-packages/nvidia/cuda_nvrtc/lib, which cudarc's dlopen only
# finds on LD_LIBRARY_PATH (or set OOMPROBE_NVRTC to the file or its directory); this script
# exports it when it finds the package.
set -euo pipefail
cd "$(dirname "$0")/.."
nvrtc_lib=$(python3 -c 'import nvidia.cuda_nvrtc as m; print(list(m.__path__)[0] + "/lib")' 2>/dev/null || true)
if [ -n "${nvrtc_lib}" ] && [ -d "${nvrtc_lib}" ]; then
  export LD_LIBRARY_PATH="${nvrtc_lib}${LD_LIBRARY_PATH:+:${LD_LIBRARY_PATH}}"
fi
exec nice -n 10 cargo test --test it "$@" -- backend::cuda::nvrtc:: --nocapture --test-threads=1
