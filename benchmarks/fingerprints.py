"""Fingerprints seen on this GPU: ``mambalab fingerprint``'s fixed step (deterministic
and atomic, repeated; deterministic under every emulated profile), and mamba-ssm's SSD backward in its
deterministic mode at the benchmark shape under emulated GPUs (dB and dC differ where its split by SM count does).

    python benchmarks/fingerprints.py --out DIR/fingerprints.json [--repeats 5]

What to expect: the deterministic step gives one fingerprint over repeats and profiles; the atomic step
several over repeats (real GPU scheduling; gradients of A_log, dt_bias, D are sums over programs); mamba-ssm
(deterministic mode, autotuning pinned) one dB/dC pattern per profile and different ones between profiles
whose heads-per-program differ (RTX 4090 and H200 vs RTX A6000 and L4), mambalab's one pattern throughout.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import torch  # noqa: E402

import mambalab  # noqa: E402,F401
from common import environment, write  # noqa: E402
from mambalab import oracle  # noqa: E402
from mambalab.determinism import ARCH_PROFILES, deterministic, emulate, fingerprint  # noqa: E402
from mambalab.determinism.step import run_step  # noqa: E402
from mambalab.ops import ssd_chunk_scan  # noqa: E402

BENCH_SHAPE = (4, 4096, 32, 64, 1, 128)   # b, l, h, p, g, n; chunk 256, bf16


def step_fingerprints(repeats: int) -> dict:
    det = [run_step(reduction="deterministic") for _ in range(repeats)]
    atomic = [run_step(reduction="atomic") for _ in range(repeats)]
    emulated = {key: run_step(reduction="deterministic", emulate_profile=key)["fingerprint"] for key in ARCH_PROFILES}
    per_param = lambda runs: {k: len({r["parameters"][k] for r in runs}) for k in runs[0]["parameters"]}
    return {
        "deterministic": [r["fingerprint"] for r in det],
        "atomic": [r["fingerprint"] for r in atomic],
        "deterministic_distinct_per_parameter": per_param(det),
        "atomic_distinct_per_parameter": per_param(atomic),
        "deterministic_emulated": emulated,
        "distinct_deterministic_overall": len({r["fingerprint"] for r in det} | set(emulated.values())),
        "report": det[0],
    }


def ssd_grads(fn, inp, dout, **kw):
    leaves = {k: v.detach().clone().requires_grad_() for k, v in inp.items()}
    out = fn(leaves["x"], leaves["dt"], leaves["A"], leaves["B"], leaves["C"], 256, D=leaves["D"],
             dt_bias=leaves["dt_bias"], dt_softplus=True, **kw)
    out.backward(dout)
    return {k: fingerprint(v.grad) for k, v in leaves.items()}


def mamba_ssm_vs_mambalab(repeats: int) -> dict:
    b, l, h, p, g, n = BENCH_SHAPE
    gen = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=gen)
    inp = {"x": r(b, l, h, p).bfloat16(), "dt": (0.5 * r(b, l, h) - 1.0).bfloat16(), "A": -torch.exp(0.5 * r(h)),
           "B": r(b, l, g, n).bfloat16(), "C": r(b, l, g, n).bfloat16(), "D": r(h), "dt_bias": 0.1 * r(h)}
    inp = {k: v.cuda() for k, v in inp.items()}
    dout = r(b, l, h, p).bfloat16().cuda()
    combined = oracle.module("ops.triton.ssd_combined").mamba_chunk_scan_combined
    result = {}
    with deterministic():   # mamba-ssm's deterministic mode; autotuning pinned, so only the SM count differs
        for key, prof in ARCH_PROFILES.items():
            with emulate(key):
                theirs = [ssd_grads(combined, inp, dout) for _ in range(repeats)]
                ours = [ssd_grads(ssd_chunk_scan, inp, dout) for _ in range(2)]
            c = -(-l // 256)
            result[key] = {
                "sm_count": prof.sm_count,
                "mamba_ssm_heads_per_program": max(min(-(-b * c * h // prof.sm_count), h // g), 1),
                "mamba_ssm": theirs[0], "mamba_ssm_repeats_identical": all(t == theirs[0] for t in theirs),
                "mambalab": ours[0], "mambalab_repeats_identical": ours[0] == ours[1],
            }
    for who in ("mamba_ssm", "mambalab"):
        result[f"{who}_distinct_dB_dC_over_profiles"] = len({(v[who]["B"], v[who]["C"]) for v in result.values()
                                                             if isinstance(v, dict) and who in v})
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/fingerprints.py measures a GPU; none is visible")
    payload = {"environment": environment(), "step": step_fingerprints(args.repeats)}
    print("step:", {k: v for k, v in payload["step"].items() if k != "report"}, flush=True)
    payload["issue_shape_ssd"] = mamba_ssm_vs_mambalab(args.repeats)
    print("ssd:", payload["issue_shape_ssd"], flush=True)
    write(args.out, payload)


if __name__ == "__main__":
    main()
