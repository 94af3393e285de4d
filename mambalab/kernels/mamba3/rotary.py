"""Mamba-3's q̂ and k̂ together: per-head bias and rotation by the cumulative angle, forward and backward.

Math (per position t, rank r, head h reading group γ(h) = h // (H / g); pairs i < a turn, the rest do not;
x is q or k, each with its own bias, both turned by the same θ):

    x̃ = x[t, r, γ(h)] + bias[h, r]                              (n,)
    out[t, r, h, 2i]   = x̃_{2i} cos θ[t, h, i] - x̃_{2i+1} sin θ[t, h, i]
    out[t, r, h, 2i+1] = x̃_{2i} sin θ[t, h, i] + x̃_{2i+1} cos θ[t, h, i]

Backward, from dout (the rotation is orthogonal, so its transpose turns back by -θ), for x = q and k:

    dx̃ = Rot(-θ) dout,   dx[t, r, g] = Σ_{h in group g} dx̃,   dbias[h, r] = Σ_t dx̃
    dθ[t, h, i] = Σ_r (dq̂_{2i+1} q̂_{2i} - dq̂_{2i} q̂_{2i+1})  +  Σ_r (dk̂_{2i+1} k̂_{2i} - dk̂_{2i} k̂_{2i+1})

MIMO's within-step correction needs no scores from here: it lives in the scan's same-step block
(:mod:`mambalab.kernels.ssd.chunk_scan`).

One launch each way for q and k: a program loads θ and evaluates cos θ, sin θ once per (position block,
head) and uses them for q and k and every rank; the backward sums dθ over q and k (and, in a tile of every
rank, over ranks) in registers and writes it once. The sum over a group's heads stays inside a program
(heads in order); the sum over positions for dbias is a reduction across programs: per-program partials,
q's and k's in one buffer, folded by one :func:`mambalab.kernels.reduce.sum_partials` (never atomics).

The outputs are written in the rank-expanded layout the SSD kernels read: (b, l, r, h, n) is (b, l·r, h, n).

Tile rule (shape only): each of q and k is a tile of ROWS = 32 rows of n, BLOCK_R = next_pow2(r) ranks by
BLOCK_T = 32 / BLOCK_R positions of the flattened (b·l) axis (at least 1), with BLOCK_N2 = next_pow2(n / 2)
pairs; rows are read and written whole (contiguous, vectorised) and split into their pairs in registers
(a pair-strided read: 1.1 ms a call; benchmarks/results/README.md, 2026-12-01).
Forward programs are (position block, head) with every rank in one tile, so that cos, sin serve every rank. Backward
programs are (position block, group, rank) at r > 1 (:func:`rank_blocks`): each holds one rank's dx tiles for q and
k (and q, k themselves) across the group's heads, in r = 1's tiles (32 positions, the row split by
:func:`turned_and_plain`), and writes dθ's term for its rank; the r terms are folded by
:func:`~mambalab.kernels.reduce.sum_partials` (a fixed order). A tile of every rank (``RANK_PROGRAMS = False``)
covers 32 / BLOCK_R positions (r = 4: 8). Warps: the forward's by rank (:func:`fwd_num_warps`); 4 for the backward,
which spills at 4 and not at 8 yet runs faster: one 8-warp program fills an SM's registers, too few warps to hide
the loads' latency. At r = 1 the backward's tiles hold a row's turned pairs alone (BLOCK_N2 = next_pow2(a), with
rope_fraction 0.5 half of n) and the rest of the row, where dx̃ = dout and there is no dθ, in tiles of their own
(:func:`turned_and_plain`). This file's figures are an H200's at b4 l4096 h32 g1 n128 a32, bf16; the other tiles
timed and each variant's registers and spills are in benchmarks/results/README.md (2026-12-01).

Shapes: q, k (b, l, r, g, n) contiguous; q_bias, k_bias (h, r, n) fp32; theta (b, l, h, a) fp32
-> q̂, k̂ (b, l, r, h, n).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from mambalab.kernels.reduce import sum_partials


ROWS = 32           # rows of n per tile (ranks x positions), each of q and k
BWD_NUM_WARPS = 4   # r = 1: 0.595 ms against 0.783 at 8 warps (benchmarks/results/README.md, 2026-12-01)


def bwd_loop_stages(r):
    """Software-pipelining stages of the backward's loop over a group's heads (``tl.range``'s num_stages: the
    loads of up to that many heads in flight; 1: none): 3 at r = 1, 1 where r > 1's larger tiles leave no room
    (r = 1: 0.452 ms against 0.513, 2026-11-30_h200_mamba3_loop_stages_ab.json)."""
    return 3 if r == 1 else 1


def fwd_num_warps(r):
    """Warps of the forward: 8 at r = 1 and 2, 4 from r = 4 on (r = 2 and 8 untimed).
    r = 1: 0.133 ms against 0.174 at 4 warps; r = 4: 0.599 against 0.651 at 8 (benchmarks/results/README.md,
    2026-12-01)."""
    return 8 if r <= 2 else 4


def row_pairs(n):
    """BLOCK_N2 for a tile of whole rows: next_pow2(n / 2) pairs (at least 1)."""
    return triton.next_power_of_2(max(n // 2, 1))


def turned_and_plain(n, a, r):
    """The backward's split of a row for tiles of r = 1 rank (SISO, or a program per rank): BLOCK_N2 =
    next_pow2(a) pairs (at least 1) in the turned tile, the rest (PLAIN = next_pow2 of the elements left) in a
    tile of their own; for tiles of r > 1 ranks, and where the turned tile covers the row, one tile (PLAIN = 0).
    r = 1: 0.402 ms against 0.539 for one tile (benchmarks/results/README.md, 2026-12-01)."""
    pairs = triton.next_power_of_2(max(a, 1))
    if r > 1 or 2 * pairs >= n:
        return dict(BLOCK_N2=row_pairs(n), PLAIN=0)
    return dict(BLOCK_N2=pairs, PLAIN=triton.next_power_of_2(n - 2 * pairs))


def tiles(r):
    """(BLOCK_R, BLOCK_T) for rank r: every rank, BLOCK_R · BLOCK_T = ROWS rows (BLOCK_T at least 1)."""
    block_r = triton.next_power_of_2(r)
    return block_r, max(ROWS // block_r, 1)


@triton.jit
def _pairs(rows, BLOCK_R: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N2: tl.constexpr):
    """(BLOCK_R, BLOCK_T, 2·BLOCK_N2) rows read contiguously -> their even and odd elements, each
    (BLOCK_R, BLOCK_T, BLOCK_N2)."""
    return tl.split(tl.reshape(rows, (BLOCK_R, BLOCK_T, BLOCK_N2, 2)))


@triton.jit
def _rows(even, odd, BLOCK_R: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N2: tl.constexpr):
    """The inverse of :func:`_pairs`: interleave even and odd elements back into (BLOCK_R, BLOCK_T, 2·BLOCK_N2)."""
    return tl.reshape(tl.join(even, odd), (BLOCK_R, BLOCK_T, 2 * BLOCK_N2))


@triton.jit
def _turn(x_ptr, bias_ptr, out_ptr, src, bias_off, dst, mask, mask_rc, cos, sin,
          BLOCK_R: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N2: tl.constexpr):
    """out = Rot(θ) x̃ with x̃ = x + bias, for one of q, k: a (BLOCK_R, BLOCK_T, 2·BLOCK_N2) tile."""
    x = tl.load(x_ptr + src, mask=mask, other=0.0).to(tl.float32)
    x += tl.load(bias_ptr + bias_off, mask=mask_rc, other=0.0)
    x0, x1 = _pairs(x, BLOCK_R, BLOCK_T, BLOCK_N2)
    out = _rows(x0 * cos - x1 * sin, x0 * sin + x1 * cos, BLOCK_R, BLOCK_T, BLOCK_N2)
    tl.store(out_ptr + dst, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def rotary_qk_fwd_kernel(
    q_ptr, k_ptr,           # (T, r, g, n) T = b·l positions
    q_bias_ptr, k_bias_ptr, # (h, r, n) fp32
    theta_ptr,              # (T, h, a) fp32
    q_out_ptr, k_out_ptr,   # (T, r, h, n) out
    T, h, g, n, a,
    R: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N2: tl.constexpr,
):
    pid_t = tl.program_id(0)
    hd = tl.program_id(1)
    grp = hd // (h // g)
    offs_r = tl.arange(0, BLOCK_R)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_i = tl.arange(0, BLOCK_N2)                  # pairs
    offs_c = tl.arange(0, 2 * BLOCK_N2)              # elements of a row: pair c // 2
    mask_t = offs_t < T
    mask_rc = (offs_r < R)[:, None, None] & (offs_c < n)[None, None, :]
    mask = mask_rc & mask_t[None, :, None]
    pos = offs_t.to(tl.int64)
    # pairs past a (and padding) load θ = 0: cos 1, sin 0, they pass unturned; once for q, k and every rank
    th = tl.load(theta_ptr + (pos[:, None] * h + hd) * a + offs_i[None, :],
                 mask=mask_t[:, None] & (offs_i < a)[None, :], other=0.0)
    cos = tl.cos(th)[None, :, :]
    sin = tl.sin(th)[None, :, :]
    rows = pos[None, :, None] * R + offs_r[:, None, None]          # (BLOCK_R, BLOCK_T, 1): row t·r + rank
    src = (rows * g + grp) * n + offs_c[None, None, :]
    dst = (rows * h + hd) * n + offs_c[None, None, :]
    bias_off = (hd * R + offs_r[:, None, None]) * n + offs_c[None, None, :]
    _turn(q_ptr, q_bias_ptr, q_out_ptr, src, bias_off, dst, mask, mask_rc, cos, sin, BLOCK_R, BLOCK_T, BLOCK_N2)
    _turn(k_ptr, k_bias_ptr, k_out_ptr, src, bias_off, dst, mask, mask_rc, cos, sin, BLOCK_R, BLOCK_T, BLOCK_N2)


def rotary_qk_fwd(q, k, q_bias, k_bias, theta, out_dtype):
    """Launch the forward. q, k (b, l, r, g, n) contiguous; q_bias, k_bias (h, r, n) fp32; theta (b, l, h, a)
    fp32 -> (q̂, k̂), each (b, l, r, h, n) in ``out_dtype``."""
    b, l, r, g, n = q.shape
    h, a = q_bias.shape[0], theta.shape[-1]
    q_out = torch.empty(b, l, r, h, n, device=q.device, dtype=out_dtype)
    k_out = torch.empty_like(q_out)
    T = b * l
    block_r, block_t = tiles(r)
    rotary_qk_fwd_kernel[(triton.cdiv(T, block_t), h)](
        q, k, q_bias, k_bias, theta, q_out, k_out, T, h, g, n, a,
        R=r, BLOCK_R=block_r, BLOCK_T=block_t, BLOCK_N2=row_pairs(n),
        num_warps=fwd_num_warps(r))
    return q_out, k_out


@triton.jit
def _turn_back(dout_ptr, dst, xt, mask, cos, sin, BLOCK_R: tl.constexpr, BLOCK_T: tl.constexpr,
               BLOCK_N2: tl.constexpr):
    """For one of q, k at one head, from x̃ = x + bias: (dx̃ = Rot(-θ) dout (BLOCK_R, BLOCK_T, 2·BLOCK_N2), dθ's
    term summed over ranks (BLOCK_T, BLOCK_N2))."""
    x0, x1 = _pairs(xt, BLOCK_R, BLOCK_T, BLOCK_N2)
    d = tl.load(dout_ptr + dst, mask=mask, other=0.0)
    d0, d1 = _pairs(d.to(tl.float32), BLOCK_R, BLOCK_T, BLOCK_N2)
    dth = tl.sum(d1 * (x0 * cos - x1 * sin) - d0 * (x0 * sin + x1 * cos), axis=0)
    return _rows(d0 * cos + d1 * sin, d1 * cos - d0 * sin, BLOCK_R, BLOCK_T, BLOCK_N2), dth


@triton.jit
def _group_block(dbias_ptr, T, h, g, n, R: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_T: tl.constexpr,
                 C0: tl.constexpr, WIDTH: tl.constexpr):
    """What a backward program (position block, group[, rank block]) addresses in elements C0 … C0 + WIDTH - 1
    of each row: its ranks (from program_id(2) · BLOCK_R), its positions and their mask, the element offsets,
    the masks of its (BLOCK_R, BLOCK_T, WIDTH) tiles, the group's rows of q, k (src), and its dbias partials'
    (BLOCK_R, WIDTH) tile for head 0 (head hd's at + hd·r·n)."""
    pid_t = tl.program_id(0)
    grp = tl.program_id(1)
    offs_r = tl.program_id(2) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_c = C0 + tl.arange(0, WIDTH)
    mask_t = offs_t < T
    mask_rc = (offs_r < R)[:, None] & (offs_c < n)[None, :]
    mask = mask_rc[:, None, :] & mask_t[None, :, None]
    pos = offs_t.to(tl.int64)
    rows = pos[None, :, None] * R + offs_r[:, None, None]          # (BLOCK_R, BLOCK_T, 1): row t·r + rank
    src = (rows * g + grp) * n + offs_c[None, None, :]
    part = dbias_ptr + (pid_t.to(tl.int64) * h * R + offs_r[:, None]) * n + offs_c[None, :]
    return grp, offs_r, offs_c, mask_t, mask_rc, mask, pos, rows, src, part


@triton.jit
def rotary_qk_bwd_kernel(
    q_ptr, k_ptr,           # (T, r, g, n) the forward's inputs
    q_bias_ptr, k_bias_ptr, # (h, r, n) fp32
    theta_ptr,              # (T, h, a) fp32
    dq_out_ptr, dk_out_ptr, # (T, r, h, n) dq̂, dk̂
    dq_ptr, dk_ptr,         # (T, r, g, n) fp32 out
    dbias_ptr,              # (programs along T, h, r, n) fp32 out: q's partials; k's k_part_stride further
    dtheta_ptr,             # (rank blocks, T, h, a) fp32 out: dθ summed over each program's ranks
    T, h, g, n, a, k_part_stride,
    R: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_N2: tl.constexpr,   # pairs of the turned part: elements 0 … 2·BLOCK_N2 - 1, BLOCK_N2 >= a
    PLAIN: tl.constexpr,      # elements of the part no pair of which turns, from 2·BLOCK_N2 on (0: none)
    LOOP_STAGES: tl.constexpr,
):
    grp, offs_r, offs_c, mask_t, mask_rc, mask, pos, rows, src, part = _group_block(
        dbias_ptr, T, h, g, n, R, BLOCK_R, BLOCK_T, 0, 2 * BLOCK_N2)
    e = h // g                                                     # heads per group
    offs_i = tl.arange(0, BLOCK_N2)                                # pairs
    mask_a = mask_t[:, None] & (offs_i < a)[None, :]
    xq = tl.load(q_ptr + src, mask=mask, other=0.0)                # kept in their dtype across the heads
    xk = tl.load(k_ptr + src, mask=mask, other=0.0)
    dxq = tl.zeros((BLOCK_R, BLOCK_T, 2 * BLOCK_N2), dtype=tl.float32)
    dxk = tl.zeros((BLOCK_R, BLOCK_T, 2 * BLOCK_N2), dtype=tl.float32)
    if PLAIN > 0:   # the rest of each row: dx̃ = dout there, no θ, no x (its own tiles, so that the turn's
        # tiles, and their registers, cover the turned pairs alone)
        _, _, offs_cp, _, mask_rcp, maskp, _, _, srcp, partp = _group_block(
            dbias_ptr, T, h, g, n, R, BLOCK_R, BLOCK_T, 2 * BLOCK_N2, PLAIN)
        dpq = tl.zeros((BLOCK_R, BLOCK_T, PLAIN), dtype=tl.float32)
        dpk = tl.zeros((BLOCK_R, BLOCK_T, PLAIN), dtype=tl.float32)
    k_part = k_part_stride.to(tl.int64)                            # from q's partials to k's
    dtheta_ptr += tl.program_id(2).to(tl.int64) * T * h * a        # this rank block's dθ
    for j in tl.range(0, e, num_stages=LOOP_STAGES):               # the group's heads, in order
        hd = grp * e + j
        th_off = (pos[:, None] * h + hd) * a + offs_i[None, :]
        th = tl.load(theta_ptr + th_off, mask=mask_a, other=0.0)
        cos = tl.cos(th)[None, :, :]                               # once for q, k and every rank
        sin = tl.sin(th)[None, :, :]
        dst = (rows * h + hd) * n + offs_c[None, None, :]
        bias_off = (hd * R + offs_r[:, None]) * n + offs_c[None, :]
        qt = xq.to(tl.float32) + tl.load(q_bias_ptr + bias_off, mask=mask_rc, other=0.0)[:, None, :]   # q̃
        hq, dth = _turn_back(dq_out_ptr, dst, qt, mask, cos, sin, BLOCK_R, BLOCK_T, BLOCK_N2)
        tl.store(part + hd * R * n, tl.sum(hq, axis=1), mask=mask_rc)   # padding rows are 0 (masked loads)
        dxq += hq
        kt = xk.to(tl.float32) + tl.load(k_bias_ptr + bias_off, mask=mask_rc, other=0.0)[:, None, :]   # k̃
        hk, dth_k = _turn_back(dk_out_ptr, dst, kt, mask, cos, sin, BLOCK_R, BLOCK_T, BLOCK_N2)
        tl.store(part + k_part + hd * R * n, tl.sum(hk, axis=1), mask=mask_rc)
        dxk += hk
        tl.store(dtheta_ptr + th_off, dth + dth_k, mask=mask_a)   # written once: no read-modify-write
        if PLAIN > 0:
            dstp = (rows * h + hd) * n + offs_cp[None, None, :]
            pq = tl.load(dq_out_ptr + dstp, mask=maskp, other=0.0).to(tl.float32)
            tl.store(partp + hd * R * n, tl.sum(pq, axis=1), mask=mask_rcp)
            dpq += pq
            pk = tl.load(dk_out_ptr + dstp, mask=maskp, other=0.0).to(tl.float32)
            tl.store(partp + k_part + hd * R * n, tl.sum(pk, axis=1), mask=mask_rcp)
            dpk += pk
    tl.store(dq_ptr + src, dxq, mask=mask)
    tl.store(dk_ptr + src, dxk, mask=mask)
    if PLAIN > 0:
        tl.store(dq_ptr + srcp, dpq, mask=maskp)
        tl.store(dk_ptr + srcp, dpk, mask=maskp)


# r > 1: a backward program per rank (module docstring); False: every rank in one tile
# (r = 4: 1.31 ms against 1.84 with every rank in one tile; benchmarks/results/README.md, 2026-12-01)
RANK_PROGRAMS = True


def rank_blocks(r):
    """Rank blocks of the backward's grid: r at r > 1 (a program per rank, tiles of r = 1's shape, dθ's terms
    folded over ranks afterwards), else 1."""
    return r if r > 1 and RANK_PROGRAMS else 1


def rotary_qk_bwd(dq_out, dk_out, q, k, q_bias, k_bias, theta):
    """Launch the backward. dq_out, dk_out: dq̂, dk̂ (b, l, r, h, n) contiguous, any float dtype (the scan's
    gradients are read as they are); q, k, q_bias, k_bias, theta: the forward's inputs
    -> (dq, dk (b, l, r, g, n) fp32, dq_bias, dk_bias (h, r, n) fp32, dtheta (b, l, h, a) fp32)."""
    b, l, r, g, n = q.shape
    h, a = q_bias.shape[0], theta.shape[-1]
    T = b * l
    ranks = rank_blocks(r)
    block_r, block_t = tiles(r // ranks)
    blocks = triton.cdiv(T, block_t)
    f32 = dict(device=q.device, dtype=torch.float32)
    dq, dk = torch.empty(b, l, r, g, n, **f32), torch.empty(b, l, r, g, n, **f32)
    partials = torch.empty(2, blocks, h, r, n, **f32)   # dbias partials, q's and k's, folded in one pass
    k_stride = partials.stride(0)
    dtheta = torch.empty(ranks, b, l, h, a, **f32)
    tile = dict(R=r, BLOCK_R=block_r, BLOCK_T=block_t)
    rotary_qk_bwd_kernel[(blocks, g, ranks)](
        q, k, q_bias, k_bias, theta, dq_out, dk_out, dq, dk, partials, dtheta, T, h, g, n, a, k_stride, **tile,
        **turned_and_plain(n, a, r // ranks), LOOP_STAGES=bwd_loop_stages(r // ranks),
        num_warps=BWD_NUM_WARPS)
    dbias = sum_partials(partials, dim=1)                         # (2, h, r, n): q's, k's
    return dq, dk, dbias[0], dbias[1], dtheta[0] if ranks == 1 else sum_partials(dtheta, dim=0)
