"""mamba-ssm, the reference implementation, loaded so that its usable parts work on any machine.

mamba-ssm 2.3.2.post1 ships only an sdist. Built without its CUDA extension (``MAMBA_SKIP_CUDA_BUILD=TRUE``,
the only way on a machine without CUDA), ``import mamba_ssm`` fails: its package ``__init__`` imports
``selective_scan_cuda`` unconditionally. This module is the one place in mambalab that handles that: when
the extension cannot be imported, it registers a stand-in module under that name whose every attribute
raises :class:`MambaCudaExtensionMissing` with instructions. Everything else in mamba-ssm (the pure-PyTorch
references, the Triton kernels on a GPU) then imports and works; only the CUDA-only ops fail, clearly.

Use :func:`load` (or the helpers below) rather than ``import mamba_ssm`` anywhere in mambalab.
"""
from __future__ import annotations

import importlib
import sys
import types
from contextlib import contextmanager
from functools import lru_cache

EXTENSION = "selective_scan_cuda"
BUILD_HINT = (
    "mamba-ssm's CUDA extension `selective_scan_cuda` is not built in this environment (it was installed "
    "with MAMBA_SKIP_CUDA_BUILD=TRUE, the only way without nvcc). On a machine with a CUDA GPU and nvcc, "
    "reinstall it with: MAMBALAB_BUILD_MAMBA_CUDA=1 ./run.sh setup  (after `pip uninstall mamba-ssm`), or "
    "compile it with torch.utils.cpp_extension.load from the sdist's csrc/selective_scan sources. "
    "On a CPU, use mamba_ssm.ops.selective_scan_interface.selective_scan_ref or mambalab.ops.selective_scan."
)


class MambaCudaExtensionMissing(RuntimeError):
    """A mamba-ssm op needs the CUDA extension that this installation lacks."""


class _MissingExtension(types.ModuleType):
    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        raise MambaCudaExtensionMissing(f"{EXTENSION}.{name} was called, but {BUILD_HINT}")


def cuda_extension_available() -> bool:
    """True when mamba-ssm's real CUDA extension is importable (after :func:`load`)."""
    load()
    return not isinstance(sys.modules.get(EXTENSION), _MissingExtension)


@lru_cache(maxsize=None)
def load() -> types.ModuleType:
    """Import mamba_ssm, standing in for its CUDA extension if that is missing. Returns the package."""
    if EXTENSION not in sys.modules:
        try:
            importlib.import_module(EXTENSION)
        except ImportError:
            sys.modules[EXTENSION] = _MissingExtension(EXTENSION)
    try:
        return importlib.import_module("mamba_ssm")
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError(
            "mamba-ssm is not installed. ./run.sh setup installs it; by hand: "
            "MAMBA_FORCE_BUILD=TRUE MAMBA_SKIP_CUDA_BUILD=TRUE pip install --no-build-isolation "
            "mamba-ssm==2.3.2.post1"
        ) from err


def version() -> str | None:
    """mamba-ssm's version, or None if it is not installed (does not import it)."""
    from importlib.metadata import PackageNotFoundError, version as _version

    try:
        return _version("mamba-ssm")
    except PackageNotFoundError:
        return None


def module(name: str) -> types.ModuleType:
    """A submodule of mamba_ssm, e.g. ``module("ops.selective_scan_interface")``."""
    load()
    return importlib.import_module(f"mamba_ssm.{name}")


@lru_cache(maxsize=None)
def source_function(name: str, function: str):
    """One function of a mamba-ssm module that cannot be imported on this machine, compiled from the installed
    module's source alone, e.g. ``source_function("ops.cute.mamba3.mamba3_step_fn",
    "selective_state_update_fused_ref_v2")``: mamba-ssm's PyTorch reference of its Mamba-3 decode step sits in
    a module that imports CUDA-only packages (cutlass, the CuTe DSL) at its top.

    Only the function's own definition is compiled, with ``torch``, ``F`` (torch.nn.functional), ``math``,
    ``Tensor`` and ``Optional`` as its globals: for self-contained PyTorch code, which a reference is; a
    function that calls anything else of its module fails with a NameError when called. Raises LookupError
    when the module has no such top-level function. Compiled once per (name, function)."""
    import ast
    import importlib.util
    import math
    from typing import Optional

    import torch

    load()
    path = importlib.util.find_spec(f"mamba_ssm.{name}").origin   # finds the file without running it
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), filename=path)
    found = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == function]
    if not found:
        raise LookupError(f"mamba_ssm.{name} ({path}) defines no top-level function {function!r}")
    namespace = {"torch": torch, "F": torch.nn.functional, "math": math, "Tensor": torch.Tensor,
                 "Optional": Optional}
    exec(compile(ast.Module(body=found, type_ignores=[]), path, "exec"), namespace)   # noqa: S102 - its source
    return namespace[function]


