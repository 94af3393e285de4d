"""Mamba-3 as an SSD, step 0: the rank-expanded sequence's input weights and within-chunk log-decays.

Mamba-3's chunked form (:mod:`mambalab.ref.mamba3`) is an SSD over a sequence of l·R positions, position
j = t·R + r holding rank r of step t. This kernel replaces the SSD's step 0
(:mod:`mambalab.kernels.ssd.chunk_cumsum`): instead of Δ and cs = cumsum(Δ A) it writes, per chunk of
Q = q·R positions (q steps),

    Δ_j  = σ_t                                   the input weight of every rank of step t
    a_j  = A_tΔ_t if r = 0 else 0                the step's decay sits on its first rank
    cs_j = Σ_{k ≤ j} a_k                         inside the chunk
    γ_j  = γ_t                                   the weight of the step's own ranks (the SSD kernels' ``same``)

so the SSD's later steps (chunk states, state passing, chunk scan and their backwards) run unchanged.
Positions past the sequence end get Δ = a = 0.

Backward. The SSD's backward hands back dΔ_j, dcs_j (row and column parts), da (the chunk's total decay) and
dws_j (chunk states' exponents cs_{Q-1} - cs_j); as in the SSD's step 0,

    ρ_k = Σ_{j ≥ k} dcs_j + da + Σ_{j < k} dws_j          the gradient of a_k
    d(A_tΔ_t) = ρ_{t·R},    dσ_t = Σ_r dΔ_{t·R + r},    dγ_t = Σ_r dγ_{t·R + r}

Every sum stays inside one program (one batch row, one chunk, BLOCK_H heads): no reduction across programs.

Shapes: adt, sigma, gamma (b, l, h) contiguous fp32 -> Δ, cs, γ (b, h, c, Q) fp32; backward -> d adt, d sigma,
d gamma (b, l, h).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def rank_cumsum_fwd_kernel(
    adt_ptr,          # (b, l, h) fp32 log-decay A·Δ per step
    sigma_ptr,        # (b, l, h) fp32 input weight σ per step
    gamma_ptr,        # (b, l, h) fp32 weight γ of a step's own input
    delta_ptr,        # (b, h, c, Q) fp32 out: Δ_j = σ_t
    cs_ptr,           # (b, h, c, Q) fp32 out: within-chunk cumsum of a
    same_ptr,         # (b, h, c, Q) fp32 out: γ_t at each of step t's positions
    h, l, c,          # sizes (l in steps)
    R: tl.constexpr,         # ranks per step
    BLOCK_H: tl.constexpr,   # heads per program
    Q: tl.constexpr,         # positions per chunk (steps per chunk · R)
):
    pid_b = tl.program_id(0)
    pid_c = tl.program_id(1)
    pid_h = tl.program_id(2)
    offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_j = tl.arange(0, Q)
    t = pid_c * (Q // R) + offs_j // R                             # the step of each position
    mask_h = offs_h < h
    mask = mask_h[:, None] & (t < l)[None, :]                      # (BLOCK_H, Q)
    src = (pid_b * l + t[None, :]).to(tl.int64) * h + offs_h[:, None]
    first = (offs_j % R == 0)[None, :]
    a = tl.load(adt_ptr + src, mask=mask & first, other=0.0)
    w = tl.load(sigma_ptr + src, mask=mask, other=0.0)
    cs = tl.cumsum(a, axis=1)
    out = ((pid_b * h + offs_h[:, None]).to(tl.int64) * c + pid_c) * Q + offs_j[None, :]
    tl.store(delta_ptr + out, w, mask=mask_h[:, None])
    tl.store(cs_ptr + out, cs, mask=mask_h[:, None])
    tl.store(same_ptr + out, tl.load(gamma_ptr + src, mask=mask, other=0.0), mask=mask_h[:, None])


def rank_cumsum_fwd(adt, sigma, gamma, r: int, chunk_size: int, block_h: int, num_warps: int = 4):
    """Launch step 0. adt, sigma, gamma (b, l, h) fp32 contiguous; ``chunk_size`` in steps -> (Δ, cs, γ), each
    (b, h, c, chunk_size · r) fp32."""
    b, l, h = adt.shape
    Q = chunk_size * r
    c = triton.cdiv(l, chunk_size)
    delta = torch.empty(b, h, c, Q, device=adt.device, dtype=torch.float32)
    cs, same = torch.empty_like(delta), torch.empty_like(delta)
    rank_cumsum_fwd_kernel[(b, c, triton.cdiv(h, block_h))](
        adt, sigma, gamma, delta, cs, same, h, l, c, R=r, BLOCK_H=block_h, Q=Q, num_warps=num_warps)
    return delta, cs, same


@triton.jit
def rank_cumsum_bwd_kernel(
    ddelta_ptr,       # (b, h, c, Q) fp32 dΔ from the chunk backward
    dcs_row_ptr,      # (b, h, c, Q) fp32 dcs, the part summed over each row
    dcs_col_ptr,      # (b, h, c, Q) fp32 dcs, the part summed over each column
    da_ptr,           # (b, h, c) fp32 gradient of the chunk's total log-decay, from state passing
    dws_ptr,          # (b, h, c, Q) fp32 gradient of chunk states' exponents
    dsame_ptr,        # (b, h, c, Q) fp32 gradient of the same-step weights
    dadt_ptr,         # (b, l, h) fp32 out
    dsigma_ptr,       # (b, l, h) fp32 out
    dgamma_ptr,       # (b, l, h) fp32 out
    h, l, c,
    R: tl.constexpr, BLOCK_H: tl.constexpr, Q: tl.constexpr,
):
    pid_b = tl.program_id(0)
    pid_c = tl.program_id(1)
    pid_h = tl.program_id(2)
    offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_j = tl.arange(0, Q)
    mask_h = offs_h < h
    mh = mask_h[:, None]
    at = ((pid_b * h + offs_h[:, None]).to(tl.int64) * c + pid_c) * Q + offs_j[None, :]
    dcs = tl.load(dcs_row_ptr + at, mask=mh, other=0.0) + tl.load(dcs_col_ptr + at, mask=mh, other=0.0)
    da = tl.load(da_ptr + (pid_b * h + offs_h).to(tl.int64) * c + pid_c, mask=mask_h, other=0.0)
    dcs += tl.where(offs_j[None, :] == Q - 1, da[:, None], 0.0)
    rho = tl.cumsum(dcs, axis=1, reverse=True)                     # Σ_{j ≥ k} dcs_j (+ da)
    dws_prev = tl.load(dws_ptr + at - 1, mask=mh & (offs_j[None, :] > 0), other=0.0)
    rho += tl.cumsum(dws_prev, axis=1)                             # + Σ_{j < k} dws_j
    ddelta = tl.load(ddelta_ptr + at, mask=mh, other=0.0)

    # positions j = s·R + r of the chunk as (steps s, ranks r): Q // R steps per chunk
    dsigma = tl.sum(tl.reshape(ddelta, (BLOCK_H, Q // R, R)), axis=2)     # Σ over the step's ranks
    dgamma = tl.sum(tl.reshape(tl.load(dsame_ptr + at, mask=mh, other=0.0), (BLOCK_H, Q // R, R)), axis=2)
    is_first = (tl.arange(0, R) == 0)[None, None, :]
    dadt = tl.sum(tl.where(is_first, tl.reshape(rho, (BLOCK_H, Q // R, R)), 0.0), axis=2)   # ρ at rank 0
    t = pid_c * (Q // R) + tl.arange(0, Q // R)
    mask = mh & (t < l)[None, :]
    dst = (pid_b * l + t[None, :]).to(tl.int64) * h + offs_h[:, None]
    tl.store(dadt_ptr + dst, dadt, mask=mask)
    tl.store(dsigma_ptr + dst, dsigma, mask=mask)
    tl.store(dgamma_ptr + dst, dgamma, mask=mask)


def rank_cumsum_bwd(ddelta, dcs_row, dcs_col, da, dws, dsame, l: int, r: int, block_h: int, num_warps: int = 4):
    """Launch step 0's backward. (b, h, c, Q) fp32 gradients (da (b, h, c)) -> (d adt, d sigma, d gamma),
    (b, l, h) fp32."""
    b, h, c, Q = ddelta.shape
    dadt = torch.empty(b, l, h, device=ddelta.device, dtype=torch.float32)
    dsigma, dgamma = torch.empty_like(dadt), torch.empty_like(dadt)
    rank_cumsum_bwd_kernel[(b, c, triton.cdiv(h, block_h))](
        ddelta, dcs_row, dcs_col, da, dws, dsame, dadt, dsigma, dgamma, h, l, c, R=r, BLOCK_H=block_h, Q=Q,
        num_warps=num_warps)
    return dadt, dsigma, dgamma
