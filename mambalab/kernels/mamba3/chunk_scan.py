"""Mamba-3's chunked scan on the SSD kernels: the rank-expanded SSD, forward and backward.

With q̂, k̂, v_r laid out rank by rank along the sequence (l·R positions j = t·R + r; see
:mod:`mambalab.ref.mamba3`),

    Y_j = Σ_i W[j, i] (C_j · B_i) x_i + exp(cs_j) H̃_c C_j + D x_j                    (per chunk c)
    W[j, i] = exp(cs_j - cs_i) σ_{step(i)}   step(i) < step(j)
            = γ_{step(j)}                    step(i) = step(j)    (every pair of ranks of the step)
            = 0                              step(i) > step(j)

with C = q̂, B = k̂, x = v_r and the decays of :mod:`mambalab.kernels.mamba3.rank_cumsum`: an SSD with
Δ = σ whose own step's block gets the weight γ instead (the SSD kernels' ``step`` mode,
:func:`mambalab.kernels.ssd.chunk_scan._intra_weights`). That block is where the exponential-trapezoidal
rule's within-step terms live: the plain rank-expanded SSD would give rank pairs r' <= r the weight σ_t and
r' > r none, and :func:`mambalab.ref.mamba3.within_step_correction` adds γ_t [r' > r] - (σ_t - γ_t)
[r' <= r], which sums to γ_t for every pair. So the correction costs nothing here: its scores q̂_r · k̂_r'
are entries of C Bᵀ, which the chunk's dot forms anyway. The steps are those of :mod:`mambalab.kernels.ssd`
with step 0 replaced:

    step 0    rank_cumsum     Δ, cs, γ           (b, h, c, Q), Q = chunk_size · R positions per chunk
    steps 1-3 state_sweep     Y (b, l·R, h, p), H̃ (entering, for the backward), final: one program per
                              (batch row, head, block of p) walks the chunks with the state on chip, for
                              16-bit inputs and chunks of up to 64 positions; otherwise the SSD's split
                              steps 1-3 (the tile rule's ``sweep_forward``). D per head (D x_j = D v ⊙ W^V_r);
                              no gate (the op's output stage applies it per rank)

The backward runs the same sweep backwards (dS_c and da_c, with dH^out_c never in memory), the SSD's chunk
backward (every sum over programs through ``reduction``: "deterministic" folds per-program partials with
:func:`mambalab.kernels.reduce.sum_partials`; it also gives dγ per position) and then step 0's. B and C being
per head here, no program sums dB or dC with another, so in the deterministic mode they are written in x's
dtype (the rotary backward reads them next).
Packed sequences: ``seq_idx`` (b, l) int32 (the sequence of each step) becomes the SSD kernels' seq_idx over
the rank-expanded axis (each step's R positions share their step's sequence), so every chunk's dots, states and
the states passed between chunks stop at a boundary (:mod:`mambalab.kernels.ssd.packed`); step 0 needs no mask
of its own, since only differences cs_j - cs_i inside one sequence are ever used and σ at a sequence's last
step holds no β of the next (the caller's :func:`mambalab.ref.mamba3.step_weights` with seq_idx). With
``cu_seqlens`` (R × it on the expanded axis) the forward's final state is each sequence's,
:func:`mambalab.kernels.ssd.varlen_states_fwd` (no gradient flows from it).
Tiles: :func:`mambalab.kernels.ssd.tiles.tile_config` for (h, p, n, Q); a step's R positions never straddle
a block (R divides every block size).

Shapes: B, C (b, l·R, h, n) and x (b, l·R, h, p), contiguous, in the compute dtype; adt, sigma, gamma
(b, l, h) fp32; D (h,) fp32 or None; initial (b, h, p, n) fp32 or None; seq_idx (b, l) int32 contiguous or None;
cu_seqlens (num_seqs + 1,) int32 or None (b = 1).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from mambalab import device

from mambalab.kernels.mamba3.rank_cumsum import rank_cumsum_bwd, rank_cumsum_fwd
from mambalab.kernels.ssd import (TileConfig, chunk_scan_bwd, state_sweep_bwd, steps_1_to_3, tile_config,
                                  varlen_states_fwd)


class Mamba3ScanForward(NamedTuple):
    y: torch.Tensor          # (b, l·R, h, p) in x's dtype
    final: torch.Tensor      # (b, h, p, n) fp32: H after the last step; (num_seqs, h, p, n) with cu_seqlens
    delta: torch.Tensor      # (b, h, c, Q) fp32
    cs: torch.Tensor         # (b, h, c, Q) fp32
    same: torch.Tensor       # (b, h, c, Q) fp32: γ of each position's step
    entering: torch.Tensor   # (b, c, h, p, n) in x's dtype (the dots'; kernels.ssd.state_passing)
    tiles: TileConfig
    seq_idx: torch.Tensor | None = None   # (b, l·R) int32: the SSD kernels' packed sequences, or None


class Mamba3ScanGrads(NamedTuple):
    dx: torch.Tensor         # (b, l·R, h, p) x's dtype
    dB: torch.Tensor         # (b, l·R, h, n) x's dtype (deterministic) or fp32 (atomic)
    dC: torch.Tensor         # (b, l·R, h, n) likewise
    dadt: torch.Tensor       # (b, l, h) fp32
    dsigma: torch.Tensor     # (b, l, h) fp32
    dgamma: torch.Tensor     # (b, l, h) fp32
    dD: torch.Tensor | None  # (h,) fp32
    dinitial: torch.Tensor | None


def _precision(x):
    return device.dot_precision(x.dtype, x.device)


def _expand(seq_idx, r: int):
    """A step's sequence for each of its R positions: (b, l) -> (b, l·R) int32 contiguous."""
    return None if seq_idx is None else seq_idx.repeat_interleave(r, dim=1).contiguous()


