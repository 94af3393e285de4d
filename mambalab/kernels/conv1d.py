"""The causal depthwise convolution over a whole sequence (``causal_conv1d_fn``'s forward and backward) as two
Triton kernels that read x once from memory and write each result once.

Math, per batch row and channel c, width W (2, 3 or 4), act = identity or SiLU:

    pre[t] = bias[c] + Σ_k w[c, k] · x[t - (W - 1) + k]      k = 0 … W - 1
    out[t] = act(pre[t])

x before position 0 comes from ``initial_states`` (b, d, W - 1) (zeros without). With ``seq_idx`` (b, l) a tap
reads only inputs of t's own sequence (an input of another sequence counts as 0) and positions whose
``seq_idx`` is negative (padding) give out[t] = 0. The final states are the last W - 1 inputs, from
``initial_states`` where l < W - 1.

The backward, from dout (b, d, l) and optionally dfinal (b, d, W - 1):

    dpre[t]   = dout[t] · act'(pre[t])              (0 at padding positions; pre recomputed from x)
    dx[p]     = Σ_k w[c, k] · dpre[p + (W - 1 - k)]  (taps of p's own sequence only; p < 0: dinitial_states)
                + dfinal[p - (l - (W - 1))]          where p is one of the last W - 1 inputs
    dw[c, k]  = Σ_{b, t} dpre[t] · x[t - (W - 1) + k],    dbias[c] = Σ_{b, t} dpre[t]

Shapes: x, out, dout, dx (b, d, l) with any strides (mamba-ssm passes ``xBC.transpose(1, 2)``: channel-last,
x.stride(1) == 1); weight (d, W); bias (d,); seq_idx (b, l) int32; initial_states, final states, dfinal,
dinitial_states (b, d, W - 1). Everything computes in fp32 and is stored in its tensor's dtype.

Tile rule: one program per (batch row, block of positions, block of channels); grid axis 0 walks (batch row,
position block) row-major, axis 1 the channel blocks. Both kernels' tiles are 32 positions by 128 channels with
4 warps (FORWARD_BLOCK_L, FORWARD_BLOCK_D, FORWARD_NUM_WARPS and BLOCK_L, BLOCK_D, NUM_WARPS): the forward's
outputs do not depend on its tile, while the backward's dw / dbias partials sum BLOCK_L positions, so its tile
is part of their order. A tile's loads carry x's strides, so Triton's coalescing makes whichever axis has
stride 1 the fast one: the channels for channel-last x, the positions for contiguous x. Each tap is a separate
masked load of the tile shifted by its offset (the W - 1 positions before the tile are the neighbour's and come
from L1/L2), not a padded copy; only the first position block reads the initial states (a branch on the block,
so the others neither load nor hold them). The backward computes dpre once over its tile and forms dx by
shifting that tile along the positions (``tl.gather``); the W - 1 rows a shift takes from past the tile's end
are dpre at the next block's first positions, computed one row each. Every tile size is a module constant: no
autotuning, nothing read from the GPU (its model, its SM count), so the same shape, dtypes and strides give the
same programs, the same sums and the same bits on every GPU.

The order of every sum:

* pre: starting from the bias (or 0), the taps added in order k = 0 … W - 1, one multiply-add each (fused on
  the GPU).
* dx and dinitial_states: starting from 0, the taps in order k = 0 … W - 1, then dfinal.
* dw and dbias: each program sums its tile's BLOCK_L positions with ``tl.sum`` (its tree is fixed by the
  tile's layout, which Triton derives from the tile sizes, num_warps, the dtype and which stride is 1) into a
  partial, written to ``partials`` (P, d, W + 1) fp32, P = b · cdiv(l, BLOCK_L) (b for l = 0), row =
  batch row · cdiv(l, BLOCK_L) + position block, column k < W for dw[:, k] and W for dbias;
  :func:`mambalab.kernels.reduce.sum_partials` then folds the P rows in its fixed order. No atomics.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from mambalab.kernels.reduce import sum_partials

BLOCK_L = 32     # the backward's tile: 0.874 ms, 1.801 at 64 x 64 (2026-12-07_h100_conv_bench_vs_64x64.json)
BLOCK_D = 128    # (BLOCK_L is also the positions each dw / dbias partial sums: part of their order)
NUM_WARPS = 4
FORWARD_BLOCK_L = 32    # the forward's tile: 0.140 ms, 0.326 at 64 x 64 (2026-12-07_h100_conv_bench.json)
FORWARD_BLOCK_D = 128
FORWARD_NUM_WARPS = 4
STATE_ROWS = 4   # a power of 2 >= W - 1: the rows of the final-state and dinitial_states tiles


def position_blocks(l: int, block_l: int | None = None) -> int:
    """The position blocks of a row: cdiv(l, block_l) (the backward's BLOCK_L unless told, read at the call, so
    that a copy of this module with its constants set launches consistent grids), and 1 for l = 0 (its program
    writes the states)."""
    return max(triton.cdiv(l, BLOCK_L if block_l is None else block_l), 1)


def partial_count(b: int, l: int) -> int:
    """P, the rows of the backward's partials buffer that sum_partials folds: one a (batch row, position block)."""
    return b * position_blocks(l)


