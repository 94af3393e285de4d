"""The decode step of a diagonal SSM (Mamba-1's and Mamba-2's) as one Triton kernel: one token, the state read
once and written once, in place.

Math (per batch row b, head h, head dimension i and state dimension j; see
:func:`mambalab.ref.state_update.selective_state_update_ref`, which this kernel is checked against):

    Δ        = clamp(softplus?(dt + dt_bias), dt_min, dt_max)
    S[i, j]  ← exp(Δ A[i, j]) S[i, j] + Δ x[i] B[j]
    out[i]   = Σ_j S[i, j] C[j] + D[i] x[i],   then ⊙ silu(z[i]) when z is given

Mamba-2 has one Δ and one A per head (``PER_HEAD``: the decay exp(Δ A) is one number per program); Mamba-1 has
them per channel and state dimension. Decoding reads the whole state and does O(p n) work on it, so the step
is bound by memory: the kernel's job is to move the state once, at full width, and fuse everything else
around that one pass (unfused, the same step is a dozen PyTorch kernels, each reading and writing the state or
a tensor of its size).

Tile rule (shape only): one program per (batch row, head, block of BLOCK_D head dimensions), the state
dimension whole (BLOCK_N = next_pow2(n)); BLOCK_D = 16 when that still gives 4,096 programs or more (a
batch-64 decode), else 4 (small batches: more programs to fill the GPU). :func:`state_update_config` decides.

Strides are arguments, so broadcast inputs (stride 0, e.g. Mamba-2's per-head A expanded over (p, n)) cost no
copy. ``A_IS_LOG``: the kernel reads the blocks' parameter A_log = log(-A) and forms A = -exp(A_log) itself, in
fp32 (in PyTorch, three kernels a layer: a cast, the exp, the negation).
``index`` (b,) optionally picks the state row each batch row updates (mamba-ssm's
``state_batch_indices``); a negative index marks a padding row: its output is zero and no state is touched.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _step_size(dt, dt_min, dt_max, SOFTPLUS: tl.constexpr, HAS_LIMIT: tl.constexpr):
    """Δ from dt (+ dt_bias already added), fp32: softplus (the identity above 20, as PyTorch's), then the clamp."""
    if SOFTPLUS:
        dt = tl.where(dt <= 20.0, tl.log(1.0 + tl.exp(dt)), dt)
    if HAS_LIMIT:
        dt = tl.minimum(tl.maximum(dt, dt_min), dt_max)
    return dt


@triton.jit
def state_update_kernel(
    state_ptr,        # (rows, h, dim, n) updated in place
    x_ptr,            # (b, h, dim)
    dt_ptr,           # (b, h, dim) (stride 0 along dim when PER_HEAD)
    bias_ptr,         # (h, dim) dt_bias, or a dummy
    A_ptr,            # (h, dim, n) A, or A_log when A_IS_LOG (strides 0 along dim and n when PER_HEAD)
    B_ptr, C_ptr,     # (b, g, n)
    D_ptr,            # (h, dim), or a dummy
    z_ptr,            # (b, h, dim), or a dummy
    out_ptr,          # (b, h, dim) out
    index_ptr,        # (b,) state rows, or a dummy
    dim, n, heads_per_group,
    s_b, s_h, s_d, s_n,
    x_b, x_h, x_d,
    dt_b, dt_h, dt_d,
    bias_h, bias_d,
    A_h, A_d, A_n,
    B_b, B_g, B_n,
    C_b, C_g, C_n,
    D_h, D_d,
    z_b, z_h, z_d,
    o_b, o_h, o_d,
    dt_min, dt_max,
    SOFTPLUS: tl.constexpr, HAS_LIMIT: tl.constexpr, PER_HEAD: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_INDEX: tl.constexpr,
    A_IS_LOG: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid_b = tl.program_id(0)
    pid_h = tl.program_id(1)
    pid_d = tl.program_id(2)
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    mask_d = offs_d < dim
    mask_n = offs_n < n
    mask = mask_d[:, None] & mask_n[None, :]
    out_ptrs = out_ptr + pid_b * o_b + pid_h * o_h + offs_d * o_d

    row = pid_b.to(tl.int64)
    if HAS_INDEX:
        row = tl.load(index_ptr + pid_b).to(tl.int64)
    if row < 0:   # a padding row (only with an index): zero out, state untouched
        tl.store(out_ptrs, tl.zeros((BLOCK_D,), dtype=tl.float32).to(out_ptr.dtype.element_ty), mask=mask_d)
        return

    grp = pid_h // heads_per_group
    s_ptrs = state_ptr + row * s_b + pid_h * s_h + offs_d[:, None] * s_d + offs_n[None, :] * s_n
    S = tl.load(s_ptrs, mask=mask, other=0.0).to(tl.float32)                     # (BLOCK_D, BLOCK_N)
    x = tl.load(x_ptr + pid_b * x_b + pid_h * x_h + offs_d * x_d, mask=mask_d, other=0.0).to(tl.float32)
    Bv = tl.load(B_ptr + pid_b * B_b + grp * B_g + offs_n * B_n, mask=mask_n, other=0.0).to(tl.float32)
    Cv = tl.load(C_ptr + pid_b * C_b + grp * C_g + offs_n * C_n, mask=mask_n, other=0.0).to(tl.float32)

    if PER_HEAD:   # one Δ and one A for the whole head: a scalar decay
        dt = tl.load(dt_ptr + pid_b * dt_b + pid_h * dt_h).to(tl.float32)
        if HAS_BIAS:
            dt += tl.load(bias_ptr + pid_h * bias_h).to(tl.float32)
        dt = _step_size(dt, dt_min, dt_max, SOFTPLUS, HAS_LIMIT)
        A = tl.load(A_ptr + pid_h * A_h).to(tl.float32)
        if A_IS_LOG:
            A = -tl.exp(A)
        decay = tl.exp(A * dt)
        S = S * decay + (x * dt)[:, None] * Bv[None, :]
    else:          # Δ per channel, A per (channel, state dimension)
        dt = tl.load(dt_ptr + pid_b * dt_b + pid_h * dt_h + offs_d * dt_d, mask=mask_d, other=0.0).to(tl.float32)
        if HAS_BIAS:
            dt += tl.load(bias_ptr + pid_h * bias_h + offs_d * bias_d, mask=mask_d, other=0.0).to(tl.float32)
        dt = _step_size(dt, dt_min, dt_max, SOFTPLUS, HAS_LIMIT)
        A = tl.load(A_ptr + pid_h * A_h + offs_d[:, None] * A_d + offs_n[None, :] * A_n, mask=mask,
                    other=0.0).to(tl.float32)
        if A_IS_LOG:
            A = -tl.exp(A)
        S = S * tl.exp(A * dt[:, None]) + (x * dt)[:, None] * Bv[None, :]
    tl.store(s_ptrs, S.to(state_ptr.dtype.element_ty), mask=mask)

    out = tl.sum(S * Cv[None, :], axis=1)                                        # (BLOCK_D,)
    if HAS_D:
        out += tl.load(D_ptr + pid_h * D_h + offs_d * D_d, mask=mask_d, other=0.0).to(tl.float32) * x
    if HAS_Z:
        z = tl.load(z_ptr + pid_b * z_b + pid_h * z_h + offs_d * z_d, mask=mask_d, other=0.0).to(tl.float32)
        out = out * z * tl.sigmoid(z)
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=mask_d)


def state_update_config(batch: int, heads: int, dim: int, n: int) -> tuple[int, int, int]:
    """(BLOCK_D, BLOCK_N, num_warps) for a (batch, heads, dim, n) state: the module docstring's tile rule."""
    block_n = triton.next_power_of_2(n)
    block_d = 16 if batch * heads * triton.cdiv(dim, 16) >= 4096 else 4
    block_d = max(1, min(block_d, 8192 // block_n))          # at most 8K fp32 state values a program
    return block_d, block_n, 4


def state_update_fwd(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus: bool, dt_limit, index, per_head: bool,
                     A_is_log: bool = False):
    """Launch :func:`state_update_kernel` on 4-d/3-d tensors (the op's shapes, checked there); returns out
    (b, h, dim) in x's dtype. ``state`` is updated in place. ``A_is_log``: A holds A_log, A = -exp(A_log)."""
    b, h, dim = x.shape
    n = state.shape[-1]
    g = B.shape[1]
    out = torch.empty_like(x)
    block_d, block_n, warps = state_update_config(b, h, dim, n)
    dummy = x
    st = lambda t, k: tuple(t.stride()) if t is not None else (0,) * k
    lo, hi = (0.0, float("inf")) if dt_limit is None else (float(dt_limit[0]), float(dt_limit[1]))
    grid = (b, h, triton.cdiv(dim, block_d))
    state_update_kernel[grid](
        state, x, dt, dt_bias if dt_bias is not None else dummy, A, B, C,
        D if D is not None else dummy, z if z is not None else dummy, out, index if index is not None else dummy,
        dim, n, h // g,
        *state.stride(), *x.stride(), *dt.stride(), *st(dt_bias, 2), *A.stride(), *B.stride(), *C.stride(),
        *st(D, 2), *st(z, 3), *out.stride(),
        lo, hi,
        SOFTPLUS=bool(dt_softplus), HAS_LIMIT=dt_limit is not None, PER_HEAD=per_head,
        HAS_BIAS=dt_bias is not None, HAS_D=D is not None, HAS_Z=z is not None, HAS_INDEX=index is not None,
        A_IS_LOG=bool(A_is_log), BLOCK_D=block_d, BLOCK_N=block_n, num_warps=warps,
    )
    return out
