"""A sum by atomics: the kernel behind chapter 04's demonstration of why atomic reductions vary.

Program i sums its BLOCK values, s_i = Σ_{j < BLOCK} x[i · BLOCK + j], and adds s_i into one fp32 total with
``tl.atomic_add``, which returns the total it found just before its add:

    old_i = 0 + s_{o_0} + s_{o_1} + … + s_{o_(k-1)}      where program i's add landed k-th (o_k = i)

Float addition is not associative, so the total's bits depend on the landing order o, which the GPU's
scheduler decides at run time. The kernel writes each s_i and old_i so that the order can be recovered
afterwards (:func:`mambalab.determinism.atomics.atomic_sum`) and checked against a left fold of the
partials in that order (:func:`mambalab.determinism.atomics.fold_in_order`, the reference).

Shapes: x (N,) fp32; partials, olds (P,) fp32 with P = cdiv(N, BLOCK); total (1,) fp32.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def atomic_sum_kernel(
    x_ptr,          # (N,) fp32 values
    partial_ptr,    # (P,) fp32: each program's partial sum, written for the reader
    old_ptr,        # (P,) fp32: the total each program's atomic add found (what tl.atomic_add returns)
    total_ptr,      # (1,) fp32, zeroed: the sum, accumulated with atomics
    N,              # number of values
    BLOCK: tl.constexpr,   # values per program
):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    part = tl.sum(tl.load(x_ptr + offs, mask=offs < N, other=0.0), axis=0)
    old = tl.atomic_add(total_ptr, part)    # lands whenever the hardware schedules it: the order is not fixed
    tl.store(partial_ptr + pid, part)
    tl.store(old_ptr + pid, old)


def atomic_total(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch :func:`atomic_sum_kernel` on the validated fp32 vector ``x``, ``block`` values per program:
    (total (1,), partials (P,), olds (P,)) on ``x``'s device."""
    n_programs = triton.cdiv(x.numel(), block)
    partials = torch.empty(n_programs, device=x.device, dtype=torch.float32)
    olds = torch.empty_like(partials)
    total = torch.zeros(1, device=x.device, dtype=torch.float32)
    atomic_sum_kernel[(n_programs,)](x.contiguous(), partials, olds, total, x.numel(), BLOCK=block)
    return total, partials, olds