def launch_grid(b: int, d: int, l: int) -> tuple[int, int]:
    """The backward's grid: (b · position blocks, channel blocks)."""
    return partial_count(b, l), triton.cdiv(d, BLOCK_D)


def forward_grid(b: int, d: int, l: int) -> tuple[int, int]:
    """The forward's grid: (b · its position blocks, its channel blocks)."""
    return b * position_blocks(l, FORWARD_BLOCK_L), triton.cdiv(d, FORWARD_BLOCK_D)


@triton.jit
def _inputs_at(
    x_row,        # x's batch row: (d, l) at strides (x_d, x_l)
    init_row,     # initial_states' batch row: (d, W - 1) at strides (i_d, i_k); unused without HAS_INIT
    seq_row,      # seq_idx's batch row: (l,); unused without HAS_SEQ_IDX
    p,            # (R,) int32 positions to read; -(W - 1) … -1 are the initial states
    seq_reader,   # (R,) the sequence of the position that reads each input (HAS_SEQ_IDX)
    offs_c,       # (BLOCK_D,) channels
    mask_c,       # (BLOCK_D,) channels < d
    at_start,     # whether p may reach before position 0 (else the initial states are not read)
    l, x_d, x_l, i_d, i_k,
    WIDTH: tl.constexpr, HAS_INIT: tl.constexpr, HAS_SEQ_IDX: tl.constexpr,
):
    """The inputs at positions p, (R, BLOCK_D) fp32: 0 past the ends and, with seq_idx, where an input belongs
    to another sequence than its reader."""
    inside = (p >= 0) & (p < l)
    if HAS_SEQ_IDX:
        inside = inside & (tl.load(seq_row + p, mask=inside, other=-1) == seq_reader)
    v = tl.load(x_row + p.to(tl.int64)[:, None] * x_l + offs_c[None, :] * x_d,
                mask=inside[:, None] & mask_c[None, :], other=0.0).to(tl.float32)
    if HAS_INIT:
        if at_start:   # a scalar branch: the other blocks neither load nor hold the initial states
            before = (p < 0) & (p >= -(WIDTH - 1))
            v0 = tl.load(init_row + (p + WIDTH - 1)[:, None] * i_k + offs_c[None, :] * i_d,
                         mask=before[:, None] & mask_c[None, :], other=0.0).to(tl.float32)
            v = tl.where(before[:, None], v0, v)
    return v


@triton.jit
def _pre_at(
    x_row, init_row, seq_row, weight_ptr, bias_ptr,
    q,            # (R,) positions
    seq_q,        # (R,) their sequences (HAS_SEQ_IDX)
    offs_c, mask_c, at_start,
    l, x_d, x_l, i_d, i_k, w_d, w_k,
    WIDTH: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_INIT: tl.constexpr, HAS_SEQ_IDX: tl.constexpr,
):
    """pre at positions q, (R, BLOCK_D) fp32: the bias, then the taps k = 0 … W - 1 in order."""
    acc = tl.zeros((q.shape[0], offs_c.shape[0]), dtype=tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_c, mask=mask_c, other=0.0).to(tl.float32)[None, :]
    for k in tl.static_range(WIDTH):
        w = tl.load(weight_ptr + offs_c * w_d + k * w_k, mask=mask_c, other=0.0).to(tl.float32)
        acc += w[None, :] * _inputs_at(x_row, init_row, seq_row, q - (WIDTH - 1) + k, seq_q, offs_c, mask_c,
                                       at_start, l, x_d, x_l, i_d, i_k, WIDTH, HAS_INIT, HAS_SEQ_IDX)
    return acc


