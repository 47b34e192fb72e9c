#!/usr/bin/env bash
# The first GPU evidence in one command, on one GPU (or the first of a node's, the collective
# bandwidth across all of them): the exactness of the kernels in bf16 against fp32, the memory
# plan against the measured peak, step time, tokens/s and MFU, and the longest sequence per
# checkpointing policy, as one table; `python -m slurm_autosp gpu-check --help` and
# docs/probe.md ("The GPU check") say what each row is and what passing means.
#
#   TORCH_SPEC=<CUDA or ROCm wheel> ./install.sh && bench/gpu_check.sh
#   OUT=runs/gpu_check bench/gpu_check.sh           # where gpu_check.json goes (the default)
#
# Exit status 0 only if every correctness row passes. Without a GPU it stops at once with
# "gpu_check: no GPU visible ..." (exit 2); the output of an earlier run is removed first.
set -euo pipefail
cd "$(dirname "$0")/.."
exec python -m slurm_autosp gpu-check --out "${OUT:-runs/gpu_check}" "$@"
