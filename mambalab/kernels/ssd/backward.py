"""The SSD backward: the forward's steps, reversed, from the intermediates it saved (:class:`SSDForward`).

    steps 3, 2  state_sweep_bwd        dS_c, d initial_states, da_c (a chunk's total log-decay), walking
                                       the chunks backwards with dL/dH on chip and adding what the
                                       outputs send to H_c, dH^out_c = Σ_t exp(cs_t) dY_t C_tᵀ, on the way
    step 3+1  chunk_scan_bwd           dx, dz, dB, dC, dD, dΔ, dcs                  (chunk scan + chunk states)
    step 0    chunk_cumsum_bwd         ddt, dA, ddt_bias                            (through cumsum, clamp, softplus)

The math of each is in its step's file. Every sum over programs (dA, ddt_bias and dD over batch rows and
chunks; dB and dC over the heads of a group; da over the state's blocks) is done one of two ways:

* ``reduction="atomic"``: tl.atomic_add into zeroed fp32 buffers, as mamba-ssm's backward does. On a GPU
  the order of the adds, and so the last bits, vary from run to run.
* ``reduction="deterministic"``: each program writes its partial to its own slot and
  :func:`mambalab.kernels.reduce.sum_partials` folds them in an order fixed by the shape alone.

Packed sequences: ``seq_idx`` reaches the sweep and the chunk backward, which mask as their forwards do;
step 0's backward needs nothing more (every gradient it receives is already 0 where a weight was masked).

Tiles come from :func:`mambalab.kernels.ssd.tiles.tile_config` (plus the whole head per backward program).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from mambalab import device

from mambalab.kernels.ssd.chunk_cumsum import chunk_cumsum_bwd
from mambalab.kernels.ssd.chunk_scan import chunk_scan_bwd
from mambalab.kernels.ssd.forward import SSDForward
from mambalab.kernels.ssd.state_sweep import state_sweep_bwd

REDUCTIONS = ("atomic", "deterministic")


class SSDGrads(NamedTuple):
    """Gradients of the SSD inputs; None where the input was None. dB, dC, dA, dD, ddt_bias, dinitial_states
    are fp32; dx, dz in x's dtype, ddt in dt's."""

    dx: torch.Tensor
    ddt: torch.Tensor
    dA: torch.Tensor
    dB: torch.Tensor
    dC: torch.Tensor
    dD: torch.Tensor | None
    dz: torch.Tensor | None
    ddt_bias: torch.Tensor | None
    dinitial_states: torch.Tensor | None


def ssd_chunk_scan_bwd(dout, dfinal, fwd: SSDForward, x, dt, A, B, C, D=None, z=None, dt_bias=None,
                       has_initial_states=False, dt_softplus=False, dt_limit=(0.0, float("inf")),
                       reduction: str = "deterministic", dot_precision: str | None = None,
                       seq_idx=None) -> SSDGrads:
    """Launch the SSD backward on the forward's (validated, contiguous) inputs and its saved results.

    dout: (b, l, h, p) contiguous, x's dtype; dfinal: (b, h, p, n) fp32 or None (no gradient reaches the
    final states). ``reduction``: "atomic" or "deterministic" (see the module docstring). seq_idx: (b, l)
    int32 or None, as given to the forward.
    """
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if dot_precision is None:
        dot_precision = device.dot_precision(x.dtype, x.device)
    cfg = fwd.tiles
    dstates, dinit, da = state_sweep_bwd(dout, z, C, fwd.dA_cumsum, fwd.entering_states, dfinal,
                                         has_initial_states, cfg, reduction, dot_precision, seq_idx=seq_idx)
    dx, dz, dB, dC, dD, ddelta, dcs_row, dcs_col, dws = chunk_scan_bwd(
        dout, x, B, C, fwd.delta, fwd.dA_cumsum, fwd.entering_states, dstates, D, z, cfg, reduction, dot_precision,
        seq_idx=seq_idx)
    ddt, dA, dbias = chunk_cumsum_bwd(dt, A, dt_bias, dt_softplus, dt_limit, fwd.delta, ddelta, dcs_row, dcs_col,
                                      da, dws, cfg, reduction)
    return SSDGrads(dx, ddt, dA, dB, dC, dD, dz, dbias, dinit)
