"""Autoregressive generation with a state that does not grow: prefill the prompt, then one step a token.

For a prompt ids (b, l0):

    logits_0 = model(ids, inference_params)     chunked scans over the prompt; fills each layer's states
    for t = 1 … max_new_tokens:
        x_t = sample(process(logits_{t-1}))     (b,)
        logits_t = model(x_t[:, None], inference_params)    one step per layer, O(1) in the position

Each layer's cache is its mixer's fixed-size state tuple (Mamba-1/2: conv window and SSM state; Mamba-3: angle,
state, previous k and v), so memory is the same for 4K and 64K tokens of context.

``process`` applies, in transformers' order, the repetition penalty (a seen token's logit s becomes s / θ if
s > 0, else s · θ), the temperature (s / T), then top-k (keep the k largest), top-p (keep the smallest set of
tokens, by decreasing probability, whose mass reaches p) and min-p (keep tokens whose probability is at least
min_p times the largest); filtered logits are -inf.

Decoding is greedy (the argmax) unless ``do_sample=True``, as in mamba-ssm's ``generate`` (``top_k=1``) and
transformers' (``do_sample=False``): the same prompt gives the same tokens without a seed. With sampling on,
temperature 0 is greedy too. Sampling arguments given without ``do_sample=True`` change nothing, and a warning
names them, as transformers' does.
"""
from __future__ import annotations

import warnings
from typing import Callable, Iterator

import torch

from mambalab.inference.cache import InferenceParams
from mambalab.inference.graphs import DecodeGraph

__all__ = ["apply_repetition_penalty", "filter_min_p", "filter_top_k", "filter_top_p", "generate", "stream"]


# ------------------------------------------------------------------------------------------ logits processing
def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """logits (b, V), seen ids (b, m): s -> s / θ where s > 0 and s · θ otherwise, for every seen token."""
    if penalty == 1.0 or seen.numel() == 0:
        return logits
    score = logits.gather(1, seen)
    score = torch.where(score > 0, score / penalty, score * penalty)
    return logits.scatter(1, seen, score)


def filter_top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep each row's k largest logits (ties at the k-th value kept), the rest -inf; k = 0 keeps all."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def filter_top_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Keep the smallest set of tokens, by decreasing probability, whose total probability reaches p."""
    if p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
    probs = sorted_logits.softmax(-1)
    mass_before = probs.cumsum(-1) - probs           # mass of the tokens ranked above each one
    drop_sorted = mass_before >= p                   # already p without this token: drop it (the first stays)
    drop = drop_sorted.scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def filter_min_p(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """Keep the tokens whose probability is at least min_p times the most likely token's."""
    if min_p <= 0.0:
        return logits
    probs = logits.softmax(-1)
    keep = probs >= min_p * probs.max(-1, keepdim=True).values
    return logits.masked_fill(~keep, float("-inf"))


def _check(max_new_tokens, temperature, top_k, top_p, min_p, repetition_penalty):
    if int(max_new_tokens) != max_new_tokens or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be a non-negative integer; got {max_new_tokens}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 is greedy); got {temperature}")
    if int(top_k) != top_k or top_k < 0:
        raise ValueError(f"top_k must be a non-negative integer (0: no top-k); got {top_k}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must lie in (0, 1]; got {top_p}")
    if not 0.0 <= min_p <= 1.0:
        raise ValueError(f"min_p must lie in [0, 1]; got {min_p}")
    if repetition_penalty <= 0:
        raise ValueError(f"repetition_penalty must be > 0 (1 is none); got {repetition_penalty}")


def _warn_unused_sampling(do_sample, temperature, top_k, top_p, min_p):
    """Greedy decoding ignores the sampling filters: say so, rather than silently return the argmax."""
    if do_sample:
        return
    unused = [f"{name}={value}" for name, value, inert in [("temperature", temperature, (0, 1.0)),
                                                           ("top_k", top_k, (0, 1)), ("top_p", top_p, (1.0,)),
                                                           ("min_p", min_p, (0.0,))] if value not in inert]
    if unused:
        warnings.warn(f"do_sample is False (greedy decoding), so {', '.join(unused)} change nothing; pass "
                      f"do_sample=True to sample", UserWarning, stacklevel=3)


