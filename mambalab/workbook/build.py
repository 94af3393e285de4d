"""The workbook, executed headless: every chapter notebook through papermill, each on a fresh kernel, then
rendered as standalone HTML that shows its plotly figures offline.

Layout of the result (``out_dir``, by default ``build/``)::

    build/notebooks/NN_name.ipynb   the executed notebook, outputs included
    build/html/NN_name.html         the same, as one self-contained page (plotly.js embedded)
    build/index.html                links to every chapter and whether it ran

A chapter counts as failed if a cell raises or if its figures would not display offline.

Kernels run in the interpreter running this module (``sys.executable``), whatever kernelspecs the user has
installed elsewhere, so a notebook sees exactly the packages that ``./run.sh`` set up. Notebooks choose
their sizes themselves (their ``parameters`` cell looks for a GPU); ``parameters`` here override that
cell for every notebook.
"""
from __future__ import annotations

import html
import json
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from jupyter_client.kernelspec import KernelSpec
from jupyter_client.manager import AsyncKernelManager
from traitlets import TraitError

#: The repository root when mambalab is installed from a checkout (``pip install -e .``).
ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS_DIR = ROOT / "notebooks"
BUILD_DIR = ROOT / "build"
CHAPTER_PATTERN = "[0-9][0-9]_*.ipynb"
IOPUB_TIMEOUT_S = 120   # seconds papermill waits for a cell's last output (nbclient's default: 4)


class ThisInterpreterKernelManager(AsyncKernelManager):
    """Starts ipykernel with ``sys.executable`` instead of looking up a kernelspec by name.

    A kernelspec called ``python3`` in the user's own Jupyter directory (say, from a system-wide
    install) would otherwise win over the one in the virtual environment, and the notebooks would run
    in another Python without mambalab's dependencies.
    """

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        # jupyter_client >= 8.10 can give the kernel CurveZMQ keys (ipykernel >= 7.4 warns without them);
        # the trait refuses "auto" when pyzmq lacks Curve support, and then the kernel runs as before.
        if "transport_encryption" in self.trait_names():
            try:
                self.transport_encryption = "auto"
            except TraitError:
                pass

    @property
    def kernel_spec(self) -> KernelSpec:
        if self._kernel_spec is None:
            from ipykernel.kernelspec import get_kernel_dict

            spec = get_kernel_dict()  # what `ipykernel install` would write, argv[0] = sys.executable
            spec["argv"][0] = sys.executable
            names = set(KernelSpec.class_trait_names())
            self._kernel_spec = KernelSpec(**{k: v for k, v in spec.items() if k in names})
        return self._kernel_spec


def find_notebooks(root: str | Path = NOTEBOOKS_DIR, pattern: str = CHAPTER_PATTERN) -> list[Path]:
    """The chapter notebooks in ``root`` (``NN_name.ipynb``), sorted by name."""
    return sorted(Path(root).glob(pattern))


def execute(path: str | Path, out_dir: str | Path, parameters: dict | None = None, *,
            timeout: float | None = None, log_output: bool = False) -> Path:
    """Run the notebook at ``path`` on a fresh kernel; write the executed copy to ``out_dir/<name>``.

    The kernel's working directory is the notebook's folder (as in JupyterLab), and ``parameters``
    are injected after its ``parameters`` cell. ``timeout`` limits each cell, in seconds (None: no
    limit). Returns the executed notebook's path. Raises
    :class:`papermill.exceptions.PapermillExecutionError` if a cell fails; the executed copy, with the
    traceback in it, is written all the same.
    """
    import papermill

    path = Path(path).resolve()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    output = out_dir / path.name
    papermill.execute_notebook(
        str(path),
        str(output),
        parameters=dict(parameters or {}),
        kernel_name="python3",  # papermill wants a name; the manager below decides what actually starts
        kernel_manager_class=ThisInterpreterKernelManager,
        cwd=str(path.parent),
        progress_bar=False,
        log_output=log_output,
        execution_timeout=timeout,
        iopub_timeout=IOPUB_TIMEOUT_S,   # past it papermill raises: a slow cell's output is not a failed cell
    )
    return output


def render_html(ipynb: str | Path, out_dir: str | Path) -> Path:
    """Render an executed notebook as one standalone HTML page ``out_dir/<name>.html``; returns its path.

    The page needs no network (:mod:`mambalab.workbook.pages`): math as MathML, widgets as static HTML, and
    figures drawn by the plotly.js that :func:`mambalab.viz.notebook.setup` embedded in the notebook's outputs.
    """
    import nbformat

    from mambalab.workbook import pages

    ipynb = Path(ipynb)
    nb = nbformat.read(ipynb, as_version=4)
    return pages.write(nb, Path(out_dir) / f"{ipynb.stem}.html")


PLOTLY_MIMETYPE = "application/vnd.plotly.v1+json"
_EXTERNAL_PLOTLY = re.compile(r"""<script[^>]*\bsrc\s*=\s*["'][^"']*plotly[^"']*["']""", re.IGNORECASE)


