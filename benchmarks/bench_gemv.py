"""The batch-1 decode GEMVs of mamba2-2.7b as MambaLM runs them (in_proj with the residual add and the block's
RMS norm before it and the conv's step after it, out_proj with the gated norm) against cuBLAS's GEMV through
F.linear (without the norms or the conv), in one process, over tile choices.

Each layer's weight is a different tensor, 64 of them as in the model (3.4 GB for in_proj): timed over all 64
back to back in one CUDA graph, so every read comes from HBM, as in a decode step, not from L2 (50 MB). The
bandwidth column is the weights' bytes over the time.

    python benchmarks/bench_gemv.py [--out build/gpu/gemv.json] [--sweep]
"""
from __future__ import annotations

import argparse

import torch

from common import environment, graph_ms, write

from mambalab.kernels.gemv import GemvConfig, gemv_config, gemv_fwd

LAYERS = 64
SHAPES = {"norm+in_proj+conv": (10576, 2560), "norm+out_proj": (2560, 5120)}   # (N, K) of mamba2-2.7b


def fused_args(name, k, device):
    bf16 = dict(device=device, dtype=torch.bfloat16)
    if name == "norm+in_proj+conv":
        return dict(norm=dict(weight=torch.ones(k, **bf16), z=None, residual=torch.randn(k, **bf16), group_size=k,
                              eps=1e-5, norm_before_gate=True),
                    conv=dict(state=torch.randn(5376, 4, **bf16), weight=torch.randn(5376, 4, **bf16),
                              bias=torch.randn(5376, **bf16), start=5120))
    return dict(norm=dict(weight=torch.ones(k, **bf16), z=torch.randn(k, **bf16), residual=None, group_size=k,
                          eps=1e-5, norm_before_gate=False))


def sweep_configs():
    """Tiles of 2K to 16K weights a program (4 to 32 rows), 4 warps below 8K and 8 from there, with and without
    software pipelining of the k loop."""
    pairs = [(bn, bk) for bn in (4, 8, 16, 32) for bk in (256, 512, 1024, 2048) if 2048 <= bn * bk <= 16384]
    return [GemvConfig(bn, bk, 4 if bn * bk < 8192 else 8, st) for bn, bk in pairs for st in (1, 3)]


def time_row(name, n, k, weights, x, extra, cfg, cublas, fused=True):
    """One tile choice over the 64 layers' weights as a results row (an error row where it fails)."""
    label = "fused" if fused else "GEMV alone"
    try:
        ms = graph_ms(lambda: [gemv_fwd(w, x, **extra, config=cfg) for w in weights])
    except Exception as error:   # a tile that does not compile or fit: recorded, the sweep goes on
        print(f"{name:18s} {cfg}: {type(error).__name__}: {error}"[:300], flush=True)
        return dict(shape=name, config=cfg.__dict__, error=f"{type(error).__name__}: {error}"[:300])
    gbytes = LAYERS * n * k * 2 / 1e9
    row = dict(shape=name, what=label, n=n, k=k, layers=LAYERS, block_n=cfg.block_n, block_k=cfg.block_k,
               num_warps=cfg.num_warps, num_stages=cfg.num_stages, default=cfg == gemv_config(n, k),
               mambalab_us_per_layer=1e3 * ms / LAYERS, cublas_us_per_layer=1e3 * cublas / LAYERS,
               ratio=ms / cublas, mambalab_tb_s=gbytes / ms, cublas_tb_s=gbytes / cublas)
    print(f"{name:18s} {label:10s} bn{cfg.block_n:<3d} bk{cfg.block_k:<5d} w{cfg.num_warps} s{cfg.num_stages}  "
          f"{row['mambalab_us_per_layer']:7.2f} us ({row['mambalab_tb_s']:.2f} TB/s)  cuBLAS "
          f"{row['cublas_us_per_layer']:7.2f} us ({row['cublas_tb_s']:.2f} TB/s)  ratio {row['ratio']:.3f}", flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="build/gpu/gemv.json")
    parser.add_argument("--sweep", action="store_true", help="also time other tiles (block_n, block_k, warps)")
    args = parser.parse_args()
    device = "cuda"
    rows = []
    for name, (n, k) in SHAPES.items():
        weights = [torch.randn(n, k, device=device, dtype=torch.bfloat16) * k ** -0.5 for _ in range(LAYERS)]
        x = torch.randn(k, device=device, dtype=torch.bfloat16)
        cublas = graph_ms(lambda: [torch.nn.functional.linear(x[None], w) for w in weights])
        default = gemv_config(n, k)
        # the default tiles without the fused steps: what the norm and the conv add to the GEMV
        rows.append(time_row(name, n, k, weights, x, {}, default, cublas, fused=False))
        configs = [default] + ([c for c in sweep_configs() if c != default] if args.sweep else [])
        rows += [time_row(name, n, k, weights, x, fused_args(name, k, device), cfg, cublas) for cfg in configs]
        del weights
        torch.cuda.empty_cache()
    write(args.out, dict(environment=environment(), command="python benchmarks/bench_gemv.py"
                         + (" --sweep" if args.sweep else ""), rows=rows))


if __name__ == "__main__":
    main()
