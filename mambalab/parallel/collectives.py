"""Autograd-aware collectives: the four communication patterns of Megatron-style tensor parallelism.

Each is a pair (forward, backward) whose backward is the forward's adjoint, so autograd differentiates
through it. With TP ranks 0..T-1 of one tensor-parallel group:

    copy_to_tp(x)                 forward: identity          backward: all-reduce (sum) of the gradients
    reduce_from_tp(x)             forward: all-reduce (sum)  backward: identity
    gather_along(x, dim)          forward: all-gather, concatenating the T shards along ``dim``
                                  backward: reduce-scatter: sum the T full gradients, keep this rank's shard
    reduce_scatter_along(x, dim)  forward: reduce-scatter along ``dim``
                                  backward: all-gather along ``dim``

Why these pairs: if every rank computes y_r = f_r(x) from the same x (a column-parallel layer), then
dL/dx = Σ_r dL/dy_r · ∂f_r/∂x needs the sum over ranks (copy_to_tp). If the output is the sum of partial
results y = Σ_r y_r (a row-parallel layer), each y_r's gradient is dL/dy itself (reduce_from_tp). The
sequence-parallel pair replaces the all-reduce by a reduce-scatter plus an all-gather, which move the same
bytes but leave activations between layers split along the sequence.

Gloo (the CPU backend) has no reduce-scatter: there it is an all-reduce followed by taking this rank's
slice, with the same result and more traffic. NCCL uses the real collective.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["copy_to_tp", "reduce_from_tp", "gather_along", "reduce_scatter_along", "all_gather_cat", "group_size",
           "reduce_scatter"]


def group_size(group) -> int:
    """Ranks in ``group`` (1 when torch.distributed is not initialised: a single process)."""
    return dist.get_world_size(group) if dist.is_initialized() else 1


def all_gather_cat(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Concatenate every rank's ``x`` (same shape on all ranks) along ``dim``, in rank order."""
    world = group_size(group)
    if world == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def reduce_scatter(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Sum ``x`` over ranks and keep rank r's r-th of T equal slices along ``dim``."""
    world = group_size(group)
    if world == 1:
        return x
    if x.shape[dim] % world:
        raise ValueError(f"reduce-scatter along dim {dim}: size {x.shape[dim]} is not divisible by the "
                         f"{world} ranks of the group")
    rank = dist.get_rank(group)
    if dist.get_backend(group) == "nccl":
        moved = x.movedim(dim, 0).contiguous()                       # reduce_scatter_tensor splits dim 0
        out = torch.empty_like(moved[: moved.shape[0] // world])
        dist.reduce_scatter_tensor(out, moved, group=group)
        return out.movedim(0, dim).contiguous()
    total = x.contiguous()
    dist.all_reduce(total, group=group)                              # gloo: no reduce-scatter
    return total.chunk(world, dim=dim)[rank].contiguous()


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        if group_size(ctx.group) > 1:
            dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous().clone()
        if group_size(group) > 1:
            dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherAlong(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return all_gather_cat(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter(grad, ctx.dim, ctx.group), None, None


class _ReduceScatterAlong(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return reduce_scatter(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_cat(grad.contiguous(), ctx.dim, ctx.group), None, None


def copy_to_tp(x: torch.Tensor, group=None) -> torch.Tensor:
    """Identity forward, all-reduce backward: enter a region where each rank computes from the same x."""
    return _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group=None) -> torch.Tensor:
    """All-reduce (sum) forward, identity backward: leave a region of partial sums."""
    return _ReduceFromTP.apply(x, group)


def gather_along(x: torch.Tensor, dim: int, group=None) -> torch.Tensor:
    """All-gather forward, reduce-scatter backward: (…, l / T, …) -> (…, l, …) along ``dim``."""
    return _GatherAlong.apply(x, dim, group)


def reduce_scatter_along(x: torch.Tensor, dim: int, group=None) -> torch.Tensor:
    """Reduce-scatter forward, all-gather backward: partial sums (…, l, …) -> summed shard (…, l / T, …)."""
    return _ReduceScatterAlong.apply(x, dim, group)
