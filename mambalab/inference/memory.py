"""What decoding keeps in memory: a Mamba-2 model's fixed-size state against a Transformer's KV cache.

* :func:`mamba2_state_bytes` and :func:`kv_cache_bytes`: the two caches by formula (the KV cache with
  multi-head attention, or grouped-query attention with ``kv_heads`` heads of ``head_dim``);
* :func:`mamba2_layer_params`, :func:`transformer_layer_params` and :func:`matched_transformer_layers`: the
  depth of a Transformer with as many parameters as a Mamba-2 model of the same width (a Transformer layer has
  about 12 d_model² weights, a Mamba-2 layer with expand 2 about 6 d_model², so about half as many layers);
* :func:`measure_cache_bytes`: the real tensors allocated (``Mamba2.allocate_inference_cache`` for every
  layer; one (2, layers, b, L, kv width) tensor for the KV cache) and measured,
  ``torch.cuda.max_memory_allocated`` on a GPU, the tensors' bytes on the CPU.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from mambalab.modules.lm import LMConfig
from mambalab.modules.mamba2 import Mamba2

__all__ = ["kv_cache_bytes", "mamba2_layer_params", "mamba2_state_bytes", "matched_transformer_layers",
           "measure_cache_bytes", "transformer_layer_params"]


def mamba2_state_bytes(config: LMConfig, batch: int = 1, conv_element_size: int = 2,
                       ssm_element_size: int = 4) -> dict:
    """The decode cache of a Mamba-2 :class:`LMConfig`, by formula (what ``Mamba2.allocate_inference_cache``
    allocates per layer, times ``n_layer``):

        conv_state  b · (d_inner + 2 g n) · d_conv      elements of the model's dtype (bf16: 2 bytes)
        ssm_state   b · h · p · n                        ``ssm_element_size`` bytes each

    The default ``ssm_element_size=4`` is mambalab's ``Mamba2``, which keeps the SSM state in fp32 because it
    accumulates over the whole sequence. mamba-ssm's ``Mamba2.allocate_inference_cache``
    (mamba_ssm/modules/mamba2.py, v2.3.2.post1) allocates it in ``in_proj.weight.dtype`` or the ``dtype`` passed,
    so a bf16 model's state there is 2 bytes an element: pass ``ssm_element_size=2`` for it.

    Returns {"conv": bytes, "ssm": bytes, "per_layer": bytes, "total": bytes}; none depends on the length."""
    d_inner = config.expand * config.d_model
    conv = batch * (d_inner + 2 * config.ngroups * config.d_state) * config.d_conv * conv_element_size
    ssm = batch * config.nheads * config.headdim * config.d_state * ssm_element_size
    return {"conv": conv, "ssm": ssm, "per_layer": conv + ssm, "total": config.n_layer * (conv + ssm)}


def _kv_width(d_model: int, kv_heads: int | None, head_dim: int | None) -> int:
    if (kv_heads is None) != (head_dim is None):
        raise ValueError(f"kv_heads and head_dim go together (grouped-query attention) or are both None "
                         f"(multi-head attention); got kv_heads={kv_heads!r}, head_dim={head_dim!r}")
    if kv_heads is None:
        return d_model
    if kv_heads < 1 or head_dim < 1:
        raise ValueError(f"kv_heads and head_dim must be positive; got kv_heads={kv_heads}, head_dim={head_dim}")
    return kv_heads * head_dim


def kv_cache_bytes(seqlen: int, d_model: int, n_layer: int, batch: int = 1, element_size: int = 2,
                   kv_heads: int | None = None, head_dim: int | None = None) -> int:
    """A Transformer's KV cache at context ``seqlen``: per token, layer and sequence a key and a value of
    ``kv_width`` numbers, 2 · n_layer · b · L · kv_width elements. Multi-head attention (``kv_heads=None``):
    kv_width = heads · head_dim = d_model. Grouped-query attention: ``kv_heads`` key/value heads of
    ``head_dim``, kv_width = kv_heads · head_dim."""
    return 2 * n_layer * batch * seqlen * _kv_width(d_model, kv_heads, head_dim) * element_size


def mamba2_layer_params(config: LMConfig) -> int:
    """Weights of one Mamba-2 block of ``config`` (mixer and its RMSNorm): ``LMConfig.num_parameters`` less the
    embedding and the final norm, over ``n_layer``. With expand 2 it is about 6 d_model² (in_proj 2·d_inner + 2gn
    + h outputs, out_proj d_inner inputs)."""
    embedding = config.vocab_size * config.d_model * (1 if config.tie_embeddings else 2)
    return (config.num_parameters() - embedding - config.d_model) // config.n_layer


def transformer_layer_params(d_model: int, kv_heads: int | None = None, head_dim: int | None = None,
                             mlp_ratio: int = 4) -> int:
    """Weights of one Transformer layer: the query and output projections (d_model² each), the key and value
    projections (d_model · kv_width each) and an MLP of two d_model × mlp_ratio·d_model matrices; biases and
    norms (O(d_model)) left out. Multi-head attention with mlp_ratio 4: 12 d_model²."""
    kv_width = _kv_width(d_model, kv_heads, head_dim)
    return 2 * d_model * d_model + 2 * d_model * kv_width + 2 * mlp_ratio * d_model * d_model


def matched_transformer_layers(config: LMConfig, kv_heads: int | None = None, head_dim: int | None = None,
                               mlp_ratio: int = 4) -> int:
    """The depth of a Transformer of width ``config.d_model`` with as many layer weights as the Mamba-2 model of
    ``config``: n_layer · mamba2_layer_params / transformer_layer_params, rounded (at least 1)."""
    ratio = mamba2_layer_params(config) / transformer_layer_params(config.d_model, kv_heads, head_dim, mlp_ratio)
    return max(1, round(config.n_layer * ratio))


def _mamba2_layer(config: LMConfig, device, dtype) -> Mamba2:
    return Mamba2(config.d_model, **config.mixer_kwargs(), layer_idx=0, device=device, dtype=dtype)


def measure_cache_bytes(config: LMConfig, seqlens: Sequence[int], batch: int = 1, dtype=torch.bfloat16,
                        device=None, kv_layers: int | None = None, kv_width: int | None = None) -> list[dict]:
    """Allocate the two decode caches at each context length and measure them.

    Mamba-2: ``allocate_inference_cache(batch, max_seqlen=L)`` of a Mamba-2 layer of ``config``, once per layer
    (every layer's tuple has the same shapes, so one layer's weights stand for all of them). Transformer: one
    (2, kv_layers, b, L, kv_width) tensor in ``dtype`` (kv_layers defaults to ``config.n_layer``, kv_width to
    ``config.d_model``: multi-head attention). On a CUDA ``device`` each is measured as
    ``torch.cuda.max_memory_allocated`` minus what was allocated before (the caching allocator rounds up to
    its blocks, 512 bytes at least); elsewhere as the allocated tensors' bytes (numel · element size).

    Returns one row per length: {"seqlen", "mamba2_bytes", "kv_bytes", "how"}."""
    device = torch.device(device or "cpu")
    kv_layers = config.n_layer if kv_layers is None else kv_layers
    kv_width = config.d_model if kv_width is None else kv_width
    if kv_layers < 1 or kv_width < 1:
        raise ValueError(f"kv_layers and kv_width must be positive; got kv_layers={kv_layers}, kv_width={kv_width}")
    cuda = device.type == "cuda"
    layer = _mamba2_layer(config, device, dtype)
    rows = []

    def measure(make) -> int:
        if cuda:
            torch.cuda.synchronize(device)
            base = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
            tensors = make()
            torch.cuda.synchronize(device)
            used = torch.cuda.max_memory_allocated(device) - base
        else:
            tensors = make()
            used = sum(t.numel() * t.element_size() for t in tensors)
        del tensors
        return int(used)

    for seqlen in seqlens:
        mamba = measure(lambda: [t for _ in range(config.n_layer)
                                 for t in layer.allocate_inference_cache(batch, max_seqlen=seqlen, dtype=dtype)])
        kv = measure(lambda: [torch.empty(2, kv_layers, batch, seqlen, kv_width, device=device,
                                          dtype=dtype)])
        rows.append({"seqlen": int(seqlen), "mamba2_bytes": mamba, "kv_bytes": kv,
                     "how": "torch.cuda.max_memory_allocated" if cuda else "tensor bytes"})
    return rows
