"""The workbook as a reader meets it: each notebook opened fresh in JupyterLab, in headless Chromium, and run
top to bottom with Run ▸ Run All Cells (no GPU here, so its ``parameters`` cell picks the CPU sizes; the
chapters in tests/conftest.py's ``SMALLER_ON_CPU`` get smaller ones injected after it, as papermill injects
parameters).

For every notebook in notebooks/ (globbed, so a new chapter is covered as is):

* every code cell ran and none ended in an error;
* every plotly figure the kernel sent is drawn: its SVG is there, has a size and holds marks;
* a slider whose cell also shows a figure drives it: dragging the slider's handle with the mouse redraws that
  figure differently (chapters 01, 02 and 03 must have at least one such slider);
* saved from JupyterLab and rendered to HTML as ``./run.sh workbook`` renders it
  (:func:`mambalab.workbook.render_html`), the page shows every figure with all network requests aborted.

A screenshot of each notebook after its run goes to build/browser/; its kernel is shut down afterwards,
whatever the checks found. The server, the browser and the request blocking live in conftest.py. This run is the
test session's one execution of the chapter: tests/test_notebooks.py and test_pages_offline.py read the copy it
saves (tests/conftest.py's ``executed_notebook``).
"""
from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import nbformat
import pytest

from conftest import smaller_sizes
from mambalab import workbook

pytestmark = pytest.mark.browser

# MAMBALAB_BROWSER_NOTEBOOKS: another folder of notebooks, to try the checks themselves on test notebooks.
NOTEBOOKS_DIR = Path(os.environ.get("MAMBALAB_BROWSER_NOTEBOOKS") or Path(__file__).resolve().parents[2] / "notebooks")
NOTEBOOKS = sorted(NOTEBOOKS_DIR.glob("*.ipynb"))  # globbed at collection: a new notebook is covered as is
SLIDER_CHAPTERS = ("01", "02", "03")  # chapters whose figures a slider must drive
OPEN_TIMEOUT_MS = 120_000  # page load and kernel start
RUN_TIMEOUT_MS = 600_000  # Run All Cells, a whole notebook on CPU
REDRAW_TIMEOUT_MS = 60_000  # a slider's figure recomputed by the kernel and redrawn
PLOTLY_MIMETYPE = workbook.PLOTLY_MIMETYPE
VIEWPORT_CORNER = (1, 1)  # where the mouse rests for screenshots: JupyterLab's logo, not a figure

# JavaScript run in the page. `panel` is the notebook's tab, found by its path through window.jupyterapp.
_PANEL = ("const panel = window.jupyterapp &&"
          " [...window.jupyterapp.shell.widgets('main')].find(w => w.context && w.context.path === path);")
_READY = "(path) => { %s const k = panel && panel.sessionContext.session && panel.sessionContext.session.kernel;" \
         " return !!k && k.status === 'idle'; }" % _PANEL
# Done: no cell queued or running ([*]), the kernel idle, and every non-empty code cell executed or an error
# shown (Run All stops at an error, leaving the later cells unexecuted).
_RUN_STATE = """(path) => { %s
  const kernel = panel.sessionContext.session && panel.sessionContext.session.kernel;
  const prompts = [...panel.node.querySelectorAll('.jp-CodeCell .jp-InputPrompt')];
  const code = panel.content.widgets.filter(c => c.model.type === 'code' && c.model.sharedModel.getSource().trim());
  const errors = code.filter(c => c.model.outputs.toJSON().some(o => o.output_type === 'error')).length;
  const executed = code.filter(c => c.model.executionCount !== null).length;
  const running = prompts.filter(p => p.textContent.includes('*')).length;
  return {kernel: kernel ? kernel.status : 'none', running, executed, total: code.length, errors,
          done: running === 0 && kernel && kernel.status === 'idle' && (executed === code.length || errors > 0)};
}""" % _PANEL
_CELLS = """(path) => { %s
  return panel.content.widgets.map((c, index) => ({index, type: c.model.type,
    source: c.model.sharedModel.getSource(), executionCount: c.model.type === 'code' ? c.model.executionCount : null,
    outputs: c.model.type === 'code' ? c.model.outputs.toJSON() : []}));
}""" % _PANEL
# Every drawn plotly figure in the notebook, with the cell it is in.
_FIGURES = """(path) => { %s
  return panel.content.widgets.flatMap((c, cell) => [...c.node.querySelectorAll('.js-plotly-plot')].map(gd => {
    const svg = gd.querySelector('svg.main-svg'), box = svg ? svg.getBoundingClientRect() : {width: 0, height: 0};
    return {cell, width: box.width, height: box.height, marks: gd.querySelectorAll('.trace, .hm, image').length,
            title: (gd.querySelector('.gtitle') || {textContent: ''}).textContent};
  }));
}""" % _PANEL
# What a cell's figures look like now: their SVG markup, hashed; '' while one is not drawn.
_CELL_FIGURES_KEY = """([path, cell]) => { %s
  const plots = [...panel.content.widgets[cell].node.querySelectorAll('.js-plotly-plot')];
  if (!plots.length) return '';
  let h = 0;
  for (const gd of plots) {
    const svg = gd.querySelector('svg.main-svg');
    if (!svg || !gd.querySelector('.trace, .hm, image')) return '';
    for (const ch of svg.outerHTML) h = (Math.imul(h, 31) + ch.charCodeAt(0)) | 0;
  }
  return plots.length + ':' + h;
}""" % _PANEL


