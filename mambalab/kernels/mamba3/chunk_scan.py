"""Mamba-3's chunked scan on the SSD kernels: the rank-expanded SSD, forward and backward.

With q̂, k̂, v_r = v ⊙ W^V_r laid out rank by rank along the sequence (l·R positions j = t·R + r; see
:mod:`mambalab.ref.mamba3`),

    Y_j = Σ_i W[j, i] (C_j · B_i) x_i + exp(cs_j) H̃_c C_j + D x_j                    (per chunk c)
    W[j, i] = exp(cs_j - cs_i) σ_{step(i)}   step(i) < step(j)
            = γ_{step(j)}                    step(i) = step(j)    (every pair of ranks of the step)
            = 0                              step(i) > step(j)

with C = q̂, B = k̂, x_j = v_t ⊙ W^V_r and the decays of :mod:`mambalab.kernels.mamba3.rank_cumsum`: an SSD with
Δ = σ whose own step's block gets the weight γ instead (the SSD kernels' ``step`` mode,
:func:`mambalab.kernels.ssd.chunk_scan._intra_weights`). That block is where the exponential-trapezoidal
rule's within-step terms live: the plain rank-expanded SSD would give rank pairs r' <= r the weight σ_t and
r' > r none, and :func:`mambalab.ref.mamba3.within_step_correction` adds γ_t [r' > r] - (σ_t - γ_t)
[r' <= r], which sums to γ_t for every pair. So the correction costs nothing here: its scores q̂_r · k̂_r'
are entries of C Bᵀ, which the chunk's dot forms anyway. The steps are those of :mod:`mambalab.kernels.ssd`
with step 0 replaced:

    step 0    rank_cumsum     Δ, cs, γ           (b, h, c, Q), Q = chunk_size · R positions per chunk
    steps 1-3 state_sweep     out (b, l, h, p), H̃ (entering, for the backward), final: one program per
                              (batch row, head, block of p) walks the chunks with the state on chip, for
                              16-bit inputs and chunks of up to 64 positions; otherwise the SSD's split
                              steps 1-3 (the tile rule's ``sweep_forward``). D per head (D x_j = D v ⊙ W^V_r)

and the output stage is where the outputs are stored:

    out_t = Σ_r W^O_r ⊙ Y_{t·R + r} ⊙ silu(z_t ⊙ W^Z_r)       (SISO: out_t = Y_t ⊙ silu(z_t), or Y_t)

Nothing per rank but q̂ and k̂ is in memory: MIMO runs the SSD kernels' rank mode
(:class:`mambalab.kernels.ssd.chunk_scan.RankWeights`), in which the kernels read v, z and d out per step
(b, l, h, p) with W^V, W^Z, W^O (h, R, p), form each position's x_j = v_t ⊙ W^V_r, gate input z_t ⊙ W^Z_r and
d out_t ⊙ W^O_r where they load them, and sum a step's R outputs where they store them; the backward hands
back dv, dz per step and dW^V, dW^Z, dW^O (per-program partials, folded in a fixed order). The rows kernel
recomputes Y for the gate's and W^O's gradients, as the SSD's own gate does. SISO is the SSD with its gate.

The backward runs the same sweep backwards (dS_c and da_c, with dH^out_c never in memory), the SSD's chunk
backward (every sum over programs through ``reduction``: "deterministic" folds per-program partials with
:func:`mambalab.kernels.reduce.sum_partials`; it also gives dγ per position) and then step 0's. B and C being
per head here, no program sums dB or dC with another, so in the deterministic mode they are written in v's
dtype (the rotary backward reads them next).
Tiles: :func:`mambalab.kernels.ssd.tiles.tile_config` for (h, p, n, Q); a step's R positions never straddle
a block (R divides every block size).

Shapes: B, C (b, l·R, h, n) and v, z (b, l, h, p), contiguous, in the compute dtype (z or None); the MIMO
weights (h, R, p) fp32 or None (SISO); adt, sigma, gamma (b, l, h) fp32; D (h,) fp32 or None; initial
(b, h, p, n) fp32 or None.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from mambalab import device

from mambalab.kernels.mamba3.rank_cumsum import rank_cumsum_bwd, rank_cumsum_fwd
from mambalab.kernels.ssd import TileConfig, chunk_scan_bwd, state_sweep_bwd, steps_1_to_3, tile_config
from mambalab.kernels.ssd.chunk_scan import RankWeights


class Mamba3ScanForward(NamedTuple):
    out: torch.Tensor        # (b, l, h, p) in v's dtype: the scan's output, gated and summed over ranks
    final: torch.Tensor      # (b, h, p, n) fp32: H after the last step
    delta: torch.Tensor      # (b, h, c, Q) fp32
    cs: torch.Tensor         # (b, h, c, Q) fp32
    same: torch.Tensor       # (b, h, c, Q) fp32: γ of each position's step
    entering: torch.Tensor   # (b, c, h, p, n) in v's dtype (the dots'; kernels.ssd.state_passing)
    tiles: TileConfig


class Mamba3ScanGrads(NamedTuple):
    dv: torch.Tensor         # (b, l, h, p) v's dtype
    dz: torch.Tensor | None  # (b, l, h, p) z's dtype
    dB: torch.Tensor         # (b, l·R, h, n) x's dtype (deterministic) or fp32 (atomic)
    dC: torch.Tensor         # (b, l·R, h, n) likewise
    dadt: torch.Tensor       # (b, l, h) fp32
    dsigma: torch.Tensor     # (b, l, h) fp32
    dgamma: torch.Tensor     # (b, l, h) fp32
    dD: torch.Tensor | None  # (h,) fp32
    dinitial: torch.Tensor | None
    dmimo: RankWeights | None  # dW^V, dW^Z (None without z), dW^O (h, R, p) fp32, for MIMO


def _precision(x):
    return device.dot_precision(x.dtype, x.device)


def mamba3_scan_fwd(B, C, v, z, mimo: RankWeights | None, adt, sigma, gamma, D, initial, r: int,
                    chunk_size: int) -> Mamba3ScanForward:
    """The forward on validated, contiguous tensors (module docstring)."""
    h, p, n = v.shape[2], v.shape[3], B.shape[3]
    cfg = tile_config(h, p, n, chunk_size * r, v.dtype)
    delta, cs, same = rank_cumsum_fwd(adt, sigma, gamma, r, chunk_size, cfg.block_h, cfg.num_warps)
    out, entering, final, _ = steps_1_to_3(v, B, C, delta, cs, initial, D, z, cfg, _precision(v),
                                           sweep=cfg.sweep_forward, same=same, step=r, mimo=mimo)
    return Mamba3ScanForward(out, final, delta, cs, same, entering, cfg)


def mamba3_scan_bwd(dout, dfinal, fwd: Mamba3ScanForward, B, C, v, z, mimo: RankWeights | None, D, l: int, r: int,
                    has_initial: bool, reduction: str = "deterministic") -> Mamba3ScanGrads:
    """The backward from dout (b, l, h, p) contiguous in v's dtype and dfinal (b, h, p, n) fp32 or None."""
    cfg = fwd.tiles
    dstates, dinit, da = state_sweep_bwd(dout, z, C, fwd.cs, fwd.entering, dfinal, has_initial, cfg, reduction,
                                         _precision(v), mimo=mimo)
    dv, dz, dB, dC, dD, ddelta, dcs_row, dcs_col, dws, dsame, dmimo = chunk_scan_bwd(
        dout, v, B, C, fwd.delta, fwd.cs, fwd.entering, dstates, D, z, cfg, reduction, _precision(v),
        bc_dtype=v.dtype, same=fwd.same, step=r, mimo=mimo)   # fp32 wherever it sums over programs (atomic mode)
    dadt, dsigma, dgamma = rank_cumsum_bwd(ddelta, dcs_row, dcs_col, da, dws, dsame, l, r, cfg.block_h,
                                           cfg.num_warps)
    return Mamba3ScanGrads(dv, dz, dB, dC, dadt, dsigma, dgamma, dD, dinit, dmimo)
