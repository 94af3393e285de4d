"""A Mamba language model: embedding, pre-norm residual blocks, final norm, and a (tied) head.

For token ids (b, l) and N = n_layer blocks of width d_model:

    h_0 = embedding(ids)                                  (b, l, d_model)
    h_k = h_{k-1} + mixer_k(rmsnorm_k(h_{k-1}))           k = 1 … N, mixer = Mamba1, Mamba2 or Mamba3
    logits = lm_head(rmsnorm_f(h_N))                      (b, l, vocab_size)

``LMConfig.layer`` picks the mixer (:class:`Mamba2` by default), as ``ssm_cfg["layer"]`` does in mamba-ssm's
``MambaLMHeadModel``; ``LMConfig.ssm_cfg`` passes further constructor arguments to every mixer. Block k's mixer
has ``layer_idx = k``, so mamba-ssm-style decoding (``inference_params``) finds each layer's state.

The head shares the embedding's weight when ``tie_embeddings`` (the default). Parameter names follow
mamba-ssm's ``MambaLMHeadModel`` minus its ``backbone.`` prefix: ``embedding``, ``layers.{k}.norm``,
``layers.{k}.mixer``, ``norm_f``, ``lm_head``. The tensor-parallel version,
:class:`mambalab.parallel.TensorParallelMambaLM`, has the same names, so a TP = 1 state dict shards into it.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

from mambalab import validate
import torch.nn as nn
import torch.nn.functional as F

from mambalab.modules.mamba1 import Mamba1
from mambalab.modules.mamba2 import Mamba2
from mambalab.modules.mamba3 import Mamba3
from mambalab.modules.norm import GatedRMSNorm, add_norm

__all__ = ["LAYERS", "LMConfig", "MambaLM", "reset_biases"]

# The mixers a block can hold, by the names mamba-ssm's ssm_cfg["layer"] uses.
LAYERS = {"Mamba1": Mamba1, "Mamba2": Mamba2, "Mamba3": Mamba3}


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
    layer: str = "Mamba2"          # the mixer: "Mamba1", "Mamba2" or "Mamba3" (see LAYERS)
    norm_epsilon: float = 1e-5     # eps of the blocks' RMSNorms and of norm_f
    ssm_cfg: dict = field(default_factory=dict)   # further mixer constructor arguments (e.g. dt_rank, bias)

    def __post_init__(self):
        if self.layer not in LAYERS:
            raise ValueError(f"layer must be one of {sorted(LAYERS)}; got {self.layer!r}")

    def mixer_kwargs(self) -> dict:
        """Constructor arguments of the mixer named by ``layer`` (layer_idx excluded)."""
        if self.layer == "Mamba1":
            common = dict(d_state=self.d_state, d_conv=self.d_conv, expand=self.expand)
        elif self.layer == "Mamba3":
            common = dict(d_state=self.d_state, expand=self.expand, headdim=self.headdim, ngroups=self.ngroups,
                          chunk_size=self.chunk_size, reduction=self.reduction,
                          backend="reference" if self.scan == "reference" else "triton")
        else:
            common = dict(d_state=self.d_state, d_conv=self.d_conv, expand=self.expand, headdim=self.headdim,
                          ngroups=self.ngroups, chunk_size=self.chunk_size, scan=self.scan,
                          reduction=self.reduction)
        return {**common, **self.ssm_cfg}

    @property
    def nheads(self) -> int:
        return self.expand * self.d_model // self.headdim

    def num_parameters(self) -> int:
        """Parameters of the TP = 1 Mamba-2 model (the tied head counted once)."""
        if self.layer != "Mamba2":
            raise NotImplementedError(f"num_parameters counts Mamba-2 models; layer is {self.layer!r} "
                                      f"(count sum(p.numel() for p in MambaLM(config).parameters()) instead)")
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
        mixer = LAYERS[config.layer]
        eps = config.norm_epsilon
        self.layers = nn.ModuleList(
            Block(GatedRMSNorm(d, eps=eps, **factory), mixer(d, **config.mixer_kwargs(), layer_idx=k, **factory))
            for k in range(config.n_layer))
        self.norm_f = GatedRMSNorm(d, eps=eps, **factory)
        self.lm_head = nn.Linear(d, config.vocab_size, bias=False, **factory)
        if config.tie_embeddings:
            self.lm_head.weight = self.embedding.weight

    def forward(self, ids: torch.Tensor, inference_params=None, num_last_tokens: int = 0,
                **mixer_kwargs) -> torch.Tensor:
        """ids (b, l) -> logits (b, l, vocab_size), or (b, num_last_tokens, vocab_size) for the last positions
        only when ``num_last_tokens`` > 0 (as mamba-ssm's ``MambaLMHeadModel``: a prefill needs one position's
        logits, and all of them cost b · l · vocab_size numbers, 6.6 GB at 64K tokens and 50K words in bf16).

        inference_params: mamba-ssm's ``InferenceParams`` (or :class:`mambalab.inference.InferenceParams`):
        every mixer keeps its state in ``key_value_memory_dict[layer_idx]``; at ``seqlen_offset == 0`` the
        prompt runs through the chunked scans and fills the states, after that each call is one step (l = 1).
        mixer_kwargs: handed to every mixer, as mamba-ssm's model does: packed sequences (``seq_idx``,
        ``cu_seqlens``) for Mamba-2 mixers.
        """
        validate.token_ids("ids", ids, self.config.vocab_size)
        h = self.embedding(ids)                              # (b, l, d_model): the residual stream h_0
        kwargs = mixer_kwargs if inference_params is None else dict(mixer_kwargs, inference_params=inference_params)
        update = None                                        # the previous block's mixer output
        for layer in self.layers:
            # h_{k-1} = h_{k-2} + mixer_{k-1}(…) and its norm in one step: on a GPU without autograd one kernel
            h, normed = (h, layer.norm(h)) if update is None else add_norm(layer.norm, h, update)
            update = layer.mixer(normed, **kwargs)
        if num_last_tokens > 0:
            h = h[:, -num_last_tokens:]
            update = None if update is None else update[:, -num_last_tokens:]
        normed = self.norm_f(h) if update is None else add_norm(self.norm_f, h, update)[1]   # norm_f(h_N)
        return self.lm_head(normed)                          # (b, l, vocab_size)

    def allocate_inference_cache(self, batch_size: int, max_seqlen: int | None = None, dtype=None) -> dict:
        """{layer_idx: that mixer's zeroed decoding state tuple}: fixed-size, whatever the length."""
        return {k: layer.mixer.allocate_inference_cache(batch_size, max_seqlen, dtype=dtype)
                for k, layer in enumerate(self.layers)}

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
