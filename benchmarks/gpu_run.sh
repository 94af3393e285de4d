#!/usr/bin/env bash
# What we run on a lent GPU machine (no network there): install the carried wheels, compile mamba-ssm's
# CUDA extension (our rival) in the background, run the GPU tests, then the benchmarks.
#   carried: .whl/ (mamba-ssm's wheel built with MAMBA_SKIP_CUDA_BUILD=TRUE; papermill, plotly, ipywidgets,
#            ipykernel, nbconvert and their missing dependencies) and .carry/ (mamba-ssm's sdist)
#   usage:   bash benchmarks/gpu_run.sh STEP...   with STEP in: tests, bench (with the tile sweep), notebooks
set -uo pipefail
OUT=${OUT:-build/gpu}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
SDIST=$(ls .carry/mamba_ssm-*.tar.gz)
EXT_DIR=/tmp/mamba_ext
nvidia-smi -L
(python3 benchmarks/mamba_cuda_ext.py "$SDIST" "$EXT_DIR" >"$OUT/ext_build.log" 2>&1; echo "ext build rc=$?" >>"$OUT/ext_build.log") &
build_pid=$!
for step in "$@"; do
  case $step in
    tests) timeout 300 python3 -m pytest -q -x -p no:cacheprovider tests/test_selective_scan.py 2>&1 | tail -15 ;;
    bench) wait $build_pid; python3 benchmarks/bench_selective_scan.py --sweep --mamba-sdist "$SDIST" \
             --mamba-build-dir "$EXT_DIR" --out "$OUT/selective_scan.json" ;;
    notebooks) python3 -m mambalab workbook --output-dir "$OUT/workbook" ;;
    *) echo "unknown step $step" ;;
  esac
done
wait
tail -3 "$OUT/ext_build.log"
