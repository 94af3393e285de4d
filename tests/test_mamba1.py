"""mambalab.modules.Mamba1: shapes, decoding step by step equals the full forward, gradients, Mamba's dt
initialisation, and interchangeability with mamba-ssm's ``Mamba`` (same state dict, same outputs)."""
import math

import pytest
import torch
import torch.nn.functional as F

from mambalab import oracle
from mambalab.modules import Mamba1
from mambalab.ref.selective_scan import selective_scan_ref

from conftest import KERNEL_DEVICE

D_MODEL, L, BATCH = 8, 20, 2


def make_block(seed=0, **kw):
    torch.manual_seed(seed)
    return Mamba1(D_MODEL, **kw).to(KERNEL_DEVICE)


def make_input(b=BATCH, l=L, seed=1):
    return torch.randn(b, l, D_MODEL, generator=torch.Generator().manual_seed(seed)).to(KERNEL_DEVICE)


def recompute(block, hidden):
    """The block written out in plain PyTorch with mambalab's sequential reference scan (no Triton)."""
    l = hidden.shape[1]
    n, r = block.d_state, block.dt_rank
    xz = hidden @ block.in_proj.weight.T                                       # (b, l, 2d)
    x, z = xz.transpose(1, 2).chunk(2, dim=1)                                  # (b, d, l)
    x = F.silu(F.conv1d(x, block.conv1d.weight, block.conv1d.bias, padding=block.d_conv - 1,
                        groups=block.d_inner)[..., :l])
    dt, B, C = (x.transpose(1, 2) @ block.x_proj.weight.T).split([r, n, n], dim=-1)
    dt = (dt @ block.dt_proj.weight.T).transpose(1, 2)                         # (b, d, l)
    y = selective_scan_ref(x, dt, -torch.exp(block.A_log), B.transpose(1, 2), C.transpose(1, 2), block.D,
                           z=z, delta_bias=block.dt_proj.bias, delta_softplus=True)
    return y.transpose(1, 2) @ block.out_proj.weight.T


def test_shapes_and_parameters():
    block = make_block(d_state=4, expand=2)
    d = 2 * D_MODEL
    assert block.d_inner == d and block.dt_rank == math.ceil(D_MODEL / 16)
    shapes = {k: tuple(v.shape) for k, v in block.state_dict().items()}
    assert shapes == {
        "in_proj.weight": (2 * d, D_MODEL), "conv1d.weight": (d, 1, 4), "conv1d.bias": (d,),
        "x_proj.weight": (block.dt_rank + 8, d), "dt_proj.weight": (d, block.dt_rank), "dt_proj.bias": (d,),
        "out_proj.weight": (D_MODEL, d), "A_log": (d, 4), "D": (d,),
    }
    assert torch.equal(block.A_log.exp(), torch.arange(1.0, 5.0, device=KERNEL_DEVICE).repeat(d, 1))
    assert torch.equal(block.D, torch.ones(d, device=KERNEL_DEVICE))
    assert block.A_log._no_weight_decay and block.D._no_weight_decay
    out = block(make_input(l=5))
    assert out.shape == (BATCH, 5, D_MODEL) and out.dtype == torch.float32


def test_dt_initialisation():
    block = Mamba1(64, dt_rank=4, dt_min=0.002, dt_max=0.05, dt_scale=2.0)
    dt = F.softplus(block.dt_proj.bias.detach())
    assert dt.min() >= 0.002 * (1 - 1e-4) and dt.max() <= 0.05 * (1 + 1e-4)
    assert dt.max() / dt.min() > 5  # spread over the range, not one value
    assert getattr(block.dt_proj.bias, "_no_reinit", False)
    bound = 4 ** -0.5 * 2.0
    assert block.dt_proj.weight.abs().max() <= bound
    const = Mamba1(16, dt_init="constant", dt_rank=4)
    assert torch.all(const.dt_proj.weight == 0.5)
    floored = Mamba1(16, dt_min=1e-6, dt_max=1e-5, dt_init_floor=1e-3)
    assert torch.allclose(F.softplus(floored.dt_proj.bias.detach()), torch.full((32,), 1e-3), rtol=1e-4)
    with pytest.raises(ValueError, match="dt_init"):
        Mamba1(8, dt_init="normal")


def test_forward_matches_plain_pytorch_recomputation():
    block, hidden = make_block(), make_input()
    with torch.no_grad():
        torch.testing.assert_close(block(hidden), recompute(block, hidden), atol=1e-5, rtol=1e-4)


