"""``causal_conv1d_fn``: the causal depthwise convolution over a whole sequence, with autograd; a drop-in for the
function of that name in the ``causal_conv1d`` package (Dao-AILab/causal-conv1d,
causal_conv1d/causal_conv1d_interface.py), which mamba-ssm's Mamba-1 and Mamba-2 blocks call for their
short convolution.

Each channel c filters its own last ``width`` inputs:

    pre_t[c] = bias[c] + Σ_k weight[c, k] · x_{t - (width - 1) + k}[c]     (k = 0 … width - 1)
    out_t[c] = act(pre_t[c]),   act = identity or SiLU

with x_{-width+1} … x_{-1} taken from ``initial_states`` (zeros without it). With ``seq_idx`` (packed sequences)
a tap reads only inputs of t's own sequence; positions whose ``seq_idx`` is negative (padding) give 0.

Shapes: x (b, d, l); weight (d, width); bias (d,); seq_idx (b, l) int32; initial_states and final states
(b, d, width - 1), the last width - 1 inputs (oldest first).

The forward and backward compute in fp32 with PyTorch ops. The backward's dweight and dbias sum over the
b · l positions with :func:`mambalab.kernels.reduce.sum_partials`, in an order fixed by the shape alone, so
their bits do not depend on the GPU (its SM count) or the run; dx and dinitial_states are sums over the
``width`` taps in tap order.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from mambalab import device as _device
from mambalab import validate
from mambalab.kernels.reduce import sum_partials

__all__ = ["causal_conv1d_fn", "causal_conv_taps"]

ACTIVATIONS = (None, "silu", "swish")
WIDTHS = (2, 3, 4)   # what causal_conv1d's CUDA kernels are built for (csrc/causal_conv1d.cpp), refused beyond


def _padded(x: torch.Tensor, seq_idx, initial_states, width: int):
    """x with the width - 1 earlier inputs in front, (b, d, width - 1 + l), and seq_idx padded alike with -1
    (or None)."""
    if initial_states is None:
        xp = F.pad(x, (width - 1, 0))
    else:
        xp = torch.cat([initial_states.to(x.dtype), x], dim=-1)
    sp = None if seq_idx is None else F.pad(seq_idx, (width - 1, 0), value=-1)
    return xp, sp


def _tap(xp: torch.Tensor, sp, seq_idx, k: int, l: int) -> torch.Tensor:
    """The inputs tap k reads at every t, (b, d, l): x_{t - (width - 1 - k)}, zero where that input belongs to
    another sequence than t (``seq_idx``); the padding before the sequence is zero in xp already."""
    if seq_idx is None:
        return xp[..., k:k + l]
    same = (sp[:, k:k + l] == seq_idx)[:, None]                             # (b, 1, l)
    return torch.where(same, xp[..., k:k + l], 0.0)


def causal_conv_taps(x: torch.Tensor, weight: torch.Tensor, bias=None, seq_idx=None,
                     initial_states=None) -> torch.Tensor:
    """The convolution before its activation, pre (b, d, l), as a sum of ``width`` shifted (and, with
    ``seq_idx``, masked) copies of x, in x's dtype: x (b, d, l), weight (d, width), bias (d,) or None,
    seq_idx (b, l) or None, initial_states (b, d, width - 1) or None. Plain PyTorch, differentiable; no checks
    (callers validate). :mod:`mambalab.modules.conv` uses it for packed sequences."""
    l, width = x.shape[-1], weight.shape[-1]
    xp, sp = _padded(x, seq_idx, initial_states, width)                     # (b, d, width - 1 + l)
    y = torch.zeros_like(x) if bias is None else bias[:, None].expand_as(x).to(x.dtype)
    for k in range(width):   # tap k reads x_{t - (width - 1 - k)}, if it is of t's sequence
        y = y + weight[:, k, None] * _tap(xp, sp, seq_idx, k, l)
    return y


def _silu_grad(pre: torch.Tensor) -> torch.Tensor:
    """d silu(p) / dp = s (1 + p (1 - s)), s = sigmoid(p)."""
    s = torch.sigmoid(pre)
    return s * (1 + pre * (1 - s))


class CausalConv1dFn(torch.autograd.Function):
    """The convolution with autograd, in fp32; inputs arrive validated."""

    @staticmethod
    def forward(ctx, x, weight, bias, seq_idx, initial_states, return_final_states, silu):
        width, l = weight.shape[-1], x.shape[-1]
        x32, w32 = x.float(), weight.float()
        b32 = None if bias is None else bias.float()
        init32 = None if initial_states is None else initial_states.float()
        pre = causal_conv_taps(x32, w32, b32, seq_idx, init32)              # (b, d, l) fp32
        out = F.silu(pre) if silu else pre
        if seq_idx is not None:   # padding positions (seq_idx < 0) give 0, as causal_conv1d's forward kernel
            out = out.masked_fill((seq_idx < 0)[:, None], 0.0)
        ctx.save_for_backward(x, weight, bias, seq_idx, initial_states)
        ctx.silu = silu
        out = out.to(x.dtype)
        if not return_final_states:
            return out, None
        xp, _ = _padded(x32, None, init32, width)
        return out, xp[..., l:].to(x.dtype)                                 # (b, d, width - 1)

    @staticmethod
    def backward(ctx, dout, dfinal):
        x, weight, bias, seq_idx, initial_states = ctx.saved_tensors
        (b, d, l), width = x.shape, weight.shape[-1]
        x32, w32 = x.float(), weight.float()
        init32 = None if initial_states is None else initial_states.float()
        xp, sp = _padded(x32, seq_idx, init32, width)
        dpre = dout.float()                                                 # (b, d, l)
        if ctx.silu:
            b32 = None if bias is None else bias.float()
            dpre = dpre * _silu_grad(causal_conv_taps(x32, w32, b32, seq_idx, init32))
        if seq_idx is not None:
            dpre = dpre.masked_fill((seq_idx < 0)[:, None], 0.0)
        dx = dweight = dbias = dinit = None
        if ctx.needs_input_grad[0] or ctx.needs_input_grad[4]:
            dxp = torch.zeros_like(xp)                                      # (b, d, width - 1 + l)
            for k in range(width):   # tap k's input gets weight[:, k] · dpre where it was read
                contrib = w32[:, k, None] * dpre
                if seq_idx is not None:
                    contrib = torch.where((sp[:, k:k + l] == seq_idx)[:, None], contrib, 0.0)
                dxp[..., k:k + l] += contrib
            if dfinal is not None:   # the final states are xp's last width - 1 columns
                dxp[..., l:] += dfinal.float()
            dx = dxp[..., width - 1:].to(x.dtype)
            if initial_states is not None:
                dinit = dxp[..., :width - 1].to(initial_states.dtype)
        # dweight and dbias: one partial (d,) per position, (b·l, d), summed in the order sum_partials fixes
        over_positions = lambda t: sum_partials(t.transpose(1, 2).reshape(b * l, d), dim=0)   # (b, d, l) -> (d,)
        if ctx.needs_input_grad[1]:
            dweight = torch.stack([over_positions(_tap(xp, sp, seq_idx, k, l) * dpre) for k in range(width)],
                                  dim=1).to(weight.dtype)                                   # (d, width)
        if bias is not None and ctx.needs_input_grad[2]:
            dbias = over_positions(dpre).to(bias.dtype)
        return dx, dweight, dbias, None, dinit, None, None


def _check(x, weight, bias, seq_idx, initial_states, return_final_states, final_states_out, activation):
    """Validate at the boundary, before any computation; errors name the argument."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}; got {activation!r}")
    validate.tensor("x", x)
    validate.tensor("weight", weight)
    if x.dim() != 3:
        raise ValueError(f"x must have shape (b, d, l); got {tuple(x.shape)}")
    b, d, l = x.shape
    if weight.dim() != 2:
        raise ValueError(f"weight must have shape (d, width) = ({d}, width); got {tuple(weight.shape)}")
    validate.shape("weight", weight, (d, None), "(d, width)")
    width = weight.shape[1]
    if width not in WIDTHS:
        raise ValueError(f"weight's width (weight.shape[1]) must be 2, 3 or 4, as causal_conv1d's; got {width}")
    if bias is not None:
        validate.tensor("bias", bias)
        validate.shape("bias", bias, (d,), "(d,)")
        if bias.dtype != weight.dtype:
            raise TypeError(f"bias must have weight's dtype {weight.dtype}; got {bias.dtype}")
    if seq_idx is not None:
        if initial_states is not None:
            raise ValueError("initial_states must be None when seq_idx is given (causal_conv1d_fn restarts the "
                             "window at each sequence of seq_idx)")
        if return_final_states:
            raise ValueError("return_final_states must be False when seq_idx is given (causal_conv1d_fn returns "
                             "no final states for packed sequences)")
        if not isinstance(seq_idx, torch.Tensor) or seq_idx.dtype != torch.int32:
            raise TypeError(f"seq_idx must be an int32 tensor; got "
                            f"{seq_idx.dtype if isinstance(seq_idx, torch.Tensor) else type(seq_idx).__name__}")
        validate.shape("seq_idx", seq_idx, (b, l), "(b, l)")
    if initial_states is not None:
        validate.tensor("initial_states", initial_states)
        validate.shape("initial_states", initial_states, (b, d, width - 1), "(b, d, width - 1)")
        if initial_states.dtype != x.dtype:
            raise TypeError(f"initial_states must have x's dtype {x.dtype}; got {initial_states.dtype}")
    if return_final_states and final_states_out is not None:
        validate.tensor("final_states_out", final_states_out)
        validate.shape("final_states_out", final_states_out, (b, d, width - 1), "(b, d, width - 1)")
        if final_states_out.dtype != x.dtype:
            raise TypeError(f"final_states_out must have x's dtype {x.dtype}; got {final_states_out.dtype}")
    dev = validate.same_device(x=x, weight=weight, bias=bias, seq_idx=seq_idx, initial_states=initial_states,
                               final_states_out=final_states_out if return_final_states else None)
    _device.ensure_kernel_device(dev)
    if validate.records_autograd(weight, bias):   # the backward's sums fold 32 of the b·l partials a program
        validate.launch_grid("causal_conv1d_fn's backward sums of dweight and dbias", (1, -(-b * l // 32)),
                             (("b (x.shape[0])", b), ("l (x.shape[2])", l)),
                             "; split the batch, or the sequence (passing the final states on as initial_states)")


def causal_conv1d_fn(x, weight, bias=None, seq_idx=None, initial_states=None, return_final_states=False,
                     final_states_out=None, activation=None):
    """The causal depthwise convolution (module docstring); the signature and results of ``causal_conv1d``'s
    ``causal_conv1d_fn``.

    Args:
        x: (b, d, l), fp32/fp16/bf16; any strides.
        weight: (d, width), width 2, 3 or 4; fp32/fp16/bf16 (may differ from x's dtype).
        bias: optional (d,), weight's dtype.
        seq_idx: optional (b, l) int32, each position's sequence: a tap reads only inputs of the same
            sequence; positions with a negative index (padding) give 0.
        initial_states: optional (b, d, width - 1), x's dtype: the inputs before x_0 (oldest first).
        return_final_states: also return the last width - 1 inputs (b, d, width - 1), x's dtype.
        final_states_out: optional (b, d, width - 1) tensor the final states are written into (and returned).
        activation: None, "silu" or "swish" (the same).

    Returns:
        out (b, d, l) in x's dtype, or (out, final_states). Gradients flow to x, weight, bias, initial_states
        and through the final states.

    Raises (before any computation), naming the argument: ValueError for an unknown activation, wrong shapes,
    a width outside 2 … 4, more than 2,097,120 positions b · l when weight or bias needs a gradient (the grid of
    the backward's sums), ``seq_idx`` together with ``initial_states`` or ``return_final_states`` (both of
    which causal_conv1d refuses too); TypeError for wrong dtypes (float64, seq_idx not int32, bias not in
    weight's dtype, initial_states / final_states_out not in x's). causal_conv1d's memory-layout conditions
    (channel-last x for seq_idx and the states, d a multiple of 8) are not imposed: any layout is computed.
    """
    _check(x, weight, bias, seq_idx, initial_states, return_final_states, final_states_out, activation)
    out, final = CausalConv1dFn.apply(x, weight, bias, seq_idx, initial_states, bool(return_final_states),
                                      activation is not None)
    if not return_final_states:
        return out
    if final_states_out is not None:
        final = final_states_out.copy_(final)
    return out, final
