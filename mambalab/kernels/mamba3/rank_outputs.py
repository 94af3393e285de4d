"""Mamba-3's output stage, fused: the gate and the sum over ranks.

Math (per position t and head h; y_r is the rank-expanded scan's output for rank r, the within-step correction
and D x_r already in it, :mod:`mambalab.kernels.mamba3.chunk_scan`):

    s_r = silu(z ⊙ W^Z_r)                    (1 without z)
    out = Σ_r W^O_r ⊙ y_r ⊙ s_r              (SISO: no W, R = 1: out = y ⊙ silu(z))

so one pass reads y and z and writes out, where PyTorch would make a pass per operation. Backward, from dout:

    dy_r   = dout ⊙ W^O_r ⊙ s_r                                    (for the scan's backward)
    dz     = Σ_r dout ⊙ W^O_r ⊙ y_r ⊙ silu'(z ⊙ W^Z_r) ⊙ W^Z_r
    dW^O_r = Σ_t dout ⊙ y_r ⊙ s_r,   dW^Z_r = Σ_t dout ⊙ W^O_r ⊙ y_r ⊙ silu'(z ⊙ W^Z_r) ⊙ z

The sums over positions for dW^O and dW^Z are per-program partials folded by
:func:`mambalab.kernels.reduce.sum_partials` (a fixed order, no atomics); everything else stays inside a
program. The within-step correction (M_r = Σ_{r'} c_{r,r'} W^V_{r'} + D W^V_r) is formed in the scan's
same-step block, where its R² sums per rank cost nothing extra, not here
(formed per tile here: this stage's backward 1.02 ms against 0.52; benchmarks/results/README.md, 2026-12-01).

Tile rule (shape only): programs are (block of BLOCK_T = 32 positions of the flattened b·l axis, head), each
with the whole head dimension (BLOCK_P = next_pow2(p)). Warps: the forward 8 from r = 4 on, else 4; the
backward 4 up to r = 4, 8 at r = 8 (2026-11-30_h200_mamba3_output_tiles_sweep.json). The loop over ranks is
unrolled, so registers grow with r (at r = 4, p = 64: 74 a thread forward, 168 backward, no spills, from
`benchmarks/ptxas_ssd.py --op mamba3 --rank 4`; benchmarks/results/README.md, 2026-11-30).

Shapes: y (T, r, h, p) (the rank-expanded scan's output, T = b·l); z, out (T, h, p); W^Z, W^O (h, r, p) fp32.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from mambalab.kernels.reduce import sum_partials

BLOCK_T = 32


def num_warps(r: int, backward: bool = False) -> int:
    """Warps a program, from the rank alone (see the module docstring)."""
    if backward:
        return 8 if r > 4 else 4
    return 8 if r >= 4 else 4


@triton.jit
def program_tile(x_ptr, pid_t, hd, T, h, p, BLOCK_T: tl.constexpr, BLOCK_P: tl.constexpr, LOAD: tl.constexpr = True):
    """A program's positions and head dimensions, their masks and offsets into (T, h, p), and its tile of x
    (T, h, p) in fp32 (zeros without ``LOAD``). Also the tile of :mod:`mambalab.kernels.mamba3.rank_inputs`."""
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_p = tl.arange(0, BLOCK_P)
    mask_p = offs_p < p
    mask = (offs_t < T)[:, None] & mask_p[None, :]
    rows = offs_t[:, None].to(tl.int64)
    hp = (rows * h + hd) * p + offs_p[None, :]
    x = tl.zeros((BLOCK_T, BLOCK_P), dtype=tl.float32)
    if LOAD:
        x = tl.load(x_ptr + hp, mask=mask, other=0.0).to(tl.float32)
    return rows, offs_p, mask_p, mask, hp, x


@triton.jit
def _row(w_ptr, hd, r, p, offs_p, mask_p, R: tl.constexpr):
    """W_r of a head, (h, R, p) fp32, as a (1, BLOCK_P) row."""
    return tl.load(w_ptr + (hd * R + r) * p + offs_p, mask=mask_p, other=0.0)[None, :]


@triton.jit
def _rank_terms(y_ptr, z, wz_ptr, wo_ptr, rows, offs_p, mask, mask_p, hd, h, p, r, R: tl.constexpr,
                MIMO: tl.constexpr):
    """For rank r: y_r, σ(z W^Z_r), z W^Z_r (BLOCK_T, BLOCK_P); W^O_r, W^Z_r as (1, BLOCK_P) rows ((1, 1) ones
    for SISO). All fp32."""
    y = tl.load(y_ptr + ((rows * R + r) * h + hd) * p + offs_p[None, :], mask=mask, other=0.0).to(tl.float32)
    if MIMO:
        wz = _row(wz_ptr, hd, r, p, offs_p, mask_p, R)
        wo = _row(wo_ptr, hd, r, p, offs_p, mask_p, R)
    else:
        wz = tl.full((1, 1), 1.0, tl.float32)
        wo = tl.full((1, 1), 1.0, tl.float32)
    zr = z * wz
    return y, tl.sigmoid(zr), zr, wo, wz


@triton.jit
def rank_outputs_fwd_kernel(
    y_ptr,            # (T, r, h, p) scan output per rank
    z_ptr,            # (T, h, p) gate, or a dummy
    wz_ptr, wo_ptr,   # (h, r, p) fp32, or dummies (SISO; W^Z without a gate)
    out_ptr,          # (T, h, p) out
    T, h, p,
    R: tl.constexpr, MIMO: tl.constexpr, HAS_Z: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_P: tl.constexpr,
):
    pid_t = tl.program_id(0)
    hd = tl.program_id(1)
    rows, offs_p, mask_p, mask, hp, z = program_tile(z_ptr, pid_t, hd, T, h, p, BLOCK_T, BLOCK_P, HAS_Z)
    out = tl.zeros((BLOCK_T, BLOCK_P), dtype=tl.float32)
    for r in tl.static_range(R):
        y, sig, zr, wo, wz = _rank_terms(y_ptr, z, wz_ptr, wo_ptr, rows, offs_p, mask, mask_p, hd, h, p, r, R, MIMO)
        if HAS_Z:
            y = y * zr * sig
        out += wo * y
    tl.store(out_ptr + hp, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def rank_outputs_bwd_kernel(
    y_ptr, z_ptr, wz_ptr, wo_ptr,   # the forward's inputs
    dout_ptr,         # (T, h, p)
    dy_ptr,           # (T, r, h, p) out, y's dtype
    dz_ptr,           # (T, h, p) out, z's dtype (or a dummy)
    dwz_ptr, dwo_ptr,   # (programs along T, h, r, p) fp32 out: partials (or dummies)
    T, h, p,
    R: tl.constexpr, MIMO: tl.constexpr, HAS_Z: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_P: tl.constexpr,
):
    pid_t = tl.program_id(0)
    hd = tl.program_id(1)
    rows, offs_p, mask_p, mask, hp, z = program_tile(z_ptr, pid_t, hd, T, h, p, BLOCK_T, BLOCK_P, HAS_Z)
    dout = tl.load(dout_ptr + hp, mask=mask, other=0.0).to(tl.float32)
    dz = tl.zeros((BLOCK_T, BLOCK_P), dtype=tl.float32)
    for r in tl.static_range(R):
        y, sig, zr, wo, wz = _rank_terms(y_ptr, z, wz_ptr, wo_ptr, rows, offs_p, mask, mask_p, hd, h, p, r, R, MIMO)
        g = dout * wo
        dy = g
        gated = y
        if HAS_Z:
            dy = g * zr * sig
            gated = y * zr * sig
            dzr = g * y * sig * (1.0 + zr * (1.0 - sig))         # silu'(x) = σ(x)(1 + x(1 - σ(x)))
            dz += dzr * wz
        tl.store(dy_ptr + ((rows * R + r) * h + hd) * p + offs_p[None, :], dy.to(dy_ptr.dtype.element_ty), mask=mask)
        if MIMO:
            part = ((pid_t * h + hd) * R + r) * p + offs_p
            tl.store(dwo_ptr + part, tl.sum(dout * gated, axis=0), mask=mask_p)
            if HAS_Z:
                tl.store(dwz_ptr + part, tl.sum(dzr * z, axis=0), mask=mask_p)
    if HAS_Z:
        tl.store(dz_ptr + hp, dz.to(dz_ptr.dtype.element_ty), mask=mask)


def _launch_args(y, z, wz, wo):
    T, r, h, p = y.shape
    mimo = wo is not None
    if (r > 1) != mimo or r & (r - 1) or (wz is not None) != (mimo and z is not None):
        raise ValueError(f"rank outputs take W^O exactly when r > 1 (a power of two), and W^Z exactly when W^O and "
                         f"z are given; got r = {r}, W^O {'given' if mimo else 'absent'}, W^Z "
                         f"{'given' if wz is not None else 'absent'}, z {'given' if z is not None else 'absent'}")
    return T, r, h, p, (triton.cdiv(T, BLOCK_T), h), max(16, triton.next_power_of_2(p)), mimo


def rank_outputs_fwd(y, z, wz, wo):
    """Launch the forward. y (T, r, h, p); z (T, h, p) or None; wz, wo (h, r, p) fp32 (MIMO; wz None without z)
    or None (SISO). All contiguous. Returns out (T, h, p) in y's dtype."""
    T, r, h, p, grid, block_p, mimo = _launch_args(y, z, wz, wo)
    out = torch.empty(T, h, p, device=y.device, dtype=y.dtype)
    or_dummy = lambda t: t if t is not None else out
    rank_outputs_fwd_kernel[grid](
        y, or_dummy(z), or_dummy(wz), or_dummy(wo), out, T, h, p,
        R=r, MIMO=mimo, HAS_Z=z is not None, BLOCK_T=BLOCK_T, BLOCK_P=block_p, num_warps=num_warps(r))
    return out


