"""MIMO's within-step correction coefficients and their gradients, as Triton kernels on tl.dot (nothing rotated).

What the rank-expanded SSD gets wrong inside a step is fixed by a coefficient per position t, head h and pair of
ranks (i, j) (:func:`mambalab.ref.mamba3.within_step_correction`):

    coef_{t,h,i,j} = c_{t,h,i,j} · s_{t,h,i,j}
    s_{t,h,i,j}    = q̃_{t,h,i} · k̃_{t,h,j},   q̃ = q_i + b^Q_{h,i},  k̃ = k_j + b^K_{h,j}
    c_{t,h,i,j}    = γ_t           if j > i,   γ_t - σ_t   if j <= i

(s = q̂_i · k̂_j: rotating both by the same θ_t keeps their dot product). Expanded, s is four terms, and each
is a matmul over n between tensors that are small or shared by a group's heads:

    s = q_i·k_j            (per position: the diagonal blocks of Q Kᵀ over a program's rows)
      + q_i·b^K_{h,j}      (Q (B^K)ᵀ: rows (t, i), columns (h, j))
      + b^Q_{h,i}·k_j      (K (B^Q)ᵀ: rows (t, j), columns (h, i), transposed within each R × R block)
      + b^Q_{h,i}·b^K_{h,j}   (bb, (h, R, R), formed once a launch by :func:`bias_products`)

Backward, from dcoef, with dS = dcoef ⊙ c (every term's transpose; A = Σ_h dS, the per-position blocks):

    dq_{t,i} = Σ_{h,j} dS_{t,h,i,j} b^K_{h,j} + Σ_j A_{t,i,j} k_{t,j}        dk the same way round
    db^Q_{h,i} = Σ_{t,j} dS_{t,h,i,j} k_{t,j} + Σ_j dbb_{h,i,j} b^K_{h,j},   dbb = Σ_t dS    (db^K alike)
    dγ_t = Σ_{i,j} dcoef ⊙ s,    dσ_t = -Σ_{j <= i} dcoef ⊙ s

Programs: (block of BLOCK_T positions, group), rows ρ = t·R + i (ROWS = BLOCK_T·R of them, all of n), a loop
over the group's heads EB at a time (columns (head, rank), COLUMNS = EB·R). The forward is one kernel, and
writes s beside coef for the backward. The backward is two, each with that loop: one for dq, dk (summed over
the group's heads by the dots, in registers) and dγ, dσ (from s); one for the biases' partials. db^Q, db^K
and dbb are per-program partials folded by :func:`mambalab.kernels.reduce.sum_partials` (a fixed order), and
:func:`correction_bwd` adds dbb's share of db^Q, db^K. No atomics: the bits repeat run to run. The dots take
fp32 operands at the project's rule (:func:`mambalab.device.dot_precision`: tf32 on a GPU, so s carries about
1e-3 of its scale in error; the tests on a GPU compare at that).

What this replaces (for r > 1): :func:`~mambalab.ref.mamba3.within_step_scores`' four einsums and
:func:`~mambalab.ref.mamba3.correction_coefficients`, PyTorch ops whose autograd adds a dozen bmm, copies and
sums a step. Measured on an H200 (session 10, calls 4 and 5; MIMO forward+backward as CUDA graphs at b4 l4096
h32 p64 n128, bf16, against that PyTorch path in the same process): r = 4, chunk 16, 11.00 ms against 11.58;
r = 2, chunk 32, 5.83 against 6.19; r = 8, chunk 8, 24.53 against 25.49 (r = 2 and 8 with 8 warps in the
backward). At r = 4 the forward kernel took 0.08 ms a step, the backward's two 0.33 and 0.28 ms (call 6).
The whole op's errors against the fp64 reference equal the PyTorch path's in every printed digit but db^Q,
db^K (0.382 and 0.426 % against 0.386 and 0.431 %); 1 bit pattern in 3 runs. Other variants at r = 4: 8 warps in
the backward 11.22 ms, 8 in both 11.27, 32 columns 11.42; the backward forming s again instead of reading it
11.33 (and 32 rows with it 14.0); fp32-accurate dots ("tf32x3") spilled and took 13.1-14.0 ms. A first,
elementwise version (a program per head, row sums over n) took 3.5 ms for its backward alone.

Shapes: q, k (b, l, r, g, n) in the kernels' dtype, contiguous; q_bias, k_bias (h, r, n) fp32; gamma, sigma
(b, l, h) fp32; coef (b, l, h, r, r) fp32.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from mambalab import device
from mambalab.kernels.reduce import sum_partials

ROWS = 64         # rows (position, rank) a program: ROWS / r positions
COLUMNS = 16      # columns (head, rank) a step of the loop over a group's heads: COLUMNS / r heads (at least 1)
NUM_WARPS = 4
BWD_NUM_WARPS = 4


@triton.jit
def _program(T, h, g, n, R: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr):
    """What a program (position block, group) works on: its ids, the group's head count E, and its rows (t, i):
    local position and rank of each row, positions t (int64), the row mask, n's offsets and mask, and the
    offsets of rows (t, i) of its group in a (T, R, g, n) array with their mask."""
    pid_t = tl.program_id(0)
    grp = tl.program_id(1)
    rho = tl.arange(0, BLOCK_T * R)
    t_loc = rho // R
    i = rho % R
    t = pid_t.to(tl.int64) * BLOCK_T + t_loc
    mask_row = t < T
    offs_n = tl.arange(0, BLOCK_N)
    mask_n = offs_n < n
    mask = mask_row[:, None] & mask_n[None, :]
    src = ((t * R + i) * g + grp)[:, None] * n + offs_n[None, :]
    return pid_t, grp, h // g, t_loc, i, t, mask_row, offs_n, mask_n, mask, src


@triton.jit
def _rows(q_ptr, k_ptr, src, mask):
    """q's and k's rows at ``src`` in fp32."""
    return (tl.load(q_ptr + src, mask=mask, other=0.0).to(tl.float32),
            tl.load(k_ptr + src, mask=mask, other=0.0).to(tl.float32))


@triton.jit
def _same_position(x, t_loc, R: tl.constexpr, BLOCK_T: tl.constexpr):
    """(BLOCK_T·R, BLOCK_T·R) over rows (t, i) and columns (t', j) -> its diagonal blocks t' = t, (BLOCK_T·R, R)."""
    x = tl.reshape(x, (BLOCK_T * R, BLOCK_T, R))
    same = t_loc[:, None] == tl.arange(0, BLOCK_T)[None, :]
    return tl.sum(tl.where(same[:, :, None], x, 0.0), axis=1)


@triton.jit
def _block_diagonal(a, t_loc, R: tl.constexpr, BLOCK_T: tl.constexpr):
    """The inverse of :func:`_same_position`: (BLOCK_T·R, R) blocks -> (BLOCK_T·R, BLOCK_T·R), zero off them."""
    same = t_loc[:, None] == tl.arange(0, BLOCK_T)[None, :]
    x = tl.where(same[:, :, None], a[:, None, :], 0.0)
    return tl.reshape(x, (BLOCK_T * R, BLOCK_T * R))


@triton.jit
def _swap_ranks(x, R: tl.constexpr, BLOCK_T: tl.constexpr, EB: tl.constexpr):
    """Rows (t, a), columns (m, b) -> rows (t, b), columns (m, a): a transpose inside each R × R block."""
    x = tl.permute(tl.reshape(x, (BLOCK_T, R, EB, R)), (0, 3, 2, 1))
    return tl.reshape(x, (BLOCK_T * R, EB * R))


@triton.jit
def _columns(m0, grp, E, h, n, offs_n, mask_n, R: tl.constexpr, EB: tl.constexpr):
    """A step of the head loop: each column's head, rank and mask, and the offsets of its bias rows
    (EB·R, BLOCK_N) in an (h, R, n) array with their mask."""
    kappa = tl.arange(0, EB * R)
    m = m0 + kappa // R
    j = kappa % R
    hd = grp * E + m
    mask_col = m < E
    bias = (hd * R + j)[:, None] * n + offs_n[None, :]
    return hd, j, mask_col, bias, mask_col[:, None] & mask_n[None, :]


@triton.jit
def _scores(q, k, qk, qb, kb, bb_ptr, hd, i, j, mask2, t_loc, R: tl.constexpr, BLOCK_T: tl.constexpr,
            EB: tl.constexpr, PRECISION: tl.constexpr):
    """s over rows (t, i) and columns (head, j): (BLOCK_T·R, EB·R) fp32 (module docstring's four terms)."""
    s = tl.dot(q, tl.trans(kb), input_precision=PRECISION)                           # q_i · b^K_j
    s += _swap_ranks(tl.dot(k, tl.trans(qb), input_precision=PRECISION), R, BLOCK_T, EB)   # b^Q_i · k_j
    s += tl.reshape(tl.broadcast_to(qk[:, None, :], (BLOCK_T * R, EB, R)), (BLOCK_T * R, EB * R))   # q_i · k_j
    s += tl.load(bb_ptr + (hd[None, :] * R + i[:, None]) * R + j[None, :], mask=mask2, other=0.0)
    return s


@triton.jit
def correction_fwd_kernel(
    q_ptr, k_ptr,             # (T, R, g, n), T = b·l
    q_bias_ptr, k_bias_ptr,   # (h, R, n) fp32
    bb_ptr,                   # (h, R, R) fp32: b^Q_i · b^K_j
    gamma_ptr, sigma_ptr,     # (T, h) fp32
    coef_ptr,                 # (T, h, R, R) fp32 out
    scores_ptr,               # (T, h, R, R) fp32 out: s, for the backward
    T, h, g, n,
    R: tl.constexpr, BLOCK_T: tl.constexpr, EB: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
):
    pid_t, grp, E, t_loc, i, t, mask_row, offs_n, mask_n, mask, src = _program(T, h, g, n, R, BLOCK_T, BLOCK_N)
    q, k = _rows(q_ptr, k_ptr, src, mask)
    qk = _same_position(tl.dot(q, tl.trans(k), input_precision=PRECISION), t_loc, R, BLOCK_T)   # (rows, R)
    for m0 in range(0, E, EB):
        hd, j, mask_col, bias, mask_b = _columns(m0, grp, E, h, n, offs_n, mask_n, R, EB)
        qb = tl.load(q_bias_ptr + bias, mask=mask_b, other=0.0)
        kb = tl.load(k_bias_ptr + bias, mask=mask_b, other=0.0)
        mask2 = mask_row[:, None] & mask_col[None, :]
        s = _scores(q, k, qk, qb, kb, bb_ptr, hd, i, j, mask2, t_loc, R, BLOCK_T, EB, PRECISION)
        th = t[:, None] * h + hd[None, :]
        gm = tl.load(gamma_ptr + th, mask=mask2, other=0.0)
        sg = tl.load(sigma_ptr + th, mask=mask2, other=0.0)
        c = tl.where(i[:, None] < j[None, :], gm, gm - sg)
        at = (th * R + i[:, None]) * R + j[None, :]
        tl.store(coef_ptr + at, c * s, mask=mask2)
        tl.store(scores_ptr + at, s, mask=mask2)


@triton.jit
def _step_gradient(gamma_ptr, sigma_ptr, dcoef_ptr, t, hd, i, j, h, mask2, R: tl.constexpr, BLOCK_T: tl.constexpr,
                   EB: tl.constexpr):
    """A step of the head loop: the offsets of (t, head, i, j) in a (T, h, R, R) array, dcoef and dS = dcoef ⊙ c
    over rows (t, i), columns (head, j), and dS with the ranks swapped (rows (t, j), columns (head, i)),
    (BLOCK_T·R, EB·R) each."""
    th = t[:, None] * h + hd[None, :]
    gm = tl.load(gamma_ptr + th, mask=mask2, other=0.0)
    sg = tl.load(sigma_ptr + th, mask=mask2, other=0.0)
    at = (th * R + i[:, None]) * R + j[None, :]
    dco = tl.load(dcoef_ptr + at, mask=mask2, other=0.0)
    ds = dco * tl.where(i[:, None] < j[None, :], gm, gm - sg)
    return at, dco, ds, _swap_ranks(ds, R, BLOCK_T, EB)


@triton.jit
def correction_bwd_qk_kernel(
    q_ptr, k_ptr,             # (T, R, g, n)
    q_bias_ptr, k_bias_ptr,   # (h, R, n) fp32
    gamma_ptr, sigma_ptr,     # (T, h) fp32
    dcoef_ptr,                # (T, h, R, R) fp32
    scores_ptr,               # (T, h, R, R) fp32: the forward's s
    dq_ptr, dk_ptr,           # (T, R, g, n) out, q's dtype
    dgamma_ptr, dsigma_ptr,   # (T, h) fp32 out
    T, h, g, n,
    R: tl.constexpr, BLOCK_T: tl.constexpr, EB: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
):
    """dq and dk, summed over the group's heads: Σ_h dS b^K (one dot a step of the head loop) and the
    per-position blocks A = Σ_h dS times k (one block-diagonal dot at the end); dk the same way round. And
    dγ, dσ from dcoef and the forward's s."""
    pid_t, grp, E, t_loc, i, t, mask_row, offs_n, mask_n, mask, src = _program(T, h, g, n, R, BLOCK_T, BLOCK_N)
    dq = tl.zeros((BLOCK_T * R, BLOCK_N), dtype=tl.float32)
    dk = tl.zeros((BLOCK_T * R, BLOCK_N), dtype=tl.float32)
    a_q = tl.zeros((BLOCK_T * R, R), dtype=tl.float32)    # Σ_h dS_{t,h,i,j} at row (t, i), column j
    a_k = tl.zeros((BLOCK_T * R, R), dtype=tl.float32)    # Σ_h dS_{t,h,i,j} at row (t, j), column i
    pos = pid_t.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    for m0 in range(0, E, EB):
        hd, j, mask_col, bias, mask_b = _columns(m0, grp, E, h, n, offs_n, mask_n, R, EB)
        mask2 = mask_row[:, None] & mask_col[None, :]
        at, dco, ds, ds_t = _step_gradient(gamma_ptr, sigma_ptr, dcoef_ptr, t, hd, i, j, h, mask2, R, BLOCK_T, EB)
        dq += tl.dot(ds, tl.load(k_bias_ptr + bias, mask=mask_b, other=0.0), input_precision=PRECISION)
        dk += tl.dot(ds_t, tl.load(q_bias_ptr + bias, mask=mask_b, other=0.0), input_precision=PRECISION)
        a_q += tl.sum(tl.reshape(ds, (BLOCK_T * R, EB, R)), axis=1)
        a_k += tl.sum(tl.reshape(ds_t, (BLOCK_T * R, EB, R)), axis=1)
        p = dco * tl.load(scores_ptr + at, mask=mask2, other=0.0)                  # dcoef ⊙ s
        below = tl.where(j[None, :] <= i[:, None], p, 0.0)
        mask_pm = (pos < T)[:, None] & (m0 + tl.arange(0, EB) < E)[None, :]
        out = pos[:, None] * h + grp * E + m0 + tl.arange(0, EB)[None, :]
        tl.store(dgamma_ptr + out, tl.sum(tl.sum(tl.reshape(p, (BLOCK_T, R, EB, R)), axis=3), axis=1), mask=mask_pm)
        tl.store(dsigma_ptr + out, -tl.sum(tl.sum(tl.reshape(below, (BLOCK_T, R, EB, R)), axis=3), axis=1),
                 mask=mask_pm)
    q, k = _rows(q_ptr, k_ptr, src, mask)
    dq += tl.dot(_block_diagonal(a_q, t_loc, R, BLOCK_T), k, input_precision=PRECISION)
    dk += tl.dot(_block_diagonal(a_k, t_loc, R, BLOCK_T), q, input_precision=PRECISION)
    tl.store(dq_ptr + src, dq.to(dq_ptr.dtype.element_ty), mask=mask)
    tl.store(dk_ptr + src, dk.to(dk_ptr.dtype.element_ty), mask=mask)


@triton.jit
def correction_bwd_params_kernel(
    q_ptr, k_ptr,             # (T, R, g, n)
    gamma_ptr, sigma_ptr,     # (T, h) fp32
    dcoef_ptr,                # (T, h, R, R) fp32
    dbias_ptr,                # (2, programs, h, R, n) fp32 out: partials of db^Q's and db^K's dot terms
    dbb_ptr,                  # (programs, h, R, R) fp32 out: partials of Σ_t dS
    T, h, g, n, k_part,
    R: tl.constexpr, BLOCK_T: tl.constexpr, EB: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
):
    """The biases' partials over the program's positions: dSᵀ k, dSᵀ q and Σ_t dS."""
    pid_t, grp, E, t_loc, i, t, mask_row, offs_n, mask_n, mask, src = _program(T, h, g, n, R, BLOCK_T, BLOCK_N)
    q, k = _rows(q_ptr, k_ptr, src, mask)
    part = pid_t.to(tl.int64) * h                          # this program's partials, head 0
    r_i = tl.arange(0, R)
    for m0 in range(0, E, EB):
        hd, j, mask_col, bias, mask_b = _columns(m0, grp, E, h, n, offs_n, mask_n, R, EB)
        mask2 = mask_row[:, None] & mask_col[None, :]
        _, _, ds, ds_t = _step_gradient(gamma_ptr, sigma_ptr, dcoef_ptr, t, hd, i, j, h, mask2, R, BLOCK_T, EB)
        rows_b = (part + hd[:, None]) * R * n + j[:, None] * n + offs_n[None, :]   # partial row (head, rank)
        tl.store(dbias_ptr + rows_b, tl.dot(tl.trans(ds_t), k, input_precision=PRECISION), mask=mask_b)
        tl.store(dbias_ptr + k_part + rows_b, tl.dot(tl.trans(ds), q, input_precision=PRECISION), mask=mask_b)
        dbb = tl.sum(tl.reshape(ds, (BLOCK_T, R, EB * R)), axis=0)          # (R_i, columns (h, j))
        tl.store(dbb_ptr + ((part + hd[None, :]) * R + r_i[:, None]) * R + j[None, :], dbb,
                 mask=(r_i < R)[:, None] & mask_col[None, :])


def _launch(q, q_bias, gamma):
    """Sizes, grid and tile, with the kernels' own checks: (T, r, g, n, h, grid, meta)."""
    b, l, r, g, n = q.shape
    h = q_bias.shape[0]
    if r < 2 or r & (r - 1) or r > COLUMNS:
        raise ValueError(f"the correction kernels take a power-of-two rank 2 <= r <= {COLUMNS}; got r = {r} "
                         "(q.shape[2]; SISO's scores come out of the rotary kernels)")
    if q_bias.shape != (h, r, n) or q_bias.dtype != torch.float32 or gamma.shape != (b, l, h) or h % g:
        raise ValueError(f"the correction kernels take q (b, l, r, g, n), q_bias (h, r, n) fp32 with g dividing h "
                         f"and gamma (b, l, h); got q {tuple(q.shape)}, q_bias {tuple(q_bias.shape)} "
                         f"{q_bias.dtype}, gamma {tuple(gamma.shape)}")
    T = b * l
    block_t = max(ROWS // r, 16 // r, 1)
    eb = min(COLUMNS // r, triton.next_power_of_2(h // g))
    eb = max(eb, triton.cdiv(16, r))                     # tl.dot's least size
    meta = dict(R=r, BLOCK_T=block_t, EB=eb, BLOCK_N=max(16, triton.next_power_of_2(n)),
                PRECISION=device.dot_precision(torch.float32, q.device))
    return T, r, g, n, h, (triton.cdiv(T, block_t), g), meta


def bias_products(q_bias, k_bias):
    """bb_{h,i,j} = b^Q_{h,i} · b^K_{h,j}: (h, r, n) twice -> (h, r, r) fp32 (elementwise and a sum: no matmul)."""
    return (q_bias[:, :, None, :] * k_bias[:, None, :, :]).sum(-1)


def correction_fwd(q, k, q_bias, k_bias, gamma, sigma):
    """coef = c ⊙ s (module docstring). q, k (b, l, r, g, n) contiguous; q_bias, k_bias (h, r, n) fp32
    contiguous; gamma, sigma (b, l, h) fp32 contiguous -> (coef, s), each (b, l, h, r, r) fp32."""
    T, r, g, n, h, grid, meta = _launch(q, q_bias, gamma)
    coef = torch.empty(*gamma.shape, r, r, device=q.device, dtype=torch.float32)
    scores = torch.empty_like(coef)
    correction_fwd_kernel[grid](q, k, q_bias, k_bias, bias_products(q_bias, k_bias), gamma, sigma, coef, scores,
                                T, h, g, n, **meta, num_warps=NUM_WARPS)
    return coef, scores


def correction_bwd(dcoef, q, k, q_bias, k_bias, gamma, sigma, scores):
    """dcoef (b, l, h, r, r) fp32 contiguous; the forward's inputs and its s -> (dq, dk (b, l, r, g, n) in q's
    dtype, dq_bias, dk_bias (h, r, n) fp32, dgamma, dsigma (b, l, h) fp32)."""
    T, r, g, n, h, grid, meta = _launch(q, q_bias, gamma)
    for name, t in (("dcoef", dcoef), ("scores", scores)):
        if t.shape != (*gamma.shape, r, r):
            raise ValueError(f"{name} must have coef's shape (b, l, h, r, r) = {(*gamma.shape, r, r)}; got "
                             f"{tuple(t.shape)}")
    dq, dk = torch.empty_like(q), torch.empty_like(k)
    f32 = dict(device=q.device, dtype=torch.float32)
    partials = torch.empty(2, grid[0], h, r, n, **f32)
    dbb_partials = torch.empty(grid[0], h, r, r, **f32)
    dgamma, dsigma = torch.empty_like(gamma), torch.empty_like(sigma)
    correction_bwd_qk_kernel[grid](q, k, q_bias, k_bias, gamma, sigma, dcoef, scores, dq, dk, dgamma, dsigma,
                                   T, h, g, n, **meta, num_warps=BWD_NUM_WARPS)
    correction_bwd_params_kernel[grid](q, k, gamma, sigma, dcoef, partials, dbb_partials, T, h, g, n,
                                       partials.stride(0), **meta, num_warps=BWD_NUM_WARPS)
    dbias = sum_partials(partials, dim=1)                     # (2, h, r, n): the dot terms, q's and k's
    dbb = sum_partials(dbb_partials, dim=0)                   # (h, r, r)
    dq_bias = dbias[0] + (dbb[:, :, :, None] * k_bias[:, None, :, :]).sum(2)   # Σ_j dbb_{i,j} b^K_j
    dk_bias = dbias[1] + (dbb[:, :, :, None] * q_bias[:, :, None, :]).sum(1)   # Σ_i dbb_{i,j} b^Q_i
    return dq, dk, dq_bias, dk_bias, dgamma, dsigma
