"""Exercises of chapter 01 (the selective scan): checkers that say ✓ or ✗ and how far off.

* :func:`zoh_step`: write the exact zero-order-hold discretisation, Ā = exp(Δ A) and
  B̄ = (Δ A)⁻¹ (exp(Δ A) - 1) Δ B, as a function of tensors (checked against
  :func:`mambalab.ref.discretization.coefficients`).
* :func:`three_step_scan`: predict by hand the outputs y₀, y₁, y₂ of a three-step scan (:data:`THREE_STEPS`),
  checked against :func:`mambalab.ref.selective_scan.selective_scan_ref`.
* :func:`scan_loop`: write the minimal kernel's loop over l (:mod:`mambalab.kernels.selective_scan_minimal`)
  as a PyTorch function ``scan(u, delta, A, B, C) -> y``, checked against the reference on several shapes.
* :func:`scan_skip_gate`: add the skip D and the gate z to the minimal Triton loop kernel, launched by
  ``scan(u, delta, A, B, C, D, z) -> out``, out = (Σ_n C h + D u) ⊙ silu(z); checked against the reference.
* :func:`reverse_scan`: the backward's core as a Triton kernel, ``reverse_scan(a, x) -> g`` with
  g_t = a_{t+1} g_{t+1} + x_t from the last step to the first (g_{l-1} = x_{l-1}), a and x (r, l).

Each checker prints one line and returns True or False; it never raises on a wrong answer (an exception
raised by the reader's function is reported, not propagated), and an answer left as ``None`` or ``...``
reads "not attempted yet".
"""
from __future__ import annotations

import math

import torch

from mambalab.exercises import not_attempted, verdict

__all__ = ["THREE_STEPS", "reverse_scan", "reverse_scan_expected", "scan_loop", "scan_skip_gate", "three_step_scan",
           "three_step_scan_expected", "zoh_step"]

# One channel, one state: A = -ln 2, so exp(Δ A) = 2^-Δ; B = C = 1, so y_t = h_t and Δ u B = Δ u.
THREE_STEPS = dict(A=-math.log(2.0), delta=(1.0, 1.0, 2.0), u=(2.0, 1.0, 2.0), B=1.0, C=1.0)


def _describe_error(err: Exception) -> str:
    return f"your function raised {type(err).__name__}: {err}"


def zoh_step(fn) -> bool:
    """``fn(delta, A, B) -> (A_bar, B_bar)``: the exact ZOH step, elementwise on float64 tensors of one shape
    (Δ > 0, A < 0)."""
    from mambalab.ref.discretization import coefficients

    if not_attempted(fn):
        return False
    if not callable(fn):
        return verdict(False, "", f"expected a function fn(delta, A, B) -> (A_bar, B_bar); got {fn!r}")
    deltas = [1e-3, 0.1, 0.5, 1.0, 5.0]
    As = [-0.01, -0.5, -1.0, -3.0]
    grid = [(dt, a, b) for dt in deltas for a in As for b in (1.0, -2.0)]
    delta, A, B = (torch.tensor(col, dtype=torch.float64) for col in zip(*grid))
    want_A = torch.tensor([coefficients("zoh", a, b, dt)[0] for dt, a, b in grid], dtype=torch.float64)
    want_B = torch.tensor([coefficients("zoh", a, b, dt)[1] for dt, a, b in grid], dtype=torch.float64)
    try:
        got_A, got_B = fn(delta.clone(), A.clone(), B.clone())
        got_A = torch.as_tensor(got_A, dtype=torch.float64).broadcast_to(want_A.shape)
        got_B = torch.as_tensor(got_B, dtype=torch.float64).broadcast_to(want_B.shape)
    except Exception as err:  # noqa: BLE001 - report any failure of the reader's code, never raise
        return verdict(False, "", _describe_error(err))
    rel = lambda got, want: float(((got - want).abs() / want.abs().clamp_min(1e-12)).nan_to_num(nan=math.inf).max())
    err_A, err_B = rel(got_A, want_A), rel(got_B, want_B)
    if err_A <= 1e-9 and err_B <= 1e-9:
        return verdict(True, f"right: Ā and B̄ match the exact zero-order hold at {len(grid)} (Δ, A, B) points "
                       f"(largest relative error {max(err_A, err_B):.1e})", "")
    worst = int(((got_B - want_B).abs() / want_B.abs()).nan_to_num(nan=math.inf).argmax())
    dt, a, b = grid[worst]
    return verdict(False, "", f"largest relative error: Ā {err_A:.3g}, B̄ {err_B:.3g}; e.g. at Δ={dt}, A={a}, B={b}: "
                   f"B̄ = {got_B[worst].item():.6g}, expected {want_B[worst].item():.6g} "
                   f"(Mamba's Euler B̄ = Δ B would be {dt * b:.6g})")


