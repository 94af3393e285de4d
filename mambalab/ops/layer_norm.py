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

The forward and the backward are one Triton kernel each (:mod:`mambalab.kernels.norm`, the gated norm's kernels
with one group and no gate): each reads its inputs once and writes its outputs once. The sums over a row's N
channels (μ, the variance, c₁, c₂) are within one program; dw and db are summed by each backward program over
its ROWS_PER_PROGRAM rows (64) in row order, and the programs' partials are folded by
:func:`mambalab.kernels.reduce.sum_partials`, whose order of adds is fixed by the number of programs alone.
Nothing reads the GPU's SM count, so the forward and every gradient give the same bits on every GPU model and
every run. mamba-ssm's backward instead sums dw and db over ``sm_count`` per-program partials
(``_layer_norm_bwd``), so its weight gradients differ between GPU models.

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
from mambalab.kernels.norm import norm_bwd, norm_fwd

__all__ = ["layer_norm_fn", "rms_norm_fn"]

_UNSUPPORTED_WHY = ("mambalab's deterministic layer norm does not implement it (mamba-ssm's Mamba models call "
                    "layer_norm_fn / rms_norm_fn with dropout_p=0 and without rowscale, x1, weight1, bias1 or "
                    "return_dropout_mask)")


class LayerNormFn(torch.autograd.Function):
    """The fused add and norm with autograd on the norm kernels; inputs arrive validated and flattened to
    (M, N), unit stride along N."""

    @staticmethod
    def forward(ctx, x, weight, bias, residual, eps, prenorm, residual_in_fp32, is_rms_norm):
        N = x.shape[1]
        stream_dtype = residual.dtype if residual is not None else (torch.float32 if residual_in_fp32 else x.dtype)
        store_s = residual is not None or stream_dtype != x.dtype        # else s is x itself
        y, s, mean, rstd = norm_fwd(x, weight, bias, None, residual, eps, N, True, is_rms_norm,
                                    stream_dtype=stream_dtype if store_s else None)
        s = s if store_s else x
        ctx.save_for_backward(s, weight, bias, mean, rstd)
        ctx.x_dtype, ctx.has_residual = x.dtype, residual is not None
        ctx.prenorm, ctx.is_rms_norm = prenorm, is_rms_norm
        return (y, s) if prenorm else y

    @staticmethod
    def backward(ctx, dy, *rest):
        s, weight, bias, mean, rstd = ctx.saved_tensors
        rows = lambda t: t if t is None or t.stride(-1) == 1 else t.contiguous()
        ds = rows(rest[0]) if ctx.prenorm else None
        want_dres = ctx.has_residual and ctx.needs_input_grad[3]
        want_db = bias is not None and ctx.needs_input_grad[2]
        dx, _, dresidual, dweight, dbias = norm_bwd(
            rows(dy), ds, s, None, weight, bias, mean, rstd, s.shape[1], True, ctx.is_rms_norm,
            dx_dtype=ctx.x_dtype, dres_dtype=s.dtype if want_dres else None, want_db=want_db)
        dx = dx if ctx.needs_input_grad[0] else None
        dweight = dweight.to(weight.dtype) if ctx.needs_input_grad[1] else None
        dbias = dbias.to(bias.dtype) if want_db else None
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
    rows = lambda t: t.reshape(-1, N) if t.stride(-1) == 1 else t.reshape(-1, N).contiguous()   # (M, N)
    out = LayerNormFn.apply(rows(x), weight, bias, None if residual is None else rows(residual),
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
