"""The cost of determinism, and who agrees with whom, for Mamba-2's SSD on a GPU, in one run.

At the benchmark shape (b=4, l=4096, h=32, p=64, g=1, n=128, chunk 256), for bf16 and fp32, forward+backward:

* time (median, CUDA events) of mambalab's ``ssd_chunk_scan`` with ``reduction="deterministic"`` and
  ``"atomic"``, mamba-ssm's ``mamba_chunk_scan_combined`` in its default mode and with
  ``set_deterministic_mode(True)`` switched on after import; and, each in a fresh process, mamba-ssm with
  ``MAMBA_DETERMINISTIC=1`` set before import, with ``TRITON_CACHE_AUTOTUNING=1`` added, and the default mode
  under ``CUDA_LAUNCH_BLOCKING=1``;
* distinct gradient bit patterns over ``--runs`` repeated backward passes, for each of those;
* gradient fingerprints under ``mambalab.determinism.emulate`` of every profile, for mambalab's deterministic
  mode (expected: one per gradient) and mamba-ssm's deterministic mode (its dB/dC split reads the SM count).

Writes ``determinism.json`` into the directory given (ratios are against mamba-ssm's default mode):

    python benchmarks/bench_determinism.py OUT_DIR [--runs 10] [--dtypes bf16 fp32]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import mambalab  # noqa: E402,F401  (before triton)
from common import distinct_patterns, environment, write  # noqa: E402
from mambalab import oracle  # noqa: E402
from mambalab.determinism import ARCH_PROFILES, emulate, fingerprint  # noqa: E402
from mambalab.determinism.ssd_variation import ssd_gradients, ssd_inputs, time_ssd_fwd_bwd  # noqa: E402

SHAPE, CHUNK = (4, 4096, 32, 64, 1, 128), 256
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# variants run in a fresh process: the variables are read at import (mamba-ssm) or at CUDA's start
FRESH = {
    "mamba_ssm_MAMBA_DETERMINISTIC=1": {"MAMBA_DETERMINISTIC": "1"},
    "mamba_ssm_MAMBA_DETERMINISTIC=1+TRITON_CACHE_AUTOTUNING=1": {"MAMBA_DETERMINISTIC": "1",
                                                                  "TRITON_CACHE_AUTOTUNING": "1"},
    "mamba_ssm_default_CUDA_LAUNCH_BLOCKING=1": {"CUDA_LAUNCH_BLOCKING": "1"},
}


def measure(inputs, impl, runs, reduction=None, mamba_det=None):
    """Time and distinct patterns of one variant."""
    mode = oracle.module("utils.determinism")
    ms = time_ssd_fwd_bwd(inputs, CHUNK, impl=impl, reduction=reduction, mamba_ssm_deterministic=mamba_det)
    if mamba_det is not None:
        mode.set_deterministic_mode(mamba_det)
    try:
        grads = [ssd_gradients(inputs, CHUNK, impl=impl, reduction=reduction) for _ in range(runs)]
    finally:
        if mamba_det is not None:
            mode.set_deterministic_mode(None)
    return {"fwd_bwd_ms": ms, "distinct_grad_patterns": distinct_patterns(grads)}


def emulated_fingerprints(inputs, impl, reduction=None, mamba_det=None):
    """{profile: {gradient: fingerprint}} under emulate() of every profile."""
    mode = oracle.module("utils.determinism")
    if mamba_det is not None:
        mode.set_deterministic_mode(mamba_det)
    try:
        out = {}
        for key in ARCH_PROFILES:
            with emulate(key):
                grads = ssd_gradients(inputs, CHUNK, impl=impl, reduction=reduction)
            out[key] = {k: fingerprint(v) for k, v in grads.items()}
        return out
    finally:
        if mamba_det is not None:
            mode.set_deterministic_mode(None)


def differing(prints, a, b):
    return [k for k in prints[a] if prints[a][k] != prints[b][k]]


def child(dtype, runs):
    """In a fresh process (environment set by the parent): mamba-ssm in whatever mode its variables say."""
    inputs = ssd_inputs(*SHAPE, dtype=DTYPES[dtype], device="cuda")
    print(json.dumps(measure(inputs, "mamba_ssm", runs)))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--dtypes", nargs="+", default=["bf16", "fp32"], choices=sorted(DTYPES))
    ap.add_argument("--child", choices=sorted(DTYPES), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_determinism.py needs a CUDA GPU")
    if args.child:
        return child(args.child, args.runs)
    result = {"environment": environment(), "shape_blhpgn": SHAPE, "chunk_size": CHUNK, "runs": args.runs,
              "note": "ratios: fwd_bwd_ms / mamba-ssm default's; fingerprints: 16 hex of the exact bits",
              "dtypes": {}}
    for dtype in args.dtypes:
        inputs = ssd_inputs(*SHAPE, dtype=DTYPES[dtype], device="cuda")
        r = {
            "mambalab_deterministic": measure(inputs, "mambalab", args.runs, reduction="deterministic"),
            "mambalab_atomic": measure(inputs, "mambalab", args.runs, reduction="atomic"),
            "mamba_ssm_default": measure(inputs, "mamba_ssm", args.runs, mamba_det=False),
            "mamba_ssm_deterministic_after_import": measure(inputs, "mamba_ssm", args.runs, mamba_det=True),
        }
        for name, env in FRESH.items():
            proc = subprocess.run([sys.executable, __file__, str(args.out_dir), "--child", dtype, "--runs",
                                   str(args.runs)], env={**os.environ, **env}, capture_output=True, text=True)
            r[name] = (json.loads(proc.stdout.strip().splitlines()[-1]) if proc.returncode == 0
                       else {"error": proc.stderr[-2000:]})
        base = r["mamba_ssm_default"]["fwd_bwd_ms"]
        for v in r.values():
            if "fwd_bwd_ms" in v:
                v["ratio_to_mamba_ssm_default"] = v["fwd_bwd_ms"] / base
        r["cost_of_determinism"] = {
            "mambalab": r["mambalab_deterministic"]["fwd_bwd_ms"] / r["mambalab_atomic"]["fwd_bwd_ms"],
            "mamba_ssm_after_import": r["mamba_ssm_deterministic_after_import"]["fwd_bwd_ms"] / base,
        }
        ml = emulated_fingerprints(inputs, "mambalab", reduction="deterministic")
        ms = emulated_fingerprints(inputs, "mamba_ssm", mamba_det=True)
        r["emulated_fingerprints"] = {"mambalab_deterministic": ml, "mamba_ssm_deterministic": ms}
        r["emulated_summary"] = {
            "mambalab_deterministic_distinct_per_gradient": {k: len({p[k] for p in ml.values()}) for k in ml["h200"]},
            "mamba_ssm_deterministic_rtx4090_vs_rtxa6000_differ": differing(ms, "rtx4090", "rtxa6000"),
            "mamba_ssm_deterministic_h200_vs_rtx4090_differ": differing(ms, "h200", "rtx4090"),
            "mamba_ssm_deterministic_h200_vs_l4_differ": differing(ms, "h200", "l4"),
        }
        result["dtypes"][dtype] = r
        print(dtype, json.dumps({k: v for k, v in r.items() if k != "emulated_fingerprints"}, indent=1))
    write(args.out_dir / "determinism.json", result)


if __name__ == "__main__":
    main()
