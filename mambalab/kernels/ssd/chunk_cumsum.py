"""SSD forward, step 0: the step sizes Δ and their decays, cumulatively summed inside each chunk.

Math (per batch row, head h, chunk c; positions t = 0 … q-1 of the chunk):

    Δ_t  = clamp(softplus(dt_t + dt_bias), dt_min, dt_max)      softplus only with ``dt_softplus``;
                                                                 linear above 20, as in mamba-ssm
    cs_t = Σ_{k ≤ t} Δ_k A                                      the chunk's log-decay up to and including t

Positions past the sequence end (the last chunk's padding) get Δ = 0: they neither decay nor feed the
state, so cs stays flat there and cs_{q-1} is the decay of the whole chunk. The cumsum restarts in every
chunk, so |cs| never exceeds one chunk's decay. The later steps take differences cs_t - cs_s (t ≥ s), which
still cancel: each keeps an error of about ulp(|cs|) (:func:`mambalab.ref.ssd.segsum_naive`), so the precision
lost is bounded by q steps' decay instead of the whole sequence's, not removed. mamba-ssm does the same: a
per-chunk ``tl.cumsum`` in ssd_chunk_state.py's ``_chunk_cumsum_fwd_kernel``, differenced in ssd_chunk_scan.py's
``_chunk_scan_fwd_kernel``.

Shapes: dt (b, l, h) contiguous, A (h,) fp32, dt_bias (h,) -> Δ and cs, each (b, h, c, q) fp32.
One program: one batch row, one chunk, BLOCK_H heads (a (BLOCK_H, q) tile; tl.cumsum along q).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from mambalab.kernels.reduce import sum_partials
from mambalab.kernels.ssd.tiles import TileConfig


@triton.jit
def chunk_cumsum_fwd_kernel(
    dt_ptr,           # (b, l, h) raw step sizes
    A_ptr,            # (h,) fp32 decay rates
    bias_ptr,         # (h,) dt_bias, or a dummy
    delta_ptr,        # (b, h, c, q) fp32 out: Δ
    cs_ptr,           # (b, h, c, q) fp32 out: within-chunk cumsum of Δ A
    h, l, c,          # sizes
    dt_min, dt_max,   # dt_limit: Δ is clamped to [dt_min, dt_max]
    HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr,
    BLOCK_H: tl.constexpr,   # heads per program
    Q: tl.constexpr,         # chunk size
):
    pid_b = tl.program_id(0)
    pid_c = tl.program_id(1)
    pid_h = tl.program_id(2)
    offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_t = tl.arange(0, Q)
    t = pid_c * Q + offs_t                                         # positions in the sequence
    mask_h = offs_h < h
    mask = mask_h[:, None] & (t < l)[None, :]                      # (BLOCK_H, Q)

    dt_ptrs = dt_ptr + (pid_b * l + t[None, :]).to(tl.int64) * h + offs_h[:, None]
    dt = tl.load(dt_ptrs, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        dt += tl.load(bias_ptr + offs_h, mask=mask_h, other=0.0).to(tl.float32)[:, None]
    if SOFTPLUS:
        dt = tl.where(dt <= 20.0, tl.log(1.0 + tl.exp(dt)), dt)
    dt = tl.minimum(tl.maximum(dt, dt_min), dt_max)
    dt = tl.where(mask, dt, 0.0)                                   # padding: no decay, no input
    A = tl.load(A_ptr + offs_h, mask=mask_h, other=0.0).to(tl.float32)
    cs = tl.cumsum(dt * A[:, None], axis=1)                        # (BLOCK_H, Q)

    out = ((pid_b * h + offs_h[:, None]).to(tl.int64) * c + pid_c) * Q + offs_t[None, :]
    tl.store(delta_ptr + out, dt, mask=mask_h[:, None])           # padding included: Δ = 0, cs flat
    tl.store(cs_ptr + out, cs, mask=mask_h[:, None])


def chunk_cumsum_fwd(dt, A, dt_bias, dt_softplus, dt_limit, cfg: TileConfig):
    """Launch step 0. dt (b, l, h) contiguous; A (h,) fp32; dt_bias (h,) or None; dt_limit (min, max).

    Returns (delta, cs), each (b, h, c, q) fp32.
    """
    b, l, h = dt.shape
    q = cfg.chunk_size
    c = triton.cdiv(l, q)
    delta = torch.empty(b, h, c, q, device=dt.device, dtype=torch.float32)
    cs = torch.empty_like(delta)
    grid = (b, c, triton.cdiv(h, cfg.block_h))
    chunk_cumsum_fwd_kernel[grid](
        dt, A, dt_bias if dt_bias is not None else A, delta, cs,
        h, l, c, float(dt_limit[0]), float(dt_limit[1]),
        HAS_BIAS=dt_bias is not None, SOFTPLUS=bool(dt_softplus),
        BLOCK_H=cfg.block_h, Q=q, num_warps=cfg.num_warps,
    )
    return delta, cs


# ---------------------------------------------------------------------------------------------- backward
# Math. The later steps hand back dΔ_t (Δ where it multiplies x), dcs_t (cs where it enters an exp), da (the
# chunk's total log-decay cs_{q-1}, from state passing) and dws_s (the exponent cs_{q-1} - cs_s = Σ_{k > s} a_k
# of chunk states). Since cs_t = Σ_{k ≤ t} a_k with a_k = Δ_k A inside the chunk, the gradient of a_k is
#     r_k = Σ_{t ≥ k} dcs_t + da + Σ_{s < k} dws_s            (a reverse and a shifted forward cumsum)
# so
#     dΔ_k += A r_k,        dA += Σ_k Δ_k r_k        (summed over the batch rows and chunks: a reduction)
# and through Δ = clamp(softplus?(v)), v = dt + dt_bias:
#     ddt_k = dΔ_k · [dt_min ≤ softplus?(v_k) ≤ dt_max] · (σ(v_k) with softplus and v_k ≤ 20, else 1)
#     ddt_bias += Σ_k ddt_k                              (over the batch rows and chunks: a reduction)
# The clamp passes the gradient where the value lies inside the limits, ends included (as torch.clamp does),
# and none where it clamps. Padding positions get ddt = 0 (they are no input).
# The reductions: REDUCE_ATOMIC adds each program's (BLOCK_H,) sums into fp32 buffers with tl.atomic_add;
# otherwise each program writes them to its own slot of (b, c, h) partials, folded by sum_partials.


@triton.jit
def chunk_cumsum_bwd_kernel(
    dt_ptr,           # (b, l, h) raw step sizes
    A_ptr,            # (h,) fp32
    bias_ptr,         # (h,) dt_bias, or a dummy
    delta_ptr,        # (b, h, c, q) fp32 Δ saved by the forward
    ddelta_ptr,       # (b, h, c, q) fp32 dΔ from the chunk backward
    dcs_row_ptr,      # (b, h, c, q) fp32 dcs, the part summed over each row t
    dcs_col_ptr,      # (b, h, c, q) fp32 dcs, the part summed over each column s
    da_ptr,           # (b, h, c) fp32 gradient of the chunk's total log-decay, from state passing
    dws_ptr,          # (b, h, c, q) fp32 gradient of chunk states' exponents, from the chunk backward
    ddt_ptr,          # (b, l, h) out: ddt
    dA_ptr,           # atomic: (h,) fp32 zeroed; deterministic: (b, c, h) fp32 partials
    dbias_ptr,        # like dA_ptr, for dt_bias (or a dummy)
    h, l, c,          # sizes
    dt_min, dt_max,
    HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr, REDUCE_ATOMIC: tl.constexpr,
    BLOCK_H: tl.constexpr, Q: tl.constexpr,
):
    pid_b = tl.program_id(0)
    pid_c = tl.program_id(1)
    pid_h = tl.program_id(2)
    offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_t = tl.arange(0, Q)
    t = pid_c * Q + offs_t
    mask_h = offs_h < h
    mask = mask_h[:, None] & (t < l)[None, :]                      # (BLOCK_H, Q)

    dt_ptrs = dt_ptr + (pid_b * l + t[None, :]).to(tl.int64) * h + offs_h[:, None]
    v = tl.load(dt_ptrs, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        v += tl.load(bias_ptr + offs_h, mask=mask_h, other=0.0).to(tl.float32)[:, None]
    dv = tl.full((BLOCK_H, Q), 1.0, tl.float32)                    # d softplus?(v) / dv
    if SOFTPLUS:
        dv = tl.where(v <= 20.0, tl.sigmoid(v), 1.0)
        v = tl.where(v <= 20.0, tl.log(1.0 + tl.exp(v)), v)
    inside = (v >= dt_min) & (v <= dt_max)                         # the clamp's gradient: 1 inside, 0 outside

    at = ((pid_b * h + offs_h[:, None]).to(tl.int64) * c + pid_c) * Q + offs_t[None, :]
    mh = mask_h[:, None]
    dcs = tl.load(dcs_row_ptr + at, mask=mh, other=0.0) + tl.load(dcs_col_ptr + at, mask=mh, other=0.0)
    da = tl.load(da_ptr + (pid_b * h + offs_h).to(tl.int64) * c + pid_c, mask=mask_h, other=0.0)
    dcs += tl.where(offs_t[None, :] == Q - 1, da[:, None], 0.0)
    r = tl.cumsum(dcs, axis=1, reverse=True)                       # Σ_{t ≥ k} dcs_t  (+ da)
    dws_prev = tl.load(dws_ptr + at - 1, mask=mh & (offs_t[None, :] > 0), other=0.0)   # dws_{k-1}
    r += tl.cumsum(dws_prev, axis=1)                               # + Σ_{s < k} dws_s
    A = tl.load(A_ptr + offs_h, mask=mask_h, other=0.0).to(tl.float32)
    delta = tl.load(delta_ptr + at, mask=mh, other=0.0)
    ddelta = tl.load(ddelta_ptr + at, mask=mh, other=0.0) + A[:, None] * r
    ddt = tl.where(mask & inside, ddelta * dv, 0.0)
    tl.store(ddt_ptr + (pid_b * l + t[None, :]).to(tl.int64) * h + offs_h[:, None],
             ddt.to(ddt_ptr.dtype.element_ty), mask=mask)

    dA = tl.sum(delta * r, axis=1)                                 # (BLOCK_H,); Δ = 0 on padding
    dbias = tl.sum(ddt, axis=1)
    if REDUCE_ATOMIC:
        tl.atomic_add(dA_ptr + offs_h, dA, mask=mask_h)
        if HAS_BIAS:
            tl.atomic_add(dbias_ptr + offs_h, dbias, mask=mask_h)
    else:
        slot = (pid_b * c + pid_c).to(tl.int64) * h + offs_h       # partials (b, c, h)
        tl.store(dA_ptr + slot, dA, mask=mask_h)
        if HAS_BIAS:
            tl.store(dbias_ptr + slot, dbias, mask=mask_h)


def chunk_cumsum_bwd(dt, A, dt_bias, dt_softplus, dt_limit, delta, ddelta, dcs_row, dcs_col, da, dws,
                     cfg: TileConfig, reduction: str):
    """Launch step 0's backward. Returns (ddt (b, l, h) in dt's dtype, dA (h,) fp32, ddt_bias (h,) fp32 or None).

    ``reduction``: "atomic" (tl.atomic_add into fp32) or "deterministic" (partials folded by sum_partials
    over the (b, c) programs, in that fixed order).
    """
    b, l, h = dt.shape
    c, q = delta.shape[2], delta.shape[3]
    atomic = reduction == "atomic"
    f32 = dict(device=dt.device, dtype=torch.float32)
    ddt = torch.empty_like(dt)
    if atomic:
        dA = torch.zeros(h, **f32)
        dbias = torch.zeros(h, **f32) if dt_bias is not None else None
    else:
        dA = torch.empty(b, c, h, **f32)
        dbias = torch.empty(b, c, h, **f32) if dt_bias is not None else None
    grid = (b, c, triton.cdiv(h, cfg.block_h))
    chunk_cumsum_bwd_kernel[grid](
        dt, A, dt_bias if dt_bias is not None else A, delta, ddelta, dcs_row, dcs_col, da, dws,
        ddt, dA, dbias if dbias is not None else dA,
        h, l, c, float(dt_limit[0]), float(dt_limit[1]),
        HAS_BIAS=dt_bias is not None, SOFTPLUS=bool(dt_softplus), REDUCE_ATOMIC=atomic,
        BLOCK_H=cfg.block_h, Q=q, num_warps=cfg.num_warps,
    )
    if not atomic:
        dA = sum_partials(dA.view(b * c, h), dim=0)
        dbias = sum_partials(dbias.view(b * c, h), dim=0) if dbias is not None else None
    return ddt, dA, dbias
