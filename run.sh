#!/usr/bin/env bash
# mambalab's one entry point. Sets everything up in ./.venv (idempotent), then runs a job:
#   ./run.sh workbook   execute every notebook headless into build/, render them as offline HTML
#   ./run.sh test       run the test suite over two pytest-xdist workers (unit tests, every notebook)
#   ./run.sh setup      only set up
#   ./run.sh lab        open JupyterLab on the notebooks
# Knobs (environment): MAMBALAB_VENV (default .venv; "none" installs into the python already active,
# e.g. a conda env made from environment.yml), PYTHON (default python3),
# MAMBALAB_TORCH_CPU_VERSION (default 2.13.0), MAMBALAB_BUILD_MAMBA_CUDA=1 (compile mamba-ssm's CUDA
# extension on a machine with nvcc; minutes).
set -euo pipefail
cd "$(dirname "$0")"
job=${1:-help}
shift || true

MAMBA_SSM_VERSION=2.3.2.post1
TORCH_CPU_VERSION=${MAMBALAB_TORCH_CPU_VERSION:-2.13.0}
TRITON_CPU_VERSION=3.6.0

activate() {
  local venv=${MAMBALAB_VENV:-.venv}
  if [ "$venv" != none ]; then
    if [ ! -x "$venv/bin/python" ]; then "${PYTHON:-python3}" -m venv "$venv"; fi
    # shellcheck disable=SC1091
    . "$venv/bin/activate"
  fi
}

has_gpu() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }

setup() {
  activate
  local stamp fingerprint
  stamp="$(python -c 'import sys; print(sys.prefix)')/.mambalab-setup"
  fingerprint=$(cat pyproject.toml run.sh | cksum)
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$fingerprint" ]; then return 0; fi
  python -m pip install -q --upgrade pip setuptools wheel
  if ! python -c 'import torch' >/dev/null 2>&1; then
    if has_gpu; then
      python -m pip install -q "torch>=2.4"              # CUDA build; it brings its own triton
    else
      echo "[mambalab] no GPU: installing the CPU build of torch $TORCH_CPU_VERSION and triton $TRITON_CPU_VERSION"
      # The CPU build lives on PyTorch's own index; its dependencies come from PyPI in the second step.
      # Where that index cannot be reached, the default index's torch of that version (a machine that keeps its
      # CPU wheel on disk serves it from there; elsewhere it is the larger CUDA build, which runs on a CPU too).
      python -m pip install -q --no-deps "torch==$TORCH_CPU_VERSION" --index-url https://download.pytorch.org/whl/cpu \
        --retries 1 --timeout 15 || python -m pip install -q --no-deps "torch==$TORCH_CPU_VERSION"
      python -m pip install -q "torch==$TORCH_CPU_VERSION" "triton==$TRITON_CPU_VERSION"
    fi
  fi
  if ! python -c 'import importlib.metadata as m; m.version("mamba-ssm")' >/dev/null 2>&1; then
    # mamba-ssm ships only an sdist whose setup.py needs torch at build time (so no build isolation) and
    # crashes on a CPU torch unless told to skip its CUDA extension. mambalab.oracle copes with the
    # missing extension at import time.
    python -m pip install -q ninja einops packaging
    local skip=TRUE
    if [ "${MAMBALAB_BUILD_MAMBA_CUDA:-0}" = 1 ]; then skip=FALSE; fi
    MAMBA_FORCE_BUILD=TRUE MAMBA_SKIP_CUDA_BUILD=$skip \
      python -m pip install -q --no-build-isolation "mamba-ssm==$MAMBA_SSM_VERSION"
  fi
  python -m pip install -q -e ".[dev]"
  echo "$fingerprint" >"$stamp"
}

case "$job" in
  setup) setup ;;
  test)
    setup
    # two workers (CI's cores); each notebook's tests form one work unit (tests/conftest.py). -n 0: one process
    python -m pytest -n 2 --dist loadscope "$@"
    ;;
  workbook)
    setup
    python -m mambalab workbook "$@"
    ;;
  lab)
    setup
    exec python -m jupyter lab notebooks "$@"
    ;;
  *)
    sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//'
    [ "$job" = help ] || exit 2
    ;;
esac