# ------------------------------------------------------------------------------------------ the loop
@torch.no_grad()
def stream(model, input_ids: torch.Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: int = 0,
           top_p: float = 1.0, min_p: float = 0.0, repetition_penalty: float = 1.0, eos_token_id=None,
           generator: torch.Generator | None = None, do_sample: bool = False, progress: bool = False,
           decode_step: Callable | None = None) -> Iterator[torch.Tensor]:
    """Yield each new token (b,) as it is chosen; the arguments are :func:`generate`'s.

    ``decode_step(tokens (b, 1), inference_params) -> logits (b, V)``, when given, replaces the eager step (the CUDA
    graph of :mod:`mambalab.inference.graphs` plugs in here); the prefill always runs eagerly. A decode step
    with a ``params`` attribute (the graph's own cache) is given those: the prefill fills them."""
    if input_ids.dim() != 2 or input_ids.dtype not in (torch.int64, torch.int32) or input_ids.shape[1] < 1:
        raise ValueError(f"input_ids must be integer token ids of shape (b, l >= 1); got "
                         f"{tuple(input_ids.shape)} {input_ids.dtype}")
    _check(max_new_tokens, temperature, top_k, top_p, min_p, repetition_penalty)
    _warn_unused_sampling(do_sample, temperature, top_k, top_p, min_p)
    b, l0 = input_ids.shape
    eos = None if eos_token_id is None else torch.as_tensor(eos_token_id, device=input_ids.device).reshape(-1)
    greedy = temperature == 0 or not do_sample
    params = getattr(decode_step, "params", None)    # a CUDA graph decodes on the states it owns
    if params is None:
        params = InferenceParams(max_seqlen=l0 + max_new_tokens, max_batch_size=b)
    else:
        params.reset(l0 + max_new_tokens, b)
    seen = input_ids.long()
    logits = model(seen, inference_params=params, num_last_tokens=1)[:, -1].float()   # (b, V)
    params.seqlen_offset = l0
    finished = torch.zeros(b, dtype=torch.bool, device=input_ids.device)
    bar = None
    if progress:
        from tqdm.auto import tqdm
        bar = tqdm(total=max_new_tokens, desc="decoding", unit="tok")
    try:
        for t in range(max_new_tokens):
            scores = apply_repetition_penalty(logits, seen, repetition_penalty)
            if greedy:
                token = scores.argmax(-1)
            else:
                scores = scores / temperature
                scores = filter_min_p(filter_top_p(filter_top_k(scores, top_k), top_p), min_p)
                token = torch.multinomial(scores.softmax(-1), 1, generator=generator)[:, 0]
            if eos is not None:  # a finished row keeps emitting EOS
                token = torch.where(finished, eos[0], token)
                finished |= torch.isin(token, eos)
            seen = torch.cat([seen, token[:, None]], dim=1)
            if bar is not None:
                bar.update(1)
            yield token
            if eos is not None and bool(finished.all()):
                return
            if t + 1 < max_new_tokens:
                if decode_step is not None:
                    logits = decode_step(token[:, None], params).float()
                else:
                    logits = model(token[:, None], inference_params=params)[:, -1].float()
                params.seqlen_offset += 1
    finally:
        if bar is not None:
            bar.close()


def generate(model, input_ids: torch.Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: int = 0,
             top_p: float = 1.0, min_p: float = 0.0, repetition_penalty: float = 1.0, eos_token_id=None,
             generator: torch.Generator | None = None, callback: Callable | None = None, progress: bool = False,
             do_sample: bool = False, cg: bool = False) -> torch.Tensor:
    """input_ids (b, l0) -> (b, l0 + m) with the m ≤ max_new_tokens new tokens appended (fewer if every row
    reached ``eos_token_id``; finished rows are padded with EOS).

    Greedy (argmax) by default; ``do_sample=True`` samples after the repetition penalty, ``temperature``,
    ``top_k``, ``top_p`` and ``min_p`` (temperature 0 stays greedy), seeded by ``generator``. ``callback(token
    (b,))`` is called as each token is chosen (:func:`stream` is the iterator form); ``progress`` shows a tqdm
    bar. ``cg=True`` replays the decode step as a CUDA graph (GPU only; see :mod:`mambalab.inference.graphs`).
    """
    decode_step = None
    if cg:
        decode_step = DecodeGraph.for_model(model, batch_size=input_ids.shape[0])   # recorded once, then replayed
    tokens = []
    for token in stream(model, input_ids, max_new_tokens, temperature, top_k, top_p, min_p, repetition_penalty,
                        eos_token_id, generator, do_sample, progress, decode_step):
        tokens.append(token)
        if callback is not None:
            callback(token)
    if not tokens:
        return input_ids
    return torch.cat([input_ids, torch.stack(tokens, dim=1).to(input_ids.dtype)], dim=1)
