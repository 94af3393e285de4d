"""What decoding keeps in memory: a Mamba-2 model's fixed-size state against a Transformer's KV cache.

* :func:`mamba2_state_bytes` and :func:`kv_cache_bytes`: the two caches by formula;
* :func:`measure_cache_bytes`: the real tensors allocated (``Mamba2.allocate_inference_cache`` for every
  layer; one (2, n_layer, b, L, d_model) tensor for the KV cache) and measured,
  ``torch.cuda.max_memory_allocated`` on a GPU, the tensors' bytes on the CPU.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from mambalab.modules.lm import LMConfig
from mambalab.modules.mamba2 import Mamba2

__all__ = ["kv_cache_bytes", "mamba2_state_bytes", "measure_cache_bytes"]


def mamba2_state_bytes(config: LMConfig, batch: int = 1, conv_element_size: int = 2,
                       ssm_element_size: int = 4) -> dict:
    """The decode cache of a Mamba-2 :class:`LMConfig`, by formula (what ``Mamba2.allocate_inference_cache``
    allocates per layer, times ``n_layer``):

        conv_state  b · (d_inner + 2 g n) · d_conv      elements of the model's dtype (bf16: 2 bytes)
        ssm_state   b · h · p · n                        fp32 (4 bytes): it accumulates over the whole sequence

    Returns {"conv": bytes, "ssm": bytes, "per_layer": bytes, "total": bytes}; none depends on the length."""
    d_inner = config.expand * config.d_model
    conv = batch * (d_inner + 2 * config.ngroups * config.d_state) * config.d_conv * conv_element_size
    ssm = batch * config.nheads * config.headdim * config.d_state * ssm_element_size
    return {"conv": conv, "ssm": ssm, "per_layer": conv + ssm, "total": config.n_layer * (conv + ssm)}


def kv_cache_bytes(seqlen: int, d_model: int, n_layer: int, batch: int = 1, element_size: int = 2) -> int:
    """A Transformer's KV cache at context ``seqlen``: a key and a value of d_model numbers (multi-head attention,
    heads · head_dim = d_model) per token, layer and sequence, 2 · n_layer · b · L · d_model elements."""
    return 2 * n_layer * batch * seqlen * d_model * element_size


def _mamba2_layer(config: LMConfig, device, dtype) -> Mamba2:
    return Mamba2(config.d_model, **config.mixer_kwargs(), layer_idx=0, device=device, dtype=dtype)


def measure_cache_bytes(config: LMConfig, seqlens: Sequence[int], batch: int = 1, dtype=torch.bfloat16,
                        device=None) -> list[dict]:
    """Allocate the two decode caches at each context length and measure them.

    Mamba-2: ``allocate_inference_cache(batch, max_seqlen=L)`` of a Mamba-2 layer of ``config``, once per layer
    (every layer's tuple has the same shapes, so one layer's weights stand for all of them). Transformer: one
    (2, n_layer, b, L, d_model) tensor in ``dtype``. On a CUDA ``device`` each is measured as
    ``torch.cuda.max_memory_allocated`` minus what was allocated before (the caching allocator rounds up to
    its blocks, 512 bytes at least); elsewhere as the allocated tensors' bytes (numel · element size).

    Returns one row per length: {"seqlen", "mamba2_bytes", "kv_bytes", "how"}."""
    device = torch.device(device or "cpu")
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
        kv = measure(lambda: [torch.empty(2, config.n_layer, batch, seqlen, config.d_model, device=device,
                                          dtype=dtype)])
        rows.append({"seqlen": int(seqlen), "mamba2_bytes": mamba, "kv_bytes": kv,
                     "how": "torch.cuda.max_memory_allocated" if cuda else "tensor bytes"})
    return rows
