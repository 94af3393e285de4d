"""The training loop: a (tensor-, context- and data-) parallel Mamba-2 language model on a synthetic task.

One step, on every rank:

    ids, targets = make_batch(task, …, seed, step, dp_rank, dp)          the same on the T·K ranks of a replica
    context parallel: keep this CP rank's piece of every sequence        ids[:, k·l/K : (k+1)·l/K]
    with autocast(bf16 on GPU):  loss = model.loss(ids, targets)          vocab-parallel cross-entropy
    loss.backward()                                                       the layers' TP (and CP) collectives
    sequence parallel: all-reduce the norm weights' gradients over TP
    context parallel: sum every gradient over CP, in rank order           (sum_context_parallel_grads)
    data parallel: average every gradient over DP
    clip by the global gradient norm (sharded parts summed over TP)
    AdamW step on fp32 master parameters

What makes it safe to run unattended:

* **No hangs.** The process group has a timeout, a collective that loses its peer raises and the trainer
  turns that into one clear line naming this rank and the step, then exits non-zero; a watchdog thread
  exits the process if no step finishes within ``timeout_s`` (it catches what a timeout cannot, e.g. NCCL
  waiting on a dead peer). Both, and the fault injection the tests use, live in :mod:`mambalab.train.faults`.
* **Exact resume.** Batches are a function of (seed, step), and checkpoints hold the model shard,
  the optimizer state and the RNG state, so a resumed run produces the losses an uninterrupted one would.
* **Same start for every TP and CP degree.** With ``init="full"`` each rank builds the whole TP = 1 model from
  the seed on the CPU and keeps its shard, so TP = 1, 2 and 4 (and any CP) begin from the same weights and their
  losses can be compared step by step. ``init="local"`` builds only the shard (for models too large to build whole).
* **Bitwise repeatable** with ``deterministic``: mambalab's determinism switch is on for the run (and put
  back after), and ``summary.json`` records each rank's parameter fingerprint, so two runs compare exactly.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from mambalab.modules.lm import LMConfig, MambaLM, reset_biases
from mambalab.parallel import (ContextParallelMambaLM, TensorParallelMambaLM, allreduce_data_parallel_grads,
                               allreduce_replicated_grads, init_distributed, load_full_state_dict, sum_over_ranks)
from mambalab.parallel.context_mamba2 import sum_context_parallel_grads
from mambalab.parallel.sharding import REPLICATED, broadcast_parameters, shard_specs
from mambalab.train.checkpoint import CheckpointError, latest_step_dir, load_checkpoint, read_meta, save_checkpoint
from mambalab.train.faults import Watchdog, crash_if_asked, describe, exit_on_peer_failure
from mambalab.train.tasks import TASKS, make_batch, task_requirements

__all__ = ["TrainConfig", "train", "ConfigError", "CheckpointError", "PARAM_DTYPES", "INIT_HOOKS", "AMP_MODES",
           "RESUME_MUST_MATCH"]

AMP_MODES = ("auto", "bf16", "off")
MIN_CHUNK_SIZE = 16   # the SSD kernels' tl.dot blocks; the reference scan is held to the same rule
#: What a resumed run must share with its checkpoint: the parameters' shapes and dtypes, the shards, the data.
RESUME_MUST_MATCH = ("model.vocab_size", "model.d_model", "model.n_layer", "model.d_state", "model.headdim",
                     "model.ngroups", "model.expand", "model.d_conv", "model.tie_embeddings", "tp", "task",
                     "param_dtype", "amp")


class ConfigError(ValueError):
    """A run that cannot start as configured (a usage error: the CLI prints it on one line, exit 2)."""

PARAM_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# "zero-biases": a framework-style hook that zeroes every *bias (dt_bias included); "zero-biases-marked":
# the same hook honouring the _no_reinit marker (dt_bias kept).
INIT_HOOKS = ("none", "zero-biases", "zero-biases-marked")


@dataclass
class TrainConfig:
    """Everything a run depends on (``python -m mambalab.train --help`` lists them with their defaults)."""

    model: LMConfig = field(default_factory=LMConfig)
    task: str = "selective_copying"
    steps: int = 100
    batch_size: int = 8            # sequences per data-parallel replica and step
    seq_len: int = 64
    lr: float = 3e-3
    weight_decay: float = 0.1
    warmup: int = 10
    grad_clip: float = 1.0
    seed: int = 0
    tp: int = 1
    cp: int = 1                    # context parallelism: ranks that split each sequence (seq_len / cp each)
    dp: int = 0                    # 0: world_size / (tp · cp); else checked against it
    sequence_parallel: bool = False
    amp: str = "auto"              # "auto": bf16 autocast on GPU, none on CPU; "bf16"; "off"
    param_dtype: str = "fp32"      # the master parameters; "fp16" / "bf16" demonstrate the pitfall
    init: str = "full"             # "full" (same weights for every TP degree) or "local"
    init_hook: str = "none"        # see INIT_HOOKS
    out_dir: str | None = None     # metrics.jsonl and summary.json go here (rank 0)
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0      # 0: only at the end (if checkpoint_dir is set)
    resume: str = ""               # "latest": checkpoint_dir's newest checkpoint; or a step folder; "": start fresh
    deterministic: bool = False
    timeout_s: float = 120.0       # collectives and the watchdog give up after this long
    fail_at_step: int = -1         # fault injection for tests and demos: rank fail_rank exits at this step
    fail_rank: int = 0
    progress: bool = True          # tqdm bar on rank 0
    backend: str | None = None     # None: nccl with CUDA, else gloo
    allow_seed_change: bool = False   # resume a checkpoint saved with another seed (else an error)

    def __post_init__(self):
        self.validate()

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def validate(self) -> None:
        """Check every field; :class:`ConfigError` (a ValueError) naming the field and the allowed range.

        ``timeout_s`` must be > 0: it bounds every collective and the watchdog (there is no "no timeout")."""
        m = self.model

        def need(ok: bool, text: str) -> None:
            if not ok:
                raise ConfigError(text)

        def integer(name: str, value, low: int) -> None:
            need(isinstance(value, int) and not isinstance(value, bool) and value >= low,
                 f"{name} must be an integer >= {low}; got {value!r}")

        def number(name: str, value, positive: bool) -> None:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            need(ok and (value > 0 if positive else value >= 0),
                 f"{name} must be a finite number {'> 0' if positive else '>= 0'}; got {value!r}")

        need(isinstance(m, LMConfig), f"model must be an LMConfig; got {type(m).__name__}")
        need(getattr(m, "layer", "Mamba2") == "Mamba2",
             f"model.layer must be 'Mamba2' (the tensor-parallel model's blocks); got {getattr(m, 'layer', None)!r}")
        for name in ("vocab_size", "d_model", "n_layer", "d_state", "headdim", "ngroups", "expand", "d_conv"):
            integer(f"model.{name}", getattr(m, name), 1)
        need(m.expand * m.d_model % m.headdim == 0,
             f"model.headdim = {m.headdim} must divide d_inner = expand · d_model = {m.expand * m.d_model}")
        need(m.nheads % m.ngroups == 0, f"model.ngroups = {m.ngroups} must divide nheads = {m.nheads}")
        need(m.scan in ("kernel", "reference"), f"model.scan must be 'kernel' or 'reference'; got {m.scan!r}")
        need(m.reduction in (None, "atomic", "deterministic"),
             f"model.reduction must be None, 'atomic' or 'deterministic'; got {m.reduction!r}")
        need(isinstance(m.chunk_size, int) and not isinstance(m.chunk_size, bool) and m.chunk_size >= MIN_CHUNK_SIZE
             and m.chunk_size & (m.chunk_size - 1) == 0,
             f"model.chunk_size must be a power of two >= {MIN_CHUNK_SIZE} (the SSD kernels' blocks; the "
             f"reference scan follows the same rule); got {m.chunk_size!r}")
        need(self.task in TASKS, f"task must be one of {sorted(TASKS)}; got {self.task!r}")
        integer("steps", self.steps, 0)
        integer("batch_size", self.batch_size, 1)
        integer("seq_len", self.seq_len, 1)
        if self.task in TASKS:
            min_len, min_vocab = task_requirements(self.task, self.seq_len)
            need(self.seq_len >= min_len, f"seq_len must be >= {min_len} for task {self.task!r}; got {self.seq_len}")
            need(m.vocab_size >= min_vocab, f"model.vocab_size must be >= {min_vocab} for task {self.task!r} at "
                                            f"seq_len {self.seq_len}; got {m.vocab_size}")
        number("lr", self.lr, positive=True)
        number("weight_decay", self.weight_decay, positive=False)
        integer("warmup", self.warmup, 0)
        number("grad_clip", self.grad_clip, positive=False)
        integer("seed", self.seed, 0)
        integer("tp", self.tp, 1)
        integer("dp", self.dp, 0)
        integer("cp", self.cp, 1)
        if self.cp > 1:
            need(m.scan == "kernel", f"cp = {self.cp} needs model.scan = 'kernel' (the context-parallel SSD runs the "
                                     f"Triton kernels' steps); got {m.scan!r}")
            need(self.seq_len % (self.cp * m.chunk_size) == 0,
                 f"seq_len = {self.seq_len} must be a multiple of cp × model.chunk_size = {self.cp} × "
                 f"{m.chunk_size}: each CP rank holds seq_len / cp positions, cut on chunk edges")
            need(not self.sequence_parallel or self.seq_len // self.cp % self.tp == 0,
                 f"sequence_parallel with cp = {self.cp} splits each CP rank's seq_len / cp = "
                 f"{self.seq_len // self.cp} positions over tp = {self.tp} ranks; tp must divide them")
        for what, size in (("nheads", m.nheads), ("model.ngroups", m.ngroups), ("model.vocab_size", m.vocab_size)):
            need(size % self.tp == 0, f"tp = {self.tp} must divide {what} = {size}")
        need(self.amp in AMP_MODES, f"amp must be one of {AMP_MODES}; got {self.amp!r}")
        need(self.param_dtype in PARAM_DTYPES, f"param_dtype must be one of {sorted(PARAM_DTYPES)}; "
                                               f"got {self.param_dtype!r}")
        need(self.init in ("full", "local"), f"init must be 'full' or 'local'; got {self.init!r}")
        need(self.init_hook in INIT_HOOKS, f"init_hook must be one of {INIT_HOOKS}; got {self.init_hook!r}")
        integer("checkpoint_every", self.checkpoint_every, 0)
        need(not self.resume or self.resume == "latest" or Path(self.resume).is_dir(),
             f"resume must be 'latest' or an existing step folder; {self.resume!r} is not a folder")
        need(self.resume != "latest" or bool(self.checkpoint_dir),
             "resume = 'latest' needs checkpoint_dir (the folder to look in)")
        number("timeout_s", self.timeout_s, positive=True)
        need(self.backend in (None, "gloo", "nccl"), f"backend must be None, 'gloo' or 'nccl'; got {self.backend!r}")


# --------------------------------------------------------------------------------------------- helpers
def _determinism(cfg: TrainConfig):
    """(context, model config): mambalab's determinism switch, scoped to the run
    (:func:`mambalab.determinism.deterministic`), or, where that package is missing, its core by hand."""
    if not cfg.deterministic:
        return contextlib.nullcontext(), cfg.model
    try:
        from mambalab.determinism import deterministic
    except ImportError:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        return contextlib.nullcontext(), dataclasses.replace(cfg.model, reduction="deterministic")
    return deterministic(), cfg.model


def _fingerprint(model) -> str | None:
    """A hash of this rank's parameters' exact bits (None without mambalab.determinism)."""
    try:
        from mambalab.determinism import fingerprint
    except ImportError:
        return None
    return fingerprint(model)


def _build_model(cfg: TrainConfig, layout, device) -> TensorParallelMambaLM:
    lm = ContextParallelMambaLM if cfg.cp > 1 else TensorParallelMambaLM   # the same parameters, by name
    if cfg.init == "full":
        torch.manual_seed(cfg.seed)
        full = MambaLM(cfg.model)                                   # on the CPU, fp32
        if cfg.init_hook != "none":
            reset_biases(full, respect_no_reinit=cfg.init_hook == "zero-biases-marked")
        torch.manual_seed(cfg.seed)
        model = lm(cfg.model, layout, cfg.sequence_parallel, device=device)
        load_full_state_dict(model, full.state_dict(), layout.tp_rank)
        del full
    elif cfg.init == "local":
        torch.manual_seed(cfg.seed * 1009 + layout.tp_rank)
        model = lm(cfg.model, layout, cfg.sequence_parallel, device=device)
        if cfg.init_hook != "none":
            reset_biases(model, respect_no_reinit=cfg.init_hook == "zero-biases-marked")
    else:
        raise ValueError(f"init must be 'full' or 'local'; got {cfg.init!r}")
    broadcast_parameters(model, layout)   # replicated copies equal across TP, replicas equal across DP
    if layout.cp > 1:   # and every parameter equal across the CP group, from its first rank
        with torch.no_grad():
            for p in model.parameters():
                dist.broadcast(p.data, src=dist.get_global_rank(layout.cp_group, 0), group=layout.cp_group)
    if cfg.param_dtype != "fp32":
        # The pitfall: every parameter (the fp32-kept A_log, D, dt_bias too) stored and updated in 16 bits.
        for p in model.parameters():
            p.data = p.data.to(PARAM_DTYPES[cfg.param_dtype])
    return model


def _optimizer(model, cfg: TrainConfig) -> torch.optim.Optimizer:
    decay, no_decay = [], []
    for p in model.parameters():
        (no_decay if p.dim() < 2 or getattr(p, "_no_weight_decay", False) else decay).append(p)
    return torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95))


def _lr(cfg: TrainConfig, step: int) -> float:
    """Linear warmup, then cosine decay to 10 %."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    t = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * min(t, 1.0))))


