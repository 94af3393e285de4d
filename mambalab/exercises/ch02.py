"""Exercises of chapter 02 (SSD chunking): checkers that say ✓ or ✗ and how far off.

* :func:`decay_mask`: write ``fn(a) -> L``, the 1-semiseparable decay mask of one head from its log-decays
  a = Δ A (l,): L[t, j] = exp(a_{j+1} + … + a_t) for t ≥ j, 0 above the diagonal. Checked against
  ``exp(`` :func:`mambalab.ref.ssd.segsum` ``)`` in float64, on short vectors and on a fp32 one whose running sum
  reaches -10⁴ before a slowly decaying stretch (chapter 02, section 4).
* :func:`crossover_chunk_size`: with the FLOP count of :func:`chunk_flops`, the largest power-of-two chunk size q
  at which the quadratic block inside a chunk still costs no more per position than the state side.

Each checker prints one line and returns True or False; it never raises on a wrong answer (an exception
raised by the reader's function is reported, not propagated), and an answer left as ``None`` or ``...``
reads "not attempted yet".
"""
from __future__ import annotations

import torch

from mambalab.exercises import not_attempted, verdict

__all__ = ["chunk_flops", "crossover_chunk_size", "crossover_chunk_size_expected", "decay_mask",
           "decay_mask_cases"]


def decay_mask_cases() -> dict[str, torch.Tensor]:
    """The log-decay vectors :func:`decay_mask` tries, by name: (l,) each, a ≤ 0."""
    gen = torch.Generator().manual_seed(0)
    return {
        "one step": torch.tensor([-0.7], dtype=torch.float64),
        "six random steps": -torch.rand(6, generator=gen, dtype=torch.float64),
        "a step of zero decay": torch.tensor([-0.5, 0.0, -1.5, -0.25], dtype=torch.float64),
        # section 4's case in fp32: 1000 steps of -10 (the running sum reaches -1e4, whose fp32 spacing is about
        # 1e-3), then 64 steps of -1e-4, each smaller than that spacing
        "fp32, -1e4 then slow decay": torch.cat([torch.full((1000,), -10.0), torch.full((64,), -1e-4)]),
    }


def decay_mask(fn, atol: float = 1e-6) -> bool:
    """``fn(a) -> L``: a (l,) log-decays (float64 or float32) -> L (l, l), L[t, j] = exp(a_{j+1} + … + a_t) for
    t ≥ j (1 on the diagonal), 0 for t < j. Passes when every case is within ``atol`` of the float64 mask
    (the fp32 case compares the last 64 rows and columns, the slow stretch, where L is close to 1)."""
    from mambalab.ref.ssd import segsum

    if not_attempted(fn):
        return False
    if not callable(fn):
        return verdict(False, "", f"expected a function a -> L; got {type(fn).__name__}")
    for name, a in decay_mask_cases().items():
        l = a.shape[0]
        try:
            got = fn(a.clone())
        except Exception as err:  # noqa: BLE001 - the reader's code: report, never raise
            return verdict(False, "", f"on {name!r} your function raised {type(err).__name__}: {err}")
        try:
            got = torch.as_tensor(got).detach().to("cpu", torch.float64)
        except (TypeError, ValueError, RuntimeError) as err:
            return verdict(False, "", f"on {name!r}: expected a tensor, got {type(got).__name__} ({err})")
        if got.shape != (l, l):
            return verdict(False, "", f"on {name!r} (l = {l}): expected shape ({l}, {l}), got {tuple(got.shape)}")
        want = torch.exp(segsum(a.double()))
        seen = slice(l - 64, None) if l > 64 else slice(None)
        diff = (got - want)[seen, seen].abs().nan_to_num(nan=float("inf"))
        err = diff.max().item()
        if not err <= atol:
            t, j = (int(i) for i in torch.unravel_index(diff.argmax(), diff.shape))
            offset = seen.start or 0
            t, j = t + offset, j + offset
            return verdict(False, "", f"on {name!r}: max |L - exact| = {err:.3g} (allowed {atol:g}); at t = {t}, "
                                      f"j = {j} you give {got[t, j].item():.9g}, exactly {want[t, j].item():.9g}")
    return verdict(True, f"right: every mask within {atol:g} of float64, the fp32 slow stretch included", "")


def chunk_flops(q: int, p: int = 64, n: int = 128) -> tuple[float, float]:
    """FLOPs per position and head of the chunked algorithm with chunks of q, split in two (a multiply-add is
    2 FLOPs; the exp, masks and Δ scaling are left out):

    * the quadratic block inside a chunk: C Bᵀ (entries each a dot over n) and (L ∘ C Bᵀ) X (entries times p),
      over the entries the chunk-scan kernel computes. Its programs visit only the column blocks on and below the
      diagonal (``mambalab.kernels.ssd.chunk_scan``; mamba-ssm's ``_chunk_scan_fwd_kernel`` likewise), so the
      convention here is q²/2 of the q² entries (the upper halves of the diagonal blocks left out):
      2 · q²/2 · (n + p) a chunk, so ``q (n + p)`` a position;
    * the state side: each position's term of its chunk's state (p n multiply-adds), its read-out of the
      entering state (p n), and its share of the state passing (p n multiply-adds a chunk, shared by q
      positions): ``4 p n + 2 p n / q``.

    Returns (quadratic block, state side)."""
    if q < 1 or p < 1 or n < 1:
        raise ValueError(f"q, p and n must be positive; got {q}, {p}, {n}")
    return 1.0 * q * (n + p), 4.0 * p * n + 2.0 * p * n / q


def crossover_chunk_size_expected(p: int = 64, n: int = 128) -> int:
    """The largest power of two q with quadratic block ≤ state side in :func:`chunk_flops`."""
    q = 1
    while chunk_flops(2 * q, p, n)[0] <= chunk_flops(2 * q, p, n)[1]:
        q *= 2
    return q


def crossover_chunk_size(answer, p: int = 64, n: int = 128) -> bool:
    """``answer``: the largest power-of-two chunk size q at which the quadratic block of :func:`chunk_flops`
    still costs no more FLOPs per position than the state side, at head dimension p and state size n."""
    if not_attempted(answer):
        return False
    try:
        got = int(answer)
        if got != answer:
            raise ValueError
    except (TypeError, ValueError, OverflowError):
        return verdict(False, "", f"expected a power of two such as 32; got {answer!r}")
    if got < 1 or got & (got - 1):
        return verdict(False, "", f"expected a power of two; got {got}")
    want = crossover_chunk_size_expected(p, n)
    block, state = chunk_flops(got, p, n)
    side = "≤" if block <= state else ">"
    return verdict(got == want,
                   f"right: at q = {want} the quadratic block costs {block:,.0f} FLOPs a position, the state side "
                   f"{state:,.0f}; at q = {2 * want} the block costs more",
                   f"expected q = {want} at p = {p}, n = {n}; at your q = {got} the quadratic block costs "
                   f"{block:,.0f} FLOPs a position {side} {state:,.0f} for the state side "
                   f"({'the block already costs more' if side == '>' else 'a larger power of two still fits'})")
