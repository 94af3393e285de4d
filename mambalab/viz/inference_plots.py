"""Figures for the inference chapter (notebook 07): what decoding keeps in memory, sampling from a small text
model, and what a decode step costs.

* :func:`memory_figure`: the decode cache of a Mamba-2 model against a Transformer's KV cache, by context
  length (the bytes come from :mod:`mambalab.inference.memory`).
* :func:`sampling_figure`: the next-character distribution after a prompt under a temperature and top-p (kept
  and dropped characters), with a continuation sampled under the same settings: the explorer's figure.
* :func:`decode_ms_per_token`, :func:`decode_speed_figure`, :func:`mimo_decode_figure`: decode timings (GPU).
* :func:`curves_figure`: training losses.

Every figure builder returns a ``plotly.graph_objects.Figure`` with a title, labelled axes and units.
"""
from __future__ import annotations

import html
import textwrap
import time
from collections.abc import Mapping, Sequence

import plotly.graph_objects as go
import torch

from mambalab.inference import filter_top_p, generate
from mambalab.modules.lm import MambaLM
from mambalab.train.text import CharTokenizer

__all__ = ["curves_figure", "decode_ms_per_token", "decode_speed_figure", "memory_figure", "mimo_decode_figure",
           "sampling_figure"]

_COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f")
MIB = 2 ** 20


# ------------------------------------------------------------------------------------------ memory
def memory_figure(rows: Sequence[Mapping], formula_mamba2: int, formula_kv_per_token: int, *, title: str) -> go.Figure:
    """Decode cache against context length, log-log: formula lines (the Mamba-2 state ``formula_mamba2`` bytes
    whatever the length; the KV cache ``formula_kv_per_token`` bytes a token) and the measured points of ``rows``
    (from :func:`measure_cache_bytes`), in MiB."""
    seqlens = [r["seqlen"] for r in rows]
    how = rows[0]["how"] if rows else "measured"
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=seqlens, y=[formula_kv_per_token * L / MIB for L in seqlens], mode="lines",
                             name="Transformer KV cache, formula", line=dict(color=_COLORS[3])))
    fig.add_trace(go.Scatter(x=seqlens, y=[r["kv_bytes"] / MIB for r in rows], mode="markers",
                             name=f"Transformer KV cache, measured ({how})",
                             marker=dict(color=_COLORS[3], size=10, symbol="circle-open", line=dict(width=2))))
    fig.add_trace(go.Scatter(x=seqlens, y=[formula_mamba2 / MIB] * len(seqlens), mode="lines",
                             name="Mamba-2 state, formula", line=dict(color=_COLORS[0])))
    fig.add_trace(go.Scatter(x=seqlens, y=[r["mamba2_bytes"] / MIB for r in rows], mode="markers",
                             name=f"Mamba-2 state, measured ({how})",
                             marker=dict(color=_COLORS[0], size=10, symbol="square-open", line=dict(width=2))))
    fig.update_layout(title=title, xaxis_title="context length L (tokens, log scale)",
                      yaxis_title="decode cache (MiB, log scale)", xaxis_type="log", yaxis_type="log",
                      legend=dict(x=0.01, y=0.99), height=480)
    fig.update_xaxes(tickvals=seqlens, ticktext=[f"{L // 1024}K" if L >= 1024 else str(L) for L in seqlens])
    return fig


# ------------------------------------------------------------------------------------------ text
def curves_figure(curves: Mapping[str, Sequence[float]], title: str, yaxis_title: str,
                  xaxis_title: str = "training step") -> go.Figure:
    """One line per curve."""
    fig = go.Figure([go.Scatter(y=list(v), mode="lines", name=k, line=dict(color=_COLORS[i % 8]))
                     for i, (k, v) in enumerate(curves.items())])
    fig.update_layout(title=title, xaxis_title=xaxis_title, yaxis_title=yaxis_title, height=420)
    return fig


# ------------------------------------------------------------------------------------------ sampling
def _shown(ch: str) -> str:
    return {"\n": "⏎", " ": "␣"}.get(ch, ch)


def _wrapped_html(text: str, width: int = 90) -> str:
    lines = []
    for line in text.split("\n"):
        lines += textwrap.wrap(line, width, replace_whitespace=False, drop_whitespace=False) or [""]
    return "<br>".join(html.escape(line).replace(" ", "&nbsp;") for line in lines)


