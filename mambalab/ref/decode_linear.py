"""A batch-1 decode step's linear layer with the norm before it and the causal conv's step after it, in
PyTorch: the reference that :mod:`mambalab.kernels.gemv` is checked against (math there).

Shapes: x (1, K); weight (N, K); bias (N,); norm_weight, z, residual (1, K) or (K,); conv_state (channels,
width), updated in place; conv_weight (channels, width); conv_bias (channels,). The norm is RMS, in groups of
``group_size``; the conv's channels are the outputs ``conv_start`` to ``conv_start + channels``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def decode_linear_ref(x, weight, bias=None, *, norm_weight=None, z=None, residual=None, group_size=None,
                      eps=1e-5, norm_before_gate=True, conv_state=None, conv_weight=None, conv_bias=None,
                      conv_start=0):
    """out (1, N) in x's dtype, and s = x + residual (1, K) when a residual is given; math in fp32."""
    dtype = x.dtype
    v = x.float()
    s = None
    if residual is not None:
        s = (v + residual.float()).to(dtype)                       # the stream, rounded once
        v = s.float()
    if norm_weight is not None:
        k = v.shape[-1]
        gate = F.silu(z.float()) if z is not None else None
        if gate is not None and not norm_before_gate:
            v = v * gate
        groups = v.unflatten(-1, (k // (group_size or k), -1))      # (1, G, group_size)
        v = (groups * torch.rsqrt(groups.square().mean(-1, keepdim=True) + eps)).flatten(-2) * norm_weight.float()
        if gate is not None and norm_before_gate:
            v = v * gate
        v = v.to(dtype).float()                                      # the norm's output, as stored
    out = F.linear(v, weight.float(), None if bias is None else bias.float())
    if conv_state is not None:
        channels = conv_state.shape[0]
        new = out[0, conv_start:conv_start + channels].to(dtype)     # the channels' new inputs, as stored
        conv_state.copy_(torch.cat([conv_state[:, 1:], new[:, None].to(conv_state.dtype)], dim=1))
        y = (conv_state.float() * conv_weight.float()).sum(-1)
        if conv_bias is not None:
            y = y + conv_bias.float()
        out[0, conv_start:conv_start + channels] = F.silu(y)
    out = out.to(dtype)
    return (out, s) if s is not None else out
