"""The vocabulary split over T ranks: an embedding and a cross-entropy that never build the full logits.

Rank r owns token ids [r·V/T, (r+1)·V/T).

**VocabParallelEmbedding**: rank r looks up the ids it owns (zero rows for the others), and the sum over
ranks is the full embedding: forward all-reduce (reduce-scatter along the sequence in sequence-parallel
mode), backward none (each rank's rows receive the gradient of the tokens it owns).

**vocab_parallel_cross_entropy**: with this rank's logits z_r (N, V/T) of the full logits z (N, V) and
targets t (N,),

    loss_i = log Σ_v exp(z_iv) - z_{i t_i}
           = log Σ_r Σ_{v ∈ r} exp(z_iv - m_i) + m_i - z_{i t_i},   m_i = max_v z_iv

which needs three all-reduces of N numbers (the max, the sum of exponentials, and the target logit, which
only its owner has) instead of gathering N·V logits. The gradient is softmax(z) - onehot(t), of which each
rank computes its own V/T columns with no communication. Targets equal to ``ignore_index`` give loss 0
and no gradient.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from mambalab.parallel.collectives import reduce_from_tp, reduce_scatter_along
from mambalab.parallel.layout import ParallelLayout, check_divides, single_process_layout
from mambalab.parallel.linear import SEQUENCE_DIM
from mambalab.parallel.sharding import Sharded, contiguous_block

__all__ = ["VocabParallelEmbedding", "vocab_parallel_cross_entropy", "IGNORE_INDEX"]

IGNORE_INDEX = -100


class VocabParallelEmbedding(nn.Module):
    """ids (b, l) -> (b, l, d) (or (b, l / T, d) with sequence_parallel); rank r holds rows r·V/T … of the table.

    The weight is initialised N(0, std²) (``init_std``), as a language model's embedding usually is."""

    def __init__(self, num_embeddings: int, embedding_dim: int, layout: ParallelLayout | None = None,
                 sequence_parallel: bool = False, init_std: float = 0.02, device=None, dtype=None):
        super().__init__()
        self.layout = layout or single_process_layout()
        tp = self.layout.tp
        check_divides(tp, vocab_size=num_embeddings)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.sequence_parallel = sequence_parallel
        self.per_rank = num_embeddings // tp
        self.vocab_start = self.layout.tp_rank * self.per_rank
        self.weight = nn.Parameter(torch.empty(self.per_rank, embedding_dim, device=device, dtype=dtype))
        with torch.no_grad():
            self.weight.normal_(0.0, init_std)

    def shard_specs(self):
        return {"weight": Sharded(0, contiguous_block(self.num_embeddings, self.layout.tp))}

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"ids must be an integer tensor; got {ids.dtype}")
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.per_rank)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        group = self.layout.tp_group
        if self.layout.tp == 1:
            return out
        return reduce_scatter_along(out, SEQUENCE_DIM, group) if self.sequence_parallel else reduce_from_tp(out, group)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim} (this rank: ids {self.vocab_start}…"
                f"{self.vocab_start + self.per_rank - 1}), sequence_parallel={self.sequence_parallel}")


def _all_reduce(t, op, group):
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, vocab_start, group, ignore_index):
        # at least fp32 (16-bit logits are upcast), fp64 stays fp64
        z = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits.clone()   # (N, V/T)
        m = z.max(dim=-1).values                                           # (N,)
        _all_reduce(m, dist.ReduceOp.MAX, group)
        z = z - m.unsqueeze(-1)
        local = target - vocab_start
        mine = (local >= 0) & (local < z.shape[-1])
        safe = local.clamp(0, z.shape[-1] - 1)
        target_logit = z.gather(-1, safe.unsqueeze(-1)).squeeze(-1) * mine  # (N,) nonzero on the owner
        _all_reduce(target_logit, dist.ReduceOp.SUM, group)
        e = z.exp()
        sum_exp = e.sum(dim=-1)
        _all_reduce(sum_exp, dist.ReduceOp.SUM, group)
        valid = target != ignore_index
        loss = (sum_exp.log() - target_logit) * valid
        ctx.save_for_backward(e / sum_exp.unsqueeze(-1), safe, mine, valid)
        ctx.logits_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, safe, mine, valid = ctx.saved_tensors
        # softmax - onehot(target) on the rank that owns the target (a one-hot, not a scatter: deterministic)
        onehot = F.one_hot(safe, softmax.shape[-1]).to(softmax.dtype) * mine.to(softmax.dtype).unsqueeze(-1)
        grad = (softmax - onehot) * (grad_loss * valid).unsqueeze(-1)
        return grad.to(ctx.logits_dtype), None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, layout: ParallelLayout | None = None,
                                 ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Per-token loss (N,) from this rank's logits (N, V/T) and the full-vocabulary targets (N,).

    Equal to ``F.cross_entropy(full_logits, target, reduction="none", ignore_index=ignore_index)``."""
    layout = layout or single_process_layout()
    if logits.dim() != 2 or target.shape != logits.shape[:1]:
        raise ValueError(f"logits must be (N, V/T) and target (N,); got {tuple(logits.shape)} and "
                         f"{tuple(target.shape)}")
    vocab_start = layout.tp_rank * logits.shape[-1]
    return _VocabParallelCrossEntropy.apply(logits, target, vocab_start, layout.tp_group, ignore_index)
