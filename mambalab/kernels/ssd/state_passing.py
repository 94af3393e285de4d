"""SSD forward, step 2: the recurrence over chunks, giving the state that enters every chunk.

Math (per batch row and head; S_c from step 1, cs from step 0):

    H_0 = initial_states (or 0)
    H_{c+1} = exp(cs_{c, q-1}) H_c + S_c          cs_{c, q-1}: the whole chunk's log-decay

H_c is the state entering chunk c (what :func:`mambalab.ref.ssd.state_passing` calls ``entering``); H_C, after
the last chunk, is the final state. This is the only sequential part of SSD: C steps, not l. Every (p, n)
element evolves on its own, so the state is flattened to p·n and split into blocks of BLOCK_PN.

Shapes: states (b, c, h, p, n) fp32; cs (b, h, c, q) fp32; initial_states (b, h, p, n) fp32
-> entering states (b, c, h, p, n) in ``store_dtype``, final states (b, h, p, n) fp32.
One program: (batch row, head, block of BLOCK_PN state elements), walking the chunks in order.

Storage. The recurrence runs in fp32 (``running`` below), and the final state stays fp32. The per-chunk
tensors it hands on, the entering states H_c here and the gradients dS_c in the backward, are stored in the
dots' dtype, the inputs' (bf16/fp16 on a GPU, fp32 on the CPU interpreter). The chunk scan's kernels convert
them to that dtype before every tl.dot anyway, so storing them there changes none of their results. It does
halve the largest traffic of the scan at 16-bit inputs: (b, c, h, p, n) is 268 MB in fp32 for SISO Mamba-3 at
b4 l4096 h32 p64 n128 and 1.07 GB for MIMO r = 4. One consumer reads H_c outside a dot: the backward's
da_c = exp(a_c) <H_c, G_{c+1}> (fp32 products of the stored H_c). mamba-ssm also keeps these states in the
inputs' dtype.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from mambalab.kernels.reduce import sum_partials
from mambalab.kernels.ssd.tiles import TileConfig


@triton.jit
def state_passing_fwd_kernel(
    states_ptr,       # (b, c, h, p·n) fp32: each chunk's own state, from step 1
    cs_ptr,           # (b, h, c, q) fp32: within-chunk cumsum; position q-1 is the chunk's decay
    init_ptr,         # (b, h, p·n) fp32 initial states, or a dummy
    entering_ptr,     # (b, c, h, p·n) out, its own dtype: the state entering each chunk
    final_ptr,        # (b, h, p·n) fp32 out: the state after the last chunk
    h, pn, c,         # sizes (pn = p·n)
    HAS_INIT: tl.constexpr,
    BLOCK_PN: tl.constexpr,   # state elements per program
    Q: tl.constexpr,          # chunk size
):
    pid_b = tl.program_id(0)
    pid_h = tl.program_id(1)
    pid_e = tl.program_id(2)
    offs = pid_e * BLOCK_PN + tl.arange(0, BLOCK_PN)
    mask = offs < pn
    bh = pid_b * h + pid_h

    running = tl.zeros((BLOCK_PN,), dtype=tl.float32)
    if HAS_INIT:
        running = tl.load(init_ptr + bh.to(tl.int64) * pn + offs, mask=mask, other=0.0).to(tl.float32)
    for ci in range(0, c):
        at = ((pid_b * c + ci) * h + pid_h).to(tl.int64) * pn + offs
        tl.store(entering_ptr + at, running.to(entering_ptr.dtype.element_ty), mask=mask)
        decay = tl.exp(tl.load(cs_ptr + (bh * c + ci).to(tl.int64) * Q + Q - 1))   # scalar, ≤ 1 for A ≤ 0
        running = decay * running + tl.load(states_ptr + at, mask=mask, other=0.0)
    tl.store(final_ptr + bh.to(tl.int64) * pn + offs, running, mask=mask)


def state_passing_fwd(states, cs, initial_states, cfg: TileConfig, store_dtype=torch.float32):
    """Launch step 2. states (b, c, h, p, n) fp32 contiguous; cs (b, h, c, q) fp32; initial_states
    (b, h, p, n) fp32 contiguous or None; store_dtype: the entering states' dtype, the dots' (module
    docstring). Returns (entering states (b, c, h, p, n) in store_dtype, final states (b, h, p, n) fp32)."""
    b, c, h, p, n = states.shape
    entering = torch.empty_like(states, dtype=store_dtype)
    final = torch.empty(b, h, p, n, device=states.device, dtype=torch.float32)
    grid = (b, h, triton.cdiv(p * n, cfg.block_pn))
    state_passing_fwd_kernel[grid](
        states, cs, initial_states if initial_states is not None else final, entering, final,
        h, p * n, c,
        HAS_INIT=initial_states is not None, BLOCK_PN=cfg.block_pn, Q=cfg.chunk_size, num_warps=cfg.num_warps,
    )
    return entering, final


# ---------------------------------------------------------------------------------------------- backward
# Math. With a_c = cs_{c, q-1} and H_{c+1} = exp(a_c) H_c + S_c, walk the chunks backwards carrying
# G_{c+1} = dL/dH_{c+1} (all paths): G_C = d final_states (or 0), and for c = C-1 … 0
#     dS_c  = G_{c+1}                                      the chunk state's gradient (to step 1's backward)
#     da_c  = exp(a_c) <H_c, G_{c+1}>                       summed over the p·n elements: a reduction over
#                                                           the BLOCK_PN blocks of the state
#     G_c   = dH_c^out + exp(a_c) G_{c+1}                   dH_c^out: what chunk c's outputs send to H_c
# and d initial_states = G_0. da_c joins dcs at the chunk's last position (step 0's backward).
# REDUCE_ATOMIC adds each block's da_c into a zeroed fp32 (b, h, c) with tl.atomic_add; otherwise each block
# writes its own slot of (b, h, c, n_blocks) partials, folded by sum_partials.


@triton.jit
def state_passing_bwd_kernel(
    entering_ptr,     # (b, c, h, p·n) H_c, saved by the forward (the dots' dtype)
    cs_ptr,           # (b, h, c, q) fp32
    dout_states_ptr,  # (b, c, h, p·n) fp32 dH_c^out, from the chunk scan's outputs
    dfinal_ptr,       # (b, h, p·n) fp32 gradient of the final states, or a dummy
    dstates_ptr,      # (b, c, h, p·n) out, entering's dtype: dS_c
    dinit_ptr,        # (b, h, p·n) fp32 out: d initial_states (or a dummy)
    da_ptr,           # atomic: (b, h, c) fp32 zeroed; deterministic: (b, h, c, n_blocks) fp32 partials
    h, pn, c, n_blocks,
    HAS_DFINAL: tl.constexpr, HAS_INIT: tl.constexpr, REDUCE_ATOMIC: tl.constexpr,
    BLOCK_PN: tl.constexpr, Q: tl.constexpr,
):
    pid_b = tl.program_id(0)
    pid_h = tl.program_id(1)
    pid_e = tl.program_id(2)
    offs = pid_e * BLOCK_PN + tl.arange(0, BLOCK_PN)
    mask = offs < pn
    bh = pid_b * h + pid_h

    running = tl.zeros((BLOCK_PN,), dtype=tl.float32)              # G_{c+1}
    if HAS_DFINAL:
        running = tl.load(dfinal_ptr + bh.to(tl.int64) * pn + offs, mask=mask, other=0.0).to(tl.float32)
    for i in range(0, c):
        ci = c - 1 - i
        at = ((pid_b * c + ci) * h + pid_h).to(tl.int64) * pn + offs
        tl.store(dstates_ptr + at, running.to(dstates_ptr.dtype.element_ty), mask=mask)
        decay = tl.exp(tl.load(cs_ptr + (bh * c + ci).to(tl.int64) * Q + Q - 1))
        Hc = tl.load(entering_ptr + at, mask=mask, other=0.0).to(tl.float32)
        da = decay * tl.sum(Hc * running, axis=0)
        if REDUCE_ATOMIC:
            tl.atomic_add(da_ptr + (bh * c + ci).to(tl.int64), da)
        else:
            tl.store(da_ptr + (bh * c + ci).to(tl.int64) * n_blocks + pid_e, da)
        running = tl.load(dout_states_ptr + at, mask=mask, other=0.0) + decay * running
    if HAS_INIT:
        tl.store(dinit_ptr + bh.to(tl.int64) * pn + offs, running, mask=mask)


def state_passing_bwd(entering, cs, dout_states, dfinal, has_init, cfg: TileConfig, reduction: str):
    """Launch step 2's backward. entering (b, c, h, p, n) in the dots' dtype; dout_states (b, c, h, p, n)
    fp32; cs (b, h, c, q); dfinal (b, h, p, n) fp32 or None. Returns (dstates (b, c, h, p, n) in entering's
    dtype, which only the chunk scan's dots read (module docstring), dinit (b, h, p, n) fp32 or None, da
    (b, h, c) fp32)."""
    b, c, h, p, n = entering.shape
    n_blocks = triton.cdiv(p * n, cfg.block_pn)
    atomic = reduction == "atomic"
    dstates = torch.empty_like(entering)
    dinit = torch.empty(b, h, p, n, device=entering.device, dtype=torch.float32) if has_init else None
    shape = (b, h, c) if atomic else (b, h, c, n_blocks)
    da = (torch.zeros if atomic else torch.empty)(shape, device=entering.device, dtype=torch.float32)
    state_passing_bwd_kernel[(b, h, n_blocks)](
        entering, cs, dout_states, dfinal if dfinal is not None else dstates, dstates,
        dinit if dinit is not None else dstates, da,
        h, p * n, c, n_blocks,
        HAS_DFINAL=dfinal is not None, HAS_INIT=has_init, REDUCE_ATOMIC=atomic,
        BLOCK_PN=cfg.block_pn, Q=cfg.chunk_size, num_warps=cfg.num_warps,
    )
    if not atomic:
        da = sum_partials(da, dim=3)
    return dstates, dinit, da
