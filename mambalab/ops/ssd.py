"""``ssd_chunk_scan_forward``: Mamba-2's SSD (chunked scan) on Triton kernels, forward only for now.

Same arguments, shapes and results as mamba-ssm's ``mamba_chunk_scan_combined`` (without ``seq_idx``,
``cu_seqlens`` and the varlen outputs). The backward is not written yet: called on inputs that require grad
while autograd is recording, it raises NotImplementedError rather than returning outputs without a graph.
Use :func:`mambalab.ref.ssd.ssd_ref` where gradients are needed.
"""
from __future__ import annotations

import math

import torch

from mambalab import device as _device
from mambalab import validate
from mambalab.kernels import ssd as _kernels

MIN_CHUNK_SIZE = 16  # tl.dot wants blocks of at least 16


def _check(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, dt_limit):
    """Validate at the boundary; returns (b, l, h, p, g, n). Raises TypeError/ValueError naming the argument."""
    for name, t in (("x", x), ("dt", dt), ("A", A), ("B", B), ("C", C)):
        validate.tensor(name, t)
    for name, t in (("D", D), ("z", z), ("dt_bias", dt_bias), ("initial_states", initial_states)):
        if t is not None:
            validate.tensor(name, t)
    if x.dim() != 4:
        raise ValueError(f"x must have shape (b, l, h, p); got {tuple(x.shape)}")
    b, l, h, p = x.shape
    validate.shape("dt", dt, (b, l, h), "(b, l, h), like x's first three")
    validate.shape("A", A, (h,), "(h,)")
    if B.dim() != 4:
        raise ValueError(f"B must have shape (b, l, g, n) = ({b}, {l}, g, n); got {tuple(B.shape)}")
    g, n = B.shape[2], B.shape[3]
    validate.shape("B", B, (b, l, g, n), "(b, l, g, n)")
    validate.shape("C", C, (b, l, g, n), "(b, l, g, n), like B")
    if g == 0 or h % g:
        raise ValueError(f"the number of groups g = {g} (B.shape[2]) must divide the heads h = {h} (x.shape[2])")
    if D is not None and D.dim() == 2:
        validate.shape("D", D, (h, p), "(h, p)")
    elif D is not None:
        validate.shape("D", D, (h,), "(h,) or (h, p)")
    if z is not None:
        validate.shape("z", z, (b, l, h, p), "(b, l, h, p), like x")
    if dt_bias is not None:
        validate.shape("dt_bias", dt_bias, (h,), "(h,)")
    if initial_states is not None:
        validate.shape("initial_states", initial_states, (b, h, p, n), "(b, h, p, n)")
    validate.positive_int("chunk_size", chunk_size, power_of_two=True)
    if chunk_size < MIN_CHUNK_SIZE:
        raise ValueError(f"chunk_size must be at least {MIN_CHUNK_SIZE} (the kernels' dot products); "
                         f"got {chunk_size}")
    try:
        lo, hi = (float(v) for v in dt_limit)
    except (TypeError, ValueError):
        raise ValueError(f"dt_limit must be a pair of numbers (min, max); got {dt_limit!r}") from None
    if math.isnan(lo) or math.isnan(hi) or lo > hi:
        raise ValueError(f"dt_limit must be (min, max) with min <= max; got {dt_limit!r}")
    dev = validate.same_device(x=x, dt=dt, A=A, B=B, C=C, D=D, z=z, dt_bias=dt_bias,
                               initial_states=initial_states)
    validate.finite("dt", dt)
    _device.ensure_kernel_device(dev)
    return b, l, h, p, g, n


def ssd_chunk_scan_forward(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None,
                           dt_softplus=False, dt_limit=(0.0, float("inf")), return_final_states=False):
    """Mamba-2's SSD, forward only; the arguments and results of mamba-ssm's ``mamba_chunk_scan_combined``.

    Per head, with Δ_t = clamp(softplus(dt_t + dt_bias), *dt_limit) (softplus only with ``dt_softplus``):

        s_t = exp(Δ_t A) s_{t-1} + Δ_t x_t B_tᵀ,    y_t = s_t C_t + D x_t,    out_t = y_t ⊙ silu(z_t)

    computed by the chunked SSD algorithm (see :mod:`mambalab.kernels.ssd`).

    Args:
        x: (b, l, h, p) inputs, fp32/fp16/bf16.  dt: (b, l, h) step sizes before bias/softplus (no NaN).
        A: (h,) decay rates (negative).  B, C: (b, l, g, n), g dividing h (head i reads group i // (h // g)).
        chunk_size: q, a power of two >= 16; any l works (the last chunk is padded inside).
        D: optional (h,) or (h, p) skip.  z: optional (b, l, h, p) gate.  dt_bias: optional (h,).
        initial_states: optional (b, h, p, n) state before the first step.
        dt_softplus: apply softplus to dt + dt_bias.  dt_limit: (min, max) clamp of Δ.
        return_final_states: also return the state after the last step, (b, h, p, n) fp32.

    Returns:
        out (b, l, h, p) in x's dtype, or (out, final_states).

    Raises:
        NotImplementedError: if an input requires grad while autograd is recording (no backward yet).
    """
    _check(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, dt_limit)
    tensors = (x, dt, A, B, C, D, z, dt_bias, initial_states)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        raise NotImplementedError(
            "the SSD backward is not implemented yet: ssd_chunk_scan_forward is forward only. Call it under "
            "torch.no_grad() (or on tensors that do not require grad), or use mambalab.ref.ssd.ssd_ref for "
            "gradients.")

    def prep(t):  # contiguous rows; on the CPU interpreter, fp32 (its bf16/fp16 arithmetic is wrong)
        if t is None:
            return None
        return (t if t.dtype == torch.float32 else t.to(_device.compute_dtype(t.dtype, t.device))).contiguous()

    x_, z_ = prep(x), prep(z)
    B_, C_ = B.to(x_.dtype).contiguous(), C.to(x_.dtype).contiguous()   # the dot products read them in x's dtype
    dt_, D_, bias_ = prep(dt), prep(D), prep(dt_bias)
    A_ = A.float().contiguous()
    init_ = initial_states.float().contiguous() if initial_states is not None else None
    res = _kernels.ssd_chunk_scan_fwd(x_, dt_, A_, B_, C_, chunk_size, D_, z_, bias_, init_,
                                      bool(dt_softplus), tuple(float(v) for v in dt_limit))
    out = res.out if res.out.dtype == x.dtype else res.out.to(x.dtype)
    return (out, res.final_states) if return_final_states else out
