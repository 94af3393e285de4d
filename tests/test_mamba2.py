"""mambalab.modules.Mamba2: shapes, forward and gradients equal a plain-PyTorch recomputation on mambalab's
reference SSD, decoding step by step equals the full forward, fp32 parameters, and interchangeability with
mamba-ssm's ``Mamba2`` state dict. (The gated norm is tested in tests/test_norm.py, mamba-ssm's calling
conventions in tests/test_module_dropin.py.)"""
import pytest
import torch
import torch.nn.functional as F

from mambalab import oracle
from mambalab.modules import Mamba2
from mambalab.ref.ssd import ssd_ref

from conftest import FP32_KERNEL_TOL, KERNEL_DEVICE

D_MODEL, L, BATCH = 16, 37, 2  # l not a multiple of the chunk size: the last chunk is partial
SIZES = dict(d_state=16, headdim=8, chunk_size=16)  # d_inner 32: 4 heads


def make_block(ngroups=1, seed=0, **kw):
    torch.manual_seed(seed)
    return Mamba2(D_MODEL, ngroups=ngroups, **{**SIZES, **kw}).to(KERNEL_DEVICE)


def make_input(b=BATCH, l=L, seed=1):
    return torch.randn(b, l, D_MODEL, generator=torch.Generator().manual_seed(seed)).to(KERNEL_DEVICE)


# One block per ngroups, one input and its forward, shared by the tests below: each kernel launch costs
# seconds in the Triton interpreter on a CPU.
@pytest.fixture(scope="module", params=[1, 2], ids=["g1", "g2"])
def block(request):
    return make_block(ngroups=request.param)


@pytest.fixture(scope="module")
def hidden():
    return make_input()


@pytest.fixture(scope="module")
def full(block, hidden):
    with torch.no_grad():
        return block(hidden)


