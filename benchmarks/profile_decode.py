"""Where one decode step's time goes, mambalab against mamba-ssm: each library's whole decode step as the CUDA
graph its ``generate(cg=True)`` replays, same weights, same batch.

For each configuration of :mod:`bench_generation` asked for (random weights, bf16), after a prompt of
``--prompt`` tokens:

* ``replay_ms``: one replay of the decode step's graph (median, CUDA events), the GPU's time per token with
  nothing else around it;
* ``loop_ms_per_token``: the library's own generation loop per token (greedy, ``--tokens`` new tokens, minus the
  prefill), what bench_generation.py reports as decode ms/token: the replay plus the per-token work around it;
* ``kernels``: the graph's kernels (torch.profiler over ``--steps`` replays), one row per kernel name with its
  launches and device time per step, and their count and sum per step.

mamba-ssm's graph is the one its ``generate`` records (``mamba_ssm.utils.generation.update_graph_cache``).

    python benchmarks/profile_decode.py --configs mamba-130m --batch 1 --out DIR/profile_decode.json
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_generation import CONFIGS, mamba_ssm_model  # noqa: E402
from common import environment, time_ms  # noqa: E402
from mambalab.inference import DecodeGraph, generate  # noqa: E402
from mambalab.modules.lm import LMConfig, MambaLM  # noqa: E402


def kernel_table(fn, steps: int) -> dict:
    """The device kernels of ``steps`` calls of ``fn`` (after one), per call: rows by kernel name, sorted by
    time, and the totals."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    rows = [{"name": e.key, "launches": e.count / steps, "us": e.self_device_time_total / steps}
            for e in prof.key_averages() if e.self_device_time_total > 0]
    rows.sort(key=lambda r: r["us"], reverse=True)
    return {"launches": sum(r["launches"] for r in rows), "device_us": sum(r["us"] for r in rows), "rows": rows}


def loop_ms_per_token(run, tokens: int) -> float:
    """(time of run(tokens) - time of run(1)) / (tokens - 1), best of three each, in ms."""
    def best(n):
        times = []
        for _ in range(3):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            run(n)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        return min(times)
    run(tokens)   # warm-up at the timed length (mamba-ssm records its graph for it)
    return 1e3 * (best(tokens) - best(1)) / (tokens - 1)


def profile_config(name: str, batch: int, prompt_len: int, tokens: int, steps: int, rival: bool) -> dict:
    cfg = CONFIGS[name]
    torch.manual_seed(0)
    model = MambaLM(LMConfig(**cfg), device="cuda").to(dtype=torch.bfloat16).eval()
    prompt = torch.randint(0, cfg["vocab_size"], (batch, prompt_len), device="cuda")
    row = {"config": name, "batch": batch, "prompt": prompt_len}

    generate(model, prompt, 2, temperature=0, cg=True)                      # records mambalab's graph
    graph = DecodeGraph.for_model(model, batch)
    row["mambalab"] = {"replay_ms": time_ms(graph.graph.replay, warmup=10, rep=100),
                       "loop_ms_per_token": loop_ms_per_token(
                           lambda n: generate(model, prompt, n, temperature=0, cg=True), tokens),
                       "kernels": kernel_table(graph.graph.replay, steps)}
    if rival:
        from mambalab import oracle
        theirs = mamba_ssm_model(model, cfg, torch.device("cuda"), torch.bfloat16)
        run = lambda n: theirs.generate(prompt, max_length=prompt_len + n, cg=True, top_k=1, enable_timing=False)
        loop = loop_ms_per_token(run, tokens)                                 # records mamba-ssm's graph
        cache = theirs._decoding_cache
        step = cache.callables[batch, 1]
        ids = torch.zeros(batch, 1, dtype=torch.long, device="cuda")
        pos = torch.full((batch, 1), prompt_len, dtype=torch.long, device="cuda")
        def replay():   # mamba-ssm's cache holds inference tensors: its graph runs under inference mode
            with torch.inference_mode():
                return step(ids, pos, prompt_len + 1)
        row["mamba_ssm"] = {"replay_ms": time_ms(replay, warmup=10, rep=100), "loop_ms_per_token": loop,
                            "kernels": kernel_table(replay, steps), "version": oracle.version()}
    for side in ("mambalab", "mamba_ssm"):
        if side in row:
            r = row[side]
            print(f"{name} b={batch} {side:9s} replay {r['replay_ms'] * 1e3:7.1f} us  loop {r['loop_ms_per_token'] * 1e3:7.1f}"
                  f" us/token  {r['kernels']['launches']:.0f} kernels, {r['kernels']['device_us']:.1f} us of them",
                  flush=True)
    return row


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", default=["mamba-130m"], choices=list(CONFIGS))
    parser.add_argument("--batch", type=int, nargs="+", default=[1])
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--steps", type=int, default=20, help="graph replays under the profiler")
    parser.add_argument("--no-rival", action="store_true")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.exit(2, "profile_decode.py: needs a CUDA GPU\n")
    record = {"environment": environment(), "command": "python benchmarks/profile_decode.py " + " ".join(argv or sys.argv[1:]),
              "rows": []}
    for name in args.configs:
        for b in args.batch:
            record["rows"].append(profile_config(name, b, args.prompt, args.tokens, args.steps, not args.no_rival))
            Path(args.out).write_text(json.dumps(record, indent=2))
    return record


if __name__ == "__main__":
    main()
