#!/usr/bin/env bash
# Set up specd in ./.venv: torch first (CPU build unless an NVIDIA GPU is present),
# then the project with its test extras. Idempotent; safe to re-run.
#
# Why torch first: the project pins torch==2.13.0, and on Linux PyPI's wheel for
# that version is the multi-GB CUDA build. On a machine without a GPU we install
# the CPU build explicitly (local version 2.13.0+cpu), which then satisfies the pin.
# GPU users: either let this script see `nvidia-smi`, or install the CUDA build
# yourself first (`pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128`).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
# --no-compile: pip compiles each installed file to bytecode one at a time; the
# venv is compiled once at the end with every core instead (the same files,
# about a quarter less set-up time on a 2-core machine).
pip_q() { python -m pip install -q --disable-pip-version-check --no-compile "$@"; }

if ! python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "setup: GPU found, installing the CUDA build of torch 2.13.0"
    pip_q "torch==2.13.0"
  else
    echo "setup: no GPU, installing the CPU build of torch 2.13.0"
    # A local wheel/find-links copy is used when present; else PyTorch's CPU index.
    pip_q "torch==2.13.0+cpu" 2>/dev/null || \
      pip_q "torch==2.13.0+cpu" --extra-index-url https://download.pytorch.org/whl/cpu
  fi
fi
pip_q -e ".[test,bench]"
# Like pip, ignore files that do not compile (torch ships some in newer Python syntax).
python -m compileall -q -j 0 "$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" >/dev/null || true
python -c "import torch; print('setup: torch', torch.__version__, 'cuda' if torch.cuda.is_available() else 'cpu')"
