"""benchmarks/bench_conv.py's pieces that decide what a GPU run reports: the candidate loader and the row a
candidate gets, its bits compared through mambalab's fingerprint (its kernels run here through Triton's
interpreter, its timing stubbed out), and the commit a benchmark's JSON records (benchmarks/common.py)."""
from pathlib import Path

import pytest
import torch

from conftest import benchmark_module
from mambalab.device import DEVICE
from mambalab.kernels import conv1d

PACKAGE_CONV = Path(conv1d.__file__)


@pytest.fixture(scope="module")
def bench():
    return benchmark_module("bench_conv")


def conv_inputs(seed: int, b: int = 2, d: int = 40, l: int = 70):
    """Channel-last x and dout (b, d, l), as the bench passes them, and a width-4 weight and a bias."""
    torch.manual_seed(seed)
    x = torch.randn(b, l, d, device=DEVICE).transpose(1, 2)
    dout = torch.randn(b, l, d, device=DEVICE).transpose(1, 2)
    return x, dout, torch.randn(d, 4, device=DEVICE) / 4, torch.randn(d, device=DEVICE)


def test_a_candidate_is_a_fresh_copy_with_its_constants_set(bench):
    candidate = bench.load_candidate(f"{PACKAGE_CONV}:NUM_WARPS=8,FORWARD_BLOCK_L=64", 0)
    assert (candidate.NUM_WARPS, candidate.FORWARD_BLOCK_L) == (8, 64)
    assert candidate is not conv1d and conv1d.NUM_WARPS != 8                    # the package's own untouched
    with pytest.raises(SystemExit, match="no constant NOT_A_CONSTANT"):
        bench.load_candidate(f"{PACKAGE_CONV}:NOT_A_CONSTANT=1", 1)


def test_a_candidate_row_says_which_results_keep_the_packages_bits(bench, monkeypatch):
    monkeypatch.setattr(bench, "time_ms", lambda fn, **_: (fn(), 1.0)[1])
    x, dout, weight, bias = conv_inputs(seed=0)
    row, results = bench.kernels_row(conv1d, x, dout, weight, bias)
    assert set(row) == {"fwd_ms", "bwd_ms", "fwd_TBps", "bwd_TBps"}
    reference = [bench.bits(t) for t in results]

    retiled = bench.load_candidate(f"{PACKAGE_CONV}:FORWARD_BLOCK_L=64,FORWARD_BLOCK_D=32", 0)
    row, _ = bench.kernels_row(retiled, x, dout, weight, bias, reference)
    assert row["out_same_bits"] and row["dx_same_bits"] and row["partials_same_bits"]

    off = bench.load_candidate(str(PACKAGE_CONV), 1)
    forward = off.causal_conv1d_fwd
    monkeypatch.setattr(off, "causal_conv1d_fwd", lambda *a: (lambda o: (o[0] * 1.0001, o[1]))(forward(*a)))
    row, _ = bench.kernels_row(off, x, dout, weight, bias, reference)
    assert not row["out_same_bits"] and row["dx_same_bits"] and row["partials_same_bits"]


def test_a_candidate_with_another_backward_tile_launches_grids_of_that_tile(bench):
    """The backward's grid and partials count read BLOCK_L when called: a copy with BLOCK_L set launches one
    program a block of that size, so dx keeps its bits and the partials, one row a block, fold to dw and dbias
    (another order: equal within rounding)."""
    x, dout, weight, bias = conv_inputs(seed=1)
    b, d = x.shape[:2]
    dx, dweight, dbias, _ = conv1d.causal_conv1d_bwd(x, weight, bias, None, None, dout, None, True)
    retiled = bench.load_candidate(f"{PACKAGE_CONV}:BLOCK_L=16,BLOCK_D=32,NUM_WARPS=2", 0)
    dx_tiled, _, partials = retiled.causal_conv1d_bwd_partials(x, weight, bias, None, None, dout, None, True)
    assert partials.shape == (b * 5, d, 5)                                      # cdiv(70, 16) = 5 blocks a row
    assert torch.equal(dx_tiled, dx)
    sums = partials.sum(0)
    torch.testing.assert_close(sums[:, :4], dweight, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sums[:, 4], dbias, rtol=1e-5, atol=1e-5)


def test_the_commit_a_json_records(monkeypatch):
    common = benchmark_module("common")
    monkeypatch.setenv("MAMBALAB_COMMIT", "abc1234")
    assert common.commit() == "abc1234"
    monkeypatch.delenv("MAMBALAB_COMMIT")
    head = common.commit()                       # this checkout's HEAD, or None where git or .git is missing
    assert head is None or (len(head) >= 7 and all(ch in "0123456789abcdef" for ch in head))
