"""Figures for the tensor-parallel chapter (notebook 06): who holds what, what it costs, how runs compare.

Every builder returns a ``plotly.graph_objects.Figure`` with a title, labelled axes and units.

* :func:`split_figure`: a Mamba-2 block's in_proj rows (z, x, B, C, dt) and out_proj columns coloured by the
  TP rank that holds them, with the collectives marked where they sit.
* :func:`communication_figure`: collectives per layer for Mamba-2, Mamba-1 and a transformer layer.
* :func:`memory_figure`: parameter + gradient + optimizer memory per rank for several TP degrees.
* :func:`curves_figure`: per-step curves (losses, Δ values, …) of several runs overlaid.
* :func:`tp_cost_figure`: for one TP degree, sequence-parallel setting and sequence length, the memory each rank
  holds (training state, layer-boundary activations) and the bytes it sends per layer (the widget's figure).
* :func:`sequence_split_figure`: bytes a rank sends per layer and step against the sequence length, Megatron's
  sequence parallelism against context parallelism.
* :func:`context_parallel_figure`: the context-parallel ring: ranks as lanes, chunks as boxes, the state passed
  forward and its gradient backward, and the order in which each rank's steps run.
* :func:`memory_model_figure`: GiB per rank against the sequence length for several layouts, from a cost model.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import plotly.graph_objects as go
from plotly.subplots import make_subplots

__all__ = ["communication_figure", "context_parallel_figure", "curves_figure", "memory_figure",
           "memory_model_figure", "sequence_split_figure", "split_figure", "tp_cost_figure"]

_COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f")


def split_figure(tp: int, d_inner: int, ngroups: int, d_state: int, nheads: int, d_model: int) -> go.Figure:
    """Mamba-2's weights split over ``tp`` ranks: each bar is the full weight's output rows (in_proj) or input
    columns (out_proj), each cell coloured by the rank that holds it."""
    gn = ngroups * d_state
    pieces = [("z", d_inner), ("x", d_inner), ("B", gn), ("C", gn), ("dt", nheads)]
    fig = go.Figure()
    seen = set()

    def cell(x0, width, y, rank, text):
        fig.add_trace(go.Bar(x=[width], base=[x0], y=[y], orientation="h", marker_color=_COLORS[rank % 8],
                             marker_line_color="white", marker_line_width=1, name=f"rank {rank}",
                             legendgroup=f"rank {rank}", showlegend=rank not in seen, text=text,
                             textposition="inside", insidetextanchor="middle",
                             hovertemplate=f"{text}: rank {rank}, {width} rows/cols<extra></extra>"))
        seen.add(rank)

    rows, cols = "in_proj (column-parallel):<br>output rows", "out_proj (row-parallel):<br>input columns"
    offset = 0
    for name, size in pieces:
        for r in range(tp):
            cell(offset + r * size // tp, size // tp, rows, r, f"{name}{r}")
        offset += size
    for r in range(tp):
        cell(r * d_inner // tp, d_inner // tp, cols, r, f"y{r}")
    fig.add_annotation(x=offset, y=rows, xanchor="right", yshift=34, showarrow=False,
                       text="forward: none · backward: <b>all-reduce</b> of dL/du (copy_to_tp)")
    fig.add_annotation(x=d_inner, y=cols, xanchor="left", xshift=8, showarrow=False,
                       text="forward: <b>all-reduce</b> of the partial sums (reduce_from_tp) · backward: none")
    fig.update_layout(barmode="overlay", height=330, bargap=0.35,
                      title=f"Mamba-2 split over TP = {tp}: rank r holds heads/groups r·h/T …, conv, SSD and "
                            f"norm stay on the rank (d_model = {d_model})",
                      xaxis_title="row (in_proj) or column (out_proj) index of the full weight",
                      yaxis_title="weight", legend_title="held by")
    return fig


def communication_figure(table: Mapping[str, Mapping[str, int]], d_model: int) -> go.Figure:
    """Bars of all-reduces per layer (forward, backward) and numbers all-reduced per token, per architecture
    (``table`` from :func:`mambalab.parallel.cost.collectives_per_layer`)."""
    names = list(table)
    fig = make_subplots(rows=1, cols=2, subplot_titles=("all-reduces per layer and step",
                                                        "numbers all-reduced per token (forward)"))
    for i, phase in enumerate(("forward", "backward")):
        fig.add_trace(go.Bar(x=names, y=[table[n][phase] for n in names], name=phase, marker_color=_COLORS[i]),
                      row=1, col=1)
    fig.add_trace(go.Bar(x=names, y=[table[n]["elements_per_token"] for n in names], name="elements / token",
                         marker_color=_COLORS[2]), row=1, col=2)
    fig.update_yaxes(title_text="collectives (count)", row=1, col=1)
    fig.update_yaxes(title_text="elements per token (count)", row=1, col=2)
    fig.update_xaxes(title_text="layer", row=1, col=1)
    fig.update_xaxes(title_text="layer", row=1, col=2)
    fig.update_layout(title=f"Tensor-parallel communication per layer (d_model = {d_model})", height=380)
    return fig


def memory_figure(rows_by_tp: Mapping[int, Sequence[Mapping]], title: str) -> go.Figure:
    """Grouped bars: GiB of parameters + gradients + AdamW state held by each rank, one group per TP degree
    (``rows_by_tp`` from :func:`mambalab.parallel.cost.memory_per_rank`)."""
    fig = go.Figure()
    width = max(len(rows) for rows in rows_by_tp.values())
    for r in range(width):
        xs = [f"TP = {tp}" for tp, rows in rows_by_tp.items() if r < len(rows)]
        ys = [rows[r]["bytes"] / 2**30 for rows in rows_by_tp.values() if r < len(rows)]
        fig.add_trace(go.Bar(x=xs, y=ys, name=f"rank {r}", marker_color=_COLORS[r % 8]))
    fig.update_layout(barmode="group", title=title, xaxis_title="tensor-parallel degree",
                      yaxis_title="parameters + grads + AdamW state per rank (GiB)", legend_title="rank")
    return fig


def curves_figure(curves: Mapping[str, Sequence[float]], title: str, yaxis_title: str,
                  xaxis_title: str = "training step", log_y: bool = False) -> go.Figure:
    """One line per run, overlaid (NaN points leave gaps, so a diverged run shows where it stopped)."""
    fig = go.Figure()
    for i, (name, ys) in enumerate(curves.items()):
        fig.add_trace(go.Scatter(x=list(range(len(ys))), y=list(ys), mode="lines+markers", name=name,
                                 marker_size=4, line_color=_COLORS[i % 8]))
    fig.update_layout(title=title, xaxis_title=xaxis_title, yaxis_title=yaxis_title, legend_title="run")
    if log_y:
        fig.update_yaxes(type="log")
    return fig


def tp_cost_figure(state_bytes_by_tp: Mapping[int, int], *, d_model: int, n_layer: int, batch: int, seqlen: int,
                   tp: int, sequence_parallel: bool, element_size: int = 2) -> go.Figure:
    """Left: GiB per rank at TP = ``tp``: the training state (``state_bytes_by_tp[tp]``, from
    :func:`mambalab.parallel.cost.memory_per_rank`) and the activations at the n_layer layer inputs
    (batch·seqlen·d_model each, split along l by sequence parallelism). Right: MiB each rank sends per layer,
    forward and backward (:func:`mambalab.parallel.cost.layer_communication`)."""
    from mambalab.parallel.cost import layer_communication

    if tp not in state_bytes_by_tp:
        raise ValueError(f"tp = {tp} has no training-state entry; known: {sorted(state_bytes_by_tp)}")
    comm = layer_communication(d_model, batch * seqlen, tp, sequence_parallel, element_size)
    state_gib = state_bytes_by_tp[tp] / 2**30
    act_gib = n_layer * comm["activation_bytes"] / 2**30
    fig = make_subplots(rows=1, cols=2, subplot_titles=("memory per rank", "bytes each rank sends per layer"))
    fig.add_trace(go.Bar(x=["per rank"], y=[state_gib], name="params + grads + AdamW (fp32)",
                         marker_color=_COLORS[0]), row=1, col=1)
    fig.add_trace(go.Bar(x=["per rank"], y=[act_gib], name=f"layer inputs ({n_layer} × b·l·d, bf16)",
                         marker_color=_COLORS[1]), row=1, col=1)
    fig.add_trace(go.Bar(x=["forward", "backward"], y=[comm["forward_bytes"] / 2**20, comm["backward_bytes"] / 2**20],
                         name="all-reduce (or reduce-scatter + all-gather)", marker_color=_COLORS[2]), row=1, col=2)
    fig.update_layout(barmode="stack", title=f"TP = {tp}, sequence parallel {'on' if sequence_parallel else 'off'}, "
                      f"{batch} × {seqlen} tokens a step: {state_gib + act_gib:.3g} GiB and "
                      f"{(comm['forward_bytes'] + comm['backward_bytes']) / 2**20:.3g} MiB a layer per rank",
                      legend=dict(font=dict(size=10)))
    fig.update_yaxes(title_text="GiB per rank", row=1, col=1)
    fig.update_yaxes(title_text="MiB sent per rank", row=1, col=2)
    fig.update_xaxes(title_text="what a rank holds", row=1, col=1)
    fig.update_xaxes(title_text="pass", row=1, col=2)
    return fig


def sequence_split_figure(rows: Sequence[Mapping], degree: int, title: str) -> go.Figure:
    """Log-log lines of MiB one rank sends per layer and step against the sequence length (``rows`` from
    :func:`mambalab.parallel.cost.sequence_split_bytes`): Megatron's sequence parallelism (all-gather +
    reduce-scatter, forward and backward), context parallelism's cut (state + conv halo, forward and backward),
    and context parallelism's gradient sum (once a step, the layer's share)."""
    seqlens = [r["seqlen"] for r in rows]
    fig = go.Figure()
    for i, (key, name, dash) in enumerate((
            ("sequence_parallel_bytes", f"Megatron SP (TP = {degree}): all-gather + reduce-scatter of (b·l, d_model)",
             "solid"),
            ("context_parallel_bytes", f"CP = {degree}: a cut's SSD state + conv halo, forward + backward", "solid"),
            ("context_parallel_gradient_bytes", f"CP = {degree}: the layer's gradients summed over the group "
                                                "(all-gather, once a step)", "dot"))):
        fig.add_trace(go.Scatter(x=seqlens, y=[r[key] / 2**20 for r in rows], name=name, mode="lines+markers",
                                 line=dict(color=_COLORS[i], dash=dash)))
    fig.update_xaxes(type="log", title_text="sequence length l (tokens, b = 1)", tickvals=seqlens,
                     ticktext=[f"{v // 1024}K" for v in seqlens])
    fig.update_yaxes(type="log", title_text="MiB one rank sends per layer and step (forward + backward)")
    fig.update_layout(title=title, legend=dict(font=dict(size=10)), height=420)
    return fig


def _ring_schedule(cp: int) -> list[tuple[int, str, float, float]]:
    """(rank, step, start, end) of context_parallel_ssd's steps in the order :mod:`mambalab.parallel.context`
    runs them, one unit a step (an order, not a timing): the forward's cumsum and chunk states on every rank at
    once; rank r's state passing once rank r - 1's is done; its chunk scan right after. The backward's state
    sweep from the last rank to the first; each rank's chunk-scan backward right after its own sweep."""
    rows = []
    for r in range(cp):
        rows.append((r, "chunk cumsum + chunk states", 0.0, 1.0))
        rows.append((r, "state passing (the ring)", 1.0 + r, 2.0 + r))
        rows.append((r, "chunk scan", 2.0 + r, 3.0 + r))
    start = 2.0 + cp   # the backward begins once the last rank's forward is done
    for r in reversed(range(cp)):
        k = cp - 1 - r
        rows.append((r, "state sweep (the ring, backward)", start + k, start + k + 1))
        rows.append((r, "chunk-scan + cumsum backward", start + k + 1, start + k + 2))
    return rows


