"""Mamba-3's state update: exponential-trapezoidal steps, a rotary (complex) state and MIMO, in pure PyTorch.

Glossary: b batch, l length, h heads, p head dimension, g groups of q/k heads (g divides h; head i reads
group i // (h // g)), n state size (even), r MIMO rank (1 = SISO), a rotary angle pairs (a <= n / 2).

Per head, with state H_t (p, n), step size Δ_t > 0, log-decay A_tΔ_t <= 0 (``adt``, so α_t = exp(A_tΔ_t)),
trapezoid weight λ_t in [0, 1] (``trap``) and, for r = 1 … R,

    θ_t      = θ_{t-1} + angles_t ⊙ Δ_t                              (a,) cumulative rotary angle
    k̂_{t,r}  = Rot(θ_t) (k_{t,r} + k_bias_r),  q̂_{t,r} = Rot(θ_t) (q_{t,r} + q_bias_r)       (n,)
    v_{t,r}  = v_t ⊙ W^V_r                                            (p,)   (r = 1 without W: v_{t,1} = v_t)
    U_t      = Σ_r v_{t,r} k̂_{t,r}ᵀ                                   (p, n) the step's rank-R input
    H_t      = α_t H_{t-1} + β_t U_{t-1} + γ_t U_t,   β_t = (1 - λ_t) Δ_t α_t,   γ_t = λ_t Δ_t
    y_{t,r}  = (H_t q̂_{t,r} + D v_{t,r}) ⊙ silu(z_t ⊙ W^Z_r)           (silu gate only when z is given)
    out_t    = Σ_r W^O_r ⊙ y_{t,r}                                    (r = 1: out_t = y_{t,1})

Rot(θ) turns the pairs (k[2i], k[2i+1]) by θ[i] for i < a and leaves the other dimensions alone (the
"pairwise" layout of mamba-ssm's SISO kernel). mamba-ssm's MIMO kernels pair (k[i], k[i + n/2]) instead: the
same rotation after a fixed permutation of the n axis, applied alike to q, k and their biases
(:func:`halves_order`; the Mamba3 module applies it when it is MIMO). Rotating q and k by the same cumulative angle is
the rotary trick: q̂_t · k̂_s = (q_t + b^Q) · Rot(θ_s - θ_t)(k_s + b^K), so the real state of size n behaves
like a complex state of size n/2 whose eigenvalues α e^{iΔ angle} turn as well as decay.

The trapezoid: β_t U_{t-1} + γ_t U_t is the trapezoidal rule's two end points for ∫ e^{A(t-s)} U(s) ds over
one step (λ = 1 is exponential Euler, Mamba-2's rule). Unrolled, U_s enters H_t (t >= s) with weight

    w[t, s] = γ_s                                           t = s
            = exp(A_{s+1}Δ_{s+1} + … + A_tΔ_t) · σ_s        t > s,   σ_s = γ_s + (1 - λ_{s+1}) Δ_{s+1}

so y is an SSD (Mamba-2's chunked scan, :mod:`mambalab.ref.ssd`) with input weight σ_s in place of Δ_s and
decay A_tΔ_t, except on the diagonal t = s, where the weight is γ_s instead of σ_s. σ_s reads step s + 1;
after the last step (and past it) that term is 0.

MIMO (r > 1) as an SSD: lay the R ranks of every step out as R consecutive positions (s, 1) … (s, R) of a
sequence of length l·R, with k̂ as B, q̂ as C, v_{s,r} as x, weight σ_s at every rank and the decay A_sΔ_s
at rank 1 only (0 at the others). An output position (t, r) then sees every earlier step through the right
decays, but of its own step only the ranks r' <= r, each with σ_t. The within-step correction adds the rest:

    y_{t,r} += Σ_{r'} c_{r,r'} (q̂_{t,r} · k̂_{t,r'}) v_{t,r'},   c_{r,r'} = γ_t [r' > r] - (σ_t - γ_t) [r' <= r]

which costs O(R² (n + p)) per step. :func:`mamba3_chunked` computes exactly this with the chunked SSD of
:mod:`mambalab.ref.ssd`; :func:`mamba3_recurrent` is the plain loop over :func:`mamba3_step_ref`.

State between calls (:class:`Mamba3State`): the angle θ (b, h, a), the SSM state H (b, h, p, n), the last
step's k̂ (b, h, r, n) (bias added and rotated) and its raw v (b, h, p), which the next step's β term needs.
Starting from a state, the sequence behaves as if those had been its previous step; without one, θ, H and
U_{-1} are 0.

Shapes:
    q, k            : (b, l, r, g, n)  already RMS-normalised (the op adds the biases and rotates)
    v, z            : (b, l, h, p)
    adt, dt, trap   : (b, l, h)        A·Δ (<= 0), Δ (> 0), λ in [0, 1]
    q_bias, k_bias  : (h, r, n)
    angles          : (b, l, h, a)     per-step angle rates (θ grows by angles · Δ)
    D               : (h,)
    mimo_v, mimo_z, mimo_o : (h, r, p) required when r > 1 (mimo_z only with z), not allowed when r = 1
    out             : (b, l, h, p) in v's dtype
Computation runs in fp32 (fp64 for fp64 inputs); the returned state is in that dtype.
"""
from __future__ import annotations