def three_step_scan_expected() -> tuple[float, float, float]:
    """y₀, y₁, y₂ of :data:`THREE_STEPS`, computed by the reference scan."""
    from mambalab.ref.selective_scan import selective_scan_ref

    s = THREE_STEPS
    y = selective_scan_ref(torch.tensor([[s["u"]]], dtype=torch.float64), torch.tensor([[s["delta"]]], dtype=torch.float64),
                           torch.tensor([[s["A"]]], dtype=torch.float64), torch.full((1, 1, 3), s["B"], dtype=torch.float64),
                           torch.full((1, 1, 3), s["C"], dtype=torch.float64))
    return tuple(float(v) for v in y[0, 0])


def three_step_scan(answer) -> bool:
    """``answer``: (y₀, y₁, y₂) of the scan :data:`THREE_STEPS` describes, starting from h = 0."""
    if not_attempted(answer):
        return False
    try:
        got = [float(v) for v in answer]
    except (TypeError, ValueError):
        return verdict(False, "", f"expected three numbers (y0, y1, y2); got {answer!r}")
    if len(got) != 3:
        return verdict(False, "", f"expected three numbers (y0, y1, y2); got {len(got)}")
    want = three_step_scan_expected()
    off = [g - w for g, w in zip(got, want)]
    ok = all(abs(o) <= 1e-6 * max(1.0, abs(w)) for o, w in zip(off, want))
    return verdict(ok, f"right: y = ({', '.join(f'{w:g}' for w in want)})",
                   f"got ({', '.join(f'{g:g}' for g in got)}): off by ({', '.join(f'{o:+.3g}' for o in off)})")


def scan_loop(fn) -> bool:
    """``fn(u, delta, A, B, C) -> y``: the selective scan as a loop over l, u and delta (b, d, l), A (d, n),
    B and C (b, n, l), y (b, d, l); checked against the reference on three shapes."""
    from mambalab.ref.selective_scan import selective_scan_ref

    if not_attempted(fn):
        return False
    if not callable(fn):
        return verdict(False, "", f"expected a function fn(u, delta, A, B, C) -> y; got {fn!r}")
    gen = torch.Generator().manual_seed(0)
    worst = 0.0
    for b, d, n, l in [(1, 1, 1, 5), (2, 3, 4, 17), (1, 5, 8, 33)]:
        u = torch.randn(b, d, l, generator=gen)
        delta = 0.5 * torch.rand(b, d, l, generator=gen)
        A = -(0.5 + torch.rand(d, n, generator=gen))
        B, C = torch.randn(b, n, l, generator=gen), torch.randn(b, n, l, generator=gen)
        want = selective_scan_ref(u, delta, A, B, C)
        try:
            got = torch.as_tensor(fn(u.clone(), delta.clone(), A.clone(), B.clone(), C.clone()))
        except Exception as err:  # noqa: BLE001 - report any failure of the reader's code, never raise
            return verdict(False, "", f"at (b, d, n, l) = {(b, d, n, l)}: {_describe_error(err)}")
        if tuple(got.shape) != tuple(want.shape):
            return verdict(False, "", f"at (b, d, n, l) = {(b, d, n, l)}: y has shape {tuple(got.shape)}, "
                           f"expected {tuple(want.shape)}")
        err = float((got.double() - want.double()).abs().nan_to_num(nan=math.inf).max())
        worst = max(worst, err)
        if err > 1e-4:
            return verdict(False, "", f"at (b, d, n, l) = {(b, d, n, l)}: max |y - reference| = {err:.3g}")
    return verdict(True, f"right: your loop matches the reference on three shapes (max |Δ| = {worst:.2g})", "")


def _kernel_device() -> str:
    # Triton kernels run on the GPU when there is one, else on CPU tensors through the interpreter.
    return "cuda" if torch.cuda.is_available() else "cpu"


