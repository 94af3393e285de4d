"""SSD forward, step 3: every chunk's outputs, from its own inputs and the state entering it.

Math (per batch row, chunk c, head h; t, s positions of the chunk; cs and Δ from step 0, H_c from step 2):

    Y_t = Σ_{s ≤ t} exp(cs_t - cs_s) (C_t · B_s) Δ_s x_s        inside the chunk: (L ∘ C Bᵀ)(Δ ⊙ X)
        + exp(cs_t) H_c C_t                                      what the entering state adds
        + D x_t                                                  skip (D per head, or per head and dimension)
    out_t = Y_t ⊙ silu(z_t)                                      when z is given

The decay matrix L[t, s] = exp(cs_t - cs_s) uses the within-chunk cumsum, and the causal mask is applied to
the exponent (−inf above the diagonal) *before* the exp, so exp never sees a positive argument for A ≤ 0
and nothing is ever multiplied by an overflowed value.

A program computes BLOCK_T rows t of one chunk: C Hᵀ (BLOCK_T × BLOCK_P, over n in steps of BLOCK_K), then,
for each block of BLOCK_T columns s up to the diagonal, C Bᵀ (BLOCK_T × BLOCK_T, over n likewise) and
(L ∘ C Bᵀ ∘ Δ) X (BLOCK_T × BLOCK_P). Blocks wholly above the diagonal are never visited.

Shapes: x, z, out (b, l, h, p); C, B (b, l, g, n), head i reading group i // (h // g); Δ, cs (b, h, c, q) fp32;
entering (b, c, h, p, n) fp32; D (h,) or (h, p). out is written in x's dtype, padding positions skipped.
One program: (batch row, chunk, head, block of BLOCK_T rows, block of BLOCK_P head dimensions).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from mambalab.kernels.ssd.tiles import TileConfig


@triton.jit
def chunk_scan_fwd_kernel(
    x_ptr,            # (b, l, h, p) inputs
    B_ptr,            # (b, l, g, n)
    C_ptr,            # (b, l, g, n)
    delta_ptr,        # (b, h, c, q) fp32 Δ from step 0
    cs_ptr,           # (b, h, c, q) fp32 within-chunk cumsum of Δ A from step 0
    entering_ptr,     # (b, c, h, p, n) fp32 state entering each chunk, from step 2
    D_ptr,            # (h,) or (h, p) skip weights, or a dummy
    z_ptr,            # (b, l, h, p) gate, or a dummy
    out_ptr,          # (b, l, h, p) out, in x's dtype
    h, p, n, l, g, c,  # sizes
    HAS_D: tl.constexpr,
    D_PER_DIM: tl.constexpr,         # D is (h, p) rather than (h,)
    HAS_Z: tl.constexpr,
    BLOCK_T: tl.constexpr,           # rows (chunk positions) per program, and the step over s ≤ t
    BLOCK_P: tl.constexpr, BLOCK_K: tl.constexpr,
    Q: tl.constexpr,                 # chunk size
    DOT_PRECISION: tl.constexpr,     # tl.dot input_precision for fp32 operands ("ieee": exact fp32)
):
    pid_b = tl.program_id(0)
    pid_c = tl.program_id(1)
    pid_x = tl.program_id(2)                      # (head, block of rows, block of head dims), flattened
    n_pblocks = tl.cdiv(p, BLOCK_P)
    n_tblocks = Q // BLOCK_T
    head = pid_x // (n_pblocks * n_tblocks)
    tblk = (pid_x // n_pblocks) % n_tblocks
    group = head // (h // g)
    offs_p = (pid_x % n_pblocks) * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_k = tl.arange(0, BLOCK_K)
    offs_t = tblk * BLOCK_T + tl.arange(0, BLOCK_T)                                  # rows: positions in the chunk
    mask_t = pid_c * Q + offs_t < l
    mask_p = offs_p < p
    dot_ty = x_ptr.dtype.element_ty   # dots run in the inputs' dtype (fp32 on the CPU), accumulate in fp32

    chunk = ((pid_b * h + head) * c + pid_c).to(tl.int64) * Q
    cs_t = tl.load(cs_ptr + chunk + offs_t)                                          # (BLOCK_T,)
    row_t = (pid_b * l + pid_c * Q + offs_t).to(tl.int64)                            # (BLOCK_T,)
    C_rows = (row_t[:, None] * g + group) * n                                        # (BLOCK_T, 1)
    H_rows = (((pid_b * c + pid_c) * h + head) * p + offs_p[:, None]).to(tl.int64) * n   # (BLOCK_P, 1)

    # What the entering state adds: exp(cs_t) C_t Hᵀ, C Hᵀ summed over n in steps of BLOCK_K.
    ch = tl.zeros((BLOCK_T, BLOCK_P), dtype=tl.float32)
    for k0 in range(0, n, BLOCK_K):
        k = k0 + offs_k
        mask_k = k < n
        Ck = tl.load(C_ptr + C_rows + k[None, :], mask=mask_t[:, None] & mask_k[None, :], other=0.0)   # (BT, BK)
        Hk = tl.load(entering_ptr + H_rows + k[None, :], mask=mask_p[:, None] & mask_k[None, :], other=0.0)
        ch += tl.dot(Ck.to(dot_ty), tl.trans(Hk.to(dot_ty)), input_precision=DOT_PRECISION)          # (BT, BP)
    y = tl.exp(cs_t)[:, None] * ch                                                   # cs_t ≤ 0: no overflow

    # Inside the chunk: Σ_{s ≤ t} exp(cs_t - cs_s) (C_t · B_s) Δ_s x_s, over blocks of s up to the diagonal.
    for s0 in range(0, (tblk + 1) * BLOCK_T, BLOCK_T):
        offs_s = s0 + tl.arange(0, BLOCK_T)
        mask_s = pid_c * Q + offs_s < l
        row_s = (pid_b * l + pid_c * Q + offs_s).to(tl.int64)
        B_rows = (row_s[:, None] * g + group) * n                                    # (BLOCK_T, 1)
        cb = tl.zeros((BLOCK_T, BLOCK_T), dtype=tl.float32)
        for k0 in range(0, n, BLOCK_K):
            k = k0 + offs_k
            mask_k = k < n
            Ck = tl.load(C_ptr + C_rows + k[None, :], mask=mask_t[:, None] & mask_k[None, :], other=0.0)
            Bk = tl.load(B_ptr + B_rows + k[None, :], mask=mask_s[:, None] & mask_k[None, :], other=0.0)
            cb += tl.dot(Ck.to(dot_ty), tl.trans(Bk.to(dot_ty)), input_precision=DOT_PRECISION)      # (BT, BT)
        cs_s = tl.load(cs_ptr + chunk + offs_s)
        delta_s = tl.load(delta_ptr + chunk + offs_s)
        # Decay from s to t: mask the exponent first (-inf where s > t), then exp.
        causal = offs_t[:, None] >= offs_s[None, :]
        L = tl.exp(tl.where(causal, cs_t[:, None] - cs_s[None, :], float("-inf")))   # (BLOCK_T, BLOCK_T)
        scores = cb * L * delta_s[None, :]
        xs = tl.load(x_ptr + (row_s[:, None] * h + head) * p + offs_p[None, :],
                     mask=mask_s[:, None] & mask_p[None, :], other=0.0)              # (BLOCK_T, BLOCK_P)
        y += tl.dot(scores.to(dot_ty), xs.to(dot_ty), input_precision=DOT_PRECISION)

    mask_tp = mask_t[:, None] & mask_p[None, :]
    x_ptrs = (row_t[:, None] * h + head) * p + offs_p[None, :]                       # (BLOCK_T, BLOCK_P)
    x = tl.load(x_ptr + x_ptrs, mask=mask_tp, other=0.0)
    if HAS_D:
        if D_PER_DIM:
            Dv = tl.load(D_ptr + head * p + offs_p, mask=mask_p, other=0.0).to(tl.float32)[None, :]
        else:
            Dv = tl.load(D_ptr + head).to(tl.float32)
        y += x.to(tl.float32) * Dv
    if HAS_Z:
        zz = tl.load(z_ptr + x_ptrs, mask=mask_tp, other=0.0).to(tl.float32)
        y = y * zz * tl.sigmoid(zz)
    tl.store(out_ptr + x_ptrs, y.to(out_ptr.dtype.element_ty), mask=mask_tp)


def chunk_scan_fwd(x, B, C, delta, cs, entering, D, z, cfg: TileConfig, dot_precision: str = "ieee"):
    """Launch step 3. x, z (b, l, h, p) and B, C (b, l, g, n) contiguous; delta, cs (b, h, c, q) fp32;
    entering (b, c, h, p, n) fp32; D (h,) or (h, p) or None; z or None. Returns out (b, l, h, p), x's dtype."""
    b, l, h, p = x.shape
    g, n = B.shape[2], B.shape[3]
    c, q = delta.shape[2], delta.shape[3]
    out = torch.empty_like(x)
    grid = (b, c, h * (q // cfg.block_t) * triton.cdiv(p, cfg.block_p))
    chunk_scan_fwd_kernel[grid](
        x, B, C, delta, cs, entering,
        D if D is not None else x, z if z is not None else x, out,
        h, p, n, l, g, c,
        HAS_D=D is not None, D_PER_DIM=D is not None and D.dim() == 2, HAS_Z=z is not None,
        BLOCK_T=cfg.block_t, BLOCK_P=cfg.block_p, BLOCK_K=cfg.block_k, Q=cfg.chunk_size, DOT_PRECISION=dot_precision,
        num_warps=cfg.num_warps,
    )
    return out
