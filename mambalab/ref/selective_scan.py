"""The Mamba-1 selective scan, as a plain sequential loop.

Continuous system, per channel d and state index n:  h'(t) = A h(t) + B(t) u(t),  y(t) = C(t) h(t).
Mamba makes Δ, B and C functions of the input ("selective") and discretises with step Δ_t:

    Ā_t = exp(Δ_t A)              zero-order hold for A
    B̄_t u_t = Δ_t B_t u_t          the simplified (Euler) step Mamba uses for B
    h_t = Ā_t ⊙ h_{t-1} + B̄_t u_t
    y_t = C_t · h_t  (+ D u_t)   then, optionally, y_t ⊙ silu(z_t)

Shapes (mamba-ssm's layout, channels first):
    u, delta, z : (b, d, l)
    A           : (d, n), real
    B, C        : (b, n, l), or grouped (b, g, n, l) with g dividing d (channel c uses group c // (d // g))
    D, delta_bias : (d,)
    out         : (b, d, l) in u's dtype; last_state (b, d, n) in fp32
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def _per_channel(M: torch.Tensor, d: int) -> torch.Tensor:
    """(b, n, l) or (b, g, n, l) -> (b, d, n, l): the B or C row each channel reads."""
    if M.dim() == 3:
        return M.unsqueeze(1).expand(-1, d, -1, -1)
    g = M.shape[1]
    return M.repeat_interleave(d // g, dim=1)


def discretize(delta: torch.Tensor, A: torch.Tensor, B: torch.Tensor, u: torch.Tensor):
    """Ā = exp(Δ A) and B̄u = Δ B u for every (b, d, n, l).

    delta, u: (b, d, l); A: (d, n); B: (b, d, n, l) -> both (b, d, n, l).
    """
    A_bar = torch.exp(delta.unsqueeze(2) * A[None, :, :, None])  # (b, d, n, l)
    Bu_bar = (delta * u).unsqueeze(2) * B                         # (b, d, n, l)
    return A_bar, Bu_bar


def selective_scan_ref(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                       return_last_state=False):
    """The selective scan, one time step after another (O(l) sequential steps). Computes in fp32.

    Same arguments and results as ``mamba_ssm.ops.selective_scan_interface.selective_scan_ref``
    (see the module docstring for the shapes).
    """
    dtype_in = u.dtype
    b, d, l = u.shape
    u, delta = u.float(), delta.float()
    if delta_bias is not None:
        delta = delta + delta_bias.float()[:, None]
    if delta_softplus:
        delta = F.softplus(delta)
    A = A.float()
    B = _per_channel(B.float(), d)  # (b, d, n, l)
    C = _per_channel(C.float(), d)  # (b, d, n, l)
    A_bar, Bu_bar = discretize(delta, A, B, u)

    h = u.new_zeros(b, d, A.shape[1])  # (b, d, n): the state
    ys = []
    for t in range(l):
        h = A_bar[..., t] * h + Bu_bar[..., t]   # (b, d, n)
        ys.append((h * C[..., t]).sum(-1))        # (b, d)
    y = torch.stack(ys, dim=-1)                   # (b, d, l)
    if D is not None:
        y = y + u * D.float()[:, None]
    if z is not None:
        y = y * F.silu(z.float())
    out = y.to(dtype_in)
    return (out, h) if return_last_state else out


def selective_scan_step(h, u_t, delta_t, A, B_t, C_t, D=None):
    """One recurrent step, as used when decoding token by token.

    h: (b, d, n) fp32; u_t, delta_t: (b, d); A: (d, n); B_t, C_t: (b, n) -> (new h, y_t (b, d)).
    """
    A_bar = torch.exp(delta_t.unsqueeze(-1) * A)                      # (b, d, n)
    h = A_bar * h + (delta_t * u_t).unsqueeze(-1) * B_t.unsqueeze(1)  # (b, d, n)
    y = (h * C_t.unsqueeze(1)).sum(-1)                                # (b, d)
    if D is not None:
        y = y + D * u_t
    return h, y
