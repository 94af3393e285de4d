"""The gated RMS/Layer norm's forward as one Triton kernel: for inference (a decode step runs two norms a layer,
each a handful of PyTorch kernels otherwise). Training keeps :func:`mambalab.modules.norm.layernorm_fn`'s
PyTorch form, whose autograd backward is deterministic; this kernel has no backward.

Math (per row and group of ``group_size`` channels; :mod:`mambalab.modules.norm` states it in full, and its
PyTorch :func:`~mambalab.modules.norm.layernorm_fn` is the reference this kernel is checked against):

    v = x ⊙ silu(z) if z is given and not norm_before_gate, else x
    y = (v - mean(v)?) / sqrt(mean((v - mean(v)?)²) + eps) ⊙ w + b,  then ⊙ silu(z) if norm_before_gate
                                                                      (the mean subtracted in LayerNorm mode)

With a residual r (the pre-norm residual stream of a language model): s = r + x is formed first, rounded to x's
dtype and written out (the stream's next value, what ``r + x`` in PyTorch stores), and the norm reads s: one
kernel where a decode step would launch an add and then the norm (mamba-ssm's ``fused_add_norm`` does the same).

Tile rule: one program per (row, group), the group whole (BLOCK = next_pow2(group_size)), 4 warps up to 4,096
channels, 8 beyond. Shapes: x, z, r, out, s (M, d) with unit stride along d; w, b (d,). Sums in fp32.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def gated_norm_fwd_kernel(
    x_ptr, z_ptr, w_ptr, b_ptr, out_ptr,
    res_ptr, res_out_ptr,   # (M, d) the residual r and the sum s = r + x written out (HAS_RESIDUAL), or dummies
    group_size, x_row, z_row, o_row, r_row, eps,
    HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, NORM_BEFORE_GATE: tl.constexpr, IS_RMS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * group_size + tl.arange(0, BLOCK)       # this group's channels
    mask = tl.arange(0, BLOCK) < group_size
    v = tl.load(x_ptr + row * x_row + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:   # s = r + x, rounded to the stream's dtype as PyTorch's add rounds it, then normed
        s = (v + tl.load(res_ptr + row * r_row + offs, mask=mask, other=0.0).to(tl.float32))
        s = s.to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * r_row + offs, s, mask=mask)
        v = s.to(tl.float32)
    if HAS_Z:
        z = tl.load(z_ptr + row * z_row + offs, mask=mask, other=0.0).to(tl.float32)
        gate = z * tl.sigmoid(z)
        if not NORM_BEFORE_GATE:
            v = v * gate
    if not IS_RMS:
        v = tl.where(mask, v - tl.sum(v, axis=0) / group_size, 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(v * v, axis=0) / group_size + eps)
    y = v * rstd * tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        y += tl.load(b_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_Z and NORM_BEFORE_GATE:
        y = y * gate
    tl.store(out_ptr + row * o_row + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def gated_norm_fwd(x, weight, bias, z, eps: float, group_size: int, norm_before_gate: bool, is_rms_norm: bool,
                   residual=None):
    """Launch :func:`gated_norm_fwd_kernel` on x (M, d) (and z (M, d) or None), unit stride along d (checked by
    the caller with the rest); returns out (M, d) in x's dtype. With ``residual`` (M, d) contiguous, of x's
    dtype: the norm of s = residual + x, and returns (out, s)."""
    M, d = x.shape
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    res_out = torch.empty_like(residual) if residual is not None else None
    block = triton.next_power_of_2(group_size)
    gated_norm_fwd_kernel[(M, d // group_size)](
        x, z if z is not None else x, weight, bias if bias is not None else weight, out,
        residual if residual is not None else x, res_out if residual is not None else out,
        group_size, x.stride(0), z.stride(0) if z is not None else 0, out.stride(0),
        residual.stride(0) if residual is not None else 0, float(eps),
        HAS_Z=z is not None, HAS_BIAS=bias is not None, NORM_BEFORE_GATE=bool(norm_before_gate),
        IS_RMS=bool(is_rms_norm), HAS_RESIDUAL=residual is not None, BLOCK=block,
        num_warps=4 if block <= 4096 else 8,
    )
    return out if residual is None else (out, res_out)
