"""The decode step of the causal depthwise convolution (Mamba-1's and Mamba-2's), as one Triton kernel: the
window shifted by one input, the filter applied, the bias and SiLU added, in one pass.

Math (per batch row and channel c; see :mod:`mambalab.modules.conv`, whose
:func:`~mambalab.modules.conv.conv_step_ref` this kernel is checked against):

    window[c] ← (window[c, 1:], x[c])                 the last ``width`` inputs, oldest first
    y[c]      = act(bias[c] + Σ_k w[c, k] window[c, k])     act: SiLU, or none

Unfused, the same step is half a dozen small PyTorch kernels per layer (shift, append, product, sum, bias,
SiLU); in a CUDA-graph decode of a small model at batch 1 those launches, not bytes, are the cost.

Tile rule: one program per (batch row, block of BLOCK_C = 256 channels), the window whole (BLOCK_W =
next_pow2(width)). Shapes: x (b, channels); conv_state (b, channels, width), updated in place; weight
(channels, width); bias (channels,). Out: y (b, channels) in x's dtype; the sums in fp32.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_C = 256


@triton.jit
def conv_update_kernel(
    x_ptr, state_ptr, weight_ptr, bias_ptr, out_ptr,
    channels, width,
    x_b, x_c, s_b, s_c, s_w, w_c, w_w, o_b, o_c,
    HAS_BIAS: tl.constexpr, SILU: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_W: tl.constexpr,
):
    pid_b = tl.program_id(0)
    pid_c = tl.program_id(1)
    offs_c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    offs_w = tl.arange(0, BLOCK_W)
    mask_c = offs_c < channels
    newest = offs_w == width - 1                                       # the column the new input takes
    older = offs_w < width - 1
    s_ptrs = state_ptr + pid_b.to(tl.int64) * s_b + offs_c[:, None] * s_c
    # the window shifted left by one: column k takes column k + 1, the last takes x
    shifted = tl.load(s_ptrs + (offs_w[None, :] + 1) * s_w, mask=mask_c[:, None] & older[None, :], other=0.0)
    x = tl.load(x_ptr + pid_b * x_b + offs_c * x_c, mask=mask_c, other=0.0)
    window = tl.where(newest[None, :], x[:, None].to(shifted.dtype), shifted)   # (BLOCK_C, BLOCK_W)
    keep = mask_c[:, None] & (offs_w[None, :] < width)
    tl.store(s_ptrs + offs_w[None, :] * s_w, window.to(state_ptr.dtype.element_ty), mask=keep)
    w = tl.load(weight_ptr + offs_c[:, None] * w_c + offs_w[None, :] * w_w, mask=keep, other=0.0)
    y = tl.sum(window.to(tl.float32) * w.to(tl.float32), axis=1)
    if HAS_BIAS:
        y += tl.load(bias_ptr + offs_c, mask=mask_c, other=0.0).to(tl.float32)
    if SILU:
        y = y * tl.sigmoid(y)
    tl.store(out_ptr + pid_b * o_b + offs_c * o_c, y.to(out_ptr.dtype.element_ty), mask=mask_c)


def conv_update_fwd(x, conv_state, weight, bias, silu: bool):
    """Launch :func:`conv_update_kernel` (shapes checked by the caller); returns y (b, channels)."""
    b, channels = x.shape
    width = conv_state.shape[-1]
    out = torch.empty_like(x)
    grid = (b, triton.cdiv(channels, BLOCK_C))
    conv_update_kernel[grid](
        x, conv_state, weight, bias if bias is not None else weight, out, channels, width,
        *x.stride(), *conv_state.stride(), *weight.stride(), *out.stride(),
        HAS_BIAS=bias is not None, SILU=silu, BLOCK_C=BLOCK_C, BLOCK_W=triton.next_power_of_2(width),
        num_warps=4,
    )
    return out
