"""mambalab.ref.ssd: the recurrent, quadratic and chunked forms agree (outputs, final states, every gradient);
they match mamba-ssm's ssd_minimal_discrete and ssd_chunk_scan_combined_ref; each chunked step checks
against the recurrence; segsum stays accurate where the naive form does not; dt_limit clamps."""
import pytest
import torch
import torch.nn.functional as F

from mambalab import oracle
from mambalab.ref import ssd
from mambalab.ref.ssd import (chunk_diagonal_outputs, chunk_state_outputs, chunk_states, effective_dt, segsum,
                              segsum_naive, split_into_chunks, ssd_chunked, ssd_quadratic, ssd_recurrent,
                              ssd_ref, state_passing)

from conftest import make_ssd_inputs

NAMES = ("x", "dt", "A", "B", "C", "D", "z", "dt_bias", "initial_states")


make_inputs = make_ssd_inputs


def run(inputs, dout, dfinal, **kw):
    """ssd_ref forward and backward of <out, dout> + <final, dfinal>: (out, final, {name: grad})."""
    leaves = {k: (v.detach().clone().requires_grad_() if v is not None else None) for k, v in inputs.items()}
    out, final = ssd_ref(*(leaves[k] for k in NAMES[:5]), return_final_states=True,
                         **{k: leaves[k] for k in NAMES[5:]}, **kw)
    ((out * dout).sum() + (final * dfinal).sum()).backward()
    return out.detach(), final.detach(), {k: v.grad for k, v in leaves.items() if v is not None}


def assert_close(got, want, msg=""):
    """fp32 agreement, relative to the size of the reference."""
    scale = want.abs().max().item() + 1.0
    torch.testing.assert_close(got, want, atol=2e-5 * scale, rtol=1e-4, msg=msg)


