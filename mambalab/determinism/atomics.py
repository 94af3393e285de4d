"""An atomic-add sum and the order in which its programs' adds land.

:func:`atomic_sum` launches :func:`mambalab.kernels.atomic_sum.atomic_sum_kernel` (each program sums its block
and ``tl.atomic_add``\\ s the partial into one total) and recovers the order in which the programs' adds landed
from the values ``tl.atomic_add`` returned; :func:`fold_in_order` is its reference (a left fold of the partials
in that order must give the total's exact bits).

On a CPU, Triton's interpreter runs programs one after another in launch order, so atomics are as
deterministic there as anything else; run-to-run variation on a CPU only exists under
:func:`mambalab.determinism.shuffled_program_order`, which is a simulation and is labelled so wherever it is used.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mambalab import device
from mambalab.determinism.float_sums import ordered_sum
from mambalab.kernels.atomic_sum import atomic_total

__all__ = ["AtomicSumRun", "atomic_sum", "fold_in_order"]


@dataclass(frozen=True)
class AtomicSumRun:
    """One launch of :func:`mambalab.kernels.atomic_sum.atomic_sum_kernel`: the total, each program's partial,
    and the landing order (``order[k]`` = the program whose add landed k-th, recovered from the values the
    atomics returned)."""

    total: torch.Tensor
    partials: torch.Tensor
    order: list[int]


def fold_in_order(partials: torch.Tensor, order: Sequence[int]) -> torch.Tensor:
    """The reference for :func:`mambalab.kernels.atomic_sum.atomic_sum_kernel`: 0 + partials[order[0]] +
    partials[order[1]] + … in fp32."""
    return ordered_sum(partials.detach().cpu(), order, torch.float32)


def _landing_order(partials: torch.Tensor, olds: torch.Tensor) -> list[int]:
    """Chain the programs: the first found the total at 0, the next found 0 + first partial, and so on.
    Ties (two programs that found the same total, possible only when a partial rounds away) go to the lower
    program id; fold_in_order then still reproduces the total's bits."""
    partials, olds = partials.cpu(), olds.cpu()
    remaining = list(range(partials.numel()))
    acc = torch.zeros((), dtype=torch.float32)
    order = []
    while remaining:
        match = [i for i in remaining if olds[i].view(torch.int32) == acc.view(torch.int32)]
        if not match:
            raise RuntimeError("atomic_sum: the values returned by the atomics do not chain; "
                               "another launch wrote to the same total")
        i = match[0]
        order.append(i)
        remaining.remove(i)
        acc = acc + partials[i]
    return order


def atomic_sum(x: torch.Tensor, block: int = 4) -> AtomicSumRun:
    """Sum the fp32 vector ``x`` with :func:`mambalab.kernels.atomic_sum.atomic_sum_kernel`, ``block`` values
    per program.

    On a GPU the landing order is the hardware's; on the CPU interpreter it is launch order, unless the call
    sits inside :func:`mambalab.determinism.shuffled_program_order` (a seeded simulation)."""
    if not isinstance(x, torch.Tensor) or x.dim() != 1 or x.dtype != torch.float32 or x.numel() == 0:
        raise ValueError(f"x must be a non-empty 1-d fp32 tensor; got {getattr(x, 'shape', type(x))}")
    if block < 1 or block & (block - 1):
        raise ValueError(f"block must be a positive power of two; got {block}")
    device.ensure_kernel_device(x.device)
    total, partials, olds = atomic_total(x, block)
    return AtomicSumRun(total[0].cpu(), partials.cpu(), _landing_order(partials, olds))