def test_step_loop_equals_forward():
    block, hidden = make_block(), make_input()
    with torch.no_grad():
        full = block(hidden)
        conv_state, ssm_state = block.allocate_inference_cache(BATCH)
        steps = [block.step(hidden[:, t:t + 1], conv_state, ssm_state)[0] for t in range(L)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("prefill", [2, 9])  # shorter and longer than d_conv
def test_prefill_then_step_equals_forward(prefill):
    block, hidden = make_block(), make_input()
    with torch.no_grad():
        full = block(hidden)
        cache = block.allocate_inference_cache(BATCH)
        first = block(hidden[:, :prefill], cache=cache)
        rest = [block.step(hidden[:, t:t + 1], *cache)[0] for t in range(prefill, L)]
    torch.testing.assert_close(torch.cat([first, *rest], dim=1), full, atol=1e-5, rtol=1e-4)


def test_gradients_reach_every_parameter():
    block = make_block(bias=True)
    hidden = make_input().requires_grad_()
    block(hidden).square().sum().backward()
    for name, p in [("input", hidden), *block.named_parameters()]:
        assert p.grad is not None, f"no gradient reached {name}"
        assert torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, f"gradient of {name} is zero or not finite"


def test_gradients_match_plain_pytorch_recomputation():
    block, hidden = make_block(), make_input(l=12)
    block(hidden).square().sum().backward()
    ours = {k: p.grad.clone() for k, p in block.named_parameters()}
    block.zero_grad()
    recompute(block, hidden).square().sum().backward()
    for k, p in block.named_parameters():
        torch.testing.assert_close(ours[k], p.grad, atol=1e-4, rtol=1e-3, msg=lambda m: f"{k}: {m}")


def test_state_dict_interchangeable_with_mamba_ssm(monkeypatch):
    """mamba-ssm's own Mamba, loaded with our weights, gives our outputs in forward and in step.

    Without its CUDA extension mamba-ssm's forward cannot run its scan, so its module's slow path
    (use_fast_path=False) is pointed at its pure-PyTorch selective_scan_ref (same signature), and its step
    at its pure-PyTorch update (no Triton selective_state_update)."""
    mamba_simple = oracle.module("modules.mamba_simple")
    theirs = mamba_simple.Mamba(D_MODEL, d_state=4, use_fast_path=False).to(KERNEL_DEVICE)
    ours = make_block(d_state=4)
    keys = lambda m: {k: tuple(v.shape) for k, v in m.state_dict().items()}
    assert keys(theirs) == keys(ours)
    theirs.load_state_dict(ours.state_dict())
    ours.load_state_dict(theirs.state_dict())

    if not oracle.cuda_extension_available() or KERNEL_DEVICE == "cpu":
        monkeypatch.setattr(mamba_simple, "selective_scan_fn", oracle.selective_scan_ref())
    if mamba_simple.causal_conv1d_fn is not None and KERNEL_DEVICE == "cpu":  # pragma: no cover
        monkeypatch.setattr(mamba_simple, "causal_conv1d_fn", None)
        monkeypatch.setattr(mamba_simple, "causal_conv1d_update", None)
    monkeypatch.setattr(mamba_simple, "selective_state_update", None)

    hidden = make_input()
    with torch.no_grad():
        torch.testing.assert_close(ours(hidden), theirs(hidden), atol=1e-5, rtol=1e-4)
        our_cache = ours.allocate_inference_cache(BATCH)
        their_cache = theirs.allocate_inference_cache(BATCH, L)
        for t in range(4):
            token = hidden[:, t:t + 1]
            torch.testing.assert_close(ours.step(token, *our_cache)[0], theirs.step(token, *their_cache)[0],
                                       atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(our_cache[0], their_cache[0])
        torch.testing.assert_close(our_cache[1], their_cache[1], atol=1e-5, rtol=1e-4)


def test_rejects_wrong_shapes():
    block = make_block()
    with pytest.raises(ValueError, match="d_model"):
        block(torch.zeros(1, 3, D_MODEL + 1, device=KERNEL_DEVICE))
    cache = block.allocate_inference_cache(1)
    with pytest.raises(ValueError, match="one token"):
        block.step(torch.zeros(1, 2, D_MODEL, device=KERNEL_DEVICE), *cache)
