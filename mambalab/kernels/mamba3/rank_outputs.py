"""Mamba-3's output stage, fused: the within-step correction and D skip, the gate, and the sum over ranks.

Math (per position t and head h; y_r is the rank-expanded SSD's output for rank r, v the raw input, c_{r,r'}
the within-step correction's coefficient times q̂_r·k̂_r', from the op):

    M_r   = Σ_{r'} c_{r,r'} W^V_{r'} + D W^V_r = Σ_{r'} c̃_{r,r'} W^V_{r'},    c̃_{r,r'} = c_{r,r'} + D [r' = r]
    pre_r = y_r + v ⊙ M_r
    s_r   = silu(z ⊙ W^Z_r)                  (1 without z)
    out   = Σ_r W^O_r ⊙ pre_r ⊙ s_r          (SISO: no W, R = 1)

so one pass reads y, v, z and writes out, where PyTorch would make a pass per operation. MIMO: the kernels
take c, W^V and D and form M_r for their tile in registers (R multiply-adds of a tile per rank), so nothing of
M's size (T, h, r, p) is ever written or read. SISO: M is one number per position and head, c_{0,0} q̂·k̂ + D,
which the op passes in c's place, D folded in (W^V ≡ 1; no W^V, no D here).

Backward, from dout (dM_r stays in registers):

    dy_r = dout ⊙ W^O_r ⊙ s_r                              (for the SSD's backward)
    dM_r = dy_r ⊙ v                                         dv = Σ_r dy_r ⊙ M_r
    dc_{r,r'} = Σ_p dM_r ⊙ W^V_{r'}                         (per position; SISO: dM = Σ_p dy ⊙ v)
    dW^V_{r'} = Σ_t Σ_r c̃_{r,r'} dM_r,   dD = Σ_t Σ_r dc_{r,r}
    dz   = Σ_r dout ⊙ W^O_r ⊙ pre_r ⊙ silu'(z ⊙ W^Z_r) ⊙ W^Z_r
    dW^O_r = Σ_t dout ⊙ pre_r ⊙ s_r,   dW^Z_r = Σ_t dout ⊙ W^O_r ⊙ pre_r ⊙ silu'(z W^Z_r) ⊙ z

The sums over positions for dW^V, dD, dW^O and dW^Z are per-program partials folded by
:func:`mambalab.kernels.reduce.sum_partials` (a fixed order, no atomics); everything else stays inside a
program. Inside one, dc is gathered into a (BLOCK_T, r·r') tile written once; dW^V's partial is a
(RJ, BLOCK_P) accumulator, RJ = max(16, r) (tl.dot's least size; rows r' >= r stay zero), that each rank adds
c̃_rᵀ dM_r to with one fp32 dot ("ieee": no tf32 rounding), in a fixed order.

Tile rule (shape only): programs are (block of BLOCK_T = 32 positions of the flattened b·l axis, head), each
with the whole head dimension (BLOCK_P = next_pow2(p)). Warps: the forward 8 from r = 4 on, else 4; the
backward 4 up to r = 4, 8 at r = 8. The loops over ranks (and over r' inside them) are unrolled, so registers
grow with r. sm_90, p = 64:

    r = 2 (4 warps)   forward 101 registers a thread, backward 248
    r = 4             forward 116 (8 warps); backward 255 and 16 B spilled (4 warps; 185 at 8 warps, no spill)
    r = 8 (8 warps)   forward 245, backward 198

The backward's 4 warps at r = 4 despite the spill: in an H200 sweep (session 7, call 2; T = 16384, h = 32,
bf16) it took 1.26 ms at 4 warps against 2.04 at 8 (one 8-warp program of 185 registers fills half an SM's
register file, too few warps in flight to hide its loads); BLOCK_T 16 or 64 were no faster at their best
warps (1.42, 1.33 ms). At r = 1 every tile in the sweep took 0.14 ms.

(benchmarks/ptxas_ssd.py --op mamba3 --rank R, which compiles as a launch would, pointers and sizes marked
divisible by 16). dW^V as r' tile accumulators instead of the dot took 254 registers at r = 4 and spilled 80 B
at r = 8.

Shapes: y (T, r, h, p) (the rank-expanded SSD output, T = b·l); v, z, out (T, h, p); c (T, h, r, r') fp32
(SISO: M as (T, h, 1, 1)); W^V, W^Z, W^O (h, r, p) fp32; D (h,) fp32.
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
def program_tile(v_ptr, z_ptr, pid_t, hd, T, h, p, HAS_Z: tl.constexpr, BLOCK_T: tl.constexpr,
                  BLOCK_P: tl.constexpr):
    """A program's positions and head dimensions, their masks and offsets into (T, h, p), and its v and z
    tiles in fp32 (z = 0 without a gate). Also the tile of :mod:`mambalab.kernels.mamba3.rank_inputs`."""
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
def _row(w_ptr, hd, r, p, offs_p, mask_p, R: tl.constexpr):
    """W_r of a head, (h, R, p) fp32, as a (1, BLOCK_P) row."""
    return tl.load(w_ptr + (hd * R + r) * p + offs_p, mask=mask_p, other=0.0)[None, :]


@triton.jit
def _mix_coef(coef_ptr, d, offs_t, T, hd, h, r, j, R: tl.constexpr, HAS_D: tl.constexpr):
    """c̃_{r,j} = c_{r,j} + D [j = r] at the program's positions, a (BLOCK_T, 1) column (loaded as a vector:
    one load a row, not one per element of the broadcast)."""
    c = tl.load(coef_ptr + ((offs_t.to(tl.int64) * h + hd) * R + r) * R + j, mask=offs_t < T, other=0.0)
    if HAS_D:
        if j == r:
            c += d
    return c[:, None]


@triton.jit
def _rank_terms(y_ptr, v, z, coef_ptr, wv_ptr, d, wz_ptr, wo_ptr, offs_t, rows, offs_p, mask, mask_t, mask_p, hd,
                T, h, p, r, R: tl.constexpr, MIMO: tl.constexpr, HAS_D: tl.constexpr):
    """For rank r: pre_r, σ(z W^Z_r), z W^Z_r (BLOCK_T, BLOCK_P); W^O_r, W^Z_r as (1, BLOCK_P) rows ((1, 1)
    ones for SISO); M_r: (BLOCK_T, BLOCK_P) formed as Σ_{r'} c̃_{r,r'} W^V_{r'} (MIMO, d = D of the head), or
    c read as it is, (BLOCK_T, 1) (SISO). All fp32."""
    y = tl.load(y_ptr + ((rows * R + r) * h + hd) * p + offs_p[None, :], mask=mask, other=0.0).to(tl.float32)
    if MIMO:
        M = tl.zeros_like(v)
        for j in tl.static_range(R):
            M += _mix_coef(coef_ptr, d, offs_t, T, hd, h, r, j, R, HAS_D) * _row(wv_ptr, hd, j, p, offs_p, mask_p, R)
        wz = _row(wz_ptr, hd, r, p, offs_p, mask_p, R)
        wo = _row(wo_ptr, hd, r, p, offs_p, mask_p, R)
    else:
        M = tl.load(coef_ptr + rows * h + hd, mask=mask_t, other=0.0)                    # (BLOCK_T, 1)
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
    coef_ptr,         # (T, h, r, r') fp32 c (MIMO) or (T, h, 1, 1) fp32 M (SISO)
    wv_ptr,           # (h, r, p) fp32 W^V, or a dummy (SISO)
    D_ptr,            # (h,) fp32, or a dummy (no D; SISO)
    wz_ptr, wo_ptr,   # (h, r, p) fp32, or dummies (SISO)
    out_ptr,          # (T, h, p) out
    T, h, p,
    R: tl.constexpr, MIMO: tl.constexpr, HAS_Z: tl.constexpr, HAS_D: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_P: tl.constexpr,
):
    pid_t = tl.program_id(0)
    hd = tl.program_id(1)
    offs_t, rows, offs_p, mask_p, mask_t, mask, hp, v, z = program_tile(v_ptr, z_ptr, pid_t, hd, T, h, p, HAS_Z,
                                                                          BLOCK_T, BLOCK_P)
    d = 0.0
    if HAS_D:
        d = tl.load(D_ptr + hd)
    out = tl.zeros((BLOCK_T, BLOCK_P), dtype=tl.float32)
    for r in tl.static_range(R):
        pre, sig, zr, wo, wz, M = _rank_terms(y_ptr, v, z, coef_ptr, wv_ptr, d, wz_ptr, wo_ptr, offs_t, rows, offs_p,
                                              mask, mask_t, mask_p, hd, T, h, p, r, R, MIMO, HAS_D)
        if HAS_Z:
            pre = pre * zr * sig
        out += wo * pre
    tl.store(out_ptr + hp, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def rank_outputs_bwd_kernel(
    y_ptr, v_ptr, z_ptr, coef_ptr, wv_ptr, D_ptr, wz_ptr, wo_ptr,   # the forward's inputs
    dout_ptr,         # (T, h, p)
    dy_ptr,           # (T, r, h, p) out, y's dtype
    dv_ptr,           # (T, h, p) out, v's dtype
    dz_ptr,           # (T, h, p) out, z's dtype (or a dummy)
    dcoef_ptr,        # like coef, fp32 out
    dwv_ptr, dwz_ptr, dwo_ptr,   # (programs along T, h, r, p) fp32 out: partials (or dummies)
    dD_ptr,           # (programs along T, h) fp32 out: partials (or a dummy)
    T, h, p,
    R: tl.constexpr, MIMO: tl.constexpr, HAS_Z: tl.constexpr, HAS_D: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_P: tl.constexpr, RJ: tl.constexpr,
):
    pid_t = tl.program_id(0)
    hd = tl.program_id(1)
    offs_t, rows, offs_p, mask_p, mask_t, mask, hp, v, z = program_tile(v_ptr, z_ptr, pid_t, hd, T, h, p, HAS_Z,
                                                                          BLOCK_T, BLOCK_P)
    dout = tl.load(dout_ptr + hp, mask=mask, other=0.0).to(tl.float32)
    d = 0.0
    if HAS_D:
        d = tl.load(D_ptr + hd)
    dv = tl.zeros((BLOCK_T, BLOCK_P), dtype=tl.float32)
    dz = tl.zeros((BLOCK_T, BLOCK_P), dtype=tl.float32)
    # MIMO: dW^V_{r'} (row r') summed over ranks and positions; dc_{r,r'} at column r·R + r'; Σ_r dc_{r,r}
    offs_j = tl.arange(0, RJ)
    dwv = tl.zeros((RJ, BLOCK_P), dtype=tl.float32)
    offs_rr = tl.arange(0, R * R)
    dc_all = tl.zeros((BLOCK_T, R * R), dtype=tl.float32)
    dd = tl.zeros((BLOCK_T,), dtype=tl.float32)
    for r in tl.static_range(R):
        pre, sig, zr, wo, wz, M = _rank_terms(y_ptr, v, z, coef_ptr, wv_ptr, d, wz_ptr, wo_ptr, offs_t, rows, offs_p,
                                              mask, mask_t, mask_p, hd, T, h, p, r, R, MIMO, HAS_D)
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
        dM = dpre * v
        if MIMO:
            for j in tl.static_range(R):
                dc = tl.sum(dM * _row(wv_ptr, hd, j, p, offs_p, mask_p, R), axis=1)            # dc_{r,j}
                dc_all = tl.where(offs_rr[None, :] == r * R + j, dc[:, None], dc_all)
                if HAS_D:
                    if j == r:
                        dd += dc
            c = tl.load(coef_ptr + ((rows * h + hd) * R + r) * R + offs_j[None, :],
                        mask=mask_t & (offs_j[None, :] < R), other=0.0)                      # c_{r,r'}, (BLOCK_T, RJ)
            if HAS_D:
                c += tl.where(offs_j[None, :] == r, d, 0.0)
            dwv = tl.dot(tl.trans(c), dM, dwv, input_precision="ieee")                       # += c̃_rᵀ dM_r
            part = ((pid_t * h + hd) * R + r) * p + offs_p
            tl.store(dwo_ptr + part, tl.sum(dout * gated, axis=0), mask=mask_p)
            if HAS_Z:
                tl.store(dwz_ptr + part, tl.sum(dzr * z, axis=0), mask=mask_p)
        else:
            tl.store(dcoef_ptr + offs_t * h + hd, tl.sum(dM, axis=1), mask=offs_t < T)
    tl.store(dv_ptr + hp, dv.to(dv_ptr.dtype.element_ty), mask=mask)
    if HAS_Z:
        tl.store(dz_ptr + hp, dz.to(dz_ptr.dtype.element_ty), mask=mask)
    if MIMO:
        tl.store(dcoef_ptr + (rows * h + hd) * (R * R) + offs_rr[None, :], dc_all, mask=mask_t)
        tl.store(dwv_ptr + ((pid_t * h + hd) * R + offs_j[:, None]) * p + offs_p[None, :], dwv,
                 mask=(offs_j[:, None] < R) & mask_p[None, :])
        if HAS_D:
            tl.store(dD_ptr + pid_t * h + hd, tl.sum(dd, axis=0))


def _launch_args(y, coef, wv, D):
    T, r, h, p = y.shape
    mimo = wv is not None
    if (r > 1) != mimo or (D is not None and not mimo) or coef.shape != (T, h, r, r) or r & (r - 1):
        raise ValueError(f"rank outputs take, for a power-of-two r > 1, c (T, h, r, r') = {(T, h, r, r)}, W^V and "
                         f"D or None; for r = 1, M (T, h, 1, 1) in c's place (D folded in) without W^V or D. Got r = "
                         f"{r}, c {tuple(coef.shape)}, W^V {'given' if mimo else 'absent'}, "
                         f"D {'given' if D is not None else 'absent'}")
    return T, r, h, p, (triton.cdiv(T, BLOCK_T), h), max(16, triton.next_power_of_2(p)), mimo


def rank_outputs_fwd(y, v, z, coef, wv, D, wz, wo):
    """Launch the forward. y (T, r, h, p); v, z (T, h, p); MIMO: coef (T, h, r, r'), wv (h, r, p), D (h,) or
    None, all fp32; SISO: coef = M (T, h, 1, 1) fp32 (D folded in), wv and D None. wz, wo (h, r, p) fp32
    (MIMO; wz None without z) or None (SISO). All contiguous. Returns out (T, h, p) in v's dtype."""
    T, r, h, p, grid, block_p, mimo = _launch_args(y, coef, wv, D)
    out = torch.empty_like(v)
    or_dummy = lambda t: t if t is not None else coef
    rank_outputs_fwd_kernel[grid](
        y, v, z if z is not None else v, coef, or_dummy(wv), or_dummy(D), or_dummy(wz), or_dummy(wo), out, T, h, p,
        R=r, MIMO=mimo, HAS_Z=z is not None, HAS_D=D is not None, BLOCK_T=BLOCK_T, BLOCK_P=block_p,
        num_warps=num_warps(r))
    return out


def rank_outputs_bwd(dout, y, v, z, coef, wv, D, wz, wo):
    """Launch the backward (dout (T, h, p) contiguous; the rest as for :func:`rank_outputs_fwd`). Returns (dy
    like y, dv like v, dz like z or None, dcoef like coef, dwv, dD, dwz, dwo): dv and dz summed in fp32 and
    written once in their input's dtype (what autograd would cast them to); dcoef fp32; dwv, dwz, dwo (h, r, p)
    and dD (h,) fp32, folded over position blocks, or None where their input is None."""
    T, r, h, p, grid, block_p, mimo = _launch_args(y, coef, wv, D)
    f32 = dict(device=y.device, dtype=torch.float32)
    dy = torch.empty_like(y)
    dv = torch.empty_like(v)
    dz = torch.empty_like(z) if z is not None else None
    dcoef = torch.empty_like(coef)
    blocks = grid[0]
    dwv = torch.empty(blocks, h, r, p, **f32) if mimo else None
    dwo = torch.empty(blocks, h, r, p, **f32) if mimo else None
    dwz = torch.empty(blocks, h, r, p, **f32) if mimo and z is not None else None
    dD = torch.empty(blocks, h, **f32) if D is not None else None
    or_dummy = lambda t: t if t is not None else dcoef
    rank_outputs_bwd_kernel[grid](
        y, v, z if z is not None else v, coef, or_dummy(wv), or_dummy(D), or_dummy(wz), or_dummy(wo), dout,
        dy, dv, dz if dz is not None else dv, dcoef, or_dummy(dwv), or_dummy(dwz), or_dummy(dwo), or_dummy(dD),
        T, h, p, R=r, MIMO=mimo, HAS_Z=z is not None, HAS_D=D is not None, BLOCK_T=BLOCK_T, BLOCK_P=block_p,
        RJ=max(16, r), num_warps=num_warps(r, backward=True))
    fold = lambda t: sum_partials(t, dim=0) if t is not None else None
    return dy, dv, dz, dcoef, fold(dwv), fold(dD), fold(dwz), fold(dwo)