@torch.no_grad()
def sampling_figure(model: MambaLM, tokenizer: CharTokenizer, prompt: str, temperature: float, top_p: float, *,
                    new_chars: int = 160, seed: int = 0, top: int = 30) -> go.Figure:
    """The next character's distribution after ``prompt`` under ``temperature`` and ``top_p``, for the ``top``
    most likely characters (kept by top-p in colour, dropped in grey, their probability before the filter as
    outlines), with ``new_chars`` characters sampled under the same settings (seeded) printed below."""
    device = next(model.parameters()).device
    ids = tokenizer.encode(prompt).to(device)[None]                       # (1, l0)
    logits = model(ids)[0, -1].float()                                    # (V,)
    scaled = logits / temperature
    before = scaled.softmax(-1)
    kept = filter_top_p(scaled[None], top_p)[0]
    after = kept.softmax(-1)
    order = before.argsort(descending=True)[:top].cpu()
    labels = [_shown(tokenizer.chars[i]) for i in order]
    is_kept = kept.isfinite().cpu()
    out = generate(model, ids, new_chars, temperature=temperature, top_p=top_p, do_sample=True,
                   generator=torch.Generator(device).manual_seed(seed))
    text = tokenizer.decode(out[0, ids.shape[1]:])
    fig = go.Figure()
    fig.add_trace(go.Bar(x=labels, y=before.cpu()[order].tolist(), name="p after temperature, before top-p",
                         marker=dict(color="rgba(0,0,0,0)", line=dict(color="#444", width=1))))
    fig.add_trace(go.Bar(x=labels, y=after.cpu()[order].tolist(), name="p sampled from (after top-p)",
                         marker=dict(color=[_COLORS[0] if is_kept[i] else "#bbbbbb" for i in order])))
    n_kept = int(is_kept.sum())
    fig.update_layout(
        title=f"Next character after the prompt: temperature {temperature:.2f}, top-p {top_p:.2f} "
              f"({n_kept} of {tokenizer.vocab_size} characters kept)",
        xaxis_title=f"the {len(order)} most likely characters (␣ space, ⏎ newline)",
        yaxis_title="probability", barmode="overlay", height=560, margin=dict(b=230),
        legend=dict(x=0.6, y=0.98))
    fig.add_annotation(text="<b>prompt</b> " + _wrapped_html(prompt[-80:]) + "<br><b>sampled</b> "
                            + _wrapped_html(text), xref="paper", yref="paper", x=0, y=-0.22, xanchor="left",
                       yanchor="top", showarrow=False, align="left", font=dict(family="monospace", size=11))
    return fig


# ------------------------------------------------------------------------------------------ speed (GPU)
def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def decode_ms_per_token(model: MambaLM, prompt: torch.Tensor, new_tokens: int, cg: bool, repeats: int = 3) -> float:
    """Milliseconds per decoded token of greedy :func:`generate` (best of ``repeats``), timed from the first new
    token to the last: the clock starts when the prefill has chosen the first token (the device synchronised
    there, through ``generate``'s callback) and stops when the last is out, so it holds the ``new_tokens - 1``
    decode steps alone. A warm-up run first (compilation, autotuning and, with ``cg=True``, the recording of
    the model's CUDA graph, which later calls replay)."""
    if new_tokens < 2:
        raise ValueError(f"new_tokens must be at least 2 (a token from the prefill, then decode steps); got {new_tokens}")
    device = prompt.device

    def run() -> float:
        start: list[float] = []

        def first_token(_token: torch.Tensor) -> None:
            if not start:
                _sync(device)
                start.append(time.perf_counter())

        generate(model, prompt, new_tokens, temperature=0, cg=cg, callback=first_token)
        _sync(device)
        return time.perf_counter() - start[0]

    run()
    return 1e3 * min(run() for _ in range(repeats)) / (new_tokens - 1)


def decode_speed_figure(ms_per_token: Mapping[str, float], *, note: str) -> go.Figure:
    """Bars of ms per decoded token, one per way of running the step."""
    names = list(ms_per_token)
    fig = go.Figure(go.Bar(x=names, y=[ms_per_token[k] for k in names], marker_color=_COLORS[:len(names)],
                           text=[f"{ms_per_token[k]:.3f} ms" for k in names], textposition="outside"))
    fig.update_layout(title=f"Decode speed, greedy: {note}", xaxis_title="decode step",
                      yaxis_title="time per token (ms)", height=420)
    return fig


def mimo_decode_figure(times_us: Mapping[int, Mapping[int, float]], *, note: str) -> go.Figure:
    """Mamba-3 decode-step time against batch size, one line per MIMO rank (``times_us[rank][batch]`` in µs)."""
    fig = go.Figure()
    for i, (rank, by_batch) in enumerate(times_us.items()):
        batches = sorted(by_batch)
        fig.add_trace(go.Scatter(x=batches, y=[by_batch[b] for b in batches], mode="lines+markers",
                                 name=f"r = {rank}" + (" (SISO)" if rank == 1 else ""),
                                 line=dict(color=_COLORS[i % 8])))
    fig.update_layout(title=f"Mamba-3 decode step against batch size, MIMO ranks: {note}",
                      xaxis_title="batch size (sequences, log scale)", yaxis_title="time per step (µs)",
                      xaxis_type="log", height=420)
    return fig
