"""SSD forward, step 1: the state each chunk leaves behind when it starts from zero.

Math (per batch row, chunk c, head h; s runs over the q positions of the chunk, cs from step 0):

    S_c = Σ_s exp(cs_{q-1} - cs_s) Δ_s x_s B_sᵀ        (p, n)

exp(cs_{q-1} - cs_s) is the decay from just after step s to the chunk's end (a within-chunk difference,
≤ 0 for A ≤ 0, so the exp never overflows). As a matrix product over the chunk's positions:
S_c = (w ⊙ X_c)ᵀ B_c with w_s = exp(cs_{q-1} - cs_s) Δ_s: tl.dots of (BLOCK_P, BLOCK_T) by (BLOCK_T, BLOCK_N),
summed over the chunk's positions BLOCK_T at a time.
Padding positions (past l) load x = B = 0 and have Δ = 0, so they add nothing.

Packed sequences (``seq_idx``, :mod:`mambalab.kernels.ssd.packed`): the state a chunk hands on is that of its
last position's sequence, so only s with seq_s = seq_last(c) contribute (w_s = 0 for the others).

Per-sequence final states (:func:`varlen_states_fwd`, mamba-ssm's ``return_varlen_states``): for a sequence
whose last position is e, in chunk c_e = e // q at offset u = e - c_e q,

    V = [seq_e = seq_before(c_e)] exp(cs_u) H_{c_e} + Σ_{s ≤ u, seq_s = seq_e} exp(cs_u - cs_s) Δ_s x_s B_sᵀ

the state after e (the one out_e reads), from the entering state H_{c_e} of step 2 and the chunk's positions up
to e: one program per (sequence, head, block of BLOCK_P head dimensions), b = 1.

Backward: in :mod:`mambalab.kernels.ssd.chunk_scan` (``chunk_scan_bwd``), which walks the same positions with
the same x, B, Δ and cs; its math is written there.

Shapes: x (b, l, h, p), B (b, l, g, n) contiguous, head i reading group i // (h // g); Δ, cs (b, h, c, q) fp32
-> states (b, c, h, p, n) fp32. One program: (batch row, chunk, head, block of BLOCK_P head dimensions).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from mambalab.kernels.ssd.packed import _seq_before, _seq_block, _seq_last
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
    seq_ptr,          # (b, l) int32 sequence of each position (HAS_SEQ), or a dummy
    h, p, n, l, g, c,  # sizes
    HAS_SEQ: tl.constexpr,           # packed sequences: only the last position's sequence contributes
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
    if HAS_SEQ:
        seq_last = _seq_last(seq_ptr, pid_b, pid_c, l, Q)
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
        if HAS_SEQ:
            w = tl.where(_seq_block(seq_ptr, row, mask_s) == seq_last, w, 0.0)
        xw = (x.to(tl.float32) * w[:, None]).to(dot_ty)                             # (BLOCK_T, BLOCK_P)
        S += tl.dot(tl.trans(xw), Bs.to(dot_ty), input_precision=DOT_PRECISION)     # (BLOCK_P, BLOCK_N) fp32

    out = (((pid_b * c + pid_c) * h + head) * p + offs_p[:, None]).to(tl.int64) * n + offs_n[None, :]
    tl.store(states_ptr + out, S, mask=mask_p[:, None] & mask_n[None, :])


def chunk_states_fwd(x, B, delta, cs, cfg: TileConfig, dot_precision: str = "ieee", seq_idx=None):
    """Launch step 1. x (b, l, h, p), B (b, l, g, n) contiguous; delta, cs (b, h, c, q) fp32 from step 0;
    seq_idx (b, l) int32 contiguous or None.

    Returns the chunk states (b, c, h, p, n) fp32.
    """
    b, l, h, p = x.shape
    g, n = B.shape[2], B.shape[3]
    c = delta.shape[2]
    states = torch.empty(b, c, h, p, n, device=x.device, dtype=torch.float32)
    grid = (b, c, h * triton.cdiv(p, cfg.block_p))
    chunk_states_fwd_kernel[grid](
        x, B, delta, cs, states, seq_idx if seq_idx is not None else delta,
        h, p, n, l, g, c, HAS_SEQ=seq_idx is not None,
        BLOCK_T=cfg.states_block_t, BLOCK_P=cfg.block_p, BLOCK_N=cfg.block_n, Q=cfg.chunk_size,
        DOT_PRECISION=dot_precision, num_warps=cfg.states_num_warps,
    )
    return states


@triton.jit
def varlen_states_fwd_kernel(
    x_ptr,            # (1, l, h, p) inputs
    B_ptr,            # (1, l, g, n)
    delta_ptr,        # (1, h, c, q) fp32 Δ from step 0
    cs_ptr,           # (1, h, c, q) fp32 within-chunk cumsum of Δ A from step 0
    entering_ptr,     # (1, c, h, p, n) the state entering each chunk, from step 2 (x's dtype)
    seq_ptr,          # (1, l) int32 sequence of each position (HAS_SEQ), or a dummy
    cu_ptr,           # (num_seqs + 1,) the sequences' first positions, then l' (their end)
    out_ptr,          # (num_seqs, h, p, n) fp32 out: each sequence's state after its last position
    h, p, n, l, g, c,  # sizes
    HAS_SEQ: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
    Q: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid_i = tl.program_id(0)                                                         # the sequence
    head, _, group, offs_p, mask_p = _head_block(tl.program_id(1), h, p, g, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    offs_t = tl.arange(0, BLOCK_T)
    mask_n = offs_n < n
    mask_pn = mask_p[:, None] & mask_n[None, :]
    dot_ty = x_ptr.dtype.element_ty

    first = tl.load(cu_ptr + pid_i).to(tl.int32)
    e = (tl.load(cu_ptr + pid_i + 1) - 1).to(tl.int32)                              # the sequence's last position
    nonempty = e >= first                                                            # an empty one's state is 0
    e = tl.maximum(e, 0)
    ce = e // Q
    u = e - ce * Q                                                                   # its offset in chunk ce
    chunk = (head * c + ce).to(tl.int64) * Q
    cs_u = tl.load(cs_ptr + chunk + u)
    keep = tl.where(nonempty, tl.exp(cs_u), 0.0)                                     # decay of H_ce up to e
    if HAS_SEQ:
        seq_e = tl.load(seq_ptr + e)
        keep = tl.where(seq_e == _seq_before(seq_ptr, 0, ce, l, Q), keep, 0.0)
    at = ((ce * h + head) * p + offs_p[:, None]).to(tl.int64) * n + offs_n[None, :]
    V = keep * tl.load(entering_ptr + at, mask=mask_pn, other=0.0).to(tl.float32)
    for s0 in range(0, u + 1, BLOCK_T):   # the chunk's positions up to e
        s = s0 + offs_t
        mine = (s <= u) & nonempty                                                  # (and so before l)
        row = (ce * Q + s).to(tl.int64)
        if HAS_SEQ:
            mine = mine & (_seq_block(seq_ptr, row, mine) == seq_e)
        x = tl.load(x_ptr + (row[:, None] * h + head) * p + offs_p[None, :],
                    mask=mine[:, None] & mask_p[None, :], other=0.0)                 # (BLOCK_T, BLOCK_P)
        Bs = tl.load(B_ptr + (row[:, None] * g + group) * n + offs_n[None, :],
                     mask=mine[:, None] & mask_n[None, :], other=0.0)                # (BLOCK_T, BLOCK_N)
        cs = tl.load(cs_ptr + chunk + s)
        delta = tl.load(delta_ptr + chunk + s)
        w = tl.exp(tl.where(mine, cs_u - cs, float("-inf"))) * delta                 # exponent ≤ 0 where kept
        xw = (x.to(tl.float32) * w[:, None]).to(dot_ty)
        V += tl.dot(tl.trans(xw), Bs.to(dot_ty), input_precision=DOT_PRECISION)
    out = ((pid_i * h + head) * p + offs_p[:, None]).to(tl.int64) * n + offs_n[None, :]
    tl.store(out_ptr + out, V, mask=mask_pn)


def varlen_states_fwd(x, B, delta, cs, entering, seq_idx, cu_seqlens, cfg: TileConfig, dot_precision: str = "ieee"):
    """Each packed sequence's final state (module docstring). x (1, l, h, p), B (1, l, g, n) contiguous; delta,
    cs (1, h, c, q) fp32; entering (1, c, h, p, n) from step 2; seq_idx (1, l) int32 or None; cu_seqlens
    (num_seqs + 1,) integers, nondecreasing from 0 to at most l (validated by the op; an empty sequence's
    state is zero).

    Returns (num_seqs, h, p, n) fp32.
    """
    _, l, h, p = x.shape
    g, n = B.shape[2], B.shape[3]
    c = delta.shape[2]
    num_seqs = cu_seqlens.shape[0] - 1
    out = torch.empty(num_seqs, h, p, n, device=x.device, dtype=torch.float32)
    grid = (num_seqs, h * triton.cdiv(p, cfg.block_p))
    varlen_states_fwd_kernel[grid](
        x, B, delta, cs, entering, seq_idx if seq_idx is not None else cu_seqlens, cu_seqlens, out,
        h, p, n, l, g, c, HAS_SEQ=seq_idx is not None,
        BLOCK_T=cfg.states_block_t, BLOCK_P=cfg.block_p, BLOCK_N=cfg.block_n, Q=cfg.chunk_size,
        DOT_PRECISION=dot_precision, num_warps=cfg.states_num_warps,
    )
    return out
