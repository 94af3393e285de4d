"""C Bᵀ within each chunk, once per group: the (q, q) matrix of products C_t · B_s that the chunk scan's forward
and backward read (TileConfig.precompute_cb) instead of forming it in every head's programs.

Math (b batch rows, c chunks of q positions, g groups of heads sharing B and C):

    CB[b, c, g, t, s] = Σ_n C[b, c q + t, g, n] B[b, c q + s, g, n]        for every t, s < q

Every (t, s) is written, above the diagonal too: a kernel that tiles the chunk differently from this one reads
whole blocks and multiplies the entries above the diagonal by a zero weight, so they must be finite. Positions
past l read B and C as zero. The sum over n runs in steps of BLOCK_K (the tile rule's block_k), as the chunk
scan's forward forms it; with h heads a group, the chunk scan otherwise forms each entry h / g times (and its
backward twice more per head).

Shapes: B, C (b, l, g, n) contiguous, in the dots' dtype (x's); returns (b, c, g, q, q) fp32.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from mambalab.kernels.ssd.tiles import TileConfig


@triton.jit
def chunk_cb_kernel(
    B_ptr, C_ptr,      # (b, l, g, n)
    cb_ptr,            # (b, c, g, q, q) fp32 out
    l, g, n, c,        # sizes
    Q: tl.constexpr,   # chunk size
    BLOCK_T: tl.constexpr,   # rows t and columns s per program
    BLOCK_K: tl.constexpr,   # state dimensions per step of the sum over n
    DOT_PRECISION: tl.constexpr,
):
    pid_b = tl.program_id(0)
    pid_c = tl.program_id(1)
    pid_x = tl.program_id(2)                       # (group, block of rows, block of columns), flattened
    n_blocks = Q // BLOCK_T
    group = pid_x // (n_blocks * n_blocks)
    offs_t = ((pid_x // n_blocks) % n_blocks) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_s = (pid_x % n_blocks) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_k = tl.arange(0, BLOCK_K)
    mask_t = pid_c * Q + offs_t < l
    mask_s = pid_c * Q + offs_s < l
    C_rows = ((pid_b * l + pid_c * Q + offs_t).to(tl.int64) * g + group) * n     # (BLOCK_T,)
    B_rows = ((pid_b * l + pid_c * Q + offs_s).to(tl.int64) * g + group) * n
    dot_ty = C_ptr.dtype.element_ty
    cb = tl.zeros((BLOCK_T, BLOCK_T), dtype=tl.float32)
    for k0 in range(0, n, BLOCK_K):
        k = k0 + offs_k
        mask_k = k < n
        Ck = tl.load(C_ptr + C_rows[:, None] + k[None, :], mask=mask_t[:, None] & mask_k[None, :], other=0.0)
        Bk = tl.load(B_ptr + B_rows[:, None] + k[None, :], mask=mask_s[:, None] & mask_k[None, :], other=0.0)
        cb += tl.dot(Ck.to(dot_ty), tl.trans(Bk.to(dot_ty)), input_precision=DOT_PRECISION)   # (BT, BT)
    out = (((pid_b * c + pid_c) * g + group) * Q + offs_t[:, None]).to(tl.int64) * Q + offs_s[None, :]
    tl.store(cb_ptr + out, cb)


def chunk_cb(B, C, cfg: TileConfig, dot_precision: str = "ieee") -> torch.Tensor:
    """Launch it: B, C (b, l, g, n) contiguous; one program per (batch row, chunk, group, block of rows, block
    of columns), blocks of cfg.block_t. Returns CB (b, c, g, q, q) fp32."""
    b, l, g, n = B.shape
    q = cfg.chunk_size
    c = triton.cdiv(l, q)
    cb = torch.empty(b, c, g, q, q, device=B.device, dtype=torch.float32)
    blocks = q // cfg.block_t
    chunk_cb_kernel[(b, c, g * blocks * blocks)](
        B, C, cb, l, g, n, c, Q=q, BLOCK_T=cfg.block_t, BLOCK_K=cfg.block_k, DOT_PRECISION=dot_precision,
        num_warps=cfg.num_warps,
    )
    return cb
