"""Mamba-3's cumulative rotary angle, forward and backward: one pass over (b, l, h, a) each way.

Math (per batch row and head; pairs i < a; θ_{-1} the initial state's angle, 0 without one):

    θ[t, i] = θ_{-1}[i] + Σ_{s ≤ t} angles[s, i] Δ[s]

Backward, from dθ, with G[s, i] = Σ_{t ≥ s} dθ[t, i] (a cumulative sum from the end):

    d angles[s, i] = G[s, i] Δ[s],   dΔ[s] = Σ_i G[s, i] angles[s, i],   dθ_{-1}[i] = G[0, i]

Packed sequences (``seq_idx`` (b, l) int32, nondecreasing along l; :mod:`mambalab.kernels.ssd.packed`): the sums
run inside each sequence only, so θ restarts from 0 where seq changes,

    θ[t, i] = Σ_{s ≤ t, seq_s = seq_t} angles[s, i] Δ[s],    G[s, i] = Σ_{t ≥ s, seq_t = seq_s} dθ[t, i]

Both are segmented scans (:func:`_segment_sum`, :func:`_segment_sum_reverse`): a scan of (value, seq) pairs
whose combine adds two values of one sequence and otherwise keeps the later (forward) or earlier (backward)
sequence's, exact because seq never decreases. The carry between blocks is the running sum of the sequence
that the block before (after) ended (began) with, and reaches only that sequence's positions. No initial
angle goes with ``seq_idx`` (the op's packed mode starts every sequence from zero).

Programs are (batch row, head), each with all a pairs of its head; a program walks the l positions in blocks
of BLOCK_L, carrying the running sum from block to block (forward from the first position, backward from the
last), so every sum stays inside one program in a fixed order: no reduction across programs, no atomics.
Rows of a pairs are read and written where they lie in (b, l, h, a): no transposed copy, which PyTorch's
cumsum along l needs to be fast (:func:`mambalab.ref.mamba3.cumulative_angle`, the reference).

Tile rule (shape only): BLOCK_A = next_pow2(a) pairs, BLOCK_L = max(16, 4096 / BLOCK_A) positions a block.
One pass each way replaces 4 PyTorch passes forward and 6 backward
(forward 0.083 ms against about 1 ms: 2026-11-30_h200_mamba3_glue_profile.json). At b4 l4096 h32 a32 there
are 128 programs, each walking its l positions in order, so the walk waits on its loads; fetching the next
blocks while one is summed (:data:`LOOP_STAGES`) hides part of that wait.

Shapes: angles (b, l, h, a) fp32, any strides (the module passes one row of angles expanded over the heads);
dt (b, l, h) fp32 contiguous; initial (b, h, a) fp32 contiguous or None -> theta (b, l, h, a) fp32.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


# Software-pipelining stages of both loops over position blocks (tl.range's num_stages: the loads of the next
# blocks are issued while this one is summed; the additions and their order are unchanged).
# forward 0.054 ms against 0.086 at 1 stage: benchmarks/results/2026-11-30_h200_mamba3_loop_stages_ab.json
LOOP_STAGES = 3


def _blocks(a: int):
    block_a = triton.next_power_of_2(max(a, 1))
    return block_a, max(16, 4096 // block_a)


# A padding row's sequence in the segmented scans: above every real one, so that seq stays nondecreasing.
_PAD_SEQ = tl.constexpr(2 ** 30)


@triton.jit
def _combine_forward(va, sa, vb, sb):
    """Two adjacent partial sums (va, sa), (vb, sb) of a nondecreasing seq: their sum within one sequence, else
    the later sequence's (commutative, so either argument order of the scan works)."""
    return tl.where(sa == sb, va + vb, tl.where(sb > sa, vb, va)), tl.maximum(sa, sb)


@triton.jit
def _combine_reverse(va, sa, vb, sb):
    """As :func:`_combine_forward`, keeping the earlier sequence's sum (the scan from the end)."""
    return tl.where(sa == sb, va + vb, tl.where(sa < sb, va, vb)), tl.minimum(sa, sb)


@triton.jit
def _segment_sum(x, seq):
    """Σ_{s ≤ t, seq_s = seq_t} x[s] along axis 0: x (BLOCK_L, BLOCK_A), seq (BLOCK_L,) nondecreasing."""
    keys = seq[:, None] + tl.zeros(x.shape, dtype=tl.int32)
    total, _ = tl.associative_scan((x, keys), 0, _combine_forward)
    return total


