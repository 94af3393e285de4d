"""What the Mamba-3 decode step kernel issues, counted in its sm_90 machine code, on a machine without a GPU.

The step kernel (:mod:`mambalab.kernels.mamba3.step`) has no loops: its rank loops are ``tl.static_range``, so
every program runs its SASS once, top to bottom (the first p-block also runs the stores of k̂ and θ'). So
SASS instructions × warps a program × programs is the count of warp instructions a step issues, and Nsight
Compute's "issue slots busy" can be read against it. This script records the launcher's own launch at a shape
(:func:`mambalab.aot.record_launches`), compiles it for sm_90 with Triton's compiler
(:func:`mambalab.aot.compile_in_subprocess`), assembles the PTX with the ptxas that ships with Triton and lists
the machine code with its cuobjdump (:func:`mambalab.aot.sass`), then counts the instructions by kind:

    fp32 math    FFMA FMUL FADD FMNMX (the state update and the read-out: 1 + 3r multiplies a state element)
    special      MUFU (exp, sin, cos, reciprocals of the sigmoids), DMUL (sin and cos's range reduction)
    memory       LDG STG LDS STS LDL STL ... (global, shared and local loads and stores)
    shuffles     SHFL (the read-out's sums over n across lanes)
    moves        MOV PRMT SEL F2F I2F F2I HFMA2 ... (register moves, conversions, selects, constants)
    integer      IMAD IADD3 LEA SHF LOP3 ISETP ... (addresses, masks, predicates)
    control      BRA EXIT BAR NOP ...

    python benchmarks/sass_mamba3_step.py [--batch 64] [--shape H P G N A] [--ranks 1 2 4] [--out FILE]
    python benchmarks/sass_mamba3_step.py --against-sweep benchmarks/results/2026-12-03_h200_mamba3_step_sweep_flat.json

The second form counts every configuration a GPU sweep timed, at its batch and heads and --shape's P G N A (the
default, p64 g1 n128 a32, is the 2026-12-03 sweep's), beside its time.

Both steps import mambalab from this checkout (the directory above benchmarks/).
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # this checkout's mambalab

from mambalab import aot  # noqa: E402  (first: importing mambalab switches the interpreter on, before triton)
import torch  # noqa: E402

KINDS = {
    "fp32 math": ("FFMA", "FMUL", "FADD", "FMNMX", "FSETP", "FSEL", "FCHK", "FRND"),
    "special": ("MUFU", "DMUL", "DFMA", "DADD"),   # and sin/cos's fp64 range reduction
    "memory": ("LDG", "STG", "LDS", "STS", "LDSM", "LDC", "ULDC", "LD", "ST", "RED", "ATOM", "LDL", "STL"),
    "shuffles": ("SHFL",),
    "moves": ("MOV", "UMOV", "HFMA2", "PRMT", "SEL", "F2F", "I2F", "F2I", "I2FP", "F2FP", "S2R", "S2UR", "CS2R", "R2UR",
              "MOVM"),
    "integer": ("IMAD", "IADD3", "IADD", "LEA", "SHF", "LOP3", "ISETP", "IABS", "IMNMX", "UIMAD", "UIADD3", "ULEA",
                "USHF", "ULOP3", "UISETP", "PLOP3", "P2R", "R2P", "POPC", "FLO", "BMSK", "SGXT", "VIADD", "UIMNMX",
                "IMUL", "USEL", "UPRMT"),
    "control": ("BRA", "EXIT", "BAR", "NOP", "BSSY", "BSYNC", "WARPSYNC", "CALL", "RET", "DEPBAR", "YIELD",
                "VOTE", "VOTEU", "ELECT", "ACQBULK", "BPT"),
}
KIND_OF = {op: kind for kind, ops in KINDS.items() for op in ops}
# "/*0090*/                   @!P0 FFMA R3, R2, R5, R3 ;" -> FFMA
INSTRUCTION = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9]*)(?:\.[A-Z0-9_.]+)?\b")


def step_launch(batch: int, h: int, p: int, g: int, n: int, a: int, r: int, config: dict | None = None):
    """The step's one launch at this shape, recorded (bf16 token inputs, fp32 state, D and z, as the benchmark's
    ``bench_mamba3.step_inputs``), and its grid; ``config`` replaces ``step_config``'s choice (BLOCK_P,
    num_warps, FLAT, STREAM)."""
    from mambalab.ops import mamba3_step
    from mambalab.kernels.mamba3 import step as step_kernel
    from mambalab.ref.mamba3 import zero_state

    bf = lambda *s: torch.randn(*s).bfloat16()
    dt = torch.rand(batch, h) + 0.1
    mimo = {k: torch.rand(h, r, p) for k in ("mimo_v", "mimo_z", "mimo_o")} if r > 1 else {}
    args = dict(q=bf(batch, r, g, n), k=bf(batch, r, g, n), v=bf(batch, h, p), adt=-dt, dt=dt,
                trap=torch.rand(batch, h), q_bias=torch.randn(h, r, n), k_bias=torch.randn(h, r, n),
                angles=torch.randn(batch, h, a), D=torch.randn(h), z=bf(batch, h, p), **mimo)
    rule = step_kernel.step_config
    cfg = dict(config) if config is not None else rule(batch, h, p, r)
    step_kernel.step_config = lambda *_: dict(cfg)
    try:
        launches = aot.record_launches(lambda: mamba3_step(zero_state(batch, h, p, n, r, a, torch.float32, "cpu"),
                                                           **args))
    finally:
        step_kernel.step_config = rule
    assert len(launches) == 1, [x.kernel for x in launches]
    programs = batch * h * -(-p // cfg["BLOCK_P"])
    return launches[0], programs, cfg["num_warps"]


def counts(sass: str) -> collections.Counter:
    """Instructions of a SASS listing by opcode (predicated ones included)."""
    return collections.Counter(INSTRUCTION.findall(sass))


def by_kind(ops: collections.Counter) -> dict[str, int]:
    kinds = collections.Counter()
    for op, c in ops.items():
        kinds[KIND_OF.get(op, "other")] += c
    return dict(sorted(kinds.items(), key=lambda kv: -kv[1]))


def count_step(batch, h, p, g, n, a, r, arch=90, config=None) -> dict:
    """The counts of one launch (the rule's, or ``config``): instructions a warp, warp instructions a step, kinds,
    top opcodes, registers."""
    launch, programs, warps = step_launch(batch, h, p, g, n, a, r, config)
    [compiled] = aot.compile_in_subprocess([launch], arch, keep_ptx=True)
    if compiled.error:
        sys.exit(f"r = {r}: {compiled.error}")
    usage, listing = aot.sass(compiled.ptx, arch)
    ops = counts(listing)
    total = sum(ops.values())
    return dict(r=r, programs=programs, warps_per_program=warps, sass_instructions=total,
                warp_instructions_per_step=total * warps * programs,
                warp_instructions_per_1k_state_elements=round(1000 * total * warps * programs / (batch * h * p * n), 1),
                kinds=by_kind(ops), top_opcodes=dict(ops.most_common(12)),
                registers=usage.registers)


def against_sweep(path: str, shape: tuple[int, int, int, int], arch: int) -> list[dict]:
    """Each configuration a step sweep measured on a GPU (``bench_mamba3.py step-sweep``'s JSON: r, batch,
    heads, BLOCK_P, num_warps, FLAT, STREAM, us; rows of a layout the kernel no longer has are skipped), counted
    here beside its time at the sweep's batch and heads and ``shape`` (p, g, n, a: the file does not record them),
    so that the count can be read as a predictor of the time before a GPU is at hand."""
    data = json.loads(Path(path).read_text())
    rows = []
    for m in data["rows"]:
        if "r" not in m or m.get("RANK_TILE"):
            continue
        cfg = {k: m[k] for k in ("BLOCK_P", "num_warps", "FLAT", "STREAM")}
        row = count_step(m["batch"], m["heads"], *shape, m["r"], arch, cfg)
        rows.append(dict(config=cfg, us=m["us"], **{k: row[k] for k in ("r", "sass_instructions",
                                                                          "warp_instructions_per_step", "registers")}))
        print(f"r = {m['r']} {cfg}: {row['warp_instructions_per_step'] / 1e6:6.2f} M warp instructions, "
              f"{row['registers']} registers; measured {m['us']:.1f} us", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--shape", type=int, nargs=5, default=[32, 64, 1, 128, 32], metavar=("H", "P", "G", "N", "A"),
                        help="heads, head dimension, groups, state size, angle pairs (default: the decode benchmark's)")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--arch", type=int, default=90)
    parser.add_argument("--out", help="a JSON file for the counts")
    parser.add_argument("--against-sweep", metavar="JSON",
                        help="count each configuration of a GPU step sweep's JSON instead, beside its measured time")
    args = parser.parse_args()
    h, p, g, n, a = args.shape
    if args.against_sweep:
        rows = against_sweep(args.against_sweep, (p, g, n, a), args.arch)
        if args.out:
            Path(args.out).write_text(json.dumps(dict(
                command="python benchmarks/sass_mamba3_step.py " + " ".join(sys.argv[1:]), arch=f"sm_{args.arch}a",
                triton=__import__("triton").__version__, rows=rows), indent=1) + "\n")
        return
    rows = []
    for r in args.ranks:
        row = count_step(args.batch, h, p, g, n, a, r, args.arch)
        rows.append(row)
        print(f"r = {r}: {row['sass_instructions']} SASS instructions a warp, {row['warps_per_program']} warp(s) x "
              f"{row['programs']} programs = {row['warp_instructions_per_step'] / 1e6:.2f} M warp instructions a "
              f"step; {row['registers']} registers")
        print("   by kind: " + ", ".join(f"{k} {v}" for k, v in row["kinds"].items()))
        print("   top:     " + ", ".join(f"{k} {v}" for k, v in row["top_opcodes"].items()))
    if args.out:
        Path(args.out).write_text(json.dumps(dict(
            command="python benchmarks/sass_mamba3_step.py " + " ".join(sys.argv[1:]),
            shape=dict(batch=args.batch, h=h, p=p, g=g, n=n, a=a), arch=f"sm_{args.arch}a",
            triton=__import__("triton").__version__, rows=rows), indent=1) + "\n")


if __name__ == "__main__":
    main()
