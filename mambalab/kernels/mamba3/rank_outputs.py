"""Mamba-3's output stage, fused: the within-step correction and D skip, the gate, and the sum over ranks.

Math (per position t and head h; y_r is the rank-expanded SSD's output for rank r, v the raw input):

    pre_r = y_r + v ⊙ M_r                    M_r = Σ_{r'} c_{r,r'} (q̂_r·k̂_r') W^V_{r'} + D W^V_r  (the op forms M)
    s_r   = silu(z ⊙ W^Z_r)                  (1 without z)
    out   = Σ_r W^O_r ⊙ pre_r ⊙ s_r          (SISO: no W, R = 1)

so one pass reads y, v, z and writes out, where PyTorch would make a pass per operation. M is (T, h, r, p)
for MIMO; for SISO it is one scalar per position and head, (T, h, 1) (c_{0,0} q̂·k̂ + D).

Backward, from dout:

    dy_r = dout ⊙ W^O_r ⊙ s_r                              (for the SSD's backward)
    dM_r = dy_r ⊙ v   (SISO: Σ_p of it)          dv = Σ_r dy_r ⊙ M_r
    dz   = Σ_r dout ⊙ W^O_r ⊙ pre_r ⊙ silu'(z ⊙ W^Z_r) ⊙ W^Z_r
    dW^O_r = Σ_t dout ⊙ pre_r ⊙ s_r,   dW^Z_r = Σ_t dout ⊙ W^O_r ⊙ pre_r ⊙ silu'(z W^Z_r) ⊙ z

The sums over positions for dW^O and dW^Z are per-program partials folded by
:func:`mambalab.kernels.reduce.sum_partials`; everything else stays inside a program.

Tile rule (shape only): programs are (block of BLOCK_T = 32 positions of the flattened b·l axis, head), each
with the whole head dimension (BLOCK_P = next_pow2(p)); 8 warps from r = 4 on (the loop over ranks is
unrolled: at r = 4, p = 64 with 4 warps the backward spills 36 B on sm_90 and takes 255 registers a thread,
with 8 none; benchmarks/ptxas_ssd.py --op mamba3 --rank 4, which compiles as a launch would, pointers and
sizes marked divisible by 16), else 4.

Shapes: y (T, r, h, p) (the rank-expanded SSD output, T = b·l); v, z, out (T, h, p); M (T, h, r, p) or
(T, h, 1) fp32; W^Z, W^O (h, r, p) fp32.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from mambalab.kernels.reduce import sum_partials

BLOCK_T = 32


def num_warps(r: int) -> int:
    """Warps a program, from the rank alone (see the module docstring)."""
    return 8 if r >= 4 else 4


@triton.jit
def _program_tile(v_ptr, z_ptr, pid_t, hd, T, h, p, HAS_Z: tl.constexpr, BLOCK_T: tl.constexpr,
                  BLOCK_P: tl.constexpr):
    """A program's positions and head dimensions, their masks and offsets into (T, h, p), and its v and z
    tiles in fp32 (z = 0 without a gate)."""
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_p = tl.arange(0, BLOCK_P)
    mask_p = offs_p < p
    mask_t = (offs_t < T)[:, None]
    mask = mask_t & mask_p[None, :]
    rows = offs_t[:, None].to(tl.int64)
    hp = (rows * h + hd) * p + offs_p[None, :]
    v = tl.load(v_ptr + hp, mask=mask, other=0.0).to(tl.float32)
    z = tl.zeros((BLOCK_T, BLOCK_P), dtype=tl.float32)
    if HAS_Z:
        z = tl.load(z_ptr + hp, mask=mask, other=0.0).to(tl.float32)
    return offs_t, rows, offs_p, mask_p, mask_t, mask, hp, v, z


@triton.jit
def _rank_terms(y_ptr, v, z, M_ptr, wz_ptr, wo_ptr, rows, offs_p, mask, mask_t, mask_p, hd, h, p, r,
                R: tl.constexpr, MIMO: tl.constexpr):
    """For rank r: pre_r, σ(z W^Z_r), z W^Z_r (BLOCK_T, BLOCK_P); W^O_r, W^Z_r as (1, BLOCK_P) rows ((1, 1)
    ones for SISO); M_r ((BLOCK_T, BLOCK_P), or (BLOCK_T, 1) for SISO). All fp32."""
    y = tl.load(y_ptr + ((rows * R + r) * h + hd) * p + offs_p[None, :], mask=mask, other=0.0).to(tl.float32)
    if MIMO:
        M = tl.load(M_ptr + ((rows * h + hd) * R + r) * p + offs_p[None, :], mask=mask, other=0.0)
        wz = tl.load(wz_ptr + (hd * R + r) * p + offs_p, mask=mask_p, other=0.0)[None, :]
        wo = tl.load(wo_ptr + (hd * R + r) * p + offs_p, mask=mask_p, other=0.0)[None, :]
    else:
        M = tl.load(M_ptr + rows * h + hd, mask=mask_t, other=0.0)                       # (BLOCK_T, 1)
        wz = tl.full((1, 1), 1.0, tl.float32)
        wo = tl.full((1, 1), 1.0, tl.float32)
    pre = y + v * M
    zr = z * wz
    sig = tl.sigmoid(zr)
    return pre, sig, zr, wo, wz, M


@triton.jit
def rank_outputs_fwd_kernel(
    y_ptr,            # (T, r, h, p) SSD output per rank
    v_ptr,            # (T, h, p) raw v
    z_ptr,            # (T, h, p) gate, or a dummy
    M_ptr,            # (T, h, r, p) fp32 (MIMO) or (T, h, 1) fp32 (SISO)
    wz_ptr, wo_ptr,   # (h, r, p) fp32, or dummies (SISO)
    out_ptr,          # (T, h, p) out
    T, h, p,
    R: tl.constexpr, MIMO: tl.constexpr, HAS_Z: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_P: tl.constexpr,
):
    pid_t = tl.program_id(0)
    hd = tl.program_id(1)
    offs_t, rows, offs_p, mask_p, mask_t, mask, hp, v, z = _program_tile(v_ptr, z_ptr, pid_t, hd, T, h, p, HAS_Z,
                                                                          BLOCK_T, BLOCK_P)
    out = tl.zeros((BLOCK_T, BLOCK_P), dtype=tl.float32)
    for r in tl.static_range(R):
        pre, sig, zr, wo, wz, M = _rank_terms(y_ptr, v, z, M_ptr, wz_ptr, wo_ptr, rows, offs_p, mask, mask_t,
                                              mask_p, hd, h, p, r, R, MIMO)
        if HAS_Z:
            pre = pre * zr * sig
        out += wo * pre
    tl.store(out_ptr + hp, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def rank_outputs_bwd_kernel(
    y_ptr, v_ptr, z_ptr, M_ptr, wz_ptr, wo_ptr,   # the forward's inputs
    dout_ptr,         # (T, h, p)
    dy_ptr,           # (T, r, h, p) out, y's dtype
    dv_ptr,           # (T, h, p) out, v's dtype
    dz_ptr,           # (T, h, p) out, z's dtype (or a dummy)
    dM_ptr,           # like M, fp32 out
    dwz_ptr, dwo_ptr,  # (programs along T, h, r, p) fp32 out: partials (or dummies)
    T, h, p,
    R: tl.constexpr, MIMO: tl.constexpr, HAS_Z: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_P: tl.constexpr,
):
    pid_t = tl.program_id(0)
    hd = tl.program_id(1)
    offs_t, rows, offs_p, mask_p, mask_t, mask, hp, v, z = _program_tile(v_ptr, z_ptr, pid_t, hd, T, h, p, HAS_Z,
                                                                          BLOCK_T, BLOCK_P)
    dout = tl.load(dout_ptr + hp, mask=mask, other=0.0).to(tl.float32)
    dv = tl.zeros((BLOCK_T, BLOCK_P), dtype=tl.float32)
    dz = tl.zeros((BLOCK_T, BLOCK_P), dtype=tl.float32)
    for r in tl.static_range(R):
        pre, sig, zr, wo, wz, M = _rank_terms(y_ptr, v, z, M_ptr, wz_ptr, wo_ptr, rows, offs_p, mask, mask_t,
                                              mask_p, hd, h, p, r, R, MIMO)
        g = dout * wo
        dpre = g
        gated = pre
        if HAS_Z:
            dpre = g * zr * sig
            gated = pre * zr * sig
            dzr = g * pre * sig * (1.0 + zr * (1.0 - sig))         # silu'(x) = σ(x)(1 + x(1 - σ(x)))
            dz += dzr * wz
        tl.store(dy_ptr + ((rows * R + r) * h + hd) * p + offs_p[None, :],
                 dpre.to(dy_ptr.dtype.element_ty), mask=mask)
        dv += dpre * M
        if MIMO:
            tl.store(dM_ptr + ((rows * h + hd) * R + r) * p + offs_p[None, :], dpre * v, mask=mask)
            part = ((pid_t * h + hd) * R + r) * p + offs_p
            tl.store(dwo_ptr + part, tl.sum(dout * gated, axis=0), mask=mask_p)
            if HAS_Z:
                tl.store(dwz_ptr + part, tl.sum(dzr * z, axis=0), mask=mask_p)
        else:
            tl.store(dM_ptr + offs_t * h + hd, tl.sum(dpre * v, axis=1), mask=offs_t < T)
    tl.store(dv_ptr + hp, dv.to(dv_ptr.dtype.element_ty), mask=mask)
    if HAS_Z:
        tl.store(dz_ptr + hp, dz.to(dz_ptr.dtype.element_ty), mask=mask)


def _launch_args(y, M):
    T, r, h, p = y.shape
    return T, r, h, p, (triton.cdiv(T, BLOCK_T), h), max(16, triton.next_power_of_2(p)), M.dim() == 4


def rank_outputs_fwd(y, v, z, M, wz, wo):
    """Launch the forward. y (T, r, h, p); v, z (T, h, p); M (T, h, r, p) (MIMO) or (T, h, 1) (SISO) fp32;
    wz, wo (h, r, p) fp32 (MIMO; wz None without z) or None (SISO). All contiguous. Returns out (T, h, p) in
    v's dtype."""
    T, r, h, p, grid, block_p, mimo = _launch_args(y, M)
    out = torch.empty_like(v)
    rank_outputs_fwd_kernel[grid](
        y, v, z if z is not None else v, M, wz if wz is not None else M, wo if wo is not None else M, out, T, h, p,
        R=r, MIMO=mimo, HAS_Z=z is not None, BLOCK_T=BLOCK_T, BLOCK_P=block_p, num_warps=num_warps(r))
    return out