def recompute(block, u):
    """The block written out in plain PyTorch with mambalab's reference SSD (no Triton)."""
    l = u.shape[1]
    d, h, p, g, n = block.d_inner, block.nheads, block.headdim, block.ngroups, block.d_state
    zxbcdt = F.linear(u, block.in_proj.weight, block.in_proj.bias)
    z, xBC, dt = zxbcdt[..., :d], zxbcdt[..., d:2 * d + 2 * g * n], zxbcdt[..., 2 * d + 2 * g * n:]
    xBC = F.silu(F.conv1d(xBC.transpose(1, 2), block.conv1d.weight, block.conv1d.bias, padding=block.d_conv - 1,
                          groups=xBC.shape[-1])[..., :l]).transpose(1, 2)
    x = xBC[..., :d].reshape(*u.shape[:2], h, p)
    B = xBC[..., d:d + g * n].reshape(*u.shape[:2], g, n)
    C = xBC[..., d + g * n:].reshape(*u.shape[:2], g, n)
    y = ssd_ref(x, dt, -torch.exp(block.A_log), B, C, D=block.D, dt_bias=block.dt_bias, dt_softplus=True,
                method="quadratic").reshape(*u.shape[:2], d)
    v = (y * F.silu(z)).reshape(*u.shape[:2], g, d // g)          # gate, then one RMS per group of heads
    v = v * torch.rsqrt(v.square().mean(-1, keepdim=True) + 1e-5)
    y = v.reshape(*u.shape[:2], d) * block.norm.weight
    return F.linear(y, block.out_proj.weight, block.out_proj.bias)


def test_shapes_and_parameters(block, full):
    d, g, n, h = 32, block.ngroups, 16, 4
    assert (block.d_inner, block.nheads, block.conv_dim) == (d, h, d + 2 * g * n)
    assert block.split_sizes() == [0, 0, d, d + 2 * g * n, h] and block.xBC_split_sizes() == [d, g * n, g * n]
    shapes = {k: tuple(v.shape) for k, v in block.state_dict().items()}
    assert shapes == {
        "dt_bias": (h,), "A_log": (h,), "D": (h,), "in_proj.weight": (2 * d + 2 * g * n + h, D_MODEL),
        "conv1d.weight": (d + 2 * g * n, 1, 4), "conv1d.bias": (d + 2 * g * n,), "norm.weight": (d,),
        "out_proj.weight": (D_MODEL, d),
    }
    assert block.norm.group_size == d // g
    for name in ("A_log", "D", "dt_bias"):
        assert getattr(block, name)._no_weight_decay
    assert torch.equal(block.D, torch.ones(h, device=KERNEL_DEVICE))
    assert full.shape == (BATCH, L, D_MODEL) and full.dtype == torch.float32 and torch.isfinite(full).all()


def test_initialisation():
    block = Mamba2(64, d_state=8, headdim=4, A_init_range=(2, 8), dt_min=0.002, dt_max=0.05)  # 32 heads
    A = block.A_log.detach().exp()
    assert A.min() >= 2 and A.max() <= 8 and A.max() / A.min() > 1.5
    dt = F.softplus(block.dt_bias.detach())
    assert dt.min() >= 0.002 * (1 - 1e-4) and dt.max() <= 0.05 * (1 + 1e-4) and dt.max() / dt.min() > 5
    floored = Mamba2(16, d_state=8, headdim=8, dt_min=1e-6, dt_max=1e-5, dt_init_floor=1e-3)
    torch.testing.assert_close(F.softplus(floored.dt_bias.detach()), torch.full((4,), 1e-3))
    with pytest.raises(ValueError, match="headdim"):
        Mamba2(16, headdim=5)
    with pytest.raises(ValueError, match="ngroups"):
        Mamba2(16, headdim=8, ngroups=3)


def test_forward_matches_plain_pytorch_recomputation(block, hidden, full):
    with torch.no_grad():
        torch.testing.assert_close(full, recompute(block, hidden), **FP32_KERNEL_TOL)


def test_step_loop_equals_forward(block, hidden, full):
    with torch.no_grad():
        conv_state, ssm_state = block.allocate_inference_cache(BATCH)
        assert conv_state.shape == (BATCH, block.conv_dim, 4)
        assert ssm_state.shape == (BATCH, 4, 8, 16) and ssm_state.dtype == torch.float32
        steps = [block.step(hidden[:, t:t + 1], conv_state, ssm_state)[0] for t in range(L)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, **FP32_KERNEL_TOL)


@pytest.mark.parametrize("prefill", [2, 20])  # shorter than d_conv; longer than one chunk
def test_prefill_then_step_equals_forward(block, hidden, full, prefill):
    with torch.no_grad():
        cache = block.allocate_inference_cache(BATCH)
        first = block(hidden[:, :prefill], cache=cache)
        rest = [block.step(hidden[:, t:t + 1], *cache)[0] for t in range(prefill, prefill + 5)]
    torch.testing.assert_close(torch.cat([first, *rest], dim=1), full[:, :prefill + 5], **FP32_KERNEL_TOL)


@pytest.mark.parametrize("ngroups", [1, 2])
def test_gradients_reach_every_parameter_and_match_recomputation(ngroups):
    block = make_block(ngroups=ngroups, bias=True)
    hidden = make_input(l=24).requires_grad_()
    block(hidden).square().sum().backward()
    ours = {"input": hidden.grad.clone(), **{k: p.grad.clone() for k, p in block.named_parameters()}}
    assert set(ours) == {"input", *(k for k, _ in block.named_parameters())}
    for name, grad in ours.items():
        assert torch.isfinite(grad).all() and grad.abs().sum() > 0, f"gradient of {name} is zero or not finite"

    hidden.grad = None
    block.zero_grad()
    recompute(block, hidden).square().sum().backward()
    theirs = {"input": hidden.grad, **{k: p.grad for k, p in block.named_parameters()}}
    for k in ours:
        torch.testing.assert_close(ours[k], theirs[k], atol=max(1e-4, FP32_KERNEL_TOL["atol"]),
                                   rtol=max(1e-3, FP32_KERNEL_TOL["rtol"]), msg=lambda m: f"{k}: {m}")


def test_without_rmsnorm_gates_inside_the_scan():
    block = make_block(rmsnorm=False)
    assert not hasattr(block, "norm") and "norm.weight" not in block.state_dict()
    u = make_input(l=10)
    with torch.no_grad():
        full = block(u)
        cache = block.allocate_inference_cache(BATCH)
        steps = torch.cat([block.step(u[:, t:t + 1], *cache)[0] for t in range(10)], dim=1)
    torch.testing.assert_close(steps, full, **FP32_KERNEL_TOL)


def test_fp32_parameters_in_a_bf16_block():
    made = Mamba2(D_MODEL, **SIZES, dtype=torch.bfloat16)
    cast = Mamba2(D_MODEL, **SIZES).to(torch.bfloat16)
    for block in (made, cast):
        for name, p in block.named_parameters():
            expected = torch.float32 if name in ("A_log", "D", "dt_bias") else torch.bfloat16
            assert p.dtype == expected, f"{name}: {p.dtype}"
    assert cast.half().A_log.dtype == torch.float32 and cast.float().in_proj.weight.dtype == torch.float32


def test_state_dict_interchangeable_with_mamba_ssm(block):
    """mamba-ssm's Mamba2 (its constructor runs on a CPU) has our state dict's names and shapes; weights
    round-trip through it unchanged."""
    mamba2 = oracle.module("modules.mamba2")
    theirs = mamba2.Mamba2(D_MODEL, ngroups=block.ngroups, **SIZES, device=KERNEL_DEVICE)
    keys = lambda m: {k: tuple(v.shape) for k, v in m.state_dict().items()}
    assert keys(theirs) == keys(block)
    assert theirs.norm.group_size == block.norm.group_size
    theirs.load_state_dict(block.state_dict())
    fresh = make_block(ngroups=block.ngroups, seed=1)
    fresh.load_state_dict(theirs.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), block.state_dict().values()))


def test_rejects_wrong_shapes(block):
    with pytest.raises(ValueError, match="d_model"):
        block(torch.zeros(1, 3, D_MODEL + 1, device=KERNEL_DEVICE))
    cache = block.allocate_inference_cache(1)
    with pytest.raises(ValueError, match="one token"):
        block.step(torch.zeros(1, 2, D_MODEL, device=KERNEL_DEVICE), *cache)