from typing import NamedTuple

import math

import torch
import torch.nn.functional as F

from mambalab import validate
from mambalab.ref.ssd import chunk_diagonal_outputs, chunk_state_outputs, chunk_states, state_passing


class Mamba3State(NamedTuple):
    """What a Mamba-3 layer carries from one step to the next (constant size, whatever the length)."""

    angle: torch.Tensor   # (b, h, a): θ, the cumulative rotary angle
    ssm: torch.Tensor     # (b, h, p, n): H, the state
    k: torch.Tensor       # (b, h, r, n): the last step's k̂ (bias added, rotated by its θ)
    v: torch.Tensor       # (b, h, p): the last step's raw v (before W^V)


# ---------------------------------------------------------------------------------------------- validation
DTYPES = validate.FLOAT_DTYPES + (torch.float64,)  # the references also take fp64 (the tests' oracle precision)


def check_inputs(q, k, v, adt, dt, trap, q_bias, k_bias, angles, D=None, z=None, mimo_v=None, mimo_z=None,
                 mimo_o=None, state=None, *, per_token=False, chunk_size=None):
    """Check Mamba-3's inputs; raises TypeError/ValueError naming the argument. Returns (b, l, h, p, g, n, r, a).

    ``per_token``: the shapes of one decoding step (the l axis dropped; l is returned as 1). ``state``: an
    initial :class:`Mamba3State` (or None). ``chunk_size``: checked to be a power of two when given.
    """
    names = ("q", "k", "v", "adt", "dt", "trap", "q_bias", "k_bias", "angles")
    for name, t in zip(names, (q, k, v, adt, dt, trap, q_bias, k_bias, angles)):
        validate.tensor(name, t, dtypes=DTYPES)
    opt = {"D": D, "z": z, "mimo_v": mimo_v, "mimo_z": mimo_z, "mimo_o": mimo_o}
    for name, t in opt.items():
        if t is not None:
            validate.tensor(name, t, dtypes=DTYPES)
    lname = "" if per_token else "l, "
    if q.dim() != 5 - per_token:
        raise ValueError(f"q must have shape (b, {lname}r, g, n); got {tuple(q.shape)}")
    if v.dim() != 4 - per_token:
        raise ValueError(f"v must have shape (b, {lname}h, p); got {tuple(v.shape)}")
    b = q.shape[0]
    l = 1 if per_token else q.shape[1]
    r, g, n = q.shape[-3:]
    h, p = v.shape[-2:]
    Lx = () if per_token else (l,)
    validate.shape("k", k, (b, *Lx, r, g, n), f"(b, {lname}r, g, n), like q")
    validate.shape("v", v, (b, *Lx, h, p), f"(b, {lname}h, p)")
    if g == 0 or h % g:
        raise ValueError(f"the q/k groups g = {g} (q.shape[-2]) must divide the heads h = {h} (v.shape[-2])")
    if n % 2:
        raise ValueError(f"the state size n = {n} (q.shape[-1]) must be even (the rotary state pairs it)")
    for name, t in (("adt", adt), ("dt", dt), ("trap", trap)):
        validate.shape(name, t, (b, *Lx, h), f"(b, {lname}h)")
    validate.shape("q_bias", q_bias, (h, r, n), "(h, r, n)")
    validate.shape("k_bias", k_bias, (h, r, n), "(h, r, n)")
    if angles.dim() != 4 - per_token:
        raise ValueError(f"angles must have shape (b, {lname}h, a); got {tuple(angles.shape)}")
    a = angles.shape[-1]
    validate.shape("angles", angles, (b, *Lx, h, a), f"(b, {lname}h, a)")
    if a > n // 2:
        raise ValueError(f"angles has a = {a} pairs but the state has only n / 2 = {n // 2}")
    if D is not None:
        validate.shape("D", D, (h,), "(h,)")
    if z is not None:
        validate.shape("z", z, (b, *Lx, h, p), f"(b, {lname}h, p), like v")
    mimo = {k_: t for k_, t in opt.items() if k_.startswith("mimo_")}
    if r == 1:
        given = [k_ for k_, t in mimo.items() if t is not None]
        if given:
            raise ValueError(f"{', '.join(given)} given but r = 1 (q.shape[-3]): SISO has no MIMO weights")
    else:
        for name, t in mimo.items():
            if t is None and not (name == "mimo_z" and z is None):
                raise ValueError(f"{name} (h, r, p) is required when r = {r} > 1 (q.shape[-3])")
            if t is not None:
                validate.shape(name, t, (h, r, p), "(h, r, p)")
    if state is not None:
        if not isinstance(state, Mamba3State):
            raise TypeError(f"the state must be a Mamba3State; got {type(state).__name__}")
        for name, t, shp, meaning in (("angle", state.angle, (b, h, a), "(b, h, a)"),
                                      ("ssm", state.ssm, (b, h, p, n), "(b, h, p, n)"),
                                      ("k", state.k, (b, h, r, n), "(b, h, r, n)"),
                                      ("v", state.v, (b, h, p), "(b, h, p)")):
            validate.tensor(f"state.{name}", t, dtypes=DTYPES)
            validate.shape(f"state.{name}", t, shp, meaning)
    if chunk_size is not None:
        validate.positive_int("chunk_size", chunk_size, power_of_two=True)
    validate.same_device(q=q, k=k, v=v, adt=adt, dt=dt, trap=trap, q_bias=q_bias, k_bias=k_bias, angles=angles,
                         **opt, **({} if state is None else {f"state.{f}": t for f, t in state._asdict().items()}))
    return b, l, h, p, g, n, r, a


