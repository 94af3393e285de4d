"""Exercises of chapter 06 (tensor-parallel training): checkers that say ✓ or ✗ and how far off.

* :func:`allreduce_bytes_per_layer`: the bytes each rank sends in one Mamba-2 layer's forward all-reduce
  (ring algorithm) at a TP degree.
* :func:`activation_bytes_per_rank`: the bytes of one layer's input activation each rank holds, with or
  without sequence parallelism.
* :func:`parameters_per_rank`: the parameters TP rank 0 holds for a model config.
* :func:`context_parallel_bytes_per_cut`: the bytes one context-parallel cut sends forward per layer (the SSD's
  final state and the conv's halo), at mamba2-2.7b's sizes by default.

Each checker prints one line and returns True or False; it never raises on a wrong answer, and an answer
left as ``None`` or ``...`` reads "not attempted yet". The TP defaults are the 460M-parameter model's step:
d_model 1024, 8 × 2048 tokens, bf16 activations (2 bytes); the CP defaults mamba2-2.7b's layer at b = 1: h 80,
p 64, n 128, conv_dim 5120 + 2·128 = 5376, d_conv 4, bf16 activations.
"""
from __future__ import annotations

from mambalab.exercises import not_attempted

__all__ = ["activation_bytes_per_rank", "allreduce_bytes_per_layer", "context_parallel_bytes_per_cut",
           "parameters_per_rank"]


def _number(answer):
    try:
        return float(answer)
    except (TypeError, ValueError):
        return None


def _compare(answer, want: float, what: str, rtol: float = 1e-6) -> bool:
    if not_attempted(answer):
        return False
    got = _number(answer)
    if got is None:
        print(f"✗ expected a number of {what}; got {answer!r}")
        return False
    ok = abs(got - want) <= rtol * max(abs(want), 1.0)
    if ok:
        print(f"✓ right: {want:,.0f} {what}")
    else:
        ratio = f", {got / want:.3g}× the right value" if want else ""
        print(f"✗ expected {want:,.0f} {what}, got {got:,.0f} (off by {got - want:+,.0f}{ratio})")
    return ok


def allreduce_bytes_per_layer(answer, tp: int = 2, d_model: int = 1024, tokens: int = 8 * 2048,
                              element_size: int = 2) -> bool:
    """``answer``: bytes each rank sends in one layer's forward all-reduce of (tokens, d_model)."""
    from mambalab.parallel.cost import layer_communication

    want = layer_communication(d_model, tokens, tp, False, element_size)["forward_bytes"]
    return _compare(answer, want, f"bytes sent per rank (TP = {tp})")


def activation_bytes_per_rank(answer, tp: int = 4, sequence_parallel: bool = True, d_model: int = 1024,
                              tokens: int = 8 * 2048, element_size: int = 2) -> bool:
    """``answer``: bytes of one layer's (tokens, d_model) input activation each rank holds."""
    from mambalab.parallel.cost import layer_communication

    want = layer_communication(d_model, tokens, tp, sequence_parallel, element_size)["activation_bytes"]
    return _compare(answer, want, f"bytes held per rank (TP = {tp}, sequence parallel {sequence_parallel})")


def parameters_per_rank(answer, config, tp: int = 2) -> bool:
    """``answer``: parameters held by TP rank 0 of ``config`` (a :class:`mambalab.modules.lm.LMConfig`),
    counted on the tensor-parallel model built on the meta device."""
    from mambalab.parallel.cost import memory_per_rank

    if not_attempted(answer):
        return False
    want = memory_per_rank(config, tp)[0]["parameters"]
    return _compare(answer, want, f"parameters on rank 0 (TP = {tp})")


def context_parallel_bytes_per_cut(answer, batch: int = 1, nheads: int = 80, headdim: int = 64, d_state: int = 128,
                                   conv_dim: int = 5376, d_conv: int = 4, element_size: int = 2) -> bool:
    """``answer``: bytes one cut between context-parallel ranks sends forward in one layer: the SSD's final state
    (b, h, p, n) fp32 and the conv's last d_conv - 1 inputs (b, conv_dim, d_conv - 1) in the activations' dtype."""
    from mambalab.parallel.cost import context_parallel_communication

    want = context_parallel_communication(batch, nheads, headdim, d_state, conv_dim, d_conv, 2,
                                          element_size)["forward_bytes"]
    return _compare(answer, want, "bytes sent forward per cut and layer")
