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
    kw.setdefault("d_state", 4)  # small n: the Triton interpreter's time grows with it
    return Mamba1(D_MODEL, **kw).to(KERNEL_DEVICE)


def make_input(b=BATCH, l=L, seed=1):
    return torch.randn(b, l, D_MODEL, generator=torch.Generator().manual_seed(seed)).to(KERNEL_DEVICE)


# One block, one input and its forward, shared by the tests below: each kernel launch costs seconds in the
# Triton interpreter on a CPU.
@pytest.fixture(scope="module")
def block():
    return make_block()


@pytest.fixture(scope="module")
def hidden():
    return make_input()


@pytest.fixture(scope="module")
def full(block, hidden):
    with torch.no_grad():
        return block(hidden)


def recompute(block, hidden):
    """The block written out in plain PyTorch with mambalab's sequential reference scan (no Triton)."""
    l = hidden.shape[1]
    n, r = block.d_state, block.dt_rank
    xz = F.linear(hidden, block.in_proj.weight, block.in_proj.bias)           # (b, l, 2d)
    x, z = xz.transpose(1, 2).chunk(2, dim=1)                                  # (b, d, l)
    x = F.silu(F.conv1d(x, block.conv1d.weight, block.conv1d.bias, padding=block.d_conv - 1,
                        groups=block.d_inner)[..., :l])
    dt, B, C = (x.transpose(1, 2) @ block.x_proj.weight.T).split([r, n, n], dim=-1)
    dt = (dt @ block.dt_proj.weight.T).transpose(1, 2)                         # (b, d, l)
    y = selective_scan_ref(x, dt, -torch.exp(block.A_log), B.transpose(1, 2), C.transpose(1, 2), block.D,
                           z=z, delta_bias=block.dt_proj.bias, delta_softplus=True)
    return F.linear(y.transpose(1, 2), block.out_proj.weight, block.out_proj.bias)


def test_shapes_and_parameters(block, full):
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
    assert full.shape == (BATCH, L, D_MODEL) and full.dtype == torch.float32


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


def test_forward_matches_plain_pytorch_recomputation(block, hidden, full):
    with torch.no_grad():
        torch.testing.assert_close(full, recompute(block, hidden), atol=1e-5, rtol=1e-4)


def test_step_loop_equals_forward(block, hidden, full):
    with torch.no_grad():
        conv_state, ssm_state = block.allocate_inference_cache(BATCH)
        steps = [block.step(hidden[:, t:t + 1], conv_state, ssm_state)[0] for t in range(L)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("prefill", [2, 9])  # shorter and longer than d_conv
def test_prefill_then_step_equals_forward(block, hidden, full, prefill):
    with torch.no_grad():
        cache = block.allocate_inference_cache(BATCH)
        first = block(hidden[:, :prefill], cache=cache)
        rest = [block.step(hidden[:, t:t + 1], *cache)[0] for t in range(prefill, L)]
    torch.testing.assert_close(torch.cat([first, *rest], dim=1), full, atol=1e-5, rtol=1e-4)


def test_gradients_reach_every_parameter_and_match_recomputation():
    block = make_block(bias=True)
    hidden = make_input(l=12).requires_grad_()
    block(hidden).square().sum().backward()
    ours = {"input": hidden.grad.clone(), **{k: p.grad.clone() for k, p in block.named_parameters()}}
    for name, grad in ours.items():
        assert torch.isfinite(grad).all() and grad.abs().sum() > 0, f"gradient of {name} is zero or not finite"
    assert set(ours) == {"input", *(k for k, _ in block.named_parameters())}

    hidden.grad = None
    block.zero_grad()
    recompute(block, hidden).square().sum().backward()
    theirs = {"input": hidden.grad, **{k: p.grad for k, p in block.named_parameters()}}
    for k in ours:
        torch.testing.assert_close(ours[k], theirs[k], atol=1e-4, rtol=1e-3, msg=lambda m: f"{k}: {m}")


def test_state_dict_interchangeable_with_mamba_ssm(block, hidden, full, monkeypatch):
    """mamba-ssm's own Mamba, loaded with our weights, gives our outputs in forward and in step.

    Without its CUDA extension mamba-ssm's forward cannot run its scan, so its module's slow path
    (use_fast_path=False) is pointed at its pure-PyTorch selective_scan_ref (same signature), and its step
    at its pure-PyTorch update (no Triton selective_state_update)."""
    mamba_simple = oracle.module("modules.mamba_simple")
    theirs = mamba_simple.Mamba(D_MODEL, d_state=4, use_fast_path=False).to(KERNEL_DEVICE)
    keys = lambda m: {k: tuple(v.shape) for k, v in m.state_dict().items()}
    assert keys(theirs) == keys(block)
    theirs.load_state_dict(block.state_dict())
    fresh = make_block(seed=1)
    fresh.load_state_dict(theirs.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), block.state_dict().values()))

    if not oracle.cuda_extension_available() or KERNEL_DEVICE == "cpu":
        monkeypatch.setattr(mamba_simple, "selective_scan_fn", oracle.selective_scan_ref())
    if mamba_simple.causal_conv1d_fn is not None and KERNEL_DEVICE == "cpu":  # pragma: no cover
        monkeypatch.setattr(mamba_simple, "causal_conv1d_fn", None)
        monkeypatch.setattr(mamba_simple, "causal_conv1d_update", None)
    monkeypatch.setattr(mamba_simple, "selective_state_update", None)

    with torch.no_grad():
        torch.testing.assert_close(full, theirs(hidden), atol=1e-5, rtol=1e-4)
        our_cache = block.allocate_inference_cache(BATCH)
        their_cache = theirs.allocate_inference_cache(BATCH, L)
        for t in range(4):
            token = hidden[:, t:t + 1]
            torch.testing.assert_close(block.step(token, *our_cache)[0], theirs.step(token, *their_cache)[0],
                                       atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(our_cache[0], their_cache[0])
        torch.testing.assert_close(our_cache[1], their_cache[1], atol=1e-5, rtol=1e-4)


def test_rejects_wrong_shapes(block):
    with pytest.raises(ValueError, match="d_model"):
        block(torch.zeros(1, 3, D_MODEL + 1, device=KERNEL_DEVICE))
    cache = block.allocate_inference_cache(1)
    with pytest.raises(ValueError, match="one token"):
        block.step(torch.zeros(1, 2, D_MODEL, device=KERNEL_DEVICE), *cache)
