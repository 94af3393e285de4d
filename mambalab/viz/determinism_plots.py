"""Figures, tables and widgets for the determinism chapters (notebooks 04 and 05).

* :func:`sum_order_figure` and :func:`sum_order_explorer`: the same numbers summed in different orders, the
  running error of each order against the exact sum, and the final bits side by side (ipywidgets: pick the
  order's seed and the dtype).
* :func:`bits_html`: two floats' bits with the differing bits highlighted.
* :func:`landing_order_figure`: which program's atomic add landed when, one row per run.
* :func:`loss_curves_figure`: loss curves of two "machines" overlaid, and their difference per step.
* :func:`cost_figure`: forward+backward time of each variant, and its ratio to a baseline.
* :func:`split_groupings_figure`: for each GPU profile, how mamba-ssm's dB/dC backward groups the heads of a
  group at a given shape (heads per program), beside mambalab's one grouping; the widget's figure in notebook 05.
* :func:`table`: a small table that displays as HTML in a notebook and as aligned text elsewhere.
* :func:`source_excerpt`: the lines of a function (ours, or mamba-ssm's installed source) from the first line
  containing one string to the next containing another, with a caption naming the file and lines.

Every figure builder returns a ``plotly.graph_objects.Figure`` with a title, labelled axes and units.
The computations they draw live in :mod:`mambalab.determinism`'s experiment modules (float_sums, atomics,
ssd_variation, mamba_ssm_splits, norms, two_machines).
"""
from __future__ import annotations

import html
from collections.abc import Mapping, Sequence

import plotly.graph_objects as go
import torch
from plotly.subplots import make_subplots

from mambalab.determinism.atomics import AtomicSumRun
from mambalab.determinism.float_sums import float_bits, ordered_sum

__all__ = ["Table", "bits_html", "source_excerpt", "cost_figure", "landing_order_figure", "loss_curves_figure", "sum_order_explorer",
           "split_groupings_figure", "sum_order_figure", "table"]

_COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


# ----------------------------------------------------------------------------------- source excerpts

def source_excerpt(obj, start: str, end: str | None = None, *, after: int = 0):
    """The lines of ``obj``'s source (a function, class or Triton kernel, read from its file) from the first
    line containing ``start`` to the first line at or after it containing ``end`` (just that line when
    ``end`` is None), plus ``after`` more lines; a :class:`mambalab.viz.notebook.Source` whose caption names
    the object and ``path:first-last``. The lines keep their indentation, so a branch shows as it sits."""
    import inspect
    import textwrap

    from mambalab.viz.notebook import Source, _relative, _unwrap

    target = _unwrap(obj)
    try:
        lines, first = inspect.getsourcelines(target)
        path = inspect.getsourcefile(target)
    except (TypeError, OSError) as err:
        raise TypeError(f"source_excerpt: cannot find the source of {obj!r} ({err})") from None
    i = next((k for k, line in enumerate(lines) if start in line), None)
    if i is None:
        raise ValueError(f"source_excerpt: no line of {getattr(target, '__qualname__', target)} contains {start!r}")
    j = i if end is None else next((k for k in range(i, len(lines)) if end in lines[k]), None)
    if j is None:
        raise ValueError(f"source_excerpt: no line at or after {start!r} contains {end!r}")
    j = min(j + after, len(lines) - 1)
    name = f"{getattr(target, '__module__', '')}.{getattr(target, '__qualname__', '')}".strip(".")
    caption = f"{name}  ({_relative(path)}:{first + i}-{first + j})"
    return Source(textwrap.dedent("".join(lines[i:j + 1])), caption)


# ----------------------------------------------------------------------------------- tables

