#!/usr/bin/env bash
# Install slurm_autosp and its dependencies into the current Python environment.
# torch first, pinned to a CPU build where no GPU is present; DeepSpeed compiles against it
# (hence --no-build-isolation) with its CUDA ops built just in time, not at install.
set -euo pipefail
cd "$(dirname "$0")"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
python -m pip install -q $TORCH_SPEC  # e.g. TORCH_SPEC="torch==2.13.0 --index-url <your CUDA wheel index>"
# --no-build-isolation builds with the environment's own backend: a fresh venv's setuptools
# (65 on Python 3.11, which some torch releases leave as is) cannot build a wheel
python -m pip install -q "setuptools>=70.1" wheel
DS_BUILD_OPS=0 python -m pip install -q --no-build-isolation -e '.[test]'
python -c "import torch, deepspeed, submitit, omegaconf, transformers, tensorboard; print(f'slurm_autosp installed: torch {torch.__version__}, deepspeed {deepspeed.__version__}')"
