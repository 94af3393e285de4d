"""The whole decode step of a model as one CUDA graph, replayed once per token (mamba-ssm's ``cg=True``).

Called from Python, a decode step launches a few kernels per layer and the host dominates (hundreds of µs
for tens of µs of kernels). A CUDA graph records those launches once, on fixed tensors: the input token
buffer (b, 1), every layer's state tensors (updated in place by each mixer's ``step``) and the logits it
writes; replaying it reruns every kernel with one launch. Recording runs the step, so :class:`DecodeGraph`
saves the states first and restores them afterwards: the recorded warm-up leaves no trace in the sequence.
"""
from __future__ import annotations

import torch

__all__ = ["DecodeGraph"]


class DecodeGraph:
    """``decode_step(tokens (b, 1), inference_params) -> logits (b, V)`` replayed from a CUDA graph.

    The graph is recorded on the first call, against that call's ``inference_params`` state tensors (the same
    tensors for the rest of the sequence: the cache is fixed-size). Needs a CUDA model."""

    def __init__(self, model, batch_size: int, warmup: int = 2):
        if not torch.cuda.is_available() or next(model.parameters()).device.type != "cuda":
            raise RuntimeError("cg=True records the decode step as a CUDA graph: the model must be on a CUDA GPU "
                               "(use cg=False on the CPU)")
        self.model, self.batch_size, self.warmup = model, batch_size, warmup
        self.graph = None

    def _record(self, tokens: torch.Tensor, params) -> None:
        states = [t for layer in params.key_value_memory_dict.values() for t in layer]
        saved = [t.clone() for t in states]
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
        self.params = params

    def __call__(self, tokens: torch.Tensor, params) -> torch.Tensor:
        if tokens.shape != (self.batch_size, 1):
            raise ValueError(f"tokens must have shape (batch_size={self.batch_size}, 1); got {tuple(tokens.shape)}")
        if self.graph is None:
            self._record(tokens, params)
        elif params is not self.params:
            raise ValueError("a DecodeGraph replays on the states it was recorded with; make a new one per sequence")
        self.tokens.copy_(tokens)
        self.graph.replay()
        return self.logits
