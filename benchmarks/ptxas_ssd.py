"""Compile time, registers and spills of every kernel launch of mambalab's SSD (or Mamba-3: ``--op mamba3``)
forward and backward, for a GPU architecture, on a machine without a GPU.

Step 1 (this process, Triton's interpreter on): runs ``ssd_chunk_scan`` forward and backward at the
benchmark's head shape (h, p, n, chunk) on a short CPU sequence with every launch *recorded instead of run*
(:func:`mambalab.aot.record_launches`): which kernel, its constexpr values, its arguments' types and which of
them a GPU launch would mark divisible by 16, num_warps. Tiles come from the shape rule alone, so a short
sequence compiles the same kernels as a long one.
Step 2 (a child process, interpreter off: :func:`mambalab.aot.compile_in_subprocess`): compiles each distinct
recorded launch with Triton's compiler for the target; then the ptxas shipped with Triton runs on each PTX in
verbose mode (:func:`mambalab.aot.ptxas_usage`). Each kernel's line also counts its loops and the loads Triton's
software pipeliner made asynchronous: a loop with none issues each iteration's loads only after the previous
iteration's arithmetic (``tl.range(..., num_stages=...)`` asks for pipelining; the angle cumsum
and the rotary backward were found that way).

    python benchmarks/ptxas_ssd.py [--arch 90] [--dtype bf16] [--shape H P N CHUNK] [--op mamba3 --rank R]

Both steps import mambalab from this checkout (the directory above benchmarks/), not an installed copy, so a
git worktree compiles its own kernels.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # this checkout's mambalab

from mambalab import aot  # noqa: E402  (first: importing mambalab switches the interpreter on, before triton)
import torch  # noqa: E402


def forward_backward(dtype: str, h: int, p: int, n: int, chunk: int, reduction: str, op: str = "ssd",
                     rank: int = 1) -> None:
    """One forward and backward of the op on a sequence of two chunks (b = g = 1)."""
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    b, l, g = 1, 2 * chunk, 1
    if op == "mamba3":
        from mambalab.ops import mamba3_chunk_scan

        r, a = rank, n // 4
        act = lambda *shape: torch.randn(*shape).to(dt).requires_grad_()
        par = lambda *shape: torch.randn(*shape).requires_grad_()
        step = torch.rand(b, l, h) + 0.1
        mimo = {k: par(h, r, p) for k in ("mimo_v", "mimo_z", "mimo_o")} if r > 1 else {}
        out = mamba3_chunk_scan(act(b, l, r, g, n), act(b, l, r, g, n), act(b, l, h, p), -step, step,
                                torch.rand(b, l, h), par(h, r, n), par(h, r, n), par(b, l, h, a), par(h),
                                act(b, l, h, p), **mimo, chunk_size=chunk, reduction=reduction)
    else:
        from mambalab.ops import ssd_chunk_scan

        x = torch.randn(b, l, h, p).to(dt).requires_grad_()
        out = ssd_chunk_scan(x, torch.rand(b, l, h).to(dt), -torch.rand(h), torch.randn(b, l, g, n).to(dt),
                             torch.randn(b, l, g, n).to(dt), chunk, D=torch.randn(h), dt_bias=torch.randn(h),
                             dt_softplus=True, reduction=reduction)
    out.backward(torch.ones_like(out))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", type=int, default=90)
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    p.add_argument("--shape", type=int, nargs=4, default=[32, 64, 128, 256], metavar=("H", "P", "N", "CHUNK"))
    p.add_argument("--reduction", default="deterministic", choices=["deterministic", "atomic"])
    p.add_argument("--op", default="ssd", choices=["ssd", "mamba3"])
    p.add_argument("--rank", type=int, default=1, help="Mamba-3's MIMO rank r (--op mamba3)")
    args = p.parse_args()
    launches = aot.record_launches(forward_backward, args.dtype, *args.shape, args.reduction, args.op, args.rank)
    compiled = aot.compile_in_subprocess(launches, args.arch, keep_ptx=True)

    h, hp, n, chunk = args.shape
    what = "SSD" if args.op == "ssd" else f"Mamba-3 r={args.rank}"
    print(f"{what} {args.reduction}, h={h} p={hp} n={n} chunk={chunk}, {args.dtype}, sm_{args.arch}")
    for c in compiled:
        if c.error:
            sys.exit(f"{c.launch.kernel} does not compile for sm_{args.arch}:\n{c.error}")
        warps = c.launch.options.get("num_warps", 4)
        blocks = {k: v for k, v in c.launch.constexprs.items() if k.startswith("BLOCK")}
        print(f"  {c.launch.name:34s} warps={warps} {blocks}\n"
              f"  {'':34s} {aot.ptxas_usage(c.ptx, args.arch)}, {c.shared / 1024:.0f} KiB shared memory, "
              f"{c.loops} loops, {c.async_copies} async copies, compiled to PTX in {c.seconds:.1f} s")


if __name__ == "__main__":
    main()
