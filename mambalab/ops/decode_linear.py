"""A batch-1 decode step's linear layer, with the gated RMS norm before it or the causal conv's step after it
fused in: :func:`decode_linear`. Mamba-2's decode step at batch 1 on a GPU, without autograd, runs its in_proj
(with the conv) and its out_proj (with the norm) through it (:meth:`mambalab.modules.Mamba2.step`, where
:meth:`~mambalab.modules.Mamba2._fused_step_applies`).

Checks the shapes, then runs :mod:`mambalab.kernels.gemv` (one Triton kernel; on a CPU in Triton's
interpreter, in fp32). Reference: :func:`mambalab.ref.decode_linear.decode_linear_ref`.
"""
from __future__ import annotations

from mambalab import device as _device
from mambalab import validate
from mambalab.kernels.gemv import gemv_fwd

__all__ = ["decode_linear"]


def decode_linear(x, weight, bias=None, *, norm_weight=None, z=None, residual=None, group_size=None, eps=1e-5,
                  norm_before_gate=True, conv_state=None, conv_weight=None, conv_bias=None, conv_start=0):
    """out = weight · v + bias for one row (math: :mod:`mambalab.kernels.gemv`). Forward only.

    x (1, K); weight (N, K); bias (N,) or None.
    With ``norm_weight`` (K,): v = rmsnorm(x [+ residual], in groups of ``group_size`` (None: one group),
    gated by silu(z) after the norm (``norm_before_gate``, mamba-ssm's default) or before it) ⊙ norm_weight,
    rounded to x's dtype on a GPU (on the CPU the kernel runs in fp32 and rounds only what it returns); z and
    residual (1, K) or None. Else v = x (``group_size`` and ``eps`` are then unused).
    With ``conv_state`` (channels, width): the outputs ``conv_start`` to ``conv_start + channels`` enter the
    causal conv's windows (updated in place) and leave as silu(conv_bias + Σ_k conv_weight[:, k] window[:, k]);
    conv_weight (channels, width), conv_bias (channels,) or None.
    Returns out (1, N) in x's dtype, and s = x + residual (1, K) when a residual is given.
    """
    named = dict(x=x, weight=weight, bias=bias, norm_weight=norm_weight, z=z, residual=residual,
                 conv_state=conv_state, conv_weight=conv_weight, conv_bias=conv_bias)
    for name, t in named.items():
        if t is not None:
            validate.tensor(name, t)
    if x.dim() != 2 or x.shape[0] != 1:
        raise ValueError(f"x must have shape (1, K): one row, batch 1; got {tuple(x.shape)}")
    k = x.shape[1]
    if weight.dim() != 2 or weight.shape[1] != k:
        raise ValueError(f"weight must have shape (N, K) with K = {k} (x's width); got {tuple(weight.shape)}")
    n = weight.shape[0]
    if bias is not None:
        validate.shape("bias", bias, (n,), "(N,)")
    if norm_weight is None and any(t is not None for t in (z, residual)):
        raise ValueError("z and residual belong to the norm: pass norm_weight with them")
    if norm_weight is not None:
        validate.shape("norm_weight", norm_weight, (k,), "(K,)")
        for name, t in (("z", z), ("residual", residual)):
            if t is not None:
                validate.shape(name, t, (1, k), "(1, K)")
        group_size = k if group_size is None else validate.positive_int("group_size", group_size)
        if k % group_size:
            raise ValueError(f"group_size must divide K = {k}; got {group_size}")
    if conv_state is None and any(t is not None for t in (conv_weight, conv_bias)):
        raise ValueError("conv_weight and conv_bias belong to the conv: pass conv_state with them")
    if conv_state is not None:
        if conv_state.dim() != 2:
            raise ValueError(f"conv_state must have shape (channels, width); got {tuple(conv_state.shape)}")
        channels, width = conv_state.shape
        if conv_weight is None:
            raise ValueError("conv_weight (channels, width) is needed with conv_state")
        validate.shape("conv_weight", conv_weight, (channels, width), "(channels, width)")
        if conv_bias is not None:
            validate.shape("conv_bias", conv_bias, (channels,), "(channels,)")
        if not (isinstance(conv_start, int) and 0 <= conv_start <= n - channels):
            raise ValueError(f"conv_start must be an int in [0, N - channels] = [0, {n - channels}]; "
                             f"got {conv_start!r}")
    validate.same_device(**named)
    tensors = [t for t in named.values() if t is not None]
    validate.decoding_only("decode_linear", *tensors)
    _device.ensure_kernel_device(x.device)
    if weight.stride(1) != 1:
        weight = weight.contiguous()
    cast = _device.compute_dtype(x.dtype, x.device)
    wide = lambda t: None if t is None else t.to(cast).contiguous()
    window = conv_state
    if conv_state is not None and any(_device.compute_dtype(t.dtype, t.device) != t.dtype for t in tensors):
        window = conv_state.float()   # the interpreter computes in fp32 only: run on a copy, write it back
    norm = None if norm_weight is None else dict(weight=wide(norm_weight), z=wide(None if z is None else z[0]),
                                                 residual=wide(None if residual is None else residual[0]),
                                                 group_size=group_size, eps=eps, norm_before_gate=norm_before_gate)
    conv = None if conv_state is None else dict(state=window, weight=wide(conv_weight), bias=wide(conv_bias),
                                                start=conv_start)
    result = gemv_fwd(wide(weight), wide(x[0]), wide(bias), norm=norm, conv=conv)
    if window is not conv_state:
        conv_state.copy_(window)
    out, s = result if isinstance(result, tuple) else (result, None)
    out = out.to(x.dtype)[None]
    return (out, s.to(x.dtype)[None]) if s is not None else out
