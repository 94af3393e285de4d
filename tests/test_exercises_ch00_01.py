"""The exercise checkers of chapter 01 accept reference solutions written independently of them (the ZOH
step from its formula, a hand-worked three-step scan, a loop over l written from the recurrence) and reject
wrong answers, without raising."""
import math

import pytest
import torch

from mambalab.exercises import ch01


@pytest.mark.parametrize("checker", [ch01.zoh_step, ch01.three_step_scan, ch01.scan_loop])
def test_a_blank_answer_reads_not_attempted_and_a_malformed_one_does_not_raise(checker, capsys):
    assert checker(None) is False and checker(...) is False
    assert "not attempted" in capsys.readouterr().out
    assert checker("not an answer") is False
    assert "✗" in capsys.readouterr().out


# ----------------------------------------------------------------------------------- the ZOH step

def zoh_reference(delta, A, B):
    """Ā = e^{ΔA}; B̄ = (ΔA)⁻¹ (e^{ΔA} - 1) Δ B, written with expm1 for small ΔA."""
    return torch.exp(delta * A), torch.expm1(delta * A) / A * B


def test_zoh_step_accepts_the_formula_and_rejects_euler(capsys):
    assert ch01.zoh_step(zoh_reference) is True
    assert "✓" in capsys.readouterr().out
    euler = lambda delta, A, B: (torch.exp(delta * A), delta * B)       # Mamba's simplification
    assert ch01.zoh_step(euler) is False
    out = capsys.readouterr().out
    assert "✗" in out and "relative error" in out


def test_zoh_step_reports_a_function_that_raises(capsys):
    def broken(delta, A, B):
        raise RuntimeError("not written yet")
    assert ch01.zoh_step(broken) is False
    assert "RuntimeError: not written yet" in capsys.readouterr().out


# ----------------------------------------------------------------------------------- three steps by hand

def test_three_step_scan_accepts_the_hand_worked_answer(capsys):
    s = ch01.THREE_STEPS
    h, ys = 0.0, []
    for dt, x in zip(s["delta"], s["u"]):     # h_t = 2^(-Δ_t) h_{t-1} + Δ_t x_t, y_t = h_t
        h = math.exp(dt * s["A"]) * h + dt * x * s["B"]
        ys.append(s["C"] * h)
    assert ys == pytest.approx([2.0, 2.0, 4.5])
    assert ch01.three_step_scan((2.0, 2.0, 4.5)) is True
    assert ch01.three_step_scan(ys) is True
    assert ch01.three_step_scan((2.0, 2.0, 4.0)) is False
    assert "off by (+0, +0, -0.5)" in capsys.readouterr().out.split("\n")[-2]
    assert ch01.three_step_scan((2.0, 2.0)) is False


# ----------------------------------------------------------------------------------- the loop over l

def scan_loop_reference(u, delta, A, B, C):
    """The minimal kernel's loop in PyTorch: h (b, d, n) carried over l steps."""
    b, d, l = u.shape
    h = u.new_zeros(b, d, A.shape[1])
    ys = []
    for t in range(l):
        dt = delta[:, :, t, None]                                            # (b, d, 1)
        h = torch.exp(dt * A) * h + dt * u[:, :, t, None] * B[:, None, :, t]  # (b, d, n)
        ys.append((h * C[:, None, :, t]).sum(-1))                            # (b, d)
    return torch.stack(ys, dim=-1)                                           # (b, d, l)


def test_scan_loop_accepts_a_loop_and_rejects_a_loop_that_forgets_the_decay(capsys):
    assert ch01.scan_loop(scan_loop_reference) is True
    assert "✓" in capsys.readouterr().out

    def no_decay(u, delta, A, B, C):
        return scan_loop_reference(u, delta, torch.zeros_like(A), B, C)
    assert ch01.scan_loop(no_decay) is False
    assert "max |y - reference|" in capsys.readouterr().out
    assert ch01.scan_loop(lambda u, delta, A, B, C: u[..., :-1]) is False
    assert "shape" in capsys.readouterr().out


# ----------------------------------------------------------------------------------- kernels: D and z, reverse scan

import triton  # noqa: E402 - after mambalab's import (conftest), which switches the interpreter on where needed
import triton.language as tl  # noqa: E402