def selective_scan_ref():
    """mamba-ssm's pure-PyTorch selective scan (runs anywhere)."""
    return module("ops.selective_scan_interface").selective_scan_ref


def selective_scan_fn():
    """mamba-ssm's CUDA selective scan; calling it without the extension raises MambaCudaExtensionMissing."""
    return module("ops.selective_scan_interface").selective_scan_fn


def autotuners(module_prefix: str) -> list:
    """The Triton autotuners defined in the imported modules whose names start with ``module_prefix`` (e.g.
    ``"mamba_ssm.ops.triton.mamba3"``), each once, also when another module imported it too."""
    from triton.runtime.autotuner import Autotuner

    found = {id(v): v for name, mod in list(sys.modules.items()) if name.startswith(module_prefix)
             for v in vars(mod).values() if isinstance(v, Autotuner)}
    return list(found.values())


def block_cost(config) -> int:
    """How much a Triton configuration asks of an SM, roughly: the product of its BLOCK_SIZE_* values times its
    pipelining stages (shared memory grows with both)."""
    cost = 1
    for key, value in config.kwargs.items():
        if key.startswith("BLOCK_SIZE_"):
            cost *= value
    return cost * (config.num_stages or 1)


@contextmanager
def single_config(module_prefix: str = "mamba_ssm.ops.triton", smallest: bool = False):
    """Within the block, every autotuner of :func:`autotuners` (``module_prefix``) tries only one configuration:
    its first, or with ``smallest`` its cheapest by :func:`block_cost`; they get all of them back afterwards.
    For numerical comparisons with mamba-ssm on a GPU: its Mamba-3 kernels autotune over some 190
    configurations, minutes of compiling and timing on a fresh machine before the first result, and a
    comparison's tolerance holds whichever configuration runs. Its SSD kernels need ``smallest``: the first
    configuration of its chunk-scan forward asks for 273 KiB of shared memory, more than an H200 has (the
    autotuner skips such a configuration only when it has others to try). Import the mamba-ssm modules first
    (:func:`module`): only autotuners already defined are narrowed."""
    tuners = autotuners(module_prefix)
    saved = [(t, t.configs) for t in tuners]
    try:
        for t in tuners:
            t.configs = [min(t.configs, key=block_cost)] if smallest else t.configs[:1]
        yield tuners
    finally:
        for t, configs in saved:
            t.configs = configs


