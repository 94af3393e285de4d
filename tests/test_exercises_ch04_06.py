"""The exercise checkers of chapters 04-06 accept reference solutions worked out independently (a simulated
run, mamba-ssm's own source lines, a measured result file, a ring all-reduce simulated by hand) and reject
wrong answers, without raising."""
import glob
import json
import math
from pathlib import Path

import pytest
import torch

import mambalab  # noqa: F401  (before triton)
import triton
from mambalab import oracle
from mambalab.determinism import ARCH_PROFILES, emulate, fingerprint, shuffled_program_order
from mambalab.determinism.mamba_ssm_splits import mamba_ssm_norm_split
from mambalab.determinism.ssd_variation import gradient_variation, ssd_gradients, ssd_inputs
from mambalab.exercises import ch04, ch05, ch06
from mambalab.modules.lm import LMConfig
from mambalab.viz.determinism_plots import source_excerpt

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"


@pytest.mark.parametrize("checker", [lambda a: ch04.atomic_gradients(a), lambda a: ch04.head_split(a),
                                     lambda a: ch04.norm_row_blocks(a), lambda a: ch05.bit_patterns(a),
                                     lambda a: ch05.fold_order(a), lambda a: ch06.allreduce_bytes_per_layer(a),
                                     lambda a: ch06.activation_bytes_per_rank(a)])
def test_a_blank_answer_reads_not_attempted_and_a_malformed_one_does_not_raise(checker, capsys):
    assert checker(None) is False and checker(...) is False
    assert "not attempted" in capsys.readouterr().out
    assert checker("not an answer") is False
    assert "✗" in capsys.readouterr().out


# ----------------------------------------------------------------------------------- chapter 04

def _varying_gradients_simulated(g: int, h: int) -> set[str]:
    """Reference: the gradients that take more than one bit pattern over seeded program orders."""
    inputs = ssd_inputs(2, 64, h, 4, g, 4, seed=0)

    def run(r):
        with shuffled_program_order(r):
            return ssd_gradients(inputs, 16, reduction="atomic")
    return {v.name for v in gradient_variation(run, 4) if v.distinct > 1}


@pytest.mark.parametrize("g, h", [(1, 4), (4, 4)])
def test_atomic_gradients_accepts_what_a_simulated_run_varies(g, h, capsys):
    reference = _varying_gradients_simulated(g, h)
    assert ch04.atomic_gradients(reference, g=g, h=h) is True
    assert ch04.atomic_gradients({f"d{n}" for n in reference}, g=g, h=h) is True   # "dA" reads as "A"
    assert ch04.atomic_gradients(reference - {"A"}, g=g, h=h) is False
    assert "missing ['A']" in capsys.readouterr().out
    assert ch04.atomic_gradients(reference | {"x"}, g=g, h=h) is False


def _run_mamba_ssm_lines(obj, start, end, profile, **names):
    """Execute mamba-ssm's own lines (read from the installed package) under emulate(profile)."""
    code = source_excerpt(obj, start, end).code
    ns = dict(math=math, triton=triton, torch=torch, **names)
    with emulate(profile):
        exec(code, ns)   # noqa: S102 - mamba-ssm's installed source, a few assignments
    return ns


@pytest.mark.parametrize("profile", ["rtxa6000", "l4", "h200"])
def test_head_split_accepts_mamba_ssm_own_lines(profile):
    dout = torch.empty(1)
    ns = _run_mamba_ssm_lines(oracle.module("ops.triton.ssd_chunk_scan")._chunk_scan_bwd_dC, "sm_count =",
                              "nsplits =", profile, dout=dout, batch=4, nchunks=16, nheads=32,
                              nheads_ngroups_ratio=32)
    reference = (ns["nheads_per_program"], ns["nsplits"])
    assert ch04.head_split(reference, profile=profile) is True
    assert ch04.head_split((reference[0] + 1, reference[1]), profile=profile) is False


