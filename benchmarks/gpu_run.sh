#!/usr/bin/env bash
# The prepared run for one NVIDIA GPU (about 9 minutes): ML-1M quality runs (the
# SASRec+ recipe's grid, all at once), fast GPU tests, loss_bench dense / xla /
# pallas_gpu at V = 131k and 1M, the trainer step at the paper's V. JSON under OUT_DIR.
#
#   bash benchmarks/gpu_run.sh [OUT_DIR]    # default runs/gpu_run
#
# Needs a Python with jax (CUDA) and the project's dependencies ($PYTHON, default
# python3); ML-1M's wheels copied to runs/data_cache/wheels beforehand (see
# benchmarks/gpu_run.py).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-runs/gpu_run}"
PYTHON="${PYTHON:-python3}"
mkdir -p "$OUT"
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || true
exec timeout 540 "$PYTHON" benchmarks/gpu_run.py device --out "$OUT" 2>&1 | tee "$OUT/log.txt"