def context_parallel_figure(cp: int, chunks_per_rank: int, chunk_size: int) -> go.Figure:
    """Top: the sequence cut into ``cp`` contiguous pieces, one lane a rank, ``chunks_per_rank`` chunks of
    ``chunk_size`` positions each; an arrow from each rank's last chunk to the next rank's first (the final state
    H, (b, h, p, n) fp32, forward) and one back (its gradient, backward). Bottom: when each rank runs each step of
    :func:`mambalab.parallel.context.context_parallel_ssd`, in the module docstring's order, one unit a step."""
    if not (isinstance(cp, int) and cp >= 1 and isinstance(chunks_per_rank, int) and chunks_per_rank >= 1):
        raise ValueError(f"cp and chunks_per_rank must be positive ints; got {cp!r} and {chunks_per_rank!r}")
    fig = make_subplots(rows=2, cols=1, vertical_spacing=0.2, row_heights=[0.45, 0.55],
                        subplot_titles=("what each rank holds (boxes: chunks) and sends (arrows)",
                                        "when each step runs (an order, one unit a step: not measured time)"))
    lanes = [f"rank {r}" for r in range(cp)]
    piece = chunks_per_rank * chunk_size
    for r in range(cp):
        for c in range(chunks_per_rank):
            x0 = r * piece + c * chunk_size
            fig.add_trace(go.Bar(x=[chunk_size * 0.92], base=[x0], y=[lanes[r]], orientation="h", showlegend=False,
                                 marker_color="#b8c7de", text=f"chunk {r * chunks_per_rank + c}",
                                 textposition="inside", insidetextanchor="middle",
                                 hovertemplate=f"rank {r}, positions {x0} … {x0 + chunk_size - 1}<extra></extra>"),
                          row=1, col=1)
    for r in range(cp - 1):
        end, start = (r + 1) * piece - chunk_size * 0.1, (r + 1) * piece + chunk_size * 0.1
        fig.add_annotation(x=start, y=lanes[r + 1], ax=end, ay=lanes[r], xref="x", yref="y", axref="x", ayref="y",
                           showarrow=True, arrowhead=3, arrowwidth=2, arrowcolor="black", yshift=6,
                           text="H" if r == 0 else "", font=dict(size=12))
        fig.add_annotation(x=end, y=lanes[r], ax=start, ay=lanes[r + 1], xref="x", yref="y", axref="x", ayref="y",
                           showarrow=True, arrowhead=3, arrowwidth=2, arrowcolor="#d62728", yshift=-6,
                           text="dH" if r == 0 else "", font=dict(size=12, color="#d62728"))
    kinds = {}
    for r, step, t0, t1 in _ring_schedule(cp):
        color = _COLORS[len(kinds) % 8] if step not in kinds else kinds[step]
        fig.add_trace(go.Bar(x=[(t1 - t0) * 0.94], base=[t0], y=[lanes[r]], orientation="h", name=step,
                             legendgroup=step, showlegend=step not in kinds, marker_color=color,
                             hovertemplate=f"rank {r}: {step}<extra></extra>"), row=2, col=1)
        kinds[step] = color
    fig.add_vline(x=2.0 + cp, line_dash="dash", line_color="gray", row=2, col=1)
    fig.update_xaxes(title_text=f"position along the sequence (tokens; chunks of {chunk_size})", row=1, col=1)
    fig.update_xaxes(title_text="schedule step (units: one step of one rank; forward left of the dashed line)",
                     row=2, col=1)
    for row in (1, 2):
        fig.update_yaxes(title_text="rank", autorange="reversed", row=row, col=1)
    fig.update_layout(barmode="overlay", height=620, title=f"Context parallelism over {cp} ranks: the state passes "
                      "forward rank to rank (black), its gradient backward (red)", legend=dict(font=dict(size=10)))
    return fig


