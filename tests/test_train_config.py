"""The trainer's guard rails: TrainConfig's validation, the CLI's one-line usage errors, and resume that refuses
what it cannot continue (a different config, damaged files) while tolerating a stale ``latest`` marker."""
import dataclasses
import json
import math
import re
import shutil

import pytest
import torch

import mambalab  # noqa: F401
from mambalab import cli
from mambalab.modules.lm import LMConfig
from mambalab.train import TrainConfig, train
from mambalab.train.checkpoint import CheckpointError
from mambalab.train.launch import read_metrics
from mambalab.train.trainer import ConfigError

TINY = dict(vocab_size=32, d_model=16, n_layer=1, d_state=8, headdim=8, ngroups=2, chunk_size=16, scan="reference")
RUN = dict(task="mqar", batch_size=2, seq_len=16, warmup=1, progress=False)


def config(**kw) -> TrainConfig:
    model = LMConfig(**{**TINY, **kw.pop("model", {})})
    return TrainConfig(model=model, **{**RUN, **kw})


# ------------------------------------------------------------------------------------------ validation
@pytest.mark.parametrize("field, value, message", [
    ("batch_size", 0, r"batch_size must be an integer >= 1; got 0"),
    ("steps", -5, r"steps must be an integer >= 0; got -5"),
    ("amp", "bf61", r"amp must be one of \('auto', 'bf16', 'off'\); got 'bf61'"),
    ("lr", math.nan, r"lr must be a finite number > 0; got nan"),
    ("lr", 0.0, r"lr must be a finite number > 0"),
    ("seq_len", 4, r"seq_len must be >= 16 for task 'selective_copying'"),
    ("tp", 0, r"tp must be an integer >= 1; got 0"),
    ("tp", 3, r"tp = 3 must divide nheads = 4"),
    ("timeout_s", 0, r"timeout_s must be a finite number > 0; got 0"),
    ("param_dtype", "fp8", r"param_dtype must be one of"),
    ("task", "copy", r"task must be one of"),
    ("resume", "/no/such/folder", r"resume must be 'latest' or an existing step folder"),
])
def test_each_bad_field_is_a_value_error_naming_it(field, value, message):
    kw = {"task": "selective_copying", "seq_len": 32} if field == "seq_len" else {}
    with pytest.raises(ValueError, match=message):
        config(**{**kw, field: value})


@pytest.mark.parametrize("chunk_size, scan", [(24, "kernel"), (24, "reference"), (8, "reference")])
def test_chunk_size_must_suit_the_kernels_for_either_scan(chunk_size, scan):
    with pytest.raises(ConfigError, match=rf"model.chunk_size must be a power of two >= 16.*got {chunk_size}"):
        config(model={"chunk_size": chunk_size, "scan": scan})


def test_validation_also_runs_when_train_is_called_on_a_mutated_config():
    cfg = config(steps=1)
    cfg.batch_size = 0
    with pytest.raises(ConfigError, match="batch_size must be an integer >= 1"):
        train(cfg)


def test_mqar_with_the_default_sizes_trains():
    # vocabulary 32 holds 15 keys; the default seq_len 64 asks for 16 pairs unless the task caps them
    rows = train(TrainConfig(task="mqar", steps=1, progress=False,
                             model=dataclasses.replace(LMConfig(), scan="reference")))
    assert len(rows) == 1 and math.isfinite(rows[0]["loss"])


