"""The workbook's exported pages as a reader on a train opens them: each chapter executed (tests/conftest.py's
``executed_notebook``: JupyterLab's Run All Cells when test_workbook_in_browser.py runs it, else papermill),
rendered as ``./run.sh workbook`` renders it (:func:`mambalab.workbook.render_html`), and opened from disk in
headless Chromium with every request other than the page itself aborted.

For every notebook in notebooks/:

* no request leaves the page;
* every formula of the notebook's Markdown is a MathML element that the browser lays out as math, with a size
  and no error, and no raw TeX (``$…$``, ``\\command``) is left in the page's text outside code;
* every plotly figure is drawn (its SVG is there, has a size and holds marks);
* every plotly slider in the page changes its figure when clicked to another step;
* every widget shows a static form (no widget view is left waiting for a widget manager).

The notebooks are executed and rendered once per test session, shared with tests/test_notebooks.py and the
JupyterLab runs.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import nbformat
import pytest

pytestmark = pytest.mark.browser

NOTEBOOKS = sorted((Path(__file__).resolve().parents[2] / "notebooks").glob("[0-9][0-9]_*.ipynb"))
DRAW_TIMEOUT_MS = 60_000
# Formulas as a reader of the Markdown sees them, counted independently of the converter: $$…$$ and $…$.
FORMULA = re.compile(r"(?<!\\)\$\$(.+?)(?<!\\)\$\$|(?<![\\$])\$(?!\$)(.+?)(?<![\\$])\$", re.S)

# Text the reader sees, outside code, scripts, math and figures, that still looks like TeX.
_RAW_TEX = r"""() => {
  const skip = 'pre, code, script, style, math, svg, textarea, .highlight, .jp-InputArea';
  const walker = document.createTreeWalker(document.body, NodeFilter.SHOW_TEXT);
  const found = [];
  for (let node = walker.nextNode(); node; node = walker.nextNode()) {
    if (node.parentElement.closest(skip)) continue;
    const text = node.textContent;
    const m = text.match(/\$[^$\s][^$]*\$|\$\$|\\[A-Za-z]{2,}/);
    if (m) found.push(text.slice(Math.max(0, m.index - 30), m.index + 50));
  }
  return found;
}"""
_MATH = r"""() => [...document.querySelectorAll('math')].map(m => {
  const r = m.getBoundingClientRect();
  return {width: r.width, height: r.height, display: getComputedStyle(m).display,
          error: !!m.querySelector('merror'), text: m.textContent.slice(0, 40)};
})"""
_DRAWN = """(n) => { const gds = [...document.querySelectorAll('.js-plotly-plot')];
  return gds.length === n && gds.every(gd => { const s = gd.querySelector('svg.main-svg');
    return s && s.getBoundingClientRect().width > 0 && gd.querySelector('.trace, .hm, image'); }); }"""
_FIGURE_KEY = """(i) => { const gd = document.querySelectorAll('.js-plotly-plot')[i]; let h = 0;
  for (const svg of gd.querySelectorAll('svg.main-svg'))
    for (const ch of svg.outerHTML) h = (Math.imul(h, 31) + ch.charCodeAt(0)) | 0;
  return h; }"""
_SLIDERS = """() => [...document.querySelectorAll('.js-plotly-plot')].map(gd =>
  ((gd._fullLayout && gd._fullLayout.sliders) || []).map(s => ({active: s.active, steps: s.steps.length})))"""


def formulas(ipynb: Path) -> list[str]:
    nb = nbformat.read(ipynb, as_version=4)
    return [m.group(1) or m.group(2) for c in nb.cells if c.cell_type == "markdown" for m in FORMULA.finditer(c.source)]


@pytest.fixture(scope="module")
def offline_context(browser):
    """A browser context whose pages may load only themselves: every other request is aborted and recorded."""
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    requests: list[str] = []
    context.allowed = set()  # the pages themselves, added as they are opened

    def route(r):
        if r.request.url in context.allowed:
            r.continue_()
        else:
            requests.append(r.request.url)
            r.abort()

    context.route("**/*", route)
    context.requests = requests
    yield context
    context.close()


@dataclass
class ExportedPage:
    """A chapter's exported page, opened: the notebook, its executed copy, the browser page, the requests the
    page made, and how many figures its source holds."""

    path: Path
    executed: Path
    page: object
    requests: list[str]
    figures: int


@pytest.fixture(scope="module", params=NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def exported_page(request, executed_notebook, rendered_page, offline_context):
    """The notebook's page, exported and opened offline (an :class:`ExportedPage`)."""
    executed = executed_notebook(request.param)
    html = rendered_page(executed)
    before = len(offline_context.requests)
    page = offline_context.new_page()
    offline_context.allowed.add(html.as_uri())
    page.goto(html.as_uri())
    page.wait_for_load_state("load")
    figures = html.read_text(encoding="utf-8").count('class="plotly-graph-div"')
    yield ExportedPage(request.param, executed, page, offline_context.requests[before:], figures)
    page.close()


