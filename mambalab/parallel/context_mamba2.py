"""The context-parallel Mamba-2 mixer and language model: every sequence cut into K contiguous pieces, one per rank
of a context-parallel (CP) group, on top of tensor parallelism (TP) inside each piece.

Rank k of the CP group holds positions [k · l / K, (k + 1) · l / K) of every sequence (:mod:`mambalab.parallel.
layout`: the rank order). Of the block's steps (:mod:`mambalab.modules.mamba2`) most act on each position alone
and run on the piece as they are:

    in_proj, out_proj     per token (column- and row-parallel over TP)     TP's all-reduce, nothing over CP
    conv1d                reads the d_conv - 1 inputs before each position  CP: the halo, forward and backward
    SSD                   the state runs along the whole sequence           CP: the state ring, forward and backward
    gated norm            per token (the RMS is over channels)              nothing over CP

so the two collectives over the CP group are :func:`mambalab.parallel.context.context_parallel_conv1d`'s halo and
:func:`mambalab.parallel.context.context_parallel_ssd`'s ring, with packed sequences (``seq_idx``) across the
cuts as one process has them. With sequence parallelism the residual stream between the blocks holds 1/T of
this rank's piece on each TP rank, and in_proj gathers the piece (:mod:`mambalab.parallel.linear`).

Every parameter is whole on each CP rank (TP shards it as :class:`~mambalab.parallel.mamba2.TensorParallelMamba2`
does), and its gradient there is the part from this rank's piece: the trainer sums them over the CP group.

The language model's loss on a CP rank is Σ (its tokens' cross-entropy) / (the target count of the whole
sequences, summed over the CP group), so the sum of the CP ranks' losses, and of their gradients, is the mean
over every token. The SSD here is the Triton kernels' (the ring runs their steps); ``scan="reference"`` is
refused.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from mambalab.modules.lm import LMConfig
from mambalab.modules.mamba2 import Mamba2
from mambalab.parallel.context import context_parallel_conv1d, context_parallel_ssd, sum_over_ranks
from mambalab.parallel.layout import ParallelLayout
from mambalab.parallel.lm import TensorParallelMambaLM
from mambalab.parallel.mamba2 import TensorParallelMamba2
from mambalab.parallel.vocab import IGNORE_INDEX, vocab_parallel_cross_entropy

__all__ = ["ContextParallelMamba2", "ContextParallelMambaLM", "sum_context_parallel_grads"]


class ContextParallelMamba2(TensorParallelMamba2):
    """This rank's piece of the sequence and share of the heads of a :class:`~mambalab.modules.mamba2.Mamba2`
    block: u (b, l_k, d_model) -> (b, l_k, d_model), l_k this rank's piece (module docstring).

    Arguments as :class:`~mambalab.parallel.mamba2.TensorParallelMamba2` (sizes of the full block, and
    ``layout`` with its ``cp`` and ``cp_group``). Parameter names and shapes are TensorParallelMamba2's, so a
    state dict moves between the two, and between CP degrees. With ``layout.cp`` = 1 it is that block.
    """

    def __init__(self, d_model: int, layout: ParallelLayout, sequence_parallel: bool = False, **kwargs):
        if kwargs.get("scan", "kernel") != "kernel":
            raise ValueError(f"scan must be 'kernel' for a context-parallel block (the ring runs the SSD kernels' "
                             f"steps); got {kwargs['scan']!r}")
        super().__init__(d_model, layout, sequence_parallel, **kwargs)

    def forward(self, u: torch.Tensor, seq_idx: torch.Tensor | None = None) -> torch.Tensor:
        """u (b, l_k, d_model) -> (b, l_k, d_model). seq_idx (b, l_k) or None: this piece of the packed
        sequences' indices (nonnegative, nondecreasing along the whole sequence; given on every rank or none).
        Mamba2's forward, whose conv (:meth:`_conv`) and SSD (:meth:`_scan`) this block passes across the cuts."""
        return Mamba2.forward(self, u, seq_idx=seq_idx)   # TensorParallelMamba2.forward takes no seq_idx

    def _conv(self, xBC, conv_state=None, seq_idx=None):
        if self.layout.cp == 1:
            return super()._conv(xBC, conv_state, seq_idx)
        if conv_state is not None:
            raise NotImplementedError("ContextParallelMamba2 does not decode with a cache; use Mamba2")
        return context_parallel_conv1d(xBC, self.conv1d.weight[:, 0], self.conv1d.bias, "silu", seq_idx=seq_idx,
                                       group=self.layout.cp_group)

    def _scan(self, x, dt, A, B, C, z, return_final_states: bool, seq_idx=None, cu_seqlens=None):
        if self.layout.cp == 1:
            return super()._scan(x, dt, A, B, C, z, return_final_states, seq_idx, cu_seqlens)
        return context_parallel_ssd(x, dt, A, B, C, self.chunk_size, D=self._skip().float(), z=z,
                                    dt_bias=self.dt_bias.float(), dt_softplus=True, dt_limit=self.dt_limit,
                                    reduction=self.reduction, seq_idx=seq_idx, group=self.layout.cp_group)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()} [cp={self.layout.cp}]"


class ContextParallelMambaLM(TensorParallelMambaLM):
    """:class:`~mambalab.parallel.lm.TensorParallelMambaLM` with :class:`ContextParallelMamba2` mixers: ids
    (b, l_k), this rank's piece of every sequence -> this rank's logits (b, l_k, vocab_size / T). The same
    parameter names, so checkpoints move between CP degrees."""

    def __init__(self, config: LMConfig, layout: ParallelLayout, sequence_parallel: bool = False, device=None,
                 dtype=None):
        super().__init__(config, layout, sequence_parallel, device=device, dtype=dtype)
        for layer in self.layers:   # the same shapes and names; the weights come from the caller's state dict
            layer.mixer = ContextParallelMamba2(config.d_model, layout, sequence_parallel, **config.mixer_kwargs(),
                                                device=device, dtype=dtype)

    def loss(self, ids: torch.Tensor, targets: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
        """This rank's share of the mean cross-entropy over the whole sequences: Σ over its targets that are not
        ``ignore_index``, divided by the count of such targets over the CP group (module docstring)."""
        logits = self(ids)
        per_token = vocab_parallel_cross_entropy(logits.flatten(0, 1), targets.flatten(), self.layout, ignore_index)
        count = (targets != ignore_index).sum()
        if self.layout.cp > 1:   # an integer sum: exact in any order
            dist.all_reduce(count, group=self.layout.cp_group)
        return per_token.sum() / count.clamp(min=1)


@torch.no_grad()
def sum_context_parallel_grads(model: torch.nn.Module, layout: ParallelLayout) -> None:
    """Σ over the CP group of every gradient (each rank's is its piece's part), in place: one flat buffer per
    dtype, added in rank order (:func:`~mambalab.parallel.context.sum_over_ranks`), so the same bits on every run
    and on every rank of the group. A no-op with CP = 1."""
    if layout.cp == 1:
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for p in model.parameters():
        if p.grad is not None:
            by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
    for grads in by_dtype.values():
        total = sum_over_ranks(torch.cat([g.reshape(-1) for g in grads]), layout.cp_group)
        offset = 0
        for g in grads:
            g.copy_(total[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