@triton.jit
def _dpre_at(
    x_row, init_row, seq_row, weight_ptr, bias_ptr, dout_row,
    q,            # (R,) positions; dpre is 0 outside 0 … l - 1
    offs_c, mask_c, at_start,
    l, x_d, x_l, i_d, i_k, w_d, w_k, do_d, do_l,
    WIDTH: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_INIT: tl.constexpr, HAS_SEQ_IDX: tl.constexpr,
    SILU: tl.constexpr,
):
    """dpre = dout · act'(pre) at positions q, (R, BLOCK_D) fp32; 0 at padding positions."""
    inside = (q >= 0) & (q < l)
    seq_q = tl.zeros_like(q)
    if HAS_SEQ_IDX:
        seq_q = tl.load(seq_row + q, mask=inside, other=-1)
    g = tl.load(dout_row + q.to(tl.int64)[:, None] * do_l + offs_c[None, :] * do_d,
                mask=inside[:, None] & mask_c[None, :], other=0.0).to(tl.float32)
    if SILU:   # d silu(p) / dp = s (1 + p (1 - s)), s = sigmoid(p)
        pre = _pre_at(x_row, init_row, seq_row, weight_ptr, bias_ptr, q, seq_q, offs_c, mask_c, at_start,
                      l, x_d, x_l, i_d, i_k, w_d, w_k, WIDTH, HAS_BIAS, HAS_INIT, HAS_SEQ_IDX)
        s = tl.sigmoid(pre)
        g = g * (s * (1 + pre * (1 - s)))
    if HAS_SEQ_IDX:
        g = tl.where((seq_q >= 0)[:, None], g, 0.0)
    return g


@triton.jit
def _add_tap(acc, g, q, seq_reader, seq_row, weight_ptr, offs_c, mask_c, k, l, w_d, w_k,
             HAS_SEQ_IDX: tl.constexpr):
    """acc + w[:, k] · g, where g is dpre at the output positions q whose tap k reads the inputs of acc's rows,
    kept where q's sequence is the reader's (HAS_SEQ_IDX)."""
    if HAS_SEQ_IDX:
        same = tl.load(seq_row + q, mask=(q >= 0) & (q < l), other=-2) == seq_reader
        g = tl.where(same[:, None], g, 0.0)
    w = tl.load(weight_ptr + offs_c * w_d + k * w_k, mask=mask_c, other=0.0).to(tl.float32)
    return acc + w[None, :] * g


@triton.jit
def _final_state_grad(dfinal_row, p, offs_c, mask_c, l, df_d, df_k, WIDTH: tl.constexpr):
    """dfinal at the inputs p that are final states (the last W - 1 inputs), 0 elsewhere: (R, BLOCK_D) fp32."""
    f = p - (l - (WIDTH - 1))   # the final state p is, if any
    is_final = (f >= 0) & (p < l) & (p >= -(WIDTH - 1))
    return tl.load(dfinal_row + f[:, None] * df_k + offs_c[None, :] * df_d,
                   mask=is_final[:, None] & mask_c[None, :], other=0.0).to(tl.float32)


