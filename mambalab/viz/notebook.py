"""Helpers every notebook uses: set plotly up to work offline, show the package's own source instead of
copying it into cells, and check one step against another with a visible one-line verdict.

    from mambalab.viz.notebook import setup, show_source, check
    setup()                                        # first cell: figures embed plotly.js, work offline
    show_source(mambalab.ref.selective_scan_ref)   # the code the notebook is about, highlighted
    check("kernel vs reference", y, y_ref, atol=1e-5, rtol=1e-5)   # ✓ ... or AssertionError
"""
from __future__ import annotations

import html
import inspect
from pathlib import Path

def _in_kernel() -> bool:
    try:
        from IPython import get_ipython
    except ImportError:  # pragma: no cover - IPython comes with ipykernel
        return False
    shell = get_ipython()
    return shell is not None and type(shell).__name__ == "ZMQInteractiveShell"


def setup() -> None:
    """Make plotly figures display offline, in JupyterLab and in HTML exported with nbconvert.

    Call it once, in the notebook's first code cell: it outputs plotly.js itself (about 5 MB) into that
    cell, and every later figure uses it rather than a CDN. Each figure then carries two forms (see
    :func:`figure_bundle`): plotly's JSON, which JupyterLab's plotly extension draws even in a notebook that is
    not trusted, and HTML calling the embedded plotly.js, which exported pages keep. plotly's own notebook
    renderer would also put a CDN MathJax script into every figure's HTML; the renderer registered here does
    not. Outside a Jupyter kernel (plain Python, tests) it does nothing, since there is no notebook to embed
    plotly.js in.
    """
    if not _in_kernel():
        return
    import plotly.io as pio
    from plotly.io._base_renderers import NotebookRenderer

    class OfflineNotebookRenderer(NotebookRenderer):
        def to_mimebundle(self, fig_dict):
            return {"text/html": figure_html(fig_dict)}

    renderer = OfflineNotebookRenderer(connected=False)
    pio.renderers["mambalab_offline"] = renderer
    pio.renderers.default = "plotly_mimetype+mambalab_offline"
    pio.renderers._activate_pending_renderers()  # output plotly.js into this cell now, as init_notebook_mode does


class Source:
    """Source code with a caption, displayed syntax-highlighted (HTML) or as plain text."""

    def __init__(self, code: str, caption: str):
        self.code = code
        self.caption = caption

    def _repr_html_(self) -> str:
        from pygments import highlight
        from pygments.formatters import HtmlFormatter
        from pygments.lexers import PythonLexer

        # Inline styles rather than a stylesheet: they survive JupyterLab's sanitiser and nbconvert's themes.
        body = highlight(self.code, PythonLexer(), HtmlFormatter(noclasses=True, nobackground=True))
        return f'<div><p style="margin:0 0 .3em 0"><code>{html.escape(self.caption)}</code></p>{body}</div>'

    def __repr__(self) -> str:
        return f"# {self.caption}\n{self.code}"


def _unwrap(obj):
    """The plain Python function or class behind ``obj`` (Triton kernels and autotuners keep it in .fn)."""
    obj = inspect.unwrap(obj) if callable(obj) else obj
    seen = set()
    while not (inspect.isfunction(obj) or inspect.isclass(obj) or inspect.ismodule(obj) or inspect.ismethod(obj)):
        inner = getattr(obj, "fn", None)
        if inner is None or id(inner) in seen:
            break
        seen.add(id(inner))
        obj = inner
    return obj


def source_of(obj) -> Source:
    """``obj``'s source and a caption naming it and where it lives (``path:first-last``)."""
    target = _unwrap(obj)
    try:
        lines, first = inspect.getsourcelines(target)
        path = inspect.getsourcefile(target)
    except (TypeError, OSError) as err:
        raise TypeError(f"show_source: cannot find the source of {obj!r} ({err})") from None
    first = max(first, 1)  # modules report line 0
    name = getattr(target, "__qualname__", getattr(target, "__name__", repr(target)))
    module = getattr(target, "__module__", None) or getattr(target, "__name__", "")
    caption = f"{module}.{name}" if module and module != name else name
    location = _relative(path)
    caption += f"  ({location}:{first}-{first + len(lines) - 1})"
    return Source("".join(lines), caption)


def _relative(path: str | None) -> str:
    if path is None:
        return "?"
    p = Path(path).resolve()
    package_root = Path(__file__).resolve().parents[2]  # the folder holding mambalab/
    try:
        return p.relative_to(package_root).as_posix()
    except ValueError:
        return p.as_posix()


def show_source(obj) -> None:
    """Display the source of a package function, class, module or Triton kernel, highlighted."""
    from IPython.display import display

    display(source_of(obj))


