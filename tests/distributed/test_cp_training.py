"""Context parallelism in the block and the trainer, on CPU processes (gloo), launched with torchrun.

The context-parallel SSD runs the Triton kernels (in the interpreter here), so the model is tiny (one layer,
d_model 16, two heads) and runs are four steps of two sequences of 64 tokens, cut into pieces of 32.

What agrees with what, and why not bit for bit: a CP run regroups sums that one process makes whole. Each CP
rank's in_proj and out_proj weight gradients sum over its own tokens, then the ranks' parts are added; the
conv's dweight and the per-head sums (dA, dD, d dt_bias) likewise (:mod:`mambalab.parallel.context`); the loss
is a sum of per-rank shares. So losses and gradients agree to float32 rounding, not bitwise; per-position
results of the ring itself are bitwise (tests/distributed/test_context_parallel.py). A CP run against itself,
resumed from its own checkpoint, is bitwise: the same launches in the same order, and every sum over ranks in
rank order.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import mambalab  # noqa: F401
from mambalab.modules.lm import LMConfig
from mambalab.modules.mamba2 import Mamba2
from mambalab.parallel import ContextParallelMamba2
from mambalab.parallel.layout import single_process_layout
from mambalab.train import TrainConfig, train
from mambalab.train.trainer import ConfigError
from mambalab.train.launch import launch, read_metrics

HERE = Path(__file__).resolve().parent
# two heads of 16 and two groups: TP = 2 takes one of each; chunk 16 and seq_len 64 give CP = 2 pieces of 32
MODEL = dict(vocab_size=32, d_model=16, n_layer=1, d_state=8, headdim=16, ngroups=2, chunk_size=16, scan="kernel")
RUN = dict(task="mqar", batch_size=2, seq_len=64, steps=4, lr=3e-3, warmup=2, progress=False, timeout_s=120,
           deterministic=True)


def config(**kw) -> TrainConfig:
    return TrainConfig(model=LMConfig(**MODEL), **{**RUN, **{k: str(v) if isinstance(v, Path) else v
                                                            for k, v in kw.items()}})


def _ok(proc):
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"


def run(nproc: int, **kw) -> subprocess.CompletedProcess:
    """The trainer under torchrun, on CPU processes (gloo) even where GPUs exist."""
    return launch(config(**kw), nproc, timeout=300, hide_gpus=True, check=False)


def losses(out_dir: Path) -> list[float]:
    return [m["loss"] for m in read_metrics(out_dir)]


# ------------------------------------------------------------------------------------------ the block
def test_block_tp2_cp2_forward_and_every_gradient_equal_one_process_with_packed_sequences(tmp_path):
    """cp_block_worker.py: TP = 2 × CP = 2 against the single-process Mamba2 block, the output, d u and every
    parameter's gradient, with packed sequences (one across the cut, one starting at it)."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4",
           str(HERE / "cp_block_worker.py"), str(tmp_path)]
    _ok(subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300))
    got = json.loads((tmp_path / "block.json").read_text())
    assert set(got) == {"packed"}
    for name, result in got.items():
        assert {"out", "du", "d in_proj.weight", "d conv1d.weight", "d conv1d.bias", "d A_log", "d D",
                "d dt_bias", "d norm.weight", "d out_proj.weight"} <= set(result), name
        far = {k: v for k, v in result.items() if not v["max_diff"] <= 1e-5 * max(1.0, v["scale"])}
        assert not far, f"{name}: beyond float32 rounding of the single process: {far}"


def test_block_with_cp1_is_the_single_process_block_and_refuses_the_reference_scan():
    """layout.cp = 1 (no process group): Mamba2's own conv and SSD on the whole sequence."""
    torch.manual_seed(0)
    full = Mamba2(16, d_state=8, headdim=8, ngroups=2, chunk_size=16)
    block = ContextParallelMamba2(16, single_process_layout(), d_state=8, headdim=8, ngroups=2, chunk_size=16)
    block.load_state_dict(full.state_dict())
    u = torch.randn(2, 32, 16, generator=torch.Generator().manual_seed(1))
    seq_idx = torch.zeros(2, 32, dtype=torch.int32)
    seq_idx[0, 10:] = 1
    for packed in (None, seq_idx):
        got, want = block(u, seq_idx=packed), full(u, seq_idx=packed)
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match=r"scan must be 'kernel' for a context-parallel block"):
        ContextParallelMamba2(16, single_process_layout(), d_state=8, headdim=8, scan="reference")


