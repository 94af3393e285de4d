"""The command line of the trainer: ``python -m mambalab.train`` and ``mambalab train``.

One process (TP = 1):      python -m mambalab.train --steps 50
Four ranks on one node:    torchrun --standalone --nproc_per_node 4 -m mambalab.train --tp 4
Two nodes, TP 4 × DP 2:    torchrun --nnodes 2 --node_rank R --nproc_per_node 4 --rdzv_backend c10d \\
                               --rdzv_endpoint HOST:PORT -m mambalab.train --tp 4
Sequences split in 2 (CP):  torchrun --standalone --nproc_per_node 4 -m mambalab.train --tp 2 --cp 2
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path

from mambalab.modules.lm import LMConfig
from mambalab.train.tasks import TASKS
from mambalab.train.trainer import INIT_HOOKS, PARAM_DTYPES, TrainConfig

__all__ = ["add_arguments", "closing_line", "config_from_args", "main", "run_from_args"]

_MODEL_HELP = {"vocab_size": "vocabulary (TP must divide it)", "d_model": "width of the residual stream",
               "n_layer": "Mamba-2 blocks", "d_state": "n, state size", "headdim": "p, channels per head",
               "ngroups": "g, groups of B and C (TP must divide it)", "expand": "d_inner = expand · d_model",
               "d_conv": "conv width", "chunk_size": "q, SSD chunk length",
               "tie_embeddings": "share the embedding and head weights", "scan": "kernel (Triton) or reference",
               "reduction": "SSD backward reduction: atomic or deterministic (default: the switch decides)"}
_RUN_HELP = {"task": "synthetic task", "steps": "optimizer steps", "batch_size": "sequences per DP replica and step",
             "seq_len": "tokens per sequence", "lr": "peak learning rate (warmup, then cosine to 10%%)",
             "tp": "tensor-parallel degree (ranks per TP group)",
             "cp": "context-parallel degree: ranks that split each sequence (seq_len / cp each; the kernel scan)",
             "dp": "data-parallel degree (0: world / (tp · cp))",
             "sequence_parallel": "split activations along the sequence between blocks",
             "amp": "auto: bf16 autocast on GPU, none on CPU", "param_dtype": "master parameters' dtype (fp32!)",
             "init": "full: same weights for every TP degree; local: build only this rank's shard",
             "init_hook": "apply a zero-every-bias init hook (the pitfall), or one that honours _no_reinit",
             "out_dir": "metrics.jsonl, config.json, summary.json", "checkpoint_dir": "sharded checkpoints",
             "checkpoint_every": "steps between checkpoints (0: only at the end)",
             "resume": "'latest' or a step folder", "deterministic": "turn on mambalab's determinism switch",
             "timeout_s": "collectives and the watchdog give up after this many seconds (> 0)",
             "fail_at_step": "fault injection: rank --fail-rank exits at this step (tests, demos)",
             "progress": "tqdm bar on rank 0", "backend": "gloo or nccl (default: nccl with CUDA)",
             "allow_seed_change": "resume a checkpoint saved with another seed"}
_CHOICES = {"task": sorted(TASKS), "amp": ["auto", "bf16", "off"], "param_dtype": sorted(PARAM_DTYPES),
            "init": ["full", "local"], "init_hook": list(INIT_HOOKS), "scan": ["auto", "kernel", "reference"],
            "reduction": ["atomic", "deterministic"]}


def _add(parser, name, default, help_text=""):
    flag = "--" + name.replace("_", "-")
    if isinstance(default, bool):
        parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=help_text)
    else:
        kind = type(default) if default is not None else str
        parser.add_argument(flag, type=kind, default=default, choices=_CHOICES.get(name), help=help_text,
                            metavar=None if name in _CHOICES else name.upper())


def _flag_fields(cls) -> list:
    """The fields a flag can set: those with a plain default (not e.g. LMConfig.ssm_cfg's dict)."""
    return [f for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags for every TrainConfig and LMConfig field (--d-model, --tp, --sequence-parallel, …)."""
    run = parser.add_argument_group("run")
    for f in dataclasses.fields(TrainConfig):
        if f.name != "model":
            _add(run, f.name, f.default, _RUN_HELP.get(f.name, ""))
    model = parser.add_argument_group("model")
    for f in _flag_fields(LMConfig):
        _add(model, f.name, "auto" if f.name == "scan" else f.default, _MODEL_HELP.get(f.name, ""))
    parser.add_argument("--debug", action="store_true", help="show the traceback of a usage error")


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    import torch

    model_kw = {f.name: getattr(args, f.name) for f in _flag_fields(LMConfig)}
    if model_kw["scan"] == "auto":   # the kernels on a GPU or with CP (its ring runs them); else on a CPU the
        # reference (the interpreter is slow)
        model_kw["scan"] = "kernel" if torch.cuda.is_available() or args.cp > 1 else "reference"
    run_kw = {f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig) if f.name != "model"}
    return TrainConfig(model=LMConfig(**model_kw), **run_kw)   # validated: ConfigError names a bad field


def main(argv: list[str] | None = None) -> int:
    import mambalab  # noqa: F401  (before triton: switches on the interpreter on a CPU)

    parser = argparse.ArgumentParser(prog="python -m mambalab.train", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run_from_args(parser.parse_args(argv))


def closing_line(cfg: TrainConfig, metrics: list[dict], wall_s: float, prog: str = "mambalab train") -> str:
    """The run's last line: the steps trained, the final loss, the wall time, and where it wrote what."""
    from mambalab.train.checkpoint import latest_step_dir

    if metrics:
        resumed = f", from step {metrics[0]['step']}" if metrics[0]["step"] else ""
        trained = (f"{len(metrics)} step{'s' if len(metrics) != 1 else ''}{resumed} to {metrics[-1]['step'] + 1} of {cfg.steps}, "
                   f"final loss {metrics[-1]['loss']:.4f}")
    else:
        trained = f"no step trained (steps = {cfg.steps}), no final loss"
    wrote = []
    if cfg.checkpoint_dir:
        newest = latest_step_dir(cfg.checkpoint_dir, warn=lambda text: None)
        wrote.append(f"checkpoint {newest}" if newest is not None else f"no checkpoint in {cfg.checkpoint_dir}")
    if cfg.out_dir:
        out = Path(cfg.out_dir)
        wrote.append(f"metrics {out / 'metrics.jsonl'} (config.json, summary.json beside it)")
    where = "; ".join(wrote) if wrote else "nothing written (no --out-dir, no --checkpoint-dir)"
    wall = f"{wall_s:.1f}" if wall_s >= 1 else f"{wall_s:.3f}"
    return f"{prog}: {trained}, {wall} s wall; {where}"


def run_from_args(args: argparse.Namespace, prog: str = "mambalab train") -> int:
    """Build the config from ``args`` and train; shared by ``mambalab train`` and ``python -m mambalab.train``.

    Rank 0 ends with :func:`closing_line` on stdout (a resumed run with no step left says so itself instead).

    A usage error (:class:`~mambalab.train.trainer.ConfigError`: a bad field, a checkpoint that does not fit
    the run) is one line on stderr, printed by rank 0 only under torchrun, and exit code 2; a damaged
    checkpoint (:class:`~mambalab.train.checkpoint.CheckpointError`) one line per rank naming its file, exit
    code 1. ``--debug`` re-raises instead, with the traceback."""
    from mambalab.train.trainer import CheckpointError, ConfigError, train

    rank = int(os.environ.get("RANK", "0") or 0)
    start = time.perf_counter()
    try:
        cfg = config_from_args(args)
        metrics = train(cfg)
    except (ConfigError, CheckpointError) as e:
        if getattr(args, "debug", False):
            raise
        usage = isinstance(e, ConfigError)
        if rank == 0 or not usage:
            sys.stderr.write(f"{prog}: error: {e}\n")   # one write: ranks share the terminal
            sys.stderr.flush()
        return 2 if usage else 1
    if rank == 0 and (metrics or not cfg.resume):   # a resume past the last step has said so (trainer)
        print(closing_line(cfg, metrics, time.perf_counter() - start, prog), flush=True)
    return 0
