"""Mamba-3 against mamba-ssm's own PyTorch references, on the CPU: its rotary inference reference (both rotary
layouts) and its decode-step reference (SISO and MIMO), fed the same inputs in its layouts.

mamba-ssm's Triton and TileLang kernels are compared with ours on a GPU (tests/test_mamba3_kernels.py,
tests/test_mamba3_module.py); these references run anywhere, so this file pins on every machine that we
compute mamba-ssm's function, and in particular its MIMO rotary layout (pairs (i, i + n/2), where its SISO and
our kernels turn (2i, 2i+1): :func:`mambalab.ref.mamba3.halves_order`). The decode-step reference sits in a
module that imports the CuTe DSL, which is GPU-only; :func:`mambalab.oracle.source_function` compiles the
reference alone from mamba-ssm's installed source.
"""
import math

import pytest
import torch

from mambalab import oracle
from mambalab.ops import mamba3_step
from mambalab.ref.mamba3 import Mamba3State, biased_rotated, halves_order, mamba3_step_ref

B, H, P, N, A = 2, 3, 8, 16, 4          # batch, heads, head dimension, state, rotary pairs (a < n/2: some stay)


def rotary_reference():
    return oracle.module("ops.triton.mamba3.mamba3_mimo_rotary_step").apply_rotary_qk_inference_reference


def step_reference():
    return oracle.source_function("ops.cute.mamba3.mamba3_step_fn", "selective_state_update_fused_ref_v2")


def token(r, seed=0):
    """One token's inputs in our layouts (fp64, one q/k group) and the raw angle projection mamba-ssm takes
    (ours is π·tanh of it), with a random state to step from."""
    gen = torch.Generator().manual_seed(seed)
    rn = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)
    uniform = lambda *s: torch.rand(*s, generator=gen, dtype=torch.float64)
    dt = 0.05 + 0.5 * uniform(B, H)
    angles_raw = rn(B, H, A)
    x = {"q": rn(B, r, 1, N), "k": rn(B, r, 1, N), "v": rn(B, H, P), "adt": -dt * (0.5 + uniform(H)), "dt": dt,
         "trap": uniform(B, H), "q_bias": 1 + 0.1 * rn(H, r, N), "k_bias": 1 + 0.1 * rn(H, r, N),
         "angles": math.pi * torch.tanh(angles_raw), "D": rn(H), "z": rn(B, H, P)}
    if r > 1:
        x.update(mimo_v=(1 + 0.1 * rn(H, r, P)) / r, mimo_z=1 + 0.1 * rn(H, r, P), mimo_o=(1 + 0.1 * rn(H, r, P)) / r)
    state = Mamba3State(rn(B, H, A), rn(B, H, P, N), rn(B, H, r, N), rn(B, H, P))
    return x, angles_raw, state


def in_their_layout(x, state, r):
    """The permutation of n that our kernels need to compute mamba-ssm's rotation for rank r (its SISO turns
    adjacent pairs as ours do; its MIMO the halves), and x, state with q, k, biases, state.k, state.ssm in it."""
    if r == 1:
        return None, x, state
    order = halves_order(N, A)
    x = dict(x, **{name: x[name][..., order] for name in ("q", "k", "q_bias", "k_bias")})
    return order, x, state._replace(k=state.k[..., order], ssm=state.ssm[..., order])


def heads(t):
    """Our one-group (b, r, 1, n) -> mamba-ssm's per head (b, r, h, n)."""
    return t.expand(-1, -1, H, -1)


@pytest.mark.parametrize("r", [1, 4], ids=["siso-pairwise", "mimo-halves"])
def test_rotary_matches_mamba_ssm_reference(r):
    """k̂ = Rot(θ)(k + bias) and θ = θ_prev + π·tanh(angle)·Δ against apply_rotary_qk_inference_reference, whose
    SISO (rotate_pairwise) turns the pairs (2i, 2i+1) and whose MIMO turns (i, i + n/2): ours, handed q, k and
    biases in halves_order, gives its MIMO result in that order. The other layout differs, so the test can fail."""
    x, angles_raw, state = token(r)
    q_hat, k_hat, theta = rotary_reference()(heads(x["q"]), heads(x["k"]), state.angle, angles_raw, x["dt"],
                                             x["q_bias"].transpose(0, 1), x["k_bias"].transpose(0, 1),
                                             rotate_pairwise=r == 1)
    ours_theta = state.angle + x["angles"] * x["dt"][..., None]
    torch.testing.assert_close(ours_theta, theta)
    order, xo, _ = in_their_layout(x, state, r)
    back = (lambda t: t) if order is None else (lambda t: t[..., torch.argsort(order)])
    for name, want in (("q", q_hat), ("k", k_hat)):
        got = back(biased_rotated(xo[name], xo[f"{name}_bias"], ours_theta))              # (b, r, h, n)
        torch.testing.assert_close(got, want, msg=lambda m: f"{name}̂: {m}")
        other = biased_rotated(x[name], x[f"{name}_bias"], ours_theta) if order is not None else None
        if other is not None:   # without the permutation ours turns other pairs: the layout matters
            assert (other - want).abs().max() > 1e-2


@pytest.mark.parametrize("step", [mamba3_step_ref, mamba3_step], ids=["reference", "kernel"])
@pytest.mark.parametrize("r", [1, 2, 4], ids=["siso", "mimo2", "mimo4"])
def test_decode_step_matches_mamba_ssm_reference(r, step):
    """One decode step from a random state against mamba-ssm's: its rotary reference then its fused
    state-update reference (selective_state_update_fused_ref_v2, the PyTorch reference of its CuTe decode
    kernel), which take A rather than A·Δ, the previous step's rotated k̂ (B_state) and raw v (x_state), and
    the rank weights as (r, h, p) (ones for SISO, as its module's step passes). Output, new state, new k̂ and θ
    in fp64. For MIMO ours runs in halves_order (:func:`in_their_layout`): its state's n axis comes back in it."""
    x, angles_raw, state = token(r, seed=1)
    q_hat, k_hat, theta = rotary_reference()(heads(x["q"]), heads(x["k"]), state.angle, angles_raw, x["dt"],
                                             x["q_bias"].transpose(0, 1), x["k_bias"].transpose(0, 1),
                                             rotate_pairwise=r == 1)
    ones = torch.ones(r, H, P, dtype=torch.float64)
    w = lambda name: x[name].transpose(0, 1) if r > 1 else ones                  # (h, r, p) -> its (r, h, p)
    out, ssm = step_reference()(state.ssm, x["adt"] / x["dt"], k_hat, q_hat, w("mimo_v"), x["v"], w("mimo_z"), x["z"],
                                x["dt"], state.k.transpose(1, 2), state.v, x["trap"], x["D"], w("mimo_o"),
                                compute_dtype=torch.float64)
    order, xo, so = in_their_layout(x, state, r)
    tol = {}
    if step is mamba3_step:   # the kernel takes fp32 at most (and computes in it)
        xo, so = {k: t.float() for k, t in xo.items()}, Mamba3State(*(t.float() for t in so))
        tol = dict(rtol=1e-5, atol=1e-5)
    got, new = step(so, **xo)
    back = (lambda t: t) if order is None else (lambda t: t[..., torch.argsort(order)])
    torch.testing.assert_close(got.double(), out, **tol)
    torch.testing.assert_close(back(new.ssm).double(), ssm, **tol)
    torch.testing.assert_close(back(new.k).double(), k_hat.transpose(1, 2), **tol)
    torch.testing.assert_close(new.angle.double(), theta, **tol)
    torch.testing.assert_close(new.v.double(), x["v"], **tol)
