"""Generation speed of mambalab against mamba-ssm's ``MambaLMHeadModel.generate(…, cg=True)``, same weights.

For each configuration (mamba-130m, mamba2-130m, mamba2-2.7b sizes, random weights), prompt length,
number of new tokens and batch size, both libraries decode greedily from the same prompt, and the script
records the prefill time, decode ms/token and tokens/s (batch · new tokens / decode time) and the peak GPU
memory, with and without CUDA graphs for mambalab. Results go to ``benchmarks/results/bench_generation.json``
with the machine and versions.

    python benchmarks/bench_generation.py                     # the full table (GPU)
    python benchmarks/bench_generation.py --smoke             # a tiny model: checks the script runs (the GPU
                                                              # when there is one, else the CPU's interpreter)
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from mambalab.inference import generate  # noqa: E402
from mambalab.modules.lm import LMConfig, MambaLM  # noqa: E402
from common import environment  # noqa: E402

# mamba-ssm's published configurations (their config.json), vocabulary padded to a multiple of 16.
CONFIGS = {
    "mamba-130m": dict(d_model=768, n_layer=24, vocab_size=50288, layer="Mamba1", d_state=16),
    "mamba2-130m": dict(d_model=768, n_layer=24, vocab_size=50288, layer="Mamba2", d_state=128, headdim=64,
                        ngroups=1, chunk_size=256),
    "mamba2-2.7b": dict(d_model=2560, n_layer=64, vocab_size=50288, layer="Mamba2", d_state=128, headdim=64,
                        ngroups=1, chunk_size=256),
}
SMOKE = dict(d_model=32, n_layer=2, vocab_size=64, layer="Mamba2", d_state=8, headdim=8, ngroups=2, chunk_size=4,
             scan="reference")


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_generation(run, device, max_new_tokens, warmup_tokens=None, repeats=1):
    """(prefill s, decode ms/token, peak GiB) of ``run(n)``, which generates n tokens; prefill = run(1).

    The warm-up generates ``warmup_tokens`` (default: the timed length) once: kernels compile and autotune
    there, and both libraries record their CUDA graphs there, so no recording is timed. mamba-ssm records again
    when a sequence is longer than the one it recorded for, so its warm-up needs the timed length; mambalab's
    graph serves every length, and two tokens (the prefill and one decode step) warm it up. ``repeats``: best
    of that many runs of each (the CPU smoke, whose milliseconds a busy machine can swamp)."""
    run(max_new_tokens if warmup_tokens is None else min(warmup_tokens, max_new_tokens))

    def best(n):
        times = []
        for _ in range(repeats):
            sync(device)
            t0 = time.perf_counter()
            run(n)
            sync(device)
            times.append(time.perf_counter() - t0)
        return min(times)

    prefill = best(1)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    total = best(max_new_tokens)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
    return prefill, 1e3 * (total - prefill) / max(max_new_tokens - 1, 1), peak


def mamba_ssm_model(ours: MambaLM, cfg: dict, device, dtype):
    """mamba-ssm's MambaLMHeadModel with our model's weights (same names after ``backbone.``)."""
    from mambalab import oracle
    oracle.load()
    from mamba_ssm.models.config_mamba import MambaConfig
    from mamba_ssm.models.mixer_seq_simple import MambaLMHeadModel
    ssm_cfg = {k: cfg[k] for k in ("d_state", "headdim", "ngroups", "chunk_size") if k in cfg}
    ssm_cfg["layer"] = cfg["layer"]
    theirs = MambaLMHeadModel(MambaConfig(d_model=cfg["d_model"], n_layer=cfg["n_layer"], vocab_size=cfg["vocab_size"],
                                          ssm_cfg=ssm_cfg, pad_vocab_size_multiple=16), device=device, dtype=dtype)
    state = {("backbone." + k if not k.startswith("lm_head") else k): v for k, v in ours.state_dict().items()}
    theirs.load_state_dict(state)
    return theirs.eval()


def bench_row(name, cfg, prompt_len, new_tokens, batch, device, dtype, rival: bool, eager: bool):
    gc.collect()   # the previous row's models: a model and the decode graphs it keeps reference each other
    if device.type == "cuda":
        torch.cuda.empty_cache()
    torch.manual_seed(0)
    # made on the device: on the CPU, mamba2-2.7b's random initialisation alone takes tens of seconds per row
    model = MambaLM(LMConfig(**cfg), device=device).to(dtype=dtype).eval()
    prompt = torch.randint(0, cfg["vocab_size"], (batch, prompt_len), device=device)
    row = dict(config=name, prompt=prompt_len, new_tokens=new_tokens, batch=batch, dtype=str(dtype))
    variants = {}
    if eager or device.type != "cuda":
        variants["mambalab_eager"] = lambda n: generate(model, prompt, n, temperature=0)
    if device.type == "cuda":
        variants["mambalab_cg"] = lambda n: generate(model, prompt, n, temperature=0, cg=True)
        if rival:
            theirs = mamba_ssm_model(model, cfg, device, dtype)
            variants["mamba_ssm_cg"] = lambda n: theirs.generate(prompt, max_length=prompt_len + n, cg=True,
                                                                 top_k=1, enable_timing=False)
            same = torch.equal(generate(model, prompt, 8, temperature=0, cg=True)[:, prompt_len:],
                               variants["mamba_ssm_cg"](8)[:, prompt_len:])
            row["same_greedy_tokens_8"] = bool(same)   # bf16 rounding may make a near-tie go either way
    for variant, run in variants.items():
        prefill, ms, peak = time_generation(run, device, new_tokens,
                                            warmup_tokens=2 if variant.startswith("mambalab") else None,
                                            repeats=3 if device.type == "cpu" else 1)
        row[variant] = dict(prefill_s=prefill, decode_ms_per_token=ms, tokens_per_s=1e3 * batch / ms, peak_gib=peak)
        print(f"{name:12s} b={batch:3d} new={new_tokens:5d} {variant:15s} prefill {prefill * 1e3:8.1f} ms  "
              f"decode {ms:7.3f} ms/tok  {1e3 * batch / ms:9.0f} tok/s  peak {peak:6.2f} GiB", flush=True)
    return row


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a tiny model, fp32, on the GPU if there is one (checks the script runs)")
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--prompt", type=int, default=2048)
    parser.add_argument("--new-tokens", type=int, nargs="+", default=[128, 1024])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--no-rival", action="store_true", help="skip mamba-ssm")
    parser.add_argument("--eager-tokens", type=int, nargs="*", default=[128],
                        help="the new-token counts at which mambalab's eager (no CUDA graph) decoding is timed too")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "bench_generation.json"))
    args = parser.parse_args(argv)
    if args.smoke:
        # a GPU process runs Triton natively, so CPU tensors would not reach the interpreter: the GPU's then
        device, dtype = torch.device("cuda" if torch.cuda.is_available() else "cpu"), torch.float32
        rows = [bench_row("smoke", SMOKE, 8, 16, 2, device, dtype, rival=False, eager=True)]
    else:
        if not torch.cuda.is_available():
            parser.exit(2, "bench_generation.py: needs a CUDA GPU (use --smoke on the CPU)\n")
        device, dtype = torch.device("cuda"), torch.bfloat16
        rows = []
    record = dict(environment=environment(), command="python benchmarks/bench_generation.py " + " ".join(argv or sys.argv[1:]),
                  rows=rows)
    if not args.smoke:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        for name in args.configs:
            for n in args.new_tokens:
                for b in args.batch:
                    rows.append(bench_row(name, CONFIGS[name], args.prompt, n, b, device, dtype,
                                          rival=not args.no_rival, eager=n in args.eager_tokens))
                    Path(args.out).write_text(json.dumps(record, indent=2))   # what is done survives a cut-off
    return record


if __name__ == "__main__":
    main()
