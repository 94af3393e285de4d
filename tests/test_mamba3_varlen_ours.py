"""Packed sequences in Mamba-3's chunked scan: a packed row (``cu_seqlens``) equals its sequences run alone.

Each packed sequence starts from a zero state (SSM state, rotary angle and the trapezoid's previous k, v) or
from its own initial state, so the packed outputs, the gradients of every input and the per-sequence final
states must match separate calls,
with boundaries inside chunks, at chunk edges and a sequence of length 1; in both reduction modes, SISO and
MIMO; and the Mamba3 block packed must equal the block on each sequence.
"""
import pytest
import torch

from mambalab.kernels.mamba3 import angle_cumsum_bwd, angle_cumsum_fwd
from mambalab.modules import Mamba3
from mambalab.ops import mamba3_chunk_scan
from mambalab.ref.mamba3 import Mamba3State, mamba3_chunked

from conftest import make_mamba3_inputs

PER_STEP = ("q", "k", "v", "adt", "dt", "trap", "angles", "z")   # the inputs with an l axis


def _cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def _leaves(x):
    return {k: (t.detach().clone().requires_grad_(True) if isinstance(t, torch.Tensor) else t) for k, t in x.items()}


def _slice(x, s, e):
    return {k: (t[:, s:e] if k in PER_STEP and t is not None else t) for k, t in x.items()}


@pytest.mark.parametrize("r, chunk, lengths", [
    (1, 16, [1, 15, 16, 7]),     # boundaries at 1 (inside a chunk), 16 and 32 (chunk edges); a length-1 sequence
    (2, 8, [5, 1, 10, 8]),       # MIMO: boundaries at 5, 6 (inside), 16 (edge); a length-1 sequence inside
])
@pytest.mark.parametrize("reduction", ["deterministic", "atomic"])
def test_packed_equals_separate(r, chunk, lengths, reduction):
    x = make_mamba3_inputs(1, sum(lengths), 2, 16, 1, 16, r, 4, dtype=torch.float32, seed=r)
    cu = _cu(lengths)
    packed = _leaves(x)
    out = mamba3_chunk_scan(**packed, chunk_size=chunk, reduction=reduction, cu_seqlens=cu)
    dout = torch.randn_like(out)
    (out * dout).sum().backward()

    alone = _leaves(x)
    outs = []
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        o = mamba3_chunk_scan(**_slice(alone, s, e), chunk_size=chunk, reduction=reduction)
        (o * dout[:, s:e]).sum().backward()
        outs.append(o)
    torch.testing.assert_close(out, torch.cat(outs, dim=1), atol=2e-4, rtol=1e-4)
    for name, t in packed.items():
        if isinstance(t, torch.Tensor):
            torch.testing.assert_close(t.grad, alone[name].grad, atol=5e-4, rtol=1e-3, msg=lambda m: f"d{name}: {m}")


@pytest.mark.parametrize("r, chunk", [(1, 16), (2, 8)])
def test_packed_final_states(r, chunk):
    lengths = [3, 13, 1, 16]
    x = make_mamba3_inputs(1, sum(lengths), 2, 16, 1, 16, r, 4, dtype=torch.float32, seed=7)
    cu = _cu(lengths)
    with torch.no_grad():
        out, state = mamba3_chunk_scan(**x, chunk_size=chunk, return_final_state=True, cu_seqlens=cu)
        ref_out, ref_state = mamba3_chunked(**x, chunk_size=chunk, return_final_state=True, cu_seqlens=cu)
        for i, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
            _, alone = mamba3_chunk_scan(**_slice(x, s, e), chunk_size=chunk, return_final_state=True)
            for name, got, want in zip(alone._fields, state, alone):
                torch.testing.assert_close(got[i:i + 1], want, atol=2e-4, rtol=1e-4, msg=lambda m: f"{name}: {m}")
    torch.testing.assert_close(out, ref_out, atol=2e-4, rtol=1e-4)
    for name, got, want in zip(state._fields, state, ref_state):
        torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4, msg=lambda m: f"{name}: {m}")


def test_angle_cumsum_restarts_at_boundaries(monkeypatch):
    """The segmented scan across blocks of 16 positions: sequences within a block, across blocks, of length 1."""
    from mambalab.kernels.mamba3 import angle_cumsum
    monkeypatch.setattr(angle_cumsum, "_blocks", lambda a: (4, 16))
    lengths = [1, 15, 16, 20, 1]
    seq = torch.repeat_interleave(torch.arange(len(lengths), dtype=torch.int32), torch.tensor(lengths))[None]
    gen = torch.Generator().manual_seed(0)
    angles = torch.randn(1, sum(lengths), 2, 3, generator=gen)
    dt = torch.rand(1, sum(lengths), 2, generator=gen)
    theta = angle_cumsum_fwd(angles, dt, None, seq)
    a, d = angles.clone().requires_grad_(True), dt.clone().requires_grad_(True)
    ref = torch.cat([torch.cumsum(a[:, seq[0] == i] * d[:, seq[0] == i, :, None], 1) for i in range(len(lengths))],
                    dim=1)
    dtheta = torch.randn_like(theta)
    ref.backward(dtheta)
    torch.testing.assert_close(theta, ref.detach())
    dangles, ddt, _ = angle_cumsum_bwd(dtheta, angles, dt, False, seq)
    torch.testing.assert_close(dangles, a.grad)
    torch.testing.assert_close(ddt, d.grad)


