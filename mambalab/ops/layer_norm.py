"""``layer_norm_fn`` and ``rms_norm_fn``: the residual add fused with a LayerNorm or RMSNorm, with autograd whose
backward gives the same bits on every GPU; drop-ins for the functions of those names in mamba-ssm
(mamba_ssm/ops/triton/layer_norm.py), which mamba-ssm's ``Block`` and ``MixerModel`` call between layers.

Per row of N channels (x viewed as (M, N), M the product of the leading dimensions):

    s   = x + residual                    (s = x without a residual)
    μ   = Σ_j s_j / N                     (μ = 0 for RMSNorm)
    σ⁻¹ = 1 / sqrt(Σ_j (s_j - μ)² / N + eps)
    ŝ   = (s - μ) · σ⁻¹
    y   = ŝ ⊙ w + b                       (b = 0 without a bias)

The sum s is formed and normalised in fp32 and stored in the residual stream's dtype: residual's, else fp32 if
``residual_in_fp32``, else x's (then the stored s is x itself, as in mamba-ssm). y is returned in x's dtype;
``prenorm=True`` returns (y, s), s being the next layer's residual.

Backward, per row in fp32, with ŝ recomputed from the stored s (as mamba-ssm's backward does) and g = w ⊙ dy:

    c₁ = Σ_j ŝ_j g_j / N,   c₂ = Σ_j g_j / N             (c₂ = 0 for RMSNorm)
    ds = (g - (ŝ c₁ + c₂)) · σ⁻¹  (+ ds from the returned s, with prenorm)
    dx = ds in x's dtype,   dresidual = ds in residual's dtype
    dw = Σ_rows dy ⊙ ŝ,     db = Σ_rows dy

Every sum (μ, the variance, c₁, c₂ over the N channels; dw, db over the M rows) is
:func:`mambalab.kernels.reduce.sum_partials`, whose order of adds is fixed by the shape alone; everything else
is element-wise PyTorch. Nothing reads the GPU's SM count, so the forward and every gradient give the same
bits on every GPU model and every run. mamba-ssm's backward instead sums dw and db over ``sm_count``
per-program partials (``_layer_norm_bwd``), so its weight gradients differ between GPU models.

Shapes and dtypes:
    x          (..., N)   fp32 / fp16 / bf16
    weight     (N,)       any of those (may differ from x's)
    bias       (N,) or None
    residual   (..., N) as x, or None
    y          (..., N) in x's dtype;  s (..., N) in the residual stream's dtype

Not implemented (refused with a ValueError before any computation): ``dropout_p`` other than 0, ``rowscale``,
the parallel second input and norm (``x1``, ``weight1``, ``bias1``) and ``return_dropout_mask=True``. Dropout's
random mask and the parallel norm are not part of this deterministic path; mamba-ssm's Mamba models call
these functions with dropout 0 and none of the others.
"""
from __future__ import annotations

import math
import numbers

import torch

from mambalab import device as _device
from mambalab import validate
from mambalab.kernels.reduce import sum_partials

__all__ = ["layer_norm_fn", "rms_norm_fn"]

_UNSUPPORTED_WHY = ("mambalab's deterministic layer norm does not implement it (mamba-ssm's Mamba models call "
                    "layer_norm_fn / rms_norm_fn with dropout_p=0 and without rowscale, x1, weight1, bias1 or "
                    "return_dropout_mask)")


def _row_sums(t: torch.Tensor) -> torch.Tensor:
    """Σ_j t[i, j] over the N columns of t (M, N) fp32, (M,), in sum_partials' order (fixed by N)."""
    return sum_partials(t.t(), dim=0)   # (N, M): N partials of M numbers each


def _column_sums(t: torch.Tensor) -> torch.Tensor:
    """Σ_i t[i, j] over the M rows of t (M, N) fp32, (N,), in sum_partials' order (fixed by M)."""
    return sum_partials(t, dim=0)


class LayerNormFn(torch.autograd.Function):
    """The fused add and norm with autograd, in fp32; inputs arrive validated and flattened to (M, N)."""

    @staticmethod
    def forward(ctx, x, weight, bias, residual, eps, prenorm, residual_in_fp32, is_rms_norm):
        M, N = x.shape
        s32 = x.float() if residual is None else x.float() + residual.float()       # (M, N) fp32
        stream_dtype = residual.dtype if residual is not None else (torch.float32 if residual_in_fp32 else x.dtype)
        s = x if residual is None and stream_dtype == x.dtype else s32.to(stream_dtype)
        if is_rms_norm:
            mean, centred = None, s32
        else:
            mean = _row_sums(s32) / N                                              # (M,)
            centred = s32 - mean[:, None]
        rstd = 1.0 / torch.sqrt(_row_sums(centred * centred) / N + eps)              # (M,)
        y = centred * rstd[:, None] * weight.float()
        if bias is not None:
            y = y + bias.float()
        ctx.save_for_backward(s, weight, bias, mean, rstd)
        ctx.x_dtype, ctx.has_residual, ctx.prenorm = x.dtype, residual is not None, prenorm
        y = y.to(x.dtype)
        return (y, s) if prenorm else y

    @staticmethod
    def backward(ctx, dy, *rest):
        s, weight, bias, mean, rstd = ctx.saved_tensors
        M, N = s.shape
        s32 = s.float()
        shat = (s32 if mean is None else s32 - mean[:, None]) * rstd[:, None]      # (M, N)
        dy = dy.float()
        g = weight.float() * dy
        if mean is None:
            c1 = _row_sums(shat * g) / N
            ds = (g - shat * c1[:, None]) * rstd[:, None]
        else:
            c1, c2 = (_row_sums(torch.cat([shat * g, g])) / N).split(M)          # one pass for both sums
            ds = (g - (shat * c1[:, None] + c2[:, None])) * rstd[:, None]
        if ctx.prenorm:
            ds = ds + rest[0].float()
        dx = ds.to(ctx.x_dtype) if ctx.needs_input_grad[0] else None
        dresidual = ds.to(s.dtype) if ctx.has_residual and ctx.needs_input_grad[3] else None
        dweight = dbias = None
        want_db = bias is not None and ctx.needs_input_grad[2]
        if ctx.needs_input_grad[1] and want_db:
            sums = _column_sums(torch.cat([dy * shat, dy], dim=1))                 # (2N,): dw then db
            dweight, dbias = sums[:N].to(weight.dtype), sums[N:].to(bias.dtype)
        elif ctx.needs_input_grad[1]:
            dweight = _column_sums(dy * shat).to(weight.dtype)
        elif want_db:
            dbias = _column_sums(dy).to(bias.dtype)
        return dx, dweight, dbias, dresidual, None, None, None, None


