"""Exercises of chapter 07 (inference): checkers that say ✓ or ✗ and how far off.

* :func:`mamba2_layer_state_bytes`: the bytes of one Mamba-2 layer's decode state for a config, as mambalab's
  ``Mamba2`` allocates it (conv state in the model's dtype, SSM state in fp32; mamba-ssm's
  ``Mamba2.allocate_inference_cache`` would use the model's dtype for both, ``ssm_element_size=2`` here).
* :func:`kv_cache_bytes`: the bytes of a Transformer's KV cache at context L; by default the grouped-query
  Transformer (8 key/value heads of 64) with as many parameters as mamba2-2.7b.
* :func:`top_p_filter`: a top-p (nucleus) filter, checked against :func:`mambalab.inference.filter_top_p` on
  random logits.

Each checker prints one line and returns True or False; it never raises on a wrong answer, and an answer left
as ``None`` or ``...`` reads "not attempted yet". The defaults are mamba2-2.7b's sizes (d_model 2560, 64 layers,
n = 128, p = 64, g = 1, d_conv = 4), bf16 weights and batch 1.
"""
from __future__ import annotations

import torch

from mambalab.exercises import not_attempted, verdict

__all__ = ["kv_cache_bytes", "mamba2_layer_state_bytes", "top_p_filter"]

MAMBA2_2_7B = dict(vocab_size=50288, d_model=2560, n_layer=64, d_state=128, headdim=64, ngroups=1, expand=2,
                   d_conv=4, chunk_size=256)


def _compare(answer, want: int, what: str) -> bool:
    if not_attempted(answer):
        return False
    try:
        got = float(answer)
    except (TypeError, ValueError):
        print(f"✗ expected a number of {what}; got {answer!r}")
        return False
    ok = abs(got - want) <= 1e-6 * max(abs(want), 1.0)
    return verdict(ok, f"right: {want:,} {what} ({want / 2**20:,.2f} MiB)",
                   f"expected {want:,} {what}, got {got:,.0f} (off by {got - want:+,.0f}, "
                   f"{got / want:.3g}× the right value)")


def mamba2_layer_state_bytes(answer, config: dict | None = None, batch: int = 1, element_size: int = 2,
                             ssm_element_size: int = 4) -> bool:
    """``answer``: bytes of one Mamba-2 layer's decode state for ``config`` (an :class:`LMConfig`'s fields;
    default mamba2-2.7b), conv state in a dtype of ``element_size`` bytes and SSM state of ``ssm_element_size``
    (default 4: fp32, as mambalab's ``Mamba2.allocate_inference_cache`` makes it)."""
    from mambalab.modules.lm import LMConfig
    from mambalab.inference.memory import mamba2_state_bytes

    want = mamba2_state_bytes(LMConfig(**(config or MAMBA2_2_7B)), batch, conv_element_size=element_size,
                              ssm_element_size=ssm_element_size)
    return _compare(answer, want["per_layer"], f"bytes per layer (batch {batch})")


def kv_cache_bytes(answer, seqlen: int = 65536, d_model: int = 2560, n_layer: int | None = None, batch: int = 1,
                   element_size: int = 2, kv_heads: int | None = 8, head_dim: int | None = 64) -> bool:
    """``answer``: bytes of a Transformer's KV cache at ``seqlen`` tokens: grouped-query attention over
    ``kv_heads`` key/value heads of ``head_dim`` (both None: multi-head attention), ``n_layer`` layers (None: as
    many as give the Transformer mamba2-2.7b's parameters, :func:`~mambalab.inference.memory.matched_transformer_layers`)."""
    from mambalab.inference.memory import kv_cache_bytes as formula, matched_transformer_layers
    from mambalab.modules.lm import LMConfig

    if n_layer is None:
        n_layer = matched_transformer_layers(LMConfig(**{**MAMBA2_2_7B, "d_model": d_model}), kv_heads, head_dim)
    want = formula(seqlen, d_model, n_layer, batch, element_size, kv_heads, head_dim)
    return _compare(answer, want, f"bytes of KV cache at L = {seqlen:,}")


def _cases():
    """(logits (b, V), p) pairs: random logits of several scales, p from tiny to almost 1, and a peaked row."""
    g = torch.Generator().manual_seed(7)
    cases = []
    for scale, p in ((1.0, 0.9), (3.0, 0.5), (0.3, 0.95), (5.0, 0.1), (2.0, 0.999)):
        cases.append((torch.randn(4, 50, generator=g) * scale, p))
    peaked = torch.zeros(1, 10)
    peaked[0, 3] = 20.0
    cases.append((peaked, 0.5))
    return cases


def top_p_filter(answer) -> bool:
    """``answer``: a function ``(logits (b, V), p) -> logits`` that keeps, in each row, the smallest set of tokens
    (by decreasing probability) whose probability sums to at least p, and sets the others to -inf."""
    from mambalab.inference import filter_top_p

    if not_attempted(answer):
        return False
    if not callable(answer):
        print(f"✗ expected a function (logits, p) -> logits; got {answer!r}")
        return False
    for logits, p in _cases():
        want = filter_top_p(logits, p)
        try:
            got = answer(logits.clone(), p)
        except Exception as err:  # a reader's bug: say what it was, do not raise
            print(f"✗ your function raised {type(err).__name__}: {err} (logits {tuple(logits.shape)}, p = {p})")
            return False
        if not isinstance(got, torch.Tensor) or got.shape != want.shape:
            print(f"✗ expected a tensor of shape {tuple(want.shape)}; got "
                  f"{tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__}")
            return False
        kept_got, kept_want = got.isfinite(), want.isfinite()
        if not torch.equal(kept_got, kept_want):
            row = int((kept_got != kept_want).any(-1).nonzero()[0])
            print(f"✗ p = {p}: row {row} keeps {int(kept_got[row].sum())} tokens, the filter keeps "
                  f"{int(kept_want[row].sum())} (the smallest set whose probability reaches p)")
            return False
        if not torch.allclose(got[kept_want], want[kept_want]):
            print(f"✗ p = {p}: the kept tokens' logits changed; keep them as they are")
            return False
    return verdict(True, f"right: your filter keeps the same tokens as filter_top_p on {len(_cases())} cases", "")