@dataclass
class RanNotebook:
    """A notebook after Run All Cells in JupyterLab: its page, its cells (from the notebook model) and the
    copy JupyterLab saved, outputs included."""

    name: str
    page: object
    cells: list[dict]
    saved: Path

    @property
    def chapter(self) -> str:
        return self.name[:2]

    def code_cells(self) -> list[dict]:
        return [c for c in self.cells if c["type"] == "code"]

    def figures(self) -> list[dict]:
        return self.page.evaluate(_FIGURES, self.name)

    def cell(self, index: int):
        return self.page.locator(".jp-Notebook .jp-Cell").nth(index)

    def slider_figure_cells(self) -> list[int]:
        """Cells showing both a slider and a drawn figure (the figure a slider drives sits in its cell)."""
        return [c["index"] for c in self.code_cells() if _has_widget(c)
                and self.cell(c["index"]).locator(".widget-slider").count()
                and self.cell(c["index"]).locator(".js-plotly-plot").count()]

    def scroll_to(self, index: int) -> None:
        self.page.evaluate("([path, i]) => { %s panel.content.widgets[i].node.scrollIntoView({block: 'start'}); }"
                           % _PANEL, [self.name, index])


def _describe_errors(cells: list[dict]) -> list[str]:
    return [f"cell {c['index']}: {o.get('ename')}: {o.get('evalue')}"
            for c in cells for o in c["outputs"] if o.get("output_type") == "error"]


def _first(cells: list[dict], predicate) -> int | None:
    return next((c["index"] for c in cells if predicate(c)), None)


def _has_widget(cell: dict) -> bool:
    return any("application/vnd.jupyter.widget-view+json" in o.get("data", {}) for o in cell["outputs"])


