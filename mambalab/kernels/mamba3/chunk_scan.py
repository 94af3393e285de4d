"""Mamba-3's chunked scan on the SSD kernels: the rank-expanded SSD, forward and backward.

With q̂, k̂, v_r laid out rank by rank along the sequence (l·R positions; see :mod:`mambalab.ref.mamba3`),

    Y_j = Σ_{i ≤ j} exp(cs_j - cs_i) (C_j · B_i) Δ_i x_i + exp(cs_j) H̃_c C_j        (SSD, per chunk c)

with C = q̂, B = k̂, x = v_r, Δ = σ and the decays of :mod:`mambalab.kernels.mamba3.rank_cumsum`. The
steps are those of :mod:`mambalab.kernels.ssd` with step 0 replaced:

    step 0    rank_cumsum     Δ, cs              (b, h, c, Q), Q = chunk_size · R positions per chunk
    steps 1-3 state_sweep     Y (b, l·R, h, p), H̃ (entering, for the backward), final: one program per
                              (batch row, head, block of p) walks the chunks with the state on chip, for
                              16-bit inputs and chunks of up to 64 positions; otherwise the SSD's split
                              steps 1-3 (the tile rule's ``sweep_forward``). No D, no gate (the op adds
                              them per rank)

The backward runs the same sweep backwards (dS_c and da_c, with dH^out_c never in memory), the SSD's chunk
backward (every sum over programs through ``reduction``: "deterministic" folds per-program partials with
:func:`mambalab.kernels.reduce.sum_partials`) and then step 0's. B and C being per head here, no program
sums dB or dC with another, so in the deterministic mode they are written in x's dtype (the rotary backward
reads them next).
Tiles: :func:`mambalab.kernels.ssd.tiles.tile_config` for (h, p, n, Q).

Shapes: B, C (b, l·R, h, n) and x (b, l·R, h, p), contiguous, in the compute dtype; adt, sigma (b, l, h) fp32;
initial (b, h, p, n) fp32 or None.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from mambalab import device

from mambalab.kernels.mamba3.rank_cumsum import rank_cumsum_bwd, rank_cumsum_fwd
from mambalab.kernels.ssd import TileConfig, chunk_scan_bwd, state_sweep_bwd, steps_1_to_3, tile_config


class Mamba3ScanForward(NamedTuple):
    y: torch.Tensor          # (b, l·R, h, p) in x's dtype
    final: torch.Tensor      # (b, h, p, n) fp32: H after the last step
    delta: torch.Tensor      # (b, h, c, Q) fp32
    cs: torch.Tensor         # (b, h, c, Q) fp32
    entering: torch.Tensor   # (b, c, h, p, n) in x's dtype (the dots'; kernels.ssd.state_passing)
    tiles: TileConfig


class Mamba3ScanGrads(NamedTuple):
    dx: torch.Tensor         # (b, l·R, h, p) x's dtype
    dB: torch.Tensor         # (b, l·R, h, n) x's dtype (deterministic) or fp32 (atomic)
    dC: torch.Tensor         # (b, l·R, h, n) likewise
    dadt: torch.Tensor       # (b, l, h) fp32
    dsigma: torch.Tensor     # (b, l, h) fp32
    dinitial: torch.Tensor | None


def _precision(x):
    return device.dot_precision(x.dtype, x.device)


def mamba3_scan_fwd(B, C, x, adt, sigma, initial, r: int, chunk_size: int) -> Mamba3ScanForward:
    """The forward on validated, contiguous tensors (module docstring)."""
    h, p, n = x.shape[2], x.shape[3], B.shape[3]
    cfg = tile_config(h, p, n, chunk_size * r, x.dtype)
    delta, cs = rank_cumsum_fwd(adt, sigma, r, chunk_size, cfg.block_h, cfg.num_warps)
    y, entering, final, _ = steps_1_to_3(x, B, C, delta, cs, initial, None, None, cfg, _precision(x),
                                         sweep=cfg.sweep_forward)
    return Mamba3ScanForward(y, final, delta, cs, entering, cfg)


def mamba3_scan_bwd(dy, dfinal, fwd: Mamba3ScanForward, B, C, x, l: int, r: int, has_initial: bool,
                    reduction: str = "deterministic") -> Mamba3ScanGrads:
    """The backward from dy (b, l·R, h, p) contiguous in x's dtype and dfinal (b, h, p, n) fp32 or None."""
    cfg = fwd.tiles
    dstates, dinit, da = state_sweep_bwd(dy, None, C, fwd.cs, fwd.entering, dfinal, has_initial, cfg, reduction,
                                         _precision(x))
    dx, _, dB, dC, _, ddelta, dcs_row, dcs_col, dws = chunk_scan_bwd(
        dy, x, B, C, fwd.delta, fwd.cs, fwd.entering, dstates, None, None, cfg, reduction, _precision(x),
        bc_dtype=x.dtype)   # chunk_scan_bwd keeps fp32 wherever it sums over programs (atomic mode)
    dadt, dsigma = rank_cumsum_bwd(ddelta, dcs_row, dcs_col, da, dws, l, r, cfg.block_h, cfg.num_warps)
    return Mamba3ScanGrads(dx, dB, dC, dadt, dsigma, dinit)
