"""mambalab.kernels.reduce: the shared fixed-order sum of per-program partials, bit for bit against its
PyTorch reference (fold_reference) and against folds written out by hand."""
import pytest
import torch

from mambalab.kernels import reduce
from mambalab.kernels.reduce import SEGMENT, fold_reference, sum_partials

from conftest import KERNEL_DEVICE, requires_gpu


def partials(*shape, seed=5):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 1e3


def left_fold(rows):
    total = rows[0].clone()
    for row in rows[1:]:
        total = total + row
    return total


@pytest.mark.parametrize("P", [1, 4, 5, 11, SEGMENT])   # four partials a load, then the rest; one segment
def test_up_to_a_segment_is_a_left_fold(P):
    x = partials(3, P, 7)
    want = left_fold(list(x.unbind(1)))
    assert torch.equal(fold_reference(x, dim=1), want)
    assert torch.equal(sum_partials(x.to(KERNEL_DEVICE), dim=1).cpu(), want)


def test_the_reference_folds_segments_then_their_sums():
    """P = 2·SEGMENT + 6: three segments (the last short), then their three sums, each left to right; and
    with more than SEGMENT segment sums, the sums are segmented again."""
    x = partials(2 * SEGMENT + 6, 5)
    seg = [left_fold(list(x[s:s + SEGMENT])) for s in (0, SEGMENT, 2 * SEGMENT)]
    assert torch.equal(fold_reference(x, dim=0), left_fold(seg))
    big = partials(SEGMENT * (SEGMENT + 3), 4, seed=6)             # SEGMENT + 3 segments: two levels
    level1 = [left_fold(list(big[s:s + SEGMENT])) for s in range(0, big.shape[0], SEGMENT)]
    level2 = [left_fold(level1[s:s + SEGMENT]) for s in range(0, len(level1), SEGMENT)]
    assert torch.equal(fold_reference(big, dim=0), left_fold(level2))
    assert not torch.equal(fold_reference(big, dim=0), left_fold(list(big)))   # another order: other bits


@pytest.mark.parametrize("P", [SEGMENT + 1, 3 * SEGMENT - 5, SEGMENT * (SEGMENT + 3) + 7])
def test_longer_folds_match_the_reference_bit_for_bit(P):
    x = partials(2, P, 5, seed=P)
    assert torch.equal(sum_partials(x.to(KERNEL_DEVICE), dim=1).cpu(), fold_reference(x, dim=1))


def test_dims_dtypes_and_empty_sizes():
    """Any dim; inner wider than one program's block; the result cast once to out_dtype; P = 0 gives zeros
    and an empty outer or inner an empty result."""
    x = partials(2, SEGMENT + 9, reduce.BLOCK_INNER + 3)
    want = fold_reference(x, dim=1)
    assert torch.equal(sum_partials(x.to(KERNEL_DEVICE), dim=1).cpu(), want)
    # (2, 7, P): fold the last dim. Seven columns, not all of inner: with the folded dim last every column is
    # a program of its own (inner = 1), and 515 of them take the interpreter seconds to show the same thing.
    moved = x[..., :7].movedim(1, 2).contiguous()
    assert torch.equal(sum_partials(moved.to(KERNEL_DEVICE), dim=-1).cpu(), want[..., :7])
    low = sum_partials(x.to(KERNEL_DEVICE), dim=1, out_dtype=torch.bfloat16).cpu()
    assert low.dtype == torch.bfloat16
    if KERNEL_DEVICE == "cpu":   # the interpreter's cast to bf16 truncates where a GPU's rounds to nearest
        torch.testing.assert_close(low.float(), want, rtol=2 ** -7, atol=0)
    else:
        assert torch.equal(low, want.bfloat16())
    assert torch.equal(sum_partials(torch.empty(3, 0, 4, device=KERNEL_DEVICE), dim=1).cpu(), torch.zeros(3, 4))
    assert sum_partials(torch.empty(0, 5, 4, device=KERNEL_DEVICE), dim=1).shape == (0, 4)


@pytest.mark.gpu
@requires_gpu
def test_more_blocks_of_inner_than_a_cuda_grid_axis_holds():
    """CUDA caps a grid's second and third axes at 65,535 programs. The rotary backward folds dθ partials
    with inner = b·l·h·a numbers (2^25 at b4 l4096 h64 a32: 65,536 blocks of BLOCK_INNER), which failed to
    launch ("invalid argument") while the blocks of inner had an axis of their own. Two blocks past the cap,
    folded bit for bit as the reference folds them."""
    inner = 65_535 * reduce.BLOCK_INNER + reduce.BLOCK_INNER + 1
    x = torch.randn(1, 3, inner, device="cuda")
    assert torch.equal(sum_partials(x, dim=1), fold_reference(x, dim=1))
