"""Synthetic tasks from the Mamba papers, generated on the fly from a seed (no download).

Each returns ``(ids, targets)``, both (b, l) int64: the model reads ``ids`` and, at position t, is scored on
predicting ``targets[t]``; positions with nothing to predict hold ``IGNORE_INDEX`` (-100). A batch is a
function of (seed, step) alone, so a resumed run sees exactly the batches an uninterrupted one would;
data-parallel replicas take disjoint rows of it (see :func:`make_batch`).

**Selective copying** (Mamba-1, §4.1.1). Token 0 is noise, 1 the "recall" marker, 2 … V-1 data. The
context holds ``n_memorize`` data tokens at random positions among noise; then come ``n_memorize``
markers, and at the i-th marker the model must output the i-th data token. A time-invariant model cannot
tell where the data tokens were; a selective one can ignore the noise.

**Multi-query associative recall, MQAR** (Zoology; used for Mamba-2). The vocabulary (above the two
reserved ids) is split into keys and values. ``n_pairs`` key-value pairs are listed, k_1 v_1 … k_P v_P;
then ``n_queries`` keys drawn from them, and after each queried key the model must output its value.
"""
from __future__ import annotations

import torch

from mambalab.parallel.vocab import IGNORE_INDEX

__all__ = ["TASKS", "selective_copying", "mqar", "make_batch", "batch_generator", "task_requirements"]

NOISE, MARKER, FIRST_DATA = 0, 1, 2


def batch_generator(seed: int, step: int) -> torch.Generator:
    """The CPU generator for one step's global batch: a fixed function of (seed, step)."""
    return torch.Generator().manual_seed(seed * 1_000_003 + step)


def selective_copying(batch: int, seq_len: int, vocab_size: int, gen: torch.Generator, n_memorize: int = 8):
    """(ids, targets) (b, seq_len): a context of seq_len - n_memorize, then n_memorize markers."""
    context = seq_len - n_memorize
    if vocab_size <= FIRST_DATA or n_memorize < 1 or context < n_memorize:
        raise ValueError(f"selective copying needs vocab_size > {FIRST_DATA} and 1 <= n_memorize <= seq_len / 2; "
                         f"got vocab_size={vocab_size}, seq_len={seq_len}, n_memorize={n_memorize}")
    data = torch.randint(FIRST_DATA, vocab_size, (batch, n_memorize), generator=gen)
    # n_memorize distinct positions per row, kept in order
    positions = torch.rand(batch, context, generator=gen).argsort(dim=-1)[:, :n_memorize].sort(dim=-1).values
    ids = torch.full((batch, seq_len), NOISE, dtype=torch.long)
    ids.scatter_(1, positions, data)
    ids[:, context:] = MARKER
    targets = torch.full_like(ids, IGNORE_INDEX)
    targets[:, context:] = data
    return ids, targets


def mqar(batch: int, seq_len: int, vocab_size: int, gen: torch.Generator, n_pairs: int | None = None):
    """(ids, targets) (b, seq_len): 2·n_pairs tokens of pairs, then seq_len - 2·n_pairs queried keys.

    ``n_pairs`` defaults to seq_len // 4, capped at the (vocab_size - 2) // 2 distinct keys the vocabulary holds."""
    half = (vocab_size - FIRST_DATA) // 2
    n_pairs = n_pairs or min(seq_len // 4, half)
    n_queries = seq_len - 2 * n_pairs
    if n_queries < 1 or n_pairs < 1 or half < n_pairs:
        raise ValueError(f"MQAR needs 1 <= n_pairs < seq_len / 2 and (vocab_size - 2) / 2 >= n_pairs distinct keys; "
                         f"got seq_len={seq_len}, n_pairs={n_pairs}, vocab_size={vocab_size}")
    keys = torch.rand(batch, half, generator=gen).argsort(dim=-1)[:, :n_pairs] + FIRST_DATA   # distinct keys
    values = torch.randint(FIRST_DATA + half, FIRST_DATA + 2 * half, (batch, n_pairs), generator=gen)
    which = torch.randint(0, n_pairs, (batch, n_queries), generator=gen)
    ids = torch.cat([torch.stack([keys, values], dim=-1).flatten(1), keys.gather(1, which)], dim=1)
    targets = torch.full_like(ids, IGNORE_INDEX)
    targets[:, 2 * n_pairs:] = values.gather(1, which)
    return ids, targets


TASKS = {"selective_copying": selective_copying, "mqar": mqar}


def task_requirements(task: str, seq_len: int) -> tuple[int, int]:
    """(smallest seq_len, smallest vocab_size) with which ``task`` generates batches at its default sizes:
    selective copying needs 2 · n_memorize = 16 tokens and one data id beside noise and marker; MQAR needs a
    pair and a query (4 tokens: n_pairs = seq_len // 4 >= 1) and one key and one value id."""
    if task == "selective_copying":
        return 16, FIRST_DATA + 1
    if task == "mqar":
        return 4, FIRST_DATA + 2
    raise ValueError(f"task must be one of {sorted(TASKS)}; got {task!r}")


def make_batch(task: str, batch: int, seq_len: int, vocab_size: int, seed: int, step: int, replica: int = 0,
               replicas: int = 1):
    """The (ids, targets) (batch, seq_len) of one training step for data-parallel replica ``replica`` of
    ``replicas``: rows [replica · batch, (replica + 1) · batch) of the step's global batch of
    replicas · batch sequences. So DP = 2 with batch 4 trains on exactly the sequences of DP = 1 with batch 8."""
    if task not in TASKS:
        raise ValueError(f"task must be one of {sorted(TASKS)}; got {task!r}")
    if not 0 <= replica < replicas:
        raise ValueError(f"replica must be in [0, replicas = {replicas}); got {replica}")
    ids, targets = TASKS[task](batch * replicas, seq_len, vocab_size, batch_generator(seed, step))
    rows = slice(replica * batch, (replica + 1) * batch)
    return ids[rows], targets[rows]
