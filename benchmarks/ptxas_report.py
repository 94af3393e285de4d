"""Registers, spills and stack of mambalab's selective-scan kernels for a GPU architecture, on any machine.

Compiles the kernels ahead of time for a target (default sm_90, the H100/H200) with Triton's own compiler
and runs the ptxas that ships with Triton in verbose mode. No GPU needed: this is how to see, from a CPU
machine, whether a tile configuration spills or how many registers (hence how few warps per SM) it takes
before spending GPU time on it. The launches are the launchers' own (:func:`mambalab.aot.record_launches`,
recorded through Triton's interpreter instead of run), compiled in a child process with the interpreter off
(:func:`mambalab.aot.compile_in_subprocess`).

    python benchmarks/ptxas_report.py [--arch 90] [--dtype bf16]
"""
from __future__ import annotations

import argparse
import dataclasses
import sys

from mambalab import aot  # first: importing mambalab switches Triton's interpreter on, before triton loads
import torch

from mambalab.kernels import selective_scan as kernels

SHAPE = (2048, 16, 8192)   # (d, n, l), one group of B/C: the shape the tiles are reported at


def forward_backward(dtype: torch.dtype, cfg: kernels.TileConfig) -> None:
    """The launchers' forward and backward with tiles ``cfg`` (D, z, delta_bias, softplus), b = 1: launches
    recorded, not run (nothing reads the results)."""
    d, n, l = SHAPE
    act = lambda *shape: torch.randn(*shape, dtype=dtype)
    u, delta, z, B, C = act(1, d, l), act(1, d, l), act(1, d, l), act(1, 1, n, l), act(1, 1, n, l)
    A, D, bias = -torch.rand(d, n), torch.randn(d), torch.randn(d)
    out, _, saved, _ = kernels.selective_scan_fwd(u, delta, A, B, C, D, z, bias, True, cfg=cfg)
    kernels.selective_scan_bwd(out, u, delta, A, B, C, D, z, bias, True, saved, cfg)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", type=int, default=90)
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    args = p.parse_args()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    rule = kernels.tile_config(*SHAPE)
    two = dataclasses.replace(rule, block_d=2, bwd_block_d=2)   # 2 channels a program, forward and backward
    rows = [("forward, the rule", "selective_scan_fwd_kernel", rule),
            ("forward, 2 channels", "selective_scan_fwd_kernel", two),
            ("backward, the rule", "selective_scan_bwd_kernel", rule),
            ("backward, 2 channels", "selective_scan_bwd_kernel", two)]
    launches = []
    for _, name, cfg in rows:
        recorded = aot.record_launches(forward_backward, dtype, cfg)
        launches.append(next(launch for launch in recorded if launch.name == name))
    print(f"selective scan, d/g={SHAPE[0]}, n={SHAPE[1]}, {args.dtype}, sm_{args.arch}")
    for (row, _, _), c in zip(rows, aot.compile_in_subprocess(launches, args.arch, keep_ptx=True)):
        if c.error:
            sys.exit(f"{c.launch.kernel} does not compile for sm_{args.arch}:\n{c.error}")
        k = c.launch.constexprs
        print(f"  {row:22s} BLOCK_D={k['BLOCK_D']} BLOCK_L={k['BLOCK_L']:4d} "
              f"warps={c.launch.options['num_warps']}: {aot.ptxas_usage(c.ptx, args.arch)}")


if __name__ == "__main__":
    sys.exit(main())