@pytest.mark.parametrize("profile", ["rtxa6000", "a100", "l4"])
def test_norm_row_blocks_accepts_mamba_ssm_own_lines(profile):
    rows, d = 256, 1024
    x, weight = torch.empty(rows, d), torch.empty(d)
    ns = _run_mamba_ssm_lines(oracle.module("ops.triton.layernorm_gated")._layer_norm_bwd, "MAX_FUSED_SIZE =",
                              "rows_per_program =", profile, x=x, weight=weight, bias=None, group_size=d, ngroups=1,
                              M=rows, N=d)
    reference = (ns["nrow_groups"], ns["rows_per_program"])
    assert ns["_dw"].shape == (reference[0], d)
    assert ch04.norm_row_blocks(reference, profile=profile, rows=rows, d=d) is True
    assert ch04.norm_row_blocks((reference[0], reference[1] + 1), profile=profile, rows=rows, d=d) is False


@pytest.mark.parametrize("profile, programs, per, full, partial, empty",
                         [("rtxa6000", 84, 4, 64, 0, 20), ("l4", 58, 5, 51, 1, 6), ("a100", 108, 3, 85, 1, 22)])
def test_norm_programs_and_their_rows_follow_mamba_ssm_kernel(profile, programs, per, full, partial, empty, capsys):
    # 256 rows of 1024: nrow_groups and rows_per_program from the launcher's lines, then each program's rows from
    # the kernel's own row_start / row_end lines, executed for every program id
    rows, d = 256, 1024
    gated = oracle.module("ops.triton.layernorm_gated")
    ns = _run_mamba_ssm_lines(gated._layer_norm_bwd, "MAX_FUSED_SIZE =", "rows_per_program =", profile,
                              x=torch.empty(rows, d), weight=torch.empty(d), bias=None, group_size=d, ngroups=1,
                              M=rows, N=d)
    assert (ns["nrow_groups"], ns["rows_per_program"]) == (programs, per)
    assert mamba_ssm_norm_split(rows, d, ARCH_PROFILES[profile].sm_count) == (programs, per)
    start_line = source_excerpt(gated._layer_norm_bwd_kernel, "row_start =").code
    end_line = source_excerpt(gated._layer_norm_bwd_kernel, "row_end =").code
    taken = []
    for pid in range(ns["nrow_groups"]):
        env = dict(row_block_id=pid, rows_per_program=ns["rows_per_program"], M=rows, min=min)
        exec(start_line.strip() + "\n" + end_line.strip(), env)   # noqa: S102 - mamba-ssm's two lines
        taken.append(max(0, env["row_end"] - env["row_start"]))
    assert sum(taken) == rows
    assert (taken.count(per), sum(0 < t < per for t in taken), taken.count(0)) == (full, partial, empty)
    assert ch04.norm_row_blocks((programs, per), profile=profile, rows=rows, d=d) is True
    assert f"{full} take {per}, {partial} fewer, {empty} none" in capsys.readouterr().out


# ----------------------------------------------------------------------------------- chapter 05

def test_bit_patterns_accepts_the_measured_h200_fingerprints():
    files = sorted(glob.glob(str(RESULTS / "*nb04_autotune_cell*.json")))
    assert files, "the H200 fingerprints of notebook 04's cell are kept in benchmarks/results/"
    pinned = json.loads(Path(files[-1]).read_text())["pinned"]
    profiles = tuple(pinned)
    reference = len({pinned[p]["B"] for p in profiles})
    assert ch05.bit_patterns(reference, impl="mamba_ssm", profiles=profiles) is True
    assert ch05.bit_patterns(reference - 1, impl="mamba_ssm", profiles=profiles) is False


def test_bit_patterns_of_mambalab_is_what_emulated_runs_give():
    inputs = ssd_inputs(2, 32, 4, 4, 1, 4, seed=1)
    prints = set()
    for profile in ("rtx4090", "rtxa6000"):
        with emulate(profile):
            prints.add(fingerprint(ssd_gradients(inputs, 16, reduction="deterministic")["B"]))
    assert ch05.bit_patterns(len(prints), impl="mambalab", profiles=("rtx4090", "rtxa6000")) is True
    assert ch05.bit_patterns(len(prints) + 1, impl="mambalab") is False


