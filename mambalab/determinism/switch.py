"""The determinism switch: one place that turns on every setting that decides whether gradients repeat.

Bits of a training step can change from one run to the next, or from one machine to another, for reasons
that live in different libraries. :func:`deterministic` (a context manager) and :func:`set_deterministic`
set all of them at once:

=====================================  ==========================  ===============================================
setting                                deterministic value         why
=====================================  ==========================  ===============================================
mambalab's reduction mode              "deterministic"             ``reduction=None`` in mambalab's ops resolves
                                                                   to per-program partials summed in a fixed
                                                                   order (:mod:`mambalab.kernels.reduce`), never
                                                                   atomics (:func:`resolve_reduction`)
``torch.use_deterministic_algorithms`` True                        torch's own ops pick deterministic kernels, or
                                                                   raise where none exists
``torch.utils.deterministic.           False                       with deterministic algorithms on, torch fills
fill_uninitialized_memory``                                        the tensors that ``torch.empty``,
                                                                   ``empty_like``, ``empty_strided`` and
                                                                   ``empty_permuted`` return, and ``resize_``'s
                                                                   new elements, with NaN, or an integer dtype's
                                                                   largest value, so that a read of unwritten
                                                                   memory repeats; a program that reads only what
                                                                   it wrote gets the same bits without the fills
                                                                   (torch's page
                                                                   docs.pytorch.org/docs/stable/deterministic.html),
                                                                   and mambalab's kernels write every element they
                                                                   allocate (tests/test_compat.py runs a routed
                                                                   step both ways, on the CPU)
``CUBLAS_WORKSPACE_CONFIG``            ``:4096:8``                 cuBLAS needs a fixed workspace to repeat its
                                                                   split-K sums (read when a handle is created)
TF32 (matmul and cuDNN)                off                         TF32 rounds inputs to 10 mantissa bits, on
                                                                   Ampere and later only: bits differ by GPU
``torch.backends.cudnn.deterministic`` True, ``benchmark`` False   cuDNN's autotuner picks by timing
mamba-ssm's deterministic mode         on (``MAMBA_DETERMINISTIC   its SSD backward sums per program instead of
                                       =1`` and                    with atomics (its dB/dC splits still read the
                                       ``set_deterministic_mode``) SM count: see :mod:`mambalab.determinism.arch`)
Triton autotuners (mamba-ssm's)        pinned to the first         timing picks differ by machine and run
                                       configuration               (:mod:`mambalab.determinism.autotune`)
=====================================  ==========================  ===============================================

TF32 here is torch's (cuBLAS, cuDNN). Triton kernels choose their ``tl.dot`` precision themselves: mambalab's
follow :func:`mambalab.device.dot_precision` (TF32 tensor cores for fp32 operands on a GPU, as mamba-ssm's),
which repeats bit for bit on one GPU model but is part of the hardware's arithmetic across models.

mambalab's own kernels have no autotuner: every tile comes from a shape rule
(:func:`mambalab.kernels.ssd.tiles.tile_config`), so pinning changes nothing for them. mamba-ssm decides at
*import* whether to prune its autotuned configurations to one (its ``autotune_configs`` reads the mode when
its modules load); ``MAMBA_DETERMINISTIC=1`` set here reaches a mamba-ssm imported inside the block, while an
already-imported one keeps the configurations it loaded with and gets only ``set_deterministic_mode``.

The library default is deterministic: without touching the switch, ``is_deterministic()`` is True and
``reduction=None`` means "deterministic" (torch's global settings are left alone until you use the switch).
"""
from __future__ import annotations

import contextlib
import os
import sys
from dataclasses import dataclass, fields
from typing import Iterator

import torch

from mambalab.determinism import autotune

__all__ = ["REDUCTIONS", "Settings", "deterministic", "is_deterministic", "resolve_reduction",
           "set_deterministic"]

REDUCTIONS = ("atomic", "deterministic")
CUBLAS_WORKSPACE = ":4096:8"
_MAMBA_DETERMINISM_MODULE = "mamba_ssm.utils.determinism"

_mambalab_deterministic = True  # the library default


def is_deterministic() -> bool:
    """Whether mambalab's ops reduce deterministically when called with ``reduction=None`` (default True)."""
    return _mambalab_deterministic


def resolve_reduction(reduction: str | None) -> str:
    """The reduction an op uses: ``reduction`` itself if given ("atomic" or "deterministic"), else the switch's.

    An explicit argument wins over the switch, so a notebook can show the atomic mode inside a
    deterministic block. Raises ValueError for anything else, naming the argument.
    """
    if reduction is None:
        return "deterministic" if _mambalab_deterministic else "atomic"
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be None, 'atomic' or 'deterministic'; got {reduction!r}")
    return reduction


def _mamba_determinism():
    """mamba-ssm's determinism module if mamba-ssm is already imported (never imports it: that takes seconds)."""
    return sys.modules.get(_MAMBA_DETERMINISM_MODULE)


_UNSET = object()  # an environment variable that was not set