def test_page_makes_no_request(exported_page):
    path, page, requests = exported_page.path, exported_page.page, exported_page.requests
    page.wait_for_timeout(500)  # scripts that would fetch something have run by then
    assert not requests, f"{path.name}: the page asked for {requests[:5]}"


def test_every_formula_renders_as_math(exported_page):
    path, page = exported_page.path, exported_page.page
    expected = formulas(exported_page.executed)
    math = page.evaluate(_MATH)
    assert len(math) == len(expected), f"{path.name}: {len(math)} math elements for {len(expected)} formulas"
    bad = [m for m in math if m["error"] or not (m["width"] > 0 and m["height"] > 0)
           or m["display"] not in ("math", "block math", "inline math")]
    assert not bad, f"{path.name}: formulas not laid out as math: {bad[:3]}"
    raw = page.evaluate(_RAW_TEX)
    assert not raw, f"{path.name}: raw TeX left in the page's text: {raw[:5]}"


def test_every_figure_draws(exported_page):
    path, page, expected = exported_page.path, exported_page.page, exported_page.figures
    try:
        page.wait_for_function(_DRAWN, arg=expected, timeout=DRAW_TIMEOUT_MS)
    except Exception:
        drawn = page.evaluate("() => document.querySelectorAll('.js-plotly-plot').length")
        raise AssertionError(f"{path.name}: {drawn} of {expected} figures drawn") from None


def test_page_sliders_change_their_figure(exported_page):
    path, page, figures = exported_page.path, exported_page.page, exported_page.figures
    page.wait_for_function(_DRAWN, arg=figures, timeout=DRAW_TIMEOUT_MS)
    sliders = page.evaluate(_SLIDERS)
    if not any(sliders):
        pytest.skip(f"{path.name} has no page slider")
    for figure, figure_sliders in enumerate(sliders):
        gd = page.locator(".js-plotly-plot").nth(figure)
        for k, slider in enumerate(figure_sliders):
            target = 0 if slider["active"] > 0 else slider["steps"] - 1
            rail = gd.locator(".slider-container .slider-group").nth(k).locator("rect.slider-rail-touch-rect")
            rail.scroll_into_view_if_needed()
            box = rail.bounding_box()
            before = page.evaluate(_FIGURE_KEY, figure)
            # the rail's ends are its first and last steps; click just inside the chosen end
            x = box["x"] + box["width"] * (0.02 if target == 0 else 0.98)
            page.mouse.click(x, box["y"] + box["height"] / 2)
            page.wait_for_function(f"() => document.querySelectorAll('.js-plotly-plot')[{figure}]"
                                   f"._fullLayout.sliders[{k}].active === {target}", timeout=10_000)
            page.wait_for_timeout(300)
            after = page.evaluate(_FIGURE_KEY, figure)
            assert after != before, f"{path.name}: figure {figure}'s slider {k} moved but the figure did not change"


def test_widgets_have_a_static_form(exported_page):
    path, executed, page = exported_page.path, exported_page.executed, exported_page.page
    nb = nbformat.read(executed, as_version=4)
    widget_outputs = sum("application/vnd.jupyter.widget-view+json" in o.get("data", {})
                         for c in nb.cells for o in c.get("outputs", []))
    empty = page.evaluate("() => [...document.querySelectorAll('.jupyter-widgets')].length")
    assert empty == 0, f"{path.name}: {empty} widget views wait for a widget manager the page does not have"
    if widget_outputs:
        shown = page.evaluate("() => document.querySelectorAll('.mambalab-widget-control, .mambalab-widget-html,"
                              " .mambalab-widget-box, .mambalab-page-sliders').length")
        assert shown > 0, f"{path.name}: {widget_outputs} widget outputs, none shown in a static form"
