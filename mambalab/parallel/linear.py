"""Column- and row-parallel linear layers (Megatron-LM's split of Y = X Wᵀ + b over T ranks).

With W of shape (out, in) as in ``nn.Linear``:

* **ColumnParallelLinear** splits W by output features: rank r holds W_r (out / T, in) and b_r, and computes
  Y_r = X W_rᵀ + b_r, its out / T columns of Y. Every rank needs all of X:

      forward:  X --copy_to_tp--> X W_rᵀ + b_r          (no communication)
      backward: dX = Σ_r dY_r W_r                         (all-reduce, inside copy_to_tp)

* **RowParallelLinear** splits W by input features: rank r holds W_r (out, in / T) and reads its own
  in / T features X_r (what a column-parallel layer left it), so Y = Σ_r X_r W_rᵀ + b:

      forward:  Y = all-reduce(X_r W_rᵀ [+ b on rank 0])   (all-reduce, inside reduce_from_tp)
      backward: dX_r = dY W_r                              (no communication)

  The bias lives on TP rank 0 alone and enters the sum once; giving every rank a copy would add it T times
  (or need a replicated parameter whose copies must be kept equal). Initialised on rank 0, it reaches the
  other ranks through the all-reduce of every forward, which broadcasts its contribution; the parameters
  every rank does hold whole are made equal at start by
  :func:`mambalab.parallel.sharding.broadcast_parameters`.

Column followed by row is one all-reduce forward and one backward for the pair. In sequence-parallel mode
(``sequence_parallel=True``) activations outside the pair are split along the sequence (dim 1 of
(b, l, d)): the column layer all-gathers them (reduce-scatter in the backward) and the row layer
reduce-scatters its output (all-gather in the backward): the same bytes as one all-reduce.

Both initialise W like ``nn.Linear`` would for the full layer (uniform ±1/sqrt(in), with the full in).
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from mambalab.parallel.collectives import copy_to_tp, gather_along, reduce_from_tp, reduce_scatter_along
from mambalab.parallel.layout import ParallelLayout, check_divides, single_process_layout
from mambalab.parallel.sharding import RANK0, Sharded, contiguous_block

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "SEQUENCE_DIM"]

SEQUENCE_DIM = 1  # activations are (b, l, d)


def _init_uniform(t: torch.Tensor, fan_in: int) -> None:
    bound = 1.0 / math.sqrt(fan_in) if fan_in > 0 else 0.0
    with torch.no_grad():
        t.uniform_(-bound, bound)


class ColumnParallelLinear(nn.Module):
    """x (…, in) -> this rank's outputs (…, out / T); see the module docstring.

    Args:
        in_features, out_features: of the full layer; T must divide out_features.
        bias: give each rank its out / T entries of b.
        layout: the run's :class:`ParallelLayout` (default: one process).
        sequence_parallel: x arrives split along dim 1; all-gather it first.
        row_index: optionally, which rows of the full W rank r holds (a function r -> LongTensor); default a
            contiguous block. Only :func:`mambalab.parallel.sharding` reads it.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, layout: ParallelLayout | None = None,
                 sequence_parallel: bool = False, row_index=None, device=None, dtype=None):
        super().__init__()
        self.layout = layout or single_process_layout()
        tp = self.layout.tp
        check_divides(tp, out_features=out_features)
        self.in_features, self.out_features = in_features, out_features
        self.sequence_parallel = sequence_parallel
        self.row_index = row_index or contiguous_block(out_features, tp)
        self.weight = nn.Parameter(torch.empty(out_features // tp, in_features, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(out_features // tp, device=device, dtype=dtype)) if bias else None
        _init_uniform(self.weight, in_features)
        if self.bias is not None:
            _init_uniform(self.bias, in_features)

    def shard_specs(self):
        specs = {"weight": Sharded(0, self.row_index)}
        if self.bias is not None:
            specs["bias"] = Sharded(0, self.row_index)
        return specs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        group = self.layout.tp_group
        x = gather_along(x, SEQUENCE_DIM, group) if self.sequence_parallel else copy_to_tp(x, group)
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features} "
                f"(this rank: {self.weight.shape[0]}), bias={self.bias is not None}, "
                f"sequence_parallel={self.sequence_parallel}")


class RowParallelLinear(nn.Module):
    """This rank's inputs (…, in / T) -> y (…, out), summed over ranks; see the module docstring.

    Args:
        in_features, out_features: of the full layer; T must divide in_features.
        bias: a bias (out,) held by TP rank 0 only.
        layout: the run's :class:`ParallelLayout` (default: one process).
        sequence_parallel: reduce-scatter the output along dim 1 instead of all-reducing it.
        col_index: optionally, which columns of the full W rank r holds (r -> LongTensor).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, layout: ParallelLayout | None = None,
                 sequence_parallel: bool = False, col_index=None, device=None, dtype=None):
        super().__init__()
        self.layout = layout or single_process_layout()
        tp = self.layout.tp
        check_divides(tp, in_features=in_features)
        self.in_features, self.out_features = in_features, out_features
        self.sequence_parallel = sequence_parallel
        self.col_index = col_index or contiguous_block(in_features, tp)
        self.weight = nn.Parameter(torch.empty(out_features, in_features // tp, device=device, dtype=dtype))
        _init_uniform(self.weight, in_features)
        self.has_bias = bias
        if bias and self.layout.tp_rank == 0:
            self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype))
            _init_uniform(self.bias, in_features)
        else:
            self.register_parameter("bias", None)

    def shard_specs(self):
        specs = {"weight": Sharded(1, self.col_index)}
        if self.bias is not None:
            specs["bias"] = RANK0
        return specs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)   # partial sum; the bias only on rank 0
        group = self.layout.tp_group
        return reduce_scatter_along(y, SEQUENCE_DIM, group) if self.sequence_parallel else reduce_from_tp(y, group)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features} (this rank: {self.weight.shape[1]}), "
                f"out_features={self.out_features}, bias={self.has_bias} (on TP rank 0), "
                f"sequence_parallel={self.sequence_parallel}")
