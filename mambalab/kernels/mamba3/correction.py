"""MIMO's within-step correction coefficients in one kernel each way (no matmuls, nothing rotated).

What the rank-expanded SSD gets wrong inside a step is fixed by a coefficient per position t, head h and pair of
ranks (i, j) (:func:`mambalab.ref.mamba3.within_step_correction`):

    coef_{t,h,i,j} = c_{t,h,i,j} · s_{t,h,i,j}
    s_{t,h,i,j}    = q̃_{t,h,i} · k̃_{t,h,j},   q̃ = q_i + b^Q_{h,i},  k̃ = k_j + b^K_{h,j}

    c_{t,h,i,j}    = γ_t           if j > i,   γ_t - σ_t   if j <= i

(s = q̂_i · k̂_j: rotating both by the same θ_t keeps their dot product).

Backward, from dcoef (everything per position and head, dS = dcoef ⊙ c):

    dq̃_i = Σ_j dS_{i,j} k̃_j        dk̃_j = Σ_i dS_{i,j} q̃_i
    dq_{t,i} = Σ_{h in group} dq̃_{t,h,i},   db^Q_{h,i} = Σ_t dq̃_{t,h,i}        (k, b^K the same)
    dγ_t = Σ_{i,j} dcoef ⊙ s,                dσ_t = -Σ_{j <= i} dcoef ⊙ s

What this replaces (for r > 1): :func:`~mambalab.ref.mamba3.within_step_scores` expands the product into four
small matmuls over n and :func:`~mambalab.ref.mamba3.correction_coefficients` weights them, PyTorch ops whose
autograd adds a dozen bmm, copies and sums a step (MIMO r = 4 at b4 l4096 h32 n128 on an H200: 12 bmm took
0.64 ms of a step's GPU time, session 9's profile). Here the forward reads q and k once a head (from L2: they
are (b, l, r, g, n), shared by a group's heads) and writes coef; the backward reads them once a program.

Programs work on rows ρ = t·R + i of the flattened (b·l·r) axis (BLOCK_ROWS rows, a whole number of positions,
with all of n); the forward one head a program, the backward one group a program, looping over the group's
heads in order so that dq, dk are summed over heads in registers (no atomics). The loop over the other rank j
is unrolled: row (t, i) reads row (t, j) of q and k (the same address for the R rows of a position, from L1).
db^Q, db^K are per-program partials folded by :func:`mambalab.kernels.reduce.sum_partials` (a fixed order).
Sums over n run in fp32 in Triton's reduction order, which depends on the tile only (fixed by n and r): the
bits repeat run to run and on any GPU.

Shapes: q, k (b, l, r, g, n) in the kernels' dtype, contiguous; q_bias, k_bias (h, r, n) fp32; gamma, sigma
(b, l, h) fp32; coef (b, l, h, r, r) fp32.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from mambalab.kernels.reduce import sum_partials

BLOCK_ROWS = 32   # rows (position, rank) a program: BLOCK_ROWS / r positions
NUM_WARPS = 4
BWD_NUM_WARPS = 8


@triton.jit
def _rows(pid, T, g, grp, n, R: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
    """A program's rows ρ = t·R + i: their positions t (int64), ranks i, row mask, n offsets and mask, and the
    offsets of row (t, i) of group grp in a (T, R, g, n) array."""
    rho = pid.to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    t = rho // R
    i = rho % R
    mask_row = rho < T * R
    offs_n = tl.arange(0, BLOCK_N)
    mask_n = offs_n < n
    src = (rho * g + grp)[:, None] * n + offs_n[None, :]
    return t, i, mask_row, offs_n, mask_n, src


@triton.jit
def _other_rank(x_ptr, bias_ptr, t, j, grp, hd, g, n, offs_n, mask, mask_n, R: tl.constexpr):
    """Row (t, j) of x + b_{hd,j} for every row of the tile: (BLOCK_ROWS, BLOCK_N) fp32."""
    x = tl.load(x_ptr + ((t * R + j) * g + grp)[:, None] * n + offs_n[None, :], mask=mask, other=0.0)
    return x.to(tl.float32) + tl.load(bias_ptr + (hd * R + j) * n + offs_n, mask=mask_n, other=0.0)[None, :]


@triton.jit
def correction_fwd_kernel(
    q_ptr, k_ptr,             # (T, R, g, n), T = b·l
    q_bias_ptr, k_bias_ptr,   # (h, R, n) fp32
    gamma_ptr, sigma_ptr,     # (T, h) fp32
    coef_ptr,                 # (T, h, R, R) fp32 out
    T, h, g, n,
    R: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)
    hd = tl.program_id(1)
    grp = hd // (h // g)
    t, i, mask_row, offs_n, mask_n, src = _rows(pid, T, g, grp, n, R, BLOCK_ROWS, BLOCK_N)
    mask = mask_row[:, None] & mask_n[None, :]
    qt = tl.load(q_ptr + src, mask=mask, other=0.0).to(tl.float32)
    qt += tl.load(q_bias_ptr + (hd * R + i)[:, None] * n + offs_n[None, :], mask=mask, other=0.0)
    gm = tl.load(gamma_ptr + t * h + hd, mask=mask_row, other=0.0)
    sg = tl.load(sigma_ptr + t * h + hd, mask=mask_row, other=0.0)
    out = coef_ptr + ((t * h + hd) * R + i) * R
    for j in tl.static_range(R):
        kt = _other_rank(k_ptr, k_bias_ptr, t, j, grp, hd, g, n, offs_n, mask, mask_n, R)
        s = tl.sum(qt * kt, axis=1)
        tl.store(out + j, tl.where(i < j, gm, gm - sg) * s, mask=mask_row)


@triton.jit
def correction_bwd_kernel(
    q_ptr, k_ptr,             # (T, R, g, n)
    q_bias_ptr, k_bias_ptr,   # (h, R, n) fp32
    gamma_ptr, sigma_ptr,     # (T, h) fp32
    dcoef_ptr,                # (T, h, R, R) fp32
    dq_ptr, dk_ptr,           # (T, R, g, n) out, q's dtype
    dbias_ptr,                # (2, programs, h, R, n) fp32 out: q's partials, then k's (k_part further)
    dgamma_ptr, dsigma_ptr,   # (T, h) fp32 out
    T, h, g, n, k_part,
    R: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)
    grp = tl.program_id(1)
    e = h // g                                                 # heads per group
    t, i, mask_row, offs_n, mask_n, src = _rows(pid, T, g, grp, n, R, BLOCK_ROWS, BLOCK_N)
    mask = mask_row[:, None] & mask_n[None, :]
    q = tl.load(q_ptr + src, mask=mask, other=0.0).to(tl.float32)
    dq = tl.zeros((BLOCK_ROWS, BLOCK_N), dtype=tl.float32)
    dk = tl.zeros((BLOCK_ROWS, BLOCK_N), dtype=tl.float32)
    # this program's (R, BLOCK_N) tile of head 0's partials (head hd's at + hd·R·n) and its positions
    ranks = tl.arange(0, R)
    part = dbias_ptr + (pid.to(tl.int64) * h * R + ranks[:, None]) * n + offs_n[None, :]
    mask_part = (ranks < R)[:, None] & mask_n[None, :]
    pos = pid.to(tl.int64) * (BLOCK_ROWS // R) + tl.arange(0, BLOCK_ROWS // R)
    for m in range(0, e):                                      # the group's heads, in order
        hd = grp * e + m
        qt = q + tl.load(q_bias_ptr + (hd * R + i)[:, None] * n + offs_n[None, :], mask=mask, other=0.0)
        gm = tl.load(gamma_ptr + t * h + hd, mask=mask_row, other=0.0)
        sg = tl.load(sigma_ptr + t * h + hd, mask=mask_row, other=0.0)
        dco = dcoef_ptr + (t * h + hd) * R * R
        dqt = tl.zeros((BLOCK_ROWS, BLOCK_N), dtype=tl.float32)
        dkt = tl.zeros((BLOCK_ROWS, BLOCK_N), dtype=tl.float32)
        dgm = tl.zeros((BLOCK_ROWS,), dtype=tl.float32)
        dsg = tl.zeros((BLOCK_ROWS,), dtype=tl.float32)
        for j in tl.static_range(R):
            kt = _other_rank(k_ptr, k_bias_ptr, t, j, grp, hd, g, n, offs_n, mask, mask_n, R)    # k̃_j
            qj = _other_rank(q_ptr, q_bias_ptr, t, j, grp, hd, g, n, offs_n, mask, mask_n, R)    # q̃_j
            d_ij = tl.load(dco + i * R + j, mask=mask_row, other=0.0)                          # dcoef_{i,j}
            d_ji = tl.load(dco + j * R + i, mask=mask_row, other=0.0)                          # dcoef_{j,i}
            dqt += (d_ij * tl.where(i < j, gm, gm - sg))[:, None] * kt
            dkt += (d_ji * tl.where(j < i, gm, gm - sg))[:, None] * qj
            ds = d_ij * tl.sum(qt * kt, axis=1)                                                # dcoef ⊙ s
            dgm += ds
            dsg -= tl.where(j <= i, ds, 0.0)
        dq += dqt
        dk += dkt
        tl.store(part + hd * R * n, tl.sum(tl.reshape(dqt, (BLOCK_ROWS // R, R, BLOCK_N)), axis=0), mask=mask_part)
        tl.store(part + k_part + hd * R * n, tl.sum(tl.reshape(dkt, (BLOCK_ROWS // R, R, BLOCK_N)), axis=0),
                 mask=mask_part)
        mask_pos = pos < T
        tl.store(dgamma_ptr + pos * h + hd, tl.sum(tl.reshape(dgm, (BLOCK_ROWS // R, R)), axis=1), mask=mask_pos)
        tl.store(dsigma_ptr + pos * h + hd, tl.sum(tl.reshape(dsg, (BLOCK_ROWS // R, R)), axis=1), mask=mask_pos)
    tl.store(dq_ptr + src, dq.to(dq_ptr.dtype.element_ty), mask=mask)
    tl.store(dk_ptr + src, dk.to(dk_ptr.dtype.element_ty), mask=mask)


def _launch(q, q_bias, gamma):
    """Sizes and the tile: (T, r, g, n, h, blocks, BLOCK_N); checks the kernels' own assumptions."""
    b, l, r, g, n = q.shape
    h = q_bias.shape[0]
    if r < 2 or r & (r - 1) or BLOCK_ROWS % r:
        raise ValueError(f"the correction kernels take a power-of-two rank 2 <= r <= {BLOCK_ROWS}; got r = {r} "
                         "(q.shape[2]; SISO's scores come out of the rotary kernels)")
    if q_bias.shape != (h, r, n) or q_bias.dtype != torch.float32 or gamma.shape != (b, l, h):
        raise ValueError(f"the correction kernels take q (b, l, r, g, n), q_bias (h, r, n) fp32 and gamma "
                         f"(b, l, h); got q {tuple(q.shape)}, q_bias {tuple(q_bias.shape)} {q_bias.dtype}, "
                         f"gamma {tuple(gamma.shape)}")
    T = b * l
    return T, r, g, n, h, triton.cdiv(T * r, BLOCK_ROWS), max(16, triton.next_power_of_2(n))


