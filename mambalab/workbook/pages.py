"""An executed notebook as one self-contained HTML page that needs no network: math, figures and widgets.

nbconvert's ``lab`` template, as it comes, fetches three things from CDNs when the page opens: MathJax (to
typeset every ``$…$``), require.js, and the ipywidgets manager (to draw saved widget state). Offline, the
equations show as raw TeX and the widgets are gone. :func:`render` keeps the template's look and removes
all three:

* **Math** is converted once, at export time, from TeX to MathML (``latex2mathml``, pure Python), which
  Chromium, Firefox and Safari draw natively. The page carries no math script at all, and a formula the
  converter cannot read fails the export naming the cell, instead of failing silently in a reader's
  browser. (The alternative, a MathJax copy shipped beside the pages, means thousands of files, web fonts
  that browsers refuse to load from ``file://`` pages, and typesetting that happens only after the page
  has loaded.)
* **Figures** are plotly's HTML outputs with plotly.js embedded once in the notebook
  (:func:`mambalab.viz.notebook.setup`), which also keeps plotly from adding its CDN MathJax tag to each
  figure.
* **Widgets** need a Python kernel to do anything. Every widget output is replaced by static HTML drawn
  from its saved state: a control shows its starting value, marked as live in JupyterLab; an HTML widget
  shows its HTML; an Output widget shows what it holds. An explorer built with
  :func:`mambalab.viz.notebook.explore` also carries a plotly figure with the page's own sliders over
  precomputed values, which needs no kernel.
"""
from __future__ import annotations

import html
import re
from pathlib import Path

WIDGET_STATE_MIMETYPE = "application/vnd.jupyter.widget-state+json"
WIDGET_VIEW_MIMETYPE = "application/vnd.jupyter.widget-view+json"

#: The ``lab`` template with its network scripts left out (math is MathML by then, widgets static HTML).
_TEMPLATE = """{%- extends 'lab/index.html.j2' -%}
{%- block html_head_js_requirejs -%}{%- endblock html_head_js_requirejs -%}
{%- block html_head_js_mathjax -%}{%- endblock html_head_js_mathjax -%}
{%- block jupyter_widgets -%}{%- endblock jupyter_widgets -%}
"""


class MathConversionError(ValueError):
    """A formula of a Markdown cell that cannot be converted to MathML."""


def tex_to_mathml(tex: str, display: bool) -> str:
    """``tex`` (the body of ``$…$`` or ``$$…$$``) as one ``<math>`` element.

    ``\\_`` inside ``\\text{…}`` is LaTeX's underscore; the converter would keep the backslash.
    """
    from latex2mathml.converter import convert

    try:
        mathml = convert(tex.strip(), display="block" if display else "inline")
    except Exception as err:  # latex2mathml raises its own exception types, one per kind of mistake
        raise MathConversionError(f"cannot convert ${tex}$ to MathML: {type(err).__name__}: {err}") from None
    return mathml.replace("\\_", "_")


_ELEMENTTREE_PREFIX = re.compile(r' xmlns:ns0="[^"]*"|(?<=<)ns0:|(?<=</)ns0:')


def _renderer_class():
    from nbconvert.filters.markdown_mistune import IPythonRenderer

    class MathMLRenderer(IPythonRenderer):
        """nbconvert's Markdown renderer, with math as MathML instead of TeX left for MathJax."""

        def block_math(self, body: str) -> str:
            return tex_to_mathml(body, display=True)

        def inline_math(self, body: str) -> str:
            return tex_to_mathml(body, display=False)

        def latex_environment(self, name: str, body: str) -> str:
            return tex_to_mathml(f"\\begin{{{name}}}{body}\\end{{{name}}}", display=True)

        def heading(self, text: str, level: int, **attrs) -> str:
            # nbconvert adds the anchor through ElementTree, which writes MathML as <ns0:math …>: an element
            # HTML does not know. HTML's parser makes <math> MathML by its name alone.
            html = super().heading(text, level, **attrs)
            return _ELEMENTTREE_PREFIX.sub("", html) if "ns0:" in html else html

    return MathMLRenderer


