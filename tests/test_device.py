"""mambalab.device's patches of Triton's interpreter (a machine without a GPU) give triton's own answers: the
numpy dtype remembered for each Triton type (scalar, block, pointer) is the one triton's function derives; a
reduction with a user-defined combine (``tl.flip`` is one) gives the bits of triton's element-by-element one; and
kernels that call jit functions again and again, launched one after another, give the bits they give when
triton.language is patched at every call."""
import pytest
import torch
import triton
import triton.language as tl

from mambalab import device

pytestmark = pytest.mark.skipif(not device.interpreter_active(),
                                reason="patches Triton's interpreter (a machine without a GPU)")

SCALARS = [tl.int1, tl.int8, tl.uint8, tl.int16, tl.uint16, tl.int32, tl.uint32, tl.int64, tl.uint64, tl.float16,
           tl.bfloat16, tl.float32, tl.float64, tl.float8e5, tl.float8e4nv]


def test_remembered_numpy_dtypes_are_tritons_own():
    from triton.runtime import interpreter

    remembered = interpreter._get_np_dtype
    types = [*SCALARS, *(tl.block_type(t, [4, 8]) for t in SCALARS), *(tl.block_type(t, [2]) for t in SCALARS),
             *(tl.pointer_type(t) for t in SCALARS), tl.block_type(tl.pointer_type(tl.float32), [16])]
    for t in types * 2:    # the second pass reads what the first remembered
        assert remembered(t) == remembered.__wrapped__(t), t


@triton.jit
def _halve_and_add(a, b):   # neither associative nor commutative: the order of the combines shows in the bits
    return a * 0.5 + b


@triton.jit
def _running_pair(a, i, b, j):   # a tuple combine: a sum, and the larger index
    return a * 0.75 + b, tl.maximum(i, j)


@triton.jit
def _reductions_kernel(x_ptr, flips_ptr, rows_ptr, cols_ptr, all_ptr, kept_ptr, pair_ptr, index_ptr,
                       M: tl.constexpr, N: tl.constexpr):
    offs_m, offs_n = tl.arange(0, M), tl.arange(0, N)
    at = offs_m[:, None] * N + offs_n[None, :]
    x = tl.load(x_ptr + at)
    tl.store(flips_ptr + at, tl.flip(x, 1))
    tl.store(flips_ptr + M * N + at, tl.flip(x, 0))
    tl.store(rows_ptr + offs_m, tl.reduce(x, 1, _halve_and_add))
    tl.store(cols_ptr + offs_n, tl.reduce(x, 0, _halve_and_add))
    tl.store(all_ptr, tl.reduce(x, None, _halve_and_add))
    tl.store(kept_ptr + offs_m[:, None], tl.reduce(x, 1, _halve_and_add, keep_dims=True))
    total, index = tl.reduce((x, at), 1, _running_pair)
    tl.store(pair_ptr + offs_m, total)
    tl.store(index_ptr + offs_m, index)


def _reductions(x):
    m, n = x.shape
    outs = [torch.empty(2, m, n), torch.empty(m), torch.empty(n), torch.empty(1), torch.empty(m, 1),
            torch.empty(m), torch.empty(m, dtype=torch.int32)]
    _reductions_kernel[(1,)](x, *outs, M=m, N=n)
    return outs


def test_reductions_with_a_combine_give_the_element_by_element_bits(monkeypatch):
    from triton.runtime import interpreter

    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    got = _reductions(x)
    assert torch.equal(got[0][0], x.flip(1)) and torch.equal(got[0][1], x.flip(0))
    monkeypatch.setattr(interpreter.ReduceOps, "generic_reduce", interpreter.ReduceOps.generic_reduce.__wrapped__)
    want = _reductions(x)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and torch.equal(g, w)


@triton.jit
def _scaled(x, k):
    return x * k + tl.sigmoid(x)


@triton.jit
def _helpers_kernel(x_ptr, out_ptr, N: tl.constexpr, STEPS: tl.constexpr):
    offs = tl.arange(0, N)
    x = tl.load(x_ptr + offs)
    acc = tl.zeros((N,), dtype=tl.float32)
    for k in range(STEPS):   # each helper called once a step
        acc += _scaled(x, k) + tl.sum(x * k, axis=0) + tl.cumsum(x, axis=0)
    tl.store(out_ptr + offs, acc)


def _launches():
    x = torch.randn(16, generator=torch.Generator().manual_seed(1))
    outs = []
    for steps in (3, 1, 3):   # launches one after another, the same kernel again last
        outs.append(torch.empty(16))
        _helpers_kernel[(1,)](x, outs[-1], N=16, STEPS=steps)
    x2 = x.reshape(2, 8).contiguous()
    outs += _reductions(x2)   # another kernel between two of this one
    outs.append(torch.empty(16))
    _helpers_kernel[(1,)](x, outs[-1], N=16, STEPS=2)
    return outs


def test_kernels_calling_jit_functions_give_the_bits_of_a_patch_at_every_call(monkeypatch):
    from triton.runtime import interpreter

    got = _launches()
    for cls in (interpreter.GridExecutor, interpreter.InterpretedFunction):
        monkeypatch.setattr(cls, "__call__", cls.__call__.__wrapped__)
    want = _launches()
    for g, w in zip(got, want):
        assert torch.equal(g, w)
