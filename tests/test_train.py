"""The trainer's parts that need no process group: tasks, clear errors, the init-hook marker, the
vocab-parallel loss at TP = 1, the reference scan, and a short single-process run with exact resume.
(Multi-process runs live in tests/distributed/.)"""
import json

import pytest
import torch
import torch.nn.functional as F

import mambalab  # noqa: F401
from mambalab.modules import Mamba2
from mambalab.modules.lm import LMConfig, MambaLM, reset_biases
from mambalab.parallel import ParallelLayout, TensorParallelMamba2, TensorParallelMambaLM, vocab_parallel_cross_entropy
from mambalab.parallel.layout import layout_from_env
from mambalab.train import TrainConfig, make_batch, train
from mambalab.train.cli import add_arguments, config_from_args
from mambalab.train.tasks import IGNORE_INDEX, MARKER

from conftest import KERNEL_DEVICE, requires_gpu

TINY = dict(vocab_size=32, d_model=16, n_layer=1, d_state=8, headdim=8, ngroups=2, chunk_size=16, scan="reference")


def fake_layout(tp, tp_rank=0):
    """A layout for constructing one rank's shard without a process group (no forward)."""
    return ParallelLayout(world_size=tp, rank=tp_rank, tp=tp, dp=1, tp_rank=tp_rank, dp_rank=0, local_rank=tp_rank)


# ------------------------------------------------------------------------------------------ tasks
def test_selective_copying_targets_are_the_context_data_in_order():
    ids, targets = make_batch("selective_copying", 3, 40, 16, seed=0, step=5)
    assert ids.shape == targets.shape == (3, 40)
    for row_ids, row_t in zip(ids, targets):
        data = row_ids[:32][row_ids[:32] >= 2]                       # the data tokens among the noise
        assert torch.equal(row_t[32:], data) and (row_ids[32:] == MARKER).all()
        assert (row_t[:32] == IGNORE_INDEX).all()


def test_mqar_targets_are_the_values_of_the_queried_keys():
    ids, targets = make_batch("mqar", 2, 24, 64, seed=1, step=0)
    for row_ids, row_t in zip(ids, targets):
        table = dict(zip(row_ids[0:12:2].tolist(), row_ids[1:12:2].tolist()))
        assert len(table) == 6                                       # distinct keys
        assert [table[k] for k in row_ids[12:].tolist()] == row_t[12:].tolist()


def test_batches_depend_on_seed_and_step_and_replicas_split_the_global_batch():
    a = make_batch("mqar", 4, 16, 32, seed=0, step=3)
    assert all(torch.equal(x, y) for x, y in zip(a, make_batch("mqar", 4, 16, 32, seed=0, step=3)))
    assert not torch.equal(a[0], make_batch("mqar", 4, 16, 32, seed=0, step=4)[0])
    halves = [make_batch("mqar", 2, 16, 32, seed=0, step=3, replica=r, replicas=2)[0] for r in range(2)]
    assert torch.equal(torch.cat(halves), a[0])
    with pytest.raises(ValueError, match="task must be one of"):
        make_batch("copy", 1, 16, 32, 0, 0)


# ------------------------------------------------------------------------------------------ errors
def test_clear_errors_for_tp_that_does_not_divide_and_bad_world_size():
    with pytest.raises(ValueError, match=r"tp = 4 must divide nheads = 2"):
        TensorParallelMamba2(8, fake_layout(4), d_state=8, headdim=8, ngroups=1)
    with pytest.raises(ValueError, match=r"tp = 2 must divide ngroups = 1"):
        TensorParallelMamba2(16, fake_layout(2), d_state=8, headdim=8, ngroups=1)
    with pytest.raises(ValueError, match=r"tp = 4 must divide vocab_size = 30"):
        TensorParallelMambaLM(LMConfig(**{**TINY, "vocab_size": 30, "ngroups": 4}), fake_layout(4))
    with pytest.raises(ValueError, match=r"world size 6 .* != tp × dp = 2 × 2"):
        layout_from_env(2, 2, env={"WORLD_SIZE": "6", "RANK": "0"})
    with pytest.raises(ValueError, match=r"world size 6 .* not a multiple of tp = 4"):
        layout_from_env(4, env={"WORLD_SIZE": "6", "RANK": "0"})
    assert layout_from_env(2, env={"WORLD_SIZE": "8", "RANK": "5", "LOCAL_RANK": "1"}) == (8, 5, 1, 4)


def test_shard_holds_its_share_of_every_projection():
    rank1 = TensorParallelMamba2(16, fake_layout(2, 1), d_state=8, headdim=8, ngroups=2, bias=True)
    full = Mamba2(16, d_state=8, headdim=8, ngroups=2, bias=True)
    assert rank1.in_proj.weight.shape[0] * 2 == full.in_proj.weight.shape[0]
    assert rank1.out_proj.weight.shape[1] * 2 == full.out_proj.weight.shape[1]
    assert rank1.out_proj.bias is None                               # the row-parallel bias lives on rank 0
    assert TensorParallelMamba2(16, fake_layout(2, 0), d_state=8, headdim=8, ngroups=2, bias=True).out_proj.bias \
        is not None
    assert (rank1.nheads, rank1.ngroups, rank1.d_inner) == (2, 1, 16)