def _grad_norm(model, layout, specs) -> torch.Tensor:
    """Global gradient norm: sharded parts summed over the TP group, replicated parts counted once."""
    sharded, replicated = [], []
    for name, p in model.named_parameters():
        if p.grad is not None:
            (replicated if specs[name] == REPLICATED else sharded).append(p.grad.float().square().sum())
    zero = torch.zeros((), device=next(model.parameters()).device)
    sq_sharded = torch.stack(sharded).sum() if sharded else zero
    if layout.tp > 1:
        dist.all_reduce(sq_sharded, group=layout.tp_group)
    sq = sq_sharded + (torch.stack(replicated).sum() if replicated else zero)
    return sq.sqrt()


def config_differences(saved: dict, cfg: TrainConfig) -> list[str]:
    """The :data:`RESUME_MUST_MATCH` fields (and the seed, unless ``allow_seed_change``) where the checkpoint's
    saved config ``saved`` (``TrainConfig.to_dict()``) and ``cfg`` differ, as "field: saved X, this run Y"."""
    now = cfg.to_dict()

    def get(d, name):
        for part in name.split("."):
            d = d.get(part, "(absent)") if isinstance(d, dict) else "(absent)"
        return d

    names = RESUME_MUST_MATCH + (() if cfg.allow_seed_change else ("seed",))
    return [f"{n}: checkpoint {get(saved, n)!r}, this run {get(now, n)!r}" for n in names if get(saved, n) != get(now, n)]


