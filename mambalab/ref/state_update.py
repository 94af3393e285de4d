"""The decode step of a diagonal SSM (Mamba-1's and Mamba-2's), in PyTorch: the reference that
:mod:`mambalab.kernels.state_update` is checked against, with mamba-ssm's ``selective_state_update`` arguments.

    Δ        = clamp(softplus?(dt + dt_bias), *dt_limit)
    S[i, j]  ← exp(Δ[i] A[i, j]) S[i, j] + Δ[i] x[i] B[j]
    out[i]   = Σ_j S[i, j] C[j] + D[i] x[i],   then ⊙ silu(z[i]) when z is given

Shapes (with heads; mamba-ssm's forms without the head axis are the same with h = 1 squeezed out):
state (b, h, dim, n); x, dt, z (b, h, dim); A (h, dim, n); B, C (b, g, n), g dividing h; D, dt_bias (h, dim).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def selective_state_update_ref(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False,
                               dt_limit=None):
    """One token: ``state`` updated in place (math in fp32, stored in its dtype); returns out in x's dtype,
    (b, h, dim) or, for a 3-d state (b, dim, n), (b, dim)."""
    heads = state.dim() == 4
    if not heads:   # mamba-ssm's forms without heads: one head
        state, x, dt, A, B, C = state[:, None], x[:, None], dt[:, None], A[None], B[:, None], C[:, None]
        D = D[None] if D is not None else None
        z = z[:, None] if z is not None else None
        dt_bias = dt_bias[None] if dt_bias is not None else None
    h, g = x.shape[1], B.shape[1]
    dt = dt.float() + (dt_bias.float() if dt_bias is not None else 0.0)           # (b, h, dim)
    if dt_softplus:
        dt = F.softplus(dt)
    if dt_limit is not None:
        dt = dt.clamp(*dt_limit)
    B_h = B.float().repeat_interleave(h // g, dim=1)                             # (b, h, n)
    C_h = C.float().repeat_interleave(h // g, dim=1)
    x32 = x.float()
    new = torch.exp(dt[..., None] * A.float()) * state.float() + (dt * x32)[..., None] * B_h[:, :, None]
    state.copy_(new)
    out = (new * C_h[:, :, None]).sum(-1)                                        # (b, h, dim)
    if D is not None:
        out = out + D.float() * x32
    if z is not None:
        out = out * F.silu(z.float())
    out = out.to(x.dtype)
    return out if heads else out[:, 0]