@triton.jit
def _input_grad_at(
    x_row, init_row, seq_row, weight_ptr, bias_ptr, dout_row, dfinal_row,
    p,            # (R,) input positions, -(W - 1) … l - 1
    offs_c, mask_c, at_start,
    l, x_d, x_l, i_d, i_k, w_d, w_k, do_d, do_l, df_d, df_k,
    WIDTH: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_INIT: tl.constexpr, HAS_SEQ_IDX: tl.constexpr,
    SILU: tl.constexpr, HAS_DFINAL: tl.constexpr,
):
    """The gradient of the input at positions p, (R, BLOCK_D) fp32: Σ_k w[:, k] · dpre[p + W - 1 - k] over
    the taps k = 0 … W - 1 in order (same sequence only), then dfinal where p is one of the final states."""
    acc = tl.zeros((p.shape[0], offs_c.shape[0]), dtype=tl.float32)
    seq_p = tl.zeros_like(p)
    if HAS_SEQ_IDX:
        seq_p = tl.load(seq_row + p, mask=(p >= 0) & (p < l), other=-1)
    for k in tl.static_range(WIDTH):
        q = p + (WIDTH - 1 - k)    # the output position whose tap k reads p
        g = _dpre_at(x_row, init_row, seq_row, weight_ptr, bias_ptr, dout_row, q, offs_c, mask_c, at_start,
                     l, x_d, x_l, i_d, i_k, w_d, w_k, do_d, do_l, WIDTH, HAS_BIAS, HAS_INIT, HAS_SEQ_IDX, SILU)
        acc = _add_tap(acc, g, q, seq_p, seq_row, weight_ptr, offs_c, mask_c, k, l, w_d, w_k, HAS_SEQ_IDX)
    if HAS_DFINAL:
        acc += _final_state_grad(dfinal_row, p, offs_c, mask_c, l, df_d, df_k, WIDTH)
    return acc


@triton.jit
def causal_conv1d_fwd_kernel(
    x_ptr,        # (b, d, l) any strides
    weight_ptr,   # (d, W)
    bias_ptr,     # (d,); unused without HAS_BIAS
    seq_ptr,      # (b, l) int32; unused without HAS_SEQ_IDX
    init_ptr,     # (b, d, W - 1) initial states; unused without HAS_INIT
    out_ptr,      # (b, d, l) output, act(pre)
    final_ptr,    # (b, d, W - 1) final states written; unused without WRITE_FINAL
    d, l,         # channels, positions
    l_blocks,     # position blocks a row (position_blocks(l, FORWARD_BLOCK_L))
    x_b, x_d, x_l, w_d, w_k, s_b, i_b, i_d, i_k, o_b, o_d, o_l, f_b, f_d, f_k,   # strides
    WIDTH: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_SEQ_IDX: tl.constexpr, HAS_INIT: tl.constexpr,
    WRITE_FINAL: tl.constexpr, SILU: tl.constexpr,
    BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr, STATE_ROWS: tl.constexpr,
):
    pid_b = tl.program_id(0) // l_blocks
    pid_l = tl.program_id(0) % l_blocks
    at_start = pid_l == 0   # only the first block's taps reach the initial states
    offs_t = pid_l * BLOCK_L + tl.arange(0, BLOCK_L)
    offs_c = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_t, mask_c = offs_t < l, offs_c < d
    x_row = x_ptr + pid_b.to(tl.int64) * x_b
    init_row = init_ptr + pid_b.to(tl.int64) * i_b
    seq_row = seq_ptr + pid_b.to(tl.int64) * s_b   # seq_idx has unit stride along l
    seq_t = tl.zeros_like(offs_t)
    if HAS_SEQ_IDX:
        seq_t = tl.load(seq_row + offs_t, mask=mask_t, other=-1)
    y = _pre_at(x_row, init_row, seq_row, weight_ptr, bias_ptr, offs_t, seq_t, offs_c, mask_c, at_start,
                l, x_d, x_l, i_d, i_k, w_d, w_k, WIDTH, HAS_BIAS, HAS_INIT, HAS_SEQ_IDX)
    if SILU:
        y = y * tl.sigmoid(y)
    if HAS_SEQ_IDX:   # padding positions give 0
        y = tl.where((seq_t >= 0)[:, None], y, 0.0)
    tl.store(out_ptr + pid_b.to(tl.int64) * o_b + offs_t.to(tl.int64)[:, None] * o_l + offs_c[None, :] * o_d,
             y.to(out_ptr.dtype.element_ty), mask=mask_t[:, None] & mask_c[None, :])
    if WRITE_FINAL:
        if pid_l == l_blocks - 1:   # the last block writes the last W - 1 inputs
            j = tl.arange(0, STATE_ROWS)
            p = l - (WIDTH - 1) + j
            v = _inputs_at(x_row, init_row, seq_row, p, p, offs_c, mask_c, l < WIDTH - 1, l, x_d, x_l, i_d, i_k,
                           WIDTH, HAS_INIT, False)
            tl.store(final_ptr + pid_b.to(tl.int64) * f_b + j[:, None] * f_k + offs_c[None, :] * f_d,
                     v.to(final_ptr.dtype.element_ty), mask=(j < WIDTH - 1)[:, None] & mask_c[None, :])