# ------------------------------------------------------------------------------------------ CLI
@pytest.mark.parametrize("flags, message", [
    (["--tp", "0"], "tp must be an integer >= 1"),
    (["--tp", "3"], "tp = 3 must divide nheads"),
    (["--lr", "nan"], "lr must be a finite number > 0"),
    (["--seq-len", "4"], "seq_len must be >= 16"),
    (["--resume", "/no/such/folder"], "resume must be 'latest' or an existing step folder"),
    (["--chunk-size", "24", "--scan", "kernel"], "model.chunk_size must be a power of two"),
    (["--chunk-size", "24", "--scan", "reference"], "model.chunk_size must be a power of two"),
    (["--steps", "-5"], "steps must be an integer >= 0"),
    (["--timeout-s", "0"], "timeout_s must be a finite number > 0"),
])
def test_cli_usage_error_is_one_line_and_exit_2(capsys, flags, message):
    assert cli.main(["train", "--no-progress", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("mambalab train: error: ") and message in err[0], err


def test_module_entry_point_and_debug_flag(capsys):
    from mambalab.train.cli import main

    assert main(["--tp", "0", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["mambalab train: error: tp must be an integer >= 1; got 0"]
    with pytest.raises(ConfigError, match="tp must be"):     # --debug shows the exception itself
        main(["--tp", "0", "--debug"])


TINY_FLAGS = ["--vocab-size", "32", "--d-model", "16", "--n-layer", "1", "--d-state", "8", "--headdim", "8",
              "--ngroups", "2", "--chunk-size", "16", "--scan", "reference", "--task", "mqar", "--batch-size", "2",
              "--seq-len", "16", "--warmup", "1", "--no-progress"]


def test_cli_run_ends_with_one_line_naming_its_files_loss_and_wall_time(capsys, tmp_path):
    out, ck = tmp_path / "out", tmp_path / "ck"
    assert cli.main(["train", *TINY_FLAGS, "--steps", "2", "--out-dir", str(out), "--checkpoint-dir", str(ck)]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    final = json.loads((out / "summary.json").read_text())["final_loss"]
    match = re.fullmatch(r"mambalab train: 2 steps to 2 of 2, final loss (\S+), (\S+) s wall; checkpoint (\S+); "
                         r"metrics (\S+) \(config.json, summary.json beside it\)", last)
    assert match, last
    assert float(match[1]) == pytest.approx(final, abs=5e-5) and float(match[2]) > 0
    assert match[3] == str(ck / "step_000002") and (ck / "step_000002" / "meta.json").is_file()
    assert match[4] == str(out / "metrics.jsonl") and len(read_metrics(out)) == 2
    # a resumed run says where it started; one that writes nothing says so
    assert cli.main(["train", *TINY_FLAGS, "--steps", "3", "--checkpoint-dir", str(ck), "--resume", "latest"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("mambalab train: 1 step, from step 2 to 3 of 3, final loss ")
    assert last.endswith(f"checkpoint {ck / 'step_000003'}")
    assert cli.main(["train", *TINY_FLAGS, "--steps", "0"]) == 0
    assert capsys.readouterr().out.strip().endswith("nothing written (no --out-dir, no --checkpoint-dir)")


# ------------------------------------------------------------------------------------------ resume
@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory):
    """A run of 2 steps, checkpointed after each: ck/step_000001, ck/step_000002, ck/latest; out/ its metrics."""
    tmp = tmp_path_factory.mktemp("resume")
    train(config(steps=2, checkpoint_every=1, checkpoint_dir=str(tmp / "ck"), out_dir=str(tmp / "out")))
    return tmp


def copy(two_checkpoints, tmp_path):
    shutil.copytree(two_checkpoints, tmp_path, dirs_exist_ok=True)
    return tmp_path


def test_resume_lists_every_field_that_must_match(two_checkpoints):
    with pytest.raises(ConfigError) as err:
        train(config(steps=3, resume=str(two_checkpoints / "ck" / "step_000002"), param_dtype="bf16",
                     model={"d_model": 32, "tie_embeddings": False}))
    text = str(err.value)
    for part in ("model.d_model: checkpoint 16, this run 32", "model.tie_embeddings: checkpoint True, this run False",
                 "param_dtype: checkpoint 'fp32', this run 'bf16'"):
        assert part in text, text
    with pytest.raises(ConfigError, match=r"task: checkpoint 'mqar', this run 'selective_copying'"):
        train(config(steps=3, task="selective_copying", resume=str(two_checkpoints / "ck" / "step_000002")))


def test_resume_with_another_seed_needs_the_opt_in(two_checkpoints):
    folder = str(two_checkpoints / "ck" / "step_000001")
    with pytest.raises(ConfigError, match=r"seed: checkpoint 0, this run 1.*allow-seed-change"):
        train(config(steps=2, seed=1, resume=folder))
    rows = train(config(steps=2, seed=1, resume=folder, allow_seed_change=True))
    assert [r["step"] for r in rows] == [1]


def test_fields_that_may_change_resume(two_checkpoints, tmp_path):
    rows = train(config(steps=3, timeout_s=30, resume=str(two_checkpoints / "ck" / "step_000002"),
                        out_dir=str(tmp_path)))
    assert [r["step"] for r in rows] == [2]


@pytest.mark.parametrize("damage, message", [
    ("empty shard", r"tp0-of-1.pt: the file is empty \(0 bytes\)"),
    ("truncated shard", r"tp0-of-1.pt: truncated or corrupt"),
    ("truncated meta", r"meta.json: not valid JSON"),
])
def test_damaged_files_are_named(two_checkpoints, tmp_path, damage, message):
    folder = copy(two_checkpoints, tmp_path) / "ck" / "step_000002"
    if damage == "truncated meta":
        path = folder / "meta.json"
    else:
        path = folder / "tp0-of-1.pt"
    data = path.read_bytes()
    path.write_bytes(b"" if damage == "empty shard" else data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=message) as err:
        train(config(steps=3, resume=str(folder)))
    assert str(path) in str(err.value)


@pytest.mark.parametrize("marker", ["", "step_000009"])
def test_a_stale_latest_marker_falls_back_to_the_newest_complete_checkpoint(two_checkpoints, tmp_path, capsys,
                                                                              marker):
    root = copy(two_checkpoints, tmp_path)
    (root / "ck" / "latest").write_text(marker)
    rows = train(config(steps=3, resume="latest", checkpoint_dir=str(root / "ck")))
    assert [r["step"] for r in rows] == [2]                      # resumed from step_000002
    assert "resuming from the newest complete one" in capsys.readouterr().err


def test_a_run_that_trains_no_step_overwrites_nothing(two_checkpoints, tmp_path, capsys):
    root = copy(two_checkpoints, tmp_path)
    written = {p: p.read_bytes() for p in root.rglob("*") if p.is_file()}
    rows = train(config(steps=1, resume=str(root / "ck" / "step_000002"), checkpoint_dir=str(root / "ck"),
                        out_dir=str(root / "out")))
    assert rows == []
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"mambalab.train: {root / 'ck' / 'step_000002'} is at step 2 and steps = 1: nothing to train, nothing written")
    assert {p: p.read_bytes() for p in root.rglob("*") if p.is_file()} == written
    assert json.loads((root / "out" / "summary.json").read_text())["final_loss"] is not None


def test_metrics_mark_where_a_resumed_run_continues(two_checkpoints, tmp_path):
    root = copy(two_checkpoints, tmp_path)
    train(config(steps=3, resume=str(root / "ck" / "step_000001"), out_dir=str(root / "out")))
    rows = read_metrics(root / "out", events=True)
    assert [r.get("step", r.get("event")) for r in rows] == [0, 1, "resume", 1, 2]
    assert rows[2] == {"event": "resume", "from_step": 1}
    assert [r["step"] for r in read_metrics(root / "out")] == [0, 1, 1, 2]
    assert rows[1]["loss"] == rows[3]["loss"]                   # the repeated step, bit for bit
