"""Context parallelism (mambalab.parallel.context) on CPU processes (gloo), launched with torchrun.

One launch of 4 ranks (cp_workers.py) runs CP = 4 over the default group, then CP = 2 on the groups {0, 1} and
{2, 3} at once, each with cuts on chunk edges and inside chunks, and compares every result with the
single-process op. Shapes are tiny (l = 64, chunk 16, h = 2, p = 4, n = 4): the kernels run in Triton's
interpreter. On a GPU, the same ring runs as ranks of one process (point-to-point calls through in-process
queues), and over NCCL where there are two GPUs.
"""
import collections
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

import mambalab  # noqa: F401
from mambalab.ops.conv1d import causal_conv1d_fn
from mambalab.ops.ssd import ssd_chunk_scan
from mambalab.parallel import context, context_parallel_conv1d, context_parallel_ssd

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
    for op in ("ssd", "conv1d"):   # seq_idx 0, 0, 1, 0 on the four ranks: every rank names the cut
        got = four_ranks["errors"][f"seq_{op}"]
        assert all(m == f"ValueError: context_parallel_{op}: seq_idx must be nondecreasing along the whole sequence; "
                   "it decreases at the cut between ranks 2 and 3 of the context-parallel group" for m in got), got


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


class _Mailbox:
    """torch.distributed's point-to-point calls inside one process: a queue for each (sender, receiver). The
    ranks run one after another, forwards first to last and backwards last to first, so every receive finds
    its message queued."""

    def __init__(self, world: int):
        self.world, self.rank, self.queues = world, 0, collections.defaultdict(collections.deque)

    def isend(self, tensor, dst, group=None):
        self.queues[(self.rank, dst)].append(tensor.clone())
        return types.SimpleNamespace(wait=lambda: None)

    def recv(self, tensor, src, group=None):
        tensor.copy_(self.queues[(src, self.rank)].popleft())

    def ranks(self, group):
        r = self.rank
        return r, self.world, (r - 1 if r > 0 else None), (r + 1 if r < self.world - 1 else None)


def _agree_alone(what, local, error, device, group):
    if error is not None:
        raise error
    return torch.tensor([local], dtype=torch.int64)


def _virtual_ring(monkeypatch, pieces, device, dtype, reduction, sizes=(2, 4, 16, 16, 64), seq_idx=None):
    """context_parallel_ssd and context_parallel_conv1d over ``pieces`` (lengths along l) as ranks of one
    process (:class:`_Mailbox`), against the single-process ops: {name: (bitwise, max |difference|, scale)}.
    sizes: (b, h, p, n, chunk). seq_idx: (b, l) packed sequences, each rank passing its piece (the ranks' first
    and last indices, which the ops all-gather, are read from the whole)."""
    mail = _Mailbox(len(pieces))
    bounds = [sum(pieces[:r]) for r in range(len(pieces) + 1)]
    monkeypatch.setattr(context, "dist", types.SimpleNamespace(isend=mail.isend, recv=mail.recv))
    monkeypatch.setattr(context, "_ranks", mail.ranks)
    monkeypatch.setattr(context, "_agree", _agree_alone)
    monkeypatch.setattr(context, "_sequence_ends", lambda what, piece, k, group: torch.stack(
        [torch.cat([seq_idx[:, lo:lo + k], seq_idx[:, hi - k:hi]], 1).long() for lo, hi in zip(bounds, bounds[1:])]))
    (b, h, p, n, q), L = sizes, sum(pieces)
    gen = torch.Generator().manual_seed(5)
    seq = {k: torch.randn(*shape, generator=gen).to(device, dtype) for k, shape in
           (("x", (b, L, h, p)), ("B", (b, L, 1, n)), ("C", (b, L, 1, n)), ("z", (b, L, h, p)))}
    seq["dt"] = (torch.randn(b, L, h, generator=gen) - 1.0).to(device)
    seq["u"] = torch.randn(b, 8, L, generator=gen).to(device, dtype)    # the convolution's input (b, d, l)
    A, D = (-torch.rand(h, generator=gen) - 0.5).to(device), torch.randn(h, generator=gen).to(device)
    weight = torch.randn(8, 4, generator=gen).to(device)
    w_out, w_conv = torch.randn(b, L, h, p, generator=gen).to(device), torch.randn(b, 8, L, generator=gen).to(device)

    def loss(ins, lo, hi, last):
        piece = None if seq_idx is None else seq_idx[:, lo:hi].to(device)
        y, final = context_parallel_ssd(ins["x"], ins["dt"], A, ins["B"], ins["C"], q, D=D, z=ins["z"],
                                        dt_softplus=True, return_final_states=True, reduction=reduction,
                                        seq_idx=piece)
        conv = context_parallel_conv1d(ins["u"], weight, activation="silu", seq_idx=piece)
        total = (y.float() * w_out[:, lo:hi]).sum() + (conv.float() * w_conv[..., lo:hi]).sum()
        return total + ((final * w_out[:, 0, :, :, None]).sum() if last else 0.0), y, conv

    runs = []
    for r in range(len(pieces)):   # forwards in rank order
        mail.rank = r
        lo, hi = bounds[r], bounds[r + 1]
        ins = {k: (v[..., lo:hi] if k == "u" else v[:, lo:hi]).clone().requires_grad_() for k, v in seq.items()}
        runs.append((ins, *loss(ins, lo, hi, r == len(pieces) - 1)))
    for r in reversed(range(len(pieces))):   # backwards from the last rank
        mail.rank = r
        runs[r][1].backward()
    got = {"out": torch.cat([run[2] for run in runs], 1), "conv": torch.cat([run[3] for run in runs], 2),
           **{f"d{k}": torch.cat([run[0][k].grad for run in runs], 2 if k == "u" else 1) for k in seq}}

    monkeypatch.undo()
    ins = {k: v.clone().requires_grad_() for k, v in seq.items()}
    whole = None if seq_idx is None else seq_idx.to(device)
    y, final = ssd_chunk_scan(ins["x"], ins["dt"], A, ins["B"], ins["C"], q, D=D, z=ins["z"], dt_softplus=True,
                              return_final_states=True, reduction=reduction, seq_idx=whole)
    conv = causal_conv1d_fn(ins["u"], weight, activation="silu", seq_idx=whole)
    ((y.float() * w_out).sum() + (conv.float() * w_conv).sum() + (final * w_out[:, 0, :, :, None]).sum()).backward()
    want = {"out": y, "conv": conv, **{f"d{k}": ins[k].grad for k in seq}}
    return {k: (torch.equal(got[k], want[k]), (got[k].float() - want[k].float()).abs().max().item(),
                want[k].float().abs().max().item()) for k in want}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_ring_on_one_gpu_gives_the_single_process_bits(monkeypatch, dtype):
    """The ranks as one process on one GPU (tf32 dots; bf16 entering states): deterministic mode, cuts on chunk
    edges (4 ranks of 128 positions, chunk 64): out, the conv, and every per-position gradient, bitwise."""
    got = _virtual_ring(monkeypatch, [128, 128, 128, 128], "cuda", dtype, "deterministic")
    assert all(bitwise for bitwise, _, _ in got.values()), got