def _resume_folder(cfg: TrainConfig, layout) -> Path:
    """The checkpoint to resume from, checked against ``cfg`` (ConfigError or CheckpointError otherwise)."""
    if cfg.resume == "latest":
        folder = latest_step_dir(cfg.checkpoint_dir, warn=None if layout.is_main else (lambda text: None))
        if folder is None:
            raise ConfigError(f"resume = 'latest': no complete checkpoint in checkpoint_dir = {cfg.checkpoint_dir!r}")
    else:
        folder = Path(cfg.resume)
    saved = read_meta(folder)["config"]
    diffs = config_differences(saved, cfg)
    if diffs:
        hint = " (pass allow_seed_change / --allow-seed-change to resume with another seed)" \
            if any(d.startswith("seed:") for d in diffs) else ""
        raise ConfigError(f"cannot resume {folder}: the run differs from the checkpoint in " + "; ".join(diffs) + hint)
    return folder


# --------------------------------------------------------------------------------------------- the loop
def train(cfg: TrainConfig) -> list[dict]:
    """Run the training; returns the per-step metrics (every rank computes them; rank 0 writes them)."""
    cfg.validate()   # fields may have been assigned after construction
    try:
        layout = init_distributed(cfg.tp, cfg.dp or None, backend=cfg.backend, timeout_s=cfg.timeout_s, cp=cfg.cp)
    except ValueError as e:   # the world size does not fit tp × cp × dp
        raise ConfigError(str(e)) from None
    switch, model_config = _determinism(cfg)
    try:
        with switch:
            result = _train(dataclasses.replace(cfg, model=model_config), layout)
        if dist.is_initialized():
            dist.barrier()   # every rank done before any tears its groups down
        return result
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _train(cfg: TrainConfig, layout) -> list[dict]:
    """Build, resume if asked, train from the start step to ``cfg.steps``, report; the per-step metrics."""
    device = layout.device()
    model = _build_model(cfg, layout, device)
    optimizer = _optimizer(model, cfg)
    start = _resume(cfg, layout, model, optimizer)
    if start is None:
        return []
    out = Path(cfg.out_dir) if cfg.out_dir else None
    log = _open_outputs(cfg, layout, out, start)
    metrics = _loop(cfg, layout, model, optimizer, start, log)
    _write_summary(cfg, layout, model, metrics, out)
    return metrics