# ------------------------------------------------------------------------------------------ pieces
def test_vocab_parallel_cross_entropy_at_tp1_is_cross_entropy():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(10, 7, generator=g, dtype=torch.float64, requires_grad=True)
    target = torch.randint(0, 7, (10,), generator=g)
    target[3] = IGNORE_INDEX
    ours = vocab_parallel_cross_entropy(logits, target)
    want = F.cross_entropy(logits, target, reduction="none", ignore_index=IGNORE_INDEX)
    torch.testing.assert_close(ours, want)
    (g1,) = torch.autograd.grad(ours.sum(), logits)
    (g2,) = torch.autograd.grad(want.sum(), logits)
    torch.testing.assert_close(g1, g2)


def test_reference_scan_matches_the_kernel_in_mamba2():
    torch.manual_seed(0)
    kernel = Mamba2(16, d_state=16, headdim=8, ngroups=2, chunk_size=16).to(KERNEL_DEVICE)
    reference = Mamba2(16, d_state=16, headdim=8, ngroups=2, chunk_size=16, scan="reference").to(KERNEL_DEVICE)
    reference.load_state_dict(kernel.state_dict())
    u = torch.randn(2, 20, 16, device=KERNEL_DEVICE)
    torch.testing.assert_close(reference(u), kernel(u), atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="scan must be one of"):
        Mamba2(16, headdim=8, scan="fast")


def test_init_hook_respects_the_no_reinit_marker():
    torch.manual_seed(0)
    model = MambaLM(LMConfig(**TINY))
    dt_bias = model.layers[0].mixer.dt_bias.detach().clone()
    assert model.layers[0].mixer.dt_bias._no_reinit
    assert "layers.0.mixer.dt_bias" not in reset_biases(model, respect_no_reinit=True)
    assert torch.equal(model.layers[0].mixer.dt_bias, dt_bias) and (model.layers[0].mixer.conv1d.bias == 0).all()
    assert "layers.0.mixer.dt_bias" in reset_biases(model, respect_no_reinit=False)
    assert (model.layers[0].mixer.dt_bias == 0).all()


# ------------------------------------------------------------------------------------------ one process
def test_single_process_training_learns_and_resumes_exactly(tmp_path):
    cfg = dict(model=LMConfig(**TINY), task="mqar", batch_size=4, seq_len=16, steps=6, warmup=2, progress=False)
    whole = train(TrainConfig(out_dir=str(tmp_path / "a"), checkpoint_dir=str(tmp_path / "ck"), checkpoint_every=3,
                              deterministic=True, **cfg))
    resumed = train(TrainConfig(resume=str(tmp_path / "ck" / "step_000003"), out_dir=str(tmp_path / "b"),
                                deterministic=True, **cfg))
    assert [m["loss"] for m in resumed] == [m["loss"] for m in whole[3:]]          # bit for bit
    assert whole[-1]["loss"] < whole[0]["loss"]
    fingerprints = [json.loads((tmp_path / run / "summary.json").read_text())["fingerprint_per_rank"]
                    for run in ("a", "b")]
    assert fingerprints[0] == fingerprints[1] and len(fingerprints[0][0]) == 16    # the same final weights
    assert not torch.are_deterministic_algorithms_enabled()                        # the switch was scoped
    rows = [json.loads(line) for line in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(6)) and all(r["tokens_per_s"] > 0 for r in rows)


def test_command_line_flags_reach_the_config():
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    cfg = config_from_args(parser.parse_args(["--tp", "2", "--sequence-parallel", "--d-model", "64", "--task", "mqar",
                                              "--no-tie-embeddings"]))
    assert (cfg.tp, cfg.sequence_parallel, cfg.model.d_model, cfg.task, cfg.model.tie_embeddings) == \
        (2, True, 64, "mqar", False)
    assert cfg.model.scan == ("kernel" if torch.cuda.is_available() else "reference")


def test_bf16_autocast_over_fp32_master_parameters_trains(tmp_path):
    # The GPU path's AMP (amp="auto" there), forced on the CPU, so the CPU suite covers its first step.
    rows = train(TrainConfig(model=LMConfig(**TINY), task="mqar", batch_size=4, seq_len=16, steps=3, warmup=1,
                             amp="bf16", progress=False, out_dir=str(tmp_path)))
    assert len(rows) == 3 and all(torch.isfinite(torch.tensor(r["loss"])) for r in rows)


@pytest.mark.gpu
@requires_gpu
def test_gpu_training_step_with_kernels_and_bf16_autocast(tmp_path):
    # vocab 128: MQAR at seq_len 128 asks 32 pairs of distinct keys, (vocab - 2) / 2 >= 32
    model = LMConfig(**{**TINY, "scan": "kernel", "d_model": 64, "headdim": 16, "chunk_size": 64, "vocab_size": 128})
    rows = train(TrainConfig(model=model, task="mqar", batch_size=4, seq_len=128, steps=4, warmup=1, progress=False,
                             out_dir=str(tmp_path)))
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in rows) and rows[-1]["peak_mem_gib"] > 0


def test_watchdog_ends_a_stalled_process_with_a_clear_error():
    import subprocess
    import sys

    code = ("import time; from mambalab.train.faults import Watchdog\n"
            "w = Watchdog(1.0, lambda: 'rank 3 (tp_rank 1, dp_rank 1)').start(); w.beat(7); time.sleep(30)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 3
    assert "rank 3 (tp_rank 1, dp_rank 1): no step finished for 1 s after step 7" in proc.stderr
