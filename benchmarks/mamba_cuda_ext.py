"""Compile our rivals' CUDA extensions on a machine with nvcc, for one GPU architecture only (minutes instead of
an hour): mamba-ssm's Mamba-1 scan (``selective_scan_cuda``, from mamba-ssm's sdist) and the ``causal_conv1d``
package (``causal_conv1d_cuda`` and its Python files, from its sdist, causal_conv1d-1.5.2.tar.gz), which mamba-ssm's
``Mamba2`` and ``Mamba`` blocks need for their default (fused) training paths.

Call :func:`build` before anything imports mamba_ssm (``mambalab.oracle`` then finds the real extension); a build
folder that later processes put on ``PYTHONPATH`` holds each finished module.
"""
from __future__ import annotations

import os
import sys
import tarfile
import tempfile
import time
from pathlib import Path


def build(sdist: str, arch: str | None = None, build_dir: str | None = None) -> float:
    """Build and register ``selective_scan_cuda``; returns the build time in seconds."""
    import torch
    from torch.utils.cpp_extension import load

    if arch is None:
        major, minor = torch.cuda.get_device_capability()
        arch = f"{major}{minor}"
    work = Path(build_dir or tempfile.mkdtemp(prefix="mamba_ext_"))
    work.mkdir(parents=True, exist_ok=True)
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers() if "/csrc/selective_scan/" in m.name]
        tar.extractall(work, members=members)
    src = next(work.glob("*/csrc/selective_scan"))
    sources = [str(src / "selective_scan.cpp")] + sorted(str(p) for p in src.glob("selective_scan_*.cu"))
    os.environ.setdefault("MAX_JOBS", str(os.cpu_count() or 4))
    start = time.perf_counter()
    module = load(
        name="selective_scan_cuda",
        sources=sources,
        extra_cflags=["-O3", "-std=c++17"],
        extra_cuda_cflags=[
            "-O3", "-std=c++17", "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__",
            "-U__CUDA_NO_BFLOAT16_OPERATORS__", "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
            "-U__CUDA_NO_BFLOAT162_OPERATORS__", "-U__CUDA_NO_BFLOAT162_CONVERSIONS__",
            "--expt-relaxed-constexpr", "--expt-extended-lambda", "--use_fast_math",
            f"-gencode=arch=compute_{arch},code=sm_{arch}",
        ],
        extra_include_paths=[str(src)],
        build_directory=str(work),
        verbose=False,
    )
    sys.modules["selective_scan_cuda"] = module
    return time.perf_counter() - start


def build_causal_conv1d(sdist: str, build_dir: str, arch: str | None = None) -> float:
    """Build ``causal_conv1d_cuda`` into ``build_dir`` and unpack the ``causal_conv1d`` package beside it (so
    ``PYTHONPATH=build_dir`` imports both); returns the build time in seconds."""
    import torch
    from torch.utils.cpp_extension import load

    if arch is None:
        major, minor = torch.cuda.get_device_capability()
        arch = f"{major}{minor}"
    work = Path(build_dir)
    work.mkdir(parents=True, exist_ok=True)
    with tarfile.open(sdist) as tar:
        tar.extractall(work, members=[m for m in tar.getmembers() if "/csrc/" in m.name or "/causal_conv1d/" in m.name])
    root = next(p for p in work.glob("causal_conv1d-*") if p.is_dir())
    package = work / "causal_conv1d"
    if not package.exists():
        (root / "causal_conv1d").rename(package)
    src = root / "csrc"
    os.environ.setdefault("MAX_JOBS", str(os.cpu_count() or 4))
    start = time.perf_counter()
    load(name="causal_conv1d_cuda", sources=[str(src / f) for f in ("causal_conv1d.cpp", "causal_conv1d_fwd.cu",
                                                                     "causal_conv1d_bwd.cu", "causal_conv1d_update.cu")],
         extra_cflags=["-O3", "-std=c++17"],
         extra_cuda_cflags=["-O3", "-std=c++17", "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__",
                            "-U__CUDA_NO_BFLOAT16_OPERATORS__", "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
                            "-U__CUDA_NO_BFLOAT162_OPERATORS__", "-U__CUDA_NO_BFLOAT162_CONVERSIONS__",
                            "--expt-relaxed-constexpr", "--expt-extended-lambda", "--use_fast_math",
                            f"-gencode=arch=compute_{arch},code=sm_{arch}"],
         extra_include_paths=[str(src)], build_directory=str(work), verbose=False)
    return time.perf_counter() - start


if __name__ == "__main__":
    # python benchmarks/mamba_cuda_ext.py SDIST [BUILD_DIR]: build once; later build() calls with the same
    # BUILD_DIR load the finished extension instead of compiling again.
    # python benchmarks/mamba_cuda_ext.py --causal-conv1d SDIST BUILD_DIR: the causal_conv1d package.
    if sys.argv[1] == "--causal-conv1d":
        print(f"built causal_conv1d_cuda in {build_causal_conv1d(sys.argv[2], sys.argv[3]):.0f} s")
    else:
        print(f"built selective_scan_cuda in {build(sys.argv[1], build_dir=(sys.argv[2:] or [None])[0]):.0f} s")
