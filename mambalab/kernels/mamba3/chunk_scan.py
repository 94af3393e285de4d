"""Mamba-3's chunked scan on the SSD kernels: the rank-expanded SSD, forward and backward.

With q̂, k̂, v_r laid out rank by rank along the sequence (l·R positions; see :mod:`mambalab.ref.mamba3`),

    Y_j = Σ_{i ≤ j} exp(cs_j - cs_i) (C_j · B_i) Δ_i x_i + exp(cs_j) H̃_c C_j        (SSD, per chunk c)

with C = q̂, B = k̂, x = v_r, Δ = σ and the decays of :mod:`mambalab.kernels.mamba3.rank_cumsum`. The
steps are those of :mod:`mambalab.kernels.ssd` with step 0 replaced:

    step 0  rank_cumsum     Δ, cs              (b, h, c, Q), Q = chunk_size · R positions per chunk
    step 1  chunk_states    S                  (b, c, h, p, n)
    step 2  state_passing   H̃ (entering), final
    step 3  chunk_scan      Y                  (b, l·R, h, p), no D, no gate (the op adds them per rank)

The backward runs the SSD's backwards (every sum over programs through ``reduction``: "deterministic" folds
per-program partials with :func:`mambalab.kernels.reduce.sum_partials`) and then step 0's.
Tiles: :func:`mambalab.kernels.ssd.tiles.tile_config` for (h, p, n, Q).

Shapes: B, C (b, l·R, h, n) and x (b, l·R, h, p), contiguous, in the compute dtype; adt, sigma (b, l, h) fp32;
initial (b, h, p, n) fp32 or None.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from mambalab import device

from mambalab.kernels.mamba3.rank_cumsum import rank_cumsum_bwd, rank_cumsum_fwd
from mambalab.kernels.ssd import (TileConfig, chunk_scan_bwd, chunk_scan_bwd_dstates, chunk_scan_fwd,
                                  chunk_states_fwd, state_passing_bwd, state_passing_fwd, tile_config)


class Mamba3ScanForward(NamedTuple):
    y: torch.Tensor          # (b, l·R, h, p) in x's dtype
    final: torch.Tensor      # (b, h, p, n) fp32: H after the last step
    delta: torch.Tensor      # (b, h, c, Q) fp32
    cs: torch.Tensor         # (b, h, c, Q) fp32
    entering: torch.Tensor   # (b, c, h, p, n) in x's dtype (the dots'; kernels.ssd.state_passing)
    tiles: TileConfig


class Mamba3ScanGrads(NamedTuple):
    dx: torch.Tensor         # (b, l·R, h, p) x's dtype
    dB: torch.Tensor         # (b, l·R, h, n) fp32
    dC: torch.Tensor         # (b, l·R, h, n) fp32
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
    states = chunk_states_fwd(x, B, delta, cs, cfg, _precision(x))
    entering, final = state_passing_fwd(states, cs, initial, cfg, store_dtype=x.dtype)
    y = chunk_scan_fwd(x, B, C, delta, cs, entering, None, None, cfg, _precision(x))
    return Mamba3ScanForward(y, final, delta, cs, entering, cfg)


def mamba3_scan_bwd(dy, dfinal, fwd: Mamba3ScanForward, B, C, x, l: int, r: int, has_initial: bool,
                    reduction: str = "deterministic") -> Mamba3ScanGrads:
    """The backward from dy (b, l·R, h, p) contiguous in x's dtype and dfinal (b, h, p, n) fp32 or None."""
    cfg, p = fwd.tiles, x.shape[3]
    dH_out = chunk_scan_bwd_dstates(dy, None, C, fwd.cs, cfg, p, _precision(x))
    dstates, dinit, da = state_passing_bwd(fwd.entering, fwd.cs, dH_out, dfinal, has_initial, cfg, reduction)
    dx, _, dB, dC, _, ddelta, dcs_row, dcs_col, dws = chunk_scan_bwd(
        dy, x, B, C, fwd.delta, fwd.cs, fwd.entering, dstates, None, None, cfg, reduction, _precision(x))
    dadt, dsigma = rank_cumsum_bwd(ddelta, dcs_row, dcs_col, da, dws, l, r, cfg.block_h, cfg.num_warps)
    return Mamba3ScanGrads(dx, dB, dC, dadt, dsigma, dinit)
