"""Every notebook in notebooks/ runs start to finish and renders to HTML whose figures work offline; every
committed notebook is clean. The harness itself (mambalab.workbook) is tested on throwaway notebooks.

Each notebook is executed once per test session (tests/conftest.py's ``executed_notebook``): by Run All Cells in
JupyterLab when the browser tests run it, else by papermill as ``./run.sh workbook`` runs it. Either way a fresh
kernel, so the ``parameters`` cell picks the small CPU sizes when there is no GPU, and the chapters of
tests/conftest.py's SMALLER_ON_CPU get smaller sizes still, injected after that cell.
"""
import ast
import json
import sys
from pathlib import Path

import nbformat
import pytest
from papermill.exceptions import PapermillExecutionError

from conftest import SMALLER_ON_CPU, smaller_sizes
from mambalab import workbook

NOTEBOOKS_DIR = Path(__file__).resolve().parents[1] / "notebooks"
NOTEBOOKS = sorted(NOTEBOOKS_DIR.glob("*.ipynb"))  # globbed at collection: a new notebook is covered as is


@pytest.mark.notebook
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_and_renders_offline(path, executed_notebook, rendered_page):
    executed = executed_notebook(path)  # raises PapermillExecutionError for a failed cell, whoever ran it
    nb = nbformat.read(executed, as_version=4)
    errors = [o for c in nb.cells for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors, f"{path.name}: {errors[0].ename}: {errors[0].evalue}"
    injected = [c for c in nb.cells if "injected-parameters" in c.metadata.get("tags", [])]
    assert (_assigned(injected[0].source) if injected else {}) == smaller_sizes(path), \
        f"{path.name}: the executed copy's injected sizes differ from tests/conftest.py's"
    page = rendered_page(executed)
    assert workbook.offline_figure_problems(executed, page.read_text(encoding="utf-8")) == []


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_committed_notebook_is_clean(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    with_outputs = [i for i, c in enumerate(nb.cells)
                    if c.cell_type == "code" and (c.outputs or c.execution_count is not None)]
    assert not with_outputs, f"{path.name}: cells {with_outputs} have outputs or execution counts; clear them"
    tagged = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    assert len(tagged) == 1, f"{path.name}: {len(tagged)} cells tagged 'parameters', expected exactly one"
    assert tagged[0].cell_type == "code"
    raw = json.loads(path.read_text(encoding="utf-8"))    # as committed: nbformat.read would add missing ids
    no_id = [i for i, c in enumerate(raw["cells"]) if "id" not in c]
    assert not no_id, f"{path.name}: cells {no_id} have no id (nbformat 4.5 requires one; give each a new one)"


def _assigned(source: str) -> dict:
    """name -> value of each ``name = literal`` statement in ``source``."""
    return {node.targets[0].id: ast.literal_eval(node.value) for node in ast.parse(source).body
            if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name)}


def _parameters_cell(nb):
    return next(c for c in nb.cells if "parameters" in c.metadata.get("tags", []))


@pytest.mark.parametrize("stem", sorted(SMALLER_ON_CPU))
def test_smaller_sizes_are_parameters_of_their_chapter(stem):
    """Each size the tests inject is assigned in the chapter's parameters cell (a renamed parameter cannot leave
    an injection that changes nothing), and is a value papermill writes as the same Python literal."""
    path = NOTEBOOKS_DIR / f"{stem}.ipynb"
    assert path.exists(), f"SMALLER_ON_CPU names {path.name}, which is not in notebooks/"
    tree = ast.parse(_parameters_cell(nbformat.read(path, as_version=4)).source)
    assigned = {n.id for node in ast.walk(tree) if isinstance(node, ast.Assign)
                for target in node.targets for n in ast.walk(target) if isinstance(n, ast.Name)}
    unknown = sorted(set(SMALLER_ON_CPU[stem]) - assigned)
    assert not unknown, f"{path.name}: {unknown} are not assigned in its parameters cell"

    def literal(value) -> bool:   # papermill's Python translator writes these as themselves; a tuple as a string
        if isinstance(value, list):
            return all(literal(v) for v in value)
        if isinstance(value, dict):
            return all(isinstance(k, str) and literal(v) for k, v in value.items())
        return value is None or isinstance(value, (bool, int, float, str))

    odd = {name: value for name, value in SMALLER_ON_CPU[stem].items() if not literal(value)}
    assert not odd, f"{stem}: papermill would not write {odd} as the same literal (use lists, not tuples)"


# --- the harness, on throwaway notebooks --------------------------------------------------------------

def make_notebook(path: Path, *cells: str, parameters: str = "n = 1") -> Path:
    """A notebook with a `parameters` cell followed by ``cells`` (code)."""
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    params = nbformat.v4.new_code_cell(parameters)
    params.metadata["tags"] = ["parameters"]
    nb.cells = [nbformat.v4.new_markdown_cell(f"# {path.stem}"), params]
    nb.cells += [nbformat.v4.new_code_cell(source) for source in cells]
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, path)
    return path


def stream_text(ipynb: Path) -> str:
    nb = json.loads(ipynb.read_text(encoding="utf-8"))
    return "".join("".join(o.get("text", "")) for c in nb["cells"] for o in c.get("outputs", [])
                   if o["output_type"] == "stream")


