#!/usr/bin/env bash
# The whole test suite: unit, integration (on the first wgpu adapter: lavapipe without a GPU),
# the NVRTC compile check of every CUDA kernel, and a build of the benches.
# Needs a Vulkan driver (apt-get install -y mesa-vulkan-drivers libvulkan1) and NVRTC
# (pip install nvidia-cuda-nvrtc-cu12); .ci/run installs both.
set -euo pipefail
cd "$(dirname "$0")/.."

# Let the CUDA backend find a pip-installed NVRTC (nvidia/cuda_nvrtc/lib in site-packages).
nvrtc_lib=$(python3 - <<'PY' 2>/dev/null || true
import glob, os, site, sys
roots = site.getsitepackages() + [site.getusersitepackages()]
for root in roots:
    for d in glob.glob(os.path.join(root, "nvidia", "cuda_nvrtc", "lib")):
        print(d); sys.exit(0)
PY
)
if [ -n "${nvrtc_lib}" ]; then
  export LD_LIBRARY_PATH="${nvrtc_lib}${LD_LIBRARY_PATH:+:${LD_LIBRARY_PATH}}"
fi

cargo test --all-targets "$@"
