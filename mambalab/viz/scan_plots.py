"""Figures for the selective-scan chapter (notebook 01): memory of the state, the scan's combine tree, timings.

Every builder returns a ``plotly.graph_objects.Figure`` with a title, labelled axes and units; notebooks call
``fig.show()``. :func:`memory_explorer` wraps :func:`memory_kernel_figure` in an ipywidgets slider over Δ, the
slider's curve drawn dashed over a few fixed Δ values.
:func:`scan_schedule` is the combine schedule the tree figure draws, also usable to run the scan by hand.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import plotly.graph_objects as go

__all__ = ["kernel_tiles_figure", "memory_kernel_figure", "memory_explorer", "scan_schedule", "scan_tree_figure",
           "timing_figure"]

_COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f")


def memory_kernel_figure(delta_values: Sequence[float], A: float, length: int,
                         highlight: float | None = None) -> go.Figure:
    """How much of an input the state still holds k steps later, for a few step sizes Δ.

    With a constant Δ, unrolling h_t = exp(Δ A) h_{t-1} + Δ B u_t gives h_t = Σ_k exp(Δ A k) · Δ B u_{t-k}:
    the input from k steps ago is weighted by exp(Δ·A·k) (A < 0). One curve per Δ, over lags 0 … length-1,
    with the 1/e line: a state "remembers" about 1 / (Δ |A|) steps. Large Δ: focus on the present (and reset);
    small Δ: keep the past (and ignore the current input, since B̄ = Δ B is small too). ``highlight``: one
    more Δ, drawn in black, dashed and on top (the explorer's slider value): where it equals one of
    ``delta_values``, that curve's colour shows between the dashes, so neither hides the other.
    """
    if A >= 0:
        raise ValueError(f"A must be negative for the state to decay; got A = {A}")
    lags = list(range(length))
    fig = go.Figure()
    for i, dt in enumerate(delta_values):
        memory = 1.0 / (dt * abs(A))
        fig.add_trace(go.Scatter(
            x=lags, y=[math.exp(dt * A * k) for k in lags], mode="lines",
            name=f"Δ = {dt:.3g}  (memory ≈ {memory:.3g} steps)",
            line=dict(color=_COLORS[i % len(_COLORS)], width=5),
            hovertemplate="lag %{x} steps<br>kept %{y:.3f}<extra>Δ = " + f"{dt:.3g}" + "</extra>",
        ))
    if highlight is not None:
        fig.add_trace(go.Scatter(
            x=lags, y=[math.exp(highlight * A * k) for k in lags], mode="lines",
            name=f"slider: Δ = {highlight:.3g}  (memory ≈ {1.0 / (highlight * abs(A)):.3g} steps)",
            line=dict(color="black", width=3, dash="dash"),
            hovertemplate="lag %{x} steps<br>kept %{y:.3f}<extra>slider Δ = " + f"{highlight:.3g}" + "</extra>",
        ))
    fig.add_hline(y=math.exp(-1), line=dict(dash="dot", color="grey"),
                  annotation_text="1/e", annotation_position="top right")
    fig.update_layout(
        title=f"How much of the past the state keeps: weight exp(Δ·A·k) of the input k steps ago (A = {A:g})",
        xaxis_title="lag k (time steps into the past)",
        yaxis_title="weight kept (fraction of the input, 0–1)",
        yaxis_range=[0, 1.05], legend=dict(x=0.99, xanchor="right", y=0.99), template="plotly_white",
    )
    return fig


def memory_explorer(A: float, length: int, delta: float = 0.1, delta_min: float = 1e-3, delta_max: float = 10.0,
                    reference_deltas: Sequence[float] = ()):
    """Display a log slider over Δ and, below it, :func:`memory_kernel_figure` with the slider's Δ drawn dashed
    over the fixed ``reference_deltas``.

    Starts at ``delta`` so that a headless run shows a meaningful figure. Moving the slider redraws the
    figure (a :class:`mambalab.viz.notebook.LiveFigure`; no anywidget needed). Displays; returns the slider.
    """
    import ipywidgets as widgets

    from mambalab.viz.notebook import explore

    slider = widgets.FloatLogSlider(value=delta, base=10, min=math.log10(delta_min), max=math.log10(delta_max),
                                    step=0.05, description="Δ", continuous_update=False, readout_format=".3g",
                                    layout=widgets.Layout(width="60%"))
    explore({"delta": slider}, lambda: memory_kernel_figure(list(reference_deltas), A, length, highlight=slider.value))
    return slider


def scan_schedule(length: int, kind: str = "hillis-steele") -> list[list[tuple[int, int]]]:
    """The combines of an inclusive parallel scan over ``length`` elements, level by level.

    Returns one list per level of pairs ``(src, dst)``, meaning x[dst] ← x[src] ∘ x[dst] (src < dst, the
    earlier element on the left); all pairs of one level can run at once, since they read values from
    before the level.

    * ``"hillis-steele"``: at level k every position t ≥ 2ᵏ combines with t - 2ᵏ. Depth ⌈log₂ l⌉, work
      ~ l log₂ l combines.
    * ``"brent-kung"``: an up-sweep builds sums over aligned blocks of 2, 4, 8, … (a tree), then a down-sweep
      fills in the remaining prefixes. Depth ~ 2 log₂ l, work < 2l combines: work-efficient.
    """
    if length < 1:
        raise ValueError(f"length must be at least 1; got {length}")
    levels: list[list[tuple[int, int]]] = []
    if kind == "hillis-steele":
        stride = 1
        while stride < length:
            levels.append([(t - stride, t) for t in range(stride, length)])
            stride *= 2
    elif kind == "brent-kung":
        stride = 1
        while stride < length:   # up-sweep: the last element of each block of 2·stride absorbs its left half
            level = [(t - stride, t) for t in range(2 * stride - 1, length, 2 * stride)]
            if level:
                levels.append(level)
            stride *= 2
        stride //= 2
        while stride >= 1:       # down-sweep: the middle of each block takes the prefix ending just before it
            level = [(t - stride, t) for t in range(3 * stride - 1, length, 2 * stride)]
            if level:
                levels.append(level)
            stride //= 2
    else:
        raise ValueError(f'kind must be "hillis-steele" or "brent-kung"; got {kind!r}')
    return levels


def scan_tree_figure(length: int, kind: str = "hillis-steele") -> go.Figure:
    """Draw :func:`scan_schedule`: one row per level, one column per time step, an arrow per operand.

    Arrows from (src, level) and (dst, level) meet at (dst, level + 1), where the combine
    (a₁, b₁) ∘ (a₂, b₂) = (a₁a₂, a₂b₁ + b₂) happens; grey lines carry an element through a level unchanged.
    The bottom row holds every prefix x₀ ∘ … ∘ x_t, i.e. the state h_t for every t.
    """
    levels = scan_schedule(length, kind)
    depth = len(levels)
    fig = go.Figure()
    # Pass-through lines (elements a level does not touch), drawn first so arrows sit on top.
    xs, ys = [], []
    for k, level in enumerate(levels):
        touched = {dst for _, dst in level}
        for t in range(length):
            if t not in touched:
                xs += [t, t, None]
                ys += [k, k + 1, None]
    fig.add_trace(go.Scatter(x=xs, y=ys, mode="lines", line=dict(color="lightgrey", width=1),
                             name="carried unchanged", hoverinfo="skip"))
    for k, level in enumerate(levels):
        for src, dst in level:
            for start, color in ((src, _COLORS[1]), (dst, _COLORS[0])):
                fig.add_annotation(x=dst, y=k + 1, ax=start, ay=k, xref="x", yref="y", axref="x", ayref="y",
                                   showarrow=True, arrowhead=2, arrowsize=1, arrowwidth=1.2, arrowcolor=color,
                                   text="")
    # Nodes: the value held at each (position, level); hover shows which inputs it covers.
    span = [(t, t) for t in range(length)]
    node_x, node_y, node_text = [], [], []
    for k in range(depth + 1):
        if k > 0:
            for src, dst in levels[k - 1]:
                span[dst] = (span[src][0], span[dst][1])
        for t in range(length):
            node_x.append(t)
            node_y.append(k)
            lo, hi = span[t]
            node_text.append(f"x{lo}" if lo == hi else f"x{lo} ∘ … ∘ x{hi}")
    fig.add_trace(go.Scatter(x=node_x, y=node_y, mode="markers", marker=dict(size=9, color="black"),
                             text=node_text, hovertemplate="t = %{x}, level %{y}<br>%{text}<extra></extra>",
                             name="value (a, b) at a level"))
    # Legend entries for the two arrow colours (annotations have none).
    for name, color in (("earlier operand (left of ∘)", _COLORS[1]), ("later operand (right of ∘)", _COLORS[0])):
        fig.add_trace(go.Scatter(x=[None], y=[None], mode="lines", line=dict(color=color), name=name))
    work = sum(len(level) for level in levels)
    label = {"hillis-steele": "Hillis–Steele", "brent-kung": "Brent–Kung (up-sweep, then down-sweep)"}[kind]
    fig.update_layout(
        title=f"{label} scan over {length} steps: depth {depth} levels, work {work} combines "
              f"(the sequential loop: depth {length - 1}, work {length - 1})",
        xaxis=dict(title="time step t (position in the sequence)", dtick=1),
        yaxis=dict(title="level (parallel combine steps; all arrows in a level run at once)",
                   autorange="reversed", dtick=1),
        template="plotly_white", height=180 + 60 * depth,
        legend=dict(orientation="h", y=-0.25),
    )
    return fig


def timing_figure(lengths: Sequence[int], times_by_method: Mapping[str, Sequence[float]], *,
                  note: str | None = None, title: str | None = None) -> go.Figure:
    """Run time against sequence length, log–log, with a dashed line ∝ l for reference.

    ``times_by_method`` maps a method's name to its times in milliseconds, one per length (None for a
    missing point). A method whose points run parallel to the dashed line scales linearly in l.
    ``note`` goes under the title (say, what the timings can and cannot show).
    """
    fig = go.Figure()
    anchor = None
    for i, (name, times) in enumerate(times_by_method.items()):
        if len(times) != len(lengths):
            raise ValueError(f"times_by_method[{name!r}] has {len(times)} times for {len(lengths)} lengths")
        fig.add_trace(go.Scatter(x=list(lengths), y=list(times), mode="lines+markers", name=name,
                                 line=dict(color=_COLORS[i % len(_COLORS)]),
                                 hovertemplate="l = %{x}<br>%{y:.3g} ms<extra>" + name + "</extra>"))
        if anchor is None:
            anchor = next(((l, t) for l, t in zip(lengths, times) if t is not None), None)
    if anchor is not None:
        l0, t0 = anchor
        fig.add_trace(go.Scatter(x=list(lengths), y=[t0 * l / l0 for l in lengths], mode="lines",
                                 name="∝ l (linear, for reference)", line=dict(dash="dash", color="grey")))
    full_title = title or "Selective scan forward: time against sequence length"
    if note:
        full_title += f"<br><sup>{note}</sup>"
    fig.update_layout(title=full_title, xaxis=dict(title="sequence length l (time steps)", type="log"),
                      yaxis=dict(title="time per call (ms)", type="log"), template="plotly_white")
    return fig


def kernel_tiles_figure(b: int, d: int, l: int, n: int, block_d: int, block_l: int, ckpt_l: int,
                        program: tuple[int, int] = (0, 0)) -> go.Figure:
    """The optimised forward's program grid and, for one program, what crosses between HBM and the chip.

    Left: the (batch row, channel) plane cut into the grid (b, ceil(d / block_d)); each rectangle is one
    program, labelled (pid_b, pid_d); ``program`` is drawn dark. Right: that program's walk over the l steps in
    blocks of ``block_l``, on three lanes: what it reads from HBM a block ((block_d, block_l) tiles of u, Δ, z;
    block_l-long rows of B and C, one state index at a time), what stays on chip (registers) while it works
    on the block (the scan's (block_d, block_l) tiles of a, b̄x and h for one state index, y summed over the
    n state indices), and what it writes to HBM (the (block_d, block_l) output tile; the state, (block_d, n),
    every ``ckpt_l`` steps, which is also how the next block gets its starting state). Every (b, d, n, l)
    tensor exists only one (block_d, block_l) slice at a time, on chip.
    """
    from plotly.subplots import make_subplots

    for name, value in (("b", b), ("d", d), ("l", l), ("n", n), ("block_d", block_d), ("block_l", block_l),
                        ("ckpt_l", ckpt_l)):
        if value < 1:
            raise ValueError(f"{name} must be at least 1; got {value}")
    n_dblocks = math.ceil(d / block_d)
    if not (0 <= program[0] < b and 0 <= program[1] < n_dblocks):
        raise ValueError(f"program must be (pid_b, pid_d) within the grid ({b}, {n_dblocks}); got {program}")
    fig = make_subplots(rows=1, cols=2, column_widths=[0.3, 0.7], horizontal_spacing=0.17,
                        subplot_titles=(f"grid ({b}, ⌈{d}/{block_d}⌉): {b * n_dblocks} programs",
                                        f"program {program}: blocks of {block_l} steps"))
    # Left: one rectangle a program; hover on its centre says what it owns.
    cx, cy, text = [], [], []
    for pb in range(b):
        for pd in range(n_dblocks):
            mine = (pb, pd) == program
            lo, hi = pd * block_d, min(d, (pd + 1) * block_d)
            fig.add_shape(type="rect", x0=lo, x1=hi, y0=pb, y1=pb + 1, row=1, col=1,
                          line=dict(color="white", width=2),
                          fillcolor=_COLORS[0] if mine else "rgba(31, 119, 180, 0.25)")
            cx.append((lo + hi) / 2)
            cy.append(pb + 0.5)
            text.append(f"({pb}, {pd})")
    fig.add_trace(go.Scatter(x=cx, y=cy, mode="text", text=text, textfont=dict(size=10), showlegend=False,
                             hovertemplate="program %{text}<extra></extra>"), row=1, col=1)
    # Right: three lanes, one rectangle a block on each; the checkpoints as markers on the write lane.
    lanes = {"HBM → chip (reads)": 2, "on chip (registers)": 1, "chip → HBM (writes)": 0}
    what = {2: f"u, Δ, z: ({block_d}, {block_l}) tiles; B, C: rows of {block_l}, one state index at a time",
            1: f"a = exp(ΔA), b̄x, h: ({block_d}, {block_l}) for one state index (loop over n = {n}); "
               f"y summed over n",
            0: f"out: a ({block_d}, {block_l}) tile"}
    colors = {2: _COLORS[1], 1: _COLORS[2], 0: _COLORS[3]}
    hx, hy, htext = [], [], []
    for k in range(math.ceil(l / block_l)):
        lo, hi = k * block_l, min(l, (k + 1) * block_l)
        for lane in lanes.values():
            fig.add_shape(type="rect", x0=lo, x1=hi, y0=lane + 0.1, y1=lane + 0.9, row=1, col=2,
                          line=dict(color="white", width=2), fillcolor=colors[lane], opacity=0.55)
            hx.append((lo + hi) / 2)
            hy.append(lane + 0.5)
            htext.append(f"block {k} (steps {lo}–{hi - 1}): {what[lane]}")
    fig.add_trace(go.Scatter(x=hx, y=hy, mode="markers", marker=dict(size=14, opacity=0), text=htext,
                             showlegend=False, hovertemplate="%{text}<extra></extra>"), row=1, col=2)
    ends = list(range(ckpt_l - 1, l, ckpt_l)) + ([l - 1] if (l - 1) % ckpt_l != ckpt_l - 1 else [])
    fig.add_trace(go.Scatter(x=[t + 1 for t in ends], y=[0.5] * len(ends), mode="markers",
                             marker=dict(symbol="triangle-down", size=11, color="black"),
                             name=f"state ({block_d}, {n}) written every {ckpt_l} steps (read back by the next "
                                  f"block and the backward)",
                             hovertemplate="state after step %{x}<extra></extra>"), row=1, col=2)
    for lane, name in ((2, "read from HBM a block"), (1, "kept on chip while the block runs"),
                       (0, "written to HBM a block")):
        fig.add_trace(go.Scatter(x=[None], y=[None], mode="markers", marker=dict(symbol="square", size=12,
                                 color=colors[lane], opacity=0.55), name=name), row=1, col=2)
    fig.update_xaxes(title_text="channel (d)", range=[0, d], row=1, col=1)
    fig.update_yaxes(title_text="batch row (b)", range=[b, 0], row=1, col=1)
    fig.update_xaxes(title_text="time step t (sequence position)", range=[0, l], row=1, col=2)
    fig.update_yaxes(title_text="where the data is", tickvals=[v + 0.5 for v in lanes.values()], ticktext=list(lanes),
                     range=[0, 3], row=1, col=2)
    fig.update_layout(title="The selective-scan forward: which program owns which tile, and what moves between "
                            "HBM and the chip",
                      template="plotly_white", height=420, legend=dict(orientation="h", y=-0.2))
    return fig
