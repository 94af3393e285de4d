"""mambalab.ref.discretization: the exact solution solves the ODE, each rule converges at its order (Euler,
ZOH and exponential-Euler first, exponential-trapezoidal second), λ = 1 is exponential-Euler, bad input fails."""
import pytest
import torch

from mambalab.ref import discretization as dz

A, B, OMEGA, T_END = -1.0, 1.0, 2.0, 5.0
DTS = [0.02, 0.01, 0.005, 0.0025]


def test_exact_solution_solves_the_ode():
    t = torch.linspace(0.1, 5, 50, dtype=torch.float64)
    eps = 1e-6
    derivative = (dz.exact_solution(t + eps, A, B, OMEGA) - dz.exact_solution(t - eps, A, B, OMEGA)) / (2 * eps)
    rhs = A * dz.exact_solution(t, A, B, OMEGA) + B * torch.cos(OMEGA * t)
    torch.testing.assert_close(derivative, rhs, atol=1e-8, rtol=0)
    assert dz.exact_solution(torch.zeros(1), A, B, OMEGA).item() == pytest.approx(0.0, abs=1e-15)


@pytest.mark.parametrize("method, order", [("euler", 1), ("zoh", 1), ("exp_euler", 1), ("exp_trapezoidal", 2)])
def test_each_rule_converges_at_its_order(method, order):
    errors = [dz.max_error(method, A, B, OMEGA, dt, T_END) for dt in DTS]
    assert dz.observed_order(DTS, errors) == pytest.approx(order, abs=0.05)


def test_lambda_one_is_exponential_euler_and_half_is_the_trapezoid():
    assert dz.coefficients("exp_trapezoidal", A, B, 0.1, lam=1.0) == dz.coefficients("exp_euler", A, B, 0.1)
    alpha, prev, cur = dz.coefficients("exp_trapezoidal", A, B, 0.1, lam=0.5)
    assert prev == pytest.approx(alpha * cur)  # both end points weighted Δ/2, the older one decayed once


def test_simulated_samples_sit_on_the_step_grid():
    t, h = dz.simulate("zoh", A, B, OMEGA, 0.25, 1.0)
    torch.testing.assert_close(t, torch.tensor([0.0, 0.25, 0.5, 0.75, 1.0], dtype=torch.float64))
    assert h[0] == 0 and h.shape == t.shape


@pytest.mark.parametrize("kwargs, message", [
    (dict(method="rk4"), "method must be one of"), (dict(dt=0.0), "dt must be positive"),
    (dict(a=0.0), "a must be non-zero"), (dict(lam=1.5), r"lam must lie in \[0, 1\]")])
def test_bad_arguments_fail_clearly(kwargs, message):
    args = dict(method="zoh", a=A, b=B, dt=0.1) | kwargs
    with pytest.raises(ValueError, match=message):
        dz.coefficients(**args)
