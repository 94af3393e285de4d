"""The shared deterministic reduction: sum per-program partial results in a fixed order.

Backward kernels that must combine contributions from several programs (say, the gradient of A, summed
over the batch) never add into shared memory with atomics. Each program writes its own partial result,
and this kernel sums the partials:

    out[o, i] = (((x[o, 0, i] + x[o, 1, i]) + x[o, 2, i]) + ... ) + x[o, P-1, i]     in fp32

for partials ``x`` of shape (outer, P, inner). The order is a left fold over P, fixed by the shape alone:
it does not depend on the GPU, its SM count, the launch grid or a tile size, so the bits are the same on
every machine and every run.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_INNER = 512  # elements of `inner` per program; changes only parallelism, never the order of adds


@triton.jit
def sum_partials_kernel(
    x_ptr,        # (outer, P, inner) partials, contiguous, fp32
    out_ptr,      # (outer, inner) result, contiguous
    P,            # number of partials to fold
    inner,        # size of the trailing dimension
    BLOCK: tl.constexpr,
):
    pid_o = tl.program_id(0)
    pid_i = tl.program_id(1)
    offs = pid_i * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inner
    base = x_ptr + pid_o.to(tl.int64) * P * inner + offs
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    P4 = (P // 4) * 4
    for p in range(0, P4, 4):
        # four loads in flight at once (memory parallelism), then added in order: the same left fold
        x0 = tl.load(base + p * inner, mask=mask, other=0.0)
        x1 = tl.load(base + (p + 1) * inner, mask=mask, other=0.0)
        x2 = tl.load(base + (p + 2) * inner, mask=mask, other=0.0)
        x3 = tl.load(base + (p + 3) * inner, mask=mask, other=0.0)
        acc = (((acc + x0) + x1) + x2) + x3
    for p in range(P4, P):   # the last P mod 4, one at a time
        acc += tl.load(base + p * inner, mask=mask, other=0.0)
    tl.store(out_ptr + pid_o.to(tl.int64) * inner + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def sum_partials(x: torch.Tensor, dim: int, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Sum fp32 partials ``x`` over ``dim`` in the fixed left-fold order; the result drops ``dim``."""
    dim = dim % x.dim()
    shape = x.shape
    outer = int(torch.Size(shape[:dim]).numel())
    P = shape[dim]
    inner = int(torch.Size(shape[dim + 1:]).numel())
    xc = x.contiguous()
    out = torch.empty(shape[:dim] + shape[dim + 1:], device=x.device, dtype=out_dtype or x.dtype)
    if out.numel() == 0:
        return out
    grid = (outer, triton.cdiv(inner, BLOCK_INNER))
    sum_partials_kernel[grid](xc, out, P, inner, BLOCK=BLOCK_INNER)
    return out
