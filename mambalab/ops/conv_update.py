"""The causal depthwise convolution's decode step: :func:`causal_conv1d_update`, drop-in for the function of
that name in the ``causal_conv1d`` package (which mamba-ssm's blocks call when it is installed) for one new
input: same arguments, order and result.

Checks the shapes, then runs :mod:`mambalab.kernels.conv_update` (one Triton kernel; on a CPU in Triton's
interpreter, in fp32).
"""
from __future__ import annotations

from mambalab import device as _device
from mambalab import validate
from mambalab.kernels.conv_update import conv_update_fwd

__all__ = ["causal_conv1d_update"]

ACTIVATIONS = (None, "silu", "swish")


def causal_conv1d_update(x, conv_state, weight, bias=None, activation=None):
    """One new input through the causal depthwise convolution; ``conv_state`` is updated in place.

    x (b, channels); conv_state (b, channels, width), the last ``width`` inputs, oldest first; weight
    (channels, width); bias (channels,) or None; activation None, "silu" or "swish" (the same) -> y
    (b, channels) in x's dtype: act(bias + Σ_k weight[:, k] window[:, :, k]) over the shifted window (math:
    :mod:`mambalab.kernels.conv_update`; reference: :func:`mambalab.modules.conv.conv_step_ref`). Forward only.
    ``causal_conv1d``'s x of shape (b, channels, seqlen) for several inputs at once is refused, with its
    ``cache_seqlens`` and ``conv_state_indices``: mambalab's blocks decode one token at a time.
    """
    for name, t in (("x", x), ("conv_state", conv_state), ("weight", weight), ("bias", bias)):
        if t is not None:
            validate.tensor(name, t)
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}; got {activation!r}")
    if x.dim() != 2:
        raise ValueError(f"x must have shape (b, channels): one new input per row; got {tuple(x.shape)}")
    b, channels = x.shape
    if conv_state.dim() != 3:
        raise ValueError(f"conv_state must have shape (b, channels, width); got {tuple(conv_state.shape)}")
    width = conv_state.shape[-1]
    validate.shape("conv_state", conv_state, (b, channels, width), "(b, channels, width)")
    validate.shape("weight", weight, (channels, width), "(channels, width)")
    if bias is not None:
        validate.shape("bias", bias, (channels,), "(channels,)")
    validate.same_device(x=x, conv_state=conv_state, weight=weight, bias=bias)
    tensors = [t for t in (x, conv_state, weight, bias) if t is not None]
    validate.decoding_only("causal_conv1d_update", *tensors)
    _device.ensure_kernel_device(x.device)
    silu = activation is not None
    if any(_device.compute_dtype(t.dtype, t.device) != t.dtype for t in tensors):
        # the interpreter computes in fp32 only: run on fp32 copies, write the window back
        window = conv_state.float()
        out = conv_update_fwd(x.float(), window, weight.float(), None if bias is None else bias.float(), silu)
        conv_state.copy_(window)
        return out.to(x.dtype)
    return conv_update_fwd(x, conv_state, weight, bias, silu)
