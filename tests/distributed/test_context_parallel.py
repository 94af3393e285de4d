"""Context parallelism (mambalab.parallel.context) on CPU processes (gloo), launched with torchrun.

One launch of 4 ranks (cp_workers.py) runs CP = 4 over the default group, then CP = 2 on the groups {0, 1} and
{2, 3} at once, each with cuts on chunk edges and inside chunks, and compares every result with the
single-process op. Shapes are tiny (l = 64, chunk 16, h = 2, p = 4, n = 4): the kernels run in Triton's
interpreter.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import mambalab  # noqa: F401
from mambalab.ops.conv1d import causal_conv1d_fn
from mambalab.ops.ssd import ssd_chunk_scan
from mambalab.parallel import context_parallel_conv1d, context_parallel_ssd

HERE = Path(__file__).resolve().parent
PER_POSITION = ("out", "final", "dx", "ddt", "dB", "dC", "dz")   # the module docstring's bitwise claim
PER_HEAD = ("dA", "dD", "ddt_bias")                               # folded per rank, then over ranks
RANK_SUMS_RTOL = 1e-5   # well above the reordering bound 2·γ_{P-1}·Σ|p_i| for P ≤ 16 partials of these sizes


def _launch(tmp: Path, nproc: int, names: str, backend: str = "gloo") -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if backend == "gloo":
        env["CUDA_VISIBLE_DEVICES"] = ""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           str(HERE / "cp_workers.py"), names, str(tmp), backend]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return json.loads((tmp / "rank0.json").read_text())


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    return _launch(tmp_path_factory.mktemp("cp"), 4, "ssd,conv,partial_grad,errors")


def _close(result: dict, names, rtol: float = RANK_SUMS_RTOL) -> dict:
    """The names whose difference from the single process exceeds rtol of their scale."""
    return {k: result[k] for k in names if not result[k]["max_diff"] <= rtol * max(1.0, result[k]["scale"])}


def _check_ssd(results: dict, splits, bitwise=("deterministic", "atomic"), rtol_inside=RANK_SUMS_RTOL) -> None:
    """Cuts on chunk edges: the per-position results bitwise in the ``bitwise`` reductions, to RANK_SUMS_RTOL
    in the others; the per-head sums to RANK_SUMS_RTOL. Cuts inside chunks: everything to ``rtol_inside``."""
    for reduction in ("deterministic", "atomic"):
        for split in splits:
            got = results[f"{reduction}/{split}"]
            assert set(got) == set(PER_POSITION + PER_HEAD)   # out, the final state and every gradient
            if split.endswith("edges") and reduction in bitwise:
                differ = {k: got[k]["max_diff"] for k in PER_POSITION if not got[k]["bitwise"]}
                assert not differ, f"{reduction}/{split}: not the single process's bits: {differ}"
                assert not _close(got, PER_HEAD), f"{reduction}/{split}"
            elif split.endswith("edges"):
                assert not _close(got, PER_POSITION + PER_HEAD), f"{reduction}/{split}"
            else:   # a cut inside a chunk regroups the sums: rounding, not bits
                assert not _close(got, PER_POSITION + PER_HEAD, rtol_inside), f"{reduction}/{split}"


def test_ssd_cp4_and_cp2_forward_and_gradients_equal_one_process(four_ranks):
    _check_ssd(four_ranks["ssd"], ("cp4/edges", "cp4/inside", "cp2/edges", "cp2/inside"))


def test_conv_halo_gives_the_single_process_bits_for_out_and_dx(four_ranks):
    for split in ("cp4/edges", "cp4/inside", "cp2/edges", "cp2/inside"):
        got = four_ranks["conv"][split]
        assert got["out"]["bitwise"] and got["dx"]["bitwise"], (split, got)
        assert not _close(got, ("dweight", "dbias")), split


def test_without_autograd_and_with_grad_on_one_rank_only(four_ranks):
    """Under no_grad nothing is sent back; with only the last rank's x requiring grad, the other ranks still run
    the backward's ring (the function records it on every rank if any rank records)."""
    got = four_ranks["partial_grad"]
    assert got == {"no_grad_out": True, "grad_out": True, "dx_last": True, "dx_others_none": True}


def test_bad_input_on_one_rank_raises_on_every_rank(four_ranks):
    short, heads = four_ranks["errors"]["conv_short"], four_ranks["errors"]["heads"]
    assert short[3].startswith("ValueError: x (b, d, l) = (1, 4, 2): each rank's piece needs at least width - 1 = 3")
    assert all(m == "ValueError: context_parallel_conv1d: the inputs of rank 3 of the context-parallel group are "
               "invalid (its error says why)" for m in short[:3]), short
    assert all("h (x.shape[2]) must be the same on every rank of the group; got [2, 3, 2, 2]" in m
               for m in heads), heads


def _ssd_inputs(gen):
    b, l, h, p, n = 1, 32, 2, 4, 4
    return (torch.randn(b, l, h, p, generator=gen), torch.randn(b, l, h, generator=gen),
            -torch.rand(h, generator=gen) - 0.5, torch.randn(b, l, 1, n, generator=gen),
            torch.randn(b, l, 1, n, generator=gen))


def test_without_a_process_group_it_is_the_op():
    x, dt, A, B, C = _ssd_inputs(torch.Generator().manual_seed(3))
    out, final = context_parallel_ssd(x, dt, A, B, C, 16, dt_softplus=True, return_final_states=True)
    want, want_final = ssd_chunk_scan(x, dt, A, B, C, 16, dt_softplus=True, return_final_states=True)
    assert torch.equal(out, want) and torch.equal(final, want_final)
    xc, w = torch.randn(1, 4, 8), torch.randn(4, 3)
    assert torch.equal(context_parallel_conv1d(xc, w, activation="silu"), causal_conv1d_fn(xc, w, activation="silu"))


def test_a_bad_shape_is_named_before_anything_runs():
    x, dt, A, B, C = _ssd_inputs(torch.Generator().manual_seed(4))
    with pytest.raises(ValueError, match=r"dt must have shape \(b, l, h\)"):
        context_parallel_ssd(x, dt[:, :-1], A, B, C, 16)
    with pytest.raises(ValueError, match="at least width - 1 = 3 positions"):
        context_parallel_conv1d(torch.randn(1, 4, 2), torch.randn(4, 4))


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs: NCCL takes one GPU a rank")
def test_nccl_on_two_gpus(tmp_path):
    """Atomic adds on a GPU order themselves at run time, and its dots read tf32: bits only in deterministic mode,
    and a cut inside a chunk rounds the entering states to tf32 at other positions."""
    got = _launch(tmp_path, 2, "ssd,conv", backend="nccl")
    _check_ssd(got["ssd"], ("cp2/edges", "cp2/inside"), bitwise=("deterministic",), rtol_inside=5e-3)
    for split in ("cp2/edges", "cp2/inside"):
        assert got["conv"][split]["out"]["bitwise"] and got["conv"][split]["dx"]["bitwise"], split
