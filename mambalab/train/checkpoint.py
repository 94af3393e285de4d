"""Sharded checkpoints: each TP rank of the first data-parallel replica (and first context-parallel rank) writes
its own shard.

    DIR/step_000020/meta.json           written by rank 0: step, tp, cp, dp, the model and training config
    DIR/step_000020/tp0-of-4.pt         rank (tp_rank=0, cp_rank=0, dp_rank=0): model shard, optimizer state, RNG
    …
    DIR/latest                          the name of the newest complete step folder

No rank ever holds the whole model. Writes are atomic: the shards and ``meta.json`` go into
``DIR/.step_000020.partial/``, which is renamed to ``step_000020`` only after every rank has written (a
barrier), and ``latest`` is replaced by a rename too. A run killed while saving therefore leaves every
existing checkpoint intact and at most a ``.partial`` folder, which resume never reads. A checkpoint resumes
only with the same TP degree (the shards are 1/T of each tensor); any DP and any CP degree works, as every
replica, and every rank of a CP group, holds the same weights and optimizer state.

Loading is collective: every rank reports whether its files read, so a truncated shard on one rank ends
every rank with a :class:`CheckpointError` naming the file, instead of the others waiting on a peer.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from mambalab.parallel.layout import ParallelLayout

__all__ = ["CheckpointError", "save_checkpoint", "load_checkpoint", "read_meta", "latest_step_dir",
           "complete_step_dirs"]

_STEP_DIR = re.compile(r"step_(\d{6,})")


class CheckpointError(RuntimeError):
    """A checkpoint file that is missing, empty, truncated or unreadable (the message names it)."""


def _shard_name(layout: ParallelLayout) -> str:
    return f"tp{layout.tp_rank}-of-{layout.tp}.pt"


def _barrier(layout: ParallelLayout) -> None:
    if layout.world_size > 1:
        dist.barrier()


def save_checkpoint(directory: str | Path, step: int, model, optimizer, layout: ParallelLayout, meta: dict) -> Path:
    """Write this rank's shard of step ``step`` (collective: every rank calls it); returns the step folder."""
    directory = Path(directory)
    folder = directory / f"step_{step:06d}"
    partial = directory / f".{folder.name}.partial"
    if layout.is_main:
        shutil.rmtree(partial, ignore_errors=True)      # what a killed save left behind
        partial.mkdir(parents=True)
    _barrier(layout)
    if layout.dp_rank == 0 and getattr(layout, "cp_rank", 0) == 0:
        torch.save({"step": step, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "rng": torch.get_rng_state()}, partial / _shard_name(layout))
    if layout.is_main:
        sizes = {"step": step, "tp": layout.tp, "cp": getattr(layout, "cp", 1), "dp": layout.dp}
        (partial / "meta.json").write_text(json.dumps({**sizes, **meta}, indent=2))
    _barrier(layout)
    if layout.is_main:
        if folder.exists():   # the same step saved again: move the old one aside before the new one lands
            old = directory / f".{folder.name}.old"
            shutil.rmtree(old, ignore_errors=True)
            folder.rename(old)
            partial.rename(folder)
            shutil.rmtree(old, ignore_errors=True)
        else:
            partial.rename(folder)
        tmp = directory / ".latest.tmp"
        tmp.write_text(folder.name)
        os.replace(tmp, directory / "latest")
    _barrier(layout)
    return folder


