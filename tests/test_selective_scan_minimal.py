"""The minimal selective-scan kernels (a loop over l, and an associative scan over blocks of l) give the
reference's outputs on several shapes, including lengths that do not fill the last block and channel counts
that do not fill the last program, and refuse what they do not take."""
import pytest
import torch

import mambalab  # noqa: F401  (before triton: switches the interpreter on without a GPU)
from mambalab.device import DEVICE
from mambalab.kernels.selective_scan_minimal import selective_scan_minimal
from mambalab.ref.selective_scan import selective_scan_ref


def _inputs(b, d, n, l, seed=0):
    gen = torch.Generator().manual_seed(seed)
    u = torch.randn(b, d, l, generator=gen)
    delta = 0.5 * torch.rand(b, d, l, generator=gen)
    A = -(0.5 + torch.rand(d, n, generator=gen))
    B, C = torch.randn(b, n, l, generator=gen), torch.randn(b, n, l, generator=gen)
    return [x.to(DEVICE) for x in (u, delta, A, B, C)]


@pytest.mark.parametrize("kind", ["loop", "assoc"])
@pytest.mark.parametrize("b, d, n, l, block_d, block_l", [
    (1, 1, 1, 1, 1, 16),      # one step
    (2, 4, 8, 40, 4, 16),     # l not a multiple of the block
    (1, 5, 3, 33, 2, 8),      # d not a multiple of BLOCK_D, n not a power of two
    (2, 3, 16, 64, 4, 32),    # l a multiple of the block
])
def test_minimal_kernels_match_the_reference(kind, b, d, n, l, block_d, block_l):
    u, delta, A, B, C = _inputs(b, d, n, l)
    got = selective_scan_minimal(u, delta, A, B, C, kind=kind, block_d=block_d, block_l=block_l)
    want = selective_scan_ref(u, delta, A, B, C)
    assert got.shape == (b, d, l) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_the_two_kernels_agree_with_each_other_and_carry_the_state_across_blocks():
    # Long memory (Δ small) and several blocks: a state dropped between blocks would show.
    u, delta, A, B, C = _inputs(1, 2, 4, 70, seed=1)
    delta = delta * 0.05
    loop = selective_scan_minimal(u, delta, A, B, C, kind="loop", block_d=2)
    assoc = selective_scan_minimal(u, delta, A, B, C, kind="assoc", block_d=2, block_l=16)
    torch.testing.assert_close(assoc, loop, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(loop, selective_scan_ref(u, delta, A, B, C), atol=1e-5, rtol=1e-5)


def test_refuses_grouped_B_and_an_unknown_kind():
    u, delta, A, B, C = _inputs(1, 2, 4, 8)
    with pytest.raises(ValueError, match="B and C must have shape"):
        selective_scan_minimal(u, delta, A, B.unsqueeze(1), C)
    with pytest.raises(ValueError, match="kind must be"):
        selective_scan_minimal(u, delta, A, B, C, kind="fast")
