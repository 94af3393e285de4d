"""Exercises of chapter 04 (atomic-add nondeterminism): checkers that say ✓ or ✗ and how far off.

* :func:`atomic_gradients`: which SSD gradients does mambalab's ``reduction="atomic"`` backward perturb from
  run to run, for g groups of B/C over h heads? (Read where the backward kernels call ``tl.atomic_add``.)
* :func:`head_split`: mamba-ssm's dB/dC backward on a given GPU: how many heads does each program sum, and
  how many partials does the final ``sum`` add?
* :func:`norm_row_blocks`: mamba-ssm's gated RMSNorm backward on a given GPU: how many programs (weight
  gradient partials, ``nrow_groups``) does it launch, and how many rows does each take (``rows_per_program``)?
  Some programs may get fewer rows or none; the checker says how many.

Each checker prints one line and returns True or False; it never raises on a wrong answer, and an answer
left as ``None`` or ``...`` reads "not attempted yet".
"""
from __future__ import annotations

from mambalab.exercises import not_attempted, verdict

__all__ = ["atomic_gradients", "atomic_gradients_expected", "head_split", "norm_row_blocks"]

_GRADS = ("x", "dt", "A", "B", "C", "D", "z", "dt_bias")


def atomic_gradients_expected(g: int, h: int) -> set[str]:
    """The gradients whose bits mambalab's atomic backward can vary: dA, d dt_bias (chunk_cumsum_bwd, over
    batch rows and chunks), dD (chunk_scan_bwd's rows kernel, over rows, chunks and blocks of positions), and
    dB, dC when a group holds three heads or more (the heads of a group add into one value; two adds into a
    zeroed value give the same bits in either order, 0 + a + b = 0 + b + a, so h / g ≤ 2 cannot vary)."""
    return {"A", "dt_bias", "D"} | ({"B", "C"} if h // g >= 3 else set())


def _names(answer) -> set[str] | None:
    try:
        items = [answer] if isinstance(answer, str) else list(answer)
        return {str(a).strip().removeprefix("d") if str(a).strip() not in _GRADS else str(a).strip()
                for a in items}
    except TypeError:
        return None


def atomic_gradients(answer, g: int = 1, h: int = 4) -> bool:
    """``answer``: the names of the gradients that vary (``{"A", "dt_bias", ...}``; "dA" or "A" both read)."""
    if not_attempted(answer):
        return False
    got = _names(answer)
    if got is None:
        return verdict(False, "", f"expected a set of gradient names such as {{'A', 'B'}}; got {answer!r}")
    unknown = got - set(_GRADS)
    if unknown:
        return verdict(False, "", f"not SSD gradients: {sorted(unknown)} (the names are {list(_GRADS)})")
    want = atomic_gradients_expected(g, h)
    missing, extra = sorted(want - got), sorted(got - want)
    return verdict(not missing and not extra, f"right: at g={g}, h={h} the atomic adds reach {sorted(want)}",
                    f"at g={g}, h={h}: missing {missing or 'none'}, should not be there {extra or 'none'}")


def _pair(answer) -> tuple[int, int] | None:
    try:
        a, b = answer
        return int(a), int(b)
    except (TypeError, ValueError):
        return None


def head_split(answer, profile: str = "rtxa6000", b: int = 4, l: int = 4096, h: int = 32, g: int = 1,
               chunk_size: int = 256) -> bool:
    """``answer``: (heads per program, partials summed) of mamba-ssm's dB/dC backward on ``profile``."""
    from mambalab.determinism import ARCH_PROFILES
    from mambalab.determinism.mamba_ssm_splits import mamba_ssm_head_split

    if not_attempted(answer):
        return False
    got = _pair(answer)
    if got is None:
        return verdict(False, "", f"expected a pair (heads per program, partials); got {answer!r}")
    sm = ARCH_PROFILES[profile].sm_count
    want = mamba_ssm_head_split(b, -(-l // chunk_size), h, g, sm)
    return verdict(got == want, f"right: {sm} SMs give {want[0]} heads a program, {want[1]} partials",
                    f"{profile} ({sm} SMs): expected {want}, got {got} "
                    f"(off by {got[0] - want[0]:+d} heads, {got[1] - want[1]:+d} partials)")


def norm_row_blocks(answer, profile: str = "rtxa6000", rows: int = 256, d: int = 1024,
                    group_size: int | None = None) -> bool:
    """``answer``: (programs, rows per program) of mamba-ssm's gated RMSNorm backward on ``profile``
    (``nrow_groups`` and ``rows_per_program`` in ``layernorm_gated._layer_norm_bwd``)."""
    from mambalab.determinism import ARCH_PROFILES
    from mambalab.determinism.mamba_ssm_splits import mamba_ssm_norm_split

    if not_attempted(answer):
        return False
    got = _pair(answer)
    if got is None:
        return verdict(False, "", f"expected a pair (programs, rows per program); got {answer!r}")
    sm = ARCH_PROFILES[profile].sm_count
    want = mamba_ssm_norm_split(rows, d, sm, kind="gated", group_size=group_size)
    programs, per = want
    taken = [max(0, min(per, rows - i * per)) for i in range(programs)]     # row_end - row_start, per program
    full, empty = taken.count(per), taken.count(0)
    return verdict(got == want, f"right: {sm} SMs give {programs} programs of {per} rows: {full} take {per}, "
                                f"{programs - full - empty} fewer, {empty} none",
                    f"{profile} ({sm} SMs): expected {want}, got {got} "
                    f"(off by {got[0] - want[0]:+d} programs, {got[1] - want[1]:+d} rows)")