@triton.jit
def _scan_skip_gate_kernel(
    u_ptr, delta_ptr, A_ptr, B_ptr, C_ptr,   # as the minimal loop kernel
    D_ptr,        # (d,) skip weight
    z_ptr,        # (b, d, l) gate
    out_ptr,      # (b, d, l) fp32
    d, n, l,
    BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid_b, pid_d = tl.program_id(0), tl.program_id(1)
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    mask_d, mask_n = offs_d < d, offs_n < n
    A = tl.load(A_ptr + offs_d[:, None] * n + offs_n[None, :], mask=mask_d[:, None] & mask_n[None, :], other=0.0)
    Dv = tl.load(D_ptr + offs_d, mask=mask_d, other=0.0)
    row = (pid_b * d + offs_d) * l
    bc = (pid_b * n + offs_n) * l
    h = tl.zeros((BLOCK_D, BLOCK_N), dtype=tl.float32)
    for t in range(0, l):
        u = tl.load(u_ptr + row + t, mask=mask_d, other=0.0)
        dt = tl.load(delta_ptr + row + t, mask=mask_d, other=0.0)
        Bt = tl.load(B_ptr + bc + t, mask=mask_n, other=0.0)
        Ct = tl.load(C_ptr + bc + t, mask=mask_n, other=0.0)
        zt = tl.load(z_ptr + row + t, mask=mask_d, other=0.0)
        h = tl.exp(dt[:, None] * A) * h + (dt * u)[:, None] * Bt[None, :]
        y = tl.sum(h * Ct[None, :], axis=1) + Dv * u
        tl.store(out_ptr + row + t, y * zt * tl.sigmoid(zt), mask=mask_d)


def scan_skip_gate_solution(u, delta, A, B, C, D, z):
    """The minimal loop kernel, plus y += D u and out = y · silu(z) at each step."""
    b, d, l = u.shape
    n = A.shape[1]
    out = torch.empty(b, d, l, device=u.device, dtype=torch.float32)
    _scan_skip_gate_kernel[(b, triton.cdiv(d, 2))](u, delta, A, B, C, D, z, out, d, n, l,
                                                   BLOCK_D=2, BLOCK_N=triton.next_power_of_2(n))
    return out


@triton.jit
def _reverse_scan_kernel(a_ptr, x_ptr, g_ptr, r, l, BLOCK_R: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    mask = rows < r
    g = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for i in range(0, l):
        t = l - 1 - i                                            # the last step first
        a_next = tl.load(a_ptr + rows * l + t + 1, mask=mask & (t + 1 < l), other=0.0)
        g = a_next * g + tl.load(x_ptr + rows * l + t, mask=mask, other=0.0)
        tl.store(g_ptr + rows * l + t, g, mask=mask)


def reverse_scan_solution(a, x):
    """g_t = a_{t+1} g_{t+1} + x_t, one program for BLOCK_R rows, a loop from t = l - 1 down to 0."""
    r, l = x.shape
    g = torch.empty_like(x)
    _reverse_scan_kernel[(triton.cdiv(r, 4),)](a, x, g, r, l, BLOCK_R=4)
    return g


def test_scan_skip_gate_accepts_a_kernel_and_rejects_one_without_silu(capsys):
    assert ch01.scan_skip_gate(None) is False
    assert "not attempted" in capsys.readouterr().out
    assert ch01.scan_skip_gate(scan_skip_gate_solution) is True
    assert "✓" in capsys.readouterr().out

    def gated_by_z(u, delta, A, B, C, D, z):   # y · z instead of y · silu(z)
        return scan_skip_gate_solution(u, delta, A, B, C, D, z) / torch.sigmoid(z)
    assert ch01.scan_skip_gate(gated_by_z) is False
    assert "gated by z itself" in capsys.readouterr().out

    def no_skip(u, delta, A, B, C, D, z):
        return scan_skip_gate_solution(u, delta, A, B, C, torch.zeros_like(D), z)
    assert ch01.scan_skip_gate(no_skip) is False
    assert "max |out - reference|" in capsys.readouterr().out


def test_reverse_scan_accepts_a_kernel_and_rejects_the_wrong_decay_and_direction(capsys):
    assert ch01.reverse_scan(None) is False and ch01.reverse_scan("no") is False
    capsys.readouterr()
    assert ch01.reverse_scan(reverse_scan_solution) is True
    assert "✓" in capsys.readouterr().out

    def decays_by_a_t(a, x):
        return reverse_scan_solution(torch.cat([a[:, :1], a[:, :-1]], dim=1).contiguous(), x)
    assert ch01.reverse_scan(decays_by_a_t) is False
    assert "decays by a_t" in capsys.readouterr().out

    def left_to_right(a, x):
        h, out = torch.zeros_like(x[:, 0]), torch.empty_like(x)
        for t in range(x.shape[1]):
            h = a[:, t] * h + x[:, t]
            out[:, t] = h
        return out
    assert ch01.reverse_scan(left_to_right) is False
    assert "first step to last" in capsys.readouterr().out
    assert ch01.reverse_scan(lambda a, x: x[:, :-1]) is False
    assert "shape" in capsys.readouterr().out


def test_the_reference_reverse_scan_is_the_adjoint_of_the_scan():
    # Independent of the checker's loop: g = Jᵀ x for the linear map x -> h of h_t = a_t h_{t-1} + x_t.
    gen = torch.Generator().manual_seed(3)
    a, x = torch.rand(1, 6, generator=gen, dtype=torch.float64), torch.randn(1, 6, generator=gen, dtype=torch.float64)
    J = torch.autograd.functional.jacobian(lambda v: ch01._forward_scan(a, v.view(1, -1)).view(-1), torch.zeros(6, dtype=torch.float64))
    torch.testing.assert_close(ch01.reverse_scan_expected(a, x)[0], J.T @ x[0])
