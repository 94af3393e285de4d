"""A small Mamba-2 language model: embedding, pre-norm residual blocks, final norm, and a (tied) head.

For token ids (b, l) and N = n_layer blocks of width d_model:

    h_0 = embedding(ids)                                  (b, l, d_model)
    h_k = h_{k-1} + mixer_k(rmsnorm_k(h_{k-1}))           k = 1 … N, mixer = :class:`Mamba2`
    logits = lm_head(rmsnorm_f(h_N))                      (b, l, vocab_size)

The head shares the embedding's weight when ``tie_embeddings`` (the default). Parameter names follow
mamba-ssm's ``MambaLMHeadModel`` minus its ``backbone.`` prefix: ``embedding``, ``layers.{k}.norm``,
``layers.{k}.mixer``, ``norm_f``, ``lm_head``. The tensor-parallel version,
:class:`mambalab.parallel.TensorParallelMambaLM`, has the same names, so a TP = 1 state dict shards into it.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from mambalab.modules.mamba2 import Mamba2
from mambalab.modules.norm import GatedRMSNorm

__all__ = ["LMConfig", "MambaLM", "reset_biases"]


@dataclass(frozen=True)
class LMConfig:
    """Sizes of :class:`MambaLM` (and of its tensor-parallel twin)."""

    vocab_size: int = 32
    d_model: int = 32
    n_layer: int = 2
    d_state: int = 16
    headdim: int = 8
    ngroups: int = 4
    expand: int = 2
    d_conv: int = 4
    chunk_size: int = 16
    tie_embeddings: bool = True
    scan: str = "kernel"       # "kernel" (Triton) or "reference" (pure PyTorch); see mambalab.modules.mamba2
    reduction: str | None = None   # the SSD backward's reduction (None: the determinism switch decides)

    def mixer_kwargs(self) -> dict:
        return dict(d_state=self.d_state, d_conv=self.d_conv, expand=self.expand, headdim=self.headdim,
                    ngroups=self.ngroups, chunk_size=self.chunk_size, scan=self.scan,
                    reduction=self.reduction)

    @property
    def nheads(self) -> int:
        return self.expand * self.d_model // self.headdim

    def num_parameters(self) -> int:
        """Parameters of the TP = 1 model (the tied head counted once)."""
        d, di, g, n, h, V = self.d_model, self.expand * self.d_model, self.ngroups, self.d_state, self.nheads, \
            self.vocab_size
        conv_dim = di + 2 * g * n
        mixer = d * (2 * di + 2 * g * n + h) + conv_dim * (self.d_conv + 1) + 3 * h + di + di * d
        return V * d * (1 if self.tie_embeddings else 2) + self.n_layer * (mixer + d) + d

    def to_dict(self) -> dict:
        return asdict(self)


class Block(nn.Module):
    """h -> h + mixer(rmsnorm(h)), (b, l, d_model) -> (b, l, d_model)."""

    def __init__(self, norm: nn.Module, mixer: nn.Module):
        super().__init__()
        self.norm = norm
        self.mixer = mixer

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.mixer(self.norm(h))


class MambaLM(nn.Module):
    """ids (b, l) -> logits (b, l, vocab_size); see the module docstring."""

    def __init__(self, config: LMConfig, device=None, dtype=None):
        super().__init__()
        self.config = config
        factory = {"device": device, "dtype": dtype}
        d = config.d_model
        self.embedding = nn.Embedding(config.vocab_size, d, **factory)
        nn.init.normal_(self.embedding.weight, std=0.02)
        self.layers = nn.ModuleList(
            Block(GatedRMSNorm(d, **factory), Mamba2(d, **config.mixer_kwargs(), **factory))
            for _ in range(config.n_layer))
        self.norm_f = GatedRMSNorm(d, **factory)
        self.lm_head = nn.Linear(d, config.vocab_size, bias=False, **factory)
        if config.tie_embeddings:
            self.lm_head.weight = self.embedding.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.dim() != 2:
            raise ValueError(f"ids must have shape (b, l); got {tuple(ids.shape)}")
        h = self.embedding(ids)                              # (b, l, d_model)
        for layer in self.layers:
            h = layer(h)
        return self.lm_head(self.norm_f(h))                  # (b, l, vocab_size)

    def loss(self, ids: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
        """Mean cross-entropy over the targets that are not ``ignore_index``."""
        logits = self(ids)
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=ignore_index)


@torch.no_grad()
def reset_biases(model: nn.Module, respect_no_reinit: bool = True) -> list[str]:
    """An init hook of the kind training frameworks apply: zero every parameter named ``*bias``.

    With ``respect_no_reinit`` it skips parameters marked ``_no_reinit`` (Mamba-2's ``dt_bias``, whose
    initial values set each head's time scale). Returns the names it zeroed."""
    zeroed = []
    for name, p in model.named_parameters():
        if name.endswith("bias") and not (respect_no_reinit and getattr(p, "_no_reinit", False)):
            p.zero_()
            zeroed.append(name)
    return zeroed
