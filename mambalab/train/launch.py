"""Launching the trainer under torchrun from Python (a notebook, a test), and reading back what it wrote.

    cfg = TrainConfig(model=LMConfig(...), tp=4, steps=30, out_dir="runs/tp4")
    proc = launch(cfg, nproc=4)                  # torchrun --standalone --nproc_per_node 4 -m mambalab.train …
    metrics = read_metrics("runs/tp4")           # one dict per step, from metrics.jsonl

:func:`config_to_flags` is the inverse of :func:`mambalab.train.cli.config_from_args`: the command line that
reproduces a :class:`TrainConfig`.
"""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

from mambalab.train.trainer import TrainConfig

__all__ = ["config_to_flags", "launch", "read_metrics", "torchrun_command"]

ROOT = Path(__file__).resolve().parents[2]
_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                  "TORCHELASTIC_RUN_ID")
_PATH_FIELDS = ("out_dir", "checkpoint_dir", "resume")


def _flags(obj) -> list[str]:
    out = []
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value) or value is None or value == f.default:
            continue
        if f.default is dataclasses.MISSING:   # a field no flag sets (e.g. LMConfig.ssm_cfg)
            if value:
                raise ValueError(f"{f.name} = {value!r} has no command-line flag; torchrun runs cannot take it")
            continue
        flag = "--" + f.name.replace("_", "-")
        out += ([flag] if value else ["--no-" + flag[2:]]) if isinstance(value, bool) else [flag, str(value)]
    return out


def config_to_flags(cfg: TrainConfig) -> list[str]:
    """The ``python -m mambalab.train`` flags that give ``cfg`` (defaults left out)."""
    return _flags(cfg) + _flags(cfg.model)


def torchrun_command(cfg: TrainConfig, nproc: int, launcher: list[str] | None = None) -> list[str]:
    """``python -m torch.distributed.run [launcher | --standalone] --nproc_per_node N -m mambalab.train …``."""
    return ([sys.executable, "-m", "torch.distributed.run"] + (launcher or ["--standalone"])
            + ["--nproc_per_node", str(nproc), "-m", "mambalab.train"] + config_to_flags(cfg))


def launch(cfg: TrainConfig, nproc: int, launcher: list[str] | None = None, timeout: float | None = None,
           hide_gpus: bool = False, check: bool = True) -> subprocess.CompletedProcess:
    """Run the trainer under torchrun and wait; raises RuntimeError with the output's tail if it fails (with
    ``check``). ``hide_gpus`` runs the ranks on the CPU (gloo) even where GPUs exist."""
    # torchrun runs in the repository root: make the run's paths absolute from the caller's folder first
    cfg = dataclasses.replace(cfg, **{k: str(Path(getattr(cfg, k)).resolve()) for k in _PATH_FIELDS
                                      if getattr(cfg, k) and getattr(cfg, k) != "latest"})
    env = {k: v for k, v in os.environ.items() if k not in _TORCHRUN_VARS}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.setdefault("OMP_NUM_THREADS", "1")
    if hide_gpus:
        env["CUDA_VISIBLE_DEVICES"] = ""
    proc = subprocess.run(torchrun_command(cfg, nproc, launcher), cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise RuntimeError(f"torchrun exited with {proc.returncode}:\n{proc.stderr[-4000:]}")
    return proc


def read_metrics(out_dir: str | Path, events: bool = False) -> list[dict]:
    """The per-step rows rank 0 wrote to out_dir/metrics.jsonl; with ``events``, also the event rows (such as
    ``{"event": "resume", "from_step": N}``, written where a resumed run continues)."""
    rows = [json.loads(line) for line in (Path(out_dir) / "metrics.jsonl").read_text().splitlines() if line]
    return rows if events else [r for r in rows if "event" not in r]
