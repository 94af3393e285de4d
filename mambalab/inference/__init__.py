"""Inference: checkpoints users have, generation with a fixed-size state, CUDA-graph decoding.

* :mod:`~mambalab.inference.checkpoints`: :func:`from_pretrained`, :func:`save_pretrained` in mamba-ssm's
  ``MambaLMHeadModel`` layout and transformers' ``MambaForCausalLM`` / ``Mamba2ForCausalLM`` layout.
* :mod:`~mambalab.inference.generate`: :func:`generate`, :func:`stream` (greedy, temperature, top-k, top-p,
  min-p, repetition penalty, EOS, seeded sampling) and the logits filters.
* :mod:`~mambalab.inference.graphs`: :class:`DecodeGraph`, the decode step replayed as a CUDA graph.
* :mod:`~mambalab.inference.cache`: :class:`InferenceParams`, the decoding cache both of them use.
"""
from mambalab.inference.checkpoints import CheckpointError, from_pretrained, save_pretrained
from mambalab.inference.cache import InferenceParams
from mambalab.inference.generate import (apply_repetition_penalty, filter_min_p, filter_top_k, filter_top_p,
                                         generate, stream)
from mambalab.inference.graphs import DecodeGraph

__all__ = ["CheckpointError", "DecodeGraph", "InferenceParams", "apply_repetition_penalty", "filter_min_p",
           "filter_top_k", "filter_top_p", "from_pretrained", "generate", "save_pretrained", "stream"]
