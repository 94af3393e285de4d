"""Mamba-3 against mamba-ssm's own PyTorch references, on the CPU: its rotary inference reference (both rotary
layouts) and its decode step (:func:`mambalab.oracle.mamba3_decode_reference`: that rotary reference, then its
fused state-update reference), SISO and MIMO, fed the same inputs.

mamba-ssm's Triton and TileLang kernels are compared with ours on a GPU (tests/test_mamba3_kernels.py,
tests/test_mamba3_module.py); these references run anywhere, so this file pins on every machine that we
compute mamba-ssm's function, and in particular its MIMO rotary layout (pairs (i, i + n/2), where its SISO and
our kernels turn (2i, 2i+1): :func:`mambalab.ref.mamba3.halves_order`).
"""
import math

import pytest
import torch

from mambalab import oracle
from mambalab.ops import mamba3_step
from mambalab.ref.mamba3 import Mamba3State, biased_rotated, halves_order, mamba3_step_ref

B, H, P, N, A = 2, 4, 8, 16, 4          # batch, heads, head dimension, state, rotary pairs (a < n/2: some stay)


def token(r, seed=0, g=1):
    """One token's inputs in our layouts (fp64, g q/k groups) but for the raw angle projection, which
    mamba-ssm takes (ours is π·tanh of it), and a random state to step from."""
    gen = torch.Generator().manual_seed(seed)
    rn = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)
    uniform = lambda *s: torch.rand(*s, generator=gen, dtype=torch.float64)
    dt = 0.05 + 0.5 * uniform(B, H)
    x = {"q": rn(B, r, g, N), "k": rn(B, r, g, N), "v": rn(B, H, P), "adt": -dt * (0.5 + uniform(H)), "dt": dt,
         "trap": uniform(B, H), "q_bias": 1 + 0.1 * rn(H, r, N), "k_bias": 1 + 0.1 * rn(H, r, N),
         "angles_raw": rn(B, H, A), "D": rn(H), "z": rn(B, H, P)}
    if r > 1:
        x.update(mimo_v=(1 + 0.1 * rn(H, r, P)) / r, mimo_z=1 + 0.1 * rn(H, r, P), mimo_o=(1 + 0.1 * rn(H, r, P)) / r)
    state = Mamba3State(rn(B, H, A), rn(B, H, P, N), rn(B, H, r, N), rn(B, H, P))
    return x, state


def ours(x, state, r):
    """Our arguments for mamba-ssm's function: angles after π·tanh and, for MIMO, q, k, biases, state.k and
    state.ssm in halves_order (its MIMO turns the pairs (i, i + n/2)). Returns (x, state, the order or None)."""
    x = dict(x)
    x["angles"] = math.pi * torch.tanh(x.pop("angles_raw"))
    if r == 1:
        return x, state, None
    order = halves_order(N, A)
    x.update({name: x[name][..., order] for name in ("q", "k", "q_bias", "k_bias")})
    return x, state._replace(k=state.k[..., order], ssm=state.ssm[..., order]), order


@pytest.mark.parametrize("r", [1, 4], ids=["siso-pairwise", "mimo-halves"])
def test_rotary_matches_mamba_ssm_reference(r):
    """k̂ = Rot(θ)(k + bias) and θ = θ_prev + π·tanh(angle)·Δ against apply_rotary_qk_inference_reference, whose
    SISO (rotate_pairwise) turns the pairs (2i, 2i+1) and whose MIMO turns (i, i + n/2): ours, handed q, k and
    biases in halves_order, gives its MIMO result in that order. The other layout differs, so the test can fail."""
    x, state = token(r)
    rotary = oracle.module("ops.triton.mamba3.mamba3_mimo_rotary_step").apply_rotary_qk_inference_reference
    q_hat, k_hat, theta = rotary(x["q"].expand(-1, -1, H, -1), x["k"].expand(-1, -1, H, -1), state.angle,
                                 x["angles_raw"], x["dt"], x["q_bias"].transpose(0, 1), x["k_bias"].transpose(0, 1),
                                 rotate_pairwise=r == 1)
    mine, _, order = ours(x, state, r)
    ours_theta = state.angle + mine["angles"] * x["dt"][..., None]
    torch.testing.assert_close(ours_theta, theta)
    back = (lambda t: t) if order is None else (lambda t: t[..., torch.argsort(order)])
    for name, want in (("q", q_hat), ("k", k_hat)):
        got = back(biased_rotated(mine[name], mine[f"{name}_bias"], ours_theta))          # (b, r, h, n)
        torch.testing.assert_close(got, want, msg=lambda m: f"{name}̂: {m}")
        if order is not None:   # without the permutation ours turns other pairs: the layout matters
            assert (biased_rotated(x[name], x[f"{name}_bias"], ours_theta) - want).abs().max() > 1e-2


@pytest.mark.parametrize("step", [mamba3_step_ref, mamba3_step], ids=["reference", "kernel"])
@pytest.mark.parametrize("r, g", [(1, 1), (2, 1), (4, 1), (4, 2)], ids=["siso", "mimo2", "mimo4", "mimo4-2groups"])
def test_decode_step_matches_mamba_ssm_reference(r, g, step):
    """One decode step from a random state against mamba-ssm's (:func:`mambalab.oracle.mamba3_decode_reference`):
    output, new state, new k̂, θ and v; fp64 for our reference, fp32 for our Triton step (its dtypes; within
    1e-5). For MIMO ours runs in halves_order (:func:`ours`), and its state's n axis comes back in it. With
    g = 2 groups, head i reads group i // (h / g) on both sides."""
    x, state = token(r, seed=1, g=g)
    want_out, want = oracle.mamba3_decode_reference(state, **x)
    mine, mine_state, order = ours(x, state, r)
    tol = {}
    if step is mamba3_step:   # the kernel takes fp32 at most (and computes in it)
        mine, mine_state = {k: t.float() for k, t in mine.items()}, Mamba3State(*(t.float() for t in mine_state))
        tol = dict(rtol=1e-5, atol=1e-5)
    got_out, got = step(mine_state, **mine)
    back = (lambda t: t) if order is None else (lambda t: t[..., torch.argsort(order)])
    torch.testing.assert_close(got_out.double(), want_out, **tol)
    for name in Mamba3State._fields:
        value = getattr(got, name).double()
        expected = getattr(want, name)
        if name == "angle":   # ours is kept in [0, 2π), as mamba-ssm's kernels keep it; its reference does not
            assert bool(((value >= 0) & (value < 2 * math.pi)).all())
            value = expected + torch.remainder(value - expected + math.pi, 2 * math.pi) - math.pi   # on the circle
        torch.testing.assert_close(back(value) if name in ("ssm", "k") else value, expected, **tol,
                                   msg=lambda m: f"state.{name}: {m}")


def test_decode_reference_without_d_or_z():
    """The oracle's decode step without D and z (its reference always adds D v: the oracle passes zeros)."""
    x, state = token(2, seed=2)
    x.update(D=None, z=None)
    want_out, want = oracle.mamba3_decode_reference(state, **x)
    mine, mine_state, order = ours(x, state, 2)
    got_out, got = mamba3_step_ref(mine_state, **mine)
    torch.testing.assert_close(got_out, want_out)
    torch.testing.assert_close(got.ssm[..., torch.argsort(order)], want.ssm)