class Table:
    """Rows under column headers, with a caption; HTML in a notebook, aligned text in ``repr``."""

    def __init__(self, columns: Sequence[str], rows: Sequence[Sequence], caption: str = ""):
        self.columns = [str(c) for c in columns]
        self.rows = [[_cell(v) for v in r] for r in rows]
        bad = [i for i, r in enumerate(self.rows) if len(r) != len(self.columns)]
        if bad:
            raise ValueError(f"rows {bad} do not have {len(self.columns)} cells (one per column)")
        self.caption = caption

    def _repr_html_(self) -> str:
        esc = html.escape
        head = "".join(f"<th style='text-align:left'>{esc(c)}</th>" for c in self.columns)
        body = "".join("<tr>" + "".join(f"<td style='text-align:left'>{esc(v)}</td>" for v in r) + "</tr>"
                       for r in self.rows)
        cap = f"<caption style='caption-side:top;text-align:left'>{esc(self.caption)}</caption>" if self.caption else ""
        return f"<table>{cap}<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"

    def __repr__(self) -> str:
        widths = [max(len(c), *(len(r[i]) for r in self.rows)) if self.rows else len(c)
                  for i, c in enumerate(self.columns)]
        line = lambda cells: "  ".join(v.ljust(w) for v, w in zip(cells, widths)).rstrip()
        out = ([self.caption] if self.caption else []) + [line(self.columns), line(["-" * w for w in widths])]
        return "\n".join(out + [line(r) for r in self.rows])


def _cell(v) -> str:
    if isinstance(v, float):
        return "0" if v == 0 else f"{v:.3g}"
    return str(v)


def table(columns: Sequence[str], rows: Sequence[Sequence], caption: str = "") -> Table:
    """A :class:`Table` (floats shown with 3 significant digits; exact 0 as ``0``)."""
    return Table(columns, rows, caption)


# ----------------------------------------------------------------------------------- float addition

def bits_html(a: float, b: float, dtype: torch.dtype = torch.float32, labels: tuple[str, str] = ("a", "b")) -> str:
    """HTML: ``a`` and ``b`` in ``dtype``, each as sign|exponent|mantissa bits, differing bits in red."""
    ba, bb = float_bits(a, dtype), float_bits(b, dtype)

    def mark(s, other):
        return "".join(f"<b style='color:#d62728'>{c}</b>" if c != o else c for c, o in zip(s, other))

    n_diff = sum(c != o for c, o in zip(ba, bb))
    rows = "".join(f"<tr><td>{html.escape(lab)}</td><td>{v!r}</td><td style='font-family:monospace'>{mark(s, o)}</td></tr>"
                   for lab, v, s, o in ((labels[0], float(torch.tensor(a, dtype=dtype)), ba, bb),
                                        (labels[1], float(torch.tensor(b, dtype=dtype)), bb, ba)))
    return (f"<table><thead><tr><th>sum</th><th>value</th><th>bits (sign exponent mantissa)</th></tr></thead>"
            f"<tbody>{rows}</tbody></table><p>{n_diff} bit(s) differ.</p>")


def sum_order_figure(values: Sequence[float] | torch.Tensor, orders: Mapping[str, Sequence[int]],
                     dtype: torch.dtype = torch.float32) -> go.Figure:
    """The running sum of ``values`` in each order, minus the exact running sum in the same order (float64
    of the dtype-rounded values): the rounding error each order accumulates, step by step."""
    v = torch.as_tensor(values, dtype=torch.float64).flatten().to(dtype)
    fig = go.Figure()
    for i, (label, order) in enumerate(orders.items()):
        err, acc, exact = [], torch.zeros((), dtype=dtype), 0.0
        for k in order:
            acc = acc + v[int(k)]
            exact += float(v[int(k)])
            err.append(float(acc) - exact)
        final = float(ordered_sum(v, order, dtype))
        fig.add_trace(go.Scatter(x=list(range(1, len(err) + 1)), y=err, mode="lines+markers",
                                 name=f"{label}: sum = {final!r}", line=dict(color=_COLORS[i % len(_COLORS)])))
    name = next((k for k, d in DTYPES.items() if d == dtype), str(dtype))
    fig.update_layout(title=f"The same {v.numel()} numbers added in different orders ({name}): rounding error of "
                            "the running sum", xaxis_title="additions done (count)",
                      yaxis_title="running sum − exact sum (value units)", legend=dict(font=dict(size=10)),
                      height=380)
    return fig


