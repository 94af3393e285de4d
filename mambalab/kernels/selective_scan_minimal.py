"""The selective scan's forward in two small Triton kernels: the first rungs of the climb to
:mod:`mambalab.kernels.selective_scan`.

Math (per batch row, channel d, state index n; see :mod:`mambalab.ref.selective_scan`):

    h_t = exp(Δ_t A) ⊙ h_{t-1} + Δ_t u_t B_t        y_t = Σ_n C_t h_t        h_{-1} = 0

Both kernels give each program one batch row and ``BLOCK_D`` channels, and keep that tile's whole state
``h`` (BLOCK_D, BLOCK_N) in registers from the first step to the last. Programs never talk to each other:
the grid is (b, ceil(d / BLOCK_D)).

* :func:`selective_scan_loop_kernel` runs the recurrence as a loop over the l steps, one step an iteration:
  l dependent steps, each loading one column (BLOCK_D,) of u and Δ and one (BLOCK_N,) column of B and C.
* :func:`selective_scan_assoc_kernel` walks the sequence in blocks of ``BLOCK_L`` steps; inside a block,
  ``tl.associative_scan`` with the combine (a₁, b₁) ∘ (a₂, b₂) = (a₁ a₂, a₂ b₁ + b₂) gives every prefix of
  the (BLOCK_D, BLOCK_N, BLOCK_L) tile in log-depth, and the state entering the block joins as
  h_t = a*_t h_in + b*_t. Loads are (BLOCK_D, BLOCK_L) tiles, contiguous along l.

Shapes: u, delta: (b, d, l) contiguous; A: (d, n); B, C: (b, n, l) contiguous (one group); out: (b, d, l)
fp32. No D, z, delta_bias or softplus, and no backward: :mod:`mambalab.ops.selective_scan` has those.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def selective_scan_loop_kernel(
    u_ptr,        # (b, d, l) input
    delta_ptr,    # (b, d, l) step sizes Δ (already positive)
    A_ptr,        # (d, n)
    B_ptr,        # (b, n, l)
    C_ptr,        # (b, n, l)
    out_ptr,      # (b, d, l) fp32 output y
    d, n, l,      # sizes
    BLOCK_D: tl.constexpr,   # channels a program
    BLOCK_N: tl.constexpr,   # the whole state, padded to a power of two
):
    pid_b, pid_d = tl.program_id(0), tl.program_id(1)
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    mask_d, mask_n = offs_d < d, offs_n < n
    A = tl.load(A_ptr + offs_d[:, None] * n + offs_n[None, :], mask=mask_d[:, None] & mask_n[None, :], other=0.0)
    row = (pid_b * d + offs_d) * l                  # (BLOCK_D,) start of each channel's row
    bc = (pid_b * n + offs_n) * l                   # (BLOCK_N,) start of each state index's B/C row
    h = tl.zeros((BLOCK_D, BLOCK_N), dtype=tl.float32)
    for t in range(0, l):                           # l dependent steps
        u = tl.load(u_ptr + row + t, mask=mask_d, other=0.0).to(tl.float32)          # (BLOCK_D,)
        dt = tl.load(delta_ptr + row + t, mask=mask_d, other=0.0).to(tl.float32)     # (BLOCK_D,)
        Bt = tl.load(B_ptr + bc + t, mask=mask_n, other=0.0).to(tl.float32)          # (BLOCK_N,)
        Ct = tl.load(C_ptr + bc + t, mask=mask_n, other=0.0).to(tl.float32)          # (BLOCK_N,)
        h = tl.exp(dt[:, None] * A) * h + (dt * u)[:, None] * Bt[None, :]           # (BLOCK_D, BLOCK_N)
        tl.store(out_ptr + row + t, tl.sum(h * Ct[None, :], axis=1), mask=mask_d)


@triton.jit
def _combine(a_left, b_left, a_right, b_right):
    return a_left * a_right, a_right * b_left + b_right


@triton.jit
def selective_scan_assoc_kernel(
    u_ptr,        # (b, d, l) input
    delta_ptr,    # (b, d, l) step sizes Δ (already positive)
    A_ptr,        # (d, n)
    B_ptr,        # (b, n, l)
    C_ptr,        # (b, n, l)
    out_ptr,      # (b, d, l) fp32 output y
    d, n, l,      # sizes
    BLOCK_D: tl.constexpr,   # channels a program
    BLOCK_N: tl.constexpr,   # the whole state, padded to a power of two
    BLOCK_L: tl.constexpr,   # steps a block: one associative scan each
):
    pid_b, pid_d = tl.program_id(0), tl.program_id(1)
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    offs_t = tl.arange(0, BLOCK_L)
    mask_d, mask_n = offs_d < d, offs_n < n
    A = tl.load(A_ptr + offs_d[:, None] * n + offs_n[None, :], mask=mask_d[:, None] & mask_n[None, :], other=0.0)
    row = (pid_b * d + offs_d) * l
    bc = (pid_b * n + offs_n) * l
    h = tl.zeros((BLOCK_D, BLOCK_N), dtype=tl.float32)                  # the state entering the block
    for start in range(0, l, BLOCK_L):
        t = start + offs_t
        mask_dt = mask_d[:, None] & (t < l)[None, :]
        mask_nt = mask_n[:, None] & (t < l)[None, :]
        u = tl.load(u_ptr + row[:, None] + t[None, :], mask=mask_dt, other=0.0).to(tl.float32)    # (BD, BL)
        dt = tl.load(delta_ptr + row[:, None] + t[None, :], mask=mask_dt, other=0.0).to(tl.float32)
        Bt = tl.load(B_ptr + bc[:, None] + t[None, :], mask=mask_nt, other=0.0).to(tl.float32)    # (BN, BL)
        Ct = tl.load(C_ptr + bc[:, None] + t[None, :], mask=mask_nt, other=0.0).to(tl.float32)
        a = tl.exp(dt[:, None, :] * A[:, :, None])                      # (BD, BN, BL); padded steps: Δ = 0, a = 1
        bx = (dt * u)[:, None, :] * Bt[None, :, :]                      # (BD, BN, BL)
        a_cum, b_cum = tl.associative_scan((a, bx), 2, _combine)
        hs = a_cum * h[:, :, None] + b_cum                              # (BD, BN, BL): h_t for every step
        tl.store(out_ptr + row[:, None] + t[None, :], tl.sum(hs * Ct[None, :, :], axis=1), mask=mask_dt)
        h = tl.sum(tl.where(offs_t[None, None, :] == BLOCK_L - 1, hs, 0.0), axis=2)   # the block's last state


def selective_scan_minimal(u, delta, A, B, C, *, kind: str = "loop", block_d: int = 4, block_l: int = 32):
    """Launch one of the two kernels on contiguous (b, d, l) u, delta; (d, n) A; (b, n, l) B, C.

    ``kind``: "loop" (:func:`selective_scan_loop_kernel`) or "assoc" (:func:`selective_scan_assoc_kernel`,
    blocks of ``block_l`` steps, a power of two). Returns y (b, d, l) in fp32.
    """
    b, d, l = u.shape
    n = A.shape[1]
    if B.shape != (b, n, l) or C.shape != (b, n, l):
        raise ValueError(f"B and C must have shape (b, n, l) = ({b}, {n}, {l}); got {tuple(B.shape)}, {tuple(C.shape)}")
    u, delta, A, B, C = (x.contiguous() for x in (u, delta, A.float(), B, C))
    out = torch.empty(b, d, l, device=u.device, dtype=torch.float32)
    grid = (b, triton.cdiv(d, block_d))
    sizes = dict(BLOCK_D=block_d, BLOCK_N=triton.next_power_of_2(n))
    if kind == "loop":
        selective_scan_loop_kernel[grid](u, delta, A, B, C, out, d, n, l, **sizes)
    elif kind == "assoc":
        selective_scan_assoc_kernel[grid](u, delta, A, B, C, out, d, n, l, **sizes, BLOCK_L=block_l)
    else:
        raise ValueError(f'kind must be "loop" or "assoc"; got {kind!r}')
    return out
