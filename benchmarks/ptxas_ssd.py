"""Compile time, registers and spills of every kernel launch of mambalab's SSD (or Mamba-3: ``--op mamba3``)
forward and backward, for a GPU architecture, on a machine without a GPU.

Step 1 (a child process, Triton's interpreter on): runs ``ssd_chunk_scan`` forward and backward at the
benchmark's head shape (h, p, n, chunk) on a short CPU sequence with every launch *recorded instead of run*:
which kernel, its constexpr values, the dtypes of its pointer arguments, num_warps, and which arguments a
launch would mark divisible by 16 (aligned pointers, integers divisible by 16). Tiles come from the shape
rule alone, so a short sequence compiles the same kernels as a long one.
Step 2 (this process, interpreter off): compiles each recorded launch with Triton's compiler for the target
and runs the ptxas shipped with Triton in verbose mode.

    python benchmarks/ptxas_ssd.py [--arch 90] [--dtype bf16] [--shape H P N CHUNK] [--op mamba3 --rank R]

Both steps import mambalab from this checkout (the directory above benchmarks/), not an installed copy, so a
git worktree compiles its own kernels.
"""
from __future__ import annotations

import argparse
import importlib
import inspect
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # this checkout's mambalab


def record(dtype: str, h: int, p: int, n: int, chunk: int, reduction: str, op: str = "ssd", rank: int = 1) -> list[dict]:
    """Run in a child: the launches of one forward+backward, recorded and not executed."""
    import mambalab  # noqa: F401  (switches the interpreter on)
    import torch
    import triton.runtime.interpreter as interp

    launches = []

    def run(self, *args, grid, warmup, **kwargs):
        sig = inspect.signature(self.fn)
        bound = dict(zip(self.arg_names, args)) | {k: v for k, v in kwargs.items() if k in sig.parameters}
        entry = {"module": self.fn.__module__, "name": self.fn.__name__, "num_warps": kwargs.get("num_warps", 4),
                 "num_stages": kwargs.get("num_stages", 3),
                 "constexprs": {}, "types": {}, "divisible": []}
        for name, param in sig.parameters.items():
            value = bound.get(name, param.default)
            if "constexpr" in str(param.annotation):
                entry["constexprs"][name] = value
            elif isinstance(value, torch.Tensor):
                if value.data_ptr() % 16 == 0:   # as Triton's launcher: a 16-byte aligned pointer
                    entry["divisible"].append(name)
                entry["types"][name] = "*" + {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16",
                                              torch.int32: "i32", torch.int64: "i64"}[value.dtype]
            elif isinstance(value, bool):
                entry["types"][name] = "i1"
            elif isinstance(value, int):
                if value % 16 == 0:              # as Triton's launcher: an integer divisible by 16
                    entry["divisible"].append(name)
                entry["types"][name] = "i32"
            elif isinstance(value, float):
                entry["types"][name] = "fp32"
            else:
                entry["constexprs"][name] = value  # None: an absent optional pointer
        launches.append(entry)

    interp.InterpretedFunction.run = run
    # Feed the kernels what a GPU would (bf16/fp16 stay as they are; on the CPU they are widened to fp32).
    mambalab.device.compute_dtype = lambda dtype, device: dtype
    mambalab.device.dot_precision = lambda dtype, device: "tf32"
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
    return launches


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", type=int, default=90)
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    p.add_argument("--shape", type=int, nargs=4, default=[32, 64, 128, 256], metavar=("H", "P", "N", "CHUNK"))
    p.add_argument("--reduction", default="deterministic", choices=["deterministic", "atomic"])
    p.add_argument("--op", default="ssd", choices=["ssd", "mamba3"])
    p.add_argument("--rank", type=int, default=1, help="Mamba-3's MIMO rank r (--op mamba3)")
    p.add_argument("--record", action="store_true", help=argparse.SUPPRESS)  # the child's job
    args = p.parse_args()
    if args.record:
        print(json.dumps(record(args.dtype, *args.shape, args.reduction, args.op, args.rank)))
        return
    child = subprocess.run([sys.executable, __file__, "--record", "--dtype", args.dtype, "--reduction",
                            args.reduction, "--op", args.op, "--rank", str(args.rank), "--shape",
                            *map(str, args.shape)], capture_output=True, text=True)
    if child.returncode:
        sys.exit(child.stderr)
    launches = json.loads(child.stdout.strip().splitlines()[-1])

    os.environ["TRITON_INTERPRET"] = "0"
    import triton
    from triton.backends.compiler import GPUTarget

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from ptxas_report import ptxas_usage

    h, hp, n, chunk = args.shape
    what = "SSD" if args.op == "ssd" else f"Mamba-3 r={args.rank}"
    print(f"{what} {args.reduction}, h={h} p={hp} n={n} chunk={chunk}, {args.dtype}, sm_{args.arch}")
    seen = set()
    for entry in launches:
        key = json.dumps(entry, sort_keys=True)
        if key in seen:
            continue
        seen.add(key)
        fn = getattr(importlib.import_module(entry["module"]), entry["name"])
        params = list(inspect.signature(fn.fn).parameters)
        signature = {q: ("constexpr" if q in entry["constexprs"] else entry["types"][q]) for q in params}
        # the launcher's specialisation: without it the compiler cannot vectorise and picks other layouts
        attrs = {(params.index(q),): [["tt.divisibility", 16]] for q in entry["divisible"]}
        src = triton.compiler.ASTSource(fn=fn, signature=signature, attrs=attrs,
                                        constexprs={(params.index(k),): v for k, v in entry["constexprs"].items()})
        start = time.perf_counter()
        kernel = triton.compile(src, target=GPUTarget("cuda", args.arch, 32),
                                options={"num_warps": entry["num_warps"], "num_stages": entry["num_stages"]})
        ptx = kernel.asm["ptx"]
        seconds = time.perf_counter() - start
        blocks = {k: v for k, v in entry["constexprs"].items() if k.startswith("BLOCK")}
        shared = kernel.metadata.shared
        print(f"  {entry['name']:34s} warps={entry['num_warps']} {blocks}\n"
              f"  {'':34s} {ptxas_usage(ptx, args.arch)}, {shared / 1024:.0f} KiB shared memory, "
              f"compiled to PTX in {seconds:.1f} s")


if __name__ == "__main__":
    main()