def cotangents(b, l, h, p, n, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(b, l, h, p, generator=gen), torch.randn(b, h, p, n, generator=gen)


CASES = [
    # b, l, h, p, g, n, q, D, z, bias, softplus, init
    (1, 1, 1, 1, 1, 1, 16, None, False, False, False, False),   # one step
    (2, 37, 4, 8, 1, 8, 16, "h", True, True, True, True),       # g = 1, l = 2 q + 5
    (2, 100, 4, 4, 4, 8, 32, "hp", True, False, True, True),    # g = h, l = 3 q + 4
    (1, 77, 4, 8, 2, 4, 64, "h", False, True, False, True),     # g = 2, l = q + 13
    (2, 64, 2, 8, 2, 8, 64, None, True, True, True, False),     # g = h, exactly one chunk
    (1, 50, 3, 5, 1, 6, 24, "hp", True, True, True, True),      # odd sizes, l = 2 q + 2
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "b{}l{}h{}p{}g{}n{}q{}".format(*c[:7]))
def test_three_forms_agree_with_every_gradient(case):
    b, l, h, p, g, n, q, D, z, bias, softplus, init = case
    inputs = make_inputs(b, l, h, p, g, n, D=D, z=z, bias=bias, init=init)
    dout, dfinal = cotangents(b, l, h, p, n)
    results = {m: run(inputs, dout, dfinal, chunk_size=q, dt_softplus=softplus, method=m)
               for m in ("recurrent", "quadratic", "chunked")}
    want_out, want_final, want_grads = results["recurrent"]
    assert set(want_grads) == {k for k, v in inputs.items() if v is not None}
    for m in ("quadratic", "chunked"):
        out, final, grads = results[m]
        assert_close(out, want_out, f"{m}: out")
        assert_close(final, want_final, f"{m}: final state")
        for k in want_grads:
            assert grads[k].shape == inputs[k].shape, (m, k)
            assert_close(grads[k], want_grads[k], f"{m}: grad {k}")


def test_forms_agree_to_rounding_in_float64():
    """Called directly (no cast to fp32), the three forms are the same sum in a different order."""
    x = make_inputs(2, 45, 4, 3, 2, 5, dtype=torch.float64)
    args = (x["x"], x["dt"], x["A"], x["B"], x["C"])
    want_y, want_final = ssd_recurrent(*args, initial_states=x["initial_states"])
    for y, final in (ssd_quadratic(*args, initial_states=x["initial_states"]),
                     *(ssd_chunked(*args, q, initial_states=x["initial_states"]) for q in (1, 7, 16, 64))):
        torch.testing.assert_close(y, want_y, atol=1e-12, rtol=1e-12)
        torch.testing.assert_close(final, want_final, atol=1e-12, rtol=1e-12)


def test_chunked_steps_match_the_recurrence():
    """Step 3's entering states are the recurrence's states at chunk boundaries; steps 1 + 4 are the output."""
    b, l, h, p, g, n, q = 2, 70, 2, 4, 1, 3, 16
    x = make_inputs(b, l, h, p, g, n, dtype=torch.float64)
    args = (x["x"], x["dt"], x["A"], x["B"], x["C"])
    xc, dtc, a, Bc, Cc = split_into_chunks(*args, q)
    c = -(-l // q)
    assert xc.shape == (b, c, q, h, p) and dtc.shape == a.shape == (b, c, q, h) and Cc.shape == (b, c, q, h, n)
    y_diag = chunk_diagonal_outputs(xc, dtc, a, Bc, Cc)
    states = chunk_states(xc, dtc, a, Bc)
    entering, final = state_passing(states, a.sum(dim=2), x["initial_states"])
    y_off = chunk_state_outputs(Cc, entering, a)
    assert states.shape == entering.shape == (b, c, h, p, n)

    def steps(start, stop):  # the inputs of steps start .. stop - 1 (A has no sequence axis)
        return [t if t.dim() == 1 else t[:, start:stop] for t in args]

    torch.testing.assert_close(entering[:, 0], x["initial_states"])
    for i in range(1, c):
        _, s = ssd_recurrent(*steps(0, i * q), initial_states=x["initial_states"])
        torch.testing.assert_close(entering[:, i], s)
        _, alone = ssd_recurrent(*steps((i - 1) * q, i * q))  # chunk i - 1, from zero
        torch.testing.assert_close(states[:, i - 1], alone)
    y, want_final = ssd_recurrent(*args, initial_states=x["initial_states"])
    torch.testing.assert_close(final, want_final)
    torch.testing.assert_close((y_diag + y_off).flatten(1, 2)[:, :l], y)
    # without an entering state, step 1 alone is the output of the first chunk
    y0, _ = ssd_recurrent(*steps(0, q))
    torch.testing.assert_close(y_diag[:, 0], y0)


# ---------------------------------------------------------------------------------------------- oracles
@pytest.mark.parametrize("b, l, h, p, g, n, q, init", [
    (2, 64, 4, 8, 1, 8, 16, True),
    (1, 96, 4, 4, 4, 8, 32, True),
    (2, 64, 2, 8, 2, 4, 64, False),
])
def test_matches_ssd_minimal_discrete(b, l, h, p, g, n, q, init):
    """mamba-ssm's Listing-1 SSD: it takes X·Δ and A·Δ, B and C per head, lengths a multiple of q."""
    minimal = oracle.module("modules.ssd_minimal").ssd_minimal_discrete
    inputs = make_inputs(b, l, h, p, g, n, D=None, z=False, bias=False, init=init)
    dout, dfinal = cotangents(b, l, h, p, n)
    out, final, grads = run(inputs, dout, dfinal, chunk_size=q)

    leaves = {k: v.clone().requires_grad_() for k, v in inputs.items() if v is not None}
    x, dt, A, B, C = (leaves[k] for k in NAMES[:5])
    s0 = leaves["initial_states"].unsqueeze(1) if init else None                # (b, 1, h, p, n)
    y_ref, final_ref = minimal(x * dt.unsqueeze(-1), A * dt, B.repeat_interleave(h // g, dim=2),
                               C.repeat_interleave(h // g, dim=2), q, initial_states=s0)
    ((y_ref * dout).sum() + (final_ref * dfinal).sum()).backward()
    assert_close(out, y_ref.detach(), "out")
    assert_close(final, final_ref.detach(), "final state")
    for k, v in leaves.items():
        assert_close(grads[k], v.grad, f"grad {k}")


@pytest.mark.parametrize("b, l, h, p, g, n, q, D", [
    (2, 64, 4, 8, 1, 8, 16, "h"),
    (1, 96, 4, 4, 2, 8, 32, "hp"),
    (2, 64, 4, 4, 4, 4, 64, "h"),
])
def test_matches_ssd_chunk_scan_combined_ref(b, l, h, p, g, n, q, D):
    """mamba-ssm's chunked reference: D, z, dt_bias, softplus; no initial or final states; l a multiple of q."""
    theirs = oracle.module("ops.triton.ssd_combined").ssd_chunk_scan_combined_ref
    inputs = make_inputs(b, l, h, p, g, n, D=D, init=False)
    # Keep the total decay over the sequence small (softplus(dt) about 0.15): their state_passing_ref takes exp
    # of unmasked differences of the chunk cumsums, which overflow once the total decay passes 88, and its
    # backward then turns the masked infinities into NaN (0 · inf).
    inputs["dt"] = inputs["dt"] - 2.0
    dout, _ = cotangents(b, l, h, p, n)
    ours = {}
    for name, fn in (("ours", lambda *a, **k: ssd_ref(*a, **k)), ("theirs", theirs)):
        leaves = {k: v.clone().requires_grad_() for k, v in inputs.items() if v is not None}
        out = fn(*(leaves[k] for k in NAMES[:5]), q, D=leaves["D"], z=leaves["z"], dt_bias=leaves["dt_bias"],
                 dt_softplus=True)
        (out * dout).sum().backward()
        ours[name] = out.detach(), {k: v.grad for k, v in leaves.items()}
    assert_close(ours["ours"][0], ours["theirs"][0], "out")
    for k, want in ours["theirs"][1].items():
        assert_close(ours["ours"][1][k], want, f"grad {k}")


# ---------------------------------------------------------------------------------------------- segsum
def test_segsum_is_the_segment_sum():
    a = torch.randn(2, 9, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    got = segsum(a)
    for i in range(9):
        for j in range(9):
            want = a[:, j + 1: i + 1].sum(-1) if i >= j else torch.full((2,), float("-inf"), dtype=a.dtype)
            torch.testing.assert_close(got[:, i, j], want)
    torch.testing.assert_close(segsum_naive(a), got)  # small sums: the naive form is fine
    L = torch.exp(got)
    assert torch.equal(L.diagonal(dim1=-2, dim2=-1), torch.ones(2, 9, dtype=a.dtype))
    assert torch.equal(L.triu(1), torch.zeros_like(L))


def test_naive_segsum_loses_precision_after_a_long_history():
    """A slowly decaying stretch after a long history of strong decay. The first step stands for that history
    (say 100 000 steps of a = -10): it is in no segment sum, but in every running sum of the naive form, whose
    differences then carry errors of ulp(1e6) = 0.0625 in fp32."""
    a = torch.cat([torch.tensor([-1e6]), torch.full((600,), -0.01)])          # fp32
    exact = torch.exp(segsum(a.double()))
    stable_err = (torch.exp(segsum(a)).double() - exact).abs().max().item()
    naive_err = (torch.exp(segsum_naive(a)).double() - exact).abs().max().item()
    assert stable_err < 1e-6
    assert naive_err > 0.03


def test_naive_segsum_overflows_to_nan_in_half_precision():
    """In fp16 the running sum passes -65504 after 655 steps of a = -100 and becomes -inf; -inf - (-inf) is NaN,
    even on the diagonal where the answer is 0. The stable form only sums segments: far entries become -inf,
    which is right (exp gives 0), and the diagonal stays 0."""
    a = torch.full((1000,), -100.0, dtype=torch.float16)
    naive = segsum_naive(a)
    assert naive.diagonal()[:655].eq(0).all() and naive.diagonal()[655:].isnan().all()
    stable = segsum(a)
    assert not stable.isnan().any()
    assert stable.diagonal().eq(0).all()
    assert torch.exp(stable.float()).diagonal().eq(1).all()


def test_quadratic_form_on_the_naive_segsum_is_wrong(monkeypatch):
    """The same failure, end to end: one huge first step (Δ_0 A = -1e6), then ordinary slow decay."""
    x = make_inputs(1, 300, 1, 2, 1, 2, D=None, z=False, bias=False, init=False, dtype=torch.float64)
    x["dt"][:, 1:] = 0.01
    x["dt"][:, 0] = 1e6 / -x["A"][0]
    args = [x[k] for k in NAMES[:5]]
    exact, _ = ssd_quadratic(*args)
    stable, _ = ssd_quadratic(*(t.float() for t in args))
    monkeypatch.setattr(ssd, "segsum", segsum_naive)
    naive, _ = ssd_quadratic(*(t.float() for t in args))
    scale = exact.abs().max().item()
    assert (stable.double() - exact).abs().max().item() < 1e-5 * scale
    assert (naive.double() - exact).abs().max().item() > 1e-2 * scale


# ---------------------------------------------------------------------------------------------- dt
def test_effective_dt():
    dt = torch.tensor([[[-30.0, -1.0, 0.0, 0.3, 25.0]]])                     # (b, l, h) = (1, 1, 5)
    bias = torch.tensor([0.0, 0.5, 0.1, -0.1, 0.0])
    torch.testing.assert_close(effective_dt(dt, bias, True), F.softplus(dt + bias))
    assert effective_dt(dt, bias, True)[0, 0, -1] == 25.0                   # linear above 20, as the kernels
    torch.testing.assert_close(effective_dt(dt), dt.clamp(min=0))           # no softplus: negative steps skipped
    torch.testing.assert_close(effective_dt(dt, bias, True, (0.2, 1.0)), F.softplus(dt + bias).clamp(0.2, 1.0))


@pytest.mark.parametrize("method", ["recurrent", "quadratic", "chunked"])
def test_dt_limit_clamps_the_steps_and_their_gradient(method):
    b, l, h, p, g, n = 2, 40, 4, 4, 2, 4
    inputs = make_inputs(b, l, h, p, g, n, init=True)
    inputs["dt"] = torch.randn(b, l, h, generator=torch.Generator().manual_seed(2))  # softplus: about 0.1 to 2.5
    lo, hi = 0.4, 1.2
    dout, dfinal = cotangents(b, l, h, p, n)
    out, final, grads = run(inputs, dout, dfinal, chunk_size=16, method=method, dt_softplus=True,
                            dt_limit=(lo, hi))

    steps = F.softplus(inputs["dt"] + inputs["dt_bias"])
    clamped = (steps < lo) | (steps > hi)
    assert 0.2 < clamped.float().mean() < 0.8
    pre = dict(inputs, dt=steps.clamp(lo, hi), dt_bias=None)
    want_out, want_final, _ = run(pre, dout, dfinal, chunk_size=16, method=method)
    assert_close(out, want_out, "out")
    assert_close(final, want_final, "final state")
    assert grads["dt"][clamped].eq(0).all()
    assert grads["dt"][~clamped].ne(0).all()


# ---------------------------------------------------------------------------------------------- the boundary
def test_dtypes_and_chunk_size_larger_than_the_sequence():
    x = make_inputs(1, 10, 2, 4, 1, 4, dtype=torch.bfloat16)
    out, final = ssd_ref(*(x[k] for k in NAMES[:5]), chunk_size=64, D=x["D"], z=x["z"],
                         initial_states=x["initial_states"], return_final_states=True)
    assert out.dtype == torch.bfloat16 and out.shape == x["x"].shape
    assert final.dtype == torch.float32 and final.shape == (1, 2, 4, 4)
    want = ssd_ref(*(x[k] for k in NAMES[:5]), D=x["D"], z=x["z"], initial_states=x["initial_states"],
                   method="recurrent")
    torch.testing.assert_close(out, want)


@pytest.mark.parametrize("kw, words", [
    (dict(method="parallel"), "method must be one of"),
    (dict(chunk_size=None), "chunk_size must be a positive int"),
    (dict(chunk_size=16, g=3), "must divide the heads"),
])
def test_bad_arguments_are_named(kw, words):
    g = kw.pop("g", 2)
    x = make_inputs(1, 8, 4, 2, g, 2)
    with pytest.raises(ValueError, match=words):
        ssd_ref(*(x[k] for k in NAMES[:5]), **kw)