def rank_outputs_bwd(dout, y, v, z, M, wz, wo):
    """Launch the backward (dout (T, h, p) contiguous). Returns (dy like y, dv like v, dz like z or None,
    dM like M, dwz or None, dwo or None): dv and dz summed in fp32 and written once in their input's dtype
    (what autograd would cast them to), dM, dwz, dwo fp32; dwz, dwo (h, r, p) folded over position blocks."""
    T, r, h, p, grid, block_p, mimo = _launch_args(y, M)
    f32 = dict(device=y.device, dtype=torch.float32)
    dy = torch.empty_like(y)
    dv = torch.empty_like(v)
    dz = torch.empty_like(z) if z is not None else None
    dM = torch.empty_like(M)
    blocks = grid[0]
    dwo = torch.empty(blocks, h, r, p, **f32) if mimo else None
    dwz = torch.empty(blocks, h, r, p, **f32) if mimo and z is not None else None
    rank_outputs_bwd_kernel[grid](
        y, v, z if z is not None else v, M, wz if wz is not None else M, wo if wo is not None else M, dout,
        dy, dv, dz if dz is not None else dv, dM, dwz if dwz is not None else dM, dwo if dwo is not None else dM,
        T, h, p, R=r, MIMO=mimo, HAS_Z=z is not None, BLOCK_T=BLOCK_T, BLOCK_P=block_p, num_warps=num_warps(r))
    dwo = sum_partials(dwo, dim=0) if dwo is not None else None
    dwz = sum_partials(dwz, dim=0) if dwz is not None else None
    return dy, dv, dz, dM, dwz, dwo
