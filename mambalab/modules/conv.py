"""The causal depthwise convolution that Mamba-1 and Mamba-2 put in front of their scans, with SiLU.

Each channel c filters its own last ``d_conv`` inputs: y_t[c] = silu(bias[c] + Σ_k w[c, k] x_{t-d_conv+1+k}[c]).
Over a whole sequence this is ``nn.Conv1d(groups=channels, padding=d_conv-1)`` with the look-ahead outputs
dropped; when decoding, a window ``conv_state`` (b, channels, d_conv) of the last inputs (oldest first)
replaces the sequence. The two functions here give the same outputs, which is what the blocks' step tests
check.

Packed sequences (``seq_idx`` (b, l), each position's sequence, nondecreasing): the window never reaches into
the previous sequence, y_t[c] = silu(bias[c] + Σ_k [seq_{t-d_conv+1+k} = seq_t] w[c, k] x_{t-d_conv+1+k}[c]),
so each sequence is filtered as if it stood alone (zeros before its first position).
:func:`varlen_conv_states` gives each packed sequence's decoding window.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from mambalab import device
from mambalab.ops.conv1d import causal_conv_taps
from mambalab.ops.conv_update import causal_conv1d_update


def new_conv_state(conv1d: nn.Conv1d, batch_size: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A zeroed decoding window (b, channels, d_conv) for ``conv1d``, in ``dtype`` (default: its weight's)."""
    weight = conv1d.weight
    return torch.zeros(batch_size, conv1d.in_channels, conv1d.kernel_size[0], device=weight.device,
                       dtype=dtype or weight.dtype)


def causal_conv1d(conv1d: nn.Conv1d, x: torch.Tensor, conv_state: torch.Tensor | None = None,
                  seq_idx: torch.Tensor | None = None) -> torch.Tensor:
    """silu(causal conv) over a sequence: x (b, channels, l) -> (b, channels, l).

    If ``conv_state`` (b, channels, d_conv) is given, it is filled with the last d_conv inputs (zero-padded
    on the left when l < d_conv; with ``seq_idx``, those of the row's last sequence only), so
    :func:`causal_conv1d_step` can continue from there. l = 0 gives an empty output and a zeroed window.
    ``seq_idx`` (b, l): packed sequences (module docstring); the window is then a sum of d_conv shifted,
    masked copies of x (:func:`mambalab.ops.conv1d.causal_conv_taps`) rather than nn.Conv1d.
    """
    l, width = x.shape[-1], conv1d.kernel_size[0]
    if seq_idx is not None and tuple(seq_idx.shape) != (x.shape[0], l):
        raise ValueError(f"seq_idx must have shape (b, l) = ({x.shape[0]}, {l}); got {tuple(seq_idx.shape)}")
    if conv_state is not None:
        window = x if seq_idx is None or l == 0 else x * (seq_idx == seq_idx[:, -1:])[:, None].to(x.dtype)
        conv_state.copy_(F.pad(window, (max(width - l, 0), 0))[..., -width:])
    if l == 0:  # nothing to filter (and conv1d refuses an empty length)
        return x.new_empty(x.shape)
    if seq_idx is None:
        return F.silu(conv1d(x)[..., :l])  # drop the outputs that peek ahead
    return F.silu(causal_conv_taps(x, conv1d.weight[:, 0], conv1d.bias, seq_idx))


def varlen_conv_states(x: torch.Tensor, cu_seqlens: torch.Tensor, width: int) -> torch.Tensor:
    """Each packed sequence's decoding window: x (1, channels, l) with sequence i at positions
    cu_seqlens[i] … cu_seqlens[i + 1] - 1 -> (num_seqs, channels, width), the last ``width`` inputs of each
    sequence, zero-padded on the left when it is shorter (what :func:`causal_conv1d` leaves in ``conv_state``
    for a sequence alone)."""
    start, end = cu_seqlens[:-1].long(), cu_seqlens[1:].long()              # (num_seqs,)
    at = end[:, None] - width + torch.arange(width, device=x.device)        # (num_seqs, width)
    mine = at >= start[:, None]
    windows = x[0][:, at.clamp(min=0)]                                      # (channels, num_seqs, width)
    return (windows * mine.to(x.dtype)).transpose(0, 1)                    # (num_seqs, channels, width)


def causal_conv1d_step(conv1d: nn.Conv1d, x: torch.Tensor, conv_state: torch.Tensor) -> torch.Tensor:
    """silu(causal conv) for one new input: x (b, channels) -> (b, channels); updates ``conv_state`` in place.

    One Triton kernel (:func:`mambalab.ops.conv_update.causal_conv1d_update`) where
    :func:`mambalab.device.inference_kernels_apply` says so (a GPU, no autograd); else :func:`conv_step_ref`."""
    weight = conv1d.weight[:, 0]                                               # (channels, width)
    if device.inference_kernels_apply(x, weight, conv1d.bias):
        return causal_conv1d_update(x, conv_state, weight, conv1d.bias, activation="silu")
    return conv_step_ref(x, conv_state, weight, conv1d.bias)


def conv_step_ref(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, bias=None) -> torch.Tensor:
    """The decode step in PyTorch: x (b, channels), conv_state (b, channels, width) updated in place, weight
    (channels, width), bias (channels,) -> silu(bias + Σ_k weight[:, k] window[:, :, k]) (b, channels)."""
    # Shift the window left by one and append the new input, then apply each channel's filter.
    conv_state.copy_(torch.cat([conv_state[..., 1:], x.unsqueeze(-1).to(conv_state.dtype)], dim=-1))
    y = torch.einsum("bcw,cw->bc", conv_state, weight)                         # (b, channels)
    if bias is not None:
        y = y + bias
    return F.silu(y)