@pytest.mark.parametrize("r, chunk", [(1, 16), (2, 8)])
def test_packed_states_with_gradients(r, chunk):
    """Per-sequence initial states in, final states out, gradients through both: packed == separate."""
    lengths = [6, 1, 17]
    S = len(lengths)
    x = make_mamba3_inputs(1, sum(lengths), 2, 16, 1, 16, r, 4, dtype=torch.float32, seed=3)
    gen = torch.Generator().manual_seed(5)
    x["initial_state"] = Mamba3State(torch.randn(S, 2, 4, generator=gen), torch.randn(S, 2, 16, 16, generator=gen),
                                     torch.randn(S, 2, r, 16, generator=gen), torch.randn(S, 2, 16, generator=gen))
    cu = _cu(lengths)

    def leaves():
        y = _leaves(x)
        y["initial_state"] = Mamba3State(*(t.clone().requires_grad_(True) for t in x["initial_state"]))
        return y

    packed = leaves()
    out, state = mamba3_chunk_scan(**packed, chunk_size=chunk, return_final_state=True, cu_seqlens=cu)
    gen = torch.Generator().manual_seed(6)
    dout, dstate = torch.randn(out.shape, generator=gen), [torch.randn(t.shape, generator=gen) for t in state]
    torch.autograd.backward([out, *state], [dout, *dstate])

    alone = leaves()
    outs, states = [], []
    for i, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        one = _slice(alone, s, e)
        one["initial_state"] = Mamba3State(*(t[i:i + 1] for t in alone["initial_state"]))
        o, st = mamba3_chunk_scan(**one, chunk_size=chunk, return_final_state=True)
        torch.autograd.backward([o, *st], [dout[:, s:e], *(d[i:i + 1] for d in dstate)])
        outs.append(o.detach())
        states.append([t.detach() for t in st])
    torch.testing.assert_close(out, torch.cat(outs, dim=1), atol=2e-4, rtol=1e-4)
    for j, name in enumerate(state._fields):
        torch.testing.assert_close(state[j], torch.cat([st[j] for st in states]), atol=2e-4, rtol=1e-4,
                                   msg=lambda m: f"{name}: {m}")
    for name, t in packed.items():
        if name == "initial_state":
            for f, got, want in zip(t._fields, t, alone[name]):
                torch.testing.assert_close(got.grad, want.grad, atol=5e-4, rtol=1e-3, msg=lambda m: f"d{f}: {m}")
        elif isinstance(t, torch.Tensor):
            torch.testing.assert_close(t.grad, alone[name].grad, atol=5e-4, rtol=1e-3, msg=lambda m: f"d{name}: {m}")
    ref_out, ref_state = mamba3_chunked(**x, chunk_size=chunk, return_final_state=True, cu_seqlens=cu)
    torch.testing.assert_close(out, ref_out, atol=2e-4, rtol=1e-4)


def test_packed_rejects():
    x = make_mamba3_inputs(1, 20, 2, 16, 1, 16, 1, 4, dtype=torch.float32)
    with pytest.raises(ValueError, match="cu_seqlens"):
        mamba3_chunk_scan(**x, chunk_size=16, cu_seqlens=_cu([10, 9]))
    with pytest.raises(ValueError, match="cu_seqlens"):
        mamba3_chunk_scan(**x, chunk_size=16, cu_seqlens=_cu([10, 0, 10]))
    with pytest.raises(ValueError, match="initial_state.angle"):
        bad = make_mamba3_inputs(1, 20, 2, 16, 1, 16, 1, 4, dtype=torch.float32, init=True)
        mamba3_chunk_scan(**bad, chunk_size=16, cu_seqlens=_cu([10, 10]))


@pytest.mark.parametrize("is_mimo", [False, True])
def test_block_packed_equals_separate(is_mimo):
    torch.manual_seed(0)
    block = Mamba3(d_model=32, d_state=16, expand=1, headdim=16, is_mimo=is_mimo, mimo_rank=2,
                   chunk_size=8 if is_mimo else 16, layer_idx=0)
    lengths = [7, 1, 12]
    u = torch.randn(1, sum(lengths), 32, requires_grad=True)
    out = block(u, cu_seqlens=_cu(lengths))
    out.square().sum().backward()
    grads = {k: p.grad.clone() for k, p in block.named_parameters()}
    du = u.grad.clone()
    block.zero_grad()
    u.grad = None
    cu = _cu(lengths).tolist()
    alone = torch.cat([block(u[:, s:e]) for s, e in zip(cu, cu[1:])], dim=1)
    alone.square().sum().backward()
    torch.testing.assert_close(out, alone, atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(du, u.grad, atol=5e-4, rtol=1e-3)
    for k, p in block.named_parameters():
        torch.testing.assert_close(grads[k], p.grad, atol=5e-4, rtol=1e-3, msg=lambda m: f"d{k}: {m}")
