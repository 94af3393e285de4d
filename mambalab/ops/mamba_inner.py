"""``mamba_inner_fn``: Mamba-1's fast path after the input projection (conv, x projection, Δ projection,
selective scan, out projection), a drop-in for mamba-ssm's ``mamba_inner_fn``
(mamba_ssm/ops/selective_scan_interface.py, ``MambaInnerFn``): same arguments, defaults and results.

Composed from :func:`mambalab.ops.conv1d.causal_conv1d_fn`, ``F.linear`` and
:func:`mambalab.ops.selective_scan`, so autograd wires the backward and each part's backward is deterministic
(the conv's and the scan's sums are fixed by the shape):

    x, z    = xz split over channels                          (b, d, l) each
    x       = silu(causal conv(x))                            (b, d, l)
    x_dbl   = x W_xᵀ                                          (b·l, r + [n] + [n]): Δ's low rank r, B, C
    Δ       = W_Δ x_dbl[:, :r]ᵀ                               (b, d, l)
    B, C    = x_dbl's next n and last n columns (+ bias)      (b, 1, n, l), where the caller gives no B / C
    y       = selective_scan(x, Δ, A, B, C, D, z, delta_bias, delta_softplus)
    out     = y W_outᵀ + b_out                                (b, l, e)

``b_rms_weight``, ``c_rms_weight``, ``dt_rms_weight``: RMS-normalise B, C (over n) and Δ (over d) at each
position before the scan, as mamba-ssm's ``rms_norm_forward`` (x / sqrt(mean(x²) + eps) · weight, in fp32,
the result in x's dtype). Here the norms are differentiated like every other step; mamba-ssm's
``MambaInnerFn.backward`` passes the gradients through them unchanged and returns none for their weights.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from mambalab import validate
from mambalab.ops.conv1d import causal_conv1d_fn
from mambalab.ops.selective_scan import selective_scan

__all__ = ["mamba_inner_fn"]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """mamba-ssm's ``rms_norm_forward`` without bias over the last dim: x / sqrt(mean(x²) + eps) · weight,
    computed in fp32, returned in x's dtype; differentiable."""
    xf = x.float()
    rstd = 1 / torch.sqrt(xf.square().mean(-1, keepdim=True) + eps)
    return (xf * rstd * weight.float()).to(x.dtype)


def _check(xz, conv1d_weight, conv1d_bias, x_proj_weight, delta_proj_weight, out_proj_weight, out_proj_bias,
           A, B, C, D, delta_bias, B_proj_bias, C_proj_bias, checkpoint_lvl, b_rms_weight, c_rms_weight,
           dt_rms_weight):
    """Shapes of the projections, the conv and the per-channel vectors, checked before any computation (the
    conv and the scan check the rest: devices, a given B / C). Returns (d, r, n)."""
    if checkpoint_lvl not in (0, 1):
        raise ValueError(f"checkpoint_lvl must be 0 or 1; got {checkpoint_lvl!r}")
    validate.tensor("xz", xz)
    if xz.dim() != 3 or xz.shape[1] % 2:
        raise ValueError(f"xz must have shape (b, 2·d, l), x and z stacked over channels; got {tuple(xz.shape)}")
    b, d2, l = xz.shape
    d = d2 // 2
    if isinstance(A, torch.Tensor) and A.is_complex():
        raise TypeError("A must be real: complex A is not supported (mambalab.ops.selective_scan computes in real "
                        "arithmetic)")
    validate.tensor("A", A)
    if A.dim() != 2:
        raise ValueError(f"A must have shape (d, n) = ({d}, n); got {tuple(A.shape)}")
    n = A.shape[1]
    for name, t in (("conv1d_weight", conv1d_weight), ("x_proj_weight", x_proj_weight),
                    ("delta_proj_weight", delta_proj_weight), ("out_proj_weight", out_proj_weight)):
        validate.tensor(name, t)
    validate.shape("conv1d_weight", conv1d_weight, (d, 1, None), "(d, 1, width), nn.Conv1d's depthwise weight")
    if delta_proj_weight.dim() != 2:
        raise ValueError(f"delta_proj_weight must have shape (d, r) = ({d}, r); got {tuple(delta_proj_weight.shape)}")
    validate.shape("delta_proj_weight", delta_proj_weight, (d, None), "(d, r)")
    r = delta_proj_weight.shape[1]
    rows = r + n * ((B is None) + (C is None))
    validate.shape("x_proj_weight", x_proj_weight, (rows, d),
                   "(r + n for each of B, C not given, d)")
    if out_proj_weight.dim() != 2:
        raise ValueError(f"out_proj_weight must have shape (e, d) = (e, {d}); got {tuple(out_proj_weight.shape)}")
    validate.shape("out_proj_weight", out_proj_weight, (None, d), "(e, d)")
    if out_proj_bias is not None:
        validate.tensor("out_proj_bias", out_proj_bias)
        validate.shape("out_proj_bias", out_proj_bias, (out_proj_weight.shape[0],), "(e,)")
    for name, t, given in (("B_proj_bias", B_proj_bias, B), ("C_proj_bias", C_proj_bias, C),
                           ("b_rms_weight", b_rms_weight, B), ("c_rms_weight", c_rms_weight, C)):
        if t is None:
            continue
        if given is not None:
            raise ValueError(f"{name} applies to B / C projected from x; it must be None when {name[0].upper()} "
                             "is given")
        validate.tensor(name, t)
        validate.shape(name, t, (n,), "(n,)")
    for name, t in (("dt_rms_weight", dt_rms_weight), ("D", D), ("delta_bias", delta_bias),
                    ("conv1d_bias", conv1d_bias)):
        if t is not None:
            validate.tensor(name, t)
            validate.shape(name, t, (d,), "(d,)")
    return d, r, n


