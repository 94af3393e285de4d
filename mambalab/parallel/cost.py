"""What tensor parallelism costs and saves, per layer and per rank: collectives counted, memory measured.

**Collectives per layer** (Megatron-style TP over T ranks, one training step, b·l tokens, width d_model):

* Mamba-2 (:class:`TensorParallelMamba2`): in_proj column-parallel, out_proj row-parallel, and everything in
  between (conv, SSD, gated norm) is per head or per group. 1 all-reduce of (b·l, d_model) forward, 1 backward.
* Mamba-1: in_proj column-parallel over d_inner and out_proj row-parallel as above, but x_proj maps all
  d_inner channels to (Δ-rank r, B, C), which every channel then needs: a partial sum over ranks, so one more
  all-reduce of (b·l, r + 2n) forward and its adjoint backward. 2 forward, 2 backward.
* A transformer layer (attention + MLP, each column → row): 2 all-reduces of (b·l, d_model) forward, 2
  backward.

In sequence-parallel mode each all-reduce becomes a reduce-scatter + all-gather pair, same bytes.

**Memory per rank** is counted on a model built on the ``meta`` device for each rank (no memory used), so the
numbers are the real parameter shapes: fp32 parameters, fp32 gradients and AdamW's two fp32 moments,
16 bytes per parameter in all.
"""
from __future__ import annotations

from mambalab.modules.lm import LMConfig
from mambalab.parallel.layout import ParallelLayout

__all__ = ["collectives_per_layer", "memory_per_rank"]


def collectives_per_layer(d_model: int, d_state: int = 16, dt_rank: int | None = None) -> dict[str, dict]:
    """{architecture: {"forward": count, "backward": count, "elements_per_token": all-reduced numbers per token
    (forward)}} for Mamba-2, Mamba-1 (``dt_rank`` default ceil(d_model / 16)) and a transformer layer."""
    dt_rank = dt_rank or -(-d_model // 16)
    return {
        "Mamba-2": {"forward": 1, "backward": 1, "elements_per_token": d_model},
        "Mamba-1": {"forward": 2, "backward": 2, "elements_per_token": d_model + dt_rank + 2 * d_state},
        "Transformer (attention + MLP)": {"forward": 2, "backward": 2, "elements_per_token": 2 * d_model},
    }


def memory_per_rank(config: LMConfig, tp: int, bytes_per_param: int = 16) -> list[dict]:
    """For each TP rank: parameters held, and bytes for parameters + gradients + optimizer state."""
    from mambalab.parallel.lm import TensorParallelMambaLM

    rows = []
    for r in range(tp):
        layout = ParallelLayout(world_size=tp, rank=r, tp=tp, dp=1, tp_rank=r, dp_rank=0, local_rank=r)
        model = TensorParallelMambaLM(config, layout, device="meta")
        n = sum(p.numel() for p in model.parameters())
        rows.append({"tp_rank": r, "parameters": n, "bytes": n * bytes_per_param})
    return rows
