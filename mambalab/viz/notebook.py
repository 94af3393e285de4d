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
    cell, and every later figure uses it rather than a CDN. Outside a Jupyter
    kernel (plain Python, tests) it does nothing, since there is no notebook to embed plotly.js in.
    """
    if not _in_kernel():
        return
    import plotly.offline

    # Sets the renderers to "plotly_mimetype+notebook" and outputs plotly.js right away. Each figure then
    # carries two forms: HTML calling the embedded plotly.js (what nbconvert keeps, so exported pages work
    # offline) and plotly's JSON mimetype, which JupyterLab's plotly extension draws even in a notebook
    # that is not trusted (where the HTML's scripts would not run).
    plotly.offline.init_notebook_mode(connected=False)


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


def figure_bundle(fig) -> dict:
    """The two forms :func:`setup` has a plotly figure display in: plotly's JSON (drawn by JupyterLab's plotly
    renderer, even in an untrusted notebook) and HTML calling the embedded plotly.js (what nbconvert keeps)."""
    import json

    return {PLOTLY_MIMETYPE: {**json.loads(fig.to_json()), "config": {}},
            "text/html": fig.to_html(include_plotlyjs=False, full_html=False)}


class LiveFigure:
    """A figure that widget callbacks redraw, in JupyterLab and in exported pages alike.

    The figure lives in an ``ipywidgets.Output`` whose contents the kernel replaces (:meth:`update`), so a
    callback redraws it wherever a widget manager runs. (An IPython display handle updated from a widget
    callback is not: JupyterLab routes that message to no cell.) :meth:`display` shows the Output widget with
    the first figure's HTML as its stand-in, which pages without a widget manager (nbconvert's HTML, see
    :func:`mambalab.workbook.render_html`) show instead.
    """

    def __init__(self, fig):
        import ipywidgets

        self.output = ipywidgets.Output()
        self._first = figure_bundle(fig)
        self._set(self._first)

    def _set(self, bundle: dict) -> None:
        self.output.outputs = ({"output_type": "display_data", "data": bundle, "metadata": {}},)

    def update(self, fig) -> None:
        """Replace the figure by ``fig``."""
        self._set(figure_bundle(fig))

    def display(self) -> None:
        from IPython.display import display

        view = {"version_major": 2, "version_minor": 0, "model_id": self.output.model_id}
        display({WIDGET_VIEW_MIMETYPE: view, "text/html": self._first["text/html"],
                 "text/plain": "(figure: run the notebook to redraw it)"}, raw=True)


def explore(controls: dict, figure) -> dict:
    """Display ``controls`` (name -> ipywidget) in a row and, below, ``figure()`` as a :class:`LiveFigure` that
    is redrawn whenever a control's value changes (``figure`` reads the controls itself). Returns ``controls``."""
    import ipywidgets as widgets
    from IPython.display import display

    live = LiveFigure(figure())
    display(widgets.HBox(list(controls.values())))
    live.display()
    for w in controls.values():
        w.observe(lambda _change: live.update(figure()), names="value")
    return controls
