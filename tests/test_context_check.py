"""mambalab.parallel.context_check's pieces that run in one process: the runs it makes, the float64 per-position
terms whose sums are the per-head gradients, and the single-process results it compares with. The ranks
themselves run in chapter 06 (and, for the same claims, in tests/distributed/test_context_parallel.py)."""
import pytest
import torch

import mambalab  # noqa: F401  (before triton)
from mambalab.parallel import context_check


def test_runs_cut_on_chunk_edges_and_once_inside():
    runs = context_check.check_runs(4, 64, 16)
    flat = [run for rnd in runs for run in rnd]
    assert [(ranks, pieces) for _, ranks, pieces in flat] == [
        ([0, 1, 2, 3], [16, 16, 16, 16]), ([0, 1], [32, 32]), ([2, 3], [24, 40]), ([0], [64])]
    for rnd in runs:   # the runs of a round use disjoint ranks
        members = [r for _, ranks, _ in rnd for r in ranks]
        assert len(members) == len(set(members))
    assert [pieces for _, _, pieces in (run for rnd in context_check.check_runs(2, 64, 16) for run in rnd)] == [
        [32, 32], [24, 40], [64]]


def test_runs_refuse_sizes_they_cannot_cut():
    with pytest.raises(ValueError, match="2 or 4 ranks"):
        context_check.check_runs(3, 96, 16)
    with pytest.raises(ValueError, match="multiple of ranks · chunk"):
        context_check.check_runs(4, 48, 16)


def test_per_position_terms_add_up_to_the_ops_gradients():
    sizes = dict(context_check.CHECK_SIZES, l=32)
    terms = context_check.per_position_terms(sizes)
    one = context_check.single_process(sizes)
    assert terms["dA"].shape == (1, 32, 2) and terms["dD"].shape == (1, 32, 2, 4)
    torch.testing.assert_close(terms["dA"].sum((0, 1)).float(), one["dA"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(terms["ddt_bias"].sum((0, 1)).float(), one["ddt_bias"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(terms["dD"].sum((0, 1, 3)).float(), one["dD"], atol=1e-5, rtol=1e-5)