@triton.jit
def causal_conv1d_bwd_kernel(
    x_ptr,        # (b, d, l) any strides
    weight_ptr,   # (d, W)
    bias_ptr,     # (d,); unused without HAS_BIAS
    seq_ptr,      # (b, l) int32; unused without HAS_SEQ_IDX
    init_ptr,     # (b, d, W - 1); unused without HAS_INIT
    dout_ptr,     # (b, d, l) the output's gradient, any strides
    dfinal_ptr,   # (b, d, W - 1) the final states' gradient; unused without HAS_DFINAL
    dx_ptr,       # (b, d, l) x's gradient, written
    dinit_ptr,    # (b, d, W - 1) the initial states' gradient, written; unused without HAS_INIT
    partials_ptr,  # (P, d, W + 1) fp32 contiguous: this tile's Σ_t dpre · x_k (k < W) and Σ_t dpre, written
    d, l,         # channels, positions
    l_blocks,     # position blocks a row (position_blocks(l))
    x_b, x_d, x_l, w_d, w_k, s_b, i_b, i_d, i_k, do_b, do_d, do_l, df_b, df_d, df_k,
    dx_b, dx_d, dx_l, di_b, di_d, di_k,   # strides
    WIDTH: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_SEQ_IDX: tl.constexpr, HAS_INIT: tl.constexpr,
    HAS_DFINAL: tl.constexpr, SILU: tl.constexpr,
    BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr, STATE_ROWS: tl.constexpr,
):
    pid_b = tl.program_id(0) // l_blocks
    pid_l = tl.program_id(0) % l_blocks
    at_start = pid_l == 0   # only the first block's taps reach the initial states
    offs_t = pid_l * BLOCK_L + tl.arange(0, BLOCK_L)
    offs_c = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_t, mask_c = offs_t < l, offs_c < d
    x_row = x_ptr + pid_b.to(tl.int64) * x_b
    init_row = init_ptr + pid_b.to(tl.int64) * i_b
    seq_row = seq_ptr + pid_b.to(tl.int64) * s_b   # seq_idx has unit stride along l
    dout_row = dout_ptr + pid_b.to(tl.int64) * do_b
    dfinal_row = dfinal_ptr + pid_b.to(tl.int64) * df_b
    seq_t = tl.zeros_like(offs_t)
    if HAS_SEQ_IDX:
        seq_t = tl.load(seq_row + offs_t, mask=mask_t, other=-1)
    # dpre once over the tile's positions
    g = _dpre_at(x_row, init_row, seq_row, weight_ptr, bias_ptr, dout_row, offs_t, offs_c, mask_c, at_start,
                 l, x_d, x_l, i_d, i_k, w_d, w_k, do_d, do_l, WIDTH, HAS_BIAS, HAS_INIT, HAS_SEQ_IDX, SILU)
    # dx[t] = Σ_k w[:, k] · dpre[t + W - 1 - k], the taps in order: the tile's dpre shifted along the positions
    # (tl.gather); a shifted row past the tile's end is dpre of the next block's first rows, one row each
    rows = tl.arange(0, BLOCK_L)[:, None] + tl.zeros((1, BLOCK_D), dtype=tl.int32)   # (BLOCK_L, BLOCK_D)
    dx = tl.zeros((BLOCK_L, BLOCK_D), dtype=tl.float32)
    for shift in tl.static_range(WIDTH - 1, -1, -1):   # the taps k = W - 1 - shift = 0 … W - 1, in order
        k = WIDTH - 1 - shift
        if shift == 0:
            gk = g
        else:
            gk = tl.gather(g, tl.minimum(rows + shift, BLOCK_L - 1), 0)
            for e in tl.static_range(shift):   # tile row BLOCK_L - shift + e reads position (pid_l + 1) · BLOCK_L + e
                after = (pid_l + 1) * BLOCK_L + e + tl.arange(0, 1)
                g_after = _dpre_at(x_row, init_row, seq_row, weight_ptr, bias_ptr, dout_row, after, offs_c, mask_c,
                                   at_start, l, x_d, x_l, i_d, i_k, w_d, w_k, do_d, do_l,
                                   WIDTH, HAS_BIAS, HAS_INIT, HAS_SEQ_IDX, SILU)   # (1, BLOCK_D)
                gk = tl.where(rows == BLOCK_L - shift + e, g_after, gk)
        dx = _add_tap(dx, gk, offs_t + shift, seq_t, seq_row, weight_ptr, offs_c, mask_c, k, l, w_d, w_k,
                      HAS_SEQ_IDX)   # offs_t + shift: the output positions whose tap k reads the tile's inputs
    if HAS_DFINAL:
        dx += _final_state_grad(dfinal_row, offs_t, offs_c, mask_c, l, df_d, df_k, WIDTH)
    tl.store(dx_ptr + pid_b.to(tl.int64) * dx_b + offs_t.to(tl.int64)[:, None] * dx_l + offs_c[None, :] * dx_d,
             dx.to(dx_ptr.dtype.element_ty), mask=mask_t[:, None] & mask_c[None, :])
    # this tile's partial sums of dw and dbias
    part = partials_ptr + (tl.program_id(0).to(tl.int64) * d + offs_c) * (WIDTH + 1)
    for k in tl.static_range(WIDTH):
        xk = _inputs_at(x_row, init_row, seq_row, offs_t - (WIDTH - 1) + k, seq_t, offs_c, mask_c, at_start,
                        l, x_d, x_l, i_d, i_k, WIDTH, HAS_INIT, HAS_SEQ_IDX)
        tl.store(part + k, tl.sum(g * xk, axis=0), mask=mask_c)
    tl.store(part + WIDTH, tl.sum(g, axis=0), mask=mask_c)
    if HAS_INIT:
        if pid_l == 0:   # the first block also gives the initial states' gradient, inputs -(W - 1) … -1
            j = tl.arange(0, STATE_ROWS)
            p = j - (WIDTH - 1)
            di = _input_grad_at(x_row, init_row, seq_row, weight_ptr, bias_ptr, dout_row, dfinal_row, p,
                                offs_c, mask_c, at_start, l, x_d, x_l, i_d, i_k, w_d, w_k, do_d, do_l, df_d, df_k,
                                WIDTH, HAS_BIAS, HAS_INIT, HAS_SEQ_IDX, SILU, HAS_DFINAL)
            tl.store(dinit_ptr + pid_b.to(tl.int64) * di_b + j[:, None] * di_k + offs_c[None, :] * di_d,
                     di.to(dinit_ptr.dtype.element_ty), mask=(j < WIDTH - 1)[:, None] & mask_c[None, :])


