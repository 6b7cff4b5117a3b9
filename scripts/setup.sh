#!/usr/bin/env bash
# Create .venv with gpt_tp (editable) and its test extras, from scratch.
# TORCH_SPEC picks the PyTorch build: the default torch==2.13.0 is the CPU wheel on machines whose pip
# finds it locally (as here); on a GPU machine from PyPI it is the CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q "${TORCH_SPEC:-torch==2.13.0}"  # first, so nothing pulls a multi-GB CUDA build
.venv/bin/python -m pip install -q -e ".[dev]"
