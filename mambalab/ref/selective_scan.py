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
    out         : (b, d, l) in u's dtype; last_state (b, d, n) in fp32 (float64 for float64 u)
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
    """The selective scan, one time step after another (O(l) sequential steps). Computes in fp32 (float64
    inputs in float64, so that autograd through it checks :func:`selective_scan_backward_ref` to 1e-10).

    Same arguments and results as ``mamba_ssm.ops.selective_scan_interface.selective_scan_ref``
    (see the module docstring for the shapes).
    """
    dtype_in = u.dtype
    f = torch.promote_types(dtype_in, torch.float32)
    b, d, l = u.shape
    u, delta = u.to(f), delta.to(f)
    if delta_bias is not None:
        delta = delta + delta_bias.to(f)[:, None]
    if delta_softplus:
        delta = F.softplus(delta)
    A = A.to(f)
    B = _per_channel(B.to(f), d)  # (b, d, n, l)
    C = _per_channel(C.to(f), d)  # (b, d, n, l)
    A_bar, Bu_bar = discretize(delta, A, B, u)

    h = u.new_zeros(b, d, A.shape[1])  # (b, d, n): the state
    ys = []
    for t in range(l):
        h = A_bar[..., t] * h + Bu_bar[..., t]   # (b, d, n)
        ys.append((h * C[..., t]).sum(-1))        # (b, d)
    y = torch.stack(ys, dim=-1)                   # (b, d, l)
    if D is not None:
        y = y + u * D.to(f)[:, None]
    if z is not None:
        y = y * F.silu(z.to(f))
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


def selective_scan_backward_ref(dout, u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False):
    """The gradients of :func:`selective_scan_ref`, written out by hand: the adjoint scan, run last step first.

    With a_t = exp(Δ_t A), h_t = a_t ⊙ h_{t-1} + Δ_t u_t B_t, y_t = Σ_n C_t h_t + D u_t, out_t = y_t silu(z_t):

        dy_t = dout_t silu(z_t)                         (dout_t without z)
        λ_t  = a_{t+1} ⊙ λ_{t+1} + dy_t C_t,  λ_{l-1} = dy_{l-1} C_{l-1}   the state's adjoint, right to left
        dC_t = Σ_d dy_t h_t             dB_t = Σ_d λ_t Δ_t u_t          (Σ_d over the channels of B's group)
        du_t = Δ_t Σ_n λ_t B_t + D dy_t
        dΔ_t = Σ_n λ_t (A a_t h_{t-1} + u_t B_t)        dA = Σ_{b,t} λ_t Δ_t a_t h_{t-1}
        dD = Σ_{b,t} dy_t u_t           dz_t = dout_t y_t silu'(z_t),  silu'(z) = σ(z) (1 + z (1 - σ(z)))
        with softplus, Δ = softplus(δ + bias): dδ = dΔ σ(δ + bias) (1 above 20, where softplus is the identity);
        d(delta_bias) = Σ_{b,l} dδ

    Arguments as :func:`selective_scan_ref`, plus ``dout`` (b, d, l). Computes in the inputs' dtype promoted to
    at least fp32 (float64 inputs stay float64, for checks against autograd). Returns (du, ddelta, dA, dB, dC,
    dD, dz, ddelta_bias), each shaped as its input; None for an absent optional input.
    """
    dtype = torch.promote_types(u.dtype, torch.float32)
    b, d, l = u.shape
    u_dtype, A_dtype = u.dtype, A.dtype
    u, dout, A = u.to(dtype), dout.to(dtype), A.to(dtype)
    raw = delta.to(dtype)
    if delta_bias is not None:
        raw = raw + delta_bias.to(dtype)[:, None]
    dt = F.softplus(raw) if delta_softplus else raw                        # (b, d, l)
    Bc, Cc = _per_channel(B.to(dtype), d), _per_channel(C.to(dtype), d)  # (b, d, n, l)
    A_bar, Bu_bar = discretize(dt, A, Bc, u)                               # (b, d, n, l)

    # The forward again, keeping every state (the kernel keeps one every few hundred steps instead).
    hs, h = [], u.new_zeros(b, d, A.shape[1])
    for t in range(l):
        h = A_bar[..., t] * h + Bu_bar[..., t]
        hs.append(h)
    H = torch.stack(hs, dim=-1)                                            # (b, d, n, l): h_t
    H_prev = torch.cat([torch.zeros_like(H[..., :1]), H[..., :-1]], dim=-1)  # h_{t-1}

    y = (H * Cc).sum(2) + (u * D.to(dtype)[:, None] if D is not None else 0)   # (b, d, l): before the gate
    dy, dz = dout, None
    if z is not None:
        zz = z.to(dtype)
        sig = torch.sigmoid(zz)
        dy = dout * zz * sig
        dz = (dout * y * sig * (1 + zz * (1 - sig))).to(z.dtype)

    # The adjoint, right to left: λ_t = a_{t+1} λ_{t+1} + dy_t C_t.
    lams, lam = [None] * l, torch.zeros_like(h)
    for t in reversed(range(l)):
        a_next = A_bar[..., t + 1] if t + 1 < l else torch.ones_like(lam)
        lam = a_next * lam + dy[:, :, None, t] * Cc[..., t]
        lams[t] = lam
    Lam = torch.stack(lams, dim=-1)                                        # (b, d, n, l): λ_t

    decayed = A_bar * H_prev                                               # a_t h_{t-1} = h_t - Δ_t u_t B_t
    du = dt * (Lam * Bc).sum(2)
    if D is not None:
        du = du + D.to(dtype)[:, None] * dy
    ddt = (Lam * (A[None, :, :, None] * decayed + u[:, :, None] * Bc)).sum(2)   # (b, d, l)
    dA = (Lam * dt[:, :, None] * decayed).sum((0, 3))                      # (d, n)
    dB_c = Lam * (dt * u)[:, :, None]                                      # (b, d, n, l), per channel
    dC_c = H * dy[:, :, None]
    dB, dC = (_group_sum(x, M) for x, M in ((dB_c, B), (dC_c, C)))
    dD = (dy * u).sum((0, 2)).to(D.dtype) if D is not None else None
    if delta_softplus:
        ddt = torch.where(raw <= 20.0, ddt * torch.sigmoid(raw), ddt)
    ddelta_bias = ddt.sum((0, 2)).to(delta_bias.dtype) if delta_bias is not None else None
    return du.to(u_dtype), ddt.to(delta.dtype), dA.to(A_dtype), dB.to(B.dtype), dC.to(C.dtype), dD, dz, ddelta_bias


def _group_sum(per_channel: torch.Tensor, M: torch.Tensor) -> torch.Tensor:
    """(b, d, n, l) gradient of the row each channel reads -> M's shape, (b, n, l) or (b, g, n, l)."""
    if M.dim() == 3:
        return per_channel.sum(1)
    b, d, n, l = per_channel.shape
    return per_channel.view(b, M.shape[1], d // M.shape[1], n, l).sum(2)
