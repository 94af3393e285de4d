"""The tensor-parallel twin of :class:`mambalab.modules.lm.MambaLM`: same parameter names, 1/T of the weights.

    embedding   VocabParallelEmbedding: rows of the table by vocabulary           all-reduce forward
    layers.k    norm (replicated) + TensorParallelMamba2                           all-reduce fwd + bwd
    norm_f      replicated
    lm_head     ColumnParallelLinear over the vocabulary (tied: the embedding's rows)  all-reduce backward
    loss        vocab_parallel_cross_entropy (never the full logits)

In sequence-parallel mode the residual stream between the layers is (b, l / T, d_model) on each rank: the
norms see 1/T of the tokens, which saves activation memory, and the replicated norm weights get only their
tokens' share of the gradient, so :func:`mambalab.parallel.grads.allreduce_replicated_grads` sums them.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from mambalab.modules.lm import Block, LMConfig
from mambalab.modules.norm import GatedRMSNorm
from mambalab.parallel.layout import ParallelLayout, check_divides
from mambalab.parallel.linear import ColumnParallelLinear
from mambalab.parallel.mamba2 import TensorParallelMamba2
from mambalab.parallel.sharding import REPLICATED, shard_specs
from mambalab.parallel.vocab import IGNORE_INDEX, VocabParallelEmbedding, vocab_parallel_cross_entropy

__all__ = ["TensorParallelMambaLM"]


class TensorParallelMambaLM(nn.Module):
    """ids (b, l) -> this rank's logits (b, l, vocab_size / T); :meth:`loss` gives the mean cross-entropy."""

    def __init__(self, config: LMConfig, layout: ParallelLayout, sequence_parallel: bool = False, device=None,
                 dtype=None):
        super().__init__()
        tp = layout.tp
        check_divides(tp, vocab_size=config.vocab_size, nheads=config.nheads, ngroups=config.ngroups)
        self.config, self.layout, self.sequence_parallel = config, layout, sequence_parallel
        factory = {"device": device, "dtype": dtype}
        d = config.d_model
        self.embedding = VocabParallelEmbedding(config.vocab_size, d, layout, sequence_parallel, **factory)
        self.layers = nn.ModuleList(
            Block(GatedRMSNorm(d, **factory),
                  TensorParallelMamba2(d, layout, sequence_parallel, **config.mixer_kwargs(), **factory))
            for _ in range(config.n_layer))
        self.norm_f = GatedRMSNorm(d, **factory)
        self.lm_head = ColumnParallelLinear(d, config.vocab_size, bias=False, layout=layout,
                                            sequence_parallel=sequence_parallel, **factory)
        if config.tie_embeddings:
            self.lm_head.weight = self.embedding.weight

    def replicated_parameters(self) -> list[nn.Parameter]:
        """Parameters every TP rank holds whole: the norms' weights."""
        specs = shard_specs(self)
        return [p for name, p in self.named_parameters() if specs[name] == REPLICATED]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.dim() != 2:
            raise ValueError(f"ids must have shape (b, l); got {tuple(ids.shape)}")
        if self.sequence_parallel and ids.shape[1] % self.layout.tp:
            raise ValueError(f"sequence parallelism splits l = {ids.shape[1]} over tp = {self.layout.tp} ranks; "
                             f"tp must divide it")
        h = self.embedding(ids)              # (b, l, d) or (b, l / T, d) with sequence parallelism
        for layer in self.layers:
            h = layer(h)
        return self.lm_head(self.norm_f(h))  # (b, l, V / T)

    def loss(self, ids: torch.Tensor, targets: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
        """Mean cross-entropy over the targets that are not ``ignore_index`` (same value on every TP rank)."""
        logits = self(ids)
        per_token = vocab_parallel_cross_entropy(logits.flatten(0, 1), targets.flatten(), self.layout, ignore_index)
        return per_token.sum() / (targets != ignore_index).sum().clamp(min=1)
