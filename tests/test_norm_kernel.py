"""mambalab.kernels.norm (the gated norm's forward as one Triton kernel, used for inference on a GPU) against
mambalab.modules.norm.layernorm_fn's PyTorch form: RMS and LayerNorm modes, gate before or after, bias or none,
one group or several (of a size that is no power of two). On a GPU also: the modules under no_grad take the
kernel, and give the PyTorch form's values in bf16; with autograd recording, the PyTorch form runs. The residual
form (add_norm: s = r + x, then the norm of s, one kernel) against PyTorch's add and the norm: s equal bit for
bit (the kernel rounds the sum as PyTorch's add does), the norm within the norm kernel's tolerance.

On the CPU the kernel runs in Triton's interpreter, in fp32, called directly (the modules take it on a GPU only)."""
import pytest
import torch

from mambalab.kernels.norm import gated_norm_fwd
from mambalab.modules.norm import GatedLayerNorm, GatedRMSNorm, add_norm, layernorm_fn

from conftest import KERNEL_DEVICE, requires_gpu


@pytest.mark.parametrize("is_rms_norm", [True, False])
@pytest.mark.parametrize("gated,norm_before_gate", [(False, True), (True, True), (True, False)])
@pytest.mark.parametrize("group_size,with_bias", [(48, False), (12, True)])
def test_kernel_matches_the_pytorch_form(is_rms_norm, gated, norm_before_gate, group_size, with_bias):
    gen = torch.Generator().manual_seed(0)
    x, z = (torch.randn(5, 48, generator=gen).to(KERNEL_DEVICE) * 3 for _ in range(2))
    weight = torch.randn(48, generator=gen).to(KERNEL_DEVICE)
    bias = torch.randn(48, generator=gen).to(KERNEL_DEVICE) if with_bias else None
    z = z if gated else None
    with torch.enable_grad():   # a leaf that requires grad keeps layernorm_fn on its PyTorch form
        expect = layernorm_fn(x.clone().requires_grad_(), weight, bias, z=z, eps=1e-5, group_size=group_size,
                              norm_before_gate=norm_before_gate, is_rms_norm=is_rms_norm).detach()
    got = gated_norm_fwd(x, weight, bias, z, 1e-5, group_size, norm_before_gate, is_rms_norm)
    torch.testing.assert_close(got, expect, atol=1e-5, rtol=1e-5)


def test_rows_with_a_stride():
    """Rows further apart than d (a slice of a wider tensor, as the blocks split in_proj's output) are read at
    their stride."""
    wide = torch.randn(4, 80, device=KERNEL_DEVICE)
    x = wide[:, 16:48]                                                    # (4, 32), row stride 80
    weight = torch.rand(32, device=KERNEL_DEVICE) + 0.5
    got = gated_norm_fwd(x, weight, None, None, 1e-6, 32, True, True)
    expect = x / x.square().mean(-1, keepdim=True).add(1e-6).sqrt() * weight
    torch.testing.assert_close(got, expect, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_module_under_no_grad_takes_the_kernel(dtype, monkeypatch):
    """Mamba-2's gated norm at mamba2-2.7b's width (5,120 channels, one group), batch 64, one token."""
    import mambalab.modules.norm as norm_module
    calls = []
    kernel = norm_module.gated_norm_fwd
    monkeypatch.setattr(norm_module, "gated_norm_fwd", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    norm = GatedRMSNorm(5120, eps=1e-5, norm_before_gate=False, device="cuda", dtype=dtype)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x, z = (torch.randn(64, 1, 5120, device="cuda", dtype=dtype) for _ in range(2))
    with torch.no_grad():
        got = norm(x, z)
    assert calls == [1]
    expect = norm(x, z)                    # parameters require grad: the PyTorch form
    assert calls == [1]
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got.float(), expect.detach().float(), **tol)


@pytest.mark.parametrize("is_rms_norm", [True, False])
def test_residual_form_adds_then_normalises(is_rms_norm):
    gen = torch.Generator().manual_seed(1)
    x, r = (torch.randn(6, 40, generator=gen).to(KERNEL_DEVICE) for _ in range(2))
    weight = torch.randn(40, generator=gen).to(KERNEL_DEVICE)
    bias = None if is_rms_norm else torch.randn(40, generator=gen).to(KERNEL_DEVICE)
    out, s = gated_norm_fwd(x, weight, bias, None, 1e-5, 40, True, is_rms_norm, residual=r)
    assert torch.equal(s, r + x)
    expect = layernorm_fn(r + x, weight, bias, eps=1e-5, is_rms_norm=is_rms_norm)
    torch.testing.assert_close(out, expect, atol=1e-5, rtol=1e-5)


def test_add_norm_refuses_mismatched_shapes():
    norm = GatedRMSNorm(8)
    with pytest.raises(ValueError, match="residual and x must have one shape"):
        add_norm(norm, torch.zeros(2, 8), torch.zeros(1, 2, 8))


@pytest.mark.parametrize("dev", ["cpu", pytest.param("cuda", marks=(requires_gpu, pytest.mark.gpu))])
@pytest.mark.parametrize("grad", [False, True])
def test_add_norm_keeps_an_fp32_stream_over_a_bf16_update(dev, grad):
    """Under bf16 autocast a model's stream is fp32 (the embedding) and a mixer's output bf16: s is their fp32
    sum, not a refusal and not a bf16 rounding, and the norm is the norm of that sum (eagerly, on a GPU too)."""
    gen = torch.Generator().manual_seed(3)
    r = torch.randn(4, 5, 64, generator=gen).to(dev)
    x = torch.randn(4, 5, 64, generator=gen).to(dev, torch.bfloat16)
    norm = GatedRMSNorm(64, device=dev)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    with torch.set_grad_enabled(grad):
        s, out = add_norm(norm, r, x)
    expect_s = r + x.float()
    assert s.dtype == torch.float32 and torch.equal(s, expect_s)
    torch.testing.assert_close(out, layernorm_fn(expect_s, norm.weight, None, eps=1e-5, is_rms_norm=True).detach(),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("norm_cls", [GatedRMSNorm, GatedLayerNorm])
def test_gpu_add_norm_under_no_grad_is_one_kernel_with_pytorchs_sum(norm_cls, monkeypatch):
    """A language model's residual step at mamba2-2.7b's width, bf16, batch 64, one token: under no_grad one
    kernel call; the stream s bit for bit PyTorch's bf16 add, the norm close to the PyTorch form's."""
    import mambalab.modules.norm as norm_module
    calls = []
    kernel = norm_module.gated_norm_fwd
    monkeypatch.setattr(norm_module, "gated_norm_fwd", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    norm = norm_cls(2560, eps=1e-5, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    r, x = (torch.randn(64, 1, 2560, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    with torch.no_grad():
        s, out = add_norm(norm, r, x)
    assert calls == [1]
    assert torch.equal(s, r + x)
    with torch.enable_grad():   # a leaf that requires grad keeps layernorm_fn on its PyTorch form
        expect = layernorm_fn((r + x).requires_grad_(), norm.weight, norm.bias, eps=1e-5,
                              is_rms_norm=norm.is_rms_norm).detach()
    assert calls == [1]
    torch.testing.assert_close(out.float(), expect.float(), atol=2e-2, rtol=2e-2)
