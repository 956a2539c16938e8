#!/usr/bin/env bash
# One command for a machine with a CUDA GPU (issue 28): the feature matrix on CUDA with NCCL at world size 1,
# the fused optimizers (Adam/LAMB/Lion) against torch and their HBM roofline, one summary table at the end.
# About 5-8 minutes on one GPU (most of it compiling the three fused ops with nvcc, once).
#   tests/gpu/run.sh            # from the repository root, after `make setup`
# Without a CUDA device it prints a one-row SKIP table and exits 0. Exit status 1 when a check failed.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY="${PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || PY=python3
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}"
exec timeout "${DSCORE_GPU_TIMEOUT:-900}" "$PY" tests/gpu/gpu_matrix.py "$@"
