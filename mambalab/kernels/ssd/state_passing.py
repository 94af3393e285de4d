"""SSD forward, step 2: the recurrence over chunks, giving the state that enters every chunk.

Math (per batch row and head; S_c from step 1, cs from step 0):

    H_0 = initial_states (or 0)
    H_{c+1} = exp(cs_{c, q-1}) H_c + S_c          cs_{c, q-1}: the whole chunk's log-decay

With packed sequences (``seq_idx``, :mod:`mambalab.kernels.ssd.packed`) the decay term is kept only where
one sequence runs through the whole chunk, seq_last(c) = seq_before(c); otherwise H_{c+1} = S_c, the state of
the sequence that chunk c ends in, started inside it (chunk states keeps only that sequence's positions).

H_c is the state entering chunk c (what :func:`mambalab.ref.ssd.state_passing` calls ``entering``); H_C, after
the last chunk, is the final state. This is the only sequential part of SSD: C steps, not l. Every (p, n)
element evolves on its own, so the state is flattened to p·n and split into blocks of BLOCK_PN.

Shapes: states (b, c, h, p, n) fp32; cs (b, h, c, q) fp32; initial_states (b, h, p, n) fp32
-> entering states (b, c, h, p, n) in ``store_dtype``, final states (b, h, p, n) fp32.
One program: (batch row, head, block of BLOCK_PN state elements), walking the chunks in order.

Backward: in :mod:`mambalab.kernels.ssd.state_sweep` (``state_sweep_bwd``), which walks the chunks backwards
with the gradient of H on chip and adds the chunk outputs' part to it on the way; its math is written there.

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

from mambalab.kernels.ssd.packed import _seq_last
from mambalab.kernels.ssd.tiles import TileConfig


@triton.jit
def state_passing_fwd_kernel(
    states_ptr,       # (b, c, h, p·n) fp32: each chunk's own state, from step 1
    cs_ptr,           # (b, h, c, q) fp32: within-chunk cumsum; position q-1 is the chunk's decay
    init_ptr,         # (b, h, p·n) fp32 initial states, or a dummy
    entering_ptr,     # (b, c, h, p·n) out, its own dtype: the state entering each chunk
    final_ptr,        # (b, h, p·n) fp32 out: the state after the last chunk
    seq_ptr,          # (b, l) int32 sequence of each position (HAS_SEQ), or a dummy
    h, pn, c, l,      # sizes (pn = p·n)
    HAS_INIT: tl.constexpr,
    HAS_SEQ: tl.constexpr,    # packed sequences: the state restarts where the sequence changes
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
    seq_before = tl.full((), 0, tl.int32)                            # seq_before(0): initial_states' sequence
    for ci in range(0, c):
        at = ((pid_b * c + ci) * h + pid_h).to(tl.int64) * pn + offs
        tl.store(entering_ptr + at, running.to(entering_ptr.dtype.element_ty), mask=mask)
        decay = tl.exp(tl.load(cs_ptr + (bh * c + ci).to(tl.int64) * Q + Q - 1))   # scalar, ≤ 1 for A ≤ 0
        if HAS_SEQ:
            seq_last = _seq_last(seq_ptr, pid_b, ci, l, Q)
            decay = tl.where(seq_last == seq_before, decay, 0.0)    # a new sequence: H_c does not carry on
            seq_before = seq_last
        running = decay * running + tl.load(states_ptr + at, mask=mask, other=0.0)
    tl.store(final_ptr + bh.to(tl.int64) * pn + offs, running, mask=mask)


def state_passing_fwd(states, cs, initial_states, cfg: TileConfig, store_dtype=torch.float32, seq_idx=None):
    """Launch step 2. states (b, c, h, p, n) fp32 contiguous; cs (b, h, c, q) fp32; initial_states
    (b, h, p, n) fp32 contiguous or None; store_dtype: the entering states' dtype, the dots' (module
    docstring); seq_idx (b, l) int32 contiguous or None. Returns (entering states (b, c, h, p, n) in
    store_dtype, final states (b, h, p, n) fp32)."""
    b, c, h, p, n = states.shape
    entering = torch.empty_like(states, dtype=store_dtype)
    final = torch.empty(b, h, p, n, device=states.device, dtype=torch.float32)
    grid = (b, h, triton.cdiv(p * n, cfg.block_pn))
    state_passing_fwd_kernel[grid](
        states, cs, initial_states if initial_states is not None else final, entering, final,
        seq_idx if seq_idx is not None else final, h, p * n, c, seq_idx.shape[1] if seq_idx is not None else 1,
        HAS_INIT=initial_states is not None, HAS_SEQ=seq_idx is not None, BLOCK_PN=cfg.block_pn, Q=cfg.chunk_size,
        num_warps=cfg.num_warps,
    )
    return entering, final
