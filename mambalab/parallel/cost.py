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

**Bytes per collective** (:func:`allreduce_bytes`, :func:`layer_communication`): a ring all-reduce of N
elements of e bytes over T ranks sends 2 (T − 1)/T · N · e bytes from every rank (a reduce-scatter and an
all-gather, each (T − 1)/T · N · e), and receives as many. A Mamba-2 layer all-reduces its (b·l, d_model)
output once forward and its input gradient once backward. Sequence parallelism moves the same bytes but keeps
the activations between layers split along l: b·l·d_model / T elements per rank instead of b·l·d_model.

**Memory per rank** is counted on a model built on the ``meta`` device for each rank (no memory used), so the
numbers are the real parameter shapes: fp32 parameters, fp32 gradients and AdamW's two fp32 moments,
16 bytes per parameter in all.
"""
from __future__ import annotations

from mambalab.modules.lm import LMConfig
from mambalab.parallel.layout import ParallelLayout

__all__ = ["allreduce_bytes", "collectives_per_layer", "layer_communication", "memory_per_rank"]


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


def allreduce_bytes(numel: int, tp: int, element_size: int = 2) -> float:
    """Bytes each rank sends in a ring all-reduce of ``numel`` elements of ``element_size`` bytes over ``tp``
    ranks: 2 (tp − 1)/tp · numel · element_size (0 for tp = 1)."""
    for name, v in (("numel", numel), ("tp", tp), ("element_size", element_size)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int; got {v!r}")
    return 2 * (tp - 1) / tp * numel * element_size


def layer_communication(d_model: int, tokens: int, tp: int, sequence_parallel: bool = False,
                        element_size: int = 2) -> dict[str, float]:
    """One Mamba-2 layer of a training step over ``tokens`` = b·l tokens at TP degree ``tp``, activations of
    ``element_size`` bytes (2: bf16): bytes each rank sends forward and backward (one all-reduce of
    (tokens, d_model) each way, or its reduce-scatter + all-gather pair, the same bytes), and the bytes of the
    layer's input activation each rank holds (split along l by sequence parallelism)."""
    numel = tokens * d_model
    sent = allreduce_bytes(numel, tp, element_size)
    if sequence_parallel and tokens % tp:
        raise ValueError(f"sequence parallelism splits the {tokens} tokens over tp = {tp} ranks; tp must divide them")
    held = numel * element_size // (tp if sequence_parallel else 1)
    return {"forward_bytes": sent, "backward_bytes": sent, "activation_bytes": held}
