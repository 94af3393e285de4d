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

**The two ways to split the sequence** (:func:`context_parallel_communication`, :func:`sequence_split_bytes`).
Megatron's sequence parallelism (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models", its section on sequence parallelism) splits along l only the activations *between* the
tensor-parallel layers: each layer all-gathers its (b·l, d_model) input before in_proj and reduce-scatters its
output after out_proj, the bytes of one all-reduce, 2 (T − 1)/T · b·l·d_model · e each way per layer, O(l·d).
That is the count for :mod:`mambalab.parallel.linear`, whose column-parallel layer keeps the gathered input for its
weight gradient; Megatron-LM's keeps only the 1/T shard and all-gathers it again in the backward
(``LinearWithGradAccumulationAndAsyncCommunication.backward``), one more (T − 1)/T · b·l·d_model · e.
Context parallelism (:mod:`mambalab.parallel.context`) gives each of R ranks a contiguous piece of the sequence;
per layer a cut moves, forward, the SSD's final state (b, h, p, n) fp32 and the conv's last d_conv − 1 inputs
(b, conv_dim, d_conv − 1) in the activations' dtype to the next rank, and backward the state's gradient
(b, h, p, n) fp32 and rank r's first d_conv − 1 conv inputs with their output gradients, (b, conv_dim,
2·(d_conv − 1)) fp32, to the previous one (conv_dim = d_inner + 2·g·n, the x, B and C channels the conv runs over:
:mod:`mambalab.parallel.context_mamba2`):

    forward   4·b·h·p·n + b·conv_dim·(d_conv − 1)·e    backward   4·b·h·p·n + 8·b·conv_dim·(d_conv − 1)

independent of l. Its parameters are whole on every CP rank, so their gradients are summed over the group once a
step: :func:`~mambalab.parallel.context.sum_over_ranks` all-gathers R copies, (R − 1)·N·4 bytes sent per rank for
N fp32 gradients, also independent of l (a ring all-reduce would send 2 (R − 1)/R · N·4, in the library's order of
additions; the all-gather fixes the order, so every run gives the same bits).