def scan_skip_gate(fn) -> bool:
    """``fn(u, delta, A, B, C, D, z) -> out``: the minimal loop kernel with the skip D (d,) and the gate z
    (b, d, l) added, out = (Σ_n C_t h_t + D u_t) · silu(z_t); u, delta, z (b, d, l), A (d, n), B and C (b, n, l),
    all fp32 and contiguous, on the device Triton kernels run on. Checked against the reference on three shapes
    (small: on a CPU the interpreter runs the kernel)."""
    from mambalab.ref.selective_scan import selective_scan_ref

    if not_attempted(fn):
        return False
    if not callable(fn):
        return verdict(False, "", f"expected a function fn(u, delta, A, B, C, D, z) -> out; got {fn!r}")
    gen = torch.Generator().manual_seed(1)
    worst = 0.0
    for b, d, n, l in [(1, 1, 1, 4), (2, 3, 4, 9), (1, 6, 5, 13)]:
        x = dict(u=torch.randn(b, d, l, generator=gen), delta=0.5 * torch.rand(b, d, l, generator=gen),
                 A=-(0.5 + torch.rand(d, n, generator=gen)), B=torch.randn(b, n, l, generator=gen),
                 C=torch.randn(b, n, l, generator=gen), D=torch.randn(d, generator=gen),
                 z=torch.randn(b, d, l, generator=gen))
        want = selective_scan_ref(x["u"], x["delta"], x["A"], x["B"], x["C"], D=x["D"], z=x["z"])
        dev = {k: v.to(_kernel_device()) for k, v in x.items()}
        try:
            got = torch.as_tensor(fn(*(dev[k] for k in ("u", "delta", "A", "B", "C", "D", "z")))).detach().cpu()
        except Exception as err:  # noqa: BLE001 - report any failure of the reader's code, never raise
            return verdict(False, "", f"at (b, d, n, l) = {(b, d, n, l)}: {_describe_error(err)}")
        if tuple(got.shape) != tuple(want.shape):
            return verdict(False, "", f"at (b, d, n, l) = {(b, d, n, l)}: out has shape {tuple(got.shape)}, "
                           f"expected {tuple(want.shape)}")
        err = float((got.double() - want.double()).abs().nan_to_num(nan=math.inf).max())
        worst = max(worst, err)
        if err > 1e-4:
            no_gate = selective_scan_ref(x["u"], x["delta"], x["A"], x["B"], x["C"], D=x["D"])
            hint = ""
            if float((got.double() - no_gate.double()).abs().max()) <= 1e-4:
                hint = " (your output is the scan without the gate: multiply by silu(z) = z·sigmoid(z))"
            elif float((got.double() - (no_gate * x["z"]).double()).abs().max()) <= 1e-4:
                hint = " (your output is gated by z itself: the gate is silu(z) = z·sigmoid(z))"
            return verdict(False, "", f"at (b, d, n, l) = {(b, d, n, l)}: max |out - reference| = {err:.3g}{hint}")
    return verdict(True, f"right: your kernel with D and z matches the reference on three shapes "
                   f"(max |Δ| = {worst:.2g})", "")


def reverse_scan_expected(a: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """g_t = a_{t+1} g_{t+1} + x_t from t = l - 1 down to 0 (g_{l-1} = x_{l-1}), over the last axis of (r, l)."""
    g, out = torch.zeros_like(x[..., 0]), torch.empty_like(x)
    for t in reversed(range(x.shape[-1])):
        a_next = a[..., t + 1] if t + 1 < x.shape[-1] else torch.zeros_like(g)
        g = a_next * g + x[..., t]
        out[..., t] = g
    return out


def _forward_scan(a: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """h_t = a_t h_{t-1} + x_t, first step to last: the forward's recurrence, for a hint."""
    h, out = torch.zeros_like(x[..., 0]), torch.empty_like(x)
    for t in range(x.shape[-1]):
        h = a[..., t] * h + x[..., t]
        out[..., t] = h
    return out


def reverse_scan(fn) -> bool:
    """``fn(a, x) -> g``: the adjoint's recurrence g_t = a_{t+1} g_{t+1} + x_t, run from the last step to the first,
    on a and x (r, l) fp32 contiguous, on the device Triton kernels run on; g (r, l). In the backward of section 6,
    a_t = exp(Δ_t A) and x_t = C_t dy_t, and g is λ. Checked against :func:`reverse_scan_expected`."""
    if not_attempted(fn):
        return False
    if not callable(fn):
        return verdict(False, "", f"expected a function fn(a, x) -> g; got {fn!r}")
    gen = torch.Generator().manual_seed(2)
    worst = 0.0
    for r, l in [(1, 1), (3, 7), (5, 40)]:
        a, x = torch.rand(r, l, generator=gen), torch.randn(r, l, generator=gen)
        want = reverse_scan_expected(a, x)
        try:
            got = torch.as_tensor(fn(a.to(_kernel_device()), x.to(_kernel_device()))).detach().cpu()
        except Exception as err:  # noqa: BLE001 - report any failure of the reader's code, never raise
            return verdict(False, "", f"at (r, l) = {(r, l)}: {_describe_error(err)}")
        if tuple(got.shape) != (r, l):
            return verdict(False, "", f"at (r, l) = {(r, l)}: g has shape {tuple(got.shape)}, expected {(r, l)}")
        err = float((got.double() - want.double()).abs().nan_to_num(nan=math.inf).max())
        worst = max(worst, err)
        if err > 1e-5:
            hint = ""
            same_step = reverse_scan_expected(torch.cat([a[:, :1], a[:, :-1]], dim=1), x)   # a_t in place of a_{t+1}
            if float((got.double() - same_step.double()).abs().max()) <= 1e-5:
                hint = " (your g_t decays by a_t; the adjoint of h_{t+1} = a_{t+1} h_t + ... decays by a_{t+1})"
            elif float((got.double() - _forward_scan(a, x).double()).abs().max()) <= 1e-5:
                hint = " (your scan runs first step to last: the adjoint runs from t = l - 1 down to 0)"
            return verdict(False, "", f"at (r, l) = {(r, l)}: max |g - expected| = {err:.3g}{hint}")
    return verdict(True, f"right: your reverse scan matches on three shapes (max |Δ| = {worst:.2g})", "")