def offline_figure_problems(ipynb: str | Path, page: str) -> list[str]:
    """Why the plotly figures of executed notebook ``ipynb`` would not display in its HTML ``page`` offline.

    An empty list means: plotly.js is not fetched from the network, and if there are figures, every one
    has an HTML form and plotly.js itself is embedded before the first of them.
    """
    from plotly.offline import get_plotlyjs

    problems = []
    if _EXTERNAL_PLOTLY.search(page):
        problems.append("the page loads plotly.js from the network")
    outputs = [o for c in json.loads(Path(ipynb).read_text(encoding="utf-8")).get("cells", [])
               for o in c.get("outputs", [])]
    html_only = [o for o in outputs if PLOTLY_MIMETYPE in o.get("data", {}) and "text/html" not in o["data"]]
    has_figure = any(PLOTLY_MIMETYPE in o.get("data", {}) for o in outputs) or "Plotly.newPlot" in page
    if html_only:
        problems.append(f"{len(html_only)} figure(s) have no HTML form, so the page cannot show them")
    if has_figure:
        library = page.find(get_plotlyjs()[:200])  # the bundle's opening, as the kernel embedded it
        first_figure = page.find("Plotly.newPlot")
        if library < 0 or (first_figure >= 0 and first_figure < library):
            problems.append("plotly.js is not embedded before the first figure")
    if problems:
        problems.append("call mambalab.viz.notebook.setup() in the notebook's first code cell")
    return problems


def title_of(ipynb: str | Path) -> str:
    """The notebook's first Markdown heading, or its file name."""
    cells = json.loads(Path(ipynb).read_text(encoding="utf-8")).get("cells", [])
    for cell in cells:
        if cell.get("cell_type") != "markdown":
            continue
        source = "".join(cell.get("source", []))
        for line in source.splitlines():
            if line.startswith("#"):
                return line.lstrip("#").strip()
    return Path(ipynb).stem


@dataclass
class Chapter:
    """One notebook's run: where its outputs went and whether it completed."""

    source: Path
    executed: Path | None = None
    html: Path | None = None
    seconds: float = 0.0
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


def run(notebooks: list[Path], out_dir: str | Path = BUILD_DIR, parameters: dict | None = None, *,
        timeout: float | None = None, echo=print) -> list[Chapter]:
    """Execute and render each notebook in turn, then write the index; returns one :class:`Chapter` each.

    A chapter fails if a cell raises, or if its figures would not display offline (see
    :func:`offline_figure_problems`); a failure does not stop the others. ``echo`` receives one progress
    line per notebook.
    """
    out_dir = Path(out_dir)
    chapters = []
    for i, path in enumerate(notebooks, 1):
        chapter = Chapter(source=Path(path))
        start = time.perf_counter()
        executed = out_dir / "notebooks" / chapter.source.name
        executed.unlink(missing_ok=True)  # never render a previous run's copy
        try:
            execute(path, out_dir / "notebooks", parameters, timeout=timeout)
        except Exception as err:  # the executed copy, with its traceback, is still worth rendering
            chapter.error = _one_line(err)
        if executed.exists():
            chapter.executed = executed
            try:
                chapter.html = render_html(executed, out_dir / "html")
            except Exception as err:
                chapter.error = chapter.error or f"rendering HTML failed: {_one_line(err)}"
            else:
                problems = offline_figure_problems(executed, chapter.html.read_text(encoding="utf-8"))
                chapter.error = chapter.error or ("; ".join(problems) if problems else None)
        chapter.seconds = time.perf_counter() - start
        status = "ok" if chapter.ok else f"FAILED: {chapter.error}"
        echo(f"[{i}/{len(notebooks)}] {chapter.source.name}  {chapter.seconds:.1f} s  {status}")
        chapters.append(chapter)
    write_index(chapters, out_dir)
    return chapters


def _one_line(err: Exception) -> str:
    lines = [line for line in str(err).splitlines() if line.strip()]
    # papermill's message ends with the exception raised in the cell, which is the informative part
    return f"{type(err).__name__}: {lines[-1] if lines else ''}"


def write_index(chapters: list[Chapter], out_dir: str | Path) -> Path:
    """``out_dir/index.html``: one row per chapter, linking its HTML page and executed notebook."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for c in chapters:
        title = html.escape(title_of(c.source))
        page = f'<a href="{html.escape(c.html.relative_to(out_dir).as_posix())}">{title}</a>' if c.html else title
        nb = (f'<a href="{html.escape(c.executed.relative_to(out_dir).as_posix())}">{html.escape(c.source.name)}</a>'
              if c.executed else html.escape(c.source.name))
        status = "ran" if c.ok else f'<span class="fail">failed: {html.escape(c.error)}</span>'
        rows.append(f"<tr><td>{page}</td><td>{nb}</td><td>{c.seconds:.1f} s</td><td>{status}</td></tr>")
    page = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>mambalab workbook</title>
<style>
body {{ font-family: system-ui, sans-serif; max-width: 60rem; margin: 2rem auto; padding: 0 1rem; }}
table {{ border-collapse: collapse; width: 100%; }}
td, th {{ border-bottom: 1px solid #ddd; padding: .4rem .6rem; text-align: left; }}
.fail {{ color: #b00020; }}
</style></head>
<body>
<h1>mambalab workbook</h1>
<p>Executed on {html.escape(_device_line())}, {time.strftime("%Y-%m-%d %H:%M")}.
Open a chapter's page below, or run <code>./run.sh lab</code> to work through the notebooks interactively.</p>
<table><tr><th>chapter</th><th>executed notebook</th><th>time</th><th>status</th></tr>
{chr(10).join(rows)}
</table>
</body></html>
"""
    index = out_dir / "index.html"
    index.write_text(page, encoding="utf-8")
    return index


def _device_line() -> str:
    from mambalab.device import device_info

    return device_info().describe()
