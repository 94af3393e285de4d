"""Figures for the SSD chapter (notebook 02): the semiseparable matrix and its chunk blocks, and cost curves.

Every builder returns a ``plotly.graph_objects.Figure`` with a title, labelled axes and units; notebooks call
``fig.show()``. :func:`semiseparable_explorer` wraps :func:`semiseparable_figure` in ipywidgets controls
(sequence length, chunk size, decay). :func:`semiseparable_matrix` and :func:`block_ranks` compute what the
figure draws, from :mod:`mambalab.ref.ssd`.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import plotly.graph_objects as go
import torch
from plotly.subplots import make_subplots

from mambalab.ref.ssd import segsum

__all__ = ["block_ranks", "cost_figure", "semiseparable_explorer", "semiseparable_figure",
           "semiseparable_matrix"]

_COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f")
GRID_NAME = "chunk grid"
OFF_DIAGONAL_NAME = "off-diagonal block"
DIAGONAL_NAME = "diagonal block"


def semiseparable_matrix(length: int, decay: float, n: int = 2, seed: int = 0) -> torch.Tensor:
    """One head's SSD matrix M = L ∘ C Bᵀ, in float64: (length, length), lower triangular.

    Δ_t is drawn uniformly from [0.5, 1.5] and A = -decay, so a_t = Δ_t A and L[t, s] = exp(a_{s+1} + … + a_t)
    (:func:`mambalab.ref.ssd.segsum`); B, C: (length, n) standard normal. Y = M (Δ ⊙ X) is the head's output.
    """
    if length < 1 or n < 1:
        raise ValueError(f"length and n must be positive; got length={length}, n={n}")
    if decay < 0:
        raise ValueError(f"decay must be >= 0 (A = -decay); got {decay}")
    gen = torch.Generator().manual_seed(seed)
    dt = 0.5 + torch.rand(length, generator=gen, dtype=torch.float64)         # (l,)
    B = torch.randn(length, n, generator=gen, dtype=torch.float64)            # (l, n)
    C = torch.randn(length, n, generator=gen, dtype=torch.float64)            # (l, n)
    L = torch.exp(segsum(-decay * dt))                                        # (l, l)
    return L * (C @ B.T)                                                      # (l, l): L ∘ C Bᵀ


def block_ranks(M: torch.Tensor, chunk_size: int, rtol: float = 1e-10) -> dict[tuple[int, int], int]:
    """Numerical rank of every block strictly below the diagonal of chunks: {(row chunk i, column chunk j): rank}.

    Singular values below ``rtol`` times the largest singular value of M count as zero. For M = L ∘ C Bᵀ each
    such block is (exp(cs) row factor) ∘ C_i B_jᵀ ∘ (column factor), so its rank is at most n.
    """
    l = M.shape[0]
    q = chunk_size
    c = -(-l // q)
    scale = float(torch.linalg.matrix_norm(M.double(), ord=2)) if M.numel() else 0.0
    ranks = {}
    for i in range(c):
        for j in range(i):
            block = M[i * q:(i + 1) * q, j * q:(j + 1) * q].double()
            s = torch.linalg.svdvals(block)
            ranks[(i, j)] = int((s > rtol * scale).sum()) if scale > 0 else 0
    return ranks


def semiseparable_figure(M: torch.Tensor, chunk_size: int, *, n: int | None = None,
                         note: str | None = None) -> go.Figure:
    """Heatmap of M with the chunk grid over it; blocks below the diagonal outlined and annotated with their rank.

    Diagonal blocks (lower triangular, full rank) are what step 3 of the chunked algorithm computes inside each
    chunk as small matrices; the blocks below them are low rank (at most n), which steps 1–3 exploit by never
    forming them (chunk states, state passing, and the entering state's part of step 3).
    Shapes carry names (``"chunk grid"``, ``"diagonal block"``, ``"off-diagonal block"``); each off-diagonal
    block has an annotation ``"rank r"``.
    """
    M = M.detach().double().cpu()
    l = M.shape[0]
    q = chunk_size
    if q < 1:
        raise ValueError(f"chunk_size must be positive; got {chunk_size}")
    c = -(-l // q)
    zmax = float(M.abs().max()) or 1.0
    fig = go.Figure(go.Heatmap(
        z=M.tolist(), colorscale="RdBu", zmid=0, zmin=-zmax, zmax=zmax,
        colorbar=dict(title="M[t, s]"),
        hovertemplate="t = %{y}, s = %{x}<br>M[t, s] = %{z:.3g}<extra></extra>",
    ))
    edge = l - 0.5
    shapes, annotations = [], []  # collected, then set once: fig.add_shape validates the layout every call
    for k in range(1, c):  # grid lines between chunks
        pos = k * q - 0.5
        for x0, y0, x1, y1 in ((pos, -0.5, pos, edge), (-0.5, pos, edge, pos)):
            shapes.append(dict(type="line", x0=x0, y0=y0, x1=x1, y1=y1, name=GRID_NAME,
                               line=dict(color="black", width=1, dash="dot")))
    ranks = block_ranks(M, q)
    for i in range(c):
        lo_i, hi_i = i * q - 0.5, min((i + 1) * q, l) - 0.5
        shapes.append(dict(type="rect", x0=lo_i, y0=lo_i, x1=hi_i, y1=hi_i, name=DIAGONAL_NAME,
                           line=dict(color=_COLORS[2], width=2)))
        for j in range(i):
            lo_j, hi_j = j * q - 0.5, (j + 1) * q - 0.5
            shapes.append(dict(type="rect", x0=lo_j, y0=lo_i, x1=hi_j, y1=hi_i, name=OFF_DIAGONAL_NAME,
                               line=dict(color=_COLORS[1], width=2), fillcolor="rgba(255,127,14,0.08)"))
            annotations.append(dict(x=(lo_j + hi_j) / 2, y=(lo_i + hi_i) / 2, text=f"rank {ranks[(i, j)]}",
                                    showarrow=False, font=dict(size=10, color="black"),
                                    bgcolor="rgba(255,255,255,0.7)"))
    fig.update_layout(shapes=shapes, annotations=annotations)
    # Legend entries for the outline colours (shapes have none).
    for name, color in ((f"{DIAGONAL_NAME}: step 3 inside the chunk, a q × q matrix product", _COLORS[2]),
                        (f"{OFF_DIAGONAL_NAME}: low rank, steps 1–3" + (f" (rank ≤ n = {n})" if n else ""),
                         _COLORS[1])):
        fig.add_trace(go.Scatter(x=[None], y=[None], mode="lines", line=dict(color=color, width=2), name=name))
    title = f"Semiseparable matrix M = L ∘ C Bᵀ of one head: l = {l}, chunk size q = {q} ({c} chunks)"
    if note:
        title += f"<br><sup>{note}</sup>"
    fig.update_layout(
        title=title,
        xaxis=dict(title="s: input position (time step)", range=[-0.5, edge], constrain="domain"),
        yaxis=dict(title="t: output position (time step)", range=[edge, -0.5], scaleanchor="x"),
        legend=dict(orientation="h", y=-0.15), template="plotly_white", height=620,
    )
    return fig


def semiseparable_explorer(length: int = 64, chunk_size: int = 16, decay: float = 0.05, n: int = 2,
                           seed: int = 0, max_length: int = 256):
    """Display controls (sequence length, chunk size, decay) and, below, :func:`semiseparable_figure`.

    Starts at the given values so a headless run shows a meaningful figure. Changing a control redraws
    the figure (a :class:`mambalab.viz.notebook.LiveFigure`). Displays; returns the controls as a dict.
    """
    import ipywidgets as widgets
    from mambalab.viz.notebook import explore

    style = dict(description_width="initial")
    controls = {
        "length": widgets.IntSlider(value=length, min=16, max=max_length, step=16, continuous_update=False,
                                    description="sequence length l", style=style),
        "chunk_size": widgets.Dropdown(options=[4, 8, 16, 32, 64], value=chunk_size, description="chunk size q",
                                       style=style),
        "decay": widgets.FloatLogSlider(value=decay, base=10, min=-3, max=0, step=0.1, continuous_update=False,
                                        description="decay −A", readout_format=".3g", style=style),
    }
    if chunk_size not in controls["chunk_size"].options:
        controls["chunk_size"].options = sorted({*controls["chunk_size"].options, chunk_size})
        controls["chunk_size"].value = chunk_size

    def figure():
        values = {k: w.value for k, w in controls.items()}
        M = semiseparable_matrix(values["length"], values["decay"], n=n, seed=seed)
        return semiseparable_figure(M, values["chunk_size"], n=n,
                                    note=f"A = −{values['decay']:.3g}, Δ ~ U[0.5, 1.5], n = {n}")

    return explore(controls, figure)


def cost_figure(lengths: Sequence[int], times_ms: Mapping[str, Sequence[float | None]],
                memory_bytes: Mapping[str, Sequence[float | None]], *, note: str | None = None,
                title: str | None = None) -> go.Figure:
    """Time (left) and memory of the main intermediates (right) against sequence length, log–log.

    ``times_ms`` and ``memory_bytes`` map a form's name to one value per length (None: not measured). Dashed
    grey lines ∝ l and ∝ l² (through the first point of the first series) show the two growth rates.
    """
    fig = make_subplots(rows=1, cols=2, horizontal_spacing=0.12,
                        subplot_titles=("time per forward call", "memory of the main intermediates"))
    for col, series, unit in ((1, times_ms, "ms"), (2, memory_bytes, "MiB")):
        anchor = None
        for i, (name, values) in enumerate(series.items()):
            if len(values) != len(lengths):
                raise ValueError(f"{name!r} has {len(values)} values for {len(lengths)} lengths")
            ys = [None if v is None else (v / 2**20 if unit == "MiB" else v) for v in values]
            fig.add_trace(go.Scatter(x=list(lengths), y=ys, mode="lines+markers", name=name, legendgroup=name,
                                     showlegend=col == 1, line=dict(color=_COLORS[i % len(_COLORS)]),
                                     hovertemplate="l = %{x}<br>%{y:.3g} " + unit + "<extra>" + name + "</extra>"),
                          row=1, col=col)
            if anchor is None:
                anchor = next(((l, y) for l, y in zip(lengths, ys) if y is not None), None)
        if anchor is not None:
            l0, y0 = anchor
            for power, dash in ((1, "dash"), (2, "dot")):
                fig.add_trace(go.Scatter(x=list(lengths), y=[y0 * (l / l0) ** power for l in lengths], mode="lines",
                                         name=f"∝ l{'²' if power == 2 else ''} (reference)",
                                         legendgroup=f"ref{power}", showlegend=col == 1,
                                         line=dict(dash=dash, color="grey", width=1)), row=1, col=col)
        fig.update_xaxes(title_text="sequence length l (time steps)", type="log", row=1, col=col)
    fig.update_yaxes(title_text="time per call (ms)", type="log", row=1, col=1)
    fig.update_yaxes(title_text="bytes held by the largest intermediates (MiB)", type="log", row=1, col=2)
    full_title = title or "SSD forward: quadratic, recurrent and chunked forms against sequence length"
    if note:
        full_title += f"<br><sup>{note}</sup>"
    fig.update_layout(title=full_title, template="plotly_white", height=480)
    return fig

