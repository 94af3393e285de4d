"""Faults around checkpoints and usage errors, in real processes: a shard truncated on one rank of two (gloo),
a run killed while writing a checkpoint, a finished run's exit (no gloo thread left running), and a usage error
under torchrun (printed once, no traceback)."""
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import mambalab  # noqa: F401
from mambalab.modules.lm import LMConfig
from mambalab.train import TrainConfig, train
from mambalab.train.launch import ROOT, launch, read_metrics

MODEL = dict(vocab_size=32, d_model=16, n_layer=1, d_state=8, headdim=8, ngroups=2, chunk_size=16, scan="reference")
RUN = dict(task="mqar", batch_size=2, seq_len=16, warmup=1, progress=False, timeout_s=30)
ENV = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1",
       "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


def config(**kw) -> TrainConfig:
    return TrainConfig(model=LMConfig(**MODEL), **{**RUN, **{k: str(v) if isinstance(v, Path) else v
                                                            for k, v in kw.items()}})


def test_a_shard_truncated_on_one_rank_of_two_is_named_on_both(tmp_path):
    launch(config(tp=2, steps=1, checkpoint_dir=tmp_path / "ck"), 2, timeout=120, hide_gpus=True)
    shard = tmp_path / "ck" / "step_000001" / "tp1-of-2.pt"
    shard.write_bytes(shard.read_bytes()[:1000])
    start = time.monotonic()
    proc = launch(config(tp=2, steps=2, resume=tmp_path / "ck" / "step_000001"), 2, timeout=120, hide_gpus=True,
                  check=False)
    assert proc.returncode != 0 and time.monotonic() - start < 60
    lines = sorted(line for line in proc.stderr.splitlines() if line.startswith("mambalab train: error: rank"))
    assert len(lines) == 2, proc.stderr[-3000:]
    assert lines[0].startswith("mambalab train: error: rank 0: stopping, as rank 1 cannot load its checkpoint")
    assert lines[1].startswith(f"mambalab train: error: rank 1: {shard}: truncated or corrupt")
    assert all(f"{shard}: truncated or corrupt" in line for line in lines), lines
    assert f'File "{ROOT / "mambalab"}' not in proc.stderr     # no worker traceback (torchrun adds its own)


_KILL_WHILE_SAVING = textwrap.dedent("""
    import os, sys, torch
    import mambalab
    from mambalab.modules.lm import LMConfig
    from mambalab.train import TrainConfig, train
    save = torch.save
    def dying_save(obj, path, *a, **k):   # half the shard's bytes reach the disk, then the process dies
        save(obj, path, *a, **k)
        data = open(path, "rb").read()
        open(path, "wb").write(data[: len(data) // 2])
        os._exit(9)
    torch.save = dying_save
    train(TrainConfig(model=LMConfig(**{model}), **{run}, steps=2, checkpoint_every=1, resume=sys.argv[1],
                      checkpoint_dir=sys.argv[2]))
""")


def test_a_run_killed_while_saving_leaves_the_last_complete_checkpoint(tmp_path):
    ck = tmp_path / "ck"
    train(config(steps=2, checkpoint_every=1, checkpoint_dir=ck))            # step_000001, step_000002, latest
    shutil.copytree(ck, tmp_path / "pristine")
    # Resume at step 1 into the same folder: the process dies while writing step 2's shard again.
    code = _KILL_WHILE_SAVING.format(model=MODEL, run=RUN)
    proc = subprocess.run([sys.executable, "-c", code, str(ck / "step_000001"), str(ck)], env=ENV, cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 9, proc.stderr[-3000:]
    assert (ck / "latest").read_text() == "step_000002"
    resumed = train(config(steps=3, resume="latest", checkpoint_dir=ck, out_dir=tmp_path / "out"))
    want = train(config(steps=3, resume=tmp_path / "pristine" / "step_000002"))
    assert [r["step"] for r in resumed] == [2]
    assert [r["loss"] for r in resumed] == [r["loss"] for r in want]        # the intact step 2, bit for bit
    assert read_metrics(tmp_path / "out", events=True)[0] == {"event": "resume", "from_step": 2}


_GLOO_THREADS_AFTER_A_RUN = textwrap.dedent("""
    import os
    import mambalab
    from mambalab.modules.lm import LMConfig
    from mambalab.train import TrainConfig, train
    train(TrainConfig(model=LMConfig(**{model}), **{run}, tp=2, steps=1))
    names = [open(f"/proc/self/task/{{t}}/comm").read().strip() for t in os.listdir("/proc/self/task")]
    print("gloo threads after the run:", sorted(n for n in names if "gloo" in n), flush=True)
""")


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads the process's threads from /proc")
def test_a_finished_run_leaves_no_gloo_thread_running_into_the_exit(tmp_path):
    # A process group that outlives destroy_process_group keeps its gloo threads running while the interpreter
    # exits, where a rank can abort (layout.import_group_capturing_modules says which torch default held one).
    script = tmp_path / "run.py"
    script.write_text(_GLOO_THREADS_AFTER_A_RUN.format(model=MODEL, run=RUN))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script)]
    proc = subprocess.run(cmd, env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("gloo threads after the run:")]
    assert lines == ["gloo threads after the run: []"] * 2, proc.stdout[-3000:]


def test_a_usage_error_under_torchrun_is_one_line_from_rank_0(tmp_path):
    # d_inner = 2 · 20 = 40, headdim 8: 5 heads, which tp = 2 does not divide
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m",
           "mambalab.train", "--tp", "2", "--d-model", "20", "--ngroups", "1", "--steps", "1", "--no-progress"]
    proc = subprocess.run(cmd, env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if "error:" in line and "mambalab train" in line]
    assert errors == ["mambalab train: error: tp = 2 must divide nheads = 5"], proc.stderr[-3000:]
    assert f'File "{ROOT / "mambalab"}' not in proc.stderr
