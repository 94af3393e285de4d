"""Tensor (Megatron-style), context and data parallelism for Mamba-2, on ``torch.distributed``.

* :mod:`~mambalab.parallel.collectives`: the four autograd-aware collectives.
* :mod:`~mambalab.parallel.layout`: TP × CP × DP from torchrun's environment (TP inside a node, fastest).
* :mod:`~mambalab.parallel.linear`: :class:`ColumnParallelLinear`, :class:`RowParallelLinear`.
* :mod:`~mambalab.parallel.vocab`: :class:`VocabParallelEmbedding`, :func:`vocab_parallel_cross_entropy`.
* :mod:`~mambalab.parallel.mamba2`: :class:`TensorParallelMamba2`, heads and groups split over ranks.
* :mod:`~mambalab.parallel.lm`: :class:`TensorParallelMambaLM`.
* :mod:`~mambalab.parallel.sharding`: which part of the full tensor each rank holds; shard and gather.
* :mod:`~mambalab.parallel.grads`: the sequence-parallel and data-parallel gradient all-reduces.
* :mod:`~mambalab.parallel.context`: context parallelism, one sequence split across ranks (SSD states, conv halo).
* :mod:`~mambalab.parallel.context_mamba2`: :class:`ContextParallelMamba2`, :class:`ContextParallelMambaLM`.

Works with gloo (CPU processes) and NCCL (GPUs).
"""
from mambalab.parallel.collectives import copy_to_tp, gather_along, reduce_from_tp, reduce_scatter_along
from mambalab.parallel.context import context_parallel_conv1d, context_parallel_ssd, sum_over_ranks
from mambalab.parallel.context_mamba2 import ContextParallelMamba2, ContextParallelMambaLM
from mambalab.parallel.grads import allreduce_data_parallel_grads, allreduce_replicated_grads
from mambalab.parallel.layout import ParallelLayout, check_divides, init_distributed, single_process_layout
from mambalab.parallel.linear import ColumnParallelLinear, RowParallelLinear
from mambalab.parallel.lm import TensorParallelMambaLM
from mambalab.parallel.mamba2 import TensorParallelMamba2
from mambalab.parallel.sharding import broadcast_parameters, gather_full, load_full_state_dict, shard_specs
from mambalab.parallel.vocab import VocabParallelEmbedding, vocab_parallel_cross_entropy

__all__ = [
    "ColumnParallelLinear", "ParallelLayout", "RowParallelLinear", "TensorParallelMamba2", "TensorParallelMambaLM",
    "VocabParallelEmbedding", "allreduce_data_parallel_grads", "broadcast_parameters", "allreduce_replicated_grads", "check_divides",
    "copy_to_tp", "gather_along", "gather_full", "init_distributed", "load_full_state_dict", "reduce_from_tp",
    "reduce_scatter_along", "shard_specs", "single_process_layout", "vocab_parallel_cross_entropy",
    "context_parallel_conv1d", "context_parallel_ssd", "sum_over_ranks", "ContextParallelMamba2",
    "ContextParallelMambaLM",
]
