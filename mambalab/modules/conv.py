"""The causal depthwise convolution that Mamba-1 and Mamba-2 put in front of their scans, with SiLU.

Each channel c filters its own last ``d_conv`` inputs: y_t[c] = silu(bias[c] + Σ_k w[c, k] x_{t-d_conv+1+k}[c]).
Over a whole sequence this is ``nn.Conv1d(groups=channels, padding=d_conv-1)`` with the look-ahead outputs
dropped; when decoding, a window ``conv_state`` (b, channels, d_conv) of the last inputs (oldest first)
replaces the sequence. The two functions here give the same outputs, which is what the blocks' step tests
check.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


def new_conv_state(conv1d: nn.Conv1d, batch_size: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A zeroed decoding window (b, channels, d_conv) for ``conv1d``, in ``dtype`` (default: its weight's)."""
    weight = conv1d.weight
    return torch.zeros(batch_size, conv1d.in_channels, conv1d.kernel_size[0], device=weight.device,
                       dtype=dtype or weight.dtype)


def causal_conv1d(conv1d: nn.Conv1d, x: torch.Tensor, conv_state: torch.Tensor | None = None) -> torch.Tensor:
    """silu(causal conv) over a sequence: x (b, channels, l) -> (b, channels, l).

    If ``conv_state`` (b, channels, d_conv) is given, it is filled with the last d_conv inputs (zero-padded
    on the left when l < d_conv), so :func:`causal_conv1d_step` can continue from there. l = 0 gives an
    empty output and a zeroed window.
    """
    l, width = x.shape[-1], conv1d.kernel_size[0]
    if conv_state is not None:
        conv_state.copy_(F.pad(x, (max(width - l, 0), 0))[..., -width:])
    if l == 0:  # nothing to filter (and conv1d refuses an empty length)
        return x.new_empty(x.shape)
    return F.silu(conv1d(x)[..., :l])  # drop the outputs that peek ahead


def causal_conv1d_step(conv1d: nn.Conv1d, x: torch.Tensor, conv_state: torch.Tensor) -> torch.Tensor:
    """silu(causal conv) for one new input: x (b, channels) -> (b, channels); updates ``conv_state`` in place."""
    # Shift the window left by one and append the new input, then apply each channel's filter.
    conv_state.copy_(torch.cat([conv_state[..., 1:], x.unsqueeze(-1).to(conv_state.dtype)], dim=-1))
    y = torch.einsum("bcw,cw->bc", conv_state, conv1d.weight[:, 0])  # (b, channels)
    if conv1d.bias is not None:
        y = y + conv1d.bias
    return F.silu(y)
