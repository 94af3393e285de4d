"""SSD forward, step 1: the state each chunk leaves behind when it starts from zero.

Math (per batch row, chunk c, head h; s runs over the q positions of the chunk, cs from step 0):

    S_c = Σ_s exp(cs_{q-1} - cs_s) Δ_s x_s B_sᵀ        (p, n)

exp(cs_{q-1} - cs_s) is the decay from just after step s to the chunk's end (a within-chunk difference,
≤ 0 for A ≤ 0, so the exp never overflows). As a matrix product over the chunk's positions:
S_c = (w ⊙ X_c)ᵀ B_c with w_s = exp(cs_{q-1} - cs_s) Δ_s: tl.dots of (BLOCK_P, BLOCK_T) by (BLOCK_T, BLOCK_N),
summed over the chunk's positions BLOCK_T at a time.
Padding positions (past l) load x = B = 0 and have Δ = 0, so they add nothing.

Backward: in :mod:`mambalab.kernels.ssd.chunk_scan` (``chunk_scan_bwd``), which walks the same positions with
the same x, B, Δ and cs; its math is written there.

Shapes: x (b, l, h, p), B (b, l, g, n) contiguous, head i reading group i // (h // g); Δ, cs (b, h, c, q) fp32
-> states (b, c, h, p, n) fp32. One program: (batch row, chunk, head, block of BLOCK_P head dimensions).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from mambalab.kernels.ssd.tiles import TileConfig


@triton.jit
def _head_block(pid_hp, h, p, g, BLOCK_P: tl.constexpr):
    """Which head, block of head dimensions and group a program index over (head, block of BLOCK_P) means:
    (head, block, group, offsets over p, their mask)."""
    n_pblocks = tl.cdiv(p, BLOCK_P)
    head = pid_hp // n_pblocks
    block = pid_hp % n_pblocks
    offs_p = block * BLOCK_P + tl.arange(0, BLOCK_P)
    return head, block, head // (h // g), offs_p, offs_p < p


@triton.jit
def chunk_states_fwd_kernel(
    x_ptr,            # (b, l, h, p) inputs
    B_ptr,            # (b, l, g, n)
    delta_ptr,        # (b, h, c, q) fp32 Δ from step 0
    cs_ptr,           # (b, h, c, q) fp32 within-chunk cumsum of Δ A from step 0
    states_ptr,       # (b, c, h, p, n) fp32 out
    h, p, n, l, g, c,  # sizes
    BLOCK_T: tl.constexpr,           # chunk positions per step of the sum
    BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
    Q: tl.constexpr,                 # chunk size
    DOT_PRECISION: tl.constexpr,     # tl.dot input_precision for fp32 operands ("ieee": exact fp32)
):
    pid_b = tl.program_id(0)
    pid_c = tl.program_id(1)
    head, _, group, offs_p, mask_p = _head_block(tl.program_id(2), h, p, g, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    offs_t = tl.arange(0, BLOCK_T)
    mask_n = offs_n < n
    dot_ty = x_ptr.dtype.element_ty   # dots run in the inputs' dtype (fp32 on the CPU), accumulate in fp32

    chunk = ((pid_b * h + head) * c + pid_c).to(tl.int64) * Q
    cs_last = tl.load(cs_ptr + chunk + Q - 1)                                        # the chunk's decay
    S = tl.zeros((BLOCK_P, BLOCK_N), dtype=tl.float32)
    for s0 in range(0, Q, BLOCK_T):   # the chunk's positions, BLOCK_T at a time
        s = s0 + offs_t
        mask_s = pid_c * Q + s < l
        row = (pid_b * l + pid_c * Q + s).to(tl.int64)                               # (BLOCK_T,)
        x = tl.load(x_ptr + (row[:, None] * h + head) * p + offs_p[None, :],
                    mask=mask_s[:, None] & mask_p[None, :], other=0.0)               # (BLOCK_T, BLOCK_P)
        Bs = tl.load(B_ptr + (row[:, None] * g + group) * n + offs_n[None, :],
                     mask=mask_s[:, None] & mask_n[None, :], other=0.0)              # (BLOCK_T, BLOCK_N)
        cs = tl.load(cs_ptr + chunk + s)                                             # (BLOCK_T,)
        delta = tl.load(delta_ptr + chunk + s)                                       # (BLOCK_T,)
        w = tl.exp(cs_last - cs) * delta                                             # decay to the end, times Δ
        xw = (x.to(tl.float32) * w[:, None]).to(dot_ty)                             # (BLOCK_T, BLOCK_P)
        S += tl.dot(tl.trans(xw), Bs.to(dot_ty), input_precision=DOT_PRECISION)     # (BLOCK_P, BLOCK_N) fp32

    out = (((pid_b * c + pid_c) * h + head) * p + offs_p[:, None]).to(tl.int64) * n + offs_n[None, :]
    tl.store(states_ptr + out, S, mask=mask_p[:, None] & mask_n[None, :])


def chunk_states_fwd(x, B, delta, cs, cfg: TileConfig, dot_precision: str = "ieee"):
    """Launch step 1. x (b, l, h, p), B (b, l, g, n) contiguous; delta, cs (b, h, c, q) fp32 from step 0.

    Returns the chunk states (b, c, h, p, n) fp32.
    """
    b, l, h, p = x.shape
    g, n = B.shape[2], B.shape[3]
    c = delta.shape[2]
    states = torch.empty(b, c, h, p, n, device=x.device, dtype=torch.float32)
    grid = (b, c, h * triton.cdiv(p, cfg.block_p))
    chunk_states_fwd_kernel[grid](
        x, B, delta, cs, states,
        h, p, n, l, g, c,
        BLOCK_T=cfg.block_t, BLOCK_P=cfg.block_p, BLOCK_N=cfg.block_n, Q=cfg.chunk_size, DOT_PRECISION=dot_precision,
        num_warps=cfg.num_warps,
    )
    return states
