#!/usr/bin/env bash
# Builds the fused CPU decode attention (csrc/) into veloxquant_mlx/ops/ with the venv's
# MLX and nanobind. Usage: scripts/build_native.sh [python]; a failure leaves the library
# on MLX's ops (slower on a CPU, same results) and says so.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${1:-.venv/bin/python}"
PY="$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")"  # absolute: cmake runs elsewhere
build="${VELOXQUANT_BUILD_DIR:-build/native}"
mkdir -p "$(dirname "$build")"
if cmake -S csrc -B "$build" -DPython_EXECUTABLE="$PY" -DCMAKE_BUILD_TYPE=Release >"$build.log" 2>&1 \
   && cmake --build "$build" -j 2 >>"$build.log" 2>&1; then
  cp "$build"/_native*.so veloxquant_mlx/ops/
  echo "setup: built the fused CPU kernel (veloxquant_mlx/ops/$(basename "$build"/_native*.so))"
else
  echo "setup: could not build the fused CPU kernel (log: $build.log); attention runs on MLX's ops"
fi