def check(name: str, got, expected, atol: float = 1e-5, rtol: float = 1e-5) -> None:
    """Compare ``got`` with ``expected`` elementwise, as ``torch.allclose`` does, and say so in one line.

    Passes when |got - expected| <= atol + rtol * |expected| everywhere (NaN never passes), after
    broadcasting is ruled out: the shapes must match. Prints ``✓ name: max |Δ| = ...`` or the ✗ form, and
    raises ``AssertionError`` with the same line on failure. Returns nothing, so that a cell ending with
    a check shows only its line.
    """
    import torch

    g = torch.as_tensor(got).detach().to("cpu", torch.float64)
    e = torch.as_tensor(expected).detach().to("cpu", torch.float64)
    if g.shape != e.shape:
        line = f"✗ {name}: shape {tuple(g.shape)} != expected {tuple(e.shape)}"
        print(line)
        raise AssertionError(line)
    diff = (g - e).abs()
    if diff.numel() == 0:
        max_err, ok = 0.0, True
    else:
        bad = ~(diff <= atol + rtol * e.abs())  # NaN compares False, so it counts as bad
        max_err = float(diff.nan_to_num(nan=float("inf")).max())
        ok = not bool(bad.any())
    tol = f"(atol={atol:g}, rtol={rtol:g})"
    if ok:
        print(f"✓ {name}: max |Δ| = {max_err:.3g} {tol}")
        return
    n_bad, n = int(bad.sum()), bad.numel()
    worst = tuple(int(i) for i in torch.unravel_index(diff.nan_to_num(nan=float("inf")).argmax(), diff.shape))
    line = (f"✗ {name}: max |Δ| = {max_err:.3g} {tol}, {n_bad} of {n} elements outside; "
            f"worst at {worst}: got {g[worst].item():.6g}, expected {e[worst].item():.6g}")
    print(line)
    raise AssertionError(line)


PLOTLY_MIMETYPE = "application/vnd.plotly.v1+json"
WIDGET_VIEW_MIMETYPE = "application/vnd.jupyter.widget-view+json"


def figure_html(fig) -> str:
    """A plotly figure (or its dict) as an HTML fragment that draws it with the plotly.js :func:`setup`
    embedded: no plotly.js of its own, no MathJax script."""
    from plotly.io import to_html

    return to_html(fig, include_plotlyjs=False, include_mathjax=False, full_html=False, default_width="100%",
                   default_height=525, validate=False)


def figure_bundle(fig) -> dict:
    """The two forms :func:`setup` has a plotly figure display in: plotly's JSON (drawn by JupyterLab's plotly
    renderer, even in an untrusted notebook) and HTML calling the embedded plotly.js (what nbconvert keeps)."""
    import json

    return {PLOTLY_MIMETYPE: {**json.loads(fig.to_json()), "config": {}}, "text/html": figure_html(fig)}


class LiveFigure:
    """A figure that widget callbacks redraw, in JupyterLab and in exported pages alike.

    The figure lives in an ``ipywidgets.Output`` whose contents the kernel replaces (:meth:`update`), so a
    callback redraws it wherever a widget manager runs. (An IPython display handle updated from a widget
    callback is not: JupyterLab routes that message to no cell.) :meth:`display` shows the Output widget with a
    stand-in for pages without a widget manager (:mod:`mambalab.workbook.pages`): ``page_html`` if given, else the first
    figure's HTML.
    """

    def __init__(self, fig, page_html: str | None = None):
        import ipywidgets

        self.output = ipywidgets.Output()
        self._first = figure_bundle(fig)
        self._page_html = page_html if page_html is not None else self._first["text/html"]
        self._set(self._first)

    def _set(self, bundle: dict) -> None:
        self.output.outputs = ({"output_type": "display_data", "data": bundle, "metadata": {}},)

    def update(self, fig) -> None:
        """Replace the figure by ``fig``."""
        self._set(figure_bundle(fig))

    def display(self) -> None:
        from IPython.display import display

        view = {"version_major": 2, "version_minor": 0, "model_id": self.output.model_id}
        display({WIDGET_VIEW_MIMETYPE: view, "text/html": self._page_html,
                 "text/plain": "(figure: run the notebook to redraw it)"}, raw=True)


def control_samples(widget, count: int = 7) -> list:
    """Up to about ``count`` values ``widget`` can take, its current value among them, in increasing order (or
    in the order of a dropdown's options); [] for a widget of a kind not sampled (text boxes, buttons)."""
    import ipywidgets as widgets
    import numpy as np

    value = widget.value
    if isinstance(widget, widgets.Checkbox | widgets.ToggleButton):
        return [False, True]
    options = getattr(widget, "options", None)
    if options is not None and not isinstance(widget, widgets.SelectionRangeSlider):
        values = [o[1] if isinstance(o, tuple) else o for o in options]
        if len(values) > count:  # evenly spaced options, the current one included
            keep = {round(i) for i in np.linspace(0, len(values) - 1, count)} | {values.index(value)}
            values = [values[i] for i in sorted(keep)]
        return values
    if isinstance(widget, widgets.FloatLogSlider):
        grid = widget.base ** np.linspace(widget.min, widget.max, count)
    elif isinstance(widget, widgets.IntSlider | widgets.FloatSlider):
        grid = np.linspace(widget.min, widget.max, count)
        if widget.step:
            grid = widget.min + np.round((grid - widget.min) / widget.step) * widget.step
    else:
        return []
    cast = int if isinstance(widget, widgets.IntSlider) else float
    return sorted({cast(v) for v in grid} | {value})