def complete_step_dirs(directory: str | Path) -> list[Path]:
    """Step folders of ``directory`` holding a ``meta.json``, oldest first (``.partial`` folders excluded)."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = [p for p in directory.iterdir() if _STEP_DIR.fullmatch(p.name) and (p / "meta.json").is_file()]
    return sorted(found, key=lambda p: int(p.name[5:]))


def latest_step_dir(directory: str | Path, warn=None) -> Path | None:
    """The checkpoint ``directory/latest`` names; if that marker is missing, empty or names no complete
    checkpoint, the newest complete step folder (saying so through ``warn``, default: a line on stderr);
    None when there is none."""
    directory = Path(directory)
    marker = directory / "latest"
    name = marker.read_text().strip() if marker.is_file() else ""
    if name and (directory / name / "meta.json").is_file():
        return directory / name
    found = complete_step_dirs(directory)
    if found and marker.exists():
        problem = "is empty" if not name else f"names {name!r}, which holds no complete checkpoint"
        message = f"mambalab.train: warning: {marker} {problem}; resuming from the newest complete one, {found[-1]}"
        (warn or (lambda text: print(text, file=sys.stderr, flush=True)))(message)
    return found[-1] if found else None


def read_meta(folder: str | Path) -> dict:
    """``folder/meta.json`` as a dict; :class:`CheckpointError` naming the file if it is missing or broken."""
    path = Path(folder) / "meta.json"
    try:
        text = path.read_text()
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read the checkpoint's meta data ({e.strerror or e})") from None
    if not text.strip():
        raise CheckpointError(f"{path}: the file is empty (a checkpoint write that did not finish?)")
    try:
        meta = json.loads(text)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: not valid JSON ({e.msg} at line {e.lineno}, column {e.colno}); the file "
                              f"is truncated or corrupt") from None
    if not isinstance(meta, dict) or not {"step", "tp", "config"} <= set(meta):
        raise CheckpointError(f"{path}: expected a JSON object with 'step', 'tp' and 'config'")
    return meta


def _read_shard(path: Path) -> dict:
    if not path.is_file():
        raise CheckpointError(f"{path}: missing (the checkpoint has no shard for this rank)")
    if path.stat().st_size == 0:
        raise CheckpointError(f"{path}: the file is empty (0 bytes)")
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:   # torch raises RuntimeError, EOFError, UnpicklingError … for a damaged file
        first = str(e).strip().splitlines()[0].split(". ")[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"{path}: truncated or corrupt ({path.stat().st_size} bytes; torch.load: "
                              f"{first})") from None
    if not isinstance(state, dict) or not {"step", "model", "optimizer", "rng"} <= set(state):
        raise CheckpointError(f"{path}: not a mambalab checkpoint shard (expected step, model, optimizer, rng)")
    return state


def _agree(layout: ParallelLayout, error: Exception | None) -> None:
    """Collective: raise on every rank if any rank failed; with several ranks, each message starts with the
    rank, and a rank whose own files read says which rank failed and why."""
    if layout.world_size > 1:
        errors = [None] * layout.world_size
        dist.all_gather_object(errors, None if error is None else str(error))
        failed = [(r, msg) for r, msg in enumerate(errors) if msg is not None]
        if failed and error is None:
            raise CheckpointError(f"rank {layout.rank}: stopping, as " + "; ".join(
                f"rank {r} cannot load its checkpoint: {msg}" for r, msg in failed))
        if error is not None:
            raise type(error)(f"rank {layout.rank}: {error}")
    if error is not None:
        raise error


def load_checkpoint(folder: str | Path, model, optimizer, layout: ParallelLayout) -> int:
    """Load this rank's shard into model and optimizer (collective); returns the step it was saved at.

    Raises :class:`CheckpointError` on every rank, naming the file, when any rank's files are damaged."""
    folder = Path(folder)
    path = folder / _shard_name(layout)
    error, state = None, None
    try:
        meta = read_meta(folder)
        if meta["tp"] != layout.tp:
            raise ValueError(f"checkpoint {folder} was saved with tp = {meta['tp']}; this run has tp = {layout.tp} "
                             f"(shards only load with the same tensor-parallel degree)")
        state = _read_shard(path)
    except (CheckpointError, ValueError) as e:
        error = e
    _agree(layout, error)
    error = None
    try:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
    except (RuntimeError, ValueError, KeyError) as e:
        first = str(e).strip().splitlines()[0]
        error = CheckpointError(f"{path}: does not fit this model ({first})")
    _agree(layout, error)
    torch.set_rng_state(state["rng"])
    return int(state["step"])
