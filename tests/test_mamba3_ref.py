"""mambalab.ref.mamba3: the chunked form against the recurrence (forward, final state, every gradient) in
fp64; the recurrence against independent formulations (Mamba-2's SSD when λ = 1 and nothing turns, a complex
diagonal state for the rotary trick, the update rule written out); bad input named."""
import math

import pytest
import torch

from mambalab.ref.mamba3 import (Mamba3State, halves_order, halves_to_pairs, mamba3_chunked, mamba3_quadratic,
                                 mamba3_recurrent, mamba3_step_ref, pairs_to_halves, rotate_pairs, scan_weights,
                                 step_weights, zero_state)
from mambalab.ref.ssd import ssd_recurrent

from conftest import make_mamba3_inputs, rotate_halves

STATE_FIELDS = Mamba3State._fields
SEQUENCE = ("q", "k", "v", "adt", "dt", "trap", "angles", "z")  # the inputs with an l axis


def leaves(inputs):
    """Every tensor of the inputs (the initial state's fields included), by name."""
    out = {}
    for name, t in inputs.items():
        if isinstance(t, Mamba3State):
            out.update({f"initial_state.{f}": s for f, s in zip(STATE_FIELDS, t)})
        elif t is not None:
            out[name] = t
    return out


# ---------------------------------------------------------------------------------------------- one weight matrix
@pytest.mark.parametrize("r", [1, 2, 4])
def test_quadratic_form_matches_recurrence(r):
    """The whole scan as one matrix whose same-step blocks weigh γ_t for every pair of ranks (the form the
    kernels' step mode computes chunk by chunk) gives the recurrence's outputs, with D, gate and W's."""
    inp = make_mamba3_inputs(2, 7, 4, 3, 2, 8, r, 2, dtype=torch.float64, seed=10 + r)
    inp.pop("initial_state", None)
    want = mamba3_recurrent(**inp)
    got = mamba3_quadratic(**inp)
    assert (got - want).abs().max() <= 1e-12 * want.abs().max()


def test_scan_weights_blocks():
    """scan_weights' structure on numbers small enough to write out: one head, two steps, two ranks."""
    adt = torch.tensor([[[-0.5], [-1.0]]], dtype=torch.float64)              # (b, l, h)
    sigma = torch.tensor([[[0.3], [0.7]]], dtype=torch.float64)
    gamma = torch.tensor([[[0.2], [0.4]]], dtype=torch.float64)
    W = scan_weights(adt, sigma, gamma, 2)[0, 0]                              # (4, 4): positions (t, rank)
    e = math.exp(-1.0) * 0.3                                                  # step 0's input seen from step 1
    want = torch.tensor([[0.2, 0.2, 0, 0], [0.2, 0.2, 0, 0], [e, e, 0.4, 0.4], [e, e, 0.4, 0.4]],
                        dtype=torch.float64)
    assert torch.allclose(W, want)
    gamma, sigma = step_weights(torch.full((1, 3, 1), 0.5), torch.full((1, 3, 1), 0.25))
    assert torch.allclose(sigma - gamma, torch.tensor([[[0.375], [0.375], [0.0]]]))   # (1 - λ) Δ of the next step


# ---------------------------------------------------------------------------------------------- chunked vs recurrent
CASES = [  # b, l, h, p, g, n, r, a, chunk_size, init
    (2, 11, 4, 3, 2, 8, 1, 3, 4, False),
    (1, 9, 2, 2, 1, 6, 1, 3, 2, True),
    (2, 7, 4, 3, 2, 8, 2, 2, 4, True),
    (1, 10, 2, 3, 2, 4, 4, 1, 4, False),
    (1, 5, 2, 2, 1, 4, 8, 2, 2, True),
]