# ------------------------------------------------------------------------------------------ training
@pytest.fixture(scope="module")
def cp1(tmp_path_factory) -> list[float]:
    """The same run in this process, CP = TP = 1, on the kernels."""
    out = tmp_path_factory.mktemp("cp1")
    train(config(out_dir=out))
    return losses(out)


@pytest.fixture(scope="module")
def cp2(tmp_path_factory) -> Path:
    """CP = 2: four steps, checkpointed after two."""
    tmp = tmp_path_factory.mktemp("cp2")
    _ok(run(2, cp=2, out_dir=tmp / "run", checkpoint_dir=tmp / "ckpt", checkpoint_every=2))
    return tmp


def test_cp2_loss_curve_equals_cp1(cp2, cp1):
    summary = json.loads((cp2 / "run" / "summary.json").read_text())
    assert (summary["cp"], summary["tp"], summary["dp"]) == (2, 1, 1)
    got = losses(cp2 / "run")
    assert len(got) == len(cp1) == 4
    assert got == pytest.approx(cp1, rel=1e-5)


def test_cp2_by_tp2_sequence_parallel_loss_curve_equals_cp1(tmp_path, cp1):
    """With sequence parallelism each TP rank holds a quarter of each sequence between the blocks, and the
    mixers gather their CP rank's half. TP = 2 × CP = 2 without it is the block test above (every gradient,
    summed over CP as the trainer sums it) and tests/distributed/test_tensor_parallel.py's TP = 2 × DP = 2 run
    (the trainer's TP layers without sequence parallelism)."""
    _ok(run(4, cp=2, tp=2, sequence_parallel=True, out_dir=tmp_path))
    assert json.loads((tmp_path / "summary.json").read_text())["cp"] == 2
    assert losses(tmp_path) == pytest.approx(cp1, rel=1e-5)


def test_resume_with_cp2_is_exact_and_with_cp1_continues(cp2, tmp_path):
    ckpt = cp2 / "ckpt" / "step_000002"
    meta = json.loads((ckpt / "meta.json").read_text())
    assert (meta["cp"], meta["tp"]) == (2, 1)
    assert sorted(p.name for p in ckpt.iterdir()) == ["meta.json", "tp0-of-1.pt"]   # one shard: CP ranks share it
    _ok(run(2, cp=2, resume=ckpt, out_dir=tmp_path / "cp2"))
    whole = json.loads((cp2 / "run" / "summary.json").read_text())
    resumed = json.loads((tmp_path / "cp2" / "summary.json").read_text())
    assert losses(tmp_path / "cp2") == losses(cp2 / "run")[2:]                      # bit for bit
    assert resumed["fingerprint_per_rank"] == whole["fingerprint_per_rank"]
    # another CP degree resumes the same checkpoint: the parameters are whole on every CP rank
    train(config(resume=ckpt, out_dir=tmp_path / "cp1"))
    assert losses(tmp_path / "cp1") == pytest.approx(losses(cp2 / "run")[2:], rel=1e-5)


# ------------------------------------------------------------------------------------------ errors
@pytest.mark.parametrize("change, message", [
    (dict(seq_len=48), r"seq_len = 48 must be a multiple of cp × model.chunk_size = 2 × 16"),
    (dict(model=dict(scan="reference")), r"cp = 2 needs model.scan = 'kernel'"),
    (dict(sequence_parallel=True, tp=3, model=dict(d_model=24, ngroups=3, vocab_size=33)),
     r"sequence_parallel with cp = 2 splits each CP rank's seq_len / cp = 32 positions over tp = 3"),
    (dict(cp=0), r"cp must be an integer >= 1; got 0"),
])
def test_a_cp_run_that_cannot_start_names_the_field(change, message):
    model = {**MODEL, **change.pop("model", {})}
    with pytest.raises(ConfigError, match=message):
        TrainConfig(model=LMConfig(**model), **{**RUN, "cp": 2, **change})
