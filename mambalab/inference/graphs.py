"""The whole decode step of a model as one CUDA graph, replayed once per token (mamba-ssm's ``cg=True``).

Called from Python, a decode step launches a few kernels per layer and the host dominates (hundreds of µs
for tens of µs of kernels). A CUDA graph records those launches once, on fixed tensors: the input token
buffer (b, 1), every layer's state tensors (updated in place by each mixer's ``step``) and the logits it
writes; replaying it reruns every kernel with one launch. Recording runs the step, so :class:`DecodeGraph`
saves the states first and restores them afterwards: the recorded warm-up leaves no trace in the sequence.
The graph owns the state tensors it was recorded on, so it is recorded once per model and batch size and
replayed for every later sequence (each prefill writes its states into those tensors).
"""
from __future__ import annotations

import torch

from mambalab.inference.cache import InferenceParams

__all__ = ["DecodeGraph"]


class DecodeGraph:
    """``decode_step(tokens (b, 1), inference_params) -> logits (b, V)`` replayed from a CUDA graph.

    The graph owns its decoding cache, :attr:`params`: :func:`~mambalab.inference.generate.stream` prefills every
    sequence into those state tensors (the prefill writes them in place), and the graph, recorded on the first
    decode step, replays on them for this and every later sequence of the same batch size. The states of a
    Mamba model have a fixed size, so one recording serves every prompt and output length (mamba-ssm's graph
    cache, ``update_graph_cache`` in ``mamba_ssm/utils/generation.py``, records again whenever prompt plus new
    tokens exceed the length it recorded for). :meth:`for_model` keeps one per batch size on the model. Needs a CUDA model."""

    def __init__(self, model, batch_size: int, warmup: int = 2):
        if not torch.cuda.is_available() or next(model.parameters()).device.type != "cuda":
            raise RuntimeError("cg=True records the decode step as a CUDA graph: the model must be on a CUDA GPU "
                               "(use cg=False on the CPU)")
        self.model, self.batch_size, self.warmup = model, batch_size, warmup
        self.params = InferenceParams(max_seqlen=1, max_batch_size=batch_size)   # states made by the prefill
        self.graph = None

    @classmethod
    def for_model(cls, model, batch_size: int) -> "DecodeGraph":
        """The model's graph for ``batch_size``, recorded once and kept on the model. The graph reads the
        weights' memory, so a model whose parameters were replaced (``.to(dtype)``, a new device) gets new
        graphs; weights changed in place (``load_state_dict``) are read by the existing ones."""
        weights = tuple((p.data_ptr(), p.dtype) for p in model.parameters())
        kept = model.__dict__.get("_mambalab_decode_graphs")
        if kept is None or kept[0] != weights:
            kept = model.__dict__["_mambalab_decode_graphs"] = (weights, {})
        graphs = kept[1]
        if batch_size not in graphs:
            graphs[batch_size] = cls(model, batch_size)
        return graphs[batch_size]

    def _record(self, tokens: torch.Tensor) -> None:
        params = self.params
        states = [t for layer in params.key_value_memory_dict.values() for t in layer]
        saved = [t.clone() for t in states]
        offset = params.seqlen_offset
        self.tokens = tokens.clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(self.warmup):   # the kernels' first launches (autotuning, compilation) happen here
                self.model(self.tokens, inference_params=params)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = self.model(self.tokens, inference_params=params)[:, -1]
        for t, s in zip(states, saved):
            t.copy_(s)
        params.seqlen_offset = offset

    def __call__(self, tokens: torch.Tensor, params) -> torch.Tensor:
        if tokens.shape != (self.batch_size, 1):
            raise ValueError(f"tokens must have shape (batch_size={self.batch_size}, 1); got {tuple(tokens.shape)}")
        if params is not self.params:
            raise ValueError("a DecodeGraph replays on its own states: decode with inference_params=graph.params "
                             "(stream and generate do)")
        if self.graph is None:
            self._record(tokens)
        self.tokens.copy_(tokens)
        self.graph.replay()
        return self.logits
