"""Gated RMSNorm and gated LayerNorm, as Mamba-2 applies them to the SSD output before the output projection.

For x, z of shape (..., d), a weight w (d,), an optional bias b (d,), and the d channels cut into
G = d / group_size groups of ``group_size`` consecutive channels (one group when ``group_size`` is None):

    norm_before_gate=True (the default):        y = norm_k(x) ⊙ w + b, then y ⊙ silu(z)
    norm_before_gate=False (Mamba-2's choice):  v = x ⊙ silu(z), then y = norm_k(v) ⊙ w + b

    RMS mode:        norm_k(v) = v / sqrt(mean_k(v²) + eps)
    LayerNorm mode:  norm_k(v) = (v - mean_k(v)) / sqrt(mean_k((v - mean_k(v))²) + eps)

where mean_k averages over the channels of group k. Without z there is no gate and ``norm_before_gate``
changes nothing. Each group is normalised on its own: a group's output depends on its own channels (and
weights) only. In Mamba-2 the groups are the ngroups groups of heads that share B and C, so a
tensor-parallel rank that holds whole groups normalises them without any communication; one RMS over all
d channels would need an all-reduce of the sums of squares.

These are mamba-ssm's ``RMSNorm`` and ``LayerNorm`` of ``mamba_ssm.ops.triton.layernorm_gated`` (imported
there as ``RMSNormGated``): same constructor arguments and defaults, same parameter names (``weight``; and
``bias`` for LayerNorm, which RMSNorm registers as None), so state dicts interchange, and the same
functional forms :func:`rmsnorm_fn` and :func:`layernorm_fn`.

:func:`layernorm_fn` runs the Triton kernels of :mod:`mambalab.kernels.norm` for fp32, fp16 and bf16 inputs
on a GPU, with an autograd function (:class:`GatedNormFn`) whose backward is one kernel: dx and dz a row at a
time, the weight's and bias's gradients summed by each program over a fixed number of rows and the programs'
partials folded by :func:`mambalab.kernels.reduce.sum_partials`. Their bits depend on the number of rows alone:
the same on every GPU and every run, and for any split of the leading dimensions into (batch, length). On the
CPU, and for fp64 inputs, the PyTorch form :func:`layernorm_ref` runs instead, its backward autograd's (in
Triton's interpreter a training step of chapter 03's parity model spends 94 % of its time in the backward
kernel); the tests run the kernels' path, :func:`layernorm_kernels`, through the interpreter.
:func:`layernorm_ref` computes in fp32 (fp64 for fp64 inputs) and is the reference the kernels are checked
against.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from mambalab import device
from mambalab.kernels.norm import gated_norm_fwd, norm_bwd, norm_fwd

__all__ = ["GatedLayerNorm", "GatedRMSNorm", "LayerNormGated", "RMSNormGated", "add_norm", "layernorm_fn",
           "layernorm_kernels", "layernorm_ref", "rmsnorm_fn"]

_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class GatedNormFn(torch.autograd.Function):
    """The gated norm on the kernels with autograd; x, z (M, d) with unit stride along d, validated."""

    @staticmethod
    def forward(ctx, x, weight, bias, z, eps, group_size, norm_before_gate, is_rms_norm):
        y, _, mean, rstd = norm_fwd(x, weight, bias, z, None, eps, group_size, norm_before_gate, is_rms_norm)
        ctx.save_for_backward(x, weight, bias, z, mean, rstd)
        ctx.config = group_size, norm_before_gate, is_rms_norm
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, bias, z, mean, rstd = ctx.saved_tensors
        want_db = bias is not None and ctx.needs_input_grad[2]
        dx, dz, _, dw, db = norm_bwd(dy if dy.stride(-1) == 1 else dy.contiguous(), None, x, z, weight, bias, mean,
                                     rstd, *ctx.config, dx_dtype=x.dtype, want_db=want_db)
        return (dx, dw.to(weight.dtype) if ctx.needs_input_grad[1] else None, db.to(bias.dtype) if want_db else None,
                dz if ctx.needs_input_grad[3] else None, None, None, None, None)


def layernorm_fn(x, weight, bias, z=None, eps=1e-6, group_size=None, norm_before_gate=True, is_rms_norm=False):
    """Gated (RMS or Layer) norm of x (..., d) with weight (d,), bias (d,) or None, z (..., d) or None.

    mamba-ssm's ``layernorm_fn`` (same arguments and defaults); see the module docstring for the math and for
    which inputs run the kernels. Returns x's shape and dtype.
    """
    d = x.shape[-1]
    group_size = d if group_size is None else int(group_size)
    if group_size < 1 or d % group_size:
        raise ValueError(f"group_size must divide x's last dimension {d}; got {group_size}")
    if weight.shape != (d,):
        raise ValueError(f"weight must have shape ({d},); got {tuple(weight.shape)}")
    if bias is not None and bias.shape != (d,):
        raise ValueError(f"bias must have shape ({d},) or be None; got {tuple(bias.shape)}")
    if z is not None and z.shape != x.shape:
        raise ValueError(f"z must have x's shape {tuple(x.shape)}; got {tuple(z.shape)}")
    given = [t for t in (x, weight, bias, z) if t is not None]
    if not x.numel() or not x.is_cuda or any(t.dtype not in _KERNEL_DTYPES for t in given):
        # the CPU: PyTorch beats the interpreter (the tests run layernorm_kernels there directly)
        return layernorm_ref(x, weight, bias, z, eps, group_size, norm_before_gate, is_rms_norm)
    if device.inference_kernels_apply(x, weight, bias, z):
        rows = lambda t: t.reshape(-1, d) if t.stride(-1) == 1 else t.reshape(-1, d).contiguous()   # (M, d)
        out = gated_norm_fwd(rows(x), weight, bias, None if z is None else rows(z), eps, group_size,
                             norm_before_gate, is_rms_norm)
        return out.reshape(x.shape)
    return layernorm_kernels(x, weight, bias, z, eps, group_size, norm_before_gate, is_rms_norm)


def layernorm_kernels(x, weight, bias, z, eps, group_size: int, norm_before_gate: bool, is_rms_norm: bool):
    """:func:`layernorm_fn`'s training path, :class:`GatedNormFn` on x, z (..., d) viewed as (M, d) rows; the
    arguments checked by the caller, group_size an int. On the CPU it runs through Triton's interpreter."""
    d = x.shape[-1]
    device.ensure_kernel_device(x.device)
    rows = lambda t: t.reshape(-1, d) if t.stride(-1) == 1 else t.reshape(-1, d).contiguous()   # (M, d)
    out = GatedNormFn.apply(rows(x), weight, bias, None if z is None else rows(z), float(eps), group_size,
                            bool(norm_before_gate), bool(is_rms_norm))
    return out.reshape(x.shape)


