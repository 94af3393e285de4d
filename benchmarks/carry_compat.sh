#!/usr/bin/env bash
# What gpu_run.sh's ccd-ext, compat, compat-speed and compat-tests steps carry beyond ../shared/gpu-wheels.sh:
# causal-conv1d's sdist (.carry/causal_conv1d-1.5.2.tar.gz, compiled there by benchmarks/mamba_cuda_ext.py) and
# transformers as the project pins it, with the wheels of its dependencies for the GPU machine's Python 3.12 on
# x86_64 (.carry/transformers/, about 30 MB: the GPU image's transformers is older, and its huggingface-hub
# 1.33 fails transformers 5.25's import check, which needs >= 2.4); numpy and torch's own dependencies are left
# to the image.
#   usage, from the project root, after ./run.sh setup:  bash benchmarks/carry_compat.sh
set -euo pipefail
PY=${PYTHON:-.venv/bin/python}
mkdir -p .carry/transformers
# pip reads an sdist's metadata by running its setup.py, which imports torch: the venv's, without its CUDA build
ls .carry/causal_conv1d-1.5.2.tar.gz >/dev/null 2>&1 || CAUSAL_CONV1D_SKIP_CUDA_BUILD=TRUE CAUSAL_CONV1D_FORCE_BUILD=TRUE \
  "$PY" -m pip download -q --no-deps --no-binary :all: --no-build-isolation causal-conv1d==1.5.2 -d .carry
pins=$("$PY" -c 'import importlib.metadata as m; print(*(f"{p}=={m.version(p)}" for p in ("transformers", "huggingface_hub")))')
rm -f .carry/transformers/*.whl
"$PY" -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 $pins -d .carry/transformers
rm -f .carry/transformers/{numpy,filelock,fsspec,typing_extensions,packaging,pygments}-*.whl
du -sh .carry
