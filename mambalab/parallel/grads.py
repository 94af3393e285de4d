"""The gradient all-reduces a training step needs after backward, besides those inside the layers.

* **Sequence parallelism**: a parameter every TP rank holds whole (a norm weight) saw only this rank's
  l / T tokens, so its gradient is a partial sum: all-reduce it over the TP group.
* **Data parallelism**: each DP replica saw different sequences: average every gradient over the DP group.

Both flatten the gradients into one buffer per dtype so each is one collective, not one per parameter.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from mambalab.parallel.layout import ParallelLayout

__all__ = ["allreduce_replicated_grads", "allreduce_data_parallel_grads"]


def _allreduce_flat(params, group, scale: float = 1.0) -> None:
    grads = [p.grad for p in params if p.grad is not None]
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    for same in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in same])
        dist.all_reduce(flat, group=group)
        if scale != 1.0:
            flat.mul_(scale)
        offset = 0
        for g in same:
            g.copy_(flat[offset: offset + g.numel()].view_as(g))
            offset += g.numel()


def allreduce_replicated_grads(params, layout: ParallelLayout) -> None:
    """Sum the gradients of TP-replicated parameters over the TP group (needed in sequence-parallel mode)."""
    if layout.tp > 1:
        _allreduce_flat(list(params), layout.tp_group)


def allreduce_data_parallel_grads(model: torch.nn.Module, layout: ParallelLayout) -> None:
    """Average every gradient over the DP group."""
    if layout.dp > 1:
        _allreduce_flat(list(model.parameters()), layout.dp_group, scale=1.0 / layout.dp)