def layernorm_ref(x, weight, bias, z=None, eps=1e-6, group_size=None, norm_before_gate=True, is_rms_norm=False):
    """:func:`layernorm_fn` in PyTorch, in fp32 (fp64 for fp64 inputs), returned in x's dtype; the reference
    the kernels are checked against, and the form fp64 inputs take. Arguments as :func:`layernorm_fn`."""
    d = x.shape[-1]
    group_size = d if group_size is None else int(group_size)
    dtype = x.dtype
    compute = torch.promote_types(dtype, torch.float32)          # fp32, or fp64 for fp64 inputs
    # One (rows, d) view whatever the leading shape: the weight's gradient then sums over one axis of a
    # fixed length, the same for (b, l) = (2, 8) as for (4, 4).
    v = x.reshape(-1, d).to(compute)                               # (M, d)
    gate = F.silu(z.reshape(-1, d).to(compute)) if z is not None else None
    if gate is not None and not norm_before_gate:
        v = v * gate
    groups = v.unflatten(-1, (d // group_size, group_size))       # (M, G, group_size)
    if not is_rms_norm:
        groups = groups - groups.mean(dim=-1, keepdim=True)
    rstd = torch.rsqrt(groups.square().mean(dim=-1, keepdim=True) + eps)   # (M, G, 1)
    y = (groups * rstd).flatten(-2) * weight.to(compute)           # (M, d)
    if bias is not None:
        y = y + bias.to(compute)
    if gate is not None and norm_before_gate:
        y = y * gate
    return y.reshape(x.shape).to(dtype)


def rmsnorm_fn(x, weight, bias, z=None, eps=1e-6, group_size=None, norm_before_gate=True):
    """Gated RMSNorm of x (..., d); mamba-ssm's ``rmsnorm_fn``: :func:`layernorm_fn` with ``is_rms_norm``."""
    return layernorm_fn(x, weight, bias, z=z, eps=eps, group_size=group_size, norm_before_gate=norm_before_gate,
                        is_rms_norm=True)


class _GatedNorm(nn.Module):
    """What the RMS and LayerNorm modules share: arguments, checks, forward."""

    is_rms_norm: bool

    def __init__(self, hidden_size, eps=1e-5, group_size=None, norm_before_gate=True, device=None, dtype=None,
                 *, bias: bool):
        super().__init__()
        hidden_size = int(hidden_size)
        size = hidden_size if group_size is None else int(group_size)
        if hidden_size < 1 or size < 1 or hidden_size % size:
            raise ValueError(f"group_size must divide hidden_size = {hidden_size}; got {group_size}")
        self.hidden_size = hidden_size
        self.eps = eps
        self.group_size = group_size                 # None (one group) kept as given, as mamba-ssm keeps it
        self.norm_before_gate = norm_before_gate
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        if bias:
            self.bias = nn.Parameter(torch.zeros(hidden_size, device=device, dtype=dtype))
        else:
            self.register_parameter("bias", None)

    def reset_parameters(self):
        nn.init.ones_(self.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, x: torch.Tensor, z: torch.Tensor | None = None) -> torch.Tensor:
        """x (..., hidden_size), z (..., hidden_size) or None (no gate) -> (..., hidden_size) in x's dtype."""
        if x.shape[-1] != self.hidden_size:
            raise ValueError(f"x must have last dimension hidden_size = {self.hidden_size}; got shape "
                             f"{tuple(x.shape)}")
        return layernorm_fn(x, self.weight, self.bias, z=z, eps=self.eps, group_size=self.group_size,
                            norm_before_gate=self.norm_before_gate, is_rms_norm=self.is_rms_norm)

    def extra_repr(self) -> str:
        return (f"{self.hidden_size}, eps={self.eps}, group_size={self.group_size}, "
                f"norm_before_gate={self.norm_before_gate}, bias={self.bias is not None}")


def add_norm(norm: _GatedNorm, residual: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A pre-norm residual stream's step: s = residual + x, then ``norm(s)`` (no gate). Returns (s, norm(s)).

    residual, x: (..., hidden_size), one shape; s has PyTorch's promoted dtype of the two (under bf16 autocast
    the stream from the embedding is fp32 and a mixer's output bf16, so s stays fp32, as mamba-ssm's
    ``residual_in_fp32`` keeps it). When both have one dtype, on a GPU with nothing for autograd to record
    (:func:`mambalab.device.inference_kernels_apply`) the add runs inside the norm's kernel, one launch where
    there would be two (what mamba-ssm's ``fused_add_norm`` does for a decode step); elsewhere it is PyTorch's
    add, then the norm. Both round s to the dtype before normalising it, so both give the same s and norm(s).
    """
    if residual.shape != x.shape:
        raise ValueError(f"residual and x must have one shape; got {tuple(residual.shape)} and {tuple(x.shape)}")
    d = x.shape[-1]
    if (x.numel() and x.shape[-1] == norm.hidden_size and residual.dtype == x.dtype
            and device.inference_kernels_apply(x, residual, norm.weight, norm.bias)):
        rows = lambda t: t.reshape(-1, d).contiguous()
        out, s = gated_norm_fwd(rows(x), norm.weight, norm.bias, None, norm.eps, norm.group_size or d, True,
                                norm.is_rms_norm, residual=rows(residual))
        return s.reshape(x.shape), out.reshape(x.shape)
    s = residual + x
    return s, norm(s)


class GatedRMSNorm(_GatedNorm):
    """y = rmsnorm(x) ⊙ weight ⊙ silu(z) (or rmsnorm(x ⊙ silu(z)) ⊙ weight), within groups of ``group_size``.

    mamba-ssm's ``RMSNormGated`` (``layernorm_gated.RMSNorm``); also exported as :data:`RMSNormGated`.

    Args:
        hidden_size: d, the channels.
        eps: added to the mean square before the square root.
        group_size: channels per group (must divide d); None means one group of d.
        norm_before_gate: normalise, then gate (True, mamba-ssm's default); False gates first (Mamba-2 passes it).
        device, dtype: of the weight (initialised to ones).
        bias: keyword-only, mambalab's addition: also learn a bias (initialised to zeros). Without it the
            ``bias`` attribute is None, as in mamba-ssm.
    """

    is_rms_norm = True

    def __init__(self, hidden_size, eps=1e-5, group_size=None, norm_before_gate=True, device=None, dtype=None,
                 *, bias: bool = False):
        super().__init__(hidden_size, eps, group_size, norm_before_gate, device, dtype, bias=bias)


class GatedLayerNorm(_GatedNorm):
    """y = layernorm(x) ⊙ weight + bias, gated by silu(z) after (or before) normalising, within groups.

    mamba-ssm's ``layernorm_gated.LayerNorm``; also exported as :data:`LayerNormGated`. Arguments as
    :class:`GatedRMSNorm`; the bias is always there (initialised to zeros), as in mamba-ssm.
    """

    is_rms_norm = False

    def __init__(self, hidden_size, eps=1e-5, group_size=None, norm_before_gate=True, device=None, dtype=None):
        super().__init__(hidden_size, eps, group_size, norm_before_gate, device, dtype, bias=True)


RMSNormGated = GatedRMSNorm
LayerNormGated = GatedLayerNorm
