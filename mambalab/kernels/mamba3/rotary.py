"""Mamba-3's q̂ and k̂: per-head bias and rotation by the cumulative angle, forward and backward.

Math (per position t, rank r, head h reading group γ(h) = h // (H / g); pairs i < a turn, the rest do not):

    x̃ = x[t, r, γ(h)] + bias[h, r]                              (n,)
    out[t, r, h, 2i]   = x̃_{2i} cos θ[t, h, i] - x̃_{2i+1} sin θ[t, h, i]
    out[t, r, h, 2i+1] = x̃_{2i} sin θ[t, h, i] + x̃_{2i+1} cos θ[t, h, i]

Backward, from dout (the rotation is orthogonal, so its transpose turns back by -θ):

    dx̃ = Rot(-θ) dout,   dx[t, r, g] = Σ_{h in group g} dx̃,   dbias[h, r] = Σ_t dx̃
    dθ[t, h, i] = Σ_r (dout_{2i+1} out_{2i} - dout_{2i} out_{2i+1})     (added to a given dθ: q̂'s to k̂'s)

The sum over a group's heads and over ranks stays inside a program (heads in order); the sum over positions
for dbias is a reduction across programs: per-program partials folded by
:func:`mambalab.kernels.reduce.sum_partials` (never atomics).

The output is written in the rank-expanded layout the SSD kernels read: (b, l, r, h, n) is (b, l·r, h, n).

Tile rule (shape only): BLOCK_T = 32 positions of the flattened (b·l) axis per program, BLOCK_N2 =
next_pow2(n / 2) pairs; rows of n are read and written whole (contiguous, vectorised) and split into their
pairs in registers (the earlier pair-strided version took 1.1 ms per call at b4 l4096 h32 n128 in an H200
profile); forward programs are (position block, head), backward programs (position block, group), the
backward with 8 warps from r = 4 on, else 4. (8 was chosen when the pair-strided version spilled at 4. The
row version, compiled for sm_90 at r = 4, n = 128, spills nothing at 4 warps and 176 B at 8, the figure
benchmarks/ptxas_ssd.py --op mamba3 --rank 4 reports: the rule is to re-time on a GPU.)

Shapes: x (b, l, r, g, n) contiguous; bias (h, r, n) fp32; theta (b, l, h, a) fp32 -> out (b, l, r, h, n).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from mambalab.kernels.reduce import sum_partials

BLOCK_T = 32


@triton.jit
def _pairs(rows, BLOCK_T: tl.constexpr, BLOCK_N2: tl.constexpr):
    """(BLOCK_T, 2·BLOCK_N2) rows read contiguously -> their even and odd elements, each (BLOCK_T, BLOCK_N2)."""
    return tl.split(tl.reshape(rows, (BLOCK_T, BLOCK_N2, 2)))


@triton.jit
def _rows(even, odd, BLOCK_T: tl.constexpr, BLOCK_N2: tl.constexpr):
    """The inverse of :func:`_pairs`: interleave even and odd elements back into (BLOCK_T, 2·BLOCK_N2) rows."""
    return tl.reshape(tl.join(even, odd), (BLOCK_T, 2 * BLOCK_N2))


@triton.jit
def rotary_fwd_kernel(
    x_ptr,            # (T, r, g, n) T = b·l positions
    bias_ptr,         # (h, r, n) fp32
    theta_ptr,        # (T, h, a) fp32
    out_ptr,          # (T, r, h, n) out
    T, h, g, n, a,
    R: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N2: tl.constexpr,
):
    pid_t = tl.program_id(0)
    hd = tl.program_id(1)
    grp = hd // (h // g)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_i = tl.arange(0, BLOCK_N2)                  # pairs
    offs_c = tl.arange(0, 2 * BLOCK_N2)              # elements of a row: pair c // 2
    mask_t = offs_t < T
    mask = mask_t[:, None] & (offs_c < n)[None, :]
    rows = offs_t[:, None].to(tl.int64)
    # pairs past a (and padding) load θ = 0: cos 1, sin 0, they pass unturned
    th = tl.load(theta_ptr + (rows * h + hd) * a + offs_i[None, :], mask=mask_t[:, None] & (offs_i < a)[None, :],
                 other=0.0)
    cos = tl.cos(th)
    sin = tl.sin(th)
    for r in tl.static_range(R):
        # whole rows, read and written contiguously; the pairs are split apart in registers
        x = tl.load(x_ptr + ((rows * R + r) * g + grp) * n + offs_c[None, :], mask=mask, other=0.0).to(tl.float32)
        x += tl.load(bias_ptr + (hd * R + r) * n + offs_c, mask=offs_c < n, other=0.0)[None, :]
        x0, x1 = _pairs(x, BLOCK_T, BLOCK_N2)
        out = _rows(x0 * cos - x1 * sin, x0 * sin + x1 * cos, BLOCK_T, BLOCK_N2)
        tl.store(out_ptr + ((rows * R + r) * h + hd) * n + offs_c[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=mask)


def rotary_fwd(x, bias, theta, out_dtype):
    """Launch the forward. x (b, l, r, g, n) contiguous; bias (h, r, n) fp32; theta (b, l, h, a) fp32
    -> (b, l, r, h, n) in ``out_dtype``."""
    b, l, r, g, n = x.shape
    h, a = bias.shape[0], theta.shape[-1]
    out = torch.empty(b, l, r, h, n, device=x.device, dtype=out_dtype)
    T = b * l
    rotary_fwd_kernel[(triton.cdiv(T, BLOCK_T), h)](
        x, bias, theta, out, T, h, g, n, a,
        R=r, BLOCK_T=BLOCK_T, BLOCK_N2=triton.next_power_of_2(max(n // 2, 1)))
    return out


@triton.jit
def rotary_bwd_kernel(
    x_ptr,            # (T, r, g, n) the forward's input
    bias_ptr,         # (h, r, n) fp32
    theta_ptr,        # (T, h, a) fp32
    dout_ptr,         # (T, r, h, n)
    dx_ptr,           # (T, r, g, n) fp32 out
    dbias_ptr,        # (programs along T, h, r, n) fp32 out: partials
    dtheta_ptr,       # (T, h, a) fp32 out (with ACCUMULATE: in and out)
    T, h, g, n, a,
    R: tl.constexpr, ACCUMULATE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N2: tl.constexpr,
):
    pid_t = tl.program_id(0)
    grp = tl.program_id(1)
    e = h // g                                                     # heads per group
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_i = tl.arange(0, BLOCK_N2)
    offs_c = tl.arange(0, 2 * BLOCK_N2)
    mask_t = offs_t < T
    mask_c = offs_c < n
    mask = mask_t[:, None] & mask_c[None, :]
    mask_a = mask_t[:, None] & (offs_i < a)[None, :]
    rows = offs_t[:, None].to(tl.int64)
    for r in tl.static_range(R):
        src = ((rows * R + r) * g + grp) * n + offs_c[None, :]
        xr = tl.load(x_ptr + src, mask=mask, other=0.0).to(tl.float32)
        dx = tl.zeros((BLOCK_T, 2 * BLOCK_N2), dtype=tl.float32)
        for j in range(0, e):                                      # the group's heads, in order
            hd = grp * e + j
            th_off = (rows * h + hd) * a + offs_i[None, :]
            th = tl.load(theta_ptr + th_off, mask=mask_a, other=0.0)
            cos = tl.cos(th)
            sin = tl.sin(th)
            x0, x1 = _pairs(xr + tl.load(bias_ptr + (hd * R + r) * n + offs_c, mask=mask_c, other=0.0)[None, :],
                            BLOCK_T, BLOCK_N2)
            d = tl.load(dout_ptr + ((rows * R + r) * h + hd) * n + offs_c[None, :], mask=mask, other=0.0)
            d0, d1 = _pairs(d.to(tl.float32), BLOCK_T, BLOCK_N2)
            dth = d1 * (x0 * cos - x1 * sin) - d0 * (x0 * sin + x1 * cos)
            if r > 0 or ACCUMULATE:                                # ranks in order: add to the earlier ones
                dth += tl.load(dtheta_ptr + th_off, mask=mask_a, other=0.0)
            tl.store(dtheta_ptr + th_off, dth, mask=mask_a)
            hx = _rows(d0 * cos + d1 * sin, d1 * cos - d0 * sin, BLOCK_T, BLOCK_N2)   # Rot(-θ) dout: dx̃
            part = dbias_ptr + ((pid_t * h + hd) * R + r) * n + offs_c
            tl.store(part, tl.sum(hx, axis=0), mask=mask_c)        # padding rows are 0 (masked loads)
            dx += hx
        tl.store(dx_ptr + src, dx, mask=mask)


def rotary_bwd(dout, x, bias, theta, dtheta=None):
    """Launch the backward. dout (b, l, r, h, n) contiguous, any float dtype (the scan's fp32 gradient is read
    as it is); dtheta (b, l, h, a) fp32 contiguous to add this dθ into (the other of q̂, k̂), or None
    -> (dx (b, l, r, g, n) fp32, dbias (h, r, n) fp32, dtheta (b, l, h, a) fp32: the given one, or new)."""
    b, l, r, g, n = x.shape
    h, a = bias.shape[0], theta.shape[-1]
    T = b * l
    blocks = triton.cdiv(T, BLOCK_T)
    f32 = dict(device=x.device, dtype=torch.float32)
    dx = torch.empty(b, l, r, g, n, **f32)
    partials = torch.empty(blocks, h, r, n, **f32)
    accumulate = dtheta is not None
    dtheta = dtheta if accumulate else torch.empty(b, l, h, a, **f32)
    rotary_bwd_kernel[(blocks, g)](
        x, bias, theta, dout, dx, partials, dtheta, T, h, g, n, a,
        R=r, ACCUMULATE=accumulate, BLOCK_T=BLOCK_T, BLOCK_N2=triton.next_power_of_2(max(n // 2, 1)),
        num_warps=8 if r >= 4 else 4)
    return dx, sum_partials(partials, dim=0), dtheta