def sum_order_explorer(values: Sequence[float] | torch.Tensor, seed: int = 1, dtype: str = "fp32"):
    """Controls (the seed of a random order, the dtype) over :func:`sum_order_figure` (given order vs the
    seeded one) and :func:`bits_html` of the two sums. Starts at ``seed`` and ``dtype`` so a headless run
    shows a reordering; displays in place; returns the controls as a dict."""
    import ipywidgets as widgets
    from IPython.display import display

    from mambalab.viz.notebook import LiveFigure

    v = torch.as_tensor(values, dtype=torch.float64).flatten()
    style = dict(description_width="initial")
    controls = {
        "seed": widgets.IntSlider(value=seed, min=0, max=50, continuous_update=False,
                                  description="order seed (0 = as given)", style=style),
        "dtype": widgets.Dropdown(options=list(DTYPES), value=dtype, description="dtype", style=style),
    }

    def order_of(s):
        if s == 0:
            return list(range(v.numel()))
        return torch.randperm(v.numel(), generator=torch.Generator().manual_seed(s)).tolist()

    def figure_and_bits():
        s, dt = controls["seed"].value, DTYPES[controls["dtype"].value]
        orders = {"as given": list(range(v.numel())), f"shuffled (seed {s})": order_of(s)}
        a, b = (float(ordered_sum(v, o, dt)) for o in orders.values())
        return sum_order_figure(v, orders, dt), bits_html(a, b, dt, tuple(orders))

    fig, bits = figure_and_bits()
    live, bits_view = LiveFigure(fig), widgets.HTML(bits)   # both redraw from widget callbacks in JupyterLab
    display(widgets.HBox(list(controls.values())))
    live.display()
    display(bits_view)

    def update(_change):
        f, b = figure_and_bits()
        live.update(f)
        bits_view.value = b

    for w in controls.values():
        w.observe(update, names="value")
    return controls


# ----------------------------------------------------------------------------------- atomics

def landing_order_figure(runs: Mapping[str, AtomicSumRun], *, simulated: bool) -> go.Figure:
    """One row per run: the program whose atomic add landed 1st, 2nd, … (colour and label = program id), with
    the run's total and its bits in the row label. ``simulated`` says whether the order came from the CPU
    scheduler simulation (it goes in the title)."""
    if not runs:
        raise ValueError("runs must hold at least one AtomicSumRun")
    labels = [f"{name}: total {float(r.total)!r}" for name, r in runs.items()]
    z = [r.order for r in runs.values()]
    fig = go.Figure(go.Heatmap(z=z, y=labels, x=list(range(1, len(z[0]) + 1)), text=z, texttemplate="%{text}",
                               colorscale="Viridis", colorbar=dict(title="program id"),
                               hovertemplate="landed %{x}: program %{z}<extra></extra>"))
    where = "CPU interpreter, SIMULATED scheduler (seeded shuffle)" if simulated else "real GPU scheduling"
    fig.update_layout(title=f"Order in which each program's atomic add landed ({where})",
                      xaxis_title="landing position (1 = first add into the total)", yaxis_title="run",
                      yaxis=dict(autorange="reversed"), height=120 + 40 * len(z))
    return fig


# ----------------------------------------------------------------------------------- training, cost

