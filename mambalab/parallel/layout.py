"""The 3-D layout of a run: tensor parallelism (TP), context parallelism (CP) and data parallelism (DP).

torchrun starts ``WORLD_SIZE`` = DP · CP · TP processes and gives each ``RANK`` and ``LOCAL_RANK``. With
TP = T and CP = K, global rank r sits at

    tp_rank = r mod T,    cp_rank = (r div T) mod K,    dp_rank = r div (T · K)

so TP varies fastest: the T ranks of one TP group are consecutive, and with ``--nproc_per_node T`` (or a
multiple) they share a node, where the all-reduce of every layer stays on NVLink. The K ranks of a CP group
come next (each holds one contiguous piece of every sequence, in cp_rank order; between them pass the SSD's
state and the convolution's halo, once per layer, and one gradient sum per step), and the DP groups span the
rest (one gradient all-reduce per step). Each rank belongs to three groups, every rank building all of them in
one order:

    TP group  {(d · K + k) · T + t : t < T}      same dp_rank and cp_rank
    CP group  {(d · K + k) · T + t : k < K}      same dp_rank and tp_rank
    DP group  {(d · K + k) · T + t : d < DP}     same cp_rank and tp_rank

With CP = 1 this is the 2-D layout, rank r at tp_rank = r mod T, dp_rank = r div T.

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
    """Where this process sits: ranks and sizes of its TP, DP and CP groups (groups None in one process)."""

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
    cp: int = 1
    cp_rank: int = 0
    cp_group: object = None

    @property
    def is_main(self) -> bool:
        """The rank that prints, logs and writes shared files."""
        return self.rank == 0

    def device(self) -> torch.device:
        """This rank's GPU (cuda:local_rank) with NCCL, or in one process when CUDA is available; else the CPU."""
        on_gpu = self.backend == "nccl" or (self.backend == "none" and torch.cuda.is_available())
        return torch.device("cuda", self.local_rank) if on_gpu else torch.device("cpu")


def single_process_layout() -> ParallelLayout:
    """TP = CP = DP = 1, no process group."""
    return ParallelLayout(world_size=1, rank=0, tp=1, dp=1, tp_rank=0, dp_rank=0, local_rank=0)


def check_divides(tp: int, **sizes: int) -> None:
    """Raise ValueError naming the first size that TP does not divide, e.g. check_divides(4, nheads=6)."""
    for name, size in sizes.items():
        if size % tp:
            raise ValueError(f"tensor-parallel degree tp = {tp} must divide {name} = {size}: each rank holds "
                             f"{name} / tp of them")


def layout_from_env(tp: int, dp: int | None = None, env=os.environ, cp: int = 1) -> tuple[int, int, int, int]:
    """(world_size, rank, local_rank, dp) from torchrun's variables, checking world_size == tp · cp · dp."""
    for name, size in (("tp", tp), ("cp", cp)):
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"{name} must be a positive int; got {size!r}")
    world = int(env.get("WORLD_SIZE", "1"))
    rank = int(env.get("RANK", "0"))
    local_rank = int(env.get("LOCAL_RANK", "0"))
    inner, what = tp * cp, ("tp" if cp == 1 else "tp × cp")
    if dp is None:
        if world % inner:
            raise ValueError(f"world size {world} (WORLD_SIZE from torchrun) is not a multiple of {what} = {inner}; "
                             f"it must equal {what} × dp")
        dp = world // inner
    if inner * dp != world:
        sizes = f"{tp} × {dp}" if cp == 1 else f"{tp} × {cp} × {dp}"
        raise ValueError(f"world size {world} (WORLD_SIZE) != {what} × dp = {sizes} = {inner * dp}")
    return world, rank, local_rank, dp


def import_group_capturing_modules() -> None:
    """Import, before any process group exists, the torch module known to keep the default group alive.

    ``ShardedGradScaler.__init__`` takes ``process_group: ProcessGroup | None = dist.group.WORLD``
    (torch 2.13's ``torch/distributed/fsdp/sharded_grad_scaler.py``), a default evaluated once, when the
    module is first imported; constructing an optimizer imports ``torch._dynamo``, which imports that module. First
    imported after ``init_process_group``, the default holds the world group past ``destroy_process_group``, and
    with gloo its worker threads still run when the interpreter exits, where a rank can abort ("terminate called
    without an active exception"). Imported first, the default is None. ``tests/distributed/test_faults.py``
    checks that a trainer run leaves no gloo thread behind."""
    import torch.distributed.fsdp.sharded_grad_scaler  # noqa: F401


def init_distributed(tp: int, dp: int | None = None, backend: str | None = None,
                     timeout_s: float = 60.0, cp: int = 1) -> ParallelLayout:
    """Start the process group from torchrun's environment and return this rank's layout.

    backend: "nccl" when CUDA is available, else "gloo", unless given. timeout_s bounds how long any
    collective waits for a missing peer before raising (the trainer turns that into a clear error).
    cp: ranks per context-parallel group (module docstring: the rank order). Without torchrun (no
    WORLD_SIZE) and tp = cp = 1, returns :func:`single_process_layout`.
    """
    world, rank, local_rank, dp = layout_from_env(tp, dp, cp=cp)
    if world == 1 and not dist.is_initialized():
        return single_process_layout()
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
    if not dist.is_initialized():
        import_group_capturing_modules()
        # NCCL only honours the timeout with async error handling on (the default in recent torch).
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
        kw = {"device_id": torch.device("cuda", local_rank)} if backend == "nccl" else {}
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s), **kw)
    at = lambda d, k, t: (d * cp + k) * tp + t   # the module docstring's rank order
    tp_rank, cp_rank, dp_rank = rank % tp, (rank // tp) % cp, rank // (tp * cp)
    # Every rank must create every group, in the same order: the TP groups, the DP groups, then the CP groups.
    mine = {}

    def build(kind: str, all_members) -> None:
        for ranks in all_members:
            g = dist.new_group(ranks)
            if rank in ranks:
                mine[kind] = g

    build("tp", ([at(d, k, t) for t in range(tp)] for d in range(dp) for k in range(cp)))
    build("dp", ([at(d, k, t) for d in range(dp)] for k in range(cp) for t in range(tp)))
    if cp > 1:   # (with CP = 1 the groups, and their order, are the 2-D layout's)
        build("cp", ([at(d, k, t) for k in range(cp)] for d in range(dp) for t in range(tp)))
    return ParallelLayout(world_size=world, rank=rank, tp=tp, dp=dp, tp_rank=tp_rank, dp_rank=dp_rank,
                          local_rank=local_rank, tp_group=mine["tp"], dp_group=mine["dp"], backend=backend,
                          cp=cp, cp_rank=cp_rank, cp_group=mine.get("cp"))