def _parameters_cell(nb) -> int:
    return next(i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", []))


def copy_for_lab(source: Path, target: Path) -> None:
    """Copy the notebook to the server's folder, with its :func:`conftest.smaller_sizes` assigned in a cell after
    its ``parameters`` cell."""
    parameters = smaller_sizes(source)
    if not parameters:
        shutil.copy2(source, target)
        return
    nb = nbformat.read(source, as_version=4)
    cell = nbformat.v4.new_code_cell("# Parameters injected by tests/browser: smaller CPU sizes\n"
                                     + "\n".join(f"{name} = {value!r}" for name, value in parameters.items()))
    cell.metadata["tags"] = ["injected-parameters"]
    nb.cells.insert(_parameters_cell(nb) + 1, cell)
    nbformat.write(nb, target)


@pytest.fixture(scope="module", params=NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def ran_notebook(request, lab_server, browser_context, screenshot, lab_executed, tmp_path_factory):
    """Open the notebook fresh, Run All Cells, save it; afterwards shut its kernel down and close the tab.

    The copy saved right after the run is recorded in ``lab_executed``: it is this session's executed copy of
    the chapter, which tests/test_notebooks.py and test_pages_offline.py read (tests/conftest.py's
    ``executed_notebook``); where the run breaks off, the reason is recorded instead."""
    name = request.param.name
    copy_for_lab(request.param, lab_server.root / name)
    page = browser_context.new_page()
    try:
        # ?reset: a fresh workspace, so no tab from an earlier notebook comes back.
        page.goto(f"{lab_server.url}/lab/tree/{name}?reset&token={lab_server.token}")
        page.wait_for_function(_READY, arg=name, timeout=OPEN_TIMEOUT_MS)
        page.evaluate("window.jupyterapp.shell.collapseLeft()")  # the file browser would only narrow the view
        page.get_by_role("menuitem", name="Run", exact=True).click()
        page.get_by_role("menuitem", name="Run All Cells", exact=True).click()
        try:
            page.wait_for_function(f"(path) => ({_RUN_STATE})(path).done", arg=name, timeout=RUN_TIMEOUT_MS,
                                   polling=500)
        except Exception as err:
            state = page.evaluate(_RUN_STATE, name)
            screenshot(page, f"{request.param.stem}-timeout")
            pytest.fail(f"{name}: Run All Cells did not finish in {RUN_TIMEOUT_MS / 1000:.0f} s: {state} ({err})")
        cells = page.evaluate(_CELLS, name)
        saved = tmp_path_factory.mktemp("executed-lab") / name   # the run's outputs, before any slider moves
        ran = RanNotebook(name=name, page=page, cells=cells, saved=saved)
        # The picture: the first error, else the first slider-driven figure, else the first figure, else the top.
        errors = _first(cells, lambda c: any(o.get("output_type") == "error" for o in c["outputs"]))
        drawn = [f["cell"] for f in ran.figures()]
        shown = next((i for i in (errors, *ran.slider_figure_cells()[:1], *drawn[:1]) if i is not None), 0)
        ran.scroll_to(shown)
        page.mouse.move(VIEWPORT_CORNER[0], VIEWPORT_CORNER[1])  # no hover effects (plotly's toolbar) in the picture
        page.wait_for_timeout(300)  # let the scroll settle
        screenshot(page, request.param.stem if errors is None else f"{request.param.stem}-error",
                   preview=errors is None)
        # Save through the UI (File ▸ Save Notebook), as a reader would; the offline-HTML test renders it.
        page.get_by_role("menuitem", name="File", exact=True).click()
        page.get_by_role("menuitem", name=re.compile(r"^Save Notebook(?! As)")).click()  # name ends in its shortcut
        page.wait_for_function("(path) => { %s return panel && !panel.context.model.dirty; }" % _PANEL,
                               arg=name, timeout=30_000)
        shutil.copyfile(lab_server.root / name, saved)
        lab_executed[request.param] = saved
        yield ran
    except BaseException as err:   # pytest.fail's Failed included: the readers say why there is no copy
        lab_executed.setdefault(request.param, f"{type(err).__name__}: {err}")
        raise
    finally:
        try:
            lab_server.shut_down_kernels_of(name)
        finally:
            page.close()
        left = lab_server.kernels()
        assert not left, f"{name}: kernels still running after its session was shut down: {left}"


def test_every_cell_runs_without_error(ran_notebook):
    cells = ran_notebook.code_cells()
    errors = _describe_errors(cells)
    assert not errors, (f"{ran_notebook.name}: {'; '.join(errors)} "
                        f"(screenshot: build/browser/{Path(ran_notebook.name).stem}-error.png)")
    skipped = [c["index"] for c in cells if c["source"].strip() and c["executionCount"] is None]
    assert not skipped, f"{ran_notebook.name}: cells {skipped} did not run"


def test_every_plotly_figure_is_drawn(ran_notebook):
    expected = {c["index"]: sum(PLOTLY_MIMETYPE in o.get("data", {}) for o in c["outputs"])
                for c in ran_notebook.code_cells()}
    figures = ran_notebook.figures()
    drawn = {i: sum(f["cell"] == i for f in figures) for i in expected}
    # A widget (an Output widget, a FigureWidget) may hold figures the cell's outputs do not list: at least.
    widgets = {c["index"] for c in ran_notebook.code_cells() if _has_widget(c)}
    missing = {i: (drawn[i], n) for i, n in expected.items() if drawn[i] < n or (drawn[i] > n and i not in widgets)}
    assert not missing, (f"{ran_notebook.name}: figures drawn vs sent by the kernel, by cell: {missing} "
                         f"(screenshot: build/browser/{Path(ran_notebook.name).stem}.png)")
    empty = [f for f in figures if not (f["width"] > 0 and f["height"] > 0 and f["marks"] > 0)]
    assert not empty, f"{ran_notebook.name}: figures without a drawn SVG: {empty}"
    untitled = [f["cell"] for f in figures if not f["title"].strip()]
    assert not untitled, f"{ran_notebook.name}: figures without a title in cells {untitled}"


def test_sliders_drive_their_figures(ran_notebook):
    """Drag each slider of a cell that shows a figure; the figure must be redrawn, differently."""
    page = ran_notebook.page
    cells_with_sliders = ran_notebook.slider_figure_cells()
    if not cells_with_sliders:
        assert ran_notebook.chapter not in SLIDER_CHAPTERS, \
            f"{ran_notebook.name}: chapter {ran_notebook.chapter} should have a slider driving a figure; found none"
        pytest.skip(f"{ran_notebook.name} has no slider beside a figure")
    for index in cells_with_sliders:
        sliders = ran_notebook.cell(index).locator(".widget-slider")
        for k in range(sliders.count()):
            slider = sliders.nth(k)
            label = slider.locator(".widget-label").inner_text().strip() or f"slider {k}"
            before_value = slider.locator(".widget-readout").inner_text()
            before = page.evaluate(_CELL_FIGURES_KEY, [ran_notebook.name, index])
            assert before, f"{ran_notebook.name}: cell {index}'s figure is not drawn before moving '{label}'"
            _drag_handle(page, slider)
            after_value = slider.locator(".widget-readout").inner_text()
            assert after_value != before_value, f"{ran_notebook.name}: dragging '{label}' did not move it"
            try:
                redrawn = f"(a) => {{ const k = ({_CELL_FIGURES_KEY})(a); return k && k !== {json.dumps(before)}; }}"
                page.wait_for_function(redrawn, arg=[ran_notebook.name, index], timeout=REDRAW_TIMEOUT_MS)
            except Exception as err:
                raise AssertionError(f"{ran_notebook.name}: cell {index}: '{label}' moved from {before_value} to "
                                     f"{after_value} but its figure was not redrawn differently ({err})") from None


def _drag_handle(page, slider) -> None:
    """Drag the slider's handle with the mouse to 25 % or 75 % of its track, whichever is farther."""
    handle = slider.locator(".noUi-handle")
    handle.scroll_into_view_if_needed()
    track = slider.locator(".noUi-target").bounding_box()
    grip = handle.bounding_box()
    x, y = grip["x"] + grip["width"] / 2, grip["y"] + grip["height"] / 2
    position = (x - track["x"]) / track["width"]
    target = track["x"] + track["width"] * (0.25 if position > 0.5 else 0.75)
    page.mouse.move(x, y)
    page.mouse.down()
    page.mouse.move(target, y, steps=8)
    page.mouse.up()


def test_rendered_html_shows_figures_offline(ran_notebook, browser_context, blocked_requests, rendered_page):
    """The notebook as JupyterLab saved it, rendered as ``./run.sh workbook`` renders it, opened in the same
    browser with every request off this machine aborted: every figure is drawn."""
    page_path = rendered_page(ran_notebook.saved)
    assert workbook.offline_figure_problems(ran_notebook.saved, page_path.read_text(encoding="utf-8")) == []
    saved = json.loads(ran_notebook.saved.read_text(encoding="utf-8"))
    # A figure output: plotly's mimetype, or HTML holding a plotly div (a widget's static stand-in, say).
    expected = sum(PLOTLY_MIMETYPE in data or "plotly-graph-div" in "".join(data.get("text/html", ""))
                   for c in saved["cells"] for data in (o.get("data", {}) for o in c.get("outputs", [])))
    blocked_before = len(blocked_requests.urls)
    page = browser_context.new_page()
    try:
        page.goto(page_path.as_uri())
        title = workbook.title_of(ran_notebook.saved)
        assert title in page.locator("body").inner_text(), f"{page_path.name}: the page does not show '{title}'"
        drawn_js = ("(n) => { const gds = [...document.querySelectorAll('.js-plotly-plot')];"
                    " return gds.length === n && gds.every(gd => { const s = gd.querySelector('svg.main-svg');"
                    " return s && s.getBoundingClientRect().width > 0 && gd.querySelector('.trace, .hm, image'); }); }")
        try:
            page.wait_for_function(drawn_js, arg=expected, timeout=60_000)
        except Exception:
            drawn = page.evaluate("() => document.querySelectorAll('.js-plotly-plot').length")
            blocked = blocked_requests.urls[blocked_before:]
            raise AssertionError(f"{page_path.name}: {drawn} of {expected} figures drawn offline; "
                                 f"requests aborted: {blocked or 'none'}") from None
    finally:
        page.close()