def _label(value) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def page_sliders_figure(controls: dict, figure, count: int = 7):
    """One plotly figure that redraws without a kernel: a plotly slider per control over
    :func:`control_samples` of its values, each showing ``figure()`` computed with that control at that value
    and the others at their current values.

    Every variant's traces are in the figure, hidden but for the current one; a slider's step shows its
    variant's traces, sets the layout entries (title, shapes, annotations, axis ranges, …) that differ between
    variants, and moves the other sliders back to their starting values, so the sliders never claim a
    combination the figure does not show. The controls end at their starting values. Returns the figure, or
    None when no control has two values to show.
    """
    import plotly.graph_objects as go

    start = {key: w.value for key, w in controls.items()}
    base = figure()
    sweeps = []  # (control's description, values, figures, index of the starting value)
    try:
        for key, widget in controls.items():
            values = control_samples(widget, count)
            if len(values) < 2:
                continue
            figures = []
            for value in values:
                widget.value = value
                figures.append(base if value == start[key] else figure())
            widget.value = start[key]
            sweeps.append((widget.description or key, values, figures, values.index(start[key])))
    finally:
        for key, widget in controls.items():
            widget.value = start[key]
    if not sweeps:
        return None

    fig = go.Figure(layout=base.layout)
    spans = {}  # id of a variant's figure -> (first trace, end)
    for variant in [base] + [f for _, _, figures, _ in sweeps for f in figures if f is not base]:
        first = len(fig.data)
        fig.add_traces(list(variant.data))
        spans[id(variant)] = (first, len(fig.data))
    shown = [True if t.visible is None else t.visible for t in fig.data]  # each trace's own visibility
    for i in range(spans[id(base)][1], len(fig.data)):
        fig.data[i].visible = False

    def layout_of(f) -> dict:
        return {k: v for k, v in f.layout.to_plotly_json().items() if k not in ("template", "sliders")}

    layouts = {id(f): layout_of(f) for _, _, figures, _ in sweeps for f in figures}
    start_layout = layout_of(base)
    changed = sorted({k for lay in layouts.values() for k in set(lay) | set(start_layout)
                      if lay.get(k) != start_layout.get(k)})

    sliders = []
    for j, (description, values, figures, active) in enumerate(sweeps):
        steps = []
        for value, variant in zip(values, figures):
            first, end = spans[id(variant)]
            visible = [shown[i] if first <= i < end else False for i in range(len(fig.data))]
            patch = {k: layouts[id(variant)].get(k) for k in changed}
            patch.update({f"sliders[{other}].active": sweeps[other][3] for other in range(len(sweeps)) if other != j})
            steps.append(dict(method="update", label=_label(value), args=[{"visible": visible}, patch]))
        sliders.append(dict(active=active, steps=steps, currentvalue=dict(prefix=f"{description}: "),
                            x=0.05, len=0.9, y=-0.12 - 0.22 * j, yanchor="top", pad=dict(t=30)))
    height = (base.layout.height or 525) + 110 * len(sliders)
    fig.update_layout(sliders=sliders, height=height,
                      margin=dict(b=(base.layout.margin.b or 80) + 110 * len(sliders)))
    return fig


def page_sliders_html(controls: dict, figure, count: int = 7) -> str | None:
    """:func:`page_sliders_figure` as HTML, under a line saying what its sliders do; None when there is none."""
    fig = page_sliders_figure(controls, figure, count)
    if fig is None:
        return None
    note = ("<p class=\"mambalab-page-sliders\"><em>In this page the sliders under the figure move one setting at a "
            "time over precomputed values, the others at their starting values; in JupyterLab the controls "
            "above recompute it for any combination.</em></p>")
    return note + figure_html(fig)


def explore(controls: dict, figure) -> dict:
    """Display ``controls`` (name -> ipywidget) in a row and, below, ``figure()`` as a :class:`LiveFigure` that
    is redrawn whenever a control's value changes (``figure`` reads the controls itself). Returns ``controls``.

    In a Jupyter kernel the figure's stand-in for exported pages is :func:`page_sliders_html`: the same
    figure with plotly's own sliders, which work in a page with no kernel.
    """
    import ipywidgets as widgets
    from IPython.display import display

    page_html = page_sliders_html(controls, figure) if _in_kernel() else None
    live = LiveFigure(figure(), page_html=page_html)
    display(widgets.HBox(list(controls.values())))
    live.display()
    for w in controls.values():
        w.observe(lambda _change: live.update(figure()), names="value")
    return controls