def correction_fwd(q, k, q_bias, k_bias, gamma, sigma):
    """coef = c ⊙ (q̃ · k̃) (module docstring). q, k (b, l, r, g, n) contiguous; q_bias, k_bias (h, r, n) fp32
    contiguous; gamma, sigma (b, l, h) fp32 contiguous -> coef (b, l, h, r, r) fp32."""
    T, r, g, n, h, blocks, block_n = _launch(q, q_bias, gamma)
    coef = torch.empty(*gamma.shape, r, r, device=q.device, dtype=torch.float32)
    correction_fwd_kernel[(blocks, h)](q, k, q_bias, k_bias, gamma, sigma, coef, T, h, g, n, R=r,
                                       BLOCK_ROWS=BLOCK_ROWS, BLOCK_N=block_n, num_warps=NUM_WARPS)
    return coef


def correction_bwd(dcoef, q, k, q_bias, k_bias, gamma, sigma):
    """dcoef (b, l, h, r, r) fp32 contiguous; the forward's inputs -> (dq, dk (b, l, r, g, n) in q's dtype,
    dq_bias, dk_bias (h, r, n) fp32, dgamma, dsigma (b, l, h) fp32)."""
    T, r, g, n, h, blocks, block_n = _launch(q, q_bias, gamma)
    if dcoef.shape != (*gamma.shape, r, r):
        raise ValueError(f"dcoef must have coef's shape (b, l, h, r, r) = {(*gamma.shape, r, r)}; got "
                         f"{tuple(dcoef.shape)}")
    dq, dk = torch.empty_like(q), torch.empty_like(k)
    partials = torch.empty(2, blocks, h, r, n, device=q.device, dtype=torch.float32)
    dgamma, dsigma = torch.empty_like(gamma), torch.empty_like(sigma)
    correction_bwd_kernel[(blocks, g)](q, k, q_bias, k_bias, gamma, sigma, dcoef, dq, dk, partials, dgamma, dsigma,
                                       T, h, g, n, partials.stride(0), R=r, BLOCK_ROWS=BLOCK_ROWS, BLOCK_N=block_n,
                                       num_warps=BWD_NUM_WARPS)
    dbias = sum_partials(partials, dim=1)                     # (2, h, r, n): q's, k's
    return dq, dk, dbias[0], dbias[1], dgamma, dsigma
