"""The 2-D layout of a run: tensor parallelism (TP) inside a node, data parallelism (DP) across nodes.

torchrun starts ``WORLD_SIZE`` processes and gives each ``RANK`` and ``LOCAL_RANK``. With TP = T and
DP = W / T, global rank r sits at

    tp_rank = r mod T,    dp_rank = r div T

so the T ranks of one TP group are consecutive: with ``--nproc_per_node T`` they are one node's GPUs
(the all-reduce of every layer stays on NVLink) and the DP groups span nodes (one gradient all-reduce per
step crosses the network). Each rank belongs to one TP group {dp_rank·T + i} and one DP group
{j·T + tp_rank}.

:func:`init_distributed` starts the process group with a timeout (a collective that waits longer than
that for a peer raises instead of hanging) and builds the groups.
"""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["ParallelLayout", "check_divides", "init_distributed", "single_process_layout"]


@dataclass(frozen=True)
class ParallelLayout:
    """Where this process sits: ranks and sizes of its TP and DP groups (groups None in one process)."""

    world_size: int
    rank: int
    tp: int
    dp: int
    tp_rank: int
    dp_rank: int
    local_rank: int
    tp_group: object = None
    dp_group: object = None
    backend: str = "none"

    @property
    def is_main(self) -> bool:
        """The rank that prints, logs and writes shared files."""
        return self.rank == 0

    def device(self) -> torch.device:
        """This rank's GPU (cuda:local_rank) with NCCL, or in one process when CUDA is available; else the CPU."""
        on_gpu = self.backend == "nccl" or (self.backend == "none" and torch.cuda.is_available())
        return torch.device("cuda", self.local_rank) if on_gpu else torch.device("cpu")


def single_process_layout() -> ParallelLayout:
    """TP = DP = 1, no process group."""
    return ParallelLayout(world_size=1, rank=0, tp=1, dp=1, tp_rank=0, dp_rank=0, local_rank=0)


def check_divides(tp: int, **sizes: int) -> None:
    """Raise ValueError naming the first size that TP does not divide, e.g. check_divides(4, nheads=6)."""
    for name, size in sizes.items():
        if size % tp:
            raise ValueError(f"tensor-parallel degree tp = {tp} must divide {name} = {size}: each rank holds "
                             f"{name} / tp of them")


def layout_from_env(tp: int, dp: int | None = None, env=os.environ) -> tuple[int, int, int, int]:
    """(world_size, rank, local_rank, dp) from torchrun's variables, checking world_size == tp · dp."""
    if not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp must be a positive int; got {tp!r}")
    world = int(env.get("WORLD_SIZE", "1"))
    rank = int(env.get("RANK", "0"))
    local_rank = int(env.get("LOCAL_RANK", "0"))
    if dp is None:
        if world % tp:
            raise ValueError(f"world size {world} (WORLD_SIZE from torchrun) is not a multiple of tp = {tp}; "
                             f"it must equal tp × dp")
        dp = world // tp
    if tp * dp != world:
        raise ValueError(f"world size {world} (WORLD_SIZE) != tp × dp = {tp} × {dp} = {tp * dp}")
    return world, rank, local_rank, dp


def init_distributed(tp: int, dp: int | None = None, backend: str | None = None,
                     timeout_s: float = 60.0) -> ParallelLayout:
    """Start the process group from torchrun's environment and return this rank's layout.

    backend: "nccl" when CUDA is available, else "gloo", unless given. timeout_s bounds how long any
    collective waits for a missing peer before raising (the trainer turns that into a clear error).
    Without torchrun (no WORLD_SIZE) and tp = 1, returns :func:`single_process_layout`.
    """
    world, rank, local_rank, dp = layout_from_env(tp, dp)
    if world == 1 and not dist.is_initialized():
        return single_process_layout()
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
    if not dist.is_initialized():
        # NCCL only honours the timeout with async error handling on (the default in recent torch).
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
        kw = {"device_id": torch.device("cuda", local_rank)} if backend == "nccl" else {}
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s), **kw)
    tp_group = dp_group = None
    # Every rank must create every group, in the same order.
    for d in range(dp):
        ranks = list(range(d * tp, (d + 1) * tp))
        g = dist.new_group(ranks)
        if rank in ranks:
            tp_group = g
    for t in range(tp):
        ranks = list(range(t, world, tp))
        g = dist.new_group(ranks)
        if rank in ranks:
            dp_group = g
    return ParallelLayout(world_size=world, rank=rank, tp=tp, dp=dp, tp_rank=rank % tp, dp_rank=rank // tp,
                          local_rank=local_rank, tp_group=tp_group, dp_group=dp_group, backend=backend)
