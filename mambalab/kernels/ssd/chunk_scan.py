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
entering (b, c, h, p, n) in x's dtype; D (h,) or (h, p). out is written in x's dtype, padding positions skipped.
One program: (batch row, chunk, head, block of BLOCK_T rows, block of BLOCK_P head dimensions).

Packed sequences (``seq_idx``, :mod:`mambalab.kernels.ssd.packed`): the weights of the sum inside the chunk
are kept only where seq_t = seq_s (a tl.where on L, after the exp: its exponent is already ≤ 0 there), and the
entering state reaches row t only if seq_t = seq_before(c) (exp(cs_t) becomes 0 otherwise). One load of
BLOCK_T indices per block of rows or columns, and one scalar a program; the masks inside the chunk only in a
chunk that holds more than one sequence (:func:`~mambalab.kernels.ssd.packed._chunk_mixed`).

Step mode (``STEP`` > 0 positions a step; Mamba-3's rank-expanded scan, :mod:`mambalab.kernels.mamba3.chunk_scan`):
the weights L[t, s] Δ_s of the sum inside the chunk become those of :func:`_intra_weights`, where the positions
of one step all weigh that step's γ (``same``) on each other, and earlier steps keep L Δ. STEP = 0 is the SSD,
its products in their original order (so its bits do not move).

Backward (below the forward): this step's and step 1's (chunk states), in one kernel; the math is written there.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from mambalab.kernels.reduce import sum_partials
from mambalab.kernels.ssd.chunk_cb import chunk_cb
from mambalab.kernels.ssd.packed import _chunk_mixed, _seq_before, _seq_block, _seq_last
from mambalab.kernels.ssd.tiles import TileConfig, backward_block_p


@triton.jit
def _positions(pid_b, pid_c, start, l, Q: tl.constexpr, BLOCK_T: tl.constexpr):
    """BLOCK_T positions of chunk pid_c from ``start``: (offsets in the chunk, mask of those before l, their
    row in the flattened (b·l) axis as int64)."""
    offs = start + tl.arange(0, BLOCK_T)
    return offs, pid_c * Q + offs < l, (pid_b * l + pid_c * Q + offs).to(tl.int64)


@triton.jit
def _skip_weight(D_ptr, head, p, offs_p, mask_p, D_PER_DIM: tl.constexpr):
    """D of this head in fp32: a (1, BLOCK_P) row when per head dimension, else a scalar."""
    if D_PER_DIM:
        Dv = tl.load(D_ptr + head * p + offs_p, mask=mask_p, other=0.0).to(tl.float32)[None, :]
    else:
        Dv = tl.load(D_ptr + head).to(tl.float32)
    return Dv


@triton.jit
def _gated_grad(dout_ptr, z_ptr, ptrs, mask, HAS_Z: tl.constexpr):
    """dY = dout ⊙ silu(z) (or dout) at ``ptrs``, fp32."""
    dY = tl.load(dout_ptr + ptrs, mask=mask, other=0.0).to(tl.float32)
    if HAS_Z:
        zz = tl.load(z_ptr + ptrs, mask=mask, other=0.0).to(tl.float32)
        dY = dY * zz * tl.sigmoid(zz)
    return dY


@triton.jit
def _same_step(offs_t, offs_s, STEP: tl.constexpr):
    """Rows t × columns s (BLOCK_T × BLOCK_T): whether t and s are positions of one step (STEP positions a step)."""
    return (offs_t // STEP)[:, None] == (offs_s // STEP)[None, :]


@triton.jit
def _intra_weights(offs_t, offs_s, cs_t, cs_s, delta_s, same_t, STEP: tl.constexpr):
    """The chunk's weights, rows t, columns s (BLOCK_T × BLOCK_T each): (W, L, earlier).

    SSD (STEP = 0): L = exp(cs_t - cs_s) for s ≤ t, else 0, and W = L Δ_s; earlier = s < t, where W depends
    on cs. With STEP positions a step (Mamba-3's rank-expanded scan, position j = step j // STEP): the same for
    earlier steps, but the step's own positions all get the step's weight ``same_t`` (its γ) instead:

        W[t, s] = exp(cs_t - cs_s) Δ_s    step(s) < step(t)     (L, and earlier, there only)
                = same_t                  step(s) = step(t)
                = 0                       step(s) > step(t)

    The causal mask goes on the exponent before the exp, so exp never sees a positive argument."""
    if STEP > 0:
        earlier = (offs_t // STEP)[:, None] > (offs_s // STEP)[None, :]
        L = tl.exp(tl.where(earlier, cs_t[:, None] - cs_s[None, :], float("-inf")))
        W = tl.where(_same_step(offs_t, offs_s, STEP), same_t[:, None], L * delta_s[None, :])
    else:
        earlier = offs_t[:, None] > offs_s[None, :]
        L = tl.exp(tl.where(offs_t[:, None] >= offs_s[None, :], cs_t[:, None] - cs_s[None, :], float("-inf")))
        W = L * delta_s[None, :]
    return W, L, earlier


@triton.jit
def _chunk_cb_block(cb_ptr, pid_b, pid_c, group, g, c, offs_t, offs_s, Q: tl.constexpr):
    """Rows offs_t, columns offs_s (positions in the chunk) of the chunk's C Bᵀ from :mod:`chunk_cb`."""
    base = (((pid_b * c + pid_c) * g + group) * Q + offs_t[:, None]).to(tl.int64) * Q
    return tl.load(cb_ptr + base + offs_s[None, :])


@triton.jit
def _same_sequence(W, L, seq_t, seq_s):
    """W and L (rows t × columns s) kept where t and s belong to one sequence, 0 elsewhere."""
    same = seq_t[:, None] == seq_s[None, :]
    return tl.where(same, W, 0.0), tl.where(same, L, 0.0)


@triton.jit
def chunk_scan_fwd_kernel(
    x_ptr,            # (b, l, h, p) inputs
    B_ptr,            # (b, l, g, n)
    C_ptr,            # (b, l, g, n)
    delta_ptr,        # (b, h, c, q) fp32 Δ from step 0
    cs_ptr,           # (b, h, c, q) fp32 within-chunk cumsum of Δ A from step 0
    entering_ptr,     # (b, c, h, p, n) state entering each chunk, from step 2 (x's dtype)
    D_ptr,            # (h,) or (h, p) skip weights, or a dummy
    z_ptr,            # (b, l, h, p) gate, or a dummy
    out_ptr,          # (b, l, h, p) out, in x's dtype
    same_ptr,         # (b, h, c, q) fp32 the same-step weight at each position (STEP > 0), or a dummy
    seq_ptr,          # (b, l) int32 sequence of each position (HAS_SEQ), or a dummy
    cb_ptr,           # (b, c, g, q, q) fp32 C Bᵀ of each chunk (CB_PRE, chunk_cb.py), or a dummy
    h, p, n, l, g, c,  # sizes
    STEP: tl.constexpr,              # positions a step (Mamba-3's ranks; _intra_weights), 0: plain SSD
    HAS_SEQ: tl.constexpr,           # packed sequences: no weight crosses a change of seq_idx
    CB_PRE: tl.constexpr,            # C Bᵀ read from cb_ptr rather than formed here
    HAS_D: tl.constexpr,
    D_PER_DIM: tl.constexpr,         # D is (h, p) rather than (h,)
    HAS_Z: tl.constexpr,
    BLOCK_T: tl.constexpr,           # rows (chunk positions) per program, and the step over s ≤ t
    BLOCK_P: tl.constexpr, BLOCK_K: tl.constexpr,
    Q: tl.constexpr,                 # chunk size
    DOT_PRECISION: tl.constexpr,     # tl.dot input_precision for fp32 operands ("ieee": IEEE fp32)
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
    same_t = cs_t
    if STEP > 0:
        same_t = tl.load(same_ptr + chunk + offs_t)
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
    e_t = tl.exp(cs_t)                                                               # cs_t ≤ 0: no overflow
    if HAS_SEQ:
        seq_t = _seq_block(seq_ptr, row_t, mask_t)
        e_t = tl.where(seq_t == _seq_before(seq_ptr, pid_b, pid_c, l, Q), e_t, 0.0)   # began before the chunk
        mixed = _chunk_mixed(seq_ptr, pid_b, pid_c, l, Q)
    y = e_t[:, None] * ch

    # Inside the chunk: Σ_{s ≤ t} exp(cs_t - cs_s) (C_t · B_s) Δ_s x_s, over blocks of s up to the diagonal.
    for s0 in range(0, (tblk + 1) * BLOCK_T, BLOCK_T):
        offs_s, mask_s, row_s = _positions(pid_b, pid_c, s0, l, Q, BLOCK_T)
        if CB_PRE:
            cb = _chunk_cb_block(cb_ptr, pid_b, pid_c, group, g, c, offs_t, offs_s, Q)
        else:
            B_rows = (row_s[:, None] * g + group) * n                                # (BLOCK_T, 1)
            cb = tl.zeros((BLOCK_T, BLOCK_T), dtype=tl.float32)
            for k0 in range(0, n, BLOCK_K):
                k = k0 + offs_k
                mask_k = k < n
                Ck = tl.load(C_ptr + C_rows + k[None, :], mask=mask_t[:, None] & mask_k[None, :], other=0.0)
                Bk = tl.load(B_ptr + B_rows + k[None, :], mask=mask_s[:, None] & mask_k[None, :], other=0.0)
                cb += tl.dot(Ck.to(dot_ty), tl.trans(Bk.to(dot_ty)), input_precision=DOT_PRECISION)  # (BT, BT)
        cs_s = tl.load(cs_ptr + chunk + offs_s)
        delta_s = tl.load(delta_ptr + chunk + offs_s)
        W, L, earlier = _intra_weights(offs_t, offs_s, cs_t, cs_s, delta_s, same_t, STEP)   # (BT, BT)
        if HAS_SEQ:
            if mixed:
                W, L = _same_sequence(W, L, seq_t, _seq_block(seq_ptr, row_s, mask_s))
        if STEP > 0:
            scores = cb * W
        else:
            scores = cb * L * delta_s[None, :]            # the SSD's order of products (its bits unchanged)
        xs = tl.load(x_ptr + (row_s[:, None] * h + head) * p + offs_p[None, :],
                     mask=mask_s[:, None] & mask_p[None, :], other=0.0)              # (BLOCK_T, BLOCK_P)
        y += tl.dot(scores.to(dot_ty), xs.to(dot_ty), input_precision=DOT_PRECISION)

    mask_tp = mask_t[:, None] & mask_p[None, :]
    x_ptrs = (row_t[:, None] * h + head) * p + offs_p[None, :]                       # (BLOCK_T, BLOCK_P)
    x = tl.load(x_ptr + x_ptrs, mask=mask_tp, other=0.0)
    if HAS_D:
        Dv = _skip_weight(D_ptr, head, p, offs_p, mask_p, D_PER_DIM)
        y += x.to(tl.float32) * Dv
    if HAS_Z:
        zz = tl.load(z_ptr + x_ptrs, mask=mask_tp, other=0.0).to(tl.float32)
        y = y * zz * tl.sigmoid(zz)
    tl.store(out_ptr + x_ptrs, y.to(out_ptr.dtype.element_ty), mask=mask_tp)


def chunk_scan_fwd(x, B, C, delta, cs, entering, D, z, cfg: TileConfig, dot_precision: str = "ieee", same=None,
                   step: int = 0, seq_idx=None):
    """Launch step 3. x, z (b, l, h, p) and B, C (b, l, g, n) contiguous; delta, cs (b, h, c, q) fp32;
    entering (b, c, h, p, n) in x's dtype; D (h,) or (h, p) or None; z or None; with ``step`` > 0 positions a
    step, ``same`` (b, h, c, q) fp32 their same-step weights (:func:`_intra_weights`); seq_idx (b, l) int32
    contiguous or None (packed sequences). Returns out (b, l, h, p), x's dtype."""
    b, l, h, p = x.shape
    g, n = B.shape[2], B.shape[3]
    c, q = delta.shape[2], delta.shape[3]
    out = torch.empty_like(x)
    cb = chunk_cb(B, C, cfg, dot_precision) if cfg.precompute_cb else None
    grid = (b, c, h * (q // cfg.block_t) * triton.cdiv(p, cfg.block_p))
    chunk_scan_fwd_kernel[grid](
        x, B, C, delta, cs, entering,
        D if D is not None else x, z if z is not None else x, out, same if step else delta,
        seq_idx if seq_idx is not None else delta, cb if cb is not None else delta, h, p, n, l, g, c, STEP=step,
        HAS_SEQ=seq_idx is not None, CB_PRE=cb is not None,
        HAS_D=D is not None, D_PER_DIM=D is not None and D.dim() == 2, HAS_Z=z is not None,
        BLOCK_T=cfg.block_t, BLOCK_P=cfg.block_p, BLOCK_K=cfg.block_k, Q=cfg.chunk_size, DOT_PRECISION=dot_precision,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


# ---------------------------------------------------------------------------------------------- backward
# Math. Per chunk (rows t, columns s of the chunk; dY_t = dout_t ⊙ silu(z_t), or dout_t without z;
# L_ts = exp(cs_t - cs_s) for s ≤ t, else 0; CB_ts = C_t · B_s; dYx_ts = dY_t · x_s):
#
#   the gate      dz_t  = dout_t ⊙ Y_t ⊙ σ(z_t)(1 + z_t(1 - σ(z_t)))       (Y recomputed, pre-gate)
#   the skip      dx_t += D dY_t,  dD += Σ_t dY_t ⊙ x_t  (summed over p too when D is (h,))
#   the state in  dH_c^out = Σ_t exp(cs_t) dY_t C_tᵀ                     (p, n), added in state_sweep's backward
#                 dC_t += exp(cs_t) H_cᵀ dY_t,   dcs_t += exp(cs_t) dY_t · (H_c C_t)
#   the diagonal  dC_t += Σ_{s ≤ t} L_ts Δ_s dYx_ts B_s
#                 dB_s += Δ_s Σ_{t ≥ s} L_ts dYx_ts C_t
#                 dx_s += Δ_s Σ_{t ≥ s} L_ts CB_ts dY_t
#                 dΔ_s += Σ_{t ≥ s} L_ts CB_ts dYx_ts
#                 M_ts = L_ts CB_ts Δ_s dYx_ts:  dcs_t += Σ_{s < t} M_ts,  dcs_s -= Σ_{t > s} M_ts
#                 (the diagonal s = t is left out of both: exp(cs_t - cs_t) does not depend on cs, and adding
#                 +M_tt and -M_tt would leave only rounding, which step 0 multiplies by A: large for strong decay)
# and step 1's (chunk states) backward, given dS_c from state_sweep's backward (w_s = exp(cs_{q-1} - cs_s) Δ_s):
#                 dx_s += w_s dS_c B_s,  dB_s += w_s dS_cᵀ x_s,  with dw_s = x_sᵀ dS_c B_s:
#                 dΔ_s += exp(cs_{q-1} - cs_s) dw_s,  and dws_s = w_s dw_s, the gradient of the exponent
#                 cs_{q-1} - cs_s = Σ_{k > s} a_k: step 0 adds Σ_{s < k} dws_s to a_k's gradient directly
#                 (rather than +dws_s at q-1 and -dws_s at s, which would cancel in the same way)
# In step mode L_ts Δ_s becomes W_ts of _intra_weights wherever it multiplies (dC, dB, dx), dΔ_s and the dcs
# terms keep only the entries of earlier steps (the same step's weight γ_t depends on neither), and the rows
# kernel adds dγ_t = Σ_{s in t's step} CB_ts dYx_ts (written per position; Mamba-3's step 0 sums a step's ranks).
# Steps 1 and 3 share one kernel because both walk the same positions with the same x, B, Δ, cs.
# Packed sequences: the forward's masks, where its weights appear: L_ts (and W_ts) kept where seq_t = seq_s,
# exp(cs_t) where seq_t = seq_before(c) (rows kernel), w_s where seq_s = seq_last(c) (columns kernel). A
# masked weight is 0, and so is every gradient term it multiplies (dcs, dws and dΔ included).
#
# Two kernels, each with one program per (batch row, chunk, head, block of BLOCK_T positions) and the whole
# head dimension and state (tiles.backward_block_p, BLOCK_N), so sums over p and n stay inside a program:
# the rows kernel takes the block's rows t (dz, dC, the row part of dcs, dD) and walks the columns s ≤ t;
# the columns kernel takes the block's columns s (dx, dB, dΔ, the column part of dcs, dws) and walks the
# rows t ≥ s. Each output is written once, by one program. Splitting by block rather than by chunk gives
# q/BLOCK_T times more programs, and each holds one (p, n) state tile (H_c or dS_c), not two: the single
# kernel that did both passes per chunk needed the whole register file of an sm_90 SM per program.
# Sums over programs: dB and dC over the heads of a group (g < h), dD over batch rows, chunks and blocks.
# With REDUCE_ATOMIC they go into zeroed fp32 buffers by tl.atomic_add; otherwise each program writes its
# own slot (dB, dC per head (b, l, h, n); dD (h, b·c·q/BLOCK_T, p or 1)) and sum_partials folds them.


@triton.jit
def _block_program(h, p, n, g, c, Q: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_P: tl.constexpr,
                   BLOCK_N: tl.constexpr):
    """Where a backward program works: grid (b, c, h · q/BLOCK_T). Returns (batch row, chunk index, head,
    first position of its block, group, offsets and masks over p and n, the flat start of its chunk in the
    (b, h, c, q) tensors)."""
    pid_b = tl.program_id(0)
    pid_c = tl.program_id(1)
    head = tl.program_id(2) // (Q // BLOCK_T)
    start = (tl.program_id(2) % (Q // BLOCK_T)) * BLOCK_T
    offs_p = tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    chunk = ((pid_b * h + head) * c + pid_c).to(tl.int64) * Q
    return pid_b, pid_c, head, start, head // (h // g), offs_p, offs_n, offs_p < p, offs_n < n, chunk


@triton.jit
def chunk_scan_bwd_rows_kernel(
    x_ptr,            # (b, l, h, p)
    B_ptr,            # (b, l, g, n)
    C_ptr,            # (b, l, g, n)
    delta_ptr,        # (b, h, c, q) fp32 Δ
    cs_ptr,           # (b, h, c, q) fp32
    entering_ptr,     # (b, c, h, p, n) H_c (x's dtype)
    D_ptr,            # (h,) or (h, p), or a dummy
    z_ptr,            # (b, l, h, p), or a dummy
    dout_ptr,         # (b, l, h, p)
    dz_ptr,           # (b, l, h, p) out (or a dummy)
    dC_ptr,           # atomic: (b, l, g, n) fp32 zeroed; deterministic: (b, l, h, n) per head (fp32, or
                      # the caller's dtype when g = h: nothing is folded)
    dcs_row_ptr,      # (b, h, c, q) fp32 out: dcs, row part
    dD_ptr,           # atomic: (h, p or 1) fp32 zeroed; deterministic: (h, b·c·q/BLOCK_T, p or 1); or a dummy
    same_ptr,         # (b, h, c, q) fp32 same-step weights (STEP > 0), or a dummy
    dsame_ptr,        # (b, h, c, q) fp32 out: their gradient (STEP > 0), or a dummy
    seq_ptr,          # (b, l) int32 sequence of each position (HAS_SEQ), or a dummy
    cb_ptr,           # (b, c, g, q, q) fp32 C Bᵀ of each chunk (CB_PRE), or a dummy
    h, p, n, l, g, c, n_blocks_total,   # n_blocks_total = b·c·(q / BLOCK_T): dD partials per head
    STEP: tl.constexpr, HAS_SEQ: tl.constexpr, CB_PRE: tl.constexpr,
    HAS_D: tl.constexpr, D_PER_DIM: tl.constexpr, HAS_Z: tl.constexpr, REDUCE_ATOMIC: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, Q: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Rows t of one block: dz, dC, dcs (row part), dD. One program: (batch row, chunk, head, block of rows)."""
    pid_b, pid_c, head, t0, group, offs_p, offs_n, mask_p, mask_n, chunk = _block_program(
        h, p, n, g, c, Q, BLOCK_T, BLOCK_P, BLOCK_N)
    dot_ty = x_ptr.dtype.element_ty
    offs_t, mask_t, row_t = _positions(pid_b, pid_c, t0, l, Q, BLOCK_T)
    tp = (row_t[:, None] * h + head) * p + offs_p[None, :]
    mask_tp = mask_t[:, None] & mask_p[None, :]
    mask_tn = mask_t[:, None] & mask_n[None, :]
    Ct = tl.load(C_ptr + (row_t[:, None] * g + group) * n + offs_n[None, :], mask=mask_tn, other=0.0).to(dot_ty)
    cs_t = tl.load(cs_ptr + chunk + offs_t)
    e_t = tl.exp(cs_t)
    if HAS_SEQ:
        seq_t = _seq_block(seq_ptr, row_t, mask_t)
        e_t = tl.where(seq_t == _seq_before(seq_ptr, pid_b, pid_c, l, Q), e_t, 0.0)
        mixed = _chunk_mixed(seq_ptr, pid_b, pid_c, l, Q)
    same_t = cs_t
    dsame = tl.zeros((BLOCK_T,), dtype=tl.float32)
    if STEP > 0:
        same_t = tl.load(same_ptr + chunk + offs_t)
    dout = tl.load(dout_ptr + tp, mask=mask_tp, other=0.0).to(tl.float32)
    dY = dout
    if HAS_Z:
        zz = tl.load(z_ptr + tp, mask=mask_tp, other=0.0).to(tl.float32)
        sig = tl.sigmoid(zz)
        dY = dout * zz * sig
    # the state in: the chunk's entering state, needed for this block's rows alone
    pn = (((pid_b * c + pid_c) * h + head) * p + offs_p[:, None]).to(tl.int64) * n + offs_n[None, :]
    Hc = tl.load(entering_ptr + pn, mask=mask_p[:, None] & mask_n[None, :], other=0.0).to(dot_ty)   # (BP, BN)
    CH = tl.dot(Ct, tl.trans(Hc), input_precision=DOT_PRECISION)                    # (BT, BP): H_c C_t
    y = e_t[:, None] * CH
    dcs_row = e_t * tl.sum(dY * CH, axis=1)
    dY_dot = dY.to(dot_ty)
    dC = e_t[:, None] * tl.dot(dY_dot, Hc, input_precision=DOT_PRECISION)           # (BT, BN)
    # the diagonal: columns s ≤ t
    for s0 in range(0, t0 + BLOCK_T, BLOCK_T):
        offs_s, mask_s, row_s = _positions(pid_b, pid_c, s0, l, Q, BLOCK_T)
        Bs = tl.load(B_ptr + (row_s[:, None] * g + group) * n + offs_n[None, :],
                     mask=mask_s[:, None] & mask_n[None, :], other=0.0).to(dot_ty)
        xs = tl.load(x_ptr + (row_s[:, None] * h + head) * p + offs_p[None, :],
                     mask=mask_s[:, None] & mask_p[None, :], other=0.0).to(dot_ty)
        cs_s = tl.load(cs_ptr + chunk + offs_s)
        delta_s = tl.load(delta_ptr + chunk + offs_s)
        W, L, earlier = _intra_weights(offs_t, offs_s, cs_t, cs_s, delta_s, same_t, STEP)
        if HAS_SEQ:
            if mixed:
                W, L = _same_sequence(W, L, seq_t, _seq_block(seq_ptr, row_s, mask_s))
        if CB_PRE:
            CB = _chunk_cb_block(cb_ptr, pid_b, pid_c, group, g, c, offs_t, offs_s, Q)
        else:
            CB = tl.dot(Ct, tl.trans(Bs), input_precision=DOT_PRECISION)             # (BT, BT)
        dYx = tl.dot(dY_dot, tl.trans(xs), input_precision=DOT_PRECISION)            # (BT, BT)
        if STEP > 0:
            if HAS_Z:
                y += tl.dot((CB * W).to(dot_ty), xs, input_precision=DOT_PRECISION)
            Mw = W * dYx
            dsame += tl.sum(tl.where(_same_step(offs_t, offs_s, STEP), CB * dYx, 0.0), axis=1)
        else:   # the SSD's order of products (its bits unchanged)
            if HAS_Z:
                y += tl.dot((CB * L * delta_s[None, :]).to(dot_ty), xs, input_precision=DOT_PRECISION)
            Mw = L * dYx * delta_s[None, :]
        dC += tl.dot(Mw.to(dot_ty), Bs, input_precision=DOT_PRECISION)
        dcs_row += tl.sum(tl.where(earlier, Mw * CB, 0.0), axis=1)
    tl.store(dcs_row_ptr + chunk + offs_t, dcs_row)
    if STEP > 0:
        tl.store(dsame_ptr + chunk + offs_t, dsame)
    if REDUCE_ATOMIC:
        tl.atomic_add(dC_ptr + (row_t[:, None] * g + group) * n + offs_n[None, :], dC, mask=mask_tn)
    else:
        tl.store(dC_ptr + (row_t[:, None] * h + head) * n + offs_n[None, :], dC.to(dC_ptr.dtype.element_ty),
                 mask=mask_tn)
    if HAS_D or HAS_Z:
        x_t = tl.load(x_ptr + tp, mask=mask_tp, other=0.0).to(tl.float32)
    if HAS_D:
        Dv = _skip_weight(D_ptr, head, p, offs_p, mask_p, D_PER_DIM)
        y += x_t * Dv
        slot = (head * n_blocks_total + (pid_b * c + pid_c) * (Q // BLOCK_T) + t0 // BLOCK_T).to(tl.int64)
        if D_PER_DIM:
            dD = tl.sum(dY * x_t, axis=0)                                                # (BP,)
            if REDUCE_ATOMIC:
                tl.atomic_add(dD_ptr + head * p + offs_p, dD, mask=mask_p)
            else:
                tl.store(dD_ptr + slot * p + offs_p, dD, mask=mask_p)
        else:
            dD = tl.sum(tl.sum(dY * x_t, axis=1), axis=0)
            if REDUCE_ATOMIC:
                tl.atomic_add(dD_ptr + head, dD)
            else:
                tl.store(dD_ptr + slot, dD)
    if HAS_Z:
        dz = dout * y * sig * (1.0 + zz * (1.0 - sig))
        tl.store(dz_ptr + tp, dz.to(dz_ptr.dtype.element_ty), mask=mask_tp)


@triton.jit
def chunk_scan_bwd_columns_kernel(
    x_ptr,            # (b, l, h, p)
    B_ptr,            # (b, l, g, n)
    C_ptr,            # (b, l, g, n)
    delta_ptr,        # (b, h, c, q) fp32 Δ
    cs_ptr,           # (b, h, c, q) fp32
    dstates_ptr,      # (b, c, h, p, n) dS_c, from state_sweep's backward (x's dtype)
    D_ptr,            # (h,) or (h, p), or a dummy
    z_ptr,            # (b, l, h, p), or a dummy
    dout_ptr,         # (b, l, h, p)
    dx_ptr,           # (b, l, h, p) out, x's dtype
    dB_ptr,           # atomic: (b, l, g, n) fp32 zeroed; deterministic: (b, l, h, n) per head, as dC
    ddelta_ptr,       # (b, h, c, q) fp32 out: dΔ
    dcs_col_ptr,      # (b, h, c, q) fp32 out: dcs, column part
    dws_ptr,          # (b, h, c, q) fp32 out: dws_s, gradient of chunk states' exponent cs_{q-1} - cs_s
    same_ptr,         # (b, h, c, q) fp32 same-step weights (STEP > 0), or a dummy
    seq_ptr,          # (b, l) int32 sequence of each position (HAS_SEQ), or a dummy
    cb_ptr,           # (b, c, g, q, q) fp32 C Bᵀ of each chunk (CB_PRE), or a dummy
    h, p, n, l, g, c,
    STEP: tl.constexpr, HAS_SEQ: tl.constexpr, CB_PRE: tl.constexpr,
    HAS_D: tl.constexpr, D_PER_DIM: tl.constexpr, HAS_Z: tl.constexpr, REDUCE_ATOMIC: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, Q: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Columns s of one block: dx, dB, dΔ, dcs (column part) and step 1's backward.
    One program: (batch row, chunk, head, block of columns)."""
    pid_b, pid_c, head, s0, group, offs_p, offs_n, mask_p, mask_n, chunk = _block_program(
        h, p, n, g, c, Q, BLOCK_T, BLOCK_P, BLOCK_N)
    dot_ty = x_ptr.dtype.element_ty
    cs_last = tl.load(cs_ptr + chunk + Q - 1)
    offs_s, mask_s, row_s = _positions(pid_b, pid_c, s0, l, Q, BLOCK_T)
    sp = (row_s[:, None] * h + head) * p + offs_p[None, :]
    mask_sp = mask_s[:, None] & mask_p[None, :]
    mask_sn = mask_s[:, None] & mask_n[None, :]
    Bs = tl.load(B_ptr + (row_s[:, None] * g + group) * n + offs_n[None, :], mask=mask_sn, other=0.0).to(dot_ty)
    xs = tl.load(x_ptr + sp, mask=mask_sp, other=0.0)
    xs_dot = xs.to(dot_ty)
    cs_s = tl.load(cs_ptr + chunk + offs_s)
    delta_s = tl.load(delta_ptr + chunk + offs_s)
    # chunk states: S_c = Σ_s w_s x_s B_sᵀ, so the chunk's dS_c reaches these columns
    pn = (((pid_b * c + pid_c) * h + head) * p + offs_p[:, None]).to(tl.int64) * n + offs_n[None, :]
    dS = tl.load(dstates_ptr + pn, mask=mask_p[:, None] & mask_n[None, :], other=0.0).to(dot_ty)   # (BP, BN)
    w_e = tl.exp(cs_last - cs_s)
    if HAS_SEQ:
        seq_s = _seq_block(seq_ptr, row_s, mask_s)
        w_e = tl.where(seq_s == _seq_last(seq_ptr, pid_b, pid_c, l, Q), w_e, 0.0)   # the chunk's last sequence
        mixed = _chunk_mixed(seq_ptr, pid_b, pid_c, l, Q)
    w = w_e * delta_s
    dSB = tl.dot(Bs, tl.trans(dS), input_precision=DOT_PRECISION)                  # (BT, BP): dS_c B_s
    dx = w[:, None] * dSB
    dB = w[:, None] * tl.dot(xs_dot, dS, input_precision=DOT_PRECISION)            # (BT, BN)
    dw = tl.sum(xs.to(tl.float32) * dSB, axis=1)
    ddelta = w_e * dw
    dcs_col = tl.zeros((BLOCK_T,), dtype=tl.float32)
    # the diagonal: rows t ≥ s
    for t0 in range(s0, Q, BLOCK_T):
        offs_t, mask_t, row_t = _positions(pid_b, pid_c, t0, l, Q, BLOCK_T)
        tp = (row_t[:, None] * h + head) * p + offs_p[None, :]
        dY = _gated_grad(dout_ptr, z_ptr, tp, mask_t[:, None] & mask_p[None, :], HAS_Z).to(dot_ty)
        Ct = tl.load(C_ptr + (row_t[:, None] * g + group) * n + offs_n[None, :],
                     mask=mask_t[:, None] & mask_n[None, :], other=0.0).to(dot_ty)
        cs_t = tl.load(cs_ptr + chunk + offs_t)
        same_t = cs_t
        if STEP > 0:
            same_t = tl.load(same_ptr + chunk + offs_t)
        W, L, earlier = _intra_weights(offs_t, offs_s, cs_t, cs_s, delta_s, same_t, STEP)   # rows t, cols s
        if HAS_SEQ:
            if mixed:
                W, L = _same_sequence(W, L, _seq_block(seq_ptr, row_t, mask_t), seq_s)
        if CB_PRE:
            CB = _chunk_cb_block(cb_ptr, pid_b, pid_c, group, g, c, offs_t, offs_s, Q)
        else:
            CB = tl.dot(Ct, tl.trans(Bs), input_precision=DOT_PRECISION)
        LCB = L * CB
        dYx = tl.dot(dY, tl.trans(xs_dot), input_precision=DOT_PRECISION)
        if STEP > 0:
            dx += tl.dot(tl.trans((W * CB).to(dot_ty)), dY, input_precision=DOT_PRECISION)
            dB += tl.dot(tl.trans((W * dYx).to(dot_ty)), Ct, input_precision=DOT_PRECISION)
        else:   # the SSD's order of products (its bits unchanged)
            dx += delta_s[:, None] * tl.dot(tl.trans(LCB.to(dot_ty)), dY, input_precision=DOT_PRECISION)
            dB += delta_s[:, None] * tl.dot(tl.trans((L * dYx).to(dot_ty)), Ct, input_precision=DOT_PRECISION)
        G = LCB * dYx
        ddelta += tl.sum(G, axis=0)                                                    # (BT,) per column s
        dcs_col -= delta_s * tl.sum(tl.where(earlier, G, 0.0), axis=0)
    if HAS_D:
        Dv = _skip_weight(D_ptr, head, p, offs_p, mask_p, D_PER_DIM)
        dx += _gated_grad(dout_ptr, z_ptr, sp, mask_sp, HAS_Z) * Dv
    tl.store(dx_ptr + sp, dx.to(dx_ptr.dtype.element_ty), mask=mask_sp)
    if REDUCE_ATOMIC:
        tl.atomic_add(dB_ptr + (row_s[:, None] * g + group) * n + offs_n[None, :], dB, mask=mask_sn)
    else:
        tl.store(dB_ptr + (row_s[:, None] * h + head) * n + offs_n[None, :], dB.to(dB_ptr.dtype.element_ty),
                 mask=mask_sn)
    tl.store(ddelta_ptr + chunk + offs_s, ddelta)
    tl.store(dcs_col_ptr + chunk + offs_s, dcs_col)
    tl.store(dws_ptr + chunk + offs_s, w * dw)


def chunk_scan_bwd(dout, x, B, C, delta, cs, entering, dstates, D, z, cfg: TileConfig, reduction: str,
                   dot_precision: str = "ieee", bc_dtype: torch.dtype = torch.float32, same=None, step: int = 0,
                   seq_idx=None):
    """Launch the chunk backward (steps 3 and 1): the rows kernel, then the columns kernel, each with one
    program per (batch row, chunk, head, block of bwd_block_t positions). Returns (dx in x's dtype,
    dz or None, dB, dC (b, l, g, n), dD fp32 (D's shape) or None, ddelta, dcs_row, dcs_col, dws
    (b, h, c, q) fp32). dB and dC are fp32, except with ``bc_dtype`` where nothing is summed over programs
    (g = h, deterministic): each program's fp32 tile is then written once, rounded to ``bc_dtype``. With
    ``step`` > 0 positions a step and their same-step weights ``same`` (b, h, c, q) fp32 (:func:`_intra_weights`),
    also their gradient dsame (b, h, c, q) fp32, returned last. seq_idx (b, l) int32 contiguous or None:
    packed sequences, masked as the forward masks them."""
    b, l, h, p = x.shape
    g, n = B.shape[2], B.shape[3]
    c, q = delta.shape[2], delta.shape[3]
    block_t = cfg.bwd_block_t
    if step and block_t % step:
        raise ValueError(f"a step's {step} positions must not straddle a backward block of {block_t}")
    n_tblocks = q // block_t
    atomic = reduction == "atomic"
    f32 = dict(device=x.device, dtype=torch.float32)
    dx = torch.empty_like(x)
    dz = torch.empty_like(z) if z is not None else None
    bc_shape = (b, l, g, n) if atomic else (b, l, h, n)
    bc = dict(f32, dtype=bc_dtype) if g == h and not atomic else f32
    dB = (torch.zeros if atomic else torch.empty)(bc_shape, **bc)
    dC = (torch.zeros if atomic else torch.empty)(bc_shape, **bc)
    ddelta = torch.empty(b, h, c, q, **f32)
    dcs_row = torch.empty_like(ddelta)
    dcs_col = torch.empty_like(ddelta)
    dws = torch.empty_like(ddelta)
    dsame = torch.empty_like(ddelta) if step else None
    dD = None
    if D is not None:
        pd = p if D.dim() == 2 else 1
        dD = torch.zeros(h, pd, **f32) if atomic else torch.empty(h, b * c * n_tblocks, pd, **f32)
    grid = (b, c, h * n_tblocks)
    cb = chunk_cb(B, C, cfg, dot_precision) if cfg.precompute_cb else None
    flags = dict(STEP=step, HAS_SEQ=seq_idx is not None, CB_PRE=cb is not None, HAS_D=D is not None,
                 D_PER_DIM=D is not None and D.dim() == 2, HAS_Z=z is not None, REDUCE_ATOMIC=atomic, BLOCK_T=block_t,
                 BLOCK_P=backward_block_p(p), BLOCK_N=cfg.block_n, Q=q, DOT_PRECISION=dot_precision,
                 num_warps=cfg.bwd_num_warps, num_stages=cfg.bwd_num_stages)
    D_arg, z_arg = (D if D is not None else x), (z if z is not None else x)
    seq_arg = seq_idx if seq_idx is not None else delta
    cb_arg = cb if cb is not None else delta
    chunk_scan_bwd_rows_kernel[grid](
        x, B, C, delta, cs, entering, D_arg, z_arg, dout,
        dz if dz is not None else dx, dC, dcs_row, dD if dD is not None else ddelta,
        same if step else delta, dsame if step else delta, seq_arg, cb_arg,
        h, p, n, l, g, c, b * c * n_tblocks, **flags,
    )
    chunk_scan_bwd_columns_kernel[grid](
        x, B, C, delta, cs, dstates, D_arg, z_arg, dout,
        dx, dB, ddelta, dcs_col, dws, same if step else delta, seq_arg, cb_arg,
        h, p, n, l, g, c, **flags,
    )
    if not atomic and g < h:   # fold the heads of each group, in head order
        dB = sum_partials(dB.view(b * l * g, h // g, n), dim=1).view(b, l, g, n)
        dC = sum_partials(dC.view(b * l * g, h // g, n), dim=1).view(b, l, g, n)
    if dD is not None:
        if not atomic:
            dD = sum_partials(dD, dim=1)
        dD = dD.view(D.shape)
    if step:
        return dx, dz, dB, dC, dD, ddelta, dcs_row, dcs_col, dws, dsame
    return dx, dz, dB, dC, dD, ddelta, dcs_row, dcs_col, dws