def _left_fold(x):
    acc = torch.zeros((), dtype=torch.float32)
    for v in x:
        acc = acc + v
    return acc


def _segmented_fold(x, segment=32):
    while x.numel() > segment:
        x = torch.stack([_left_fold(x[s:s + segment]) for s in range(0, x.numel(), segment)])
    return _left_fold(x)


def test_fold_order_accepts_the_segmented_fold_and_rejects_others(capsys):
    assert ch05.fold_order(_segmented_fold) is True
    assert ch05.fold_order(_left_fold) is False           # one long chain: other bits past 32 partials
    assert "off by" in capsys.readouterr().out
    assert ch05.fold_order(lambda x: 1 / 0) is False        # the reader's error is reported, not raised
    assert "ZeroDivisionError" in capsys.readouterr().out
    assert ch05.fold_order(lambda x: None) is False


# ----------------------------------------------------------------------------------- chapter 06

def _ring_allreduce_bytes_sent(numel, tp, element_size):
    """Reference: run a ring all-reduce over tp simulated ranks, counting the bytes rank 0 sends, and check
    every rank ends with the sum."""
    data = [torch.randn(numel, generator=torch.Generator().manual_seed(r), dtype=torch.float64) for r in range(tp)]
    total = sum(data)
    chunks = [list(d.chunk(tp)) for d in data]
    sent = 0
    for step in range(tp - 1):   # reduce-scatter: rank r sends chunk (r - step) to rank r + 1
        msgs = [(r, (r - step) % tp, chunks[r][(r - step) % tp].clone()) for r in range(tp)]
        for r, k, msg in msgs:
            chunks[(r + 1) % tp][k] = chunks[(r + 1) % tp][k] + msg
        sent += msgs[0][2].numel() * element_size
    for step in range(tp - 1):   # all-gather: rank r sends its finished chunk (r + 1 - step)
        msgs = [(r, (r + 1 - step) % tp, chunks[r][(r + 1 - step) % tp].clone()) for r in range(tp)]
        for r, k, msg in msgs:
            chunks[(r + 1) % tp][k] = msg
        sent += msgs[0][2].numel() * element_size
    for r in range(tp):
        assert torch.allclose(torch.cat(chunks[r]), total)
    return sent


@pytest.mark.parametrize("tp", [2, 4])
def test_allreduce_bytes_per_layer_accepts_a_simulated_ring(tp):
    d_model, tokens = 64, 32
    reference = _ring_allreduce_bytes_sent(tokens * d_model, tp, 2)
    assert ch06.allreduce_bytes_per_layer(reference, tp=tp, d_model=d_model, tokens=tokens) is True
    assert ch06.allreduce_bytes_per_layer(tp * tokens * d_model * 2, tp=tp, d_model=d_model, tokens=tokens) is False


def test_activation_bytes_per_rank_accepts_a_split_tensor():
    d_model, tokens, tp = 64, 32, 4
    act = torch.empty(tokens, d_model, dtype=torch.bfloat16)
    piece = act.chunk(tp, dim=0)[0]
    assert ch06.activation_bytes_per_rank(piece.numel() * piece.element_size(), tp=tp, d_model=d_model,
                                          tokens=tokens) is True
    assert ch06.activation_bytes_per_rank(act.numel() * act.element_size(), tp=tp, d_model=d_model,
                                          tokens=tokens) is False
    assert ch06.activation_bytes_per_rank(act.numel() * act.element_size(), tp=tp, sequence_parallel=False,
                                          d_model=d_model, tokens=tokens) is True


def test_parameters_per_rank_accepts_the_split_of_the_whole_count():
    config = LMConfig(vocab_size=32, d_model=32, n_layer=2, d_state=16, headdim=8, ngroups=4, chunk_size=16,
                      scan="reference")
    tp = 2
    replicated = config.d_model * (config.n_layer + 1)   # the blocks' norms and the final norm, held whole
    reference = (config.num_parameters() + (tp - 1) * replicated) // tp
    assert ch06.parameters_per_rank(reference, config, tp=tp) is True
    assert ch06.parameters_per_rank(config.num_parameters(), config, tp=tp) is False
