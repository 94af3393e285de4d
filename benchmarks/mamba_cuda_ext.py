"""Compile mamba-ssm's Mamba-1 CUDA extension (``selective_scan_cuda``), our rival in benchmarks, on a machine
with nvcc, from the sources in mamba-ssm's sdist (``pip download --no-deps --no-binary :all:
mamba-ssm==2.3.2.post1``), for one GPU architecture only (a few minutes instead of an hour).

Call :func:`build` before anything imports mamba_ssm (``mambalab.oracle`` then finds the real extension).
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


if __name__ == "__main__":
    # python benchmarks/mamba_cuda_ext.py SDIST [BUILD_DIR]: build once; later build() calls with the same
    # BUILD_DIR load the finished extension instead of compiling again.
    print(f"built selective_scan_cuda in {build(sys.argv[1], build_dir=(sys.argv[2:] or [None])[0]):.0f} s")
