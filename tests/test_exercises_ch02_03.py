"""The exercise checkers of chapters 02 and 03 accept reference solutions worked out independently (a mask built
column by column in float64, a crossing solved in closed form, one step of the Mamba-3 recurrence, a cost
counted from the step's own tensors) and reject wrong answers, without raising."""
import math

import pytest
import torch

from mambalab.exercises import ch02, ch03
from mambalab.ref import mamba3 as mamba3_ref


@pytest.mark.parametrize("checker", [ch02.decay_mask, ch02.crossover_chunk_size, ch03.trapezoid_weights,
                                     ch03.decode_intensity])
def test_a_blank_answer_reads_not_attempted_and_a_malformed_one_does_not_raise(checker, capsys):
    assert checker(None) is False and checker(...) is False
    assert "not attempted" in capsys.readouterr().out
    assert checker("not an answer") is False
    assert "✗" in capsys.readouterr().out


# ----------------------------------------------------------------------------------- chapter 02

def _mask_by_columns(a):
    """Reference: column j of L is exp of the running sum of a[j+1:], started afresh in float64 at j."""
    l = a.shape[0]
    a = a.double()
    L = torch.zeros(l, l, dtype=torch.float64)
    for j in range(l):
        L[j, j] = 1.0
        L[j + 1:, j] = torch.exp(torch.cumsum(a[j + 1:], dim=0))
    return L


def _mask_naive_fp32(a):
    """exp(cs_t - cs_j) with cs a running sum rounded to fp32 at every step: what a sequential fp32 accumulator
    computes."""
    cs = torch.empty_like(a, dtype=torch.float32)
    acc = torch.zeros((), dtype=torch.float32)
    for t in range(a.shape[0]):
        acc = acc + a[t].float()
        cs[t] = acc
    return torch.exp(cs[:, None] - cs[None, :]).tril()


def test_decay_mask_accepts_the_column_by_column_mask_and_rejects_the_naive_one(capsys):
    assert ch02.decay_mask(_mask_by_columns) is True
    assert "✓" in capsys.readouterr().out
    assert ch02.decay_mask(_mask_naive_fp32) is False           # the slow stretch vanishes from an fp32 running sum
    out = capsys.readouterr().out
    assert "fp32, -1e4 then slow decay" in out and "max |L - exact|" in out
    assert ch02.decay_mask(lambda a: _mask_by_columns(a).T) is False    # upper triangular: wrong side
    assert ch02.decay_mask(lambda a: _mask_by_columns(a)[:-1]) is False
    assert "expected shape" in capsys.readouterr().out
    assert ch02.decay_mask(lambda a: 1 / 0) is False             # the reader's error is reported, not raised
    assert "ZeroDivisionError" in capsys.readouterr().out


def _crossing_closed_form(p, n):
    """Reference: q (n + p) <= 4 p n + 2 p n / q  <=>  (n + p) q² - 4 p n q - 2 p n <= 0 (the lower triangle of each
    chunk, q²/2 entries, as the chunk-scan kernel visits it), solved for q; then the largest power of two below the
    root."""
    root = (2 * p * n + math.sqrt(4 * (p * n) ** 2 + 2 * (n + p) * p * n)) / (n + p)
    return 2 ** math.floor(math.log2(root))


