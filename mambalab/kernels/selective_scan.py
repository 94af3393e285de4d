"""The Mamba-1 selective scan as Triton kernels: forward, and a backward with no atomic adds.

Math (per batch row, channel d, state index n; see :mod:`mambalab.ref.selective_scan`):

    a_t = exp(Δ_t A)            b_t = Δ_t u_t B_t            (both (d, n) at each step t)
    h_t = a_t ⊙ h_{t-1} + b_t    y_t = Σ_n C_t h_t + D u_t    out_t = y_t · silu(z_t)

**Forward.** The recurrence h_t = a_t h_{t-1} + b_t is a scan with the associative combine

    (a₁, b₁) ∘ (a₂, b₂) = (a₁ a₂,  a₂ b₁ + b₂)          (earlier element on the left)

so inside a block of ``BLOCK_L`` time steps all prefixes come from one ``tl.associative_scan`` (parallel,
log-depth), and the state carried in from the previous block enters as h_t = A*_t h_in + B*_t. Blocks are
walked in order. The state is carried through memory (``states``): the steps that end backward blocks
(and the last step) write their states, picked out of each state index's scan by one reduction over a
(BLOCK_D, BLOCK_L / CKPT_L, CKPT_L) view, and the next block reads its start back as a (BLOCK_D,) column;
without a backward the slots are the forward's blocks' ends only;
with a gate z it also saves y before the gate, which the backward needs for dz (instead of recomputing
Σ_n C h, one load of C and a multiply-add per state index and step).

**Backward.** With g_t = ∂L/∂h_t (the adjoint of the state, counting all later steps) and dy_t the
gradient reaching y_t:

    g_t = a_{t+1} ⊙ g_{t+1} + dy_t C_t              a scan from the end, same combine
    ∂L/∂C_t = Σ_d dy_t h_t        ∂L/∂B_t = Σ_d g_t Δ_t u_t        ∂L/∂u_t = Δ_t Σ_n g_t B_t + D dy_t
    ∂L/∂Δ_t = Σ_n g_t (h_t - b_t) A + u_t Σ_n g_t B_t            (a_t h_{t-1} = h_t - b_t)
    ∂L/∂A   = Σ_t Δ_t g_t (h_t - b_t)        ∂L/∂D = Σ_t dy_t u_t

Blocks are walked last to first; each recomputes its forward from its saved starting state.
Inside a block, the program loops over the n state indices: each is an independent scan over the
block's steps on a (BLOCK_D, BLOCK_L) tile, and sums over n (Σ_n g B, ...) accumulate in registers. What
each state index carries between blocks is a (BLOCK_D,) column in memory: its starting state (read from
``states``), the g entering from the later block (a scratch, one slot a block, written by the later block)
and the block's share of dA (one slot a block, folded afterwards). Reading a column of a register tile costs
a select and a reduction over the whole tile; reading it from memory, one load.
The adjoint's scan runs forward over the block read backwards (element s is step end - s): the block's
Δ_{t+1} and dy are flipped once per block, C_t is read at reversed addresses, and the result is flipped
back once per state index. In sm_90 PTX (Triton 3.6, the (4, 128) bf16 tile) a state index's loop issues
171 warp shuffles this way and 423 with ``associative_scan(..., reverse=True)``
(bf16 backward 0.86× the reverse scan's time: 2026-11-30_h200_selective_scan_flip_ab.json).
Gradients that sum over programs (A over batch rows and blocks, D and delta_bias over the batch; B and C over
channel blocks) are written as per-program partials and summed by :func:`mambalab.kernels.reduce.sum_partials`
in a fixed order, so the backward is bitwise reproducible and independent of the GPU it runs on.

Shapes (already validated by :mod:`mambalab.ops.selective_scan`): u, delta, z, out: (b, d, l), contiguous;
A: (d, n); B, C: (b, g, n, l) contiguous; D, delta_bias: (d,).
Tiles: ``BLOCK_D`` channels × ``BLOCK_L`` steps per program (the state travels between blocks through memory,
a (BLOCK_D,) column per state index), picked by :func:`tile_config` from (d // g, n, l) alone, so results never
depend on the batch size or the machine (on the CPU the forward takes INTERPRETER_BLOCK_D channels a program,
which gives the same bits: tests/test_selective_scan.py checks it).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from mambalab import device
from mambalab.kernels.reduce import sum_partials

LOG2E = tl.constexpr(1.4426950408889634)   # exp(x) = exp2(x · LOG2E); a global a kernel reads must be a tl.constexpr instance


# On the CPU (Triton's interpreter, whose cost is per program) the forward takes up to 64 channels of one group a
# program instead of one: each channel's scan is its own, so the sums and their order, and the bits, are the same
INTERPRETER_BLOCK_D = 64


@dataclass(frozen=True)
class TileConfig:
    """Tiles of the forward and the backward. The backward walks blocks of ``bwd_block_l`` steps, so the
    forward saves the state every ``bwd_block_l`` steps (its own ``block_l`` is a multiple of that)."""

    block_d: int
    block_n: int
    block_l: int
    num_warps: int
    bwd_block_d: int
    bwd_block_l: int
    bwd_num_warps: int

    def __post_init__(self):
        if self.block_l % self.bwd_block_l:
            raise ValueError(f"block_l={self.block_l} must be a multiple of bwd_block_l={self.bwd_block_l}")


def _largest_power_of_two_dividing(value: int, at_most: int) -> int:
    p = 1
    while p < at_most and value % (p * 2) == 0:
        p *= 2
    return p


def tile_config(channels_per_group: int, n: int, l: int) -> TileConfig:
    """The documented tile rule, from the shape alone (never the SM count, the batch size or an autotuner).

    BLOCK_N covers the whole state (next power of two). The forward takes one channel a program; the
    backward BLOCK_D channels, a power of two up to 4 that divides the channels of one B/C group (so a
    program reads one group), which also sets how many channels each dB/dC partial sums. The forward walks
    512 steps a block (fewer when the whole sequence is shorter: the next power of two at or above l, at
    least 16); the backward min(512 / BLOCK_D, that), and the forward saves the state at that interval.
    One warp a program.

    Backward (4 channels, 128 steps): 2.70 ms against 2.77 for (8, 64), 2026-11-30_h200_selective_scan_flip_ab.json.
    Forward one channel: 0.66 ms against 0.71 for two (benchmarks/results/README.md, 2026-11-30).
    """
    block_n = triton.next_power_of_2(max(n, 1))
    block_l = min(512, max(16, triton.next_power_of_2(max(l, 1))))
    bwd_block_d = _largest_power_of_two_dividing(channels_per_group, 4)
    return TileConfig(block_d=1, block_n=block_n,
                      block_l=block_l, num_warps=1, bwd_block_d=bwd_block_d,
                      bwd_block_l=min(512 // bwd_block_d, block_l), bwd_num_warps=1)


@triton.jit
def _scan_combine(a_left, b_left, a_right, b_right):
    return a_left * a_right, a_right * b_left + b_right


@triton.jit
def _delta_at(delta_ptrs, mask, bias, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr):
    """Load Δ (BLOCK_D, BLOCK_L) in fp32, add the bias, apply softplus; masked steps get Δ = 0 (a no-op step)."""
    dt = tl.load(delta_ptrs, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        dt += bias[:, None]
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
    y_ptr,            # (b, d, l) the output before the gate, for the backward's dz (written when SAVE_Y)
    states_ptr,       # (b, c + 1, d, n) fp32: the state every CKPT_L steps (slot k enters step k·CKPT_L), the
                      # last slot the state after step l - 1; a scratch when no gradient is asked for
    last_state_ptr,   # (b, d, n) fp32: the state after the last step (a copy of the last slot)
    d, n, l, g,       # sizes
    n_blocks,         # ceil(l / BLOCK_L)
    n_ckpt,           # c = ceil(l / CKPT_L)
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_L: tl.constexpr,
    CKPT_L: tl.constexpr,        # checkpoint interval; divides BLOCK_L (BLOCK_L itself when only carrying)
    SAVE_Y: tl.constexpr,        # HAS_Z and a gradient will be asked for
):
    pid_b = tl.program_id(0)
    pid_d = tl.program_id(1)
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    offs_t = tl.arange(0, BLOCK_L)
    mask_d = offs_d < d
    mask_dn = mask_d[:, None] & (offs_n < n)[None, :]
    group = (pid_d * BLOCK_D) // (d // g)

    bias, Dv = _channel_params(bias_ptr, D_ptr, offs_d, mask_d, HAS_BIAS, HAS_D, BLOCK_D)

    row = (pid_b * d + offs_d).to(tl.int64) * l                 # (BLOCK_D,) start of each channel's row
    bc_base = ((pid_b * g + group) * n).to(tl.int64) * l        # start of this group's B/C rows
    slots = pid_b * (n_ckpt + 1)                                # this batch row's first slot in states
    first = states_ptr + (slots * d + offs_d[:, None]).to(tl.int64) * n + offs_n[None, :]
    tl.store(first, tl.zeros((BLOCK_D, BLOCK_N), dtype=tl.float32), mask=mask_dn)   # slot 0: h_{-1} = 0
    for blk in range(0, n_blocks):
        # The state entering this block was written by the previous block's last step (by any warp).
        tl.debug_barrier()
        t = blk * BLOCK_L + offs_t
        mask_t = t < l
        mask_dt = mask_d[:, None] & mask_t[None, :]
        ck = blk * (BLOCK_L // CKPT_L)
        h_col = states_ptr + ((slots + ck) * d + offs_d).to(tl.int64) * n      # + i: h entering, (BD,)
        # The steps that end checkpoint intervals (k + 1)·CKPT_L - 1 write their state into the slot that starts
        # after them; the interval holding step l - 1 writes the final slot (its padding steps are a = 1, b = 0,
        # so its end holds the state after step l - 1), and intervals past it write nothing.
        k_end = tl.arange(0, BLOCK_L // CKPT_L)
        t_end = blk * BLOCK_L + (k_end + 1) * CKPT_L - 1                                   # (BL / CKPT_L,)
        slot = tl.where(t_end >= l - 1, n_ckpt, ck + k_end + 1)
        end_mask = mask_d[:, None] & (t_end - CKPT_L < l - 1)[None, :]
        end_ptrs = states_ptr + ((slots + slot[None, :]) * d + offs_d[:, None]).to(tl.int64) * n
        is_end = ((offs_t + 1) % CKPT_L == 0)[None, :]

        dt = _delta_at(delta_ptr + row[:, None] + t[None, :], mask_dt, bias, HAS_BIAS, SOFTPLUS)  # (BD, BL)
        uu = tl.load(u_ptr + row[:, None] + t[None, :], mask=mask_dt, other=0.0).to(tl.float32)    # (BD, BL)
        dtu = dt * uu
        y = tl.zeros((BLOCK_D, BLOCK_L), dtype=tl.float32)
        # One state index at a time: each is an independent scan over the block's steps.
        for i in range(0, n):
            A_i = tl.load(A_ptr + offs_d * n + i, mask=mask_d, other=0.0).to(tl.float32) * LOG2E
            B_i = tl.load(B_ptr + bc_base + i * l + t, mask=mask_t, other=0.0).to(tl.float32)   # (BL,)
            C_i = tl.load(C_ptr + bc_base + i * l + t, mask=mask_t, other=0.0).to(tl.float32)   # (BL,)
            a = tl.exp2(dt * A_i[:, None])                                  # (BD, BL)  exp(Δ A)
            bx = dtu * B_i[None, :]                                         # (BD, BL)  Δ u B
            a_cum, b_cum = tl.associative_scan((a, bx), 1, _scan_combine)
            hs = a_cum * tl.load(h_col + i, mask=mask_d, other=0.0)[:, None] + b_cum   # (BD, BL): h_t[:, i]
            y += hs * C_i[None, :]
            ends = tl.sum(tl.where(is_end, hs, 0.0).reshape(BLOCK_D, BLOCK_L // CKPT_L, CKPT_L), axis=2)
            tl.store(end_ptrs + i, ends, mask=end_mask)                     # (BD, BL / CKPT_L)
        if HAS_D:
            y += uu * Dv[:, None]
        if HAS_Z:
            if SAVE_Y:
                tl.store(y_ptr + row[:, None] + t[None, :], y.to(y_ptr.dtype.element_ty), mask=mask_dt)
            zz = tl.load(z_ptr + row[:, None] + t[None, :], mask=mask_dt, other=0.0).to(tl.float32)
            y = y * zz * tl.sigmoid(zz)
        tl.store(out_ptr + row[:, None] + t[None, :], y.to(out_ptr.dtype.element_ty), mask=mask_dt)
    tl.debug_barrier()
    final = states_ptr + ((slots + n_ckpt) * d + offs_d[:, None]).to(tl.int64) * n + offs_n[None, :]
    ls = last_state_ptr + (pid_b * d + offs_d[:, None]).to(tl.int64) * n + offs_n[None, :]
    tl.store(ls, tl.load(final, mask=mask_dn, other=0.0), mask=mask_dn)


@triton.jit
def selective_scan_bwd_kernel(
    u_ptr, delta_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, bias_ptr,   # forward inputs, as above
    dout_ptr,         # (b, d, l) gradient of the output
    states_ptr,       # (b, c + 1, d, n) fp32 block-start states saved by the forward (and the final one)
    y_ptr,            # (b, d, l) the forward's output before the gate (HAS_Z), or a dummy
    g_first_ptr,      # (b, c, d, n) fp32 scratch: g at each block's first step (read by the block before)
    du_ptr,           # (b, d, l)
    ddelta_ptr,       # (b, d, l) gradient w.r.t. delta before bias/softplus
    dz_ptr,           # (b, d, l), or a dummy
    dA_part_ptr,      # (b, c, d, n) fp32: each (batch row, block)'s share of dA
    dD_part_ptr,      # (b, d) fp32, or a dummy
    dbias_part_ptr,   # (b, d) fp32, or a dummy
    dB_part_ptr,      # (b, d // BLOCK_D, n, l) fp32: this channel block's share of dB
    dC_part_ptr,      # (b, d // BLOCK_D, n, l) fp32
    d, n, l, g,
    n_blocks,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_L: tl.constexpr,
):
    pid_b = tl.program_id(0)
    pid_d = tl.program_id(1)
    n_dblocks = tl.num_programs(1)
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    offs_t = tl.arange(0, BLOCK_L)
    mask_d = offs_d < d
    group = (pid_d * BLOCK_D) // (d // g)

    bias, Dv = _channel_params(bias_ptr, D_ptr, offs_d, mask_d, HAS_BIAS, HAS_D, BLOCK_D)

    row = (pid_b * d + offs_d).to(tl.int64) * l
    bc_base = ((pid_b * g + group) * n).to(tl.int64) * l
    part_base = ((pid_b * n_dblocks + pid_d) * n).to(tl.int64) * l   # this program's dB/dC partial rows

    dD_acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    dbias_acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for j in range(0, n_blocks):
        blk = n_blocks - 1 - j
        # Per state index, the block's starting state, the g entering from the later block and this block's
        # share of dA are single (BLOCK_D,) columns in memory (cheaper than selecting a column of a register
        # tile). The barrier makes the previous block's g_first (written by any warp) visible to all.
        tl.debug_barrier()
        h_col = states_ptr + ((pid_b * (n_blocks + 1) + blk) * d + offs_d).to(tl.int64) * n  # + i: h_in[:, i]
        g_col = g_first_ptr + ((pid_b * n_blocks + blk) * d + offs_d).to(tl.int64) * n       # + i: this block's g
        dA_col = dA_part_ptr + ((pid_b * n_blocks + blk) * d + offs_d).to(tl.int64) * n
        t = blk * BLOCK_L + offs_t
        mask_t = t < l
        mask_dt = mask_d[:, None] & mask_t[None, :]

        dt = _delta_at(delta_ptr + row[:, None] + t[None, :], mask_dt, bias, HAS_BIAS, SOFTPLUS)
        t1 = t + 1   # the adjoint's scan pairs step t with a_{t+1}
        dt_next = _delta_at(delta_ptr + row[:, None] + t1[None, :], mask_d[:, None] & (t1 < l)[None, :], bias,
                            HAS_BIAS, SOFTPLUS)
        t_rev = blk * BLOCK_L + (BLOCK_L - 1 - offs_t)           # the block's steps, last first
        uu = tl.load(u_ptr + row[:, None] + t[None, :], mask=mask_dt, other=0.0).to(tl.float32)
        dout = tl.load(dout_ptr + row[:, None] + t[None, :], mask=mask_dt, other=0.0).to(tl.float32)
        dtu = dt * uu
        dy = dout
        if HAS_Z:
            zz = tl.load(z_ptr + row[:, None] + t[None, :], mask=mask_dt, other=0.0).to(tl.float32)
            sig = tl.sigmoid(zz)
            dy = dout * zz * sig

        dt_next_rev = tl.flip(dt_next, 1)                          # (BD, BL): column s is step t_rev[s]
        dy_rev = tl.flip(dy, 1)
        gB = tl.zeros((BLOCK_D, BLOCK_L), dtype=tl.float32)       # Σ_n g B
        ddt_a = tl.zeros((BLOCK_D, BLOCK_L), dtype=tl.float32)    # Σ_n g (h - b) A
        for i in range(0, n):
            A_i = tl.load(A_ptr + offs_d * n + i, mask=mask_d, other=0.0).to(tl.float32)
            A2_i = A_i * LOG2E
            B_i = tl.load(B_ptr + bc_base + i * l + t, mask=mask_t, other=0.0).to(tl.float32)
            # Recompute this block's forward for state index i from its saved starting state.
            a = tl.exp2(dt * A2_i[:, None])
            bx = dtu * B_i[None, :]
            a_cum, b_cum = tl.associative_scan((a, bx), 1, _scan_combine)
            hs = a_cum * tl.load(h_col + i, mask=mask_d, other=0.0)[:, None] + b_cum
            # The adjoint, a forward scan over the reversed block: element s carries (a_{t+1}, dy_t C_t), t = t_rev[s].
            C_rev = tl.load(C_ptr + bc_base + i * l + t_rev, mask=t_rev < l, other=0.0).to(tl.float32)
            a_next_rev = tl.exp2(dt_next_rev * A2_i[:, None])
            a_acc, c_acc = tl.associative_scan((a_next_rev, dy_rev * C_rev[None, :]), 1, _scan_combine)
            g_in = tl.load(g_col + d * n + i, mask=mask_d & (j > 0), other=0.0)    # from the later block
            gs_rev = a_acc * g_in[:, None] + c_acc
            # the last column is the block's first step: its g enters the block before this one
            tl.store(g_col + i, tl.sum(tl.where(offs_t[None, :] == BLOCK_L - 1, gs_rev, 0.0), axis=1), mask=mask_d)
            gs = tl.flip(gs_rev, 1)                                  # (BD, BL) in step order

            h_minus_b = hs - bx                                      # a_t h_{t-1}
            gB += gs * B_i[None, :]
            ddt_a += gs * h_minus_b * A_i[:, None]
            tl.store(dA_col + i, tl.sum(gs * h_minus_b * dt, axis=1), mask=mask_d)
            # This channel block's share of dB and dC at state index i.
            tl.store(dB_part_ptr + part_base + i * l + t, tl.sum(gs * dtu, axis=0), mask=mask_t)
            tl.store(dC_part_ptr + part_base + i * l + t, tl.sum(hs * dy, axis=0), mask=mask_t)

        du = dt * gB
        if HAS_D:
            du += Dv[:, None] * dy
            dD_acc += tl.sum(dy * uu, axis=1)
        if HAS_Z:   # the forward saved y before the gate (with D u): dz = dout y silu'(z)
            y = tl.load(y_ptr + row[:, None] + t[None, :], mask=mask_dt, other=0.0).to(tl.float32)
            dz = dout * y * sig * (1.0 + zz * (1.0 - sig))
            tl.store(dz_ptr + row[:, None] + t[None, :], dz.to(dz_ptr.dtype.element_ty), mask=mask_dt)
        ddt = ddt_a + uu * gB
        if SOFTPLUS:
            raw = tl.load(delta_ptr + row[:, None] + t[None, :], mask=mask_dt, other=0.0).to(tl.float32)
            if HAS_BIAS:
                raw += bias[:, None]
            ddt = tl.where(raw <= 20.0, ddt * tl.sigmoid(raw), ddt)
        ddt = tl.where(mask_dt, ddt, 0.0)
        dbias_acc += tl.sum(ddt, axis=1)
        tl.store(du_ptr + row[:, None] + t[None, :], du.to(du_ptr.dtype.element_ty), mask=mask_dt)
        tl.store(ddelta_ptr + row[:, None] + t[None, :], ddt.to(ddelta_ptr.dtype.element_ty), mask=mask_dt)

    if HAS_D:
        tl.store(dD_part_ptr + pid_b * d + offs_d, dD_acc, mask=mask_d)
    if HAS_BIAS:
        tl.store(dbias_part_ptr + pid_b * d + offs_d, dbias_acc, mask=mask_d)


class Saved(NamedTuple):
    """What the forward keeps for the backward."""

    states: torch.Tensor          # (b, c + 1, d, n) fp32: the state entering each backward block, then the last
    y: torch.Tensor | None        # (b, d, l) in u's dtype: the output before the gate (with z only)


def selective_scan_fwd(u, delta, A, B, C, D, z, delta_bias, delta_softplus, cfg: TileConfig | None = None,
                       save_states: bool = True):
    """Launch the forward. Inputs validated and contiguous; B, C as (b, g, n, l). ``cfg`` overrides the
    tile rule (benchmarks and tests only: the tiles fix the order of additions, so results change bits).

    Returns (out (b, d, l) in u's dtype, last_state (b, d, n) fp32, :class:`Saved` or None, tiles).
    """
    b, d, l = u.shape
    g, n = B.shape[1], B.shape[2]
    if cfg is None:
        cfg = tile_config(d // g, n, l)
        if device.interpreted(u.device):   # each channel's scan is its own: more a program, the same bits
            cfg = dataclasses.replace(cfg, block_d=_largest_power_of_two_dividing(d // g, INTERPRETER_BLOCK_D))
    for name in ("block_d", "bwd_block_d"):
        if (d // g) % getattr(cfg, name):
            raise ValueError(f"{name}={getattr(cfg, name)} must divide the channels per group, {d // g}")
    n_blocks = triton.cdiv(l, cfg.block_l)
    ckpt_l = cfg.bwd_block_l if save_states else cfg.block_l   # without a backward, only the blocks' ends
    n_ckpt = triton.cdiv(l, ckpt_l)
    out = torch.empty_like(u)
    states = torch.empty(b, n_ckpt + 1, d, n, device=u.device, dtype=torch.float32)
    y = torch.empty_like(u) if save_states and z is not None else None
    last_state = torch.empty(b, d, n, device=u.device, dtype=torch.float32)
    grid = (b, triton.cdiv(d, cfg.block_d))
    selective_scan_fwd_kernel[grid](
        u, delta, A, B, C,
        D if D is not None else u, z if z is not None else u, delta_bias if delta_bias is not None else u,
        out, y if y is not None else out, states, last_state,
        d, n, l, g, n_blocks, n_ckpt,
        HAS_D=D is not None, HAS_Z=z is not None, HAS_BIAS=delta_bias is not None, SOFTPLUS=delta_softplus,
        BLOCK_D=cfg.block_d, BLOCK_N=cfg.block_n, BLOCK_L=cfg.block_l, CKPT_L=ckpt_l,
        SAVE_Y=y is not None, num_warps=cfg.num_warps,
    )
    return out, last_state, Saved(states, y) if save_states else None, cfg


def selective_scan_bwd(dout, u, delta, A, B, C, D, z, delta_bias, delta_softplus, saved: Saved, cfg):
    """Launch the backward and reduce its partials. Returns (du, ddelta, dA, dB, dC, dD, dz, ddelta_bias)
    with B/C gradients shaped (b, g, n, l)."""
    b, d, l = u.shape
    g, n = B.shape[1], B.shape[2]
    states = saved.states
    n_blocks = states.shape[1] - 1
    n_dblocks = triton.cdiv(d, cfg.bwd_block_d)
    f32 = dict(device=u.device, dtype=torch.float32)
    du = torch.empty_like(u)
    ddelta = torch.empty_like(delta)
    dz = torch.empty_like(z) if z is not None else None
    dA_part = torch.empty(b, n_blocks, d, n, **f32)
    g_first = torch.empty(b, n_blocks, d, n, **f32)
    dD_part = torch.empty(b, d, **f32) if D is not None else None
    dbias_part = torch.empty(b, d, **f32) if delta_bias is not None else None
    dB_part = torch.empty(b, n_dblocks, n, l, **f32)
    dC_part = torch.empty(b, n_dblocks, n, l, **f32)
    selective_scan_bwd_kernel[(b, n_dblocks)](
        u, delta, A, B, C,
        D if D is not None else u, z if z is not None else u, delta_bias if delta_bias is not None else u,
        dout, states, saved.y if saved.y is not None else du, g_first, du, ddelta, dz if dz is not None else du,
        dA_part, dD_part if dD_part is not None else dA_part, dbias_part if dbias_part is not None else dA_part,
        dB_part, dC_part,
        d, n, l, g, n_blocks,
        HAS_D=D is not None, HAS_Z=z is not None, HAS_BIAS=delta_bias is not None, SOFTPLUS=delta_softplus,
        BLOCK_D=cfg.bwd_block_d, BLOCK_N=cfg.block_n, BLOCK_L=cfg.bwd_block_l, num_warps=cfg.bwd_num_warps,
    )
    # Channel blocks never straddle a group (tile_config), so each group owns (d // g) // BLOCK_D of them.
    per_group = n_dblocks // g
    dB = sum_partials(dB_part.view(b, g, per_group, n, l), dim=2, out_dtype=B.dtype)
    dC = sum_partials(dC_part.view(b, g, per_group, n, l), dim=2, out_dtype=C.dtype)
    dA = sum_partials(dA_part.view(b * n_blocks, d, n), dim=0, out_dtype=A.dtype)
    dD = sum_partials(dD_part, dim=0, out_dtype=D.dtype) if D is not None else None
    dbias = sum_partials(dbias_part, dim=0, out_dtype=delta_bias.dtype) if delta_bias is not None else None
    return du, ddelta, dA, dB, dC, dD, dz, dbias
