"""MIMO's rank inputs: the up-projection of v into one input per rank, and its backward, one pass each.

Math (per position t and head h; W^V the head's (r, p) up-projection, :func:`mambalab.ref.mamba3.rank_inputs`):

    x_{t,r} = v_t ⊙ W^V_r                      forward: read v once, write the R rank inputs
    dv_t    = Σ_r dx_{t,r} ⊙ W^V_r              backward: read dx once, write dv
    dW^V_r  = Σ_t dx_{t,r} ⊙ v_t                per-program partials over blocks of t, folded by
                                                :func:`mambalab.kernels.reduce.sum_partials` (fixed order)

The product is formed in fp32 and rounded once to the output's dtype, as PyTorch's ``(v * W^V).to(dtype)``
would; dv is summed over ranks in fp32 (rank 0 first) and rounded once to v's dtype. One pass each way
replaces PyTorch's product in fp32 (b, l, r, h, p) and its copy to the kernels' dtype, and in the backward a
cast of dx to fp32, two products of that size and two reductions
(about 3 ms of GPU time a step at MIMO r = 4, b4 l4096 h32 p64: benchmarks/results/README.md, 2026-11-30).

Tile rule (shape only): programs are (block of BLOCK_T = 128 positions of the flattened b·l axis, head), each
with the whole head dimension (BLOCK_P = next_pow2(p), at least 16); a loop over ranks; 4 warps
(backward 0.174 ms against 0.218 at 64 positions, 8 warps slower at each: benchmarks/results/README.md, 2026-11-30).

Shapes: v (T, h, p); W^V (h, r, p) fp32; x, dx (T, r, h, p), which is (b, l·r, h, p) laid out as the
rank-expanded SSD reads it; dv (T, h, p) in v's dtype; dW^V (h, r, p) fp32.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from mambalab.kernels.mamba3.rank_outputs import program_tile
from mambalab.kernels.reduce import sum_partials

BLOCK_T = 128
NUM_WARPS = 4


@triton.jit
def rank_inputs_fwd_kernel(
    v_ptr,     # (T, h, p)
    wv_ptr,    # (h, R, p) fp32
    x_ptr,     # (T, R, h, p) out
    T, h, p,
    R: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_P: tl.constexpr,
):
    pid_t = tl.program_id(0)
    hd = tl.program_id(1)
    rows, offs_p, mask_p, mask, _, v = program_tile(v_ptr, pid_t, hd, T, h, p, BLOCK_T, BLOCK_P)
    for r in range(R):
        w = tl.load(wv_ptr + (hd * R + r) * p + offs_p, mask=mask_p, other=0.0)[None, :]
        tl.store(x_ptr + ((rows * R + r) * h + hd) * p + offs_p[None, :], (v * w).to(x_ptr.dtype.element_ty),
                 mask=mask)


@triton.jit
def rank_inputs_bwd_kernel(
    dx_ptr,    # (T, R, h, p)
    v_ptr,     # (T, h, p)
    wv_ptr,    # (h, R, p) fp32
    dv_ptr,    # (T, h, p) out, v's dtype
    dwv_ptr,   # (programs along T, h, R, p) fp32 out: partials
    T, h, p,
    R: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_P: tl.constexpr,
):
    pid_t = tl.program_id(0)
    hd = tl.program_id(1)
    rows, offs_p, mask_p, mask, hp, v = program_tile(v_ptr, pid_t, hd, T, h, p, BLOCK_T, BLOCK_P)
    dv = tl.zeros((BLOCK_T, BLOCK_P), dtype=tl.float32)
    for r in range(R):
        w = tl.load(wv_ptr + (hd * R + r) * p + offs_p, mask=mask_p, other=0.0)[None, :]
        dx = tl.load(dx_ptr + ((rows * R + r) * h + hd) * p + offs_p[None, :], mask=mask, other=0.0).to(tl.float32)
        dv += dx * w
        tl.store(dwv_ptr + ((pid_t * h + hd) * R + r) * p + offs_p, tl.sum(dx * v, axis=0), mask=mask_p)
    tl.store(dv_ptr + hp, dv.to(dv_ptr.dtype.element_ty), mask=mask)


def _grid(v, wv):
    T, h, p = v.shape
    if wv.dim() != 3 or wv.shape[0] != h or wv.shape[2] != p or wv.dtype != torch.float32:
        raise ValueError(f"rank inputs take v (T, h, p) and W^V (h, r, p) fp32; got v {tuple(v.shape)}, "
                         f"W^V {tuple(wv.shape)} {wv.dtype}")
    return T, wv.shape[1], h, p, (triton.cdiv(T, BLOCK_T), h), max(16, triton.next_power_of_2(p))


def rank_inputs_fwd(v, wv):
    """x_{t,r} = v_t ⊙ W^V_r: v (T, h, p) contiguous, wv (h, r, p) fp32 contiguous -> x (T, r, h, p) in v's
    dtype."""
    T, r, h, p, grid, block_p = _grid(v, wv)
    x = torch.empty(T, r, h, p, device=v.device, dtype=v.dtype)
    rank_inputs_fwd_kernel[grid](v, wv, x, T, h, p, R=r, BLOCK_T=BLOCK_T, BLOCK_P=block_p, num_warps=NUM_WARPS)
    return x


def rank_inputs_bwd(dx, v, wv):
    """dx (T, r, h, p) contiguous; v, wv as for :func:`rank_inputs_fwd` -> (dv (T, h, p) in v's dtype,
    dW^V (h, r, p) fp32, its partials over position blocks folded in a fixed order)."""
    T, r, h, p, grid, block_p = _grid(v, wv)
    if dx.shape != (T, r, h, p):
        raise ValueError(f"dx must have the forward's output shape (T, r, h, p) = {(T, r, h, p)}; got "
                         f"{tuple(dx.shape)}")
    dv = torch.empty_like(v)
    partials = torch.empty(grid[0], h, r, p, device=v.device, dtype=torch.float32)
    rank_inputs_bwd_kernel[grid](dx, v, wv, dv, partials, T, h, p, R=r, BLOCK_T=BLOCK_T, BLOCK_P=block_p,
                                 num_warps=NUM_WARPS)
    return dv, sum_partials(partials, dim=0)