@pytest.mark.parametrize("p, n", [(64, 128), (64, 16), (128, 256), (32, 64)])
def test_crossover_chunk_size_accepts_the_closed_form_crossing(p, n, capsys):
    reference = _crossing_closed_form(p, n)
    assert ch02.crossover_chunk_size(reference, p=p, n=n) is True
    assert ch02.crossover_chunk_size(2 * reference, p=p, n=n) is False
    assert "already costs more" in capsys.readouterr().out
    assert ch02.crossover_chunk_size(reference // 2, p=p, n=n) is False
    assert ch02.crossover_chunk_size(reference + 1, p=p, n=n) is False   # not a power of two
    assert ch02.crossover_chunk_size(float(reference) + 0.5, p=p, n=n) is False


def test_crossover_chunk_size_at_mamba2s_sizes_is_128_and_32_at_n_16():
    assert _crossing_closed_form(64, 128) == 128 == ch02.crossover_chunk_size_expected(64, 128)
    assert _crossing_closed_form(64, 16) == 32 == ch02.crossover_chunk_size_expected(64, 16)
    block, state = ch02.chunk_flops(64)
    # a chunk of 64: 64²/2 entries of C Bᵀ (n = 128 multiply-adds each) and of the product with X (p = 64)
    assert block == 2 * (64 * 64 / 2) * (128 + 64) / 64 and state == 4 * 64 * 128 + 2 * 64 * 128 / 64
    assert not ch02.crossover_chunk_size(64, p=64, n=128)           # the full-square count's answer
    with pytest.raises(ValueError, match="positive"):
        ch02.chunk_flops(0)


# ----------------------------------------------------------------------------------- chapter 03

def _weights_from_one_step(dt, lam, a):
    """Reference: one step of Mamba-3's recurrence (mamba3_step_ref) with p = 1, n = 2, no rotation and a zero
    state: the previous input alone gives its weight in the new state, the current input alone its own."""
    f64 = dict(dtype=torch.float64)

    def new_state(v_prev, v_now):
        state = mamba3_ref.Mamba3State(torch.zeros(1, 1, 1, **f64), torch.zeros(1, 1, 1, 2, **f64),
                                       torch.tensor([[[[1.0, 0.0]]]], **f64), torch.tensor([[[v_prev]]], **f64))
        e = torch.tensor([[[[1.0, 0.0]]]], **f64)                          # (b, r, g, n): k = q = e_0
        scalar = lambda x: torch.tensor([[x]], **f64)                      # (b, h)
        _, after = mamba3_ref.mamba3_step_ref(state, e, e, torch.tensor([[[v_now]]], **f64), scalar(a * dt),
                                              scalar(dt), scalar(lam), torch.zeros(1, 1, 2, **f64),
                                              torch.zeros(1, 1, 2, **f64), torch.zeros(1, 1, 1, **f64))
        return after.ssm[0, 0, 0, 0].item()

    return new_state(1.0, 0.0), new_state(0.0, 1.0)


@pytest.mark.parametrize("dt, lam, a", [(0.5, 0.25, -2.0), (0.1, 0.5, -1.0), (1.0, 1.0, -0.5)])
def test_trapezoid_weights_accepts_one_step_of_the_recurrence(dt, lam, a, capsys):
    reference = _weights_from_one_step(dt, lam, a)
    assert ch03.trapezoid_weights(reference, dt=dt, lam=lam, a=a) is True
    assert ch03.trapezoid_weights((reference[0] + 1e-3, reference[1]), dt=dt, lam=lam, a=a) is False
    assert ch03.trapezoid_weights((reference[0], reference[1], 0.0), dt=dt, lam=lam, a=a) is False
    assert "✗" in capsys.readouterr().out


def test_trapezoid_weights_names_a_swapped_pair(capsys):
    prev, cur = _weights_from_one_step(0.5, 0.25, -2.0)
    assert ch03.trapezoid_weights((cur, prev)) is False
    assert "swapped" in capsys.readouterr().out


def _intensity_counted(r, p, n, state_bytes=4, act_bytes=2):
    """Reference, counted from the tensors of one step of mamba3_step_ref: a multiply-add per element of the
    state H for each rank of each of its three rank-r products (U_prev, U and the read-outs H q̂_r), one
    multiply per element for the decay, and the O(r p) gating and projections (8 r p); bytes: the fp32 state
    read and written, this token's q, k, x, z, y and the previous k, v read and the new ones written."""
    b, h, g, a = 1, 1, 1, 1
    f32 = dict(dtype=torch.float32)
    state = mamba3_ref.zero_state(b, h, p, n, r, a, torch.float32, "cpu")
    token = dict(q=torch.randn(b, r, g, n), k=torch.randn(b, r, g, n), v=torch.randn(b, h, p),
                 adt=-torch.ones(b, h), dt=torch.ones(b, h), trap=torch.full((b, h), 0.5),
                 q_bias=torch.zeros(h, r, n), k_bias=torch.zeros(h, r, n), angles=torch.zeros(b, h, a, **f32))
    if r > 1:
        token.update(mimo_v=torch.ones(h, r, p), mimo_o=torch.ones(h, r, p))
    _, after = mamba3_ref.mamba3_step_ref(state, **token)
    assert after.ssm.shape == state.ssm.shape and after.k.shape == state.k.shape   # what the step writes back
    flops = 3 * r * 2 * state.ssm.numel() + state.ssm.numel() + 8 * r * token["v"].numel()
    moved_state = 2 * state.ssm.numel() * state_bytes
    moved_tokens = act_bytes * (token["q"].numel() + token["k"].numel() + 3 * token["v"].numel()
                                + 2 * (state.k.numel() + state.v.numel()))
    return flops / (moved_state + moved_tokens)


@pytest.mark.parametrize("r", [1, 2, 4, 8])
def test_decode_intensity_accepts_a_count_from_the_steps_tensors(r, capsys):
    reference = _intensity_counted(r, 64, 128)
    assert ch03.decode_intensity(reference, rank=r) is True
    out = capsys.readouterr().out
    assert "fp32 ridge point of 14 " in out and "bf16 tensor-core one of 206" in out
    # the fp32 ceiling: the H200 datasheet's 67 TFLOP/s over 4.8 TB/s; r = 8 comes within 3× of it
    if r == 8:
        assert 67e12 / 4.8e12 / reference < 3
    assert ch03.decode_intensity(reference * 1.05, rank=r) is False
    assert ch03.decode_intensity(reference, rank=2 * r) is False      # twice the rank: about twice the FLOPs a byte
    assert "expected" in capsys.readouterr().out


def test_roofline_figure_draws_both_ceilings():
    from mambalab.viz import mamba3_plots as mp

    fig = mp.roofline_figure([1, 2, 4, 8], 64, 128)
    tensor, fp32 = fig.data[1], fig.data[2]
    assert tensor.y[0] == pytest.approx(989e12 / 4.8e12) and "tensor-core" in tensor.name
    assert fp32.y[0] == pytest.approx(67e12 / 4.8e12) and "= 14 FLOP/byte" in fp32.name
    assert len(mp.roofline_figure([1, 2], 64, 128, fp32_flops=None).data) == 2
