#!/usr/bin/env bash
# Runs groups of benchmarks/gpu_run.sh steps side by side on one lent GPU machine, one lane (a background
# process) per group, each logging to its own folder $OUT/laneN: for tests and notebooks, which check
# values, not times, so that one device call covers them all. Never for benchmarks: lanes share the GPU.
# The first lane compiles mamba-ssm's CUDA extension as gpu_run.sh does (put the steps that need it there,
# after others); the rest skip the build.
#   usage:  bash benchmarks/gpu_lanes.sh "STEP STEP ..." "STEP ..." ...
set -uo pipefail
OUT=${OUT:-build/gpu}
mkdir -p "$OUT"
SKIP_EXT=1 OUT="$OUT/setup" bash benchmarks/gpu_run.sh >"$OUT/setup.log" 2>&1 || { cat "$OUT/setup.log"; exit 1; }
pids=()
n=0
for lane in "$@"; do
  n=$((n + 1))
  skip=1; [ "$n" = 1 ] && skip=0
  # shellcheck disable=SC2086  # a lane's steps are words
  SKIP_EXT=$skip OUT="$OUT/lane$n" bash benchmarks/gpu_run.sh $lane >"$OUT/lane$n.log" 2>&1 &
  pids+=($!)
done
for i in "${!pids[@]}"; do
  wait "${pids[$i]}"
  echo "--- lane$((i + 1)) ($OUT/lane$((i + 1)).log)"
  grep -v "^GPU 0" "$OUT/lane$((i + 1)).log"
done