# ---------------------------------------------------------------------------------------------- pieces
def wrap_angle(theta: torch.Tensor) -> torch.Tensor:
    """θ reduced to [0, 2π): the angle a state carries, where mamba-ssm's kernels keep it (the turn is the same
    modulo 2π; the reduced angle keeps the state's magnitude bounded over a long decode)."""
    return torch.remainder(theta, 2 * math.pi)


def compute_dtype(t: torch.Tensor) -> torch.dtype:
    """fp64 stays fp64; everything else is computed in fp32."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def rotate_pairs(x: torch.Tensor, theta: torch.Tensor) -> torch.Tensor:
    """Rot(θ) x: turn the pairs (x[2i], x[2i+1]) by θ[i] for i < a; the rest of x unchanged.

    x: (..., n); theta: (..., a) broadcastable to x's leading axes -> (..., n).
    """
    a = theta.shape[-1]
    x0, x1 = x[..., 0:2 * a:2], x[..., 1:2 * a:2]                            # (..., a) each
    cos, sin = torch.cos(theta), torch.sin(theta)
    turned = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)  # (..., a, 2)
    return torch.cat((turned.flatten(-2), x[..., 2 * a:]), dim=-1)


def halves_order(n: int, a: int, device=None) -> torch.Tensor:
    """The permutation of the n axis that turns the "halves" rotary layout into :func:`rotate_pairs`' adjacent
    one: an index (n,) such that x[..., order] puts the pair (x[i], x[i + n/2]) at (2i, 2i+1) for i < a, and
    the dimensions no pair turns, [a, n/2) then [n/2 + a, n), after them in their order. Hence

        Rot_halves(θ) x = (Rot(θ) x[..., order])[..., argsort(order)]

    and, as dot products ignore a common permutation of both sides, a scan over q[..., order], k[..., order]
    (biases likewise) computes what mamba-ssm's MIMO kernels compute over q and k; only the state's n axis
    comes out in the permuted order."""
    i = torch.arange(a, device=device)
    turned = torch.stack((i, i + n // 2), dim=-1).flatten()                   # (2a,): i, i + n/2, …
    plain = torch.cat((torch.arange(a, n // 2, device=device), torch.arange(n // 2 + a, n, device=device)))
    return torch.cat((turned, plain))


def halves_to_pairs(x: torch.Tensor, a: int) -> torch.Tensor:
    """``x[..., halves_order(n, a)]`` made of slices, a stack and a cat: x (..., n) -> (..., n).

    Indexing with a tensor would do the same forward, but its backward is a sort and an accumulating index_put
    (3.3 ms of a MIMO block's 22.3, forward+backward at b4 l4096: benchmarks/results/README.md, 2026-12-01).
    The backward of slices is slices."""
    half = x.shape[-1] // 2
    first, second = x[..., :half], x[..., half:]
    turned = torch.stack((first[..., :a], second[..., :a]), dim=-1).flatten(-2)    # i, i + n/2, … for i < a
    return torch.cat((turned, first[..., a:], second[..., a:]), dim=-1)


def pairs_to_halves(x: torch.Tensor, a: int) -> torch.Tensor:
    """The inverse of :func:`halves_to_pairs`, ``x[..., argsort(halves_order(n, a))]``, from slices as well."""
    half = x.shape[-1] // 2
    turned, plain = x[..., :2 * a], x[..., 2 * a:]
    first, second = turned[..., 0::2], turned[..., 1::2]
    return torch.cat((first, plain[..., :half - a], second, plain[..., half - a:]), dim=-1)


def per_head(x: torch.Tensor, h: int) -> torch.Tensor:
    """Grouped q or k -> one row per head: (..., g, n) -> (..., h, n); head i reads group i // (h // g).

    An expand and a reshape, so its backward is a plain sum over each group's heads (repeat_interleave's
    goes through index_add, which adds with atomics on a GPU)."""
    *lead, g, n = x.shape
    return x.unsqueeze(-2).expand(*lead, g, h // g, n).reshape(*lead, h, n)


def biased_rotated(x, bias, theta):
    """k̂ or q̂: per head, bias added, rotated. x: (b, [l,] r, g, n); bias (h, r, n); theta (b, [l,] h, a)
    -> (b, [l,] r, h, n)."""
    h = bias.shape[0]
    x = per_head(x, h) + bias.transpose(0, 1)                                 # (b, [l,] r, h, n)
    return rotate_pairs(x, theta.unsqueeze(-3))


def rank_inputs(v, mimo_v, r):
    """v_{·,r} = v ⊙ W^V_r: (b, [l,] h, p) -> (b, [l,] r, h, p); for r = 1 without W, v itself.
    (W^V laid out (r, h, p) first, so that the product comes out contiguous.)"""
    if mimo_v is None:
        return v.unsqueeze(-3)
    return v.unsqueeze(-3) * mimo_v.transpose(0, 1).contiguous()


def rank_outputs(y, v_r, D, z, mimo_z, mimo_o):
    """out = Σ_r W^O_r ⊙ ((y_r + D v_r) ⊙ silu(z ⊙ W^Z_r)). y, v_r: (b, [l,] r, h, p); z: (b, [l,] h, p);
    D: (h,); mimo_*: (h, r, p) or None -> (b, [l,] h, p)."""
    if D is not None:
        y = y + D[:, None] * v_r
    if z is not None:
        zr = z.unsqueeze(-3) if mimo_z is None else z.unsqueeze(-3) * mimo_z.transpose(0, 1)
        y = y * F.silu(zr)
    if mimo_o is None:
        return y.squeeze(-3)
    return (y * mimo_o.transpose(0, 1)).sum(dim=-3)


def zero_state(b, h, p, n, r, a, dtype, device) -> Mamba3State:
    """The state before any step: everything zero."""
    z = lambda *s: torch.zeros(*s, dtype=dtype, device=device)
    return Mamba3State(z(b, h, a), z(b, h, p, n), z(b, h, r, n), z(b, h, p))


def _cast_inputs(*args):
    """The scan's tensor arguments q … mimo_o, in order, in the compute dtype (:func:`compute_dtype` of v, the
    third), None kept: (v's dtype, the compute dtype, the cast arguments)."""
    cd = compute_dtype(args[2])
    return args[2].dtype, cd, [None if t is None else t.to(cd) for t in args]


def _cast_state(state, dtype):
    return Mamba3State(*(t.to(dtype) for t in state))


# ---------------------------------------------------------------------------------------------- recurrent form
def mamba3_step_ref(state, q, k, v, adt, dt, trap, q_bias, k_bias, angles, D=None, z=None, mimo_v=None,
                    mimo_z=None, mimo_o=None):
    """One step of the recurrence (decoding one token). Per-token shapes: the l axis dropped.

    state: :class:`Mamba3State`; q, k (b, r, g, n); v, z (b, h, p); adt, dt, trap (b, h); angles (b, h, a);
    q_bias, k_bias (h, r, n); D (h,); mimo_* (h, r, p) -> (out (b, h, p) in v's dtype, new state).
    """
    check_inputs(q, k, v, adt, dt, trap, q_bias, k_bias, angles, D, z, mimo_v, mimo_z, mimo_o, state,
                 per_token=True)
    return _step(state, q, k, v, adt, dt, trap, q_bias, k_bias, angles, D, z, mimo_v, mimo_z, mimo_o)


def _step(state, q, k, v, adt, dt, trap, q_bias, k_bias, angles, D, z, mimo_v, mimo_z, mimo_o):
    dtype_in, cd, (q, k, v, adt, dt, trap, q_bias, k_bias, angles, D, z, mimo_v, mimo_z, mimo_o) = _cast_inputs(
        q, k, v, adt, dt, trap, q_bias, k_bias, angles, D, z, mimo_v, mimo_z, mimo_o)
    state = _cast_state(state, cd)
    r = q.shape[1]
    theta = state.angle + angles * dt[..., None]                              # (b, h, a)
    k_hat = biased_rotated(k, k_bias, theta).transpose(1, 2)                  # (b, h, r, n)
    q_hat = biased_rotated(q, q_bias, theta)                                  # (b, r, h, n)
    v_prev = rank_inputs(state.v, mimo_v, r).transpose(1, 2)                  # (b, h, r, p)
    v_now = rank_inputs(v, mimo_v, r)                                         # (b, r, h, p)
    U_prev = torch.einsum("bhrp,bhrn->bhpn", v_prev, state.k)                 # (b, h, p, n)
    U_now = torch.einsum("brhp,bhrn->bhpn", v_now, k_hat)
    alpha = torch.exp(adt)                                                    # (b, h)
    beta = (1 - trap) * dt * alpha
    gamma = trap * dt
    ssm = (alpha[..., None, None] * state.ssm + beta[..., None, None] * U_prev
           + gamma[..., None, None] * U_now)                                  # (b, h, p, n)
    y = torch.einsum("bhpn,brhn->brhp", ssm, q_hat)                           # (b, r, h, p)
    out = rank_outputs(y, v_now, D, z, mimo_z, mimo_o)                        # (b, h, p)
    return out.to(dtype_in), Mamba3State(wrap_angle(theta), ssm, k_hat, v)


def mamba3_recurrent(q, k, v, adt, dt, trap, q_bias, k_bias, angles, D=None, z=None, mimo_v=None, mimo_z=None,
                     mimo_o=None, initial_state=None, return_final_state=False):
    """The recurrence, one :func:`mamba3_step_ref` after another: l sequential steps (shapes: module docstring).

    initial_state: a :class:`Mamba3State` or None (zeros). Returns out (b, l, h, p) in v's dtype, and with
    ``return_final_state`` also the final :class:`Mamba3State`.
    """
    b, l, h, p, g, n, r, a = check_inputs(q, k, v, adt, dt, trap, q_bias, k_bias, angles, D, z, mimo_v, mimo_z,
                                          mimo_o, initial_state)
    state = initial_state or zero_state(b, h, p, n, r, a, compute_dtype(v), v.device)
    outs = []
    for t in range(l):
        zt = None if z is None else z[:, t]
        o, state = _step(state, q[:, t], k[:, t], v[:, t], adt[:, t], dt[:, t], trap[:, t], q_bias, k_bias,
                         angles[:, t], D, zt, mimo_v, mimo_z, mimo_o)
        outs.append(o)
    out = torch.stack(outs, dim=1)                                            # (b, l, h, p)
    return (out, state) if return_final_state else out


# ---------------------------------------------------------------------------------------------- one weight matrix
def scan_weights(adt, sigma, gamma, r):
    """The weight matrix of the whole scan over rank-expanded positions j = t·r + ρ (step t, rank ρ):

        W[j, i] = exp(A_{s+1}Δ_{s+1} + … + A_tΔ_t) σ_s     s < t      (s = i // r, t = j // r)
                = γ_t                                     s = t      (every pair of the step's ranks)
                = 0                                       s > t

    so that y_j = Σ_i W[j, i] (q̂_j · k̂_i) v_i (:func:`mamba3_quadratic`). The same-step block is the unrolled
    recurrence's γ_t U_t term; the rank-expanded SSD of :func:`mamba3_chunked` gives it σ_t [ρ' <= ρ] instead
    and :func:`within_step_correction` adds the difference. The kernels compute W chunk by chunk
    (:func:`mambalab.kernels.ssd.chunk_scan._intra_weights`, the SSD kernels' step mode).
    adt, sigma, gamma: (b, l, h) -> (b, h, l·r, l·r)."""
    l = adt.shape[1]
    cs = torch.cumsum(adt, dim=1)                                             # (b, l, h)
    seg = (cs[:, :, None] - cs[:, None, :]).permute(0, 3, 1, 2)               # (b, h, t, s): Σ_{s < s' <= t}
    steps = torch.arange(l, device=adt.device)
    earlier = steps[:, None] > steps[None, :]
    decayed = torch.exp(seg.masked_fill(~earlier, float("-inf"))) * sigma.transpose(1, 2)[:, :, None, :]
    W = torch.where(steps[:, None] == steps[None, :], gamma.transpose(1, 2)[..., None], decayed)
    return W.repeat_interleave(r, dim=2).repeat_interleave(r, dim=3)


def mamba3_quadratic(q, k, v, adt, dt, trap, q_bias, k_bias, angles, D=None, z=None, mimo_v=None, mimo_z=None,
                     mimo_o=None):
    """The scan as one (l·r) × (l·r) matrix product, O(l²): the arguments and output of :func:`mamba3_recurrent`
    without a state (shapes: module docstring). y = ((C Bᵀ) ⊙ W) x over rank-expanded positions, with C = q̂,
    B = k̂, x = v ⊙ W^V_r and W from :func:`scan_weights`; then D, the gate and W^O (:func:`rank_outputs`)."""
    b, l, h, p, g, n, r, a = check_inputs(q, k, v, adt, dt, trap, q_bias, k_bias, angles, D, z, mimo_v, mimo_z,
                                          mimo_o, None)
    dtype_in, _, (q, k, v, adt, dt, trap, q_bias, k_bias, angles, D, z, mimo_v, mimo_z, mimo_o) = _cast_inputs(
        q, k, v, adt, dt, trap, q_bias, k_bias, angles, D, z, mimo_v, mimo_z, mimo_o)
    q_hat, k_hat, v_r, gamma, sigma, _, _ = prepare(q, k, v, adt, dt, trap, q_bias, k_bias, angles, mimo_v, None)
    C, B, x, _, _ = expand_ranks(q_hat, k_hat, v_r, adt, sigma)               # (b, l·r, h, ·)
    scores = torch.einsum("bjhn,bihn->bhji", C, B) * scan_weights(adt, sigma, gamma, r)
    y = torch.einsum("bhji,bihp->bjhp", scores, x).reshape(b, l, r, h, p)
    return rank_outputs(y, v_r, D, z, mimo_z, mimo_o).to(dtype_in)


# ---------------------------------------------------------------------------------------------- chunked form
def step_weights(dt, trap, seq_idx=None):
    """γ_t = λ_t Δ_t and σ_t = γ_t + (1 - λ_{t+1}) Δ_{t+1} (0 past the last step). dt, trap: (b, l, h).

    seq_idx (b, l) or None: packed sequences; the second term is 0 also at a sequence's last step (t + 1
    starts the next sequence, whose previous k, v are zero)."""
    gamma = trap * dt
    shifted = F.pad(((1 - trap) * dt)[:, 1:], (0, 0, 0, 1))                   # (b, l, h): β_{t+1} / α_{t+1}
    if seq_idx is not None:
        same = F.pad(seq_idx[:, 1:] == seq_idx[:, :-1], (0, 1))               # (b, l): t + 1 in t's sequence
        shifted = shifted * same[..., None]
    return gamma, gamma + shifted


def cumulative_angle(angles, dt, initial_state=None):
    """θ_t = θ_{-1} + Σ_{s ≤ t} angles_s Δ_s: angles (b, l, h, a), dt (b, l, h) -> (b, l, h, a) (a view of a
    (b, h, a, l) tensor). The sum runs along the innermost axis of a (b, h, a, l) copy: PyTorch's CUDA cumsum
    along an outer axis walks each column with one thread, along the innermost axis it scans in parallel
    (the outer axis: 1.5 ms a call at b4 l4096 h32 a32: benchmarks/results/README.md, 2026-11-30, a profile of
    mamba3_chunk_scan)."""
    steps = (angles * dt[..., None]).permute(0, 2, 3, 1).contiguous()        # (b, h, a, l)
    theta = torch.cumsum(steps, dim=-1).permute(0, 3, 1, 2)                  # (b, l, h, a)
    return theta if initial_state is None else theta + initial_state.angle[:, None]


def entering_state(initial_state, dt, trap, mimo_v):
    """H̃_{-1} = H_{-1} + (1 - λ_0) Δ_0 U_{-1}: the state that enters step 0 in SSD form (the previous step's
    input with its σ weight, so that step 0 decays it by α_0 like any other). None without a state.
    dt, trap: (b, l, h) -> (b, h, p, n)."""
    if initial_state is None:
        return None
    r = initial_state.k.shape[2]
    U_prev = torch.einsum("brhp,bhrn->bhpn", rank_inputs(initial_state.v, mimo_v, r), initial_state.k)
    return initial_state.ssm + ((1 - trap[:, 0]) * dt[:, 0])[..., None, None] * U_prev


def prepare(q, k, v, adt, dt, trap, q_bias, k_bias, angles, mimo_v, initial_state):
    """Everything the SSD form needs, in the compute dtype (fp32/fp64): see the module docstring.

    Returns (q̂, k̂ (b, l, r, h, n); v_r (b, l, r, h, p); γ, σ (b, l, h); θ (b, l, h, a); H̃_{-1} (b, h, p, n)
    or None; see :func:`entering_state`).
    """
    theta = cumulative_angle(angles, dt, initial_state)                       # (b, l, h, a)
    q_hat = biased_rotated(q, q_bias, theta)                                  # (b, l, r, h, n)
    k_hat = biased_rotated(k, k_bias, theta)
    v_r = rank_inputs(v, mimo_v, q.shape[2])                                  # (b, l, r, h, p)
    gamma, sigma = step_weights(dt, trap)
    return q_hat, k_hat, v_r, gamma, sigma, theta, entering_state(initial_state, dt, trap, mimo_v)


def expand_ranks(q_hat, k_hat, v_r, adt, sigma):
    """Lay the R ranks of each step out along the sequence: (b, l, r, ...) -> (b, l·r, ...), position t·R + r.

    The decay adt goes to rank 0 of each step (0 at the others); the weight σ to every rank.
    Returns C = q̂, B = k̂ (b, l·r, h, n), x = v_r (b, l·r, h, p), a, w (b, l·r, h).
    """
    b, l, r = q_hat.shape[:3]
    flat = lambda t: t.flatten(1, 2)
    a = F.pad(adt.unsqueeze(2), (0, 0, 0, r - 1))                             # (b, l, r, h): adt at rank 0
    w = sigma.unsqueeze(2).expand(-1, -1, r, -1)                              # (b, l, r, h)
    return flat(q_hat), flat(k_hat), flat(v_r), flat(a), flat(w)


def within_step_scores(q, k, q_bias, k_bias):
    """q̂_{t,r} · k̂_{t,r'} for every step, head and pair of ranks, without rotating anything.

    Both sides turn by the same θ_t, and a rotation keeps dot products, so the score is that of the biased,
    unrotated vectors: (q_r + b^Q_{h,r}) · (k_r' + b^K_{h,r'}). Expanding the product keeps every term a small
    matmul over n, and nothing of size (b, l, r, h, n) is formed:

        q_r·k_r'  +  q_r·b^K_{h,r'}  +  b^Q_{h,r}·k_r'  +  b^Q_{h,r}·b^K_{h,r'}

    q, k: (b, l, r, g, n); q_bias, k_bias: (h, r, n) -> (b, l, h, r, r').
    """
    b, l, r, g, n = q.shape
    e = q_bias.shape[0] // g                                                  # heads per group
    bq, bk = q_bias.view(g, e, r, n), k_bias.view(g, e, r, n)
    s = torch.einsum("blrgn,bljgn->blgrj", q, k)[:, :, :, None]                # (b, l, g, 1, r, r')
    s = s + torch.einsum("blrgn,gejn->blgerj", q, bk) + torch.einsum("gern,bljgn->blgerj", bq, k)
    s = s + torch.einsum("gern,gejn->gerj", bq, bk)
    return s.reshape(b, l, g * e, r, r)


def within_step_correction(scores, v_r, gamma, sigma):
    """What the rank-expanded SSD gets wrong inside each step (module docstring):

        Σ_{r'} c_{r,r'} (q̂_{t,r} · k̂_{t,r'}) v_{t,r'},   c_{r,r'} = γ_t [r' > r] - (σ_t - γ_t) [r' <= r]

    scores: (b, l, h, r, r') from :func:`within_step_scores`; v_r (b, l, r, h, p); gamma, sigma (b, l, h)
    -> (b, l, r, h, p).
    """
    cs = correction_coefficients(scores, gamma, sigma)                        # (b, l, h, r, r')
    if cs.shape[-1] == 1:   # SISO: a scalar per step and head (elementwise, not a batch of 1 × 1 matmuls)
        return cs[..., 0, 0][:, :, None, :, None] * v_r
    return torch.einsum("blhrj,bljhp->blrhp", cs, v_r)


def correction_coefficients(scores, gamma, sigma):
    """c_{r,r'} (q̂_{t,r} · k̂_{t,r'}) with c from :func:`within_step_correction`: (b, l, h, r, r')."""
    r = scores.shape[-1]
    upper = torch.ones(r, r, dtype=torch.bool, device=scores.device).triu(1)  # [r' > r]
    c = torch.where(upper, gamma[..., None, None], (gamma - sigma)[..., None, None])
    return c * scores


def mamba3_chunked(q, k, v, adt, dt, trap, q_bias, k_bias, angles, D=None, z=None, mimo_v=None, mimo_z=None,
                   mimo_o=None, initial_state=None, return_final_state=False, chunk_size=64, cu_seqlens=None):
    """The chunked (SSD) form: same arguments and results as :func:`mamba3_recurrent`, plus ``chunk_size``
    (steps per chunk, a power of two; the rank-expanded SSD works on chunks of chunk_size · r positions).

    cu_seqlens: packed sequences, (num_seqs + 1,) with b = 1: sequence i is steps cu_i … cu_{i+1} - 1, each run
    alone, from zero or from its own initial state; initial and final states have num_seqs leading.

    Steps: bias and rotate q, k (:func:`prepare`); expand the ranks (:func:`expand_ranks`); the four steps of
    :func:`mambalab.ref.ssd.ssd_chunked` with weight σ and decay adt; add :func:`within_step_correction`
    (its scores from :func:`within_step_scores`); D, gate and W^O (:func:`rank_outputs`).
    """
    b, l, h, p, g, n, r, a = check_inputs(q, k, v, adt, dt, trap, q_bias, k_bias, angles, D, z, mimo_v, mimo_z,
                                          mimo_o, initial_state if cu_seqlens is None else None,
                                          chunk_size=chunk_size)
    if cu_seqlens is not None:   # (each sequence's initial state is checked by its own call)
        return _packed_chunked(cu_seqlens, q, k, v, adt, dt, trap, q_bias, k_bias, angles, D, z, mimo_v, mimo_z,
                               mimo_o, initial_state, return_final_state, chunk_size)
    dtype_in, cd, (q, k, v, adt, dt, trap, q_bias, k_bias, angles, D, z, mimo_v, mimo_z, mimo_o) = _cast_inputs(
        q, k, v, adt, dt, trap, q_bias, k_bias, angles, D, z, mimo_v, mimo_z, mimo_o)
    if initial_state is not None:
        initial_state = _cast_state(initial_state, cd)
    q_hat, k_hat, v_r, gamma, sigma, theta, entering0 = prepare(q, k, v, adt, dt, trap, q_bias, k_bias, angles,
                                                                mimo_v, initial_state)
    C, B, x, a_, w = expand_ranks(q_hat, k_hat, v_r, adt, sigma)              # (b, l·r, ...)

    Q = chunk_size * r                                                        # positions per chunk
    nc = -(-l // chunk_size)
    pad = nc * Q - l * r

    def chunked(t):  # (b, l·r, ...) -> (b, c, Q, ...), zeros past the end (no decay, no input)
        t = F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad))
        return t.reshape(b, nc, Q, *t.shape[2:])

    x, w, a_, B, C = chunked(x), chunked(w), chunked(a_), chunked(B), chunked(C)
    y_diag = chunk_diagonal_outputs(x, w, a_, B, C)                           # (b, c, Q, h, p)
    states = chunk_states(x, w, a_, B)                                        # (b, c, h, p, n)
    entering, final = state_passing(states, a_.sum(dim=2), entering0)
    y_off = chunk_state_outputs(C, entering, a_)
    y = (y_diag + y_off).flatten(1, 2)[:, :l * r].reshape(b, l, r, h, p)      # (b, l, r, h, p)
    y = y + within_step_correction(within_step_scores(q, k, q_bias, k_bias), v_r, gamma, sigma)
    out = rank_outputs(y, v_r, D, z, mimo_z, mimo_o).to(dtype_in)             # (b, l, h, p)
    if not return_final_state:
        return out
    # σ_{l-1} = γ_{l-1} (nothing after the last step), so the SSD's final state is H_{l-1} itself.
    state = Mamba3State(wrap_angle(theta[:, -1]), final, k_hat[:, -1].transpose(1, 2), v[:, -1])
    return out, state


