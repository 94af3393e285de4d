"""Discretising a continuous state space model, on a scalar ODE whose exact solution is known.

A selective SSM is the continuous system h'(t) = a h(t) + b x(t) sampled at steps of length Δ. Every
discretisation below turns it into the same recurrence shape,

    h_k = α h_{k-1} + β_prev x_{k-1} + β_cur x_k,          x_k = x(k Δ),  h_0 = h(0)

and differs only in the three coefficients (``coefficients``):

    euler              α = 1 + Δ a     β_prev = Δ b                   β_cur = 0           (forward Euler)
    zoh                α = e^{Δ a}     β_prev = (e^{Δ a} - 1) / a · b  β_cur = 0           (x held at x_{k-1})
    exp_euler          α = e^{Δ a}     β_prev = 0                     β_cur = Δ b         (Mamba-1/2)
    exp_trapezoidal    α = e^{Δ a}     β_prev = (1 - λ) Δ e^{Δ a} b   β_cur = λ Δ b       (Mamba-3)

The exact update is h_k = e^{Δ a} h_{k-1} + ∫_0^Δ e^{a (Δ - s)} b x(t_{k-1} + s) ds; the rules differ in how
they approximate that integral. Euler also approximates e^{Δ a} by 1 + Δ a (and is unstable once Δ |a| > 2).
ZOH integrates exactly but holds x constant over the step; exponential-Euler takes the integral's right end
point times Δ. All three are first order: their error at a fixed time grows like Δ. Exponential-trapezoidal
weights both end points (λ = 1/2 is the trapezoidal rule, error ~ Δ²); λ = 1 gives back exponential-Euler.
Mamba-3 makes λ_t = sigmoid(trap_t) a learned, per-token choice, so its recurrence needs the previous
token's B x (its decode state keeps the previous k and v).

The test problem (``exact_solution``): h(0) = 0 and x(t) = cos(ω t), whose solution is

    h(t) = b (ω sin ω t - a cos ω t + a e^{a t}) / (a² + ω²).

Everything is float64 and scalar: this module is for the notebook's error-versus-Δ study, not a kernel.
"""
from __future__ import annotations

import math

import torch

__all__ = ["METHODS", "coefficients", "error_curve", "exact_solution", "max_error", "observed_order", "simulate"]

METHODS = ("euler", "zoh", "exp_euler", "exp_trapezoidal")


def coefficients(method: str, a: float, b: float, dt: float, lam: float = 0.5) -> tuple[float, float, float]:
    """(α, β_prev, β_cur) of ``method`` for h' = a h + b x at step Δ = ``dt`` (module docstring).

    ``lam`` (λ in [0, 1]) is used by ``exp_trapezoidal`` only. ``a`` must be non-zero (ZOH divides by it).
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}; got {method!r}")
    if not dt > 0:
        raise ValueError(f"dt must be positive; got {dt}")
    if a == 0:
        raise ValueError("a must be non-zero")
    if not 0.0 <= lam <= 1.0:
        raise ValueError(f"lam must lie in [0, 1]; got {lam}")
    decay = math.exp(dt * a)
    if method == "euler":
        return 1.0 + dt * a, dt * b, 0.0
    if method == "zoh":
        return decay, math.expm1(dt * a) / a * b, 0.0
    if method == "exp_euler":
        return decay, 0.0, dt * b
    return decay, (1.0 - lam) * dt * decay * b, lam * dt * b


def exact_solution(t: torch.Tensor, a: float, b: float, omega: float) -> torch.Tensor:
    """h(t) for h' = a h + b cos(ω t), h(0) = 0; t (k,) -> (k,) float64."""
    t = torch.as_tensor(t, dtype=torch.float64)
    transient = a * torch.exp(a * t)
    return b * (omega * torch.sin(omega * t) - a * torch.cos(omega * t) + transient) / (a * a + omega * omega)


def simulate(method: str, a: float, b: float, omega: float, dt: float, t_end: float,
             lam: float = 0.5) -> tuple[torch.Tensor, torch.Tensor]:
    """Run ``method`` from h_0 = 0 with x_k = cos(ω k Δ) up to the last step at or before ``t_end``.

    Returns (t (k+1,), h (k+1,)) float64, t_k = k Δ.
    """
    alpha, beta_prev, beta_cur = coefficients(method, a, b, dt, lam)
    steps = int(math.floor(t_end / dt + 1e-9))
    t = torch.arange(steps + 1, dtype=torch.float64) * dt                # (k+1,)
    x = torch.cos(omega * t).tolist()                                     # plain floats: a fast scalar loop
    h = [0.0] * (steps + 1)
    for k in range(1, steps + 1):
        h[k] = alpha * h[k - 1] + beta_prev * x[k - 1] + beta_cur * x[k]
    return t, torch.tensor(h, dtype=torch.float64)


def max_error(method: str, a: float, b: float, omega: float, dt: float, t_end: float, lam: float = 0.5) -> float:
    """max_k |h_k - h(t_k)|: the global error of ``method`` at step ``dt`` over [0, t_end]."""
    t, h = simulate(method, a, b, omega, dt, t_end, lam)
    return float((h - exact_solution(t, a, b, omega)).abs().max())


def error_curve(dts, a: float = -1.0, b: float = 1.0, omega: float = 2.0, t_end: float = 10.0,
                lam: float = 0.5, methods=METHODS) -> dict[str, list[float]]:
    """{method: [max_error at each Δ in ``dts``]}: what the notebook plots on log-log axes."""
    return {m: [max_error(m, a, b, omega, float(dt), t_end, lam) for dt in dts] for m in methods}


def observed_order(dts, errors) -> float:
    """Least-squares slope of log(error) against log(Δ): about 1 for first-order rules, 2 for trapezoidal."""
    x = torch.log(torch.as_tensor(dts, dtype=torch.float64))
    y = torch.log(torch.as_tensor(errors, dtype=torch.float64))
    x = x - x.mean()
    return float((x * (y - y.mean())).sum() / (x * x).sum())