**Memory per rank against the sequence length** (:func:`memory_model`) is a model, not a measurement: the
training state, 16 bytes a parameter, sharded T ways by TP and replicated by CP, plus the saved activations,
a bytes-per-token-per-layer coefficient × n_layer × b·l / (T·R) (TP splits every layer's per-head tensors and,
with sequence parallelism, the rest along l; CP splits all of them along l). It divides by T what
:mod:`mambalab.parallel.linear` keeps whole under sequence parallelism, in_proj's gathered input (b·l·d_model), and
it does not check that T divides the heads and groups (:class:`~mambalab.parallel.mamba2.TensorParallelMamba2`
does). The coefficient comes from
:func:`activation_bytes_per_token`, a count of what autograd saves in one block's forward, or from a
measurement (``benchmarks/bench_train_step.py``).
"""
from __future__ import annotations

from dataclasses import replace

import torch

from mambalab import validate
from mambalab.modules.lm import LMConfig
from mambalab.parallel.layout import ParallelLayout

__all__ = ["activation_bytes_per_token", "allreduce_bytes", "collectives_per_layer", "context_parallel_communication",
           "layer_communication", "layer_parameters", "memory_model", "memory_per_rank", "saved_activation_bytes",
           "sequence_split_bytes"]


def _positive(**values) -> None:
    for name, v in values.items():
        validate.positive_int(name, v)


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
    _positive(numel=numel, tp=tp, element_size=element_size)
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


def context_parallel_communication(batch: int, nheads: int, headdim: int, d_state: int, conv_dim: int, d_conv: int,
                                   cp: int, element_size: int = 2) -> dict[str, int]:
    """Bytes one cut between two context-parallel ranks moves per Mamba-2 layer and training step (module
    docstring): ``forward_bytes`` from rank r − 1 to rank r, the SSD's final state (4·b·h·p·n) and the conv's
    halo (b·conv_dim·(d_conv − 1)·element_size); ``backward_bytes`` from rank r to rank r − 1, the state's
    gradient and rank r's first d_conv − 1 conv inputs with their output gradients (2·b·conv_dim·(d_conv − 1)),
    all fp32. A rank with neighbours on both sides sends one of each; the first rank sends no backward, the last
    no forward. Also the parts: ``state_bytes`` and the two halos. All 0 for cp = 1 (no cut)."""
    _positive(batch=batch, nheads=nheads, headdim=headdim, d_state=d_state, conv_dim=conv_dim, d_conv=d_conv, cp=cp,
              element_size=element_size)
    cut = cp > 1
    state = 4 * batch * nheads * headdim * d_state * cut
    halo_forward = batch * conv_dim * (d_conv - 1) * element_size * cut
    halo_backward = 4 * 2 * batch * conv_dim * (d_conv - 1) * cut   # inputs and output gradients
    return {"state_bytes": state, "halo_forward_bytes": halo_forward, "halo_backward_bytes": halo_backward,
            "forward_bytes": state + halo_forward, "backward_bytes": state + halo_backward}


def layer_parameters(config: LMConfig) -> int:
    """Parameters of one Mamba-2 layer of ``config``, its pre-norm included (what :meth:`LMConfig.num_parameters`
    counts per layer)."""
    return replace(config, n_layer=1).num_parameters() - replace(config, n_layer=0).num_parameters()


def sequence_split_bytes(config: LMConfig, batch: int, seqlen: int, degree: int, element_size: int = 2) -> dict:
    """Megatron sequence parallelism (with TP over ``degree`` ranks) against context parallelism (over ``degree``
    ranks) for one Mamba-2 layer of ``config`` and one training step of ``batch`` × ``seqlen`` tokens, activations
    of ``element_size`` bytes:

    * ``sequence_parallel_bytes``: each rank's all-gather + reduce-scatter forward and backward,
      2 · 2 (T − 1)/T · b·l·d_model · e (:func:`layer_communication`), O(l·d_model); Megatron-LM's backward
      all-gathers the saved input shard once more (module docstring);
    * ``context_parallel_bytes``: a cut's forward + backward (:func:`context_parallel_communication`), the most an
      interior rank sends, independent of l;
    * ``context_parallel_gradient_bytes``: the layer's share of the step's gradient sum over the CP group,
      (R − 1)·N·4 for its N fp32 gradients (:func:`~mambalab.parallel.context.sum_over_ranks`'s all-gather),
      once a step, independent of l.
    """
    _positive(batch=batch, seqlen=seqlen, degree=degree, element_size=element_size)
    sp = layer_communication(config.d_model, batch * seqlen, degree, True, element_size)
    d_inner = config.expand * config.d_model
    cp = context_parallel_communication(batch, config.nheads, config.headdim, config.d_state,
                                        d_inner + 2 * config.ngroups * config.d_state, config.d_conv, degree,
                                        element_size)
    return {"seqlen": seqlen, "tokens": batch * seqlen,
            "sequence_parallel_bytes": sp["forward_bytes"] + sp["backward_bytes"],
            "context_parallel_bytes": cp["forward_bytes"] + cp["backward_bytes"],
            "context_parallel_gradient_bytes": (degree - 1) * layer_parameters(config) * 4}


def saved_activation_bytes(module: torch.nn.Module, *inputs: torch.Tensor) -> int:
    """Bytes of the tensors autograd saves for the backward while ``module(*inputs)`` runs its forward: each
    storage counted once (views share one), the module's parameters left out (they are the training state).
    Counted with :func:`torch.autograd.graph.saved_tensors_hooks`; the graph is dropped afterwards."""
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"module must be a torch.nn.Module; got {type(module).__name__}")
    if not any(isinstance(t, torch.Tensor) and t.requires_grad for t in inputs) and not any(
            p.requires_grad for p in module.parameters()):
        raise ValueError("nothing requires grad: autograd would save no tensors (give an input requires_grad=True)")
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(*inputs)
    return sum(storages.values())


def activation_bytes_per_token(config: LMConfig, seqlen: int | None = None, dtype=torch.float32) -> float:
    """Bytes autograd saves per token in one block (pre-norm and Mamba-2 mixer, :class:`mambalab.modules.lm.Block`)
    of ``config``: :func:`saved_activation_bytes` for one sequence of ``seqlen`` positions and of 2·seqlen, the
    difference / seqlen. The difference drops what does not grow with l (copies of the per-head parameters and
    of the conv weight, which the mixer makes in fp32). ``seqlen`` defaults to ``config.chunk_size``: the SSD
    saves a state per chunk, so whole chunks give the per-token rate. Inputs and parameters in ``dtype`` on the
    CPU; the SSD runs as ``config.scan`` says (with "kernel", in Triton's interpreter: seconds at large widths)."""
    from mambalab.modules.lm import Block
    from mambalab.modules.mamba2 import Mamba2
    from mambalab.modules.norm import GatedRMSNorm

    seqlen = config.chunk_size if seqlen is None else seqlen
    _positive(seqlen=seqlen)
    if config.layer != "Mamba2":
        raise ValueError(f"activation_bytes_per_token counts Mamba-2 blocks; config.layer is {config.layer!r}")
    mixer = Mamba2(config.d_model, **config.mixer_kwargs(), layer_idx=0)
    block = Block(GatedRMSNorm(config.d_model, eps=config.norm_epsilon), mixer).to(dtype)
    gen = torch.Generator().manual_seed(0)
    counts = [saved_activation_bytes(block, torch.randn(1, l, config.d_model, dtype=dtype, generator=gen)
                                     .requires_grad_()) for l in (seqlen, 2 * seqlen)]
    return (counts[1] - counts[0]) / seqlen


def memory_model(config: LMConfig, tokens: int, activation_bytes_per_token_layer: float, tp: int = 1, cp: int = 1,
                 bytes_per_param: int = 16) -> dict[str, float]:
    """A model of the bytes one rank holds in training (module docstring), not a measurement:
    ``static_bytes`` = bytes_per_param · parameters / tp (TP shards the training state, CP replicates it) and
    ``activation_bytes`` = activation_bytes_per_token_layer · n_layer · tokens / (tp · cp)."""
    _positive(tokens=tokens, tp=tp, cp=cp, bytes_per_param=bytes_per_param)
    if not activation_bytes_per_token_layer >= 0:
        raise ValueError(f"activation_bytes_per_token_layer must be a nonnegative number; got "
                         f"{activation_bytes_per_token_layer!r}")
    static = bytes_per_param * config.num_parameters() / tp
    act = activation_bytes_per_token_layer * config.n_layer * tokens / (tp * cp)
    return {"static_bytes": static, "activation_bytes": act, "total_bytes": static + act}
