"""Packed sequences in the SSD kernels: which positions belong to one sequence, read from ``seq_idx``.

``seq_idx`` (b, l) int32, nondecreasing along l, gives each position's sequence; the state restarts from zero
wherever it changes (mamba-ssm's semantics). Only the sequence of a position matters, compared with another
position's, so every mask is one comparison of two loaded indices:

    inside a chunk        (t, s) contribute only if seq_t = seq_s                 (chunk scan, its backward)
    a chunk's own state   s contributes only if seq_s = seq_last(c)              (chunk states, its backward)
    the entering state    reaches t only if seq_t = seq_before(c)                (chunk scan, backward sweep)
    between chunks        H_c decays into H_{c+1} only if seq_last(c) = seq_before(c)   (state passing, sweep)

with seq_last(c) the sequence of chunk c's last position (l - 1 for the last chunk) and seq_before(c) that
of the position just before the chunk, seq_last(c - 1); seq_before(0) = 0, so ``initial_states`` is the
state of the sequence numbered 0 before its first position (and no other sequence's), as in mamba-ssm.
Because seq_idx never decreases, seq_t = seq_before(c) means that t's sequence began before chunk c, and
seq_last(c) = seq_before(c) that one sequence covers the whole chunk.

The helpers below read one index (a scalar load) or a block of them (one vector load per tile). Most chunks of a
packed row lie inside one sequence (8 sequences in 16,384 positions leave 7 of 64 chunks of 256 with a
boundary): :func:`_chunk_mixed` tells a program whether its chunk holds more than one index, and the kernels
apply the masks inside a chunk only where it does (all-true masks would change no value there).
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _seq_before(seq_ptr, pid_b, pid_c, l, Q: tl.constexpr):
    """seq_before(c): the sequence of the position just before chunk ``pid_c`` of row ``pid_b``; 0 for the
    first chunk."""
    at = tl.maximum(pid_c * Q - 1, 0)
    return tl.load(seq_ptr + (pid_b * l + at).to(tl.int64), mask=pid_c > 0, other=0)


@triton.jit
def _seq_last(seq_ptr, pid_b, pid_c, l, Q: tl.constexpr):
    """seq_last(c): the sequence of chunk ``pid_c``'s last position (l - 1 in a padded last chunk)."""
    return tl.load(seq_ptr + (pid_b * l + tl.minimum((pid_c + 1) * Q, l) - 1).to(tl.int64))


@triton.jit
def _seq_block(seq_ptr, rows, mask):
    """The sequences of a block of positions: ``rows`` their offsets in the flattened (b·l) axis (int64),
    ``mask`` the positions before l; padding gets -1 (it carries Δ = 0 and zero inputs anyway)."""
    return tl.load(seq_ptr + rows, mask=mask, other=-1)


@triton.jit
def _chunk_mixed(seq_ptr, pid_b, pid_c, l, Q: tl.constexpr):
    """Whether chunk ``pid_c`` of row ``pid_b`` holds more than one sequence index among its positions before l
    (one vector load of the chunk's Q indices, a min and a max)."""
    offs = pid_c * Q + tl.arange(0, Q)
    mask = offs < l
    seq = tl.load(seq_ptr + (pid_b * l + offs).to(tl.int64), mask=mask, other=0)
    first = tl.load(seq_ptr + (pid_b * l + pid_c * Q).to(tl.int64))
    seq = tl.where(mask, seq, first)
    return tl.min(seq, axis=0) != tl.max(seq, axis=0)
