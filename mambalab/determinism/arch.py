"""GPU profiles, and :func:`emulate`: run as if on another GPU model, as far as software can see.

A kernel's *launcher* (Python) can read the GPU it runs on and let that choose how work is split:
mamba-ssm's SSD backward sums dB and dC over ``nheads_per_program = ceil(b·c·h / sm_count)`` heads per
program (capped at h/g) before a final sum over the splits, and its layer norms size their persistent grids
by ``sm_count``; Triton's autotuner keeps whichever configuration was fastest *here*. Each of those changes
the order of floating-point sums, so the same code on an RTX 4090 (128 SMs) and an RTX A6000 (84 SMs) gives
different bits, even in mamba-ssm's deterministic mode. mambalab's launchers read none of it: splits and
tiles come from the shape (:mod:`mambalab.kernels.ssd.tiles`), sums from :mod:`mambalab.kernels.reduce`.

``with emulate("rtxa6000"):`` makes those software-visible choices behave as on that GPU, on any machine:

* ``torch.cuda.get_device_properties(...)`` (what mamba-ssm reads, and what ``get_device_name`` reads)
  returns the profile's ``name`` and ``multi_processor_count``; on a real GPU every other attribute is
  the real one's, the compute capability (``major``/``minor``) included: Triton picks the architecture it
  compiles for from ``get_device_capability``, and code compiled for the profile's architecture (sm_86,
  sm_89) does not load on an sm_90 GPU (CUDA's "no kernel image is available"). On the CPU
  (no GPU) the call answers with the whole profile, its capability too, instead of raising, so the
  emulated values can be inspected;
* on a real GPU, Triton's driver-level ``get_device_properties(...)["multiprocessor_count"]`` (what
  persistent kernels written against Triton read) likewise;
* Triton's autotuner picks a fixed configuration per profile instead of timing
  (:mod:`mambalab.determinism.autotune`); on a real GPU, among the configurations that run on it (one
  that needs more shared memory than this GPU has is dropped, as Triton's own timing drops it; one that
  fits here but not on the emulated GPU is not);
* on a machine without a GPU, ``torch.cuda.device(i)`` for a CPU tensor's index (None) selects nothing
  instead of raising, so launchers that wrap their launch in it (all of mamba-ssm's Triton ops) run
  through Triton's CPU interpreter, reading the emulated SM count: mamba-ssm's own code then splits its work
  as it would on that GPU (slowly: its tiles are sized for GPUs).

What emulation cannot reproduce: the hardware's own arithmetic. Special-function units (``exp``, ``log``,
``rsqrt`` approximations), tensor-core accumulation order and width inside ``tl.dot``/cuBLAS, FMA
contraction and the code the compiler emits for the real architecture (Triton still compiles for the GPU
that is present, whatever the profile says; cuBLAS still picks its kernels for it) all stay those of the
machine the code runs on. So emulation shows the differences that come from *software reading the
hardware*; to check the rest, run ``mambalab fingerprint`` (same flags) on the real machines and compare
the printed fingerprints: equal fingerprints mean equal bits.

So on a real GPU, code that branches on the compute capability takes the real GPU's branch; only the SM
count, the name and the autotuner's pick are the profile's.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator

import torch

from mambalab.determinism import autotune

__all__ = ["ARCH_PROFILES", "ArchProfile", "EmulatedDeviceProperties", "current_profile", "emulate", "get_profile"]


@dataclass(frozen=True)
class ArchProfile:
    """What software can see of a GPU model: the values launchers and autotuners read.

    sm_count is the number of streaming multiprocessors (``multi_processor_count``); compute_capability
    the (major, minor) pair Triton compiles for (``sm_{major}{minor}``).
    """

    key: str
    name: str
    architecture: str
    compute_capability: tuple[int, int]
    sm_count: int
    memory_gib: int

    @property
    def sm_arch(self) -> str:
        """``sm_86`` style."""
        return f"sm_{self.compute_capability[0]}{self.compute_capability[1]}"

    def describe(self) -> str:
        return f"{self.name} ({self.architecture}, {self.sm_arch}, {self.sm_count} SMs)"


ARCH_PROFILES: dict[str, ArchProfile] = {p.key: p for p in (
    ArchProfile("rtx4090", "NVIDIA GeForce RTX 4090", "Ada Lovelace", (8, 9), 128, 24),
    ArchProfile("rtxa6000", "NVIDIA RTX A6000", "Ampere", (8, 6), 84, 48),
    ArchProfile("rtx3090", "NVIDIA GeForce RTX 3090", "Ampere", (8, 6), 82, 24),
    ArchProfile("a100", "NVIDIA A100-SXM4-80GB", "Ampere", (8, 0), 108, 80),
    ArchProfile("h100", "NVIDIA H100 80GB HBM3", "Hopper", (9, 0), 132, 80),
    ArchProfile("h200", "NVIDIA H200", "Hopper", (9, 0), 132, 141),
    ArchProfile("l4", "NVIDIA L4", "Ada Lovelace", (8, 9), 58, 24),
)}


def get_profile(profile: str | ArchProfile) -> ArchProfile:
    """``profile`` as an :class:`ArchProfile` (a key of ARCH_PROFILES, or a profile itself)."""
    if isinstance(profile, ArchProfile):
        return profile
    if isinstance(profile, str) and profile in ARCH_PROFILES:
        return ARCH_PROFILES[profile]
    raise ValueError(f"profile must be an ArchProfile or one of {sorted(ARCH_PROFILES)}; got {profile!r}")


class EmulatedDeviceProperties:
    """``torch.cuda.get_device_properties``'s answer under :func:`emulate`: the profile's name,
    multi_processor_count and total_memory; on a real GPU the real device's other attributes, its compute
    capability included (Triton compiles for it); without a GPU the profile's compute capability."""

    def __init__(self, profile: ArchProfile, real=None):
        self.profile = profile
        self._real = real
        self.name = profile.name
        self.major, self.minor = (real.major, real.minor) if real is not None else profile.compute_capability
        self.multi_processor_count = profile.sm_count
        self.total_memory = profile.memory_gib * 2**30

    def __getattr__(self, attr):  # only for attributes not set above
        real = self.__dict__.get("_real")
        if real is not None:
            return getattr(real, attr)
        raise AttributeError(f"emulated device properties ({self.profile.key}, no real GPU here) have no {attr!r}")

    def __repr__(self) -> str:
        return (f"EmulatedDeviceProperties(name={self.name!r}, major={self.major}, minor={self.minor}, "
                f"multi_processor_count={self.multi_processor_count}, emulated={self.profile.key!r})")