def test_packed_sequences_across_the_cuts_give_the_single_process_bits(monkeypatch):
    """Three ranks of 32 positions (chunk 16; cuts at 32 and 64), on the CPU. Row 0: a sequence runs from 20 to
    45, across the first cut, and one starts exactly at the second; row 1: one starts exactly at the first cut
    and one at 62, two positions before the second (the conv's halo reads both sequences). The state that
    crosses a cut reaches only the sequence it belongs to: out, the final state's use, the conv and every
    per-position gradient equal the single process's bit for bit."""
    seq_idx = torch.zeros(2, 96, dtype=torch.int32)
    seq_idx[0, 20:], seq_idx[0, 45:], seq_idx[0, 64:] = 1, 2, 3
    seq_idx[1, 32:], seq_idx[1, 62:] = 1, 4
    got = _virtual_ring(monkeypatch, [32, 32, 32], "cpu", torch.float32, "deterministic", sizes=(2, 2, 4, 4, 16),
                        seq_idx=seq_idx)
    assert set(got) == {"out", "conv", "dx", "dB", "dC", "dz", "ddt", "du"}
    assert all(bitwise for bitwise, _, _ in got.values()), got


def test_packed_sequences_refuse_padding_and_a_wrong_shape():
    x, dt, A, B, C = _ssd_inputs(torch.Generator().manual_seed(6))
    padded = torch.zeros(1, 32, dtype=torch.int32)
    padded[0, 30:] = -1
    with pytest.raises(ValueError, match=r"seq_idx must be nonnegative under context parallelism"):
        context_parallel_ssd(x, dt, A, B, C, 16, seq_idx=padded)
    with pytest.raises(ValueError, match=r"seq_idx must have shape \(b, l_r\)"):
        context_parallel_conv1d(torch.randn(1, 4, 8), torch.randn(4, 4), seq_idx=padded)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_sequences_across_the_cuts_on_one_gpu_give_the_single_process_bits(monkeypatch, dtype):
    """4 ranks of 128 positions (chunk 64) as one process on one GPU, deterministic mode: row 0 has a sequence
    across the first cut and one starting exactly at the second; row 1 one starting at the first cut and a
    boundary two positions before the third. out, the conv and every per-position gradient, bitwise."""
    seq_idx = torch.zeros(2, 512, dtype=torch.int32)
    seq_idx[0, 100:], seq_idx[0, 150:], seq_idx[0, 256:] = 1, 2, 3
    seq_idx[1, 128:], seq_idx[1, 382:] = 1, 2
    got = _virtual_ring(monkeypatch, [128, 128, 128, 128], "cuda", dtype, "deterministic", seq_idx=seq_idx)
    assert all(bitwise for bitwise, _, _ in got.values()), got
