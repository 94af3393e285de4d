"""The shared deterministic reduction: sum per-program partial results in a fixed order.

Backward kernels that must combine contributions from several programs (say, the gradient of A, summed
over the batch) never add into shared memory with atomics. Each program writes its own partial result,
and this kernel sums the partials ``x`` of shape (outer, P, inner) over P in fp32, in an order fixed by P
alone: left to right within segments of SEGMENT consecutive partials,

    s_k = (((x[k·S] + x[k·S + 1]) + x[k·S + 2]) + ... ) + x[min((k+1)·S, P) - 1]      S = SEGMENT

then the same over the segments' sums s_0, s_1, ... (segmented again while there are more than S of them).
Up to S partials this is one left fold. The order depends on P and S only: not on the GPU, its SM count,
the launch grid or a tile size, so the bits are the same on every machine and every run.

Why segments: a single left fold over P partials is a chain of P dependent adds, and a fold has only
outer · inner / BLOCK_INNER programs to spread over an SM array. Backward kernels write thousands of
partials of a few thousand numbers each (the rotary backward's dbias: P = 1024, inner = 4096 at b4 l4096
h32): 16 programs walking 1024 rows each. Segments give each fold P / S times as many programs.

:func:`fold_reference` is the same order in PyTorch, one add at a time, for tests.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_INNER = 512  # elements of `inner` per program; changes only parallelism, never the order of adds
SEGMENT = 32       # partials folded left to right before the segments' sums are folded; part of the order


@triton.jit
def sum_partials_kernel(
    x_ptr,        # (outer, P, inner) partials, contiguous, fp32
    out_ptr,      # (outer, S, inner) result, contiguous: S = cdiv(P, seg) segment sums (S = 1: the total)
    P,            # number of partials
    inner,        # size of the trailing dimension
    seg,          # partials a segment (>= P for one left fold over them all)
    BLOCK: tl.constexpr,
):
    # axis 0 walks (outer, block of inner), row-major; axis 1 the segments. CUDA caps axes 1 and 2 at 65,535
    # programs, and inner / BLOCK passes that in the rotary backward's dθ at b4 l4096 h64 (2^25 numbers)
    inner_blocks = tl.cdiv(inner, BLOCK)
    pid_o = tl.program_id(0) // inner_blocks
    pid_i = tl.program_id(0) % inner_blocks
    pid_s = tl.program_id(1)
    segments = tl.num_programs(1)
    offs = pid_i * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inner
    first = pid_s * seg
    count = tl.minimum(seg, P - first)                 # this segment's partials
    base = x_ptr + (pid_o.to(tl.int64) * P + first) * inner + offs
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    count4 = (count // 4) * 4
    for p in range(0, count4, 4):
        # four loads in flight at once (memory parallelism), then added in order: the same left fold
        x0 = tl.load(base + p * inner, mask=mask, other=0.0)
        x1 = tl.load(base + (p + 1) * inner, mask=mask, other=0.0)
        x2 = tl.load(base + (p + 2) * inner, mask=mask, other=0.0)
        x3 = tl.load(base + (p + 3) * inner, mask=mask, other=0.0)
        acc = (((acc + x0) + x1) + x2) + x3
    for p in range(count4, count):   # the last count mod 4, one at a time
        acc += tl.load(base + p * inner, mask=mask, other=0.0)
    row = pid_o.to(tl.int64) * segments + pid_s
    tl.store(out_ptr + row * inner + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def sum_partials(x: torch.Tensor, dim: int, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Sum fp32 partials ``x`` over ``dim`` in the module's fixed order; the result drops ``dim``."""
    dim = dim % x.dim()
    shape = x.shape
    outer, P = int(torch.Size(shape[:dim]).numel()), shape[dim]
    inner = int(torch.Size(shape[dim + 1:]).numel())
    out = torch.empty(shape[:dim] + shape[dim + 1:], device=x.device, dtype=out_dtype or x.dtype)
    if out.numel() == 0:
        return out
    x = x.contiguous()
    while P > SEGMENT:   # one pass a level: (outer, P, inner) -> (outer, cdiv(P, SEGMENT), inner) sums in fp32
        S = triton.cdiv(P, SEGMENT)
        sums = torch.empty(outer, S, inner, device=x.device, dtype=torch.float32)
        sum_partials_kernel[(outer * triton.cdiv(inner, BLOCK_INNER), S)](x, sums, P, inner, SEGMENT,
                                                                          BLOCK=BLOCK_INNER)
        x, P = sums, S
    # the last level: one left fold over at most SEGMENT partials, written once in out's dtype
    sum_partials_kernel[(outer * triton.cdiv(inner, BLOCK_INNER), 1)](x, out, P, inner, max(P, 1), BLOCK=BLOCK_INNER)
    return out


def fold_reference(x: torch.Tensor, dim: int) -> torch.Tensor:
    """:func:`sum_partials`' order in PyTorch, one add at a time in fp32 (for tests): segments of SEGMENT
    partials folded left to right, then their sums folded the same way."""
    x = x.float().movedim(dim, 0)
    while x.shape[0] > SEGMENT:
        x = torch.stack([fold_reference(x[s:s + SEGMENT], 0) for s in range(0, x.shape[0], SEGMENT)])
    total = x[0].clone() if x.shape[0] else torch.zeros(x.shape[1:], device=x.device)
    for p in range(1, x.shape[0]):
        total = total + x[p]
    return total

