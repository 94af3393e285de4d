"""SSD forward, step 0: the step sizes Δ and their decays, cumulatively summed inside each chunk.

Math (per batch row, head h, chunk c; positions t = 0 … q-1 of the chunk):

    Δ_t  = clamp(softplus(dt_t + dt_bias), dt_min, dt_max)      softplus only with ``dt_softplus``;
                                                                 linear above 20, as in mamba-ssm
    cs_t = Σ_{k ≤ t} Δ_k A                                      the chunk's log-decay up to and including t

Positions past the sequence end (the last chunk's padding) get Δ = 0: they neither decay nor feed the
state, so cs stays flat there and cs_{q-1} is the decay of the whole chunk. The cumsum restarts in every
chunk, so cs never grows beyond one chunk's decay and the later steps may take differences cs_t - cs_s
(t ≥ s) without the cancellation that :func:`mambalab.ref.ssd.segsum_naive` shows for whole sequences.

Shapes: dt (b, l, h) contiguous, A (h,) fp32, dt_bias (h,) -> Δ and cs, each (b, h, c, q) fp32.
One program: one batch row, one chunk, BLOCK_H heads (a (BLOCK_H, q) tile; tl.cumsum along q).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

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
