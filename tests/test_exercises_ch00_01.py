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