@pytest.mark.parametrize("b, l, h, p, g, n, r, a, q, init", CASES)
def test_chunked_matches_recurrent_forward_and_gradients(b, l, h, p, g, n, r, a, q, init):
    inputs = make_mamba3_inputs(b, l, h, p, g, n, r, a, init=init, seed=r + 10 * init)
    for t in leaves(inputs).values():
        t.requires_grad_(True)
    y_rec, s_rec = mamba3_recurrent(**inputs, return_final_state=True)
    y_chk, s_chk = mamba3_chunked(**inputs, return_final_state=True, chunk_size=q)
    torch.testing.assert_close(y_chk, y_rec, atol=1e-10, rtol=1e-9)
    for f, got, want in zip(STATE_FIELDS, s_chk, s_rec):
        torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-9, msg=f"final state.{f}")

    gen = torch.Generator().manual_seed(1)
    dy = torch.randn(y_rec.shape, generator=gen, dtype=y_rec.dtype)
    ds = [torch.randn(s.shape, generator=gen, dtype=s.dtype) for s in s_rec]
    names, tensors = zip(*leaves(inputs).items())

    def grads(y, s):
        loss = (y * dy).sum() + sum((si * dsi).sum() for si, dsi in zip(s, ds))
        return torch.autograd.grad(loss, tensors, allow_unused=True)

    for name, g_chk, g_rec in zip(names, grads(y_chk, s_chk), grads(y_rec, s_rec)):
        assert g_rec is not None and g_rec.abs().max() > 0, f"no gradient reaches {name}"
        torch.testing.assert_close(g_chk, g_rec, atol=1e-9, rtol=1e-8, msg=f"d {name}")


def test_initial_state_continues_the_sequence():
    """Running the first half, then the second half from its final state, equals running the whole."""
    inputs = make_mamba3_inputs(1, 12, 2, 3, 1, 6, 2, 2, seed=3)
    whole = mamba3_chunked(**inputs, chunk_size=4)
    first = {k: (t[:, :5] if k in SEQUENCE else t) for k, t in inputs.items()}
    second = {k: (t[:, 5:] if k in SEQUENCE else t) for k, t in inputs.items()}
    y1, s1 = mamba3_recurrent(**first, return_final_state=True)
    y2 = mamba3_chunked(**second, initial_state=s1, chunk_size=4)
    torch.testing.assert_close(torch.cat([y1, y2], dim=1), whole, atol=1e-10, rtol=1e-9)


# ---------------------------------------------------------------------------------------------- independent forms
def test_euler_without_rotation_is_mamba2_ssd():
    """λ = 1 (exponential Euler), no rotation, no biases, r = 1: Mamba-3's recurrence is Mamba-2's SSD with
    A_h Δ_t as the log-decay."""
    b, l, h, p, g, n = 2, 9, 4, 3, 2, 6
    inp = make_mamba3_inputs(b, l, h, p, g, n, 1, 2, seed=5)
    A = -(0.5 + torch.rand(h, dtype=torch.float64))
    inp.update(adt=inp["dt"] * A, trap=torch.ones_like(inp["dt"]), angles=torch.zeros_like(inp["angles"]),
               q_bias=torch.zeros_like(inp["q_bias"]), k_bias=torch.zeros_like(inp["k_bias"]))
    y = mamba3_recurrent(**inp)
    want, _ = ssd_recurrent(inp["v"], inp["dt"], A, inp["k"][:, :, 0], inp["q"][:, :, 0])   # fp64 throughout
    want = (want + inp["D"][:, None] * inp["v"]) * torch.nn.functional.silu(inp["z"])
    torch.testing.assert_close(y, want, atol=1e-12, rtol=1e-10)