def test_find_notebooks_takes_numbered_chapters_in_order(tmp_path):
    for name in ("01_b.ipynb", "00_a.ipynb", "scratch.ipynb", "1_short.ipynb", "10_c.ipynb"):
        (tmp_path / name).write_text("{}")
    assert [p.name for p in workbook.find_notebooks(tmp_path)] == ["00_a.ipynb", "01_b.ipynb", "10_c.ipynb"]


@pytest.mark.notebook
def test_execute_uses_this_interpreter_and_injects_parameters(tmp_path):
    nb = make_notebook(tmp_path / "src" / "00_probe.ipynb",
                       "import os, sys\nprint(sys.prefix, n, os.getcwd(), sep='|')", parameters="n = 1")
    executed = workbook.execute(nb, tmp_path / "out", {"n": 7})
    assert executed == tmp_path / "out" / "00_probe.ipynb"
    prefix, n, cwd = stream_text(executed).strip().split("|")
    assert Path(prefix).resolve() == Path(sys.prefix).resolve()  # the kernel runs in this environment
    assert n == "7"
    assert Path(cwd).resolve() == nb.parent.resolve()  # cells run beside the notebook, as in JupyterLab


@pytest.mark.notebook
def test_execute_raises_on_a_failing_cell_and_keeps_the_traceback(tmp_path):
    nb = make_notebook(tmp_path / "00_fails.ipynb", "raise ValueError('boom in cell')")
    with pytest.raises(PapermillExecutionError, match="boom in cell"):
        workbook.execute(nb, tmp_path / "out")
    assert "boom in cell" in (tmp_path / "out" / "00_fails.ipynb").read_text()


@pytest.mark.notebook
def test_figures_render_offline_after_setup(tmp_path):
    nb = make_notebook(
        tmp_path / "00_figure.ipynb",
        "from mambalab.viz.notebook import setup\nsetup()",
        "import plotly.graph_objects as go\ngo.Figure(go.Scatter(y=[1, 3, 2]), layout_title_text='probe')",
    )
    executed = workbook.execute(nb, tmp_path / "out")
    page = workbook.render_html(executed, tmp_path / "html")
    assert page == tmp_path / "html" / "00_figure.html"
    text = page.read_text(encoding="utf-8")
    from plotly.offline import get_plotlyjs

    assert get_plotlyjs()[-2000:] in text  # the whole library is in the page, not just its opening
    assert "Plotly.newPlot" in text and "probe" in text
    assert workbook.offline_figure_problems(executed, text) == []


def test_offline_figure_problems_flags_missing_setup_and_cdn(tmp_path):
    fig_json = {"output_type": "display_data", "metadata": {},
                "data": {workbook.PLOTLY_MIMETYPE: {"data": [], "layout": {}}, "text/plain": ["Figure"]}}
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("fig", outputs=[nbformat.from_dict(fig_json)])]
    path = tmp_path / "00_nosetup.ipynb"
    nbformat.write(nb, path)
    problems = workbook.offline_figure_problems(path, "<html><body>Figure</body></html>")
    assert any("no HTML form" in p for p in problems)
    assert any("not embedded" in p for p in problems)
    assert any("setup()" in p for p in problems)
    cdn = '<script src="https://cdn.plot.ly/plotly-3.0.1.min.js"></script>'
    assert any("network" in p for p in workbook.offline_figure_problems(path, cdn))


def test_lab_copy_fails_its_readers_as_papermill_does(tmp_path):
    """A copy JupyterLab saved after Run All Cells stopped at an error raises papermill's error for that cell;
    a copy with cells left unexecuted, a run that broke off or none at all raise, naming the notebook."""
    from papermill.exceptions import PapermillExecutionError

    from conftest import _saved_by_lab

    path = make_notebook(tmp_path / "00_lab.ipynb", "x = 1", "raise ValueError('boom in lab')", "y = 2")
    nb = nbformat.read(path, as_version=4)   # cells: heading, parameters, x = 1, raise, y = 2
    for count, cell in enumerate(nb.cells[1:4], 1):
        cell.execution_count = count
    traceback = ["\x1b[0;31mValueError\x1b[0m Traceback", "ValueError: boom in lab"]
    nb.cells[3].outputs = [nbformat.v4.new_output("error", ename="ValueError", evalue="boom in lab",
                                                  traceback=traceback)]
    nbformat.write(nb, path)
    with pytest.raises(PapermillExecutionError, match="boom in lab") as failed:
        _saved_by_lab(path, {path: path})
    assert (failed.value.cell_index, failed.value.exec_count, failed.value.ename) == (3, 3, "ValueError")
    assert failed.value.source == "raise ValueError('boom in lab')"

    nb.cells[3].outputs = []
    nbformat.write(nb, path)
    with pytest.raises(RuntimeError, match=r"00_lab.ipynb: cells \[4\] did not run"):
        _saved_by_lab(path, {path: path})
    nb.cells[4].execution_count = 4
    nbformat.write(nb, path)
    assert _saved_by_lab(path, {path: path}) == path
    with pytest.raises(RuntimeError, match="00_lab.ipynb: its run in JupyterLab broke off: Failed: timeout"):
        _saved_by_lab(path, {path: "Failed: timeout"})
    with pytest.raises(RuntimeError, match="00_lab.ipynb: JupyterLab did not run it"):
        _saved_by_lab(path, {})


def test_title_of_reads_the_first_heading(tmp_path):
    nb = make_notebook(tmp_path / "03_x.ipynb")
    assert workbook.title_of(nb) == "03_x"
