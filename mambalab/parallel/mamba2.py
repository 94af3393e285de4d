"""The tensor-parallel Mamba-2 mixer: heads and groups split over T ranks, one all-reduce per layer.

Mamba-2's block is laid out by heads and groups (see :mod:`mambalab.modules.mamba2`): in_proj's outputs are
z, x (per head), B, C (per group) and dt (per head); the conv, the SSD and the gated norm act on each head
or group separately; only out_proj mixes heads. So rank r takes h / T heads and the g / T groups they read
(head i reads group i // (h/g), so whole groups come with their heads) and

    in_proj   column-parallel: its rows of z, x, B, C and dt           forward: none    backward: all-reduce
    conv1d    its x, B, C channels                                      none
    SSD       its heads (A_log, D, dt_bias sliced)                      none
    norm      its groups (the RMS is per group: no all-reduce)          none
    out_proj  row-parallel over its d_inner / T channels               forward: all-reduce  backward: none

one all-reduce forward and one backward per layer (a reduce-scatter and an all-gather each way in
sequence-parallel mode). Mamba-1 needs more: its x_proj maps all d_inner channels to (dt, B, C) shared by
every channel, so B and C must be all-reduced inside the layer (see the notebook's count).

The class is :class:`Mamba2` itself, built with this rank's d_inner / T channels and g / T groups, whose
in_proj and out_proj are swapped for the parallel layers. T must divide the heads and the groups.
"""
from __future__ import annotations

import torch

from mambalab.modules.mamba2 import Mamba2
from mambalab.parallel.layout import ParallelLayout, check_divides
from mambalab.parallel.linear import ColumnParallelLinear, RowParallelLinear
from mambalab.parallel.sharding import Sharded

__all__ = ["TensorParallelMamba2", "mamba2_shard_index"]


def mamba2_shard_index(d_inner: int, ngroups: int, d_state: int, nheads: int, tp: int):
    """(in_proj rows, conv channels, d_inner channels, heads): functions r -> LongTensor of the full block's
    positions that rank r holds, in the order the shard's own split_sizes() expects."""
    gn = ngroups * d_state

    def block(size, r, offset=0):
        share = size // tp
        return torch.arange(offset + r * share, offset + (r + 1) * share)

    def in_rows(r):   # z | x | B | C | dt
        return torch.cat([block(d_inner, r), block(d_inner, r, d_inner), block(gn, r, 2 * d_inner),
                          block(gn, r, 2 * d_inner + gn), block(nheads, r, 2 * d_inner + 2 * gn)])

    def conv_channels(r):   # x | B | C
        return torch.cat([block(d_inner, r), block(gn, r, d_inner), block(gn, r, d_inner + gn)])

    return in_rows, conv_channels, (lambda r: block(d_inner, r)), (lambda r: block(nheads, r))


class TensorParallelMamba2(Mamba2):
    """This rank's share of a :class:`Mamba2` block: (b, l, d_model) -> (b, l, d_model), summed over ranks.

    With ``sequence_parallel`` it maps (b, l / T, d_model) -> (b, l / T, d_model). Arguments as
    :class:`Mamba2` (sizes of the full block), plus ``layout`` (:class:`ParallelLayout`)."""

    def __init__(self, d_model: int, layout: ParallelLayout, sequence_parallel: bool = False, d_state=128,
                 expand=2, headdim=64, ngroups=1, bias=False, device=None, dtype=None, **kwargs):
        tp = layout.tp
        d_inner = int(expand * d_model)
        if d_inner % headdim:
            raise ValueError(f"headdim = {headdim} must divide d_inner = expand · d_model = {d_inner}")
        nheads = d_inner // headdim
        check_divides(tp, nheads=nheads, ngroups=ngroups)
        super().__init__(d_model, d_state=d_state, expand=expand, headdim=headdim, ngroups=ngroups // tp,
                         bias=bias, device=device, dtype=dtype, d_inner=d_inner // tp, **kwargs)
        self.layout, self.sequence_parallel = layout, sequence_parallel
        self.full_d_inner, self.full_ngroups, self.full_nheads = d_inner, ngroups, nheads
        in_rows, self._conv_index, self._channel_index, self._head_index = mamba2_shard_index(
            d_inner, ngroups, d_state, nheads, tp)
        factory = {"device": device, "dtype": dtype}
        self.in_proj = ColumnParallelLinear(d_model, tp * sum(self.split_sizes()), bias=bias, layout=layout,
                                            sequence_parallel=sequence_parallel, row_index=in_rows, **factory)
        self.out_proj = RowParallelLinear(d_inner, d_model, bias=bias, layout=layout,
                                          sequence_parallel=sequence_parallel, col_index=self._channel_index,
                                          **factory)

    def shard_specs(self):
        specs = {name: Sharded(0, self._head_index) for name in ("A_log", "D", "dt_bias")}
        specs["conv1d.weight"] = specs["conv1d.bias"] = Sharded(0, self._conv_index)
        specs["norm.weight"] = Sharded(0, self._channel_index)
        return specs

    def forward(self, u: torch.Tensor, cache=None) -> torch.Tensor:
        if cache is not None:
            raise NotImplementedError("TensorParallelMamba2 does not decode with a cache; use Mamba2")
        return super().forward(u)

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()} [this rank's share: full d_inner={self.full_d_inner}, "
                f"nheads={self.full_nheads}, ngroups={self.full_ngroups}, tp={self.layout.tp}, "
                f"sequence_parallel={self.sequence_parallel}]")
