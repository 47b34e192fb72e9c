#!/usr/bin/env bash
# Install slurm_autosp and its dependencies into the current Python environment.
# torch first, pinned to a CPU build where no GPU is present; DeepSpeed compiles against it
# (hence --no-build-isolation) with its CUDA ops built just in time, not at install.
#
#   ./install.sh                                   # from the package index (TORCH_SPEC: torch)
#   ./install.sh --download DIR [--no-torch] [--python-version 3.12] [--have FREEZE]
#                [--extra view] [--max-mib N]      # a wheelhouse of what is installed here
#   ./install.sh --offline DIR [--extra view]      # from that wheelhouse, no package index
#
# The plain install has the test extra, which holds the view extra (TensorBoard, matplotlib).
# --download writes the versions installed and tested here as wheels (after a plain
# ./install.sh; tools/wheelhouse.py --help): what a training job needs, plus TensorBoard and
# matplotlib with --extra view (which --offline DIR --extra view then installs); --no-torch
# leaves torch to the target, --have what the target's `python -m pip freeze` satisfies.
set -euo pipefail
cd "$(dirname "$0")"
check() {
    python -c "import torch, deepspeed, submitit, omegaconf, transformers, tensorboardX, peft; print(f'slurm_autosp installed: torch {torch.__version__}, deepspeed {deepspeed.__version__}')"
}
case "${1:-}" in
    --download)
        shift
        exec python tools/wheelhouse.py "$@"
        ;;
    --offline)
        [ -d "${2:-}" ] || { echo "install.sh --offline DIR: no wheelhouse directory '${2:-}'" >&2; exit 2; }
        package=slurm_autosp
        if [ "${3:-}" = --extra ] && [ -n "${4:-}" ] && [ -z "${5:-}" ]; then
            package="slurm_autosp[$4]"
        elif [ -n "${3:-}" ]; then
            echo "install.sh --offline DIR [--extra NAME]: not understood: '${*:3}'" >&2
            exit 2
        fi
        PIP_NO_INDEX=1 python -m pip install -q --no-index --find-links "$2" "$package"
        check
        exit
        ;;
    "") ;;
    *)
        echo "install.sh: unknown argument '$1' (--download DIR [...] | --offline DIR [--extra NAME])" >&2
        exit 2
        ;;
esac
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
python -m pip install -q $TORCH_SPEC  # e.g. TORCH_SPEC="torch==2.13.0 --index-url <your CUDA wheel index>"
# --no-build-isolation builds with the environment's own backend: a fresh venv's setuptools
# (65 on Python 3.11, which some torch releases leave as is) cannot build a wheel
python -m pip install -q "setuptools>=70.1" wheel
DS_BUILD_OPS=0 python -m pip install -q --no-build-isolation -e '.[test]'
check
