"""Figures for the tensor-parallel chapter (notebook 06): who holds what, what it costs, how runs compare.

Every builder returns a ``plotly.graph_objects.Figure`` with a title, labelled axes and units.

* :func:`split_figure`: a Mamba-2 block's in_proj rows (z, x, B, C, dt) and out_proj columns coloured by the
  TP rank that holds them, with the collectives marked where they sit.
* :func:`communication_figure`: collectives per layer for Mamba-2, Mamba-1 and a transformer layer.
* :func:`memory_figure`: parameter + gradient + optimizer memory per rank for several TP degrees.
* :func:`curves_figure`: per-step curves (losses, Δ values, …) of several runs overlaid.
* :func:`tp_cost_figure`: for one TP degree, sequence-parallel setting and sequence length, the memory each rank
  holds (training state, layer-boundary activations) and the bytes it sends per layer (the widget's figure).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import plotly.graph_objects as go
from plotly.subplots import make_subplots

__all__ = ["communication_figure", "curves_figure", "memory_figure", "split_figure", "tp_cost_figure"]

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
