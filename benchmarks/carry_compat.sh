#!/usr/bin/env bash
# What gpu_run.sh's ccd-ext, compat, compat-speed and compat-tests steps carry beyond ../shared/gpu-wheels.sh:
# causal-conv1d's sdist (.carry/causal_conv1d-1.5.2.tar.gz, compiled there by benchmarks/mamba_cuda_ext.py) and
# transformers' wheel as the project pins it (.carry/transformers/: the GPU image's transformers is older).
#   usage, from the project root, after ./run.sh setup:  bash benchmarks/carry_compat.sh
set -euo pipefail
PY=${PYTHON:-.venv/bin/python}
mkdir -p .carry/transformers
# pip reads an sdist's metadata by running its setup.py, which imports torch: the venv's, without its CUDA build
ls .carry/causal_conv1d-1.5.2.tar.gz >/dev/null 2>&1 || CAUSAL_CONV1D_SKIP_CUDA_BUILD=TRUE CAUSAL_CONV1D_FORCE_BUILD=TRUE \
  "$PY" -m pip download -q --no-deps --no-binary :all: --no-build-isolation causal-conv1d==1.5.2 -d .carry
version=$("$PY" -c 'import importlib.metadata as m; print(m.version("transformers"))')
"$PY" -m pip download -q --no-deps --only-binary=:all: "transformers==$version" -d .carry/transformers
du -sh .carry
