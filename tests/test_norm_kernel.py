"""mambalab.kernels.norm (the gated norm's forward as one Triton kernel, used for inference on a GPU) against
mambalab.modules.norm.layernorm_fn's PyTorch form: RMS and LayerNorm modes, gate before or after, bias or none,
one group or several (of a size that is no power of two). On a GPU also: the modules under no_grad take the
kernel, and give the PyTorch form's values in bf16; with autograd recording, the PyTorch form runs.

On the CPU the kernel runs in Triton's interpreter, in fp32, called directly (the modules take it on a GPU only)."""
import pytest
import torch

from mambalab.kernels.norm import gated_norm_fwd
from mambalab.modules.norm import GatedRMSNorm, layernorm_fn

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
