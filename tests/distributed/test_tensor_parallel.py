"""Tensor and data parallelism on CPU processes (gloo), launched with torchrun as a user would.

Each test starts real processes (4 ranks, or two simulated nodes of 2), so models are tiny and runs short;
the SSD runs as the pure-PyTorch reference in the training runs (the Triton interpreter is ~500x slower on a
CPU) and once on the kernels in the gradient check.
"""
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import mambalab  # noqa: F401
from mambalab.modules.lm import LMConfig
from mambalab.train import TrainConfig, train
from mambalab.train.launch import launch, read_metrics, torchrun_command

HERE = Path(__file__).resolve().parent
# The trainer's tiny model and run: vocab, heads (4) and groups (4) divisible by TP = 4, l divisible too.
MODEL = dict(vocab_size=32, d_model=16, n_layer=2, d_state=8, headdim=8, ngroups=4, chunk_size=16, scan="reference")
RUN = dict(task="mqar", batch_size=4, seq_len=32, lr=3e-3, warmup=2, progress=False, timeout_s=60)


def config(**kw) -> TrainConfig:
    return TrainConfig(model=LMConfig(**MODEL), **{**RUN, **{k: str(v) if isinstance(v, Path) else v
                                                            for k, v in kw.items()}})


def _ok(proc):
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"


def run(nproc: int, timeout: float = 240, **kw) -> subprocess.CompletedProcess:
    """The trainer under torchrun, on CPU processes (gloo) even where GPUs exist."""
    return launch(config(**kw), nproc, timeout=timeout, hide_gpus=True, check=False)


def losses(out_dir: Path) -> list[float]:
    return [m["loss"] for m in read_metrics(out_dir)]


def single_process(tmp: Path, **kw) -> list[float]:
    """The same run in this process, TP = 1 (no process group)."""
    train(config(out_dir=tmp, **kw))
    return losses(tmp)


def rank_results(out_dir: Path, n: int) -> list[dict]:
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(n)]


# ------------------------------------------------------------------------------------------ layers
@pytest.fixture(scope="module")
def layer_checks(tmp_path_factory):
    """One 4-rank launch runs both layer checks (each launch costs seconds of process start-up)."""
    tmp = tmp_path_factory.mktemp("layers")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4",
           str(HERE / "workers.py"), "grads,torch_tp", str(tmp)]
    _ok(subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240))
    return rank_results(tmp, 4)


def test_tp4_gradients_equal_tp1_with_and_without_sequence_parallelism(layer_checks):
    for result in (r["grads"] for r in layer_checks):
        for variant in ("kernel/sp=True", "reference/sp=False", "reference/sp=True"):
            scan = variant.split("/")[0]
            got = result[variant]
            assert got["loss"] == pytest.approx(result[f"{scan}/loss_ref"], rel=1e-6, abs=1e-6), variant
            tol = 1e-5 * max(1.0, got["grad_scale"])
            bad = {k: v for k, v in got["grad_diff"].items() if not v <= tol}
            assert not bad, f"{variant}: gradients differ from TP = 1 beyond {tol}: {bad}"
            assert len(got["grad_diff"]) >= 12   # every parameter of the LM was compared


def test_layers_agree_with_torch_distributed_tensor_parallel(layer_checks):
    for result in (r["torch_tp"] for r in layer_checks):
        assert result["logits_diff"] < 1e-5
        assert result["loss"][0] == pytest.approx(result["loss"][1], rel=1e-6)
        assert set(result["grad_diff"]) == {"emb.weight", "up.weight", "up.bias", "down.weight", "down.bias",
                                            "head.weight"}
        assert max(result["grad_diff"].values()) < 1e-6


# ------------------------------------------------------------------------------------------ training
def test_twenty_steps_tp4_sequence_parallel_match_tp1(tmp_path):
    _ok(run(4, tp=4, sequence_parallel=True, steps=20, out_dir=tmp_path / "tp4"))
    tp4 = losses(tmp_path / "tp4")
    tp1 = single_process(tmp_path / "tp1", steps=20)
    assert len(tp4) == len(tp1) == 20
    assert tp4 == pytest.approx(tp1, rel=1e-4, abs=1e-5)
    assert tp4[-1] < tp4[0]   # and it learns


@pytest.fixture(scope="module")
def tp2_dp2(tmp_path_factory):
    """TP = 2 × DP = 2, 6 steps of 2 sequences per replica, checkpointed every 3 steps."""
    tmp = tmp_path_factory.mktemp("tp2dp2")
    _ok(run(4, tp=2, batch_size=2, steps=6, out_dir=tmp / "run", checkpoint_dir=tmp / "ckpt", checkpoint_every=3))
    return tmp


def test_tp2_by_dp2_matches_one_process_on_the_global_batch(tp2_dp2, tmp_path):
    assert json.loads((tp2_dp2 / "run" / "summary.json").read_text())["dp"] == 2
    assert losses(tp2_dp2 / "run") == pytest.approx(single_process(tmp_path, batch_size=4, steps=6), rel=1e-4)


def test_sharded_checkpoint_resume_is_exact(tp2_dp2):
    ckpt = tp2_dp2 / "ckpt" / "step_000003"
    assert sorted(p.name for p in ckpt.iterdir()) == ["meta.json", "tp0-of-2.pt", "tp1-of-2.pt"]
    _ok(run(4, tp=2, batch_size=2, steps=6, resume=ckpt, out_dir=tp2_dp2 / "resumed"))
    assert losses(tp2_dp2 / "resumed") == losses(tp2_dp2 / "run")[3:]   # bit for bit


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_simulated_nodes_train_together(tp2_dp2, tmp_path):
    """Two torchrun launches (--nnodes 2, c10d rendezvous on 127.0.0.1): TP = 2 inside each, DP across them."""
    port = _free_port()
    procs = []
    for node in range(2):
        launcher = ["--nnodes", "2", "--node_rank", str(node), "--rdzv_backend", "c10d", "--rdzv_id", "mambalab-test",
                    "--rdzv_endpoint", f"127.0.0.1:{port}"]
        cmd = torchrun_command(config(tp=2, batch_size=2, steps=6, out_dir=tmp_path / f"node{node}"), 2, launcher)
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    for p in procs:
        out, err = p.communicate(timeout=240)
        assert p.returncode == 0, err[-4000:]
    # global rank 0 lives on one of the two nodes and writes the metrics there
    written = [tmp_path / f"node{n}" for n in range(2) if (tmp_path / f"node{n}" / "metrics.jsonl").exists()]
    assert len(written) == 1
    assert losses(written[0]) == pytest.approx(losses(tp2_dp2 / "run"), rel=1e-5)


def test_a_killed_rank_ends_the_run_with_a_clear_error(tmp_path):
    start = time.monotonic()
    proc = run(4, tp=4, steps=6, fail_at_step=2, fail_rank=2, timeout_s=20, timeout=120)
    elapsed = time.monotonic() - start
    assert proc.returncode != 0
    assert "rank 2 (tp_rank 2, dp_rank 0): simulated crash at step 2" in proc.stderr
    # The survivors say why they stop (unless torchrun's agent terminated them first, which it also reports).
    assert ("another rank most likely failed or was killed" in proc.stderr
            or "ChildFailedError" in proc.stderr), proc.stderr[-3000:]
    assert elapsed < 100