def _resume(cfg: TrainConfig, layout, model, optimizer) -> int | None:
    """The step to start at: 0 for a fresh run, else the checkpoint's (loaded into ``model`` and ``optimizer``);
    None when the checkpoint is already at ``cfg.steps``."""
    if not cfg.resume:
        return 0
    folder = _resume_folder(cfg, layout)
    start = load_checkpoint(folder, model, optimizer, layout)
    if start >= cfg.steps:   # nothing to train: leave what is written (summary, metrics, checkpoints) alone
        if layout.is_main:
            print(f"mambalab.train: {folder} is at step {start} and steps = {cfg.steps}: nothing to train, "
                  f"nothing written", file=sys.stderr, flush=True)
        return None
    return start


def _open_outputs(cfg: TrainConfig, layout, out: Path | None, start: int):
    """Rank 0 with an ``out_dir``: write config.json and open metrics.jsonl (appended to on resume, after a
    resume line); the open log, or None."""
    if out is None or not layout.is_main:
        return None
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps({**cfg.to_dict(), "world_size": layout.world_size,
                                                 "dp": layout.dp, "cp": layout.cp,
                                                 "num_parameters": cfg.model.num_parameters()}, indent=2))
    log = open(out / "metrics.jsonl", "a" if cfg.resume else "w")
    if cfg.resume:   # the steps after this line continue from a checkpoint
        log.write(json.dumps({"event": "resume", "from_step": start}) + "\n")
    return log