def _packed_chunked(cu_seqlens, q, k, v, adt, dt, trap, q_bias, k_bias, angles, D, z, mimo_v, mimo_z, mimo_o,
                    initial_state, return_final_state, chunk_size):
    """:func:`mamba3_chunked` over packed sequences: each slice of l run alone, outputs concatenated along l
    and final states stacked along a new leading axis (num_seqs)."""
    if q.shape[0] != 1:
        raise ValueError(f"packed sequences (cu_seqlens) lie along l of one batch row; got b = {q.shape[0]}")
    bounds = cu_seqlens.tolist()
    if bounds[0] != 0 or bounds[-1] != q.shape[1] or any(e <= s for s, e in zip(bounds, bounds[1:])):
        raise ValueError(f"cu_seqlens must start at 0, increase strictly and end at l = {q.shape[1]}; got {bounds}")
    per_step = (q, k, v, adt, dt, trap, angles, z)
    outs, states = [], []
    for s, e in zip(bounds, bounds[1:]):
        q_, k_, v_, adt_, dt_, trap_, angles_, z_ = (None if t is None else t[:, s:e] for t in per_step)
        init = None if initial_state is None else Mamba3State(*(t[len(outs):len(outs) + 1] for t in initial_state))
        res = mamba3_chunked(q_, k_, v_, adt_, dt_, trap_, q_bias, k_bias, angles_, D, z_, mimo_v, mimo_z, mimo_o,
                             initial_state=init, return_final_state=True, chunk_size=chunk_size)
        outs.append(res[0])
        states.append(res[1])
    out = torch.cat(outs, dim=1)                                              # (1, l, h, p)
    if not return_final_state:
        return out
    return out, Mamba3State(*(torch.cat(parts, dim=0) for parts in zip(*states)))
