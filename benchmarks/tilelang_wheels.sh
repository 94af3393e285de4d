#!/usr/bin/env bash
# Download TileLang and its dependencies for the GPU machine (Python 3.12, x86-64 Linux; it has no network), for
# mamba-ssm's MIMO kernels (mamba_ssm.ops.tilelang, which mamba-ssm 2.3.2 runs on tilelang==0.1.8, its pin).
# Together they exceed one device call's carry limit (64 MiB), so they land in two folders:
#   .carry/tilelang-a   tilelang itself (~43 MB)
#   .carry/tilelang-b   its dependencies (~34 MB; z3-solver is most of it)
# On the GPU machine: one call carrying .carry/tilelang-a runs `SKIP_EXT=1 bash benchmarks/gpu_run.sh tilelang-a`,
# and the next call, within the 30 s the machine stays warm, carries .whl and .carry/tilelang-b and runs e.g.
# `SKIP_EXT=1 STEP_TIMEOUT=570 bash benchmarks/gpu_run.sh tilelang-b mamba3-bench` (mamba-ssm's MIMO kernels timed
# too, once tilelang-b finds them importable; about 5.5 min: TileLang compiles each MIMO kernel for 30-60 s) or
# `... tilelang-b mamba3-tests` (about 4.5 min).
# apache-tvm-ffi 0.1.9 exactly: tilelang 0.1.8 allows any 0.1.x, but 0.1.10 and later break it (its TVM sets
# attributes on objects that tvm-ffi now gives __slots__; see state-spaces/mamba#907), and 0.1.15 failed its
# import on an H200 (2026-12-01: "attribute '__dict__' of 'type' objects is not writable").
set -euo pipefail
cd "$(dirname "$0")/.."
PIP=${PIP:-.venv/bin/pip}
platform=(--python-version 3.12 --only-binary=:all: --no-deps --platform manylinux_2_28_x86_64
          --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64)
"$PIP" download -q "${platform[@]}" -d .carry/tilelang-a "tilelang==0.1.8"
"$PIP" download -q "${platform[@]}" -d .carry/tilelang-b "apache-tvm-ffi==0.1.9" torch-c-dlpack-ext cloudpickle \
  ml-dtypes psutil "z3-solver>=4.13.0,<4.15.5"
du -sh .carry/tilelang-a .carry/tilelang-b