def mamba_inner_fn(xz, conv1d_weight, conv1d_bias, x_proj_weight, delta_proj_weight, out_proj_weight,
                   out_proj_bias, A, B=None, C=None, D=None, delta_bias=None, B_proj_bias=None, C_proj_bias=None,
                   delta_softplus=True, checkpoint_lvl=1, b_rms_weight=None, c_rms_weight=None,
                   dt_rms_weight=None, b_c_dt_rms_eps=1e-6):
    """Mamba-1's conv → projections → selective scan → out projection (module docstring); mamba-ssm's
    ``mamba_inner_fn`` signature and results.

    Args:
        xz: (b, 2·d, l), the input projection's output: x then the gate z, over channels.
        conv1d_weight: (d, 1, width), nn.Conv1d's depthwise weight; conv1d_bias: (d,) or None.
        x_proj_weight: (r + n·[B is None] + n·[C is None], d).  delta_proj_weight: (d, r).
        out_proj_weight: (e, d); out_proj_bias: (e,) or None.
        A: (d, n), real.  B, C: None (projected from x, (b, 1, n, l)) or as :func:`selective_scan` takes them.
        D, delta_bias: optional (d,).  B_proj_bias, C_proj_bias: optional (n,), added to projected B / C.
        delta_softplus: softplus on Δ + delta_bias in the scan.
        checkpoint_lvl: 0 or 1, as mamba-ssm's (which of its own tensors it recomputes in the backward); the
            results do not depend on it here (autograd keeps what each step needs).
        b_rms_weight, c_rms_weight: optional (n,); dt_rms_weight: optional (d,); b_c_dt_rms_eps: their eps.

    Returns:
        out (b, l, e). Gradients flow to every tensor argument, the rms weights included.

    Raises:
        ValueError / TypeError naming the argument before any computation: shapes that do not fit together,
        checkpoint_lvl outside {0, 1}, a complex A (mamba-ssm's complex path is not supported), a projection
        bias or rms weight for a B / C the caller gives; the conv's and the scan's own checks.
    """
    d, r, n = _check(xz, conv1d_weight, conv1d_bias, x_proj_weight, delta_proj_weight, out_proj_weight,
                     out_proj_bias, A, B, C, D, delta_bias, B_proj_bias, C_proj_bias, checkpoint_lvl, b_rms_weight,
                     c_rms_weight, dt_rms_weight)
    b, _, l = xz.shape
    x, z = xz.chunk(2, dim=1)                                                # (b, d, l) each
    x = causal_conv1d_fn(x, conv1d_weight[:, 0], conv1d_bias, activation="silu")
    x_dbl = F.linear(x.transpose(1, 2).reshape(b * l, d), x_proj_weight)   # (b·l, r + …)
    delta = (delta_proj_weight @ x_dbl[:, :r].t()).view(d, b, l).transpose(0, 1)   # (b, d, l)
    if dt_rms_weight is not None:   # over d at each position
        delta = rms_norm(delta.transpose(1, 2), dt_rms_weight, b_c_dt_rms_eps).transpose(1, 2)

    def projected(cols, bias, rms_weight):
        v = cols if bias is None else cols + bias.to(cols.dtype)             # (b·l, n)
        if rms_weight is not None:
            v = rms_norm(v, rms_weight, b_c_dt_rms_eps)
        return v.view(b, l, n).permute(0, 2, 1).unsqueeze(1)                 # (b, 1, n, l)

    if B is None:
        B = projected(x_dbl[:, r:r + n], B_proj_bias, b_rms_weight)
    if C is None:
        C = projected(x_dbl[:, -n:], C_proj_bias, c_rms_weight)
    y = selective_scan(x, delta, A, B, C, D, z=z, delta_bias=delta_bias, delta_softplus=delta_softplus)
    return F.linear(y.transpose(1, 2), out_proj_weight, out_proj_bias)     # (b, l, e)