_stack: list[ArchProfile] = []


def current_profile() -> ArchProfile | None:
    """The profile being emulated (the innermost :func:`emulate`), or None."""
    return _stack[-1] if _stack else None


def _triton_driver_utils():
    """Triton's CUDA driver utilities, when a GPU is present (the interpreter has none)."""
    if not torch.cuda.is_available():
        return None
    try:
        from triton.runtime import driver
        utils = driver.active.utils
        utils.get_device_properties  # noqa: B018  (check it exists)
        return utils
    except Exception:  # pragma: no cover - other backends
        return None


@contextlib.contextmanager
def emulate(profile: str | ArchProfile) -> Iterator[ArchProfile]:
    """Within the block, software-visible hardware choices behave as on ``profile`` (see the module docstring).

    Args:
        profile: a key of :data:`ARCH_PROFILES` ("rtx4090", "rtxa6000", "rtx3090", "a100", "h100", "h200",
            "l4") or an :class:`ArchProfile`.

    Yields the profile. Blocks nest (the innermost wins); everything is restored on exit, also on an
    exception.
    """
    prof = get_profile(profile)
    real_props = torch.cuda.get_device_properties

    def get_device_properties(device=None):
        real = real_props(device) if torch.cuda.is_available() else None
        return EmulatedDeviceProperties(prof, real)

    utils = _triton_driver_utils()
    real_triton_props = utils.get_device_properties if utils is not None else None

    def triton_device_properties(device):
        props = dict(real_triton_props(device))
        props["multiprocessor_count"] = prof.sm_count
        return props

    real_device = torch.cuda.device

    def select_device(index):  # only installed without a GPU
        if index is None or getattr(index, "type", None) == "cpu":   # a CPU tensor's device (index)
            return contextlib.nullcontext()
        return real_device(index)

    _stack.append(prof)
    old_key = autotune.set_emulated(prof.key)
    torch.cuda.get_device_properties = get_device_properties
    if utils is not None:
        utils.get_device_properties = triton_device_properties
    if not torch.cuda.is_available():
        torch.cuda.device = select_device
    try:
        yield prof
    finally:
        torch.cuda.device = real_device
        torch.cuda.get_device_properties = real_props
        if utils is not None:
            utils.get_device_properties = real_triton_props
        autotune.set_emulated(old_key)
        _stack.pop()