def rank_outputs_bwd(dout, y, z, wz, wo):
    """Launch the backward (dout (T, h, p) contiguous; the rest as for :func:`rank_outputs_fwd`). Returns (dy
    like y, dz like z or None, dwz, dwo (h, r, p) fp32 or None where their input is None): dz summed in fp32 and
    written once in z's dtype; dwz, dwo folded over position blocks."""
    T, r, h, p, grid, block_p, mimo = _launch_args(y, z, wz, wo)
    f32 = dict(device=y.device, dtype=torch.float32)
    dy = torch.empty_like(y)
    dz = torch.empty_like(z) if z is not None else None
    blocks = grid[0]
    dwo = torch.empty(blocks, h, r, p, **f32) if mimo else None
    dwz = torch.empty(blocks, h, r, p, **f32) if wz is not None else None
    or_dummy = lambda t: t if t is not None else dy
    rank_outputs_bwd_kernel[grid](
        y, or_dummy(z), or_dummy(wz), or_dummy(wo), dout, dy, or_dummy(dz), or_dummy(dwz), or_dummy(dwo),
        T, h, p, R=r, MIMO=mimo, HAS_Z=z is not None, BLOCK_T=BLOCK_T, BLOCK_P=block_p,
        num_warps=num_warps(r, backward=True))
    fold = lambda t: sum_partials(t, dim=0) if t is not None else None
    return dy, dz, fold(dwz), fold(dwo)