def _checkpoint_due(cfg: TrainConfig, done: int) -> bool:
    """Save after ``done`` steps: every ``checkpoint_every`` steps and at the end, if there is a checkpoint_dir."""
    return bool(cfg.checkpoint_dir) and ((cfg.checkpoint_every and done % cfg.checkpoint_every == 0)
                                         or done == cfg.steps)


def _loop(cfg: TrainConfig, layout, model, optimizer, start: int, log) -> list[dict]:
    """Steps ``start`` … ``cfg.steps`` - 1: train, log, beat the watchdog, checkpoint when due. A failing
    collective ends the process with one line (:func:`~mambalab.train.faults.exit_on_peer_failure`)."""
    from tqdm.auto import tqdm

    specs = shard_specs(model)
    replicated = model.replicated_parameters()
    watchdog = Watchdog(cfg.timeout_s, lambda: describe(layout)).start()
    metrics, step = [], start
    bar = tqdm(total=cfg.steps, initial=start, disable=not (layout.is_main and cfg.progress), desc="train",
               unit="step", dynamic_ncols=True)
    try:
        for step in range(start, cfg.steps):
            crash_if_asked(cfg, layout, step)
            row = _step(cfg, layout, model, optimizer, specs, replicated, step)
            metrics.append(row)
            if log is not None:
                log.write(json.dumps(row) + "\n")
                log.flush()
            bar.update(1)
            bar.set_postfix(loss=f"{row['loss']:.4f}")
            watchdog.beat(step)
            if _checkpoint_due(cfg, step + 1):
                save_checkpoint(cfg.checkpoint_dir, step + 1, model, optimizer, layout, {"config": cfg.to_dict()})
                watchdog.beat(step)   # a large model's save may take a while: it is progress too
    except Exception as e:   # a collective that lost its peer, or a timeout: say so plainly, never hang
        exit_on_peer_failure(e, layout, step)
        raise
    finally:
        watchdog.stop()
        bar.close()
        if log is not None:
            log.close()
    return metrics


