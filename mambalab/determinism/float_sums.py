"""Float addition is not associative: the same numbers summed in two orders can give two results.

:func:`float_bits` spells out a float's sign, exponent and mantissa; :func:`ordered_sum` adds numbers one at a
time in a given order, in a given dtype, so reordering a sum can be watched bit by bit; :func:`order_spread`
counts the distinct results over many orders. Chapter 04 starts here.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["float_bits", "order_spread", "ordered_sum"]

_FORMATS = {  # dtype: (exponent bits, mantissa bits, integer view)
    torch.float64: (11, 52, torch.int64),
    torch.float32: (8, 23, torch.int32),
    torch.bfloat16: (8, 7, torch.int16),
    torch.float16: (5, 10, torch.int16),
}


def float_bits(x, dtype: torch.dtype = torch.float32) -> str:
    """``x`` in ``dtype`` as its bits, ``"sign exponent mantissa"`` (e.g. fp32 1.0 -> ``"0 01111111 000…0"``)."""
    if dtype not in _FORMATS:
        raise ValueError(f"dtype must be one of {sorted(map(str, _FORMATS))}; got {dtype}")
    e, m, int_dtype = _FORMATS[dtype]
    v = torch.as_tensor(x, dtype=dtype).reshape(1).view(int_dtype).item()
    width = 1 + e + m
    s = format(v & ((1 << width) - 1), f"0{width}b")
    return f"{s[0]} {s[1:1 + e]} {s[1 + e:]}"


def ordered_sum(values: Sequence[float] | torch.Tensor, order: Sequence[int] | None = None,
                dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """((v[o0] + v[o1]) + v[o2]) + …, each partial sum rounded to ``dtype``; a 0-d tensor of ``dtype``.

    ``order`` is a permutation of range(len(values)) (default: as given)."""
    v = torch.as_tensor(values, dtype=torch.float64).flatten().to(dtype)
    order = list(range(v.numel())) if order is None else [int(i) for i in order]
    if sorted(order) != list(range(v.numel())):
        raise ValueError(f"order must be a permutation of range({v.numel()}); got {order}")
    acc = torch.zeros((), dtype=dtype)
    for i in order:
        acc = acc + v[i]  # a 0-d add in dtype: rounded after every step, as one thread's running sum
    return acc


def order_spread(values: Sequence[float] | torch.Tensor, n_orders: int = 200, seed: int = 0,
                 dtype: torch.dtype = torch.float32) -> dict[float, int]:
    """Sum ``values`` in ``n_orders`` random orders (seeded): {result: how many orders gave it}, by result."""
    v = torch.as_tensor(values, dtype=torch.float64).flatten()
    gen = torch.Generator().manual_seed(seed)
    counts: dict[float, int] = {}
    for _ in range(n_orders):
        r = float(ordered_sum(v, torch.randperm(v.numel(), generator=gen).tolist(), dtype))
        counts[r] = counts.get(r, 0) + 1
    return dict(sorted(counts.items()))
