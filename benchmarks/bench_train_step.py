"""One training step of a Mamba-2 of mamba2-2.7b's shape on one GPU, as mambalab's trainer runs it: where the
memory goes and how many tokens a second.

    python benchmarks/bench_train_step.py --out FILE [--batch 1] [--seq-len 2048 4096 8192] [--steps 6]

The model is the trainer's (``TensorParallelMambaLM`` at TP = 1, fp32 parameters; d_model 2560, 64 layers,
d_state 128, headdim 64, one group, chunk 256, vocabulary 50288, tied head), the step the trainer's
(``mambalab.train.trainer``: bf16 autocast, the vocabulary-parallel cross-entropy, backward, AdamW with
betas (0.9, 0.95) on the fp32 parameters, gradients set to None after the step), deterministic mode on.

Memory, read from ``torch.cuda.memory_allocated`` / ``max_memory_allocated`` (what PyTorch's allocator handed
out, not what it reserved):

* ``weights``: after the model is built;
* ``gradients``: allocated after the first backward, less the weights;
* ``optimizer_state``: allocated after the first optimizer step once the gradients are freed, less the weights
  (AdamW's two moments);
* ``peak``: the highest allocation during steps 2 … N (weights, optimizer state, activations and gradients);
* ``activations_and_transients``: peak − weights − optimizer state − gradients, so an upper bound on the saved
  activations (it also holds whatever the backward allocates for a moment).

Beside it, the cost model of chapter 06 (:func:`mambalab.parallel.cost.memory_per_rank`: 16 bytes a parameter
for weights, gradients and AdamW's moments), which does not count activations.

The step time is the median over steps 2 … N of the host's wall time with the GPU synchronised at each end,
the trainer's own ``step_time_s``. Out of memory is recorded with the phase it happened in, not raised. One row
per sequence length, each with a fresh model, so the activations' growth with the length is measured, not assumed.
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment  # noqa: E402

SHAPE = dict(d_model=2560, n_layer=64, vocab_size=50288, d_state=128, headdim=64, ngroups=1, chunk_size=256)
GIB = 2**30


def measure(batch: int, seq_len: int, steps: int) -> dict:
    from mambalab import determinism
    from mambalab.modules.lm import LMConfig
    from mambalab.parallel.cost import memory_per_rank

    config = LMConfig(**SHAPE)
    row: dict = dict(shape=dict(SHAPE, batch=batch, seq_len=seq_len, tokens=batch * seq_len),
                     cost_model_bytes=memory_per_rank(config, tp=1)[0]["bytes"])
    device = torch.device("cuda")
    row["phase"] = "build"
    try:
        with determinism.deterministic():
            _run(row, config, device, batch, seq_len, steps)
    except torch.cuda.OutOfMemoryError as err:
        row["out_of_memory"] = dict(phase=row.get("phase"), allocated_bytes=torch.cuda.memory_allocated(),
                                    peak_bytes=torch.cuda.max_memory_allocated(), message=str(err)[:300])
    row["gib"] = {k[:-6]: round(v / GIB, 2) for k, v in row.items() if k.endswith("_bytes") and isinstance(v, int)}
    return row


def _run(row: dict, config, device, batch: int, seq_len: int, steps: int) -> None:
    """Build, then run ``steps`` training steps, filling ``row`` as each phase ends."""
    torch.cuda.reset_peak_memory_stats()
    from mambalab.parallel.layout import single_process_layout
    from mambalab.parallel.lm import TensorParallelMambaLM

    torch.manual_seed(0)
    model = TensorParallelMambaLM(config, single_process_layout(), device=device)
    row["parameters"] = sum(p.numel() for p in model.parameters())
    weights = torch.cuda.memory_allocated()
    row["weights_bytes"] = weights
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)
    ids = torch.randint(0, config.vocab_size, (batch, seq_len + 1), device=device)
    times = []
    for step in range(steps):
        row["phase"] = f"step {step + 1}"
        if step == 1:
            torch.cuda.reset_peak_memory_stats()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model.loss(ids[:, :-1], ids[:, 1:])
        loss.backward()
        if step == 0:
            row["gradients_bytes"] = torch.cuda.memory_allocated() - weights
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        if step == 0:
            row["optimizer_state_bytes"] = torch.cuda.memory_allocated() - weights
        row["loss"] = loss.item()
    row["peak_bytes"] = torch.cuda.max_memory_allocated()
    row["reserved_bytes"] = torch.cuda.max_memory_reserved()
    row["activations_and_transients_bytes"] = (row["peak_bytes"] - weights - row["optimizer_state_bytes"]
                                               - row["gradients_bytes"])
    row["step_time_s"] = statistics.median(times[1:])
    row["tokens_per_s"] = batch * seq_len / row["step_time_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="the JSON file to write")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq-len", type=int, nargs="+", default=[2048, 4096, 8192])
    parser.add_argument("--steps", type=int, default=6, help="steps run; the first is not timed (default 6)")
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps: at least 2 expected (the first compiles and is not timed)")
    if not torch.cuda.is_available():
        parser.error("a CUDA GPU is required")
    rows = []
    for seq_len in args.seq_len:
        rows.append(measure(args.batch, seq_len, args.steps))
        print(json.dumps(rows[-1]), flush=True)
        gc.collect()
        torch.cuda.empty_cache()
        result = dict(environment=environment(), rows=rows,
                      command=f"python benchmarks/bench_train_step.py --batch {args.batch} --seq-len "
                              f"{' '.join(map(str, args.seq_len))} --steps {args.steps}")
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")   # after each row


if __name__ == "__main__":
    main()