def _autocast(cfg: TrainConfig, device):
    """A fresh autocast context (torch.autocast instances are not re-entrant factories): bf16 with amp "bf16",
    or "auto" on a GPU; else none."""
    if cfg.amp == "bf16" or (cfg.amp == "auto" and device.type == "cuda"):
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _step(cfg: TrainConfig, layout, model, optimizer, specs, replicated, step: int) -> dict:
    """One optimizer step (the recipe in the module docstring); its metrics row."""
    device = layout.device()
    t0 = time.perf_counter()
    ids, targets = make_batch(cfg.task, cfg.batch_size, cfg.seq_len, cfg.model.vocab_size, cfg.seed, step,
                              replica=layout.dp_rank, replicas=layout.dp)
    if layout.cp > 1:   # this CP rank's piece of every sequence
        piece = cfg.seq_len // layout.cp
        ids, targets = (t[:, layout.cp_rank * piece:(layout.cp_rank + 1) * piece] for t in (ids, targets))
    ids, targets = ids.to(device), targets.to(device)
    for group in optimizer.param_groups:
        group["lr"] = _lr(cfg, step)
    with _autocast(cfg, device):
        loss = model.loss(ids, targets)
    loss.backward()
    if cfg.sequence_parallel:
        allreduce_replicated_grads(replicated, layout)
    sum_context_parallel_grads(model, layout)   # each CP rank's gradient is its piece's part
    allreduce_data_parallel_grads(model, layout)
    grad_norm = _grad_norm(model, layout, specs)
    if cfg.grad_clip > 0 and torch.isfinite(grad_norm):
        scale = (cfg.grad_clip / (grad_norm + 1e-6)).clamp(max=1.0)
        for p in model.parameters():
            if p.grad is not None:
                p.grad.mul_(scale.to(p.grad.dtype))
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    loss_all = loss.detach().float().reshape(1)
    if layout.cp > 1:   # each CP rank's loss is its pieces' share of the mean
        loss_all = sum_over_ranks(loss_all, layout.cp_group)
    if layout.dp > 1:
        dist.all_reduce(loss_all, group=layout.dp_group)
        loss_all /= layout.dp
    if device.type == "cuda":
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    row = {"step": step, "loss": loss_all.item(), "grad_norm": grad_norm.item(), "lr": _lr(cfg, step),
           "step_time_s": dt, "tokens_per_s": cfg.batch_size * cfg.seq_len * layout.dp / dt}
    if device.type == "cuda":
        row["peak_mem_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    return row


def _write_summary(cfg: TrainConfig, layout, model, metrics: list[dict], out: Path | None) -> None:
    """The closing report: every rank's peak memory, parameter bytes and fingerprint, gathered to rank 0, which
    writes summary.json with the final loss (only with an ``out_dir``)."""
    mine = {"peak_mem_gib": metrics[-1].get("peak_mem_gib") if metrics else None,
            "param_gib": sum(p.numel() * p.element_size() for p in model.parameters()) / 2**30,
            "fingerprint": _fingerprint(model)}
    ranks = [mine]
    if out is not None and layout.world_size > 1:
        ranks = [None] * layout.world_size
        dist.all_gather_object(ranks, mine)
    if out is not None and layout.is_main:
        (out / "summary.json").write_text(json.dumps({
            "final_loss": metrics[-1]["loss"] if metrics else None, "steps": cfg.steps, "tp": layout.tp,
            "cp": layout.cp, "dp": layout.dp, "num_parameters": cfg.model.num_parameters(),
            "peak_mem_gib_per_rank": [r["peak_mem_gib"] for r in ranks],
            "param_gib_per_rank": [r["param_gib"] for r in ranks],
            "fingerprint_per_rank": [r["fingerprint"] for r in ranks]}, indent=2))
