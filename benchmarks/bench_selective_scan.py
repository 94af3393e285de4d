"""mambalab.ops.selective_scan against mamba-ssm's CUDA selective_scan_fn, on a GPU, in one run.

Times forward and forward+backward at b=8, d=2048, n=16 (delta_softplus, D, z and delta_bias given) for
each length and dtype, counts distinct gradient bit patterns over repeated backward passes for both, and
records the largest differences between the two. Writes JSON (ratios are mambalab / mamba-ssm).

    python benchmarks/bench_selective_scan.py --out benchmarks/results/selective_scan_h200.json \
        [--mamba-sdist path/to/mamba_ssm-2.3.2.post1.tar.gz] [--sweep] [--profile]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import mambalab  # noqa: E402,F401
from common import distinct_patterns, environment, profile_table, time_ms, write  # noqa: E402

NAMES = ("u", "delta", "A", "B", "C", "D", "z", "delta_bias")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def make(b, d, n, l, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda *s, dt=dtype: torch.randn(*s, device="cuda", generator=g).to(dt)
    return {
        "u": r(b, d, l), "delta": (0.5 * torch.rand(b, d, l, device="cuda", generator=g) - 4.0).to(dtype),
        "A": -torch.rand(d, n, device="cuda", generator=g) - 0.5, "B": r(b, n, l), "C": r(b, n, l),
        "D": r(d, dt=torch.float32), "z": r(b, d, l), "delta_bias": r(d, dt=torch.float32) * 0.1 + 2.0,
    }


def step(fn, x, dout, backward=True):
    leaves = {k: v.detach().requires_grad_(backward) for k, v in x.items()}
    out = fn(*(leaves[k] for k in NAMES[:5]), D=leaves["D"], z=leaves["z"], delta_bias=leaves["delta_bias"],
             delta_softplus=True)
    if not backward:
        return out, None
    out.backward(dout)
    return out, {k: v.grad for k, v in leaves.items()}


def compare(name, fn, x, dout, reps):
    fwd = time_ms(lambda: step(fn, x, dout, backward=False))
    fwdbwd = time_ms(lambda: step(fn, x, dout))
    runs = [step(fn, x, dout)[1] for _ in range(reps)]
    return {"fwd_ms": fwd, "fwd_bwd_ms": fwdbwd, "distinct_grad_patterns": distinct_patterns(runs)}


def sweep(x, dout, rival=None):
    """Time forward and backward tiles separately (for choosing the rule), beside the rival in the same run."""
    from mambalab.kernels import selective_scan as k

    u, delta, A, B, C, D, z, bias = (x[n] for n in NAMES)
    B4, C4 = B.unsqueeze(1).contiguous(), C.unsqueeze(1).contiguous()
    rows = []
    if rival is not None:
        rows.append({"rival": "mamba_ssm_cuda", "fwd_ms": time_ms(lambda: step(rival, x, dout, backward=False)),
                     "fwd_bwd_ms": time_ms(lambda: step(rival, x, dout))})
    base = k.tile_config(u.shape[1], A.shape[1], u.shape[2])
    _, _, states, _ = k.selective_scan_fwd(u, delta, A, B4, C4, D, z, bias, True, cfg=base)
    for bd in (1, 2, 4):
        for bl in (256, 512, 1024):
            for nw in (1,):   # 2 warps lost to 1 at every tile in the H200 sweeps (v1, v2 files)
                cfg = k.TileConfig(bd, 16, bl, nw, base.bwd_block_d, base.bwd_block_l, base.bwd_num_warps)
                try:
                    fwd = time_ms(lambda: k.selective_scan_fwd(u, delta, A, B4, C4, D, z, bias, True, cfg=cfg),
                                  warmup=2, rep=10)
                    rows.append({"part": "fwd", "block_d": bd, "block_l": bl, "num_warps": nw, "fwd_ms": fwd})
                except Exception as err:  # a config that does not compile is recorded, not fatal
                    rows.append({"part": "fwd", "block_d": bd, "block_l": bl, "num_warps": nw, "error": repr(err)[:200]})
    for bd in (2, 4, 8):
        for bl in (64, 128):
            for nw in (1,):
                cfg = k.TileConfig(base.block_d, 16, 1024, base.num_warps, bd, bl, nw)
                try:
                    _, _, st, _ = k.selective_scan_fwd(u, delta, A, B4, C4, D, z, bias, True, cfg=cfg)
                    bwd = time_ms(lambda: k.selective_scan_bwd(dout, u, delta, A, B4, C4, D, z, bias, True, st, cfg),
                                  warmup=2, rep=10)
                    rows.append({"part": "bwd", "block_d": bd, "block_l": bl, "num_warps": nw, "bwd_ms": bwd})
                except Exception as err:
                    rows.append({"part": "bwd", "block_d": bd, "block_l": bl, "num_warps": nw, "error": repr(err)[:200]})
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="benchmarks/results/selective_scan.json")
    p.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192])
    p.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=list(DTYPES))
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--channels", type=int, default=2048)
    p.add_argument("--state", type=int, default=16)
    p.add_argument("--reps", type=int, default=5, help="repeated backward passes for the bit-pattern count")
    p.add_argument("--mamba-sdist", help="compile mamba-ssm's CUDA extension from this sdist first")
    p.add_argument("--mamba-build-dir", help="where that extension is (or was already) built")
    p.add_argument("--sweep", action="store_true", help="also time tile configurations (l=2048, bf16)")
    p.add_argument("--profile", action="store_true",
                   help="also record where forward+backward's device time goes (l=2048, bf16, torch.profiler)")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("this benchmark needs a CUDA GPU")

    result = {"benchmark": "selective_scan", "shape": {"b": args.batch, "d": args.channels, "n": args.state},
              "options": "delta_softplus, D, z, delta_bias", "cases": []}
    if args.mamba_sdist:
        from mamba_cuda_ext import build

        result["mamba_ext_build_or_load_s"] = build(args.mamba_sdist, build_dir=args.mamba_build_dir)
    from mambalab import oracle
    from mambalab.ops import selective_scan

    result["environment"] = environment()
    rival = oracle.selective_scan_fn() if oracle.cuda_extension_available() else None
    for l in args.lengths:
        for dname in args.dtypes:
            x = make(args.batch, args.channels, args.state, l, DTYPES[dname])
            dout = torch.randn(args.batch, args.channels, l, device="cuda", dtype=DTYPES[dname])
            case = {"l": l, "dtype": dname, "mambalab": compare("mambalab", selective_scan, x, dout, args.reps)}
            if rival is not None:
                case["mamba_ssm_cuda"] = compare("mamba_ssm", rival, x, dout, args.reps)
                ours_out, ours_g = step(selective_scan, x, dout)
                their_out, their_g = step(rival, x, dout)
                case["max_abs_diff_vs_mamba_ssm"] = {"out": (ours_out - their_out).abs().max().item()} | {
                    k: (ours_g[k].float() - their_g[k].float()).abs().max().item() for k in NAMES}
                case["max_abs_vs_mamba_ssm"] = {"out": their_out.abs().max().item()} | {
                    k: their_g[k].abs().max().item() for k in NAMES}
                m, r = case["mambalab"], case["mamba_ssm_cuda"]
                case["ratio_fwd"] = m["fwd_ms"] / r["fwd_ms"]
                case["ratio_fwd_bwd"] = m["fwd_bwd_ms"] / r["fwd_bwd_ms"]
            print(case, flush=True)
            result["cases"].append(case)
            write(args.out, result)   # after every case, so a run cut short keeps what it measured
            del x, dout
    if args.profile:
        x = make(args.batch, args.channels, args.state, 2048, torch.bfloat16)
        dout = torch.randn(args.batch, args.channels, 2048, device="cuda", dtype=torch.bfloat16)
        result["profile_l2048_bf16"] = {"mambalab": profile_table(lambda: step(selective_scan, x, dout)),
                                        # without a gradient (what fwd_ms times): its kernel time against fwd_ms
                                        # shows how long the GPU waits between launches
                                        "mambalab_forward_no_grad": profile_table(
                                            lambda: step(selective_scan, x, dout, backward=False))}
        if rival is not None:
            result["profile_l2048_bf16"]["mamba_ssm_cuda"] = profile_table(lambda: step(rival, x, dout))
    if args.sweep:
        x = make(args.batch, args.channels, args.state, 2048, torch.bfloat16)
        dout = torch.randn(args.batch, args.channels, 2048, device="cuda", dtype=torch.bfloat16)
        result["tile_sweep_l2048_bf16"] = sweep(x, dout, rival)
        print(result["tile_sweep_l2048_bf16"], flush=True)
    write(args.out, result)


if __name__ == "__main__":
    main()
