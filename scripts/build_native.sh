#!/usr/bin/env bash
# Rebuilds the fused CPU decode attention (csrc/) in place with the venv's MLX and nanobind:
# the build `pip install -e .` runs (setup.py, mlx.extension.CMakeBuild), kept as a
# shortcut. Usage: scripts/build_native.sh [python]; a failure leaves the library on MLX's
# ops (slower on a CPU, same results) and says so.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${1:-.venv/bin/python}"
build="${VELOXQUANT_BUILD_DIR:-build/native}"
mkdir -p "$(dirname "$build")"
if "$PY" setup.py -q build_ext --inplace -t "$build" -b "$build/lib" >"$build.log" 2>&1 \
   && ! grep -q "veloxquant_mlx: the fused CPU attention kernel was not" "$build.log"; then
  echo "setup: built the fused CPU kernel (veloxquant_mlx/ops/$(cd veloxquant_mlx/ops && ls _native*.so))"
else  # setup.py's warning: why, and whether an earlier build stays
  why="$(grep -o "the fused CPU attention kernel was not.*" "$build.log" | head -n 1 || true)"
  [ -n "$why" ] || why="could not build the fused CPU kernel; attention runs on MLX's ops"
  echo "setup: $why (log: $build.log)"
fi

