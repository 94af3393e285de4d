"""Where a block keeps its decoding state between calls: mamba-ssm's ``inference_params.key_value_memory_dict``,
keyed by the block's ``layer_idx``, holding the tuple its ``allocate_inference_cache`` makes."""
from __future__ import annotations


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