def _check(x, weight, bias, residual, x1, weight1, bias1, eps, dropout_p, rowscale, return_dropout_mask):
    """Refuse what is not implemented, then validate; all before any computation. Errors name the argument."""
    for name, value in (("x1", x1), ("weight1", weight1), ("bias1", bias1), ("rowscale", rowscale)):
        if value is not None:
            raise ValueError(f"{name} must be None: {_UNSUPPORTED_WHY}")
    if not isinstance(dropout_p, numbers.Real) or dropout_p != 0:
        raise ValueError(f"dropout_p must be 0; got {dropout_p!r}: {_UNSUPPORTED_WHY}")
    if return_dropout_mask:
        raise ValueError(f"return_dropout_mask must be False: {_UNSUPPORTED_WHY}")
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not math.isfinite(eps) or eps < 0:
        raise ValueError(f"eps must be a finite number >= 0; got {eps!r}")
    validate.tensor("x", x)
    validate.tensor("weight", weight)
    if x.dim() < 1 or x.shape[-1] == 0:
        raise ValueError(f"x must have shape (..., N) with N >= 1; got {tuple(x.shape)}")
    N = x.shape[-1]
    validate.shape("weight", weight, (N,), "(N,)")
    if bias is not None:
        validate.tensor("bias", bias)
        validate.shape("bias", bias, (N,), "(N,)")
    if residual is not None:
        validate.tensor("residual", residual)
        validate.shape("residual", residual, tuple(x.shape), "x's shape (..., N)")
    dev = validate.same_device(x=x, weight=weight, bias=bias, residual=residual)
    _device.ensure_kernel_device(dev)


def layer_norm_fn(x, weight, bias, residual=None, x1=None, weight1=None, bias1=None, eps=1e-6, dropout_p=0.0,
                  rowscale=None, prenorm=False, residual_in_fp32=False, is_rms_norm=False,
                  return_dropout_mask=False):
    """LayerNorm (RMSNorm with ``is_rms_norm``) of s = x + residual (module docstring); mamba-ssm's signature.

    Args:
        x: (..., N), fp32/fp16/bf16.
        weight: (N,).  bias: (N,) or None.
        residual: (..., N) like x, or None.
        x1, weight1, bias1, rowscale: must be None (not implemented).
        eps: added to the variance.
        dropout_p: must be 0 (not implemented).
        prenorm: also return s, the residual stream's next value.
        residual_in_fp32: without a residual, keep s in fp32 (with one, s takes residual's dtype).
        is_rms_norm: RMSNorm (no mean subtracted) instead of LayerNorm.
        return_dropout_mask: must be False (not implemented).

    Returns:
        y (..., N) in x's dtype, or (y, s) with ``prenorm``. Gradients flow to x, weight, bias and residual, and
        through s; their bits do not depend on the GPU model.

    Raises (before any computation), naming the argument: ValueError for the unimplemented arguments above,
    wrong shapes, mixed devices or a negative eps; TypeError for dtypes other than fp32/fp16/bf16.
    """
    _check(x, weight, bias, residual, x1, weight1, bias1, eps, dropout_p, rowscale, return_dropout_mask)
    shape, N = x.shape, x.shape[-1]
    out = LayerNormFn.apply(x.reshape(-1, N), weight, bias, None if residual is None else residual.reshape(-1, N),
                            float(eps), bool(prenorm), bool(residual_in_fp32), bool(is_rms_norm))
    if prenorm:
        return out[0].reshape(shape), out[1].reshape(shape)
    return out.reshape(shape)


def rms_norm_fn(x, weight, bias, residual=None, x1=None, weight1=None, bias1=None, eps=1e-6, dropout_p=0.0,
                rowscale=None, prenorm=False, residual_in_fp32=False, return_dropout_mask=False):
    """:func:`layer_norm_fn` with ``is_rms_norm=True``: y = s / sqrt(mean(s²) + eps) ⊙ w + b; mamba-ssm's
    signature."""
    return layer_norm_fn(x, weight, bias, residual, x1, weight1, bias1, eps, dropout_p, rowscale, prenorm,
                         residual_in_fp32, True, return_dropout_mask)