def mamba3_scan(q, k, v, adt, dt, trap_raw, q_bias, k_bias, angles_raw, D=None, z=None, mimo_v=None, mimo_z=None,
                mimo_o=None, chunk_size=None):
    """mamba-ssm's Mamba-3 scan, called in :func:`mambalab.ops.mamba3_chunk_scan`'s layouts so that it computes
    the same function: the one adapter from our calling convention to mamba-ssm's (tests and benchmarks
    compare through it). GPU only (mamba-ssm's kernels are Triton and TileLang).

    Shapes as ours: q, k (b, l, r, g, n); v, z (b, l, h, p); adt, dt (b, l, h); q_bias, k_bias (h, r, n);
    D (h,); mimo_v, mimo_z, mimo_o (h, r, p) for r > 1. Unlike ours, ``trap_raw`` (b, l, h) and ``angles_raw``
    (b, l, h, a) come before their sigmoid and π·tanh: mamba-ssm applies those inside its kernels.

    r = 1: ``mamba3_siso_combined`` (Triton), chunk_size 64 unless given. r > 1: ``mamba3_mimo`` (TileLang; needs
    tilelang==0.1.8 importable), chunk_size 64 / r unless given, trap in v's dtype (its kernel's check). Its MIMO
    turns the rotary pairs (i, i + n/2) where ours turn (2i, 2i+1), so q, k and their biases go to it in the
    order whose (i, i + n/2) pairs are ours (:func:`mambalab.ref.mamba3.pairs_to_halves`).
    Returns out (b, l, h, p) in v's dtype, with gradients to every input through mamba-ssm's backward."""
    from mambalab.ref.mamba3 import pairs_to_halves

    t = lambda x: x.transpose(1, 2)                                   # (b, l, h, ...) -> its (b, h, l, ...)
    r, n, a = q.shape[2], q.shape[-1], angles_raw.shape[-1]
    if r == 1:
        siso = module("ops.triton.mamba3.mamba3_siso_combined").mamba3_siso_combined
        return siso(q[:, :, 0], k[:, :, 0], v, t(adt), t(dt), t(trap_raw), q_bias[:, 0], k_bias[:, 0], angles_raw,
                    D, z, chunk_size=chunk_size or 64)
    mimo_scan = module("ops.tilelang.mamba3.mamba3_mimo").mamba3_mimo
    q, k, q_bias, k_bias = (pairs_to_halves(x, a) for x in (q, k, q_bias, k_bias))
    return mimo_scan(q, k, v, t(adt), t(dt), t(trap_raw).to(v.dtype), q_bias, k_bias, mimo_v, mimo_z, mimo_o,
                     angles_raw, D, z, chunk_size=chunk_size or 64 // r, rotary_dim_divisor=n // a, dtype=v.dtype)


def mamba3_decode_reference(state, q, k, v, adt, dt, trap, q_bias, k_bias, angles_raw, D=None, z=None, mimo_v=None,
                            mimo_z=None, mimo_o=None):
    """mamba-ssm's Mamba-3 decode step, from its own PyTorch references, called in the layouts of
    :func:`mambalab.ref.mamba3.mamba3_step_ref`: its rotary inference reference
    (``apply_rotary_qk_inference_reference``), then its fused state-update reference
    (``selective_state_update_fused_ref_v2``, the reference of its CuTe decode kernel, through
    :func:`source_function`), computed in v's dtype. Runs anywhere (no kernel).

    Shapes as ours, per token: state a :class:`~mambalab.ref.mamba3.Mamba3State` (angle (b, h, a), ssm
    (b, h, p, n), k (b, h, r, n) the last step's k̂, v (b, h, p)); q, k (b, r, g, n); v, z (b, h, p); adt, dt,
    trap (b, h), trap after its sigmoid as ours; q_bias, k_bias (h, r, n); D (h,); mimo_* (h, r, p) for r > 1.
    Unlike ours, ``angles_raw`` (b, h, a) comes before π·tanh, which mamba-ssm applies itself. Every n axis
    (q, k, biases, the state's ssm and k) is in mamba-ssm's order: SISO (r = 1) turns the rotary pairs
    (2i, 2i+1) as our kernels do; MIMO turns (i, i + n/2), which our kernels compute on n permuted by
    :func:`mambalab.ref.mamba3.halves_order`. Returns (out (b, h, p), the new state) in v's dtype."""
    import torch

    from mambalab.ref.mamba3 import Mamba3State, per_head

    rotary = module("ops.triton.mamba3.mamba3_mimo_rotary_step").apply_rotary_qk_inference_reference
    update = source_function("ops.cute.mamba3.mamba3_step_fn", "selective_state_update_fused_ref_v2")
    h, r = q_bias.shape[0], q.shape[1]
    q_hat, k_hat, angle = rotary(per_head(q, h), per_head(k, h), state.angle, angles_raw, dt,   # q, k (b, r, h, n)
                                 q_bias.transpose(0, 1), k_bias.transpose(0, 1), rotate_pairwise=r == 1)
    ones = torch.ones(r, h, v.shape[-1], dtype=v.dtype, device=v.device)      # SISO: its module's step passes these
    rank_weight = lambda w: ones if w is None else w.transpose(0, 1)          # (h, r, p) -> its (r, h, p)
    if D is None:   # its reference always adds D v
        D = torch.zeros(h, dtype=v.dtype, device=v.device)
    out, ssm = update(state.ssm, adt / dt, k_hat, q_hat, rank_weight(mimo_v), v, rank_weight(mimo_z), z, dt,
                      state.k.transpose(1, 2), state.v, trap, D, rank_weight(mimo_o), compute_dtype=v.dtype)
    return out, Mamba3State(angle, ssm, k_hat.transpose(1, 2), v)