def _exporter():
    from jinja2 import DictLoader
    from nbconvert import HTMLExporter
    from nbconvert.exporters.html import contextfilter
    from nbconvert.filters.markdown_mistune import MarkdownWithMath

    renderer_class = _renderer_class()

    class OfflineHTMLExporter(HTMLExporter):
        @contextfilter
        def markdown2html(self, context, source):
            cell = context.get("cell", {})
            renderer = renderer_class(
                escape=False, attachments=cell.get("attachments", {}), embed_images=self.embed_images,
                path=context.get("resources", {}).get("metadata", {}).get("path", ""),
                anchor_link_text=self.anchor_link_text, exclude_anchor_links=self.exclude_anchor_links,
                **self.lexer_options)
            try:
                return MarkdownWithMath(renderer=renderer).render(source)
            except MathConversionError as err:
                first_line = source.strip().splitlines()[0] if source.strip() else ""
                raise MathConversionError(f"Markdown cell starting {first_line[:60]!r}: {err}") from None

    return OfflineHTMLExporter(template_name="lab", template_file="mambalab_offline.html.j2",
                               extra_loaders=[DictLoader({"mambalab_offline.html.j2": _TEMPLATE})])


def widget_html(model_id: str, state: dict) -> str:
    """Static HTML for the widget ``model_id`` from the notebook's saved widget ``state``.

    Boxes show their children; an HTML or Label widget its value; an Output widget its outputs' HTML (or
    text); a control (slider, dropdown, checkbox, …) its description and starting value, marked as live in
    JupyterLab, since moving it needs the kernel.
    """
    model = state.get(model_id)
    if model is None:
        return ""
    name, s = model.get("model_name", ""), model.get("state", {})
    if name.endswith("BoxModel"):
        children = [widget_html(c.removeprefix("IPY_MODEL_"), state) for c in s.get("children", [])]
        direction = "column" if name in ("VBoxModel", "GridBoxModel") else "row"
        return (f'<div class="mambalab-widget-box" style="display:flex;flex-direction:{direction};gap:1em;'
                f'flex-wrap:wrap">{"".join(children)}</div>')
    if name in ("HTMLModel", "HTMLMathModel"):
        return f'<div class="mambalab-widget-html">{s.get("value", "")}</div>'
    if name == "LabelModel":
        return f'<span class="mambalab-widget-label">{html.escape(str(s.get("value", "")))}</span>'
    if name == "OutputModel":
        return "".join(_output_html(o) for o in s.get("outputs", []))
    description = s.get("description") or name.removesuffix("Model")
    value = s.get("value")
    if "options" in s or "_options_labels" in s:
        labels = s.get("_options_labels") or s.get("options") or []
        index = s.get("index")
        if isinstance(index, int) and 0 <= index < len(labels):
            value = labels[index]
    shown = f"{value:.4g}" if isinstance(value, float) else html.escape(str(value))
    return (f'<span class="mambalab-widget-control" title="live in JupyterLab: run the notebook to use it"'
            f' style="border:1px solid #bbb;border-radius:3px;padding:.1em .5em;color:#444">'
            f'{html.escape(str(description))} = <b>{shown}</b> '
            f'<em style="color:#888">(live in JupyterLab)</em></span>')


def _output_html(output: dict) -> str:
    data = output.get("data", {})
    if "text/html" in data:
        return _joined(data["text/html"])
    if output.get("output_type") == "stream":
        return f"<pre>{html.escape(_joined(output.get('text', '')))}</pre>"
    if "text/plain" in data:
        return f"<pre>{html.escape(_joined(data['text/plain']))}</pre>"
    return ""


def _joined(text) -> str:
    return "".join(text) if isinstance(text, list) else str(text)


def make_widgets_static(nb) -> None:
    """Give every widget output of ``nb`` an HTML form drawn from the saved widget state (see
    :func:`widget_html`), drop its widget view, and drop the state, so the page needs no widget manager."""
    state = nb.metadata.get("widgets", {}).get(WIDGET_STATE_MIMETYPE, {}).get("state", {})
    for cell in nb.cells:
        for output in cell.get("outputs", []):
            data = output.get("data", {})
            view = data.get(WIDGET_VIEW_MIMETYPE)
            if view is None:
                continue
            if "text/html" not in data:
                data["text/html"] = widget_html(view.get("model_id", ""), state)
            del data[WIDGET_VIEW_MIMETYPE]
            data.pop("text/plain", None)  # the widget's repr ("HBox(children=…)") says nothing to a reader
    nb.metadata.pop("widgets", None)


def render(nb, name: str) -> str:
    """The executed notebook ``nb`` (an ``nbformat`` node, modified in place) as one offline HTML page."""
    make_widgets_static(nb)
    body, _ = _exporter().from_notebook_node(nb, resources={"metadata": {"name": name}})
    return body


def write(nb, path: str | Path) -> Path:
    """:func:`render` ``nb`` to ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render(nb, path.stem), encoding="utf-8")
    return path
