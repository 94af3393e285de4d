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

The forward and the backward are one Triton kernel each (:mod:`mambalab.kernels.conv1d`, which states the
tile rule): on a GPU natively, on the CPU through Triton's interpreter, computing in fp32 and storing in x's
dtype; out and dx keep x's layout (channel-last x, as mamba-ssm passes it, stays channel-last). The order of the
sums: pre is the bias, then the ``width`` taps in tap order; dx and dinitial_states are the ``width`` taps in
tap order, then the final states' gradient; dweight and dbias are each tile's sum over its 32 positions, written
as one partial a (batch row, block of positions), then folded by :func:`mambalab.kernels.reduce.sum_partials`.
Every step's order is fixed by the shape, the dtypes and x's layout alone, so the bits do not depend on the GPU
(its model, its SM count) or the run.

:func:`causal_conv_taps` is the same convolution (before its activation) in plain PyTorch: the reference the
kernels are tested against, and what :mod:`mambalab.modules.conv` runs for packed sequences.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from mambalab import device as _device
from mambalab import validate
from mambalab.kernels.conv1d import BLOCK_L, causal_conv1d_bwd, causal_conv1d_fwd, launch_grid, partial_count
from mambalab.kernels.reduce import SEGMENT

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
    (callers validate). :mod:`mambalab.modules.conv` uses it for packed sequences; the tests check the
    kernels against it."""
    l, width = x.shape[-1], weight.shape[-1]
    xp, sp = _padded(x, seq_idx, initial_states, width)                     # (b, d, width - 1 + l)
    y = torch.zeros_like(x) if bias is None else bias[:, None].expand_as(x).to(x.dtype)
    for k in range(width):   # tap k reads x_{t - (width - 1 - k)}, if it is of t's sequence
        y = y + weight[:, k, None] * _tap(xp, sp, seq_idx, k, l)
    return y


def kernel_inputs(x, weight, bias, seq_idx, initial_states):
    """The tensors as the kernels take them: floats in the device's compute dtype (fp32 on the CPU
    interpreter; :func:`mambalab.device.compute_dtype`), seq_idx int32 with unit stride along l.
    :mod:`mambalab.parallel.context` feeds its pieces to the kernels through it too."""
    cast = lambda t: None if t is None else t.to(_device.compute_dtype(t.dtype, t.device))
    if seq_idx is not None and (seq_idx.dtype != torch.int32 or seq_idx.stride(-1) != 1):
        seq_idx = seq_idx.to(torch.int32).contiguous()
    return cast(x), cast(weight), cast(bias), seq_idx, cast(initial_states)


class CausalConv1dFn(torch.autograd.Function):
    """The convolution with autograd, as :mod:`mambalab.kernels.conv1d`'s two kernels; inputs arrive
    validated."""

    @staticmethod
    def forward(ctx, x, weight, bias, seq_idx, initial_states, return_final_states, silu):
        out, final = causal_conv1d_fwd(*kernel_inputs(x, weight, bias, seq_idx, initial_states),
                                       return_final_states, silu)
        ctx.save_for_backward(x, weight, bias, seq_idx, initial_states)
        ctx.silu = silu
        ctx.set_materialize_grads(False)
        return out.to(x.dtype), None if final is None else final.to(x.dtype)

    @staticmethod
    def backward(ctx, dout, dfinal):
        x, weight, bias, seq_idx, initial_states = ctx.saved_tensors
        xk, wk, bk, seq_idx, initk = kernel_inputs(x, weight, bias, seq_idx, initial_states)
        if dout is None:   # only the final states reach the loss
            dout = torch.zeros_like(xk)
        compute = lambda t: None if t is None else t.to(xk.dtype)
        dx, dweight, dbias, dinit = causal_conv1d_bwd(xk, wk, bk, seq_idx, initk, compute(dout), compute(dfinal),
                                                      ctx.silu)
        needs = ctx.needs_input_grad
        return (dx.to(x.dtype) if needs[0] else None,
                dweight.to(weight.dtype) if needs[1] else None,
                dbias.to(bias.dtype) if bias is not None and needs[2] else None,
                None,
                dinit.to(initial_states.dtype) if initial_states is not None and needs[4] else None,
                None, None)


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
    partials = f"b · cdiv(l, {BLOCK_L}) partials (x.shape[0] · position blocks)"
    validate.launch_grid("causal_conv1d_fn's kernels", launch_grid(b, d, l),
                         ((partials, partial_count(b, l)),
                          ("d (x.shape[1])", d)))
    if validate.records_autograd(weight, bias):   # sum_partials folds the P partials 32 a program
        validate.launch_grid("causal_conv1d_fn's backward sums of dweight and dbias",
                             (1, -(-partial_count(b, l) // SEGMENT)),
                             (("b (x.shape[0])", b),
                              (partials, partial_count(b, l))),
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
    a width outside 2 … 4, more than 2,097,120 partials b · cdiv(l, 64) (about 134 million positions) when
    weight or bias needs a gradient (the grid of the backward's sums), more than 4,194,240 channels d (the
    kernels' grid), ``seq_idx`` together with ``initial_states`` or ``return_final_states`` (both of
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
