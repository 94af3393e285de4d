"""The decoding cache that generation and the CUDA-graph decode step share: :class:`InferenceParams`."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["InferenceParams"]


@dataclass
class InferenceParams:
    """The decoding cache, as mamba-ssm's ``InferenceParams``: ``key_value_memory_dict[layer_idx]`` holds each
    layer's state tuple; ``seqlen_offset`` is 0 during the prefill and the position afterwards."""

    max_seqlen: int
    max_batch_size: int
    seqlen_offset: int = 0
    batch_size_offset: int = 0
    key_value_memory_dict: dict = field(default_factory=dict)
    lengths_per_sample: torch.Tensor | None = None

    def reset(self, max_seqlen: int, max_batch_size: int) -> None:
        self.max_seqlen, self.max_batch_size, self.seqlen_offset = max_seqlen, max_batch_size, 0