@triton.jit
def _segment_sum_reverse(x, seq):
    """Σ_{t ≥ s, seq_t = seq_s} x[t] along axis 0 (shapes: :func:`_segment_sum`)."""
    keys = seq[:, None] + tl.zeros(x.shape, dtype=tl.int32)
    total, _ = tl.associative_scan((x, keys), 0, _combine_reverse, reverse=True)
    return total


@triton.jit
def _row(x, i, BLOCK_L: tl.constexpr):
    """Row ``i`` of a (BLOCK_L, ·) block, (·,)."""
    return tl.sum(tl.where((tl.arange(0, BLOCK_L) == i)[:, None], x, 0.0), axis=0)


@triton.jit
def _block_inputs(angles_ptr, dt_ptr, pid_b, hd, offs_t, offs_a, mask_a, l, h, a, stride_b, stride_l, stride_h):
    """One block of positions of a (batch row, head): its masks, the offsets of its rows in a contiguous
    (b, l, h, a) tensor, its angles (read through their strides) and its Δ, both 0 on padding rows."""
    mask_t = offs_t < l
    mask = mask_t[:, None] & mask_a[None, :]
    rows = (pid_b * l + offs_t).to(tl.int64)                           # (b, l) positions
    at = (rows[:, None] * h + hd) * a + offs_a[None, :]
    ang = tl.load(angles_ptr + pid_b.to(tl.int64) * stride_b + offs_t[:, None].to(tl.int64) * stride_l
                  + hd * stride_h + offs_a[None, :], mask=mask, other=0.0)
    d = tl.load(dt_ptr + rows * h + hd, mask=mask_t, other=0.0)
    return mask_t, mask, rows, at, ang, d


@triton.jit
def angle_cumsum_fwd_kernel(
    angles_ptr,       # (b, l, h, a) fp32, strides below (the last is 1)
    dt_ptr,           # (b, l, h) fp32
    init_ptr,         # (b, h, a) fp32 θ_{-1}, or a dummy
    seq_ptr,          # (b, l) int32 sequence of each position (HAS_SEQ), or a dummy
    theta_ptr,        # (b, l, h, a) fp32 out
    l, h, a,
    stride_b, stride_l, stride_h,
    HAS_INIT: tl.constexpr, HAS_SEQ: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_A: tl.constexpr,
    LOOP_STAGES: tl.constexpr,
):
    pid_b = tl.program_id(0)
    hd = tl.program_id(1)
    offs_a = tl.arange(0, BLOCK_A)
    mask_a = offs_a < a
    head = (pid_b * h + hd).to(tl.int64)
    carry = tl.zeros((BLOCK_A,), dtype=tl.float32)
    carry_seq = pid_b * 0                                              # the sequence the carry belongs to
    if HAS_INIT:
        carry += tl.load(init_ptr + head * a + offs_a, mask=mask_a, other=0.0)
    for start in tl.range(0, l, BLOCK_L, num_stages=LOOP_STAGES):
        offs_t = start + tl.arange(0, BLOCK_L)
        mask_t, mask, rows, at, ang, d = _block_inputs(angles_ptr, dt_ptr, pid_b, hd, offs_t, offs_a, mask_a, l,
                                                       h, a, stride_b, stride_l, stride_h)
        steps = ang * d[:, None]                                       # padding rows are 0
        if HAS_SEQ:
            seq = tl.load(seq_ptr + rows, mask=mask_t, other=_PAD_SEQ)
            theta = _segment_sum(steps, seq) + tl.where((seq == carry_seq)[:, None], carry[None, :], 0.0)
            tl.store(theta_ptr + at, theta, mask=mask)
            carry = _row(theta, BLOCK_L - 1, BLOCK_L)                  # (padding only after the last block)
            carry_seq = tl.max(seq, axis=0)
        else:
            tl.store(theta_ptr + at, carry[None, :] + tl.cumsum(steps, axis=0), mask=mask)
            carry += tl.sum(steps, axis=0)


def angle_cumsum_fwd(angles, dt, initial=None, seq_idx=None):
    """Launch the forward (shapes: module docstring; seq_idx (b, l) int32 contiguous or None, not with
    ``initial``) -> theta (b, l, h, a) fp32, contiguous."""
    b, l, h, a = angles.shape
    theta = torch.empty(b, l, h, a, device=angles.device, dtype=torch.float32)
    if theta.numel() == 0:
        return theta
    assert angles.stride(3) == 1, "angles' pairs must be contiguous"
    assert initial is None or seq_idx is None, "packed sequences start from a zero angle"
    block_a, block_l = _blocks(a)
    angle_cumsum_fwd_kernel[(b, h)](
        angles, dt, initial if initial is not None else theta, seq_idx if seq_idx is not None else dt, theta,
        l, h, a, *angles.stride()[:3], HAS_INIT=initial is not None, HAS_SEQ=seq_idx is not None,
        BLOCK_L=block_l, BLOCK_A=block_a, LOOP_STAGES=LOOP_STAGES)
    return theta


