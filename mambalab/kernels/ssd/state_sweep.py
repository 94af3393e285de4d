"""SSD steps 1-3 in one sweep: each program walks its head's chunks in order with the state on chip.

The split forward (:mod:`~mambalab.kernels.ssd.chunk_states`, :mod:`~mambalab.kernels.ssd.state_passing`,
:mod:`~mambalab.kernels.ssd.chunk_scan`) runs one program per chunk and hands the states between its steps
through memory: S_c (b, c, h, p, n) fp32 written by step 1 and read by step 2, H_c written by step 2 and read
by step 3. Here one program per (batch row, head, block of BLOCK_P head dimensions) keeps its block of the
state H in registers (fp32) and, for c = 0 … C-1,

    store H_c                                           the entering state, for the backward (x's dtype)
    Y_t = exp(cs_t) H_c C_t                             what the entering state adds          (step 3)
        + Σ_{s ≤ t} exp(cs_t - cs_s) (C_t · B_s) Δ_s x_s   inside the chunk                      (step 3)
        + D x_t, then ⊙ silu(z_t) when given
    H_{c+1} = exp(cs_{q-1}) H_c + Σ_s exp(cs_{q-1} - cs_s) Δ_s x_s B_sᵀ                      (steps 1, 2)

and stores H_C, the final state, in fp32. In the step mode (``step`` > 0; Mamba-3) the chunk's own weights
are those of :func:`mambalab.kernels.ssd.chunk_scan._intra_weights`: a step's positions weigh its γ on each
other. The sums are those of the split steps (their math is in their
files) in the same dtypes: H_c enters the dots in x's dtype, as the stored H_c does there, and the running
state stays fp32. Nothing of size (b, c, h, p, n) but the entering states is written, and those once.

The price is parallelism: b · h · cdiv(p, BLOCK_P) programs, each walking C chunks in turn (128 programs of
64-256 chunks at the Mamba-3 benchmark's shape). A chunk is taken BLOCK_T positions at a time: the rows
t of a block see the blocks of columns s < t unmasked and their own block under the causal mask; when
q = BLOCK_T (the Mamba-3 shapes) the chunk is one block.

Backward (below the forward), used by every SSD backward: the same sweep run backwards, in one launch, so
that no chunk's dH^out_c goes through memory as a (b, c, h, p, n) fp32 tensor. Carrying G_{c+1} = dL/dH_{c+1} on chip from G_C = d final (or 0),
for c = C-1 … 0:

    store dS_c = G_{c+1}                                 (x's dtype; the chunk backward's dots read it)
    da_c = exp(a_c) <H_c, G_{c+1}>                        a_c = cs_{c, q-1}; H_c the stored entering state
    G_c  = exp(a_c) G_{c+1} + Σ_t exp(cs_t) dY_t C_tᵀ     dY_t = dout_t (⊙ silu(z_t) when gated)

and d initial = G_0. da_c is summed over the program's (BLOCK_P, BLOCK_N) tile; with more than one block of
head dimensions the blocks' sums are partials folded by :func:`mambalab.kernels.reduce.sum_partials`
(``reduction="deterministic"``) or added by tl.atomic_add (``"atomic"``). dH^out_c never reaches memory.

Packed sequences (``seq_idx``, :mod:`mambalab.kernels.ssd.packed`), in both sweeps: exp(a_c) is kept only
where one sequence covers chunk c (seq_last(c) = seq_before(c)), else 0, so neither H nor G crosses a change
of sequence; exp(cs_t) of the entering state's term only where seq_t = seq_before(c); inside the chunk
(forward) the weights where seq_t = seq_s, and the chunk's own state S from the positions of seq_last(c).

Shapes: as :func:`~mambalab.kernels.ssd.chunk_scan.chunk_scan_fwd`, with initial (b, h, p, n) fp32 or None in
place of the entering states -> (out (b, l, h, p) in x's dtype, entering (b, c, h, p, n) in x's dtype,
final (b, h, p, n) fp32). Backward: dout (b, l, h, p), entering as stored, dfinal (b, h, p, n) fp32 or None
-> (dS (b, c, h, p, n) in entering's dtype, d initial (b, h, p, n) fp32 or None, da (b, h, c) fp32).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from mambalab.kernels.reduce import sum_partials
from mambalab.kernels.ssd.chunk_scan import _gated_grad, _same_step, _skip_weight
from mambalab.kernels.ssd.chunk_states import _head_block
from mambalab.kernels.ssd.packed import _seq_before, _seq_block, _seq_last
from mambalab.kernels.ssd.tiles import TileConfig


@triton.jit
def state_sweep_fwd_kernel(
    x_ptr,            # (b, l, h, p) inputs
    B_ptr,            # (b, l, g, n)
    C_ptr,            # (b, l, g, n)
    delta_ptr,        # (b, h, c, q) fp32 Δ from step 0
    cs_ptr,           # (b, h, c, q) fp32 within-chunk cumsum of Δ A from step 0
    init_ptr,         # (b, h, p, n) fp32 initial state, or a dummy
    D_ptr,            # (h,) or (h, p) skip weights, or a dummy
    z_ptr,            # (b, l, h, p) gate, or a dummy
    out_ptr,          # (b, l, h, p) out, x's dtype
    entering_ptr,     # (b, c, h, p, n) out, x's dtype: the state entering each chunk
    final_ptr,        # (b, h, p, n) fp32 out: the state after the last chunk
    same_ptr,         # (b, h, c, q) fp32 same-step weights (STEP > 0; chunk_scan._intra_weights), or a dummy
    seq_ptr,          # (b, l) int32 sequence of each position (HAS_SEQ), or a dummy
    h, p, n, l, g, c,  # sizes
    STEP: tl.constexpr,              # positions a step (Mamba-3's ranks), 0: plain SSD
    HAS_SEQ: tl.constexpr,           # packed sequences
    HAS_INIT: tl.constexpr, HAS_D: tl.constexpr, D_PER_DIM: tl.constexpr, HAS_Z: tl.constexpr,
    BLOCK_T: tl.constexpr,           # chunk positions per block (divides Q)
    BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
    Q: tl.constexpr,                 # chunk size
    DOT_PRECISION: tl.constexpr,
):
    pid_b = tl.program_id(0)
    head, _, group, offs_p, mask_p = _head_block(tl.program_id(1), h, p, g, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    offs_b = tl.arange(0, BLOCK_T)
    mask_pn = mask_p[:, None] & (offs_n < n)[None, :]
    dot_ty = x_ptr.dtype.element_ty   # dots run in the inputs' dtype (fp32 on the CPU), accumulate in fp32

    bh = pid_b * h + head
    state = (bh * p + offs_p[:, None]).to(tl.int64) * n + offs_n[None, :]            # (BP, BN) in (b, h, p, n)
    H = tl.zeros((BLOCK_P, BLOCK_N), dtype=tl.float32)
    if HAS_INIT:
        H = tl.load(init_ptr + state, mask=mask_pn, other=0.0)
    for ci in range(0, c):
        Hd = H.to(dot_ty)                                                            # H_c as the dots see it
        at = (((pid_b * c + ci) * h + head) * p + offs_p[:, None]).to(tl.int64) * n + offs_n[None, :]
        tl.store(entering_ptr + at, Hd, mask=mask_pn)                               # entering: x's dtype
        chunk = (bh * c + ci).to(tl.int64) * Q
        cs_last = tl.load(cs_ptr + chunk + Q - 1)                                    # the chunk's log-decay
        decay = tl.exp(cs_last)
        if HAS_SEQ:
            seq_before = _seq_before(seq_ptr, pid_b, ci, l, Q)
            seq_last = _seq_last(seq_ptr, pid_b, ci, l, Q)
            decay = tl.where(seq_last == seq_before, decay, 0.0)
        S = tl.zeros((BLOCK_P, BLOCK_N), dtype=tl.float32)                           # the chunk's own state
        for t0 in range(0, Q, BLOCK_T):
            offs_t = t0 + offs_b
            mask_t = ci * Q + offs_t < l
            row_t = (pid_b * l + ci * Q + offs_t).to(tl.int64)
            mask_tn = mask_t[:, None] & (offs_n < n)[None, :]
            tp = (row_t[:, None] * h + head) * p + offs_p[None, :]
            mask_tp = mask_t[:, None] & mask_p[None, :]
            Ct = tl.load(C_ptr + (row_t[:, None] * g + group) * n + offs_n[None, :], mask=mask_tn, other=0.0)
            Bt = tl.load(B_ptr + (row_t[:, None] * g + group) * n + offs_n[None, :], mask=mask_tn, other=0.0)
            xt = tl.load(x_ptr + tp, mask=mask_tp, other=0.0)
            cs_t = tl.load(cs_ptr + chunk + offs_t)
            delta_t = tl.load(delta_ptr + chunk + offs_t)
            Ct, Bt, xd = Ct.to(dot_ty), Bt.to(dot_ty), xt.to(dot_ty)
            e_t = tl.exp(cs_t)
            w_end = tl.exp(cs_last - cs_t) * delta_t                                 # step 1's weights
            causal = offs_t[:, None] >= offs_t[None, :]
            if HAS_SEQ:
                seq_t = _seq_block(seq_ptr, row_t, mask_t)
                e_t = tl.where(seq_t == seq_before, e_t, 0.0)
                w_end = tl.where(seq_t == seq_last, w_end, 0.0)
                causal = causal & (seq_t[:, None] == seq_t[None, :])
            y = e_t[:, None] * tl.dot(Ct, tl.trans(Hd), input_precision=DOT_PRECISION)   # (BT, BP)
            # the block's own columns, under the causal mask (applied to the exponent, before the exp)
            cb = tl.dot(Ct, tl.trans(Bt), input_precision=DOT_PRECISION)
            L = tl.exp(tl.where(causal, cs_t[:, None] - cs_t[None, :], float("-inf")))
            if STEP > 0:
                # the SSD's causal weights, then the step's own block overwritten with its γ: the same W as
                # chunk_scan._intra_weights, in a form that keeps fewer masks live
                # (MIMO r = 4 forward 2.61 ms against 2.81: 2026-12-01_h200_ssd_same_step_forms_ab.json)
                W = tl.where(_same_step(offs_t, offs_t, STEP), tl.load(same_ptr + chunk + offs_t)[:, None],
                             L * delta_t[None, :])
                if HAS_SEQ:
                    W = tl.where(seq_t[:, None] == seq_t[None, :], W, 0.0)
                y += tl.dot((cb * W).to(dot_ty), xd, input_precision=DOT_PRECISION)
            else:
                y += tl.dot((cb * L * delta_t[None, :]).to(dot_ty), xd, input_precision=DOT_PRECISION)
            # earlier blocks of the chunk: every s < t
            for s0 in range(0, t0, BLOCK_T):
                offs_s = s0 + offs_b
                mask_s = ci * Q + offs_s < l
                row_s = (pid_b * l + ci * Q + offs_s).to(tl.int64)
                Bs = tl.load(B_ptr + (row_s[:, None] * g + group) * n + offs_n[None, :],
                             mask=mask_s[:, None] & (offs_n < n)[None, :], other=0.0).to(dot_ty)
                xs = tl.load(x_ptr + (row_s[:, None] * h + head) * p + offs_p[None, :],
                             mask=mask_s[:, None] & mask_p[None, :], other=0.0).to(dot_ty)
                cs_s = tl.load(cs_ptr + chunk + offs_s)
                delta_s = tl.load(delta_ptr + chunk + offs_s)
                w = tl.exp(cs_t[:, None] - cs_s[None, :]) * delta_s[None, :]          # s < t: exponent ≤ 0
                if HAS_SEQ:
                    w = tl.where(seq_t[:, None] == _seq_block(seq_ptr, row_s, mask_s)[None, :], w, 0.0)
                cb = tl.dot(Ct, tl.trans(Bs), input_precision=DOT_PRECISION)
                y += tl.dot((cb * w).to(dot_ty), xs, input_precision=DOT_PRECISION)
            if HAS_D:
                y += xt.to(tl.float32) * _skip_weight(D_ptr, head, p, offs_p, mask_p, D_PER_DIM)
            if HAS_Z:
                zz = tl.load(z_ptr + tp, mask=mask_tp, other=0.0).to(tl.float32)
                y = y * zz * tl.sigmoid(zz)
            tl.store(out_ptr + tp, y.to(out_ptr.dtype.element_ty), mask=mask_tp)
            # step 1: this block's part of the chunk's own state, weighted by its decay to the chunk's end
            xw = (xt.to(tl.float32) * w_end[:, None]).to(dot_ty)
            S += tl.dot(tl.trans(xw), Bt, input_precision=DOT_PRECISION)              # (BP, BN)
        H = decay * H + S                                                            # step 2
    tl.store(final_ptr + state, H, mask=mask_pn)


def state_sweep_fwd(x, B, C, delta, cs, initial, D, z, cfg: TileConfig, dot_precision: str = "ieee",
                    block_p: int | None = None, num_warps: int | None = None, same=None, step: int = 0,
                    seq_idx=None):
    """Launch steps 1-3 as one sweep. x, z (b, l, h, p), B, C (b, l, g, n) contiguous; delta, cs (b, h, c, q)
    fp32; initial (b, h, p, n) fp32 contiguous or None; D (h,) or (h, p) or None; z or None; seq_idx (b, l)
    int32 contiguous or None. ``block_p`` and
    ``num_warps`` default to the tile rule's (cfg.block_p, cfg.num_warps). Returns (out (b, l, h, p) and
    entering (b, c, h, p, n) in x's dtype, final (b, h, p, n) fp32)."""
    b, l, h, p = x.shape
    g, n = B.shape[2], B.shape[3]
    c, q = delta.shape[2], delta.shape[3]
    block_p = block_p or cfg.block_p
    out = torch.empty_like(x)
    entering = torch.empty(b, c, h, p, n, device=x.device, dtype=x.dtype)
    final = torch.empty(b, h, p, n, device=x.device, dtype=torch.float32)
    state_sweep_fwd_kernel[(b, h * triton.cdiv(p, block_p))](
        x, B, C, delta, cs, initial if initial is not None else final,
        D if D is not None else x, z if z is not None else x, out, entering, final,
        same if step else delta, seq_idx if seq_idx is not None else delta, h, p, n, l, g, c, STEP=step,
        HAS_SEQ=seq_idx is not None, HAS_INIT=initial is not None, HAS_D=D is not None, D_PER_DIM=D is not None and D.dim() == 2,
        HAS_Z=z is not None, BLOCK_T=cfg.block_t, BLOCK_P=block_p, BLOCK_N=cfg.block_n, Q=q,
        DOT_PRECISION=dot_precision, num_warps=num_warps or cfg.num_warps,
    )
    return out, entering, final