def memory_model_figure(seqlens: Sequence[int], layouts: Mapping[str, Sequence[Mapping]], title: str,
                        capacity_gib: float | None = None) -> go.Figure:
    """GiB per rank against the sequence length, one line per layout (``layouts``: name -> one
    :func:`mambalab.parallel.cost.memory_model` dict per length), its static part dotted; a dashed line at
    ``capacity_gib`` (one GPU's memory) when given."""
    fig = go.Figure()
    for i, (name, rows) in enumerate(layouts.items()):
        fig.add_trace(go.Scatter(x=list(seqlens), y=[r["total_bytes"] / 2**30 for r in rows], name=name,
                                 mode="lines+markers", line_color=_COLORS[i % 8]))
        fig.add_trace(go.Scatter(x=list(seqlens), y=[r["static_bytes"] / 2**30 for r in rows],
                                 name=f"{name}: training state alone", mode="lines",
                                 line=dict(color=_COLORS[i % 8], dash="dot")))
    if capacity_gib is not None:
        fig.add_hline(y=capacity_gib, line_dash="dash", line_color="gray",
                      annotation_text=f"{capacity_gib:g} GiB", annotation_position="top left")
    fig.update_xaxes(type="log", title_text="sequence length l (tokens, b = 1)", tickvals=list(seqlens),
                     ticktext=[f"{v // 1024}K" for v in seqlens])
    fig.update_yaxes(type="log", title_text="GiB per rank (model)")
    fig.update_layout(title=title, legend=dict(font=dict(size=10)), height=440)
    return fig
