"""mambalab.ops.causal_conv1d_update (the causal conv's decode step, one Triton kernel) against
mambalab.modules.conv.conv_step_ref and against the whole-sequence convolution: a window that slides, bias
or none, SiLU or none, widths 2 to 4 and a channel count that is no multiple of the kernel's block; the blocks'
steps use it and stay differentiable through the reference; bad input named before any launch. On a GPU
also: bf16 at mamba2-2.7b's conv width at batch 64.

On the CPU the kernel runs in Triton's interpreter, in fp32."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from mambalab.modules.conv import causal_conv1d, causal_conv1d_step, conv_step_ref
from mambalab.ops.conv_update import causal_conv1d_update

from conftest import KERNEL_DEVICE, requires_gpu


def inputs(b, channels, width, dtype=torch.float32, device=KERNEL_DEVICE, seed=0):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen).to(device=device, dtype=dtype)
    return r(b, channels), r(b, channels, width), r(channels, width), r(channels)


@pytest.mark.parametrize("width", [2, 3, 4])
@pytest.mark.parametrize("with_bias,activation", [(True, "silu"), (False, "silu"), (True, None)])
def test_matches_reference(width, with_bias, activation):
    x, state, weight, bias = inputs(3, 300, width)          # 300 channels: two blocks, the second partial
    bias = bias if with_bias else None
    s_kernel, s_ref = state.clone(), state.clone()
    out = causal_conv1d_update(x, s_kernel, weight, bias, activation=activation)
    expect = conv_step_ref(x, s_ref, weight, bias)
    if activation is None:   # the reference applies SiLU: undo nothing, compare the pre-activation instead
        expect = torch.einsum("bcw,cw->bc", s_ref, weight) + (bias if bias is not None else 0.0)
    torch.testing.assert_close(s_kernel, s_ref, atol=0, rtol=0)       # the window: moved, not computed
    torch.testing.assert_close(out, expect, atol=1e-5, rtol=1e-5)


def test_steps_equal_the_whole_sequence_convolution():
    """Stepping l inputs from a zeroed window gives the whole-sequence causal conv, step by step."""
    conv = nn.Conv1d(40, 40, 4, groups=40, padding=3).to(KERNEL_DEVICE)
    x = torch.randn(2, 40, 9, device=KERNEL_DEVICE)
    with torch.no_grad():
        whole = causal_conv1d(conv, x)
        window = torch.zeros(2, 40, 4, device=KERNEL_DEVICE)
        steps = torch.stack([causal_conv1d_update(x[..., t], window, conv.weight[:, 0], conv.bias, "silu")
                             for t in range(9)], dim=-1)
    torch.testing.assert_close(steps, whole, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(window, x[..., -4:], atol=0, rtol=0)


def test_block_step_stays_differentiable():
    """Under autograd the step takes the reference, so gradients reach the weights and the input."""
    conv = nn.Conv1d(8, 8, 4, groups=8, padding=3).to(KERNEL_DEVICE)
    x = torch.randn(2, 8, device=KERNEL_DEVICE, requires_grad=True)
    y = causal_conv1d_step(conv, x, torch.zeros(2, 8, 4, device=KERNEL_DEVICE))
    y.sum().backward()
    assert x.grad is not None and conv.weight.grad is not None and conv.weight.grad.abs().sum() > 0


def test_bad_input_is_named():
    x, state, weight, bias = inputs(2, 16, 4)
    before = state.clone()
    with pytest.raises(ValueError, match=r"weight must have shape \(channels, width\)"):
        causal_conv1d_update(x, state, weight[:, :3], bias)
    with pytest.raises(ValueError, match=r"conv_state must have shape \(b, channels, width\)"):
        causal_conv1d_update(x, state[:1], weight, bias)
    with pytest.raises(ValueError, match="one new input per row"):
        causal_conv1d_update(x[..., None], state, weight, bias)
    with pytest.raises(ValueError, match="activation must be one of"):
        causal_conv1d_update(x, state, weight, bias, activation="relu")
    with pytest.raises(NotImplementedError, match="no_grad"):
        causal_conv1d_update(x, state, weight.clone().requires_grad_(), bias)
    assert torch.equal(state, before)


@pytest.mark.gpu
@requires_gpu
def test_gpu_bf16_at_decode_size():
    """mamba2-2.7b's conv (d_ssm + 2 n = 5,376 channels, width 4) at batch 64 in bf16: the window moved exactly,
    the output within bf16 rounding of the fp32 reference."""
    x, state, weight, bias = inputs(64, 5376, 4, dtype=torch.bfloat16, device="cuda")
    s_kernel = state.clone()
    out = causal_conv1d_update(x, s_kernel, weight, bias, activation="silu")
    s_ref = state.float()
    expect = conv_step_ref(x.float(), s_ref, weight.float(), bias.float())
    torch.testing.assert_close(s_kernel.float(), s_ref, atol=0, rtol=0)
    torch.testing.assert_close(out.float(), expect, atol=2e-2, rtol=2e-2)
