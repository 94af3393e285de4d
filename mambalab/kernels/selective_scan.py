"""The Mamba-1 selective scan as Triton kernels: forward, and a backward with no atomic adds.

Math (per batch row, channel d, state index n; see :mod:`mambalab.ref.selective_scan`):

    a_t = exp(Δ_t A)            b_t = Δ_t u_t B_t            (both (d, n) at each step t)
    h_t = a_t ⊙ h_{t-1} + b_t    y_t = Σ_n C_t h_t + D u_t    out_t = y_t · silu(z_t)

The recurrence h_t = a_t h_{t-1} + b_t is a scan with the associative combine

    (a₁, b₁) ∘ (a₂, b₂) = (a₁ a₂,  a₂ b₁ + b₂)          (earlier element on the left)

**Layout: one channel per thread, time in registers.** A program owns ``BLOCK_D`` channels of one batch row,
one per thread (32 a warp), with each channel's whole state (``BLOCK_N`` values) in that thread's registers.
It walks the sequence in sub-blocks of ``SUB_L`` steps, which also sit in one thread's registers (16 bytes of
the input: 8 steps in 16-bit dtypes, 4 in fp32, one vector load per tensor). ``tl.associative_scan`` along
those steps is then a sequential fold inside the thread, with no data exchanged between threads, and so is
the reverse scan of the backward. Parallelism comes from the b·d channels, not from splitting the sequence.
(An earlier version spread the steps of a block across a warp's lanes: each scan then cost warp shuffles,
and a reverse scan, which Triton lowers by flipping the data across lanes, cost far more; on the H200 it was
1.4-1.6× mamba-ssm's CUDA kernel forward+backward, ``benchmarks/results/README.md``.)

**Forward.** Per sub-block and state index i (a static loop, so picking column i of the state is a register
read): a_t, b_t, their prefix combine, h_t = A*_t h_in + B*_t, y accumulated over i. The state entering
every ``CKPT_L``-th step is saved (``states``) for the backward.

**Backward.** With g_t = ∂L/∂h_t (the adjoint of the state, counting all later steps) and dy_t the
gradient reaching y_t:

    g_t = a_{t+1} ⊙ g_{t+1} + dy_t C_t              a reverse scan
    ∂L/∂C_t = Σ_d dy_t h_t        ∂L/∂B_t = Σ_d g_t Δ_t u_t        ∂L/∂u_t = Δ_t Σ_n g_t B_t + D dy_t
    ∂L/∂Δ_t = Σ_n g_t (h_t - b_t) A + u_t Σ_n g_t B_t            (a_t h_{t-1} = h_t - b_t)
    ∂L/∂A   = Σ_t Δ_t g_t (h_t - b_t)        ∂L/∂D = Σ_t dy_t u_t

Inside a sub-block the reverse scan is a fold from the last step to the first, in the thread's registers;
it enters with a_s g_s of the first step s of the later sub-block.
The saved states are ``CKPT_L`` steps apart; the backward walks those segments last to first, and in each
first recomputes the state entering each of its sub-blocks (a forward pass, kept in a per-program scratch
buffer), then walks the sub-blocks last to first. Gradients that sum over programs (A, D and delta_bias
over the batch; B and C over the channels of a program, a sum across its threads, then over programs)
are written as per-program partials and summed by :func:`mambalab.kernels.reduce.sum_partials` in a fixed
order, so the backward is bitwise reproducible and independent of the GPU it runs on.

Shapes (already validated by :mod:`mambalab.ops.selective_scan`): u, delta, z, out: (b, d, l), contiguous;
A: (d, n); B, C: (b, g, n, l) contiguous; D, delta_bias: (d,).
Tiles: picked by :func:`tile_config` from (d // g, n, l) and the input dtype alone, so results never depend
on the batch size or the machine.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from mambalab.kernels.reduce import sum_partials

@dataclass(frozen=True)
class TileConfig:
    """Tiles of both passes. ``block_d`` channels per program (one per thread: ``num_warps`` · 32 at most),
    ``block_n`` ≥ n state indices per thread, ``sub_l`` (forward) and ``bwd_sub_l`` (backward) steps per
    thread at a time, ``ckpt_l`` steps between saved states (the backward's segment; a multiple of both)."""

    block_d: int
    block_n: int
    sub_l: int
    ckpt_l: int
    num_warps: int
    bwd_sub_l: int

    def __post_init__(self):
        for name in ("sub_l", "bwd_sub_l"):
            if self.ckpt_l % getattr(self, name):
                raise ValueError(f"ckpt_l={self.ckpt_l} must be a multiple of {name}={getattr(self, name)}")
        if self.block_d > 32 * self.num_warps:
            raise ValueError(f"block_d={self.block_d} is more channels than threads ({self.num_warps} warps)")


def _largest_power_of_two_dividing(value: int, at_most: int) -> int:
    p = 1
    while p < at_most and value % (p * 2) == 0:
        p *= 2
    return p


CKPT_L = 128   # steps between saved states (at most): b · l/128 · d · n fp32 values kept for the backward


def tile_config(channels_per_group: int, n: int, l: int, dtype: torch.dtype = torch.float32) -> TileConfig:
    """The documented tile rule, from the shape and the input dtype alone (never the SM count, the batch
    size or an autotuner).

    * one warp a program, one channel a thread: BLOCK_D = 32, or the largest power of two dividing the
      channels of one B/C group when that is smaller (a program reads one group);
    * BLOCK_N = next power of two ≥ n: the whole state of a channel in its thread;
    * SUB_L = 16 bytes of input per thread in the forward: 8 steps for fp16/bf16, 4 for fp32; 4 in the
      backward (its per-step work holds more values in registers);
    * CKPT_L = 128 steps between saved states, fewer for short sequences (the power of two ≥ l, ≥ SUB_L).
    """
    sub_l = 16 // torch.empty((), dtype=dtype).element_size()
    ckpt_l = min(CKPT_L, max(sub_l, triton.next_power_of_2(max(l, 1))))
    return TileConfig(block_d=_largest_power_of_two_dividing(channels_per_group, 32),
                      block_n=triton.next_power_of_2(max(n, 1)), sub_l=sub_l, ckpt_l=ckpt_l, num_warps=1,
                      bwd_sub_l=min(4, sub_l))


@triton.jit
def _scan_combine(a_left, b_left, a_right, b_right):
    return a_left * a_right, a_right * b_left + b_right


@triton.jit
def _delta_at(delta_ptrs, mask, bias, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr):
    """Δ (SUB_L, BLOCK_D) in fp32: delta + bias (a (1, BLOCK_D) row), softplus; masked steps get Δ = 0 (a no-op)."""
    dt = tl.load(delta_ptrs, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        dt += bias
    if SOFTPLUS:
        dt = tl.where(dt <= 20.0, tl.log(1.0 + tl.exp(dt)), dt)
    return tl.where(mask, dt, 0.0)


@triton.jit
def _channel_params(bias_ptr, D_ptr, offs_d, mask_d, HAS_BIAS: tl.constexpr, HAS_D: tl.constexpr,
                    BLOCK_D: tl.constexpr):
    """delta_bias and D for this program's channels in fp32 (zeros when absent), each (BLOCK_D,)."""
    bias = tl.zeros((BLOCK_D,), dtype=tl.float32)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    Dv = tl.zeros((BLOCK_D,), dtype=tl.float32)
    if HAS_D:
        Dv = tl.load(D_ptr + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    return bias, Dv


@triton.jit
def _state(tile, offs_n, i):
    """State index i of a (BLOCK_N, BLOCK_D) tile, as (BLOCK_D,): with i static and the state in the thread's
    registers this is a register read."""
    return tl.sum(tl.where(offs_n[:, None] == i, tile, 0.0), axis=0)


@triton.jit
def _load_states(rows, offs_n, mask_d, n, BLOCK_N: tl.constexpr):
    """A (BLOCK_N, BLOCK_D) state tile from channel-major memory (``rows``: (BLOCK_D,) pointers to each
    channel's n values), one state index at a time: each load is (BLOCK_D,), one value a thread, so the
    tile stays in the one-channel-a-thread layout (a 2-D load would be vectorised along n, across threads)."""
    tile = tl.zeros((BLOCK_N, rows.shape[0]), dtype=tl.float32)
    for i in tl.static_range(BLOCK_N):
        v = tl.load(rows + i, mask=mask_d & (i < n), other=0.0).to(tl.float32)
        tile = tl.where(offs_n[:, None] == i, v[None, :], tile)
    return tile


@triton.jit
def _store_states(rows, tile, offs_n, mask_d, n, BLOCK_N: tl.constexpr):
    """Store a (BLOCK_N, BLOCK_D) state tile to channel-major memory, one state index at a time (see
    :func:`_load_states`)."""
    for i in tl.static_range(BLOCK_N):
        tl.store(rows + i, _state(tile, offs_n, i), mask=mask_d & (i < n))


@triton.jit
def _step(tile, offs_s, k):
    """Step k of a (SUB_L, BLOCK_D) tile, as (BLOCK_D,) (in-thread, as :func:`_state`)."""
    return tl.sum(tl.where(offs_s[:, None] == k, tile, 0.0), axis=0)


@triton.jit
def selective_scan_fwd_kernel(
    u_ptr,            # (b, d, l) input
    delta_ptr,        # (b, d, l) step sizes Δ before bias/softplus
    A_ptr,            # (d, n) fp32
    B_ptr,            # (b, g, n, l)
    C_ptr,            # (b, g, n, l)
    D_ptr,            # (d,) skip weight, or a dummy
    z_ptr,            # (b, d, l) gate, or a dummy
    bias_ptr,         # (d,) delta_bias, or a dummy
    out_ptr,          # (b, d, l) output
    states_ptr,       # (b, c, d, n) fp32: the state entering every CKPT_L-th step
    last_state_ptr,   # (b, d, n) fp32: the state after the last step
    d, n, l, g,       # sizes
    n_ckpt,           # c = ceil(l / CKPT_L)
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, SUB_L: tl.constexpr,
    CKPT_L: tl.constexpr,        # a multiple of SUB_L
    SAVE_STATES: tl.constexpr,   # False when no gradient will be asked for
):
    pid_b = tl.program_id(0)
    pid_d = tl.program_id(1)
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)           # one channel a thread
    offs_n = tl.arange(0, BLOCK_N)
    offs_s = tl.arange(0, SUB_L)
    mask_d = offs_d < d
    group = (pid_d * BLOCK_D) // (d // g)

    bias, Dv = _channel_params(bias_ptr, D_ptr, offs_d, mask_d, HAS_BIAS, HAS_D, BLOCK_D)
    A2 = _load_states(A_ptr + offs_d * n, offs_n, mask_d, n, BLOCK_N) * 1.4426950408889634

    row = (pid_b * d + offs_d).to(tl.int64) * l                 # (BLOCK_D,) start of each channel's row
    bc_base = ((pid_b * g + group) * n).to(tl.int64) * l        # start of this group's B/C rows
    h = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)          # the state, all n of it, per channel
    for ck in range(0, n_ckpt):
        if SAVE_STATES:  # the state entering this segment, for the backward
            _store_states(states_ptr + ((pid_b * n_ckpt + ck) * d + offs_d).to(tl.int64) * n, h, offs_n, mask_d, n,
                          BLOCK_N)
        for sb in range(0, tl.cdiv(tl.minimum(CKPT_L, l - ck * CKPT_L), SUB_L)):
            t = ck * CKPT_L + sb * SUB_L + offs_s                  # (SUB_L,)
            mask = (t < l)[:, None] & mask_d[None, :]
            ptrs = row[None, :] + t[:, None]                       # (SUB_L, BLOCK_D)
            dt = _delta_at(delta_ptr + ptrs, mask, bias[None, :], HAS_BIAS, SOFTPLUS)
            uu = tl.load(u_ptr + ptrs, mask=mask, other=0.0).to(tl.float32)
            dtu = dt * uu
            y = tl.zeros((SUB_L, BLOCK_D), dtype=tl.float32)
            for i in tl.static_range(BLOCK_N):   # each state index: an independent scan over the steps
                B_i = tl.load(B_ptr + bc_base + i * l + t, mask=(t < l) & (i < n), other=0.0).to(tl.float32)
                C_i = tl.load(C_ptr + bc_base + i * l + t, mask=(t < l) & (i < n), other=0.0).to(tl.float32)
                a = tl.exp2(dt * _state(A2, offs_n, i)[None, :])               # exp(Δ A)
                a_cum, b_cum = tl.associative_scan((a, dtu * B_i[:, None]), 0, _scan_combine)
                hs = a_cum * _state(h, offs_n, i)[None, :] + b_cum             # h_t[i], (SUB_L, BLOCK_D)
                y += hs * C_i[:, None]
                # masked (padding) steps have a = 1, b = 0: the last step is the state after step l - 1
                h = tl.where(offs_n[:, None] == i, _step(hs, offs_s, SUB_L - 1)[None, :], h)
            if HAS_D:
                y += uu * Dv[None, :]
            if HAS_Z:
                zz = tl.load(z_ptr + ptrs, mask=mask, other=0.0).to(tl.float32)
                y = y * zz * tl.sigmoid(zz)
            tl.store(out_ptr + ptrs, y.to(out_ptr.dtype.element_ty), mask=mask)
    _store_states(last_state_ptr + (pid_b * d + offs_d).to(tl.int64) * n, h, offs_n, mask_d, n, BLOCK_N)


@triton.jit
def selective_scan_bwd_kernel(
    u_ptr, delta_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, bias_ptr,   # forward inputs, as above
    dout_ptr,         # (b, d, l) gradient of the output
    states_ptr,       # (b, c, d, n) fp32 segment-start states saved by the forward
    scratch_ptr,      # (programs, CKPT_L / SUB_L + 1, BLOCK_N, BLOCK_D) fp32: per-program working memory
    du_ptr,           # (b, d, l)
    ddelta_ptr,       # (b, d, l) gradient w.r.t. delta before bias/softplus
    dz_ptr,           # (b, d, l), or a dummy
    dA_part_ptr,      # (b, d, n) fp32: this batch row's share of dA
    dD_part_ptr,      # (b, d) fp32, or a dummy
    dbias_part_ptr,   # (b, d) fp32, or a dummy
    dB_part_ptr,      # (b, d // BLOCK_D, n, l) fp32: this program's share of dB (its channels summed)
    dC_part_ptr,      # (b, d // BLOCK_D, n, l) fp32
    d, n, l, g,
    n_ckpt,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, SUB_L: tl.constexpr, CKPT_L: tl.constexpr,
):
    # Per state index i, the values this thread carries between sub-blocks (the state entering each sub-block,
    # the adjoint entering from the later one, dA) live in memory it alone reads and writes (L1-resident),
    # one (BLOCK_D,) access per i: as register tiles of BLOCK_N rows they spilled and compiled slowly.
    pid_b = tl.program_id(0)
    pid_d = tl.program_id(1)
    n_dblocks = tl.num_programs(1)
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    offs_s = tl.arange(0, SUB_L)
    mask_d = offs_d < d
    group = (pid_d * BLOCK_D) // (d // g)
    SUBS: tl.constexpr = CKPT_L // SUB_L

    bias, Dv = _channel_params(bias_ptr, D_ptr, offs_d, mask_d, HAS_BIAS, HAS_D, BLOCK_D)
    row = (pid_b * d + offs_d).to(tl.int64) * l
    bc_base = ((pid_b * g + group) * n).to(tl.int64) * l
    part_base = ((pid_b * n_dblocks + pid_d) * n).to(tl.int64) * l   # this program's dB/dC partial rows
    A_rows = A_ptr + offs_d * n                                        # (BLOCK_D,) each channel's A row
    dA_rows = dA_part_ptr + (pid_b * d + offs_d).to(tl.int64) * n     # ... and its dA partial, accumulated
    # scratch rows: 0 … SUBS-1 the state entering each sub-block of the segment, SUBS the adjoint carry a_s g_s
    work = scratch_ptr + (pid_b * n_dblocks + pid_d).to(tl.int64) * ((SUBS + 1) * BLOCK_N * BLOCK_D) \
        + tl.arange(0, BLOCK_D)                              # row i of a block: i * BLOCK_D
    carry_rows = work + SUBS * (BLOCK_N * BLOCK_D)
    for i in tl.static_range(BLOCK_N):
        zero = tl.zeros((BLOCK_D,), dtype=tl.float32)
        tl.store(carry_rows + i * BLOCK_D, zero)
        tl.store(dA_rows + i, zero, mask=mask_d & (i < n))

    dD_acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    dbias_acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for j in range(0, n_ckpt):
        ck = n_ckpt - 1 - j
        subs = tl.cdiv(tl.minimum(CKPT_L, l - ck * CKPT_L), SUB_L)
        # 1. the state entering each sub-block of this segment, from the segment's saved state
        st_rows = states_ptr + ((pid_b * n_ckpt + ck) * d + offs_d).to(tl.int64) * n
        for i in tl.static_range(BLOCK_N):
            tl.store(work + i * BLOCK_D, tl.load(st_rows + i, mask=mask_d & (i < n), other=0.0))
        for sb in range(0, subs - 1):
            t = ck * CKPT_L + sb * SUB_L + offs_s
            mask = (t < l)[:, None] & mask_d[None, :]
            ptrs = row[None, :] + t[:, None]
            dt = _delta_at(delta_ptr + ptrs, mask, bias[None, :], HAS_BIAS, SOFTPLUS)
            dtu = dt * tl.load(u_ptr + ptrs, mask=mask, other=0.0).to(tl.float32)
            for i in tl.static_range(BLOCK_N):
                B_i = tl.load(B_ptr + bc_base + i * l + t, mask=(t < l) & (i < n), other=0.0).to(tl.float32)
                A2_i = tl.load(A_rows + i, mask=mask_d & (i < n), other=0.0) * 1.4426950408889634
                a_cum, b_cum = tl.associative_scan((tl.exp2(dt * A2_i[None, :]), dtu * B_i[:, None]), 0,
                                                   _scan_combine)
                h_i = tl.load(work + sb * (BLOCK_N * BLOCK_D) + i * BLOCK_D)
                last = _step(a_cum, offs_s, SUB_L - 1) * h_i + _step(b_cum, offs_s, SUB_L - 1)
                tl.store(work + (sb + 1) * (BLOCK_N * BLOCK_D) + i * BLOCK_D, last)
        # 2. its sub-blocks, last to first
        for k in range(0, subs):
            sb = subs - 1 - k
            t = ck * CKPT_L + sb * SUB_L + offs_s
            mask = (t < l)[:, None] & mask_d[None, :]
            ptrs = row[None, :] + t[:, None]
            dt = _delta_at(delta_ptr + ptrs, mask, bias[None, :], HAS_BIAS, SOFTPLUS)
            uu = tl.load(u_ptr + ptrs, mask=mask, other=0.0).to(tl.float32)
            dout = tl.load(dout_ptr + ptrs, mask=mask, other=0.0).to(tl.float32)
            dtu = dt * uu
            dy = dout
            if HAS_Z:
                zz = tl.load(z_ptr + ptrs, mask=mask, other=0.0).to(tl.float32)
                sig = tl.sigmoid(zz)
                dy = dout * zz * sig
            y = tl.zeros((SUB_L, BLOCK_D), dtype=tl.float32)        # recomputed output (for dz)
            gB = tl.zeros((SUB_L, BLOCK_D), dtype=tl.float32)       # Σ_n g B
            ddt_a = tl.zeros((SUB_L, BLOCK_D), dtype=tl.float32)    # Σ_n g (h - b) A
            for i in tl.static_range(BLOCK_N):
                mask_i = (t < l) & (i < n)
                B_i = tl.load(B_ptr + bc_base + i * l + t, mask=mask_i, other=0.0).to(tl.float32)
                C_i = tl.load(C_ptr + bc_base + i * l + t, mask=mask_i, other=0.0).to(tl.float32)
                A_i = tl.load(A_rows + i, mask=mask_d & (i < n), other=0.0)
                # this sub-block's forward for state index i, from its starting state
                a = tl.exp2(dt * (A_i * 1.4426950408889634)[None, :])
                bx = dtu * B_i[:, None]
                a_cum, b_cum = tl.associative_scan((a, bx), 0, _scan_combine)
                hs = a_cum * tl.load(work + sb * (BLOCK_N * BLOCK_D) + i * BLOCK_D)[None, :] + b_cum
                # the adjoint, last step to first: g_t = dy_t C_t + a_{t+1} g_{t+1}, entering with a g of the
                # later sub-block's first step (a sequential fold in the thread's registers)
                c = dy * C_i[:, None]
                ag = tl.load(carry_rows + i * BLOCK_D)
                gs = tl.zeros((SUB_L, BLOCK_D), dtype=tl.float32)
                for kk in tl.static_range(SUB_L):
                    g_k = _step(c, offs_s, SUB_L - 1 - kk) + ag
                    gs = tl.where(offs_s[:, None] == SUB_L - 1 - kk, g_k[None, :], gs)
                    ag = _step(a, offs_s, SUB_L - 1 - kk) * g_k
                tl.store(carry_rows + i * BLOCK_D, ag)

                h_minus_b = hs - bx                                      # a_t h_{t-1}
                gB += gs * B_i[:, None]
                ddt_a += gs * h_minus_b * A_i[None, :]
                dA_i = tl.load(dA_rows + i, mask=mask_d & (i < n), other=0.0) + tl.sum(gs * h_minus_b * dt, axis=0)
                tl.store(dA_rows + i, dA_i, mask=mask_d & (i < n))
                if HAS_Z:
                    y += hs * C_i[:, None]
                # this program's share of dB and dC at state index i: a sum over its channels (threads)
                tl.store(dB_part_ptr + part_base + i * l + t, tl.sum(gs * dtu, axis=1), mask=mask_i)
                tl.store(dC_part_ptr + part_base + i * l + t, tl.sum(hs * dy, axis=1), mask=mask_i)

            du = dt * gB
            if HAS_D:
                du += Dv[None, :] * dy
                dD_acc += tl.sum(dy * uu, axis=0)
            if HAS_Z:
                if HAS_D:
                    y += uu * Dv[None, :]
                dz = dout * y * sig * (1.0 + zz * (1.0 - sig))
                tl.store(dz_ptr + ptrs, dz.to(dz_ptr.dtype.element_ty), mask=mask)
            ddt = ddt_a + uu * gB
            if SOFTPLUS:
                raw = tl.load(delta_ptr + ptrs, mask=mask, other=0.0).to(tl.float32)
                if HAS_BIAS:
                    raw += bias[None, :]
                ddt = tl.where(raw <= 20.0, ddt * tl.sigmoid(raw), ddt)
            ddt = tl.where(mask, ddt, 0.0)
            dbias_acc += tl.sum(ddt, axis=0)
            tl.store(du_ptr + ptrs, du.to(du_ptr.dtype.element_ty), mask=mask)
            tl.store(ddelta_ptr + ptrs, ddt.to(ddelta_ptr.dtype.element_ty), mask=mask)

    if HAS_D:
        tl.store(dD_part_ptr + pid_b * d + offs_d, dD_acc, mask=mask_d)
    if HAS_BIAS:
        tl.store(dbias_part_ptr + pid_b * d + offs_d, dbias_acc, mask=mask_d)


def _checked(cfg: TileConfig, d: int, g: int) -> TileConfig:
    if (d // g) % cfg.block_d:
        raise ValueError(f"block_d={cfg.block_d} must divide the channels per group, {d // g}")
    return cfg


def selective_scan_fwd(u, delta, A, B, C, D, z, delta_bias, delta_softplus, cfg: TileConfig | None = None,
                       save_states: bool = True):
    """Launch the forward. Inputs validated and contiguous; B, C as (b, g, n, l). ``cfg`` overrides the
    tile rule (benchmarks and tests only: the tiles fix the order of additions, so results change bits).

    Returns (out (b, d, l) in u's dtype, last_state (b, d, n) fp32, states (b, c, d, n) fp32 or None, tiles).
    """
    b, d, l = u.shape
    g, n = B.shape[1], B.shape[2]
    cfg = _checked(cfg or tile_config(d // g, n, l, u.dtype), d, g)
    n_ckpt = triton.cdiv(l, cfg.ckpt_l)
    out = torch.empty_like(u)
    states = torch.empty(b, n_ckpt, d, n, device=u.device, dtype=torch.float32) if save_states else None
    last_state = torch.empty(b, d, n, device=u.device, dtype=torch.float32)
    selective_scan_fwd_kernel[(b, triton.cdiv(d, cfg.block_d))](
        u, delta, A, B, C,
        D if D is not None else u, z if z is not None else u, delta_bias if delta_bias is not None else u,
        out, states if states is not None else last_state, last_state,
        d, n, l, g, n_ckpt,
        HAS_D=D is not None, HAS_Z=z is not None, HAS_BIAS=delta_bias is not None, SOFTPLUS=delta_softplus,
        BLOCK_D=cfg.block_d, BLOCK_N=cfg.block_n, SUB_L=cfg.sub_l, CKPT_L=cfg.ckpt_l,
        SAVE_STATES=save_states, num_warps=cfg.num_warps,
    )
    return out, last_state, states, cfg


def selective_scan_bwd(dout, u, delta, A, B, C, D, z, delta_bias, delta_softplus, states, cfg):
    """Launch the backward and reduce its partials. Returns (du, ddelta, dA, dB, dC, dD, dz, ddelta_bias)
    with B/C gradients shaped (b, g, n, l)."""
    b, d, l = u.shape
    g, n = B.shape[1], B.shape[2]
    n_ckpt = states.shape[1]
    n_dblocks = triton.cdiv(d, cfg.block_d)
    f32 = dict(device=u.device, dtype=torch.float32)
    du = torch.empty_like(u)
    ddelta = torch.empty_like(delta)
    dz = torch.empty_like(z) if z is not None else None
    dA_part = torch.empty(b, d, n, **f32)
    dD_part = torch.empty(b, d, **f32) if D is not None else None
    dbias_part = torch.empty(b, d, **f32) if delta_bias is not None else None
    dB_part = torch.empty(b, n_dblocks, n, l, **f32)
    dC_part = torch.empty(b, n_dblocks, n, l, **f32)
    scratch = torch.empty(b * n_dblocks, cfg.ckpt_l // cfg.bwd_sub_l + 1, cfg.block_n, cfg.block_d, **f32)
    selective_scan_bwd_kernel[(b, n_dblocks)](
        u, delta, A, B, C,
        D if D is not None else u, z if z is not None else u, delta_bias if delta_bias is not None else u,
        dout, states, scratch, du, ddelta, dz if dz is not None else du,
        dA_part, dD_part if dD_part is not None else dA_part, dbias_part if dbias_part is not None else dA_part,
        dB_part, dC_part,
        d, n, l, g, n_ckpt,
        HAS_D=D is not None, HAS_Z=z is not None, HAS_BIAS=delta_bias is not None, SOFTPLUS=delta_softplus,
        BLOCK_D=cfg.block_d, BLOCK_N=cfg.block_n, SUB_L=cfg.bwd_sub_l, CKPT_L=cfg.ckpt_l, num_warps=cfg.num_warps,
    )
    # Channel blocks never straddle a group (tile_config), so each group owns (d // g) // BLOCK_D of them.
    per_group = n_dblocks // g
    dB = sum_partials(dB_part.view(b, g, per_group, n, l), dim=2, out_dtype=B.dtype)
    dC = sum_partials(dC_part.view(b, g, per_group, n, l), dim=2, out_dtype=C.dtype)
    dA = sum_partials(dA_part, dim=0, out_dtype=A.dtype)
    dD = sum_partials(dD_part, dim=0, out_dtype=D.dtype) if D is not None else None
    dbias = sum_partials(dbias_part, dim=0, out_dtype=delta_bias.dtype) if delta_bias is not None else None
    return du, ddelta, dA, dB, dC, dD, dz, dbias