def _dummy(t, like):
    """A pointer for an absent tensor (the kernel never reads it)."""
    return like if t is None else t


def _strides(t, n):
    """t's first n strides, or zeros for an absent tensor."""
    return (0,) * n if t is None else t.stride()[:n]


def like(x: torch.Tensor) -> torch.Tensor:
    """An empty tensor of x's shape (b, d, l) and dtype in x's layout: x's strides when x is dense
    (``torch.empty_like``), channel-last when x is a channel-last view that is not (mamba-ssm's
    ``xBC.transpose(1, 2)``, a slice of zxbcdt), so that the caller's ``transpose(1, 2)`` back is contiguous;
    contiguous otherwise."""
    b, d, l = x.shape
    if x.stride(1) == 1 and not x.is_contiguous() and l > 1 and d > 1:
        return torch.empty_strided((b, d, l), (l * d, 1, d), dtype=x.dtype, device=x.device)   # not a view
    return torch.empty_like(x)


def causal_conv1d_fwd(x, weight, bias, seq_idx, initial_states, write_final: bool, silu: bool):
    """Launch :func:`causal_conv1d_fwd_kernel` on validated tensors (module docstring).

    Args: x (b, d, l), any strides; weight (d, W); bias (d,) or None; seq_idx (b, l) int32 with unit stride
    along l, or None; initial_states (b, d, W - 1) or None; write_final: also return the final states; silu: the
    activation.

    Returns: out (b, d, l) in x's dtype and layout (:func:`like`), and final states (b, d, W - 1) in x's dtype,
    or None.
    """
    (b, d, l), width = x.shape, weight.shape[1]
    out = like(x)
    final = x.new_empty(b, d, width - 1) if write_final else None
    if b == 0 or d == 0:
        return out, final
    causal_conv1d_fwd_kernel[forward_grid(b, d, l)](
        x, weight, _dummy(bias, weight), _dummy(seq_idx, x), _dummy(initial_states, x), out, _dummy(final, out),
        d, l, position_blocks(l, FORWARD_BLOCK_L),
        *x.stride(), *weight.stride(), *_strides(seq_idx, 1), *_strides(initial_states, 3), *out.stride(),
        *_strides(final, 3),
        WIDTH=width, HAS_BIAS=bias is not None, HAS_SEQ_IDX=seq_idx is not None,
        HAS_INIT=initial_states is not None, WRITE_FINAL=write_final, SILU=silu,
        BLOCK_L=FORWARD_BLOCK_L, BLOCK_D=FORWARD_BLOCK_D, STATE_ROWS=STATE_ROWS, num_warps=FORWARD_NUM_WARPS,
    )
    return out, final


