"""Exercises of chapter 05 (deterministic kernels): checkers that say ✓ or ✗ and how far off.

* :func:`bit_patterns`: over a set of emulated GPUs, how many distinct dB bit patterns does a deterministic
  mode give: mamba-ssm's (its dB/dC split follows the SM count) or mambalab's (nothing reads the SM count)?
* :func:`fold_order`: write the order in which :func:`mambalab.kernels.reduce.sum_partials` adds P partials;
  checked bit for bit against the kernel for several P.

Each checker prints one line and returns True or False; it never raises on a wrong answer, and an answer
left as ``None`` or ``...`` reads "not attempted yet".
"""
from __future__ import annotations

from mambalab.exercises import not_attempted, verdict

__all__ = ["bit_patterns", "bit_patterns_expected", "fold_order"]

QUOTED_PROFILES = ("rtx4090", "rtxa6000", "h200", "l4")


def bit_patterns_expected(impl: str, profiles=QUOTED_PROFILES, b: int = 4, l: int = 4096, h: int = 32,
                          g: int = 1, chunk_size: int = 256) -> int:
    """Distinct dB bit patterns over ``profiles`` in a deterministic mode, autotuning pinned: for mamba-ssm one
    per distinct (heads per program, splits) of its dB/dC backward, for mambalab one."""
    from mambalab.determinism import ARCH_PROFILES
    from mambalab.determinism.mamba_ssm_splits import mamba_ssm_head_split

    if impl == "mambalab":
        return 1
    c = -(-l // chunk_size)
    return len({mamba_ssm_head_split(b, c, h, g, ARCH_PROFILES[p].sm_count) for p in profiles})


def bit_patterns(answer, impl: str = "mamba_ssm", profiles=QUOTED_PROFILES) -> bool:
    """``answer``: the number of distinct dB bit patterns over ``profiles`` (``impl`` "mamba_ssm" or
    "mambalab"), at the quoted shape b=4, l=4096, h=32, g=1, chunk 256."""
    if not_attempted(answer):
        return False
    if impl not in ("mamba_ssm", "mambalab"):
        return verdict(False, "", f"impl must be 'mamba_ssm' or 'mambalab'; got {impl!r}")
    try:
        got = int(answer)
    except (TypeError, ValueError):
        return verdict(False, "", f"expected a whole number of bit patterns; got {answer!r}")
    want = bit_patterns_expected(impl, profiles)
    return verdict(got == want, f"right: {want} pattern{'s' * (want != 1)} over {len(profiles)} GPUs ({impl})",
                    f"{impl} over {list(profiles)}: expected {want}, got {got} (off by {got - want:+d})")


def _trial_partials(P: int, seed: int):
    """P fp32 partials whose magnitudes span many binades, so that two orders rarely give the same bits."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    return torch.randn(P, generator=gen) * torch.exp2(torch.randint(-12, 12, (P,), generator=gen).float())


def fold_order(fold, sizes=(5, 32, 33, 100, 1100)) -> bool:
    """``fold``: a function from a 1-d fp32 tensor of P partials to their fp32 sum; ✓ when it matches
    :func:`mambalab.kernels.reduce.sum_partials` bit for bit at every P in ``sizes``."""
    import torch

    from mambalab.kernels.reduce import sum_partials

    if not_attempted(fold):
        return False
    if not callable(fold):
        return verdict(False, "", f"expected a function fold(partials) -> sum; got {fold!r}")
    kernel_device = "cuda" if torch.cuda.is_available() else "cpu"
    for P in sizes:
        x = _trial_partials(P, seed=P)
        # the kernel on the device kernels run on here (a GPU process runs Triton natively, not on CPU tensors)
        want = sum_partials(x.view(1, P, 1).to(kernel_device), dim=1).reshape(()).cpu()
        try:
            got = fold(x.clone())
        except Exception as err:   # the reader's code: report, never raise
            return verdict(False, "", f"fold raised at P={P}: {type(err).__name__}: {err}")
        if got is None or got is Ellipsis:
            print("… not attempted yet: fold returned None; write its body and run the cell again")
            return False
        try:
            got = torch.as_tensor(got, dtype=torch.float32).reshape(())
        except (TypeError, ValueError, RuntimeError):
            return verdict(False, "", f"fold must return one number; at P={P} it returned {got!r}")
        if got.view(torch.int32) != want.view(torch.int32):
            off = abs(float(got) - float(want))
            return verdict(False, "", f"at P={P}: sum_partials gives {float(want)!r}, your fold {float(got)!r} "
                            f"(off by {off:.3g}, {off / max(abs(float(want)), 1e-30):.2g} relative)")
    return verdict(True, f"right: your fold matches sum_partials bit for bit at P = {', '.join(map(str, sizes))}", "")
