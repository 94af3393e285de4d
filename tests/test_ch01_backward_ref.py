"""The hand-written backward of the selective scan (the adjoint scan, right to left) gives autograd's gradients
of the reference, in float64, with every option and with groups of B/C."""
import pytest
import torch

from mambalab.ref.selective_scan import selective_scan_backward_ref, selective_scan_ref

NAMES = ("u", "delta", "A", "B", "C", "D", "z", "delta_bias")


def _inputs(b, d, n, l, g, options, seed=0):
    gen = torch.Generator().manual_seed(seed)
    f = dict(generator=gen, dtype=torch.float64)
    bc = (b, n, l) if g is None else (b, g, n, l)
    x = dict(u=torch.randn(b, d, l, **f), delta=torch.randn(b, d, l, **f) * 0.5 + (0 if options else 0.7),
             A=-(0.5 + torch.rand(d, n, **f)), B=torch.randn(*bc, **f), C=torch.randn(*bc, **f),
             D=torch.randn(d, **f) if options else None, z=torch.randn(b, d, l, **f) if options else None,
             delta_bias=0.3 * torch.randn(d, **f) if options else None)
    if not options:
        x["delta"] = x["delta"].abs()
    return x, torch.randn(b, d, l, **f)


@pytest.mark.parametrize("options", [False, True], ids=["plain", "D-z-bias-softplus"])
@pytest.mark.parametrize("g", [None, 2], ids=["B(b,n,l)", "B(b,g,n,l)"])
def test_backward_by_hand_matches_autograd(options, g):
    x, dout = _inputs(2, 4, 3, 9, g, options)
    leaves = {k: (v.clone().requires_grad_() if v is not None else None) for k, v in x.items()}
    out = selective_scan_ref(leaves["u"], leaves["delta"], leaves["A"], leaves["B"], leaves["C"], D=leaves["D"],
                             z=leaves["z"], delta_bias=leaves["delta_bias"], delta_softplus=options)
    assert out.dtype == torch.float64
    out.backward(dout)
    got = selective_scan_backward_ref(dout, x["u"], x["delta"], x["A"], x["B"], x["C"], D=x["D"], z=x["z"],
                                      delta_bias=x["delta_bias"], delta_softplus=options)
    for name, grad in zip(NAMES, got):
        if x[name] is None:
            assert grad is None, name
            continue
        assert grad.shape == x[name].shape and grad.dtype == torch.float64, name
        torch.testing.assert_close(grad, leaves[name].grad, rtol=1e-10, atol=1e-10, msg=f"d{name}")


def test_softplus_above_threshold_passes_the_gradient_through():
    # δ + bias > 20: softplus is the identity there, so dδ = dΔ (autograd of F.softplus agrees).
    x, dout = _inputs(1, 2, 2, 5, None, True)
    x["delta"] = x["delta"] + 25.0
    x["A"] = x["A"] / 40.0   # keeps exp(Δ A) away from 0 at Δ ≈ 25
    leaves = {k: v.clone().requires_grad_() for k, v in x.items()}
    selective_scan_ref(*(leaves[k] for k in NAMES[:5]), D=leaves["D"], z=leaves["z"],
                       delta_bias=leaves["delta_bias"], delta_softplus=True).backward(dout)
    got = selective_scan_backward_ref(dout, *(x[k] for k in NAMES[:5]), D=x["D"], z=x["z"],
                                      delta_bias=x["delta_bias"], delta_softplus=True)
    torch.testing.assert_close(got[1], leaves["delta"].grad, rtol=1e-10, atol=1e-10)
