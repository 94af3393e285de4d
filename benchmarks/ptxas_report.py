"""Registers, spills and stack of mambalab's selective-scan kernels for a GPU architecture, on any machine.

Compiles the kernels ahead of time for a target (default sm_90, the H100/H200) with Triton's own compiler
and runs the ptxas that ships with Triton in verbose mode. No GPU needed: this is how to see, from a CPU
machine, whether a tile configuration spills or how many registers (hence how few warps per SM) it takes
before spending GPU time on it.

    python benchmarks/ptxas_report.py [--arch 90] [--dtype bf16]
"""
from __future__ import annotations

import argparse
import glob
import inspect
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"  # compile for real, even on a machine without a GPU
import triton  # noqa: E402  (must precede mambalab, which would otherwise switch the interpreter on)
from triton.backends.compiler import GPUTarget  # noqa: E402

from mambalab.kernels import selective_scan as kernels  # noqa: E402

ACTIVATIONS = {"u_ptr", "delta_ptr", "B_ptr", "C_ptr", "z_ptr", "out_ptr", "dout_ptr", "du_ptr", "ddelta_ptr",
               "dz_ptr"}


def compile_ptx(fn, constexprs: dict, num_warps: int, arch: int, dtype: str, divisible=("d", "n", "l")) -> str:
    """PTX of ``fn`` as a launch would compile it: pointers and the sizes in ``divisible`` marked divisible by
    16, as Triton's launcher specialises them for shapes like the benchmarks' (without that mark the
    compiler cannot vectorise loads, and picks other register layouts)."""
    params = list(inspect.signature(fn.fn).parameters)
    signature = {}
    for p in params:
        if p in constexprs:
            signature[p] = "constexpr"
        elif p.endswith("_ptr"):
            signature[p] = f"*{dtype}" if p in ACTIVATIONS else "*fp32"
        else:
            signature[p] = "i32"
    attrs = {(params.index(p),): [["tt.divisibility", 16]] for p in params
             if p not in constexprs and (p.endswith("_ptr") or p in divisible)}
    src = triton.compiler.ASTSource(fn=fn, signature=signature, attrs=attrs,
                                    constexprs={(params.index(k),): v for k, v in constexprs.items()})
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps}).asm["ptx"]


def ptxas_usage(ptx: str, arch: int) -> str:
    ptxas = glob.glob(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas"))[0]
    suffix = "a" if arch == 90 else ""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "k.ptx"
        path.write_text(ptx)
        res = subprocess.run([ptxas, f"-arch=sm_{arch}{suffix}", "-v", str(path), "-o", str(Path(tmp) / "k.cubin")],
                             capture_output=True, text=True, check=True)
    regs = re.search(r"Used (\d+) registers", res.stderr)
    spill = re.search(r"(\d+) bytes spill stores", res.stderr)
    return f"{int(regs.group(1)):4d} registers, {int(spill.group(1)):5d} bytes spilled"


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", type=int, default=90)
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    args = p.parse_args()
    rule = kernels.tile_config(2048, 16, 8192)
    common = dict(HAS_D=True, HAS_Z=True, HAS_BIAS=True, SOFTPLUS=True, BLOCK_N=rule.block_n)
    rows = [("forward, the rule", kernels.selective_scan_fwd_kernel, rule.block_d, rule.block_l, rule.num_warps),
            ("forward, 2 channels", kernels.selective_scan_fwd_kernel, 2, rule.block_l, rule.num_warps),
            ("backward, the rule", kernels.selective_scan_bwd_kernel, rule.bwd_block_d, rule.bwd_block_l,
             rule.bwd_num_warps),
            ("backward, 2 channels", kernels.selective_scan_bwd_kernel, 2, rule.bwd_block_l, rule.bwd_num_warps)]
    print(f"selective scan, d/g=2048, n=16, {args.dtype}, sm_{args.arch}")
    for name, fn, block_d, block_l, warps in rows:
        consts = dict(common, BLOCK_D=block_d, BLOCK_L=block_l)
        if fn is kernels.selective_scan_fwd_kernel:
            consts.update(CKPT_L=rule.bwd_block_l, SAVE_Y=True)
        usage = ptxas_usage(compile_ptx(fn, consts, warps, args.arch, args.dtype), args.arch)
        print(f"  {name:22s} BLOCK_D={block_d} BLOCK_L={block_l:4d} warps={warps}: {usage}")


if __name__ == "__main__":
    sys.exit(main())