def mamba3_scan_fwd(B, C, x, adt, sigma, gamma, D, initial, r: int, chunk_size: int, seq_idx=None,
                    cu_seqlens=None) -> Mamba3ScanForward:
    """The forward on validated, contiguous tensors (module docstring)."""
    h, p, n = x.shape[2], x.shape[3], B.shape[3]
    cfg = tile_config(h, p, n, chunk_size * r, x.dtype)
    seq = _expand(seq_idx, r)
    delta, cs, same = rank_cumsum_fwd(adt, sigma, gamma, r, chunk_size, cfg.block_h, cfg.num_warps)
    y, entering, final, _ = steps_1_to_3(x, B, C, delta, cs, initial, D, None, cfg, _precision(x),
                                         sweep=cfg.sweep_forward, same=same, step=r, seq_idx=seq)
    if cu_seqlens is not None:   # each sequence's state after its last step
        final = varlen_states_fwd(x, B, delta, cs, entering, seq, (cu_seqlens * r).to(torch.int32), cfg,
                                  _precision(x))
    return Mamba3ScanForward(y, final, delta, cs, same, entering, cfg, seq)


def mamba3_scan_bwd(dy, dfinal, fwd: Mamba3ScanForward, B, C, x, D, l: int, r: int, has_initial: bool,
                    reduction: str = "deterministic") -> Mamba3ScanGrads:
    """The backward from dy (b, l·R, h, p) contiguous in x's dtype and dfinal (b, h, p, n) fp32 or None (None
    with cu_seqlens); packed sequences as ``fwd.seq_idx`` holds them."""
    cfg = fwd.tiles
    dstates, dinit, da = state_sweep_bwd(dy, None, C, fwd.cs, fwd.entering, dfinal, has_initial, cfg, reduction,
                                         _precision(x), seq_idx=fwd.seq_idx)
    dx, _, dB, dC, dD, ddelta, dcs_row, dcs_col, dws, dsame = chunk_scan_bwd(
        dy, x, B, C, fwd.delta, fwd.cs, fwd.entering, dstates, D, None, cfg, reduction, _precision(x),
        bc_dtype=x.dtype, same=fwd.same, step=r, seq_idx=fwd.seq_idx)   # fp32 wherever it sums over programs (atomic mode)
    dadt, dsigma, dgamma = rank_cumsum_bwd(ddelta, dcs_row, dcs_col, da, dws, dsame, l, r, cfg.block_h,
                                           cfg.num_warps)
    return Mamba3ScanGrads(dx, dB, dC, dadt, dsigma, dgamma, dD, dinit)