def causal_conv1d_bwd_partials(x, weight, bias, seq_idx, initial_states, dout, dfinal, silu: bool):
    """Launch :func:`causal_conv1d_bwd_kernel` on validated tensors: dx, dinitial_states and the per-tile
    partial sums of dw and dbias, unfolded.

    Args: as :func:`causal_conv1d_fwd`; dout (b, d, l), any strides; dfinal (b, d, W - 1) or None.

    Returns: dx (b, d, l) in x's dtype and layout; dinitial_states (b, d, W - 1) in x's dtype, or None without
    initial_states; partials (P, d, W + 1) fp32, P = :func:`partial_count` (b, l): row batch row ·
    position_blocks(l) + position block, columns dw[:, 0 … W - 1] and dbias.
    """
    (b, d, l), width = x.shape, weight.shape[1]
    dx = like(x)
    dinit = None if initial_states is None else x.new_empty(b, d, width - 1)
    partials = torch.zeros(partial_count(b, l), d, width + 1, device=x.device, dtype=torch.float32)
    if b == 0 or d == 0:
        return dx, dinit, partials
    grid = launch_grid(b, d, l)
    causal_conv1d_bwd_kernel[grid](
        x, weight, _dummy(bias, weight), _dummy(seq_idx, x), _dummy(initial_states, x), dout,
        _dummy(dfinal, dout), dx, _dummy(dinit, dx), partials,
        d, l, position_blocks(l),
        *x.stride(), *weight.stride(), *_strides(seq_idx, 1), *_strides(initial_states, 3), *dout.stride(),
        *_strides(dfinal, 3), *dx.stride(), *_strides(dinit, 3),
        WIDTH=width, HAS_BIAS=bias is not None, HAS_SEQ_IDX=seq_idx is not None,
        HAS_INIT=initial_states is not None, HAS_DFINAL=dfinal is not None, SILU=silu,
        BLOCK_L=BLOCK_L, BLOCK_D=BLOCK_D, STATE_ROWS=STATE_ROWS, num_warps=NUM_WARPS,
    )
    return dx, dinit, partials


def causal_conv1d_bwd(x, weight, bias, seq_idx, initial_states, dout, dfinal, silu: bool):
    """The backward (module docstring) on validated tensors: :func:`causal_conv1d_bwd_partials`, then the
    partials folded by :func:`~mambalab.kernels.reduce.sum_partials`.

    Returns: dx (b, d, l) in x's dtype and layout; dweight (d, W) fp32; dbias (d,) fp32; dinitial_states
    (b, d, W - 1) in x's dtype, or None.
    """
    dx, dinit, partials = causal_conv1d_bwd_partials(x, weight, bias, seq_idx, initial_states, dout, dfinal, silu)
    sums = sum_partials(partials, dim=0)                                     # (d, W + 1) fp32
    width = weight.shape[1]
    return dx, sums[:, :width].contiguous(), sums[:, width].contiguous(), dinit
