"""``selective_scan``: Mamba-1's selective scan on Triton kernels, a drop-in for mamba-ssm's
``selective_scan_fn`` (same arguments, shapes and results).

The backward is deterministic by construction (no atomic adds; partials reduced in a fixed order), so its
gradients are bitwise reproducible run to run and do not depend on the GPU's SM count.
"""
from __future__ import annotations

import torch

from mambalab import device as _device
from mambalab import validate
from mambalab.kernels import selective_scan as _kernels


def _check(u, delta, A, B, C, D, z, delta_bias):
    """Validate at the boundary. Raises TypeError/ValueError naming the argument; returns the check that delta
    is finite, queued on its device (:class:`mambalab.validate.Finite`: the caller waits for it just before
    the kernels launch)."""
    for name, x in (("u", u), ("delta", delta), ("A", A), ("B", B), ("C", C)):
        validate.tensor(name, x)
    for name, x in (("D", D), ("z", z), ("delta_bias", delta_bias)):
        if x is not None:
            validate.tensor(name, x)
    if u.dim() != 3:
        raise ValueError(f"u must have shape (b, d, l); got {tuple(u.shape)}")
    b, d, l = u.shape
    validate.shape("delta", delta, (b, d, l), "(b, d, l), like u")
    if A.dim() != 2 or A.shape[0] != d:
        raise ValueError(f"A must have shape (d, n) = ({d}, n), real; got {tuple(A.shape)}")
    n = A.shape[1]
    if B.dim() not in (3, 4):
        raise ValueError(f"B must have shape (b, n, l) = ({b}, {n}, {l}) or grouped (b, g, n, l); "
                         f"got {tuple(B.shape)}")
    g = B.shape[1] if B.dim() == 4 else 1
    meaning = "(b, n, l)" if B.dim() == 3 else "(b, g, n, l)"
    expected = (b, n, l) if B.dim() == 3 else (b, g, n, l)
    validate.shape("B", B, expected, meaning)
    validate.shape("C", C, expected, meaning + ", like B")
    if d % g:
        raise ValueError(f"the number of groups g = {g} (B.shape[1]) must divide the channels d = {d}")
    if D is not None:
        validate.shape("D", D, (d,), "(d,)")
    if delta_bias is not None:
        validate.shape("delta_bias", delta_bias, (d,), "(d,)")
    if z is not None:
        validate.shape("z", z, (b, d, l), "(b, d, l), like u")
    dev = validate.same_device(u=u, delta=delta, A=A, B=B, C=C, D=D, z=z, delta_bias=delta_bias)
    _device.ensure_kernel_device(dev)
    return validate.Finite("delta", delta)


class SelectiveScanFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, u, delta, A, B, C, D, z, delta_bias, delta_softplus, return_last_state, delta_finite):
        squeeze_group = B.dim() == 3
        dtype_out = u.dtype
        work = _device.compute_dtype(u.dtype, u.device)
        # Kernels read contiguous (b, d, l) / (b, g, n, l) rows; on the CPU interpreter they get fp32.
        prep = lambda x: None if x is None else x.to(work if x.dtype != torch.float32 else x.dtype).contiguous()
        u_, delta_, z_ = prep(u), prep(delta), prep(z)
        B_ = prep(B.unsqueeze(1) if squeeze_group else B)
        C_ = prep(C.unsqueeze(1) if squeeze_group else C)
        A_, D_, bias_ = A.float().contiguous(), prep(D), prep(delta_bias)
        needs_grad = any(ctx.needs_input_grad[:8])
        delta_finite.check()   # the last moment before the launch: the wait exposes only the launch itself
        out, last_state, saved, cfg = _kernels.selective_scan_fwd(
            u_, delta_, A_, B_, C_, D_, z_, bias_, delta_softplus, save_states=needs_grad)
        ctx.save_for_backward(u_, delta_, A_, B_, C_, D_, z_, bias_, *(saved or (None, None)))
        ctx.cfg, ctx.softplus, ctx.squeeze_group = cfg, delta_softplus, squeeze_group
        ctx.dtypes = [x.dtype if x is not None else None for x in (u, delta, A, B, C, D, z, delta_bias)]
        ctx.mark_non_differentiable(last_state)
        out = out.to(dtype_out)
        return out, last_state

    @staticmethod
    def backward(ctx, dout, _dlast_state):
        u_, delta_, A_, B_, C_, D_, z_, bias_, states, y = ctx.saved_tensors
        dout = dout.to(u_.dtype).contiguous()
        grads = _kernels.selective_scan_bwd(dout, u_, delta_, A_, B_, C_, D_, z_, bias_, ctx.softplus,
                                            _kernels.Saved(states, y), ctx.cfg)
        du, ddelta, dA, dB, dC, dD, dz, dbias = grads
        if ctx.squeeze_group:
            dB, dC = dB.squeeze(1), dC.squeeze(1)
        ordered = [du, ddelta, dA, dB, dC, dD, dz, dbias]
        ordered = [None if gr is None else gr.to(dt) for gr, dt in zip(ordered, ctx.dtypes)]
        return (*ordered, None, None, None)


def selective_scan(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                   return_last_state=False):
    """Mamba-1's selective scan; same signature and semantics as mamba-ssm's ``selective_scan_fn``.

    h_t = exp(Δ_t A) ⊙ h_{t-1} + Δ_t u_t B_t,   y_t = C_t · h_t + D u_t,   out_t = y_t · silu(z_t),
    with Δ = softplus(delta + delta_bias) when ``delta_softplus`` (else delta + delta_bias).

    Args:
        u: (b, d, l) input, fp32/fp16/bf16.
        delta: (b, d, l) step sizes (before bias and softplus).
        A: (d, n) real state matrix (diagonal per channel), usually negative.
        B, C: (b, n, l), or grouped (b, g, n, l) with g dividing d.
        D: optional (d,) skip connection.  z: optional (b, d, l) gate.  delta_bias: optional (d,).
        delta_softplus: apply softplus to delta + delta_bias.
        return_last_state: also return the final state (b, d, n), fp32.

    Returns:
        out (b, d, l) in u's dtype, or (out, last_state). Gradients flow to every tensor argument.
    """
    delta_finite = _check(u, delta, A, B, C, D, z, delta_bias)
    out, last_state = SelectiveScanFn.apply(u, delta, A, B, C, D, z, delta_bias, bool(delta_softplus),
                                            bool(return_last_state), delta_finite)
    return (out, last_state) if return_last_state else out