@triton.jit
def angle_cumsum_bwd_kernel(
    dtheta_ptr,       # (b, l, h, a) fp32
    angles_ptr,       # (b, l, h, a) fp32, strides below (the last is 1)
    dt_ptr,           # (b, l, h) fp32
    seq_ptr,          # (b, l) int32 sequence of each position (HAS_SEQ), or a dummy
    dangles_ptr,      # (b, l, h, a) fp32 out
    ddt_ptr,          # (b, l, h) fp32 out
    dinit_ptr,        # (b, h, a) fp32 out, or a dummy
    l, h, a,
    stride_b, stride_l, stride_h,
    HAS_INIT: tl.constexpr, HAS_SEQ: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_A: tl.constexpr,
    LOOP_STAGES: tl.constexpr,
):
    pid_b = tl.program_id(0)
    hd = tl.program_id(1)
    offs_a = tl.arange(0, BLOCK_A)
    mask_a = offs_a < a
    carry = tl.zeros((BLOCK_A,), dtype=tl.float32)                      # Σ over the positions after the block
    carry_seq = pid_b * 0 + _PAD_SEQ                                    # the sequence the carry belongs to
    blocks = tl.cdiv(l, BLOCK_L)
    for k in tl.range(0, blocks, num_stages=LOOP_STAGES):
        offs_t = (blocks - 1 - k) * BLOCK_L + tl.arange(0, BLOCK_L)    # the last block first
        mask_t, mask, rows, at, ang, d = _block_inputs(angles_ptr, dt_ptr, pid_b, hd, offs_t, offs_a, mask_a, l, h,
                                                       a, stride_b, stride_l, stride_h)
        g = tl.load(dtheta_ptr + at, mask=mask, other=0.0)
        if HAS_SEQ:
            seq = tl.load(seq_ptr + rows, mask=mask_t, other=_PAD_SEQ)
            G = _segment_sum_reverse(g, seq) + tl.where((seq == carry_seq)[:, None], carry[None, :], 0.0)
            carry = _row(G, 0, BLOCK_L)
            carry_seq = tl.min(seq, axis=0)
        else:
            G = carry[None, :] + tl.cumsum(g, axis=0, reverse=True)     # Σ_{t ≥ s} dθ[t]
            carry += tl.sum(g, axis=0)
        tl.store(dangles_ptr + at, G * d[:, None], mask=mask)
        tl.store(ddt_ptr + rows * h + hd, tl.sum(G * ang, axis=1), mask=mask_t)
    if HAS_INIT:
        tl.store(dinit_ptr + (pid_b * h + hd).to(tl.int64) * a + offs_a, carry, mask=mask_a)


def angle_cumsum_bwd(dtheta, angles, dt, has_initial: bool, seq_idx=None):
    """Launch the backward. dtheta (b, l, h, a) fp32 contiguous; seq_idx (b, l) int32 contiguous or None (not
    with ``has_initial``) -> (d angles (b, l, h, a), d dt (b, l, h), d initial (b, h, a) or None), fp32."""
    b, l, h, a = angles.shape
    f32 = dict(device=angles.device, dtype=torch.float32)
    dangles = torch.empty(b, l, h, a, **f32)
    dinit = torch.empty(b, h, a, **f32) if has_initial else None
    if dangles.numel() == 0:
        return dangles, torch.zeros(b, l, h, **f32), None if dinit is None else dinit.zero_()
    ddt = torch.empty(b, l, h, **f32)
    block_a, block_l = _blocks(a)
    assert not (has_initial and seq_idx is not None), "packed sequences start from a zero angle"
    angle_cumsum_bwd_kernel[(b, h)](
        dtheta, angles, dt, seq_idx if seq_idx is not None else dt, dangles, ddt,
        dinit if dinit is not None else ddt, l, h, a, *angles.stride()[:3], HAS_INIT=has_initial,
        HAS_SEQ=seq_idx is not None, BLOCK_L=block_l, BLOCK_A=block_a, LOOP_STAGES=LOOP_STAGES)
    return dangles, ddt, dinit
