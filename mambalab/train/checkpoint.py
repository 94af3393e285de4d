"""Sharded checkpoints: each TP rank of the first data-parallel replica writes its own shard.

    DIR/step_000020/meta.json           written by rank 0: step, tp, dp, the model and training config
    DIR/step_000020/tp0-of-4.pt         rank (tp_rank=0, dp_rank=0): model shard, optimizer state, RNG state
    …
    DIR/latest                          the name of the newest complete step folder

No rank ever holds the whole model. ``latest`` is written last, after a barrier, so a crash while saving
leaves the previous checkpoint as the one to resume from. A checkpoint resumes only with the same TP degree
(the shards are 1/T of each tensor); any DP degree works, as every replica holds the same weights.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist

from mambalab.parallel.layout import ParallelLayout

__all__ = ["save_checkpoint", "load_checkpoint", "latest_step_dir"]


def _shard_name(layout: ParallelLayout) -> str:
    return f"tp{layout.tp_rank}-of-{layout.tp}.pt"


def _barrier(layout: ParallelLayout) -> None:
    if layout.world_size > 1:
        dist.barrier()


def save_checkpoint(directory: str | Path, step: int, model, optimizer, layout: ParallelLayout, meta: dict) -> Path:
    """Write this rank's shard of step ``step`` (collective: every rank calls it)."""
    folder = Path(directory) / f"step_{step:06d}"
    if layout.dp_rank == 0:
        folder.mkdir(parents=True, exist_ok=True)
        torch.save({"step": step, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "rng": torch.get_rng_state()}, folder / _shard_name(layout))
    if layout.is_main:
        (folder / "meta.json").write_text(json.dumps({"step": step, "tp": layout.tp, "dp": layout.dp, **meta},
                                                     indent=2))
    _barrier(layout)
    if layout.is_main:
        (Path(directory) / "latest").write_text(folder.name)
    _barrier(layout)
    return folder


def latest_step_dir(directory: str | Path) -> Path | None:
    """The newest complete checkpoint folder in ``directory``, or None."""
    marker = Path(directory) / "latest"
    return Path(directory) / marker.read_text().strip() if marker.exists() else None


def load_checkpoint(folder: str | Path, model, optimizer, layout: ParallelLayout) -> int:
    """Load this rank's shard into model and optimizer; returns the step it was saved at."""
    folder = Path(folder)
    meta = json.loads((folder / "meta.json").read_text())
    if meta["tp"] != layout.tp:
        raise ValueError(f"checkpoint {folder} was saved with tp = {meta['tp']}; this run has tp = {layout.tp} "
                         f"(shards only load with the same tensor-parallel degree)")
    state = torch.load(folder / _shard_name(layout), map_location="cpu", weights_only=False)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["rng"])
    return int(state["step"])
