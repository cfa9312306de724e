#!/usr/bin/env bash
# Creates the validation venv OUTSIDE the repository and installs torch, torchvision,
# transformers, peft, bitsandbytes, accelerate and lightning from PyPI into it. Never used by CI: the
# committed fixtures (tests/fixtures/validation.json, ...) are what the Rust tests read.
#
#   validation/setup.sh                      # venv at $HOME/.cache/oomprobe-validation-venv
#   OOMPROBE_VENV=/some/dir validation/setup.sh
#   "$OOMPROBE_VENV/bin/python" validation/measure.py
#   "$OOMPROBE_VENV/bin/python" validation/measure_lora.py   # LoRA / QLoRA rows (peft, bitsandbytes)
#
# PyPI's Linux torch wheel depends on the CUDA runtime wheels (cuBLAS, cuDNN, NCCL, ...): the
# venv is about 5.6 GiB. A `pip install --no-deps torch` is 1.3 GiB but `import torch` then fails
# (torch preloads libcublasLt at import even on a CPU-only machine), so the full set is installed.
# The CPU-only wheel index is not on PyPI.
set -euo pipefail

VENV="${OOMPROBE_VENV:-$HOME/.cache/oomprobe-validation-venv}"
PYTHON="${PYTHON:-python3}"
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

case "$(cd "$(dirname "$VENV")" 2>/dev/null && pwd)/" in
  "$REPO"/*) echo "setup.sh: OOMPROBE_VENV must be outside the repository ($REPO)" >&2; exit 2 ;;
esac

# The versions the committed fixture was measured with.
TORCH="${OOMPROBE_TORCH:-torch==2.15.0}"
TORCHVISION="${OOMPROBE_TORCHVISION:-torchvision==0.29.2}"
TRANSFORMERS="${OOMPROBE_TRANSFORMERS:-transformers==5.24.0}"
# LoRA / QLoRA (validation/measure_lora.py -> tests/fixtures/finetune/lora_measured.json). peft needs
# accelerate; bitsandbytes' CPU backend quantizes and runs Linear4bit on this machine's CPU.
PEFT="${OOMPROBE_PEFT:-peft==0.21.2}"
BITSANDBYTES="${OOMPROBE_BITSANDBYTES:-bitsandbytes==0.50.2}"
ACCELERATE="${OOMPROBE_ACCELERATE:-accelerate==1.15.0}"
# Lightning's own BatchSizeFinder for the end-to-end batch table (validation/batch_finder.py).
LIGHTNING="${OOMPROBE_LIGHTNING:-lightning==2.6.6}"

if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
  "$VENV/bin/pip" install --quiet --upgrade pip
fi
"$VENV/bin/pip" install --quiet "$TORCH" "$TORCHVISION" "$TRANSFORMERS"
"$VENV/bin/pip" install --quiet "$PEFT" "$BITSANDBYTES" "$ACCELERATE"
"$VENV/bin/pip" install --quiet "$LIGHTNING"
"$VENV/bin/python" - <<'PY'
import torch, torchvision, transformers, peft, bitsandbytes, accelerate, lightning
x = torch.randn(4, 4, requires_grad=True)
(x @ x).sum().backward()
print(f"validation venv ready: torch {torch.__version__}, torchvision {torchvision.__version__}, "
      f"transformers {transformers.__version__}, peft {peft.__version__}, "
      f"bitsandbytes {bitsandbytes.__version__}, accelerate {accelerate.__version__}, "
      f"lightning {lightning.__version__}")
PY
echo "run: $VENV/bin/python $REPO/validation/measure.py"
echo "     $VENV/bin/python $REPO/validation/measure_lora.py"
