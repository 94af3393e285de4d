"""Where a block keeps its decoding state between calls: mamba-ssm's ``inference_params.key_value_memory_dict``,
keyed by the block's ``layer_idx``, holding the tuple its ``allocate_inference_cache`` makes; and whether a decode step must stay differentiable."""
from __future__ import annotations

import torch


def states_from_cache(block, inference_params, batch_size: int, initialize_states: bool = False):
    """``block``'s state tuple in ``inference_params.key_value_memory_dict``, made on first use with
    ``block.allocate_inference_cache(batch_size, inference_params.max_seqlen)`` (zeroed again with
    ``initialize_states``)."""
    if block.layer_idx is None:
        raise ValueError("decoding with inference_params needs the block's layer_idx (its key in "
                         "inference_params.key_value_memory_dict); construct it with layer_idx=...")
    states = inference_params.key_value_memory_dict
    if block.layer_idx not in states:
        states[block.layer_idx] = block.allocate_inference_cache(batch_size, inference_params.max_seqlen)
    elif initialize_states:
        for state in states[block.layer_idx]:
            state.zero_()
    return states[block.layer_idx]


def step_needs_autograd(block, hidden_states) -> bool:
    """Whether a decode step must be recorded for autograd: grad mode on, and the input or the block's
    parameters require grad. The decode kernels have no backward; such a step runs the PyTorch reference
    step instead (mamba-ssm's kernels would silently drop those gradients)."""
    return torch.is_grad_enabled() and (hidden_states.requires_grad
                                        or any(p.requires_grad for p in block.parameters(recurse=False)))