def loss_curves_figure(curves: Mapping[str, Sequence[float]], pairs: Mapping[str, tuple[str, str]],
                       title: str) -> go.Figure:
    """Top: every loss curve overlaid. Bottom: |loss_a − loss_b| per step for each named pair of curves
    (log scale); a pair that is bitwise equal at every step has no points, and its legend says so."""
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.16, row_heights=[0.55, 0.45],
                        subplot_titles=("loss per step, overlaid", "difference between the two machines"))
    for i, (name, ys) in enumerate(curves.items()):
        dash = "dot" if i % 2 else "solid"
        fig.add_trace(go.Scatter(y=list(ys), x=list(range(len(ys))), mode="lines", name=name,
                                 line=dict(color=_COLORS[(i // 2) % len(_COLORS)], dash=dash)), row=1, col=1)
    for i, (name, (a, b)) in enumerate(pairs.items()):
        for key in (a, b):
            if key not in curves:
                raise ValueError(f"pair {name!r} names curve {key!r}, which is not in curves")
        ya, yb = curves[a], curves[b]
        diffs = [abs(x - y) for x, y in zip(ya, yb)]
        equal = sum(x == y for x, y in zip(ya, yb))
        label = f"{name}: bitwise equal at all {len(diffs)} steps" if equal == len(diffs) else \
            f"{name}: differ at {len(diffs) - equal} of {len(diffs)} steps"
        fig.add_trace(go.Scatter(y=[d if d > 0 else None for d in diffs], x=list(range(len(diffs))),
                                 mode="lines+markers", name=label, marker=dict(size=4),
                                 line=dict(color=_COLORS[i % len(_COLORS)])), row=2, col=1)
    fig.update_yaxes(title_text="loss (MSE)", row=1, col=1)
    fig.update_yaxes(title_text="|Δ loss| (log)", type="log", exponentformat="power", row=2, col=1)
    for row in (1, 2):   # shared steps, labelled on both panels so each reads on its own
        fig.update_xaxes(title_text="training step", showticklabels=True, row=row, col=1)
    fig.update_layout(title=title, height=600, legend=dict(font=dict(size=10)))
    return fig


def cost_figure(times_ms: Mapping[str, float], baseline: str, title: str) -> go.Figure:
    """Forward+backward time of each variant (bars, ms), each labelled with its ratio to ``baseline``."""
    if baseline not in times_ms:
        raise ValueError(f"baseline {baseline!r} is not one of {list(times_ms)}")
    names = list(times_ms)
    base = times_ms[baseline]
    fig = go.Figure(go.Bar(x=names, y=[times_ms[k] for k in names],
                           text=[f"{times_ms[k]:.3g} ms ({times_ms[k] / base:.2f}×)" for k in names],
                           textposition="outside", marker_color=[_COLORS[i % len(_COLORS)] for i in range(len(names))]))
    fig.update_layout(title=title, xaxis_title="implementation and mode", yaxis_title="forward+backward time (ms)",
                      height=420)
    return fig


def split_groupings_figure(b: int, l: int, h: int, g: int, chunk_size: int) -> go.Figure:
    """Bars over the GPU profiles of :data:`mambalab.determinism.ARCH_PROFILES`: the heads each program of
    mamba-ssm's dB/dC backward sums (:func:`mambalab.determinism.mamba_ssm_splits.mamba_ssm_head_split`), coloured
    by grouping (one colour per distinct (heads per program, partials) pair: each is one bit pattern of dB and
    dC), and mambalab's, which is h / g heads folded in head order on every GPU."""
    from mambalab.determinism import ARCH_PROFILES
    from mambalab.determinism.mamba_ssm_splits import mamba_ssm_head_split

    c = -(-l // chunk_size)
    names = [p.name.replace("NVIDIA ", "") + f" ({p.sm_count} SMs)" for p in ARCH_PROFILES.values()]
    splits = [mamba_ssm_head_split(b, c, h, g, p.sm_count) for p in ARCH_PROFILES.values()]
    groupings = sorted(set(splits), key=splits.index)
    fig = go.Figure()
    for k, grouping in enumerate(groupings):
        xs = [n for n, s in zip(names, splits) if s == grouping]
        fig.add_trace(go.Bar(x=xs, y=[grouping[0]] * len(xs), marker_color=_COLORS[k % len(_COLORS)],
                             name=f"mamba-ssm: {grouping[0]} heads a program, {grouping[1]} partial"
                                  f"{'s' if grouping[1] != 1 else ''}"))
    fig.add_trace(go.Scatter(x=names, y=[h // g] * len(names), mode="lines+markers", line=dict(color="black"),
                             name=f"mambalab: {h // g} heads folded in head order, every GPU"))
    fig.update_layout(title=f"dB/dC groupings at b={b}, l={l}, h={h}, g={g}, chunk {chunk_size}: mamba-ssm "
                            f"{len(groupings)} distinct (bit patterns), mambalab 1",
                      xaxis_title="GPU (SM count read by the launcher)", yaxis_title="heads summed by one program",
                      legend=dict(font=dict(size=10)), barmode="overlay")
    return fig
