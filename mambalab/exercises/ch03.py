"""Exercises of chapter 03 (Mamba-3): checkers that say ✓ or ✗ and how far off.

* :func:`trapezoid_weights`: the exponential-trapezoidal step's two input weights, (β_prev, β_cur) in
  h_k = α h_{k-1} + β_prev x_{k-1} + β_cur x_k, for given Δ, λ and a (b = 1), checked against
  :func:`mambalab.ref.discretization.coefficients`.
* :func:`decode_intensity`: the arithmetic intensity (FLOPs per byte) of one MIMO decode step of one head at
  rank r, in the cost model of :func:`mambalab.viz.mamba3_plots.decode_step_cost`.

Each checker prints one line and returns True or False; it never raises on a wrong answer, and an answer
left as ``None`` or ``...`` reads "not attempted yet".
"""
from __future__ import annotations

from mambalab.exercises import not_attempted, verdict

__all__ = ["decode_intensity", "decode_intensity_expected", "trapezoid_weights"]


def _numbers(answer, count: int) -> tuple[float, ...] | None:
    try:
        values = tuple(float(v) for v in answer)
    except (TypeError, ValueError):
        return None
    return values if len(values) == count else None


def trapezoid_weights(answer, dt: float = 0.5, lam: float = 0.25, a: float = -2.0, rtol: float = 1e-6) -> bool:
    """``answer``: (β_prev, β_cur), the weights of the previous and the current input in one
    exponential-trapezoidal step of h' = a h + x (b = 1) at step Δ = ``dt`` with trapezoid weight λ = ``lam``."""
    from mambalab.ref.discretization import coefficients

    if not_attempted(answer):
        return False
    got = _numbers(answer, 2)
    if got is None:
        return verdict(False, "", f"expected a pair of numbers (β_prev, β_cur); got {answer!r}")
    _, want_prev, want_cur = coefficients("exp_trapezoidal", a, 1.0, dt, lam)
    off = [abs(g - w) for g, w in zip(got, (want_prev, want_cur))]
    ok = all(o <= rtol * max(abs(w), 1e-12) for o, w in zip(off, (want_prev, want_cur)))
    swapped = abs(got[0] - want_cur) <= rtol * abs(want_cur) and abs(got[1] - want_prev) <= rtol * abs(want_prev)
    hint = " (the two are swapped: the previous input's weight comes first)" if swapped and not ok else ""
    return verdict(ok, f"right: β_prev = {want_prev:.6g}, β_cur = {want_cur:.6g} at Δ = {dt:g}, λ = {lam:g}, "
                       f"a = {a:g}",
                   f"at Δ = {dt:g}, λ = {lam:g}, a = {a:g} expected ({want_prev:.6g}, {want_cur:.6g}); got "
                   f"({got[0]:.6g}, {got[1]:.6g}), off by {got[0] - want_prev:+.3g} and {got[1] - want_cur:+.3g}"
                   f"{hint}")


def decode_intensity_expected(rank: int, headdim: int = 64, d_state: int = 128) -> float:
    """FLOPs over bytes of :func:`mambalab.viz.mamba3_plots.decode_step_cost` (fp32 state, 16-bit activations)."""
    from mambalab.viz.mamba3_plots import decode_step_cost

    flops, nbytes = decode_step_cost(rank, headdim, d_state)
    return flops / nbytes


def decode_intensity(answer, rank: int = 4, headdim: int = 64, d_state: int = 128, rtol: float = 0.01) -> bool:
    """``answer``: FLOPs per byte of one decode step of one head at MIMO rank ``rank`` (p = ``headdim``,
    n = ``d_state``, the state in fp32 and activations in 16 bits), within ``rtol``."""
    from mambalab.viz.mamba3_plots import H200_BF16_FLOPS, H200_BYTES_PER_S, H200_FP32_FLOPS

    if not_attempted(answer):
        return False
    try:
        got = float(answer)
    except (TypeError, ValueError):
        return verdict(False, "", f"expected a number (FLOPs per byte); got {answer!r}")
    want = decode_intensity_expected(rank, headdim, d_state)
    fp32_ridge, tensor_ridge = H200_FP32_FLOPS / H200_BYTES_PER_S, H200_BF16_FLOPS / H200_BYTES_PER_S
    return verdict(abs(got - want) <= rtol * want,
                   f"right: {want:.3g} FLOP/byte at r = {rank}: {fp32_ridge / want:.2g}× below an H200's fp32 "
                   f"ridge point of {fp32_ridge:.0f} (where the step's arithmetic runs), {tensor_ridge / want:.0f}× "
                   f"below its bf16 tensor-core one of {tensor_ridge:.0f}",
                   f"at r = {rank}, p = {headdim}, n = {d_state} expected {want:.4g} FLOP/byte; got {got:.4g} "
                   f"({(got - want) / want:+.1%})")
