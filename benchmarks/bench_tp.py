"""Tensor-parallel training throughput and memory: TP = 1 on one GPU against TP = N on N GPUs (NCCL).

Trains the same Mamba-2 language model with mambalab's trainer (bf16 autocast, fp32 master parameters,
AdamW, synthetic MQAR batches) and reports, from the steps after the warm-up (Triton compiles its kernels in
the first ones): median tokens per second, peak memory per GPU and parameter memory per GPU. Launch one run
per TP degree, then compare the JSON files (``scaling`` is filled in when a TP = 1 file for the same preset
is already in DIR):

    torchrun --standalone --nproc_per_node 1 benchmarks/bench_tp.py --tp 1 --out DIR
    torchrun --standalone --nproc_per_node 2 benchmarks/bench_tp.py --tp 2 --out DIR
    torchrun --standalone --nproc_per_node 4 benchmarks/bench_tp.py --tp 4 --out DIR --preset 2.7b

Presets (ngroups = 8 so that TP = 2, 4, 8 divide the groups; vocabulary padded to a multiple of 8):

    460m   d_model 1024, 48 layers, d_state 128, headdim 64, 456,848,896 parameters (460M), 8 × 2048 tokens
           a step
    2.7b   d_model 2560, 58 layers, d_state 128, headdim 64, 2.73 B parameters, 1 × 8192 tokens a step
           (mamba2-2.7b's width; 58 rather than 64 layers because 8 groups add 4.6 M parameters a layer)
    tiny   a CPU smoke test (gloo): checks that the script runs, measures nothing meaningful

Writes DIR/tp_<preset>_tp<N>.json (rank 0) with the environment, the config, per-step metrics and summary.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import mambalab  # noqa: E402,F401
from mambalab.modules.lm import LMConfig  # noqa: E402
from mambalab.train.trainer import TrainConfig, train  # noqa: E402

VOCAB = 50280  # GPT-NeoX's 50277 padded to a multiple of 8, as the Mamba checkpoints do
PRESETS = {
    "460m": dict(model=dict(vocab_size=VOCAB, d_model=1024, n_layer=48, d_state=128, headdim=64, ngroups=8,
                            chunk_size=256, scan="kernel"), batch_size=8, seq_len=2048),
    "2.7b": dict(model=dict(vocab_size=VOCAB, d_model=2560, n_layer=58, d_state=128, headdim=64, ngroups=8,
                            chunk_size=256, scan="kernel"), batch_size=1, seq_len=8192),
    "tiny": dict(model=dict(vocab_size=64, d_model=32, n_layer=2, d_state=16, headdim=8, ngroups=4, chunk_size=16,
                            scan="reference"), batch_size=2, seq_len=64),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp", type=int, required=True, help="tensor-parallel degree (= --nproc_per_node)")
    parser.add_argument("--out", required=True, help="folder for the JSON result")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="460m")
    parser.add_argument("--steps", type=int, default=25, help="steps in all, warm-up included")
    parser.add_argument("--warmup-steps", type=int, default=5, help="first steps left out of the medians")
    parser.add_argument("--sequence-parallel", action="store_true")
    parser.add_argument("--batch-size", type=int, default=None, help="override the preset's")
    args = parser.parse_args()
    if args.steps <= args.warmup_steps:
        parser.error(f"--steps ({args.steps}) must exceed --warmup-steps ({args.warmup_steps})")

    preset = PRESETS[args.preset]
    with tempfile.TemporaryDirectory() as tmp:
        # init="local": each rank builds only its shard (a 2.7B model need not be built whole on every rank)
        cfg = TrainConfig(model=LMConfig(**preset["model"]), task="mqar", steps=args.steps,
                          batch_size=args.batch_size or preset["batch_size"], seq_len=preset["seq_len"],
                          warmup=2, tp=args.tp, sequence_parallel=args.sequence_parallel, init="local",
                          out_dir=tmp, progress=False, timeout_s=600)
        metrics = train(cfg)
        summary_path = Path(tmp) / "summary.json"
        summary = json.loads(summary_path.read_text()) if summary_path.exists() else None
    if summary is None:   # not rank 0
        return 0

    from common import environment, write

    measured = metrics[args.warmup_steps:]
    tokens_per_s = statistics.median(m["tokens_per_s"] for m in measured)
    result = {
        "benchmark": "tensor-parallel training (mambalab.train)",
        "environment": {**environment(), "gpus": torch.cuda.device_count() if torch.cuda.is_available() else 0},
        "preset": args.preset, "tp": args.tp, "dp": summary["dp"], "sequence_parallel": args.sequence_parallel,
        "num_parameters": summary["num_parameters"],
        "tokens_per_step": cfg.batch_size * cfg.seq_len * summary["dp"],
        "amp": "bf16 autocast, fp32 master parameters" if torch.cuda.is_available() else "fp32 (CPU)",
        "config": cfg.to_dict(),
        "median_tokens_per_s": tokens_per_s,
        "median_step_time_s": statistics.median(m["step_time_s"] for m in measured),
        "peak_mem_gib_per_gpu": summary["peak_mem_gib_per_rank"],
        "param_gib_per_gpu": summary["param_gib_per_rank"],
        "param_gib_total_fp32": summary["num_parameters"] * 4 / 2**30,
        "losses": [m["loss"] for m in metrics],
        "steps": metrics,
    }
    out = Path(args.out)
    baseline = out / f"tp_{args.preset}_tp1.json"
    if args.tp > 1 and baseline.exists():
        base = json.loads(baseline.read_text())
        result["scaling"] = {"tokens_per_s_vs_tp1": tokens_per_s / base["median_tokens_per_s"],
                             "ideal": args.tp,
                             "peak_mem_vs_tp1": max(result["peak_mem_gib_per_gpu"] or [0])
                             / max(base["peak_mem_gib_per_gpu"] or [1]) if torch.cuda.is_available() else None}
    write(out / f"tp_{args.preset}_tp{args.tp}.json", result)
    print(f"{args.preset} TP={args.tp}: {tokens_per_s:,.0f} tokens/s, peak memory per GPU "
          f"{result['peak_mem_gib_per_gpu']} GiB, parameters per GPU {result['param_gib_per_gpu']} GiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
