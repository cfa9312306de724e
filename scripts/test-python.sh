#!/usr/bin/env bash
# The Python side: build the wheel (maturin, bindings = "bin": the Rust binary plus
# python/oomprobe), install it into a fresh venv, run `oomprobe --version` and one estimate from
# there, then the pytest suite (python/tests) against what the wheel installed. No torch: the
# hooks' tests use stubs. Everything lives under target/python (build venv, wheels, test venv).
#
#   scripts/test-python.sh            # called by scripts/test.sh after cargo test
set -euo pipefail
cd "$(dirname "$0")/.."

say() { echo "scripts/test-python.sh: $*" >&2; }
PYTHON="${PYTHON:-python3}"
MATURIN="maturin>=1.5,<2.0"
PYTEST="pytest>=7,<10"
ROOT=target/python
BUILD_VENV="$ROOT/build-venv"
TEST_VENV="$ROOT/test-venv"
WHEELS="$ROOT/wheels"

if ! "$PYTHON" -m venv --help >/dev/null 2>&1 || ! "$PYTHON" -c 'import ensurepip' 2>/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    say "no venv module: installing python3-venv"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq && apt-get install -y -qq python3-venv >/dev/null
  else
    say "no venv module for $PYTHON; run: sudo apt-get install -y python3-venv"
    exit 1
  fi
fi

# The build tools, once (kept between runs).
if [ ! -x "$BUILD_VENV/bin/maturin" ]; then
  say "making the build venv ($MATURIN)"
  "$PYTHON" -m venv "$BUILD_VENV"
  "$BUILD_VENV/bin/pip" install -q --disable-pip-version-check "$MATURIN"
fi

# The wheel, from this tree (the dev profile reuses cargo test's build).
rm -rf "$WHEELS"
"$BUILD_VENV/bin/maturin" build --quiet --profile dev --out "$WHEELS" >&2
wheel=$(ls "$WHEELS"/oomprobe-*.whl)
say "built $(basename "$wheel")"

# A fresh venv each run: the wheel, and nothing of this tree, is what it sees.
rm -rf "$TEST_VENV"
"$PYTHON" -m venv "$TEST_VENV"
"$TEST_VENV/bin/pip" install -q --disable-pip-version-check "$wheel" "$PYTEST"
unset OOMPROBE
"$TEST_VENV/bin/oomprobe" --version
"$TEST_VENV/bin/oomprobe" estimate --model tiny-gpt --memory 1GiB > "$ROOT/estimate.txt"
head -1 "$ROOT/estimate.txt"
"$TEST_VENV/bin/python" -c 'import oomprobe; print("import oomprobe:", oomprobe.__file__, oomprobe.version())'
# From inside the venv's folder, so `import oomprobe` cannot find python/oomprobe in this tree.
tests="$PWD/python/tests"
cd "$TEST_VENV"
OOMPROBE_WHEEL_TEST=1 bin/python -m pytest -q -p no:cacheprovider "$tests"
