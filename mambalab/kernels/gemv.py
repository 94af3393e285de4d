"""A batch-1 decode step's linear layers as one Triton kernel each, with the small steps around them fused in:
the gated RMS norm before Mamba-2's out_proj; the causal conv's step after its in_proj (and, in a language
model, the residual add and the block's RMS norm before it).

At batch 1 a linear layer is a matrix-vector product (GEMV) that reads each weight once and does two flops
with it; the norm and the conv step between a layer's two GEMVs touch a few thousand values each, so as
kernels of their own they add launches, not bytes (the unfused step of mamba2-2.7b on an H100: 7 kernels a
layer, the small ones 0.71 ms of 3.07; benchmarks/results/2026-12-06_h100_profile_decode_mamba2_2.7b.json).
Fused, a Mamba-2 layer's decode step is three kernels (:meth:`mambalab.modules.Mamba2._fused_step`): in_proj
with the conv, the state update (:mod:`mambalab.kernels.state_update`), out_proj with the norm.

Math (one input row v of K channels; W (N, K); fp32 sums):

    out[n] = Σ_k W[n, k] v[k] + bias[n]

    NORM (the prologue, as :mod:`mambalab.kernels.norm`'s forward, RMS only), per group of ``group_size``:
        s = x + r                       with a residual r (rounded to x's dtype and stored by program 0)
        u = s ⊙ silu(z)                 with a gate z and not norm_before_gate, else u = s
        σ⁻¹ = 1 / sqrt(Σ_j u_j² / group_size + eps)
        v = u σ⁻¹ ⊙ w,  then ⊙ silu(z) if norm_before_gate;  v rounded to x's dtype, as the unfused norm's
                                                                 output is before the GEMV reads it
    CONV (the epilogue, as :mod:`mambalab.kernels.conv_update`), for the outputs n of the conv's channels
    c = n - conv_start in [0, channels): out[n] rounded to out's dtype enters the channel's window
        window[c] ← (window[c, 1:], out[n]),   out[n] = silu(conv_bias[c] + Σ_k conv_w[c, k] window[c, k])

Every program computes the norm's statistics itself, over the whole row: it reads the row's K values of x (and
r and z) once for Σ u² and again, tile by tile, for v, where a norm kernel of its own would cost a launch and
a pass over the row.

Order of the sums, fixed by the shape alone: each output row is summed over BLOCK_K tiles in k order, each
tile's products reduced by ``tl.reduce`` with Triton's sum over a [BLOCK_N, BLOCK_K] tile of ``num_warps``
warps; the norm's Σ u² over tiles of BLOCK_S = min(STATS_BLOCK, next_pow2(K)) in k order. The tiles are set
by :func:`gemv_config` from (N, K) only, never from the GPU, so the bits are the same on every GPU and every
run.

Shapes: W (N, K) with unit stride along K (an ``nn.Linear`` weight); x, z, r (K,); bias (N,); norm weight
(K,); conv_state (channels, width), updated in place; conv weight (channels, width); conv bias (channels,).
Out: (N,) in x's dtype. On a GPU the kernel reads and writes the tensors' own dtypes; on the CPU the launcher
in :mod:`mambalab.ops.decode_linear` feeds it fp32 (:func:`mambalab.device.compute_dtype`), so there the
roundings above to a bf16 or fp16 x's dtype do not happen inside the kernel: only out, s and the window are
rounded, once, when the launcher casts them back.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.standard import _sum_combine


@dataclass(frozen=True)
class GemvConfig:
    block_n: int      # output rows a program
    block_k: int      # the k tile: part of the sums' order
    num_warps: int
    num_stages: int = 1   # Triton's software pipelining of the k loop's loads (1: none)


def gemv_config(n: int, k: int) -> GemvConfig:
    """The tile rule, from the shape only: 8 rows a program (ceil(N / 8) programs: 1,322 for mamba2-2.7b's
    in_proj, N = 10,576, and 320 for its out_proj, N = 2,560), k tiles of 1,024 (K rounded up to a power of two
    when smaller: in_proj's K = 2,560 is three tiles, the last half masked; out_proj's K = 5,120 five), 8 warps
    (8 × 1,024 weights over 256 threads: 32 weights, 64 bytes of bf16, a thread a tile)."""
    return GemvConfig(block_n=8, block_k=min(1024, triton.next_power_of_2(k)), num_warps=8)


STATS_BLOCK = 2048   # the norm's statistics pass reads x, r and z in tiles of this many (fewer loops in series)


@triton.jit
def gemv_kernel(
    w_ptr,            # (N, K) weight, unit stride along K
    x_ptr,            # (K,) the input row
    out_ptr,          # (N,) out
    bias_ptr,         # (N,) (HAS_BIAS), else a dummy
    z_ptr,            # (K,) the norm's gate (HAS_Z), else a dummy
    res_ptr,          # (K,) the residual (HAS_RESIDUAL), else a dummy
    s_ptr,            # (K,) out: s = x + r (HAS_RESIDUAL), else a dummy
    nw_ptr,           # (K,) the norm's weight (NORM), else a dummy
    state_ptr,        # (channels, width) the conv's window (CONV), updated in place, else a dummy
    cw_ptr,           # (channels, width) the conv's filter (CONV), else a dummy
    cb_ptr,           # (channels,) the conv's bias (CONV_BIAS), else a dummy
    N, K,
    w_row,            # W's row stride (elements)
    group_size, eps,
    conv_start, channels, width,
    s_c, s_w, cw_c, cw_w,   # the window's and the filter's strides (elements)
    HAS_BIAS: tl.constexpr, NORM: tl.constexpr, HAS_Z: tl.constexpr, NORM_BEFORE_GATE: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr, CONV: tl.constexpr, CONV_BIAS: tl.constexpr,
    GROUPS: tl.constexpr,   # next_pow2(K / group_size) (NORM)
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_S: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    groups = tl.arange(0, GROUPS)
    if NORM:   # the statistics of every group, over the whole row
        sum_sq = tl.zeros([GROUPS], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_S):
            cols = k0 + tl.arange(0, BLOCK_S)
            u = _norm_input(x_ptr, res_ptr, s_ptr, z_ptr, cols, cols < K, False,
                            HAS_RESIDUAL, HAS_Z, NORM_BEFORE_GATE)
            mine = (cols // group_size)[None, :] == groups[:, None]           # (GROUPS, BLOCK_S)
            sum_sq += tl.reduce(tl.where(mine, (u * u)[None, :], 0.0), 1, _sum_combine)
        rstd = 1.0 / tl.sqrt(sum_sq / group_size + eps)                       # (GROUPS,)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        col_ok = cols < K
        if NORM:
            u = _norm_input(x_ptr, res_ptr, s_ptr, z_ptr, cols, col_ok, pid == 0,
                            HAS_RESIDUAL, HAS_Z, NORM_BEFORE_GATE)
            mine = (cols // group_size)[None, :] == groups[:, None]
            v = u * tl.reduce(tl.where(mine, rstd[:, None], 0.0), 0, _sum_combine)   # each column's σ⁻¹
            v = v * tl.load(nw_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
            if HAS_Z and NORM_BEFORE_GATE:
                z = tl.load(z_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
                v = v * (z / (1.0 + tl.exp(-z)))
            v = v.to(x_ptr.dtype.element_ty).to(tl.float32)                 # the norm's output, as stored
        else:
            v = tl.load(x_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + rows[:, None] * w_row + cols[None, :], mask=row_ok[:, None] & col_ok[None, :],
                    other=0.0)
        acc += tl.reduce(w.to(tl.float32) * v[None, :], 1, _sum_combine)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    if CONV:   # the conv's step on the outputs that are its channels' new inputs
        c = rows - conv_start
        conv_ok = row_ok & (c >= 0) & (c < channels)
        taps = tl.arange(0, BLOCK_W)
        s_ptrs = state_ptr + c[:, None] * s_c
        shifted = tl.load(s_ptrs + (taps[None, :] + 1) * s_w, mask=conv_ok[:, None] & (taps < width - 1)[None, :],
                          other=0.0)
        newest = acc.to(out_ptr.dtype.element_ty).to(shifted.dtype)
        window = tl.where((taps == width - 1)[None, :], newest[:, None], shifted)   # (BLOCK_N, BLOCK_W)
        keep = conv_ok[:, None] & (taps < width)[None, :]
        tl.store(s_ptrs + taps[None, :] * s_w, window.to(state_ptr.dtype.element_ty), mask=keep)
        filt = tl.load(cw_ptr + c[:, None] * cw_c + taps[None, :] * cw_w, mask=keep, other=0.0)
        y = tl.reduce(window.to(tl.float32) * filt.to(tl.float32), 1, _sum_combine)
        if CONV_BIAS:
            y += tl.load(cb_ptr + c, mask=conv_ok, other=0.0).to(tl.float32)
        acc = tl.where(conv_ok, y / (1.0 + tl.exp(-y)), acc)                  # silu
    tl.store(out_ptr + rows, acc.to(out_ptr.dtype.element_ty), mask=row_ok)


@triton.jit
def _norm_input(x_ptr, res_ptr, s_ptr, z_ptr, cols, col_ok, store_s,
                HAS_RESIDUAL: tl.constexpr, HAS_Z: tl.constexpr, NORM_BEFORE_GATE: tl.constexpr):
    """u for the columns ``cols``: x (+ r, rounded to s's dtype and stored when ``store_s``), gated when the
    gate comes first."""
    u = tl.load(x_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        s = (u + tl.load(res_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)).to(s_ptr.dtype.element_ty)
        tl.store(s_ptr + cols, s, mask=col_ok & store_s)
        u = s.to(tl.float32)
    if HAS_Z and not NORM_BEFORE_GATE:
        z = tl.load(z_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        u = u * (z / (1.0 + tl.exp(-z)))
    return u


def gemv_fwd(weight, x, bias=None, *, norm=None, conv=None, config: GemvConfig | None = None):
    """Launch :func:`gemv_kernel` on already-validated tensors; returns out (N,), and s (K,) with a residual.

    norm: None, or a dict ``weight, z, residual, group_size, eps, norm_before_gate`` (z and residual may be
    None). conv: None, or a dict ``state, weight, bias, start`` (bias may be None). ``config``: the tiles
    (default :func:`gemv_config`'s; a benchmark's sweep passes others)."""
    n, k = weight.shape
    cfg = config or gemv_config(n, k)
    out = torch.empty(n, device=x.device, dtype=x.dtype)
    norm = norm or {}
    residual = norm.get("residual")
    s = torch.empty_like(x) if residual is not None else None
    dummy = x
    groups = k // norm["group_size"] if norm else 1
    state = conv["state"] if conv else None
    kwargs = dict(
        HAS_BIAS=bias is not None, NORM=bool(norm), HAS_Z=norm.get("z") is not None,
        NORM_BEFORE_GATE=bool(norm.get("norm_before_gate", True)), HAS_RESIDUAL=residual is not None,
        CONV=conv is not None, CONV_BIAS=bool(conv) and conv.get("bias") is not None,
        GROUPS=triton.next_power_of_2(groups), BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        BLOCK_W=triton.next_power_of_2(state.shape[1]) if conv else 1,
        BLOCK_S=min(STATS_BLOCK, triton.next_power_of_2(k)), num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    gemv_kernel[(triton.cdiv(n, cfg.block_n),)](
        weight, x, out, bias if bias is not None else dummy,
        norm.get("z") if norm.get("z") is not None else dummy, residual if residual is not None else dummy,
        s if s is not None else dummy, norm["weight"] if norm else dummy,
        state if conv else dummy, conv["weight"] if conv else dummy,
        conv["bias"] if conv and conv.get("bias") is not None else dummy,
        n, k, weight.stride(0), norm.get("group_size", 1), float(norm.get("eps", 0.0)),
        conv["start"] if conv else 0, state.shape[0] if conv else 0, state.shape[1] if conv else 0,
        *(state.stride() if conv else (0, 0)), *(conv["weight"].stride() if conv else (0, 0)),
        **kwargs)
    return (out, s) if s is not None else out