@triton.jit
def state_sweep_bwd_kernel(
    dout_ptr,         # (b, l, h, p) gradient of out
    z_ptr,            # (b, l, h, p) gate, or a dummy
    C_ptr,            # (b, l, g, n)
    cs_ptr,           # (b, h, c, q) fp32
    entering_ptr,     # (b, c, h, p, n) H_c, saved by the forward (x's dtype)
    dfinal_ptr,       # (b, h, p, n) fp32 gradient of the final state, or a dummy
    dstates_ptr,      # (b, c, h, p, n) out, entering's dtype: dS_c = G_{c+1}
    dinit_ptr,        # (b, h, p, n) fp32 out: G_0 (or a dummy)
    da_ptr,           # atomic: (b, h, c) fp32 zeroed; deterministic: (b, h, c, p-blocks) fp32 partials
    seq_ptr,          # (b, l) int32 sequence of each position (HAS_SEQ), or a dummy
    h, p, n, l, g, c,
    HAS_SEQ: tl.constexpr,
    HAS_Z: tl.constexpr, HAS_DFINAL: tl.constexpr, HAS_INIT: tl.constexpr, REDUCE_ATOMIC: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, Q: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid_b = tl.program_id(0)
    head, pblock, group, offs_p, mask_p = _head_block(tl.program_id(1), h, p, g, BLOCK_P)
    n_pblocks = tl.cdiv(p, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    mask_n = offs_n < n
    mask_pn = mask_p[:, None] & mask_n[None, :]
    dot_ty = C_ptr.dtype.element_ty

    bh = pid_b * h + head
    state = (bh * p + offs_p[:, None]).to(tl.int64) * n + offs_n[None, :]
    G = tl.zeros((BLOCK_P, BLOCK_N), dtype=tl.float32)                               # G_{c+1}
    if HAS_DFINAL:
        G = tl.load(dfinal_ptr + state, mask=mask_pn, other=0.0)
    for i in range(0, c):
        ci = c - 1 - i
        at = (((pid_b * c + ci) * h + head) * p + offs_p[:, None]).to(tl.int64) * n + offs_n[None, :]
        tl.store(dstates_ptr + at, G.to(dstates_ptr.dtype.element_ty), mask=mask_pn)
        chunk = (bh * c + ci).to(tl.int64) * Q
        decay = tl.exp(tl.load(cs_ptr + chunk + Q - 1))
        if HAS_SEQ:
            seq_before = _seq_before(seq_ptr, pid_b, ci, l, Q)
            decay = tl.where(_seq_last(seq_ptr, pid_b, ci, l, Q) == seq_before, decay, 0.0)
        Hc = tl.load(entering_ptr + at, mask=mask_pn, other=0.0).to(tl.float32)
        da = decay * tl.sum(tl.sum(Hc * G, axis=1), axis=0)
        if REDUCE_ATOMIC:
            tl.atomic_add(da_ptr + bh * c + ci, da)
        else:
            tl.store(da_ptr + (bh * c + ci) * n_pblocks + pblock, da)
        G = decay * G
        for t0 in range(0, Q, BLOCK_T):
            offs_t = t0 + tl.arange(0, BLOCK_T)
            mask_t = ci * Q + offs_t < l
            row_t = (pid_b * l + ci * Q + offs_t).to(tl.int64)
            dY = _gated_grad(dout_ptr, z_ptr, (row_t[:, None] * h + head) * p + offs_p[None, :],
                             mask_t[:, None] & mask_p[None, :], HAS_Z)
            Ct = tl.load(C_ptr + (row_t[:, None] * g + group) * n + offs_n[None, :],
                         mask=mask_t[:, None] & mask_n[None, :], other=0.0)
            e_t = tl.exp(tl.load(cs_ptr + chunk + offs_t))
            if HAS_SEQ:
                e_t = tl.where(_seq_block(seq_ptr, row_t, mask_t) == seq_before, e_t, 0.0)
            dYe = (dY * e_t[:, None]).to(dot_ty)
            G += tl.dot(tl.trans(dYe), Ct.to(dot_ty), input_precision=DOT_PRECISION)   # dH^out_c
    if HAS_INIT:
        tl.store(dinit_ptr + state, G, mask=mask_pn)


def state_sweep_bwd(dout, z, C, cs, entering, dfinal, has_init: bool, cfg: TileConfig, reduction: str,
                    dot_precision: str = "ieee", block_p: int | None = None, num_warps: int | None = None,
                    seq_idx=None):
    """Launch the backward sweep (module docstring). dout, z (b, l, h, p) contiguous; C (b, l, g, n); cs
    (b, h, c, q) fp32; entering (b, c, h, p, n) as the forward stored it; dfinal (b, h, p, n) fp32 or None;
    seq_idx (b, l) int32 contiguous or None.
    ``block_p`` and ``num_warps`` default to the tile rule's (cfg.sweep_bwd_block_p, cfg.num_warps).
    Returns (dstates (b, c, h, p, n) in entering's dtype, dinit (b, h, p, n) fp32 or None, da (b, h, c)
    fp32)."""
    b, c, h, p, n = entering.shape
    l, g = dout.shape[1], C.shape[2]
    q = cs.shape[3]
    block_p = block_p or cfg.sweep_bwd_block_p
    n_pblocks = triton.cdiv(p, block_p)
    atomic = reduction == "atomic"
    f32 = dict(device=dout.device, dtype=torch.float32)
    dstates = torch.empty_like(entering)
    dinit = torch.empty(b, h, p, n, **f32) if has_init else None
    da = torch.zeros(b, h, c, **f32) if atomic else torch.empty(b, h, c, n_pblocks, **f32)
    state_sweep_bwd_kernel[(b, h * n_pblocks)](
        dout, z if z is not None else dout, C, cs, entering, dfinal if dfinal is not None else dstates,
        dstates, dinit if dinit is not None else dstates, da, seq_idx if seq_idx is not None else cs,
        h, p, n, l, g, c, HAS_SEQ=seq_idx is not None,
        HAS_Z=z is not None, HAS_DFINAL=dfinal is not None, HAS_INIT=has_init, REDUCE_ATOMIC=atomic,
        BLOCK_T=cfg.block_t, BLOCK_P=block_p, BLOCK_N=cfg.block_n, Q=q, DOT_PRECISION=dot_precision,
        num_warps=num_warps or cfg.num_warps,
    )
    if not atomic:   # one block of head dimensions: its sums are the totals
        da = da.squeeze(3) if n_pblocks == 1 else sum_partials(da, dim=3)
    return dstates, dinit, da
