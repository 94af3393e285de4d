"""Mamba-2's whole mixer after the input projection, as mamba-ssm's ``mamba_split_conv1d_scan_combined``.

mamba-ssm's ``Mamba2`` block trains through this one function by default (``use_mem_eff_path=True``), and so
does transformers' ``Mamba2Mixer`` on a GPU when the forward builds no cache (``use_cache=False``; with the
config's default ``use_cache=True`` it runs ``causal_conv1d_fn`` and ``mamba2_chunk_scan`` instead). For the
projected input zxbcdt (b, l, ·) it computes, with
d = h · p the SSD's channels, g groups of B and C of n each, and d_mlp ≥ 0 channels of a gated MLP beside
the SSD (d_mlp is what zxbcdt holds beyond the SSD's parts, halved):

    z0, x0, z, xBC, dt = split(zxbcdt)         (d_mlp), (d_mlp), (d), (d + 2 g n), (h)
    xBC      = act(causal depthwise conv1d(xBC) + conv1d_bias)     act = silu, or none for activation=None
    x, B, C  = split(xBC)                        x (b, l, h, p), B and C (b, l, g, n)
    y        = SSD(x, Δ = clamp(softplus(dt + dt_bias), *dt_limit), A, B, C) + D x       (b, l, h, p)
    y        = y ⊙ silu(z)                                    without rmsnorm_weight
             = gated RMSNorm(y, z) · rmsnorm_weight           with it: one RMS a group of d / g channels
    y        = [silu(z0) ⊙ x0, y]                             when d_mlp > 0
    out      = y W_outᵀ + b_out                               when outproj_weight is given

Here the pieces are mambalab's ops, and autograd joins them: :func:`mambalab.ops.causal_conv1d_fn` (its
weight and bias gradients summed in a fixed order; called on x, B and C apart, which gives the bits of one conv
over xBC, the conv being depthwise, and hands the SSD contiguous inputs), :func:`mambalab.ops.ssd_chunk_scan`
(deterministic reduction unless the switch says otherwise), :func:`mambalab.modules.norm.rmsnorm_fn` and
``F.linear``. So the gradients repeat bit for bit and no launcher reads the GPU's SM count, where mamba-ssm's
deterministic mode still sums dB, dC and the norm's weight gradient over SM-count-sized partials. mamba-ssm's
function also recomputes the conv's output in the backward rather than keeping it; this one keeps the
activations autograd saves (more memory, the same values).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from mambalab import validate
from mambalab.ops.conv1d import causal_conv1d_fn
from mambalab.ops.ssd import ssd_chunk_scan

__all__ = ["mamba_split_conv1d_scan_combined"]

ACTIVATIONS = (None, "silu", "swish")


def _sizes(zxbcdt, conv1d_weight, dt_bias, A, D, headdim, ngroups, rmsnorm_weight, outproj_weight, outproj_bias):
    """(d_mlp, d, h, p, n) from the arguments' shapes, each checked; ValueError naming the argument."""
    validate.tensor("zxbcdt", zxbcdt)
    if zxbcdt.dim() != 3:
        raise ValueError(f"zxbcdt must have shape (b, l, 2 d_mlp + 2 d + 2 g n + h); got {tuple(zxbcdt.shape)}")
    if not isinstance(D, torch.Tensor) or D.dim() not in (1, 2):
        raise ValueError(f"D must be a tensor of shape (h,) or (h, headdim); got "
                         f"{tuple(D.shape) if isinstance(D, torch.Tensor) else type(D).__name__}")
    if D.dim() == 1:
        if headdim is None:
            raise ValueError("headdim must be given when D has shape (h,)")
        h, p = D.shape[0], validate.positive_int("headdim", headdim)
    else:
        h, p = D.shape
    g = validate.positive_int("ngroups", ngroups)
    if h % g:
        raise ValueError(f"ngroups must divide the heads h = {h} (D's first dimension); got {g}")
    d = h * p
    if conv1d_weight.dim() != 2 or conv1d_weight.shape[0] <= d or (conv1d_weight.shape[0] - d) % (2 * g):
        raise ValueError(f"conv1d_weight must have shape (d + 2 g n, width) with d = {d}, g = {g}; got "
                         f"{tuple(conv1d_weight.shape)}")
    n = (conv1d_weight.shape[0] - d) // (2 * g)
    rest = zxbcdt.shape[-1] - 2 * d - 2 * g * n - h
    if rest < 0 or rest % 2:
        raise ValueError(f"zxbcdt's last dimension must be 2 d_mlp + 2 d + 2 g n + h = 2 d_mlp + {2 * d + 2 * g * n + h}"
                         f" (d = {d}, g = {g}, n = {n}, h = {h}); got {zxbcdt.shape[-1]}")
    validate.shape("dt_bias", dt_bias, (h,), "(h,)")
    validate.shape("A", A, (h,), "(h,)")
    if rmsnorm_weight is not None:
        validate.shape("rmsnorm_weight", rmsnorm_weight, (d,), "(d,) = (h · headdim,)")
    if outproj_weight is None and outproj_bias is not None:
        raise ValueError("outproj_bias needs outproj_weight")
    if outproj_weight is not None:
        validate.shape("outproj_weight", outproj_weight, (None, rest // 2 + d), "(out_dim, d_mlp + d)")
        if outproj_bias is not None:
            validate.shape("outproj_bias", outproj_bias, (outproj_weight.shape[0],), "(out_dim,)")
    return rest // 2, d, h, p, n


def mamba_split_conv1d_scan_combined(zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, chunk_size,
                                     initial_states=None, seq_idx=None, dt_limit=(0.0, float("inf")),
                                     return_final_states=False, activation="silu", rmsnorm_weight=None,
                                     rmsnorm_eps=1e-6, outproj_weight=None, outproj_bias=None, headdim=None,
                                     ngroups=1, norm_before_gate=True):
    """mamba-ssm's ``mamba_split_conv1d_scan_combined``: same arguments, order, defaults and results (module
    docstring for the math).

    zxbcdt: (b, l, 2 d_mlp + 2 d + 2 g n + h), d = h · headdim.   conv1d_weight: (d + 2 g n, width).
    conv1d_bias: (d + 2 g n,) or None.   dt_bias, A: (h,).   D: (h,) (then ``headdim`` is needed) or (h, headdim).
    initial_states: (b, h, headdim, n) or None.   seq_idx: (b, l) int32 or None: packed sequences; the conv
    window and the SSD state restart where it changes.   rmsnorm_weight: (d,) or None.
    outproj_weight: (out_dim, d_mlp + d), outproj_bias: (out_dim,).
    Returns out (b, l, out_dim) (or (b, l, d_mlp + d) without outproj_weight), and with
    ``return_final_states`` also the SSD's final states (b, h, headdim, n) in fp32.
    Under autocast the output projection runs in autocast's dtype, as mamba-ssm's does.
    """
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be None, 'silu' or 'swish'; got {activation!r}")
    d_mlp, d, h, p, n = _sizes(zxbcdt, conv1d_weight, dt_bias, A, D, headdim, ngroups, rmsnorm_weight,
                               outproj_weight, outproj_bias)
    g = ngroups
    conv_channels = [d, g * n, g * n]                                                    # x, B, C
    zx0, z, x, B, C, dt = zxbcdt.split([2 * d_mlp, d, *conv_channels, h], dim=-1)
    # The conv is depthwise: convolved apart, x, B and C get the bits of one conv over xBC (each channel's
    # outputs, input gradients and weight-gradient partials are its own) and come out contiguous for the SSD
    weights = conv1d_weight.split(conv_channels)
    biases = conv1d_bias.split(conv_channels) if conv1d_bias is not None else (None,) * 3
    x, B, C = (causal_conv1d_fn(t.transpose(1, 2), w, bias, seq_idx=seq_idx,
                                activation="silu" if activation else None).transpose(1, 2)
               for t, w, bias in zip((x, B, C), weights, biases))
    x = x.unflatten(-1, (h, p))                                                          # (b, l, h, p)
    B, C = B.unflatten(-1, (g, n)), C.unflatten(-1, (g, n))                              # (b, l, g, n)
    gate = z.unflatten(-1, (h, p)) if rmsnorm_weight is None else None
    y = ssd_chunk_scan(x, dt, A, B, C, chunk_size, D=D, z=gate, dt_bias=dt_bias, initial_states=initial_states,
                       seq_idx=seq_idx, dt_softplus=True, dt_limit=dt_limit, return_final_states=return_final_states)
    y, final_states = y if return_final_states else (y, None)
    y = y.flatten(-2)                                                                    # (b, l, d)
    if rmsnorm_weight is not None:
        from mambalab.modules.norm import rmsnorm_fn   # here: mambalab.modules imports mambalab.ops

        y = rmsnorm_fn(y, rmsnorm_weight, None, z=z, eps=rmsnorm_eps, group_size=d // g,
                       norm_before_gate=norm_before_gate)
    if d_mlp > 0:
        z0, x0 = zx0.chunk(2, dim=-1)
        y = torch.cat([F.silu(z0) * x0, y], dim=-1)                                      # (b, l, d_mlp + d)
    if outproj_weight is not None:
        y = F.linear(y, outproj_weight, outproj_bias)                                    # (b, l, out_dim)
    return (y, final_states) if return_final_states else y