@dataclass
class Settings:
    """A snapshot of every setting the switch touches; :meth:`capture` reads them, :meth:`apply` writes them.

    ``mamba_ssm_override`` is mamba-ssm's ``_deterministic_override`` (None: follow the environment and
    torch), or ``_UNSET`` when mamba-ssm is not imported.
    """

    mambalab: bool
    torch_deterministic: bool
    torch_warn_only: bool
    fill_uninitialized_memory: bool
    matmul_tf32: bool
    cudnn_tf32: bool
    float32_matmul_precision: str
    cudnn_deterministic: bool
    cudnn_benchmark: bool
    cublas_workspace_config: object
    mamba_deterministic_env: object
    mamba_ssm_override: object
    autotune_pinned: bool

    @classmethod
    def capture(cls) -> "Settings":
        mamba = _mamba_determinism()
        return cls(
            mambalab=_mambalab_deterministic,
            torch_deterministic=torch.are_deterministic_algorithms_enabled(),
            torch_warn_only=torch.is_deterministic_algorithms_warn_only_enabled(),
            fill_uninitialized_memory=torch.utils.deterministic.fill_uninitialized_memory,
            matmul_tf32=torch.backends.cuda.matmul.allow_tf32,
            cudnn_tf32=torch.backends.cudnn.allow_tf32,
            float32_matmul_precision=torch.get_float32_matmul_precision(),
            cudnn_deterministic=torch.backends.cudnn.deterministic,
            cudnn_benchmark=torch.backends.cudnn.benchmark,
            cublas_workspace_config=os.environ.get("CUBLAS_WORKSPACE_CONFIG", _UNSET),
            mamba_deterministic_env=os.environ.get("MAMBA_DETERMINISTIC", _UNSET),
            mamba_ssm_override=getattr(mamba, "_deterministic_override", None) if mamba else _UNSET,
            autotune_pinned=autotune.policy() == "pinned",
        )

    def apply(self) -> None:
        global _mambalab_deterministic
        _mambalab_deterministic = bool(self.mambalab)
        torch.use_deterministic_algorithms(self.torch_deterministic, warn_only=self.torch_warn_only)
        torch.utils.deterministic.fill_uninitialized_memory = self.fill_uninitialized_memory
        torch.backends.cuda.matmul.allow_tf32 = self.matmul_tf32
        torch.backends.cudnn.allow_tf32 = self.cudnn_tf32
        torch.set_float32_matmul_precision(self.float32_matmul_precision)
        torch.backends.cudnn.deterministic = self.cudnn_deterministic
        torch.backends.cudnn.benchmark = self.cudnn_benchmark
        for name, value in (("CUBLAS_WORKSPACE_CONFIG", self.cublas_workspace_config),
                            ("MAMBA_DETERMINISTIC", self.mamba_deterministic_env)):
            if value is _UNSET:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        mamba = _mamba_determinism()
        if mamba is not None and self.mamba_ssm_override is not _UNSET:
            mamba.set_deterministic_mode(self.mamba_ssm_override)
        autotune.set_pinned(self.autotune_pinned)

    def as_dict(self) -> dict:
        """JSON-friendly: unset environment variables and a not-imported mamba-ssm become None."""
        return {f.name: (None if getattr(self, f.name) is _UNSET else getattr(self, f.name)) for f in fields(self)}


def _target(flag: bool, now: Settings) -> Settings:
    """The settings :func:`set_deterministic` (flag) moves to from ``now``.

    True: every setting at its deterministic value. False: the determinism flags off (mambalab reduces with
    atomics, torch's deterministic algorithms off, cuDNN free to pick, mamba-ssm's mode off); TF32,
    ``CUBLAS_WORKSPACE_CONFIG`` and the memory fill are precision, workspace and debugging choices, left as
    they are.
    """
    mamba_imported = _mamba_determinism() is not None
    if flag:
        return Settings(
            mambalab=True, torch_deterministic=True, torch_warn_only=False, fill_uninitialized_memory=False,
            matmul_tf32=False, cudnn_tf32=False,
            float32_matmul_precision="highest", cudnn_deterministic=True, cudnn_benchmark=False,
            cublas_workspace_config=CUBLAS_WORKSPACE, mamba_deterministic_env="1",
            mamba_ssm_override=True if mamba_imported else _UNSET, autotune_pinned=True)
    return Settings(
        mambalab=False, torch_deterministic=False, torch_warn_only=False,
        fill_uninitialized_memory=now.fill_uninitialized_memory, matmul_tf32=now.matmul_tf32,
        cudnn_tf32=now.cudnn_tf32, float32_matmul_precision=now.float32_matmul_precision, cudnn_deterministic=False,
        cudnn_benchmark=now.cudnn_benchmark, cublas_workspace_config=now.cublas_workspace_config,
        mamba_deterministic_env="0", mamba_ssm_override=False if mamba_imported else _UNSET, autotune_pinned=False)


def set_deterministic(flag: bool) -> None:
    """Switch every setting in the module docstring's table to its deterministic value (True), or turn the
    determinism flags off (False; TF32, ``CUBLAS_WORKSPACE_CONFIG`` and the memory fill are left as they are). Not undone
    automatically: :func:`deterministic` is the scoped form."""
    if not isinstance(flag, bool):
        raise TypeError(f"flag must be a bool; got {flag!r}")
    _target(flag, Settings.capture()).apply()


@contextlib.contextmanager
def deterministic(flag: bool = True) -> Iterator[Settings]:
    """``with deterministic():`` every setting at its deterministic value inside the block; on exit (also on
    an exception) every setting it changed is put back as it was. Yields the settings in force before.

    ``deterministic(False)`` is the scoped opposite (atomics and torch's nondeterministic kernels allowed).
    """
    if not isinstance(flag, bool):
        raise TypeError(f"flag must be a bool; got {flag!r}")
    before = Settings.capture()
    try:
        _target(flag, before).apply()
        yield before
    finally:
        before.apply()