def test_rotary_state_is_a_complex_diagonal_state():
    """With every pair turned (a = n/2), r = 1, no D, no z: read each pair (x[2i], x[2i+1]) as the complex
    number x[2i] + i x[2i+1]. The rotary trick is then a complex state c_t (p, n/2) with eigenvalues
    α_t e^{iφ_t}, φ_t = angles_t Δ_t:

        c_t = α_t e^{iφ_t} c_{t-1} + β_t e^{iφ_t} v_{t-1} conj(k_{t-1}) + γ_t v_t conj(k_t),   y_t = Re(c_t q_t)
    """
    b, l, h, p, g, n = 1, 10, 2, 3, 1, 6
    inp = make_mamba3_inputs(b, l, h, p, g, n, 1, n // 2, D=False, z=False, seed=7)
    y = mamba3_recurrent(**inp)

    cplx = lambda x: torch.complex(x[..., 0::2], x[..., 1::2])
    q = cplx(inp["q"][:, :, 0].repeat_interleave(h // g, 2) + inp["q_bias"][:, 0])   # (b, l, h, n/2)
    k = cplx(inp["k"][:, :, 0].repeat_interleave(h // g, 2) + inp["k_bias"][:, 0])
    v, dt, lam = inp["v"], inp["dt"], inp["trap"]
    alpha = torch.exp(inp["adt"])
    turn = torch.exp(1j * inp["angles"] * dt[..., None])                               # (b, l, h, n/2)
    c = torch.zeros(b, h, p, n // 2, dtype=torch.complex128)
    u_prev = torch.zeros_like(c)
    ys = []
    for t in range(l):
        u = v[:, t, :, :, None] * k[:, t, :, None, :].conj()                            # (b, h, p, n/2)
        beta, gamma = (1 - lam[:, t]) * dt[:, t] * alpha[:, t], lam[:, t] * dt[:, t]
        c = turn[:, t, :, None] * (alpha[:, t, :, None, None] * c + beta[..., None, None] * u_prev) \
            + gamma[..., None, None] * u
        ys.append((c * q[:, t, :, None, :]).sum(-1).real)
        u_prev = u
    torch.testing.assert_close(y, torch.stack(ys, dim=1), atol=1e-12, rtol=1e-10)


def test_mimo_step_follows_the_update_rule():
    """One step from a random state, written out from the update rule with explicit loops over ranks; the new
    angle is kept in [0, 2π), as mamba-ssm keeps it."""
    b, h, p, g, n, r, a = 2, 4, 3, 2, 6, 3, 2
    inp = make_mamba3_inputs(b, 1, h, p, g, n, r, a, init=True, seed=9)
    st = inp.pop("initial_state")
    tok = {k: (t[:, 0] if k in SEQUENCE else t) for k, t in inp.items()}
    y, new = mamba3_step_ref(st, **tok)

    theta = st.angle + tok["angles"] * tok["dt"][..., None]                           # (b, h, a)
    head_group = torch.arange(h) // (h // g)
    H = torch.exp(tok["adt"])[..., None, None] * st.ssm
    want = torch.zeros(b, h, p, dtype=torch.float64)
    k_hat = []
    for rr in range(r):
        kr = rotate_pairs(tok["k"][:, rr, head_group] + tok["k_bias"][:, rr], theta)  # (b, h, n)
        k_hat.append(kr)
        beta = (1 - tok["trap"]) * tok["dt"] * torch.exp(tok["adt"])
        gamma = tok["trap"] * tok["dt"]
        v_prev = st.v * tok["mimo_v"][:, rr]
        v_now = tok["v"] * tok["mimo_v"][:, rr]
        H = H + beta[..., None, None] * v_prev[..., None] * st.k[:, :, rr, None, :] \
            + gamma[..., None, None] * v_now[..., None] * kr[..., None, :]
    for rr in range(r):
        qr = rotate_pairs(tok["q"][:, rr, head_group] + tok["q_bias"][:, rr], theta)
        yr = (H @ qr[..., None])[..., 0] + tok["D"][:, None] * tok["v"] * tok["mimo_v"][:, rr]
        zr = tok["z"] * tok["mimo_z"][:, rr]
        want += tok["mimo_o"][:, rr] * yr * zr * torch.sigmoid(zr)
    torch.testing.assert_close(y, want, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(new.ssm, H, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(new.k, torch.stack(k_hat, dim=2), atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(new.angle, torch.remainder(theta, 2 * math.pi))
    assert bool(((new.angle >= 0) & (new.angle < 2 * math.pi)).all())
    torch.testing.assert_close(new.v, tok["v"])


def test_rotation_keeps_norms_and_leaves_unturned_pairs():
    x = torch.randn(5, 8, dtype=torch.float64)
    theta = torch.rand(5, 3, dtype=torch.float64) * 2 * math.pi
    y = rotate_pairs(x, theta)
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1))
    torch.testing.assert_close(y[:, 6:], x[:, 6:])
    torch.testing.assert_close(rotate_pairs(y, -theta), x)


@pytest.mark.parametrize("n, a", [(8, 1), (8, 3), (8, 4), (12, 2), (16, 8)])
def test_halves_order_turns_the_halves_layout_into_adjacent_pairs(n, a):
    """mamba-ssm's MIMO rotation (pairs (i, i + n/2)) is rotate_pairs after halves_order's permutation."""
    x = torch.randn(5, n, dtype=torch.float64)
    theta = torch.rand(5, a, dtype=torch.float64) * 2 * math.pi
    order = halves_order(n, a)
    assert sorted(order.tolist()) == list(range(n))
    torch.testing.assert_close(rotate_pairs(x[:, order], theta)[:, torch.argsort(order)], rotate_halves(x, theta))
    if a:   # and the two layouts differ: the permutation is needed
        assert (rotate_pairs(x, theta) - rotate_halves(x, theta)).abs().max() > 1e-3


@pytest.mark.parametrize("n, a", [(8, 0), (8, 1), (8, 3), (8, 4), (12, 2), (16, 8), (128, 32)])
def test_halves_to_pairs_is_halves_order_from_slices(n, a):
    """The block's permutation (slices, for a cheap backward) is indexing with halves_order, and
    pairs_to_halves undoes it, forward and backward, on any leading axes."""
    x = torch.randn(2, 3, n, dtype=torch.float64, requires_grad=True)
    order = halves_order(n, a)
    assert torch.equal(halves_to_pairs(x, a), x[..., order])
    assert torch.equal(pairs_to_halves(x, a), x[..., torch.argsort(order)])
    assert torch.equal(pairs_to_halves(halves_to_pairs(x, a), a), x)
    g = torch.randn(2, 3, n, dtype=torch.float64)
    grad, = torch.autograd.grad(halves_to_pairs(x, a), x, g)
    want, = torch.autograd.grad(x[..., order], x, g)
    assert torch.equal(grad, want)


# ---------------------------------------------------------------------------------------------- bad input
def _bad(**changes):
    inp = make_mamba3_inputs(1, 4, 4, 2, 2, 6, 2, 2, dtype=torch.float32, seed=0)
    inp.update(changes)
    return inp


@pytest.mark.parametrize("changes, error, words", [
    (dict(k=torch.zeros(1, 4, 2, 2, 5)), ValueError, ["k", "(b, l, r, g, n)"]),
    (dict(v=torch.zeros(1, 4, 3, 2)), ValueError, ["g = 2", "h = 3"]),
    (dict(dt=torch.zeros(1, 4, 3)), ValueError, ["dt", "(b, l, h)"]),
    (dict(trap=torch.zeros(1, 4, 4, dtype=torch.int32)), TypeError, ["trap", "dtype"]),
    (dict(q_bias=torch.zeros(4, 1, 6)), ValueError, ["q_bias", "(h, r, n)"]),
    (dict(angles=torch.zeros(1, 4, 4, 4)), ValueError, ["angles", "a = 4", "n / 2 = 3"]),
    (dict(mimo_o=None), ValueError, ["mimo_o", "required", "r = 2"]),
    (dict(mimo_v=torch.zeros(4, 2, 3)), ValueError, ["mimo_v", "(h, r, p)"]),
    (dict(D=torch.zeros(4, device="meta")), ValueError, ["D", "device"]),
    (dict(q=torch.zeros(1, 4, 2, 2, 5), k=torch.zeros(1, 4, 2, 2, 5), q_bias=torch.zeros(4, 2, 5),
          k_bias=torch.zeros(4, 2, 5)), ValueError, ["n = 5", "even"]),
])
def test_bad_input_is_named(changes, error, words):
    with pytest.raises(error) as info:
        mamba3_chunked(**_bad(**changes), chunk_size=2)
    for w in words:
        assert w in str(info.value), (w, str(info.value))


def test_siso_rejects_mimo_weights_and_chunk_must_be_power_of_two():
    inp = make_mamba3_inputs(1, 4, 2, 2, 1, 4, 1, 1, dtype=torch.float32)
    with pytest.raises(ValueError, match="mimo_v given but r = 1"):
        mamba3_recurrent(**inp, mimo_v=torch.ones(2, 1, 2))
    with pytest.raises(ValueError, match="chunk_size must be a power of two"):
        mamba3_chunked(**inp, chunk_size=3)
    bad_state = zero_state(1, 2, 2, 4, 2, 1, torch.float32, "cpu")              # r = 2 in a SISO call
    with pytest.raises(ValueError, match=r"state.k must have shape \(b, h, r, n\)"):
        mamba3_recurrent(**inp, initial_state=bad_state)
