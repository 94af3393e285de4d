"""The workbook as something to run and read: the chapters executed headless, their offline pages, the chapter
table.

* :mod:`~mambalab.workbook.build`: every chapter notebook through papermill on a fresh kernel, rendered as
  standalone HTML, with an index (``python -m mambalab workbook``, ``./run.sh workbook``). Its functions are
  this package's: :func:`run`, :func:`execute`, :func:`render_html`, :func:`find_notebooks`, …
* :mod:`~mambalab.workbook.pages`: an executed notebook as one HTML page that needs no network (math as MathML,
  widgets as static HTML, plotly.js embedded).
* :mod:`~mambalab.workbook.chapters`: the chapter table from the notebooks' metadata, which chapter 00 shows and
  the README holds (``python -m mambalab.workbook.chapters`` rewrites the README's copy).
"""
from mambalab.workbook.build import (BUILD_DIR, CHAPTER_PATTERN, NOTEBOOKS_DIR, PLOTLY_MIMETYPE, ROOT, Chapter,
                                     ThisInterpreterKernelManager, execute, find_notebooks, offline_figure_problems,
                                     render_html, run, title_of, write_index)

__all__ = ["BUILD_DIR", "CHAPTER_PATTERN", "NOTEBOOKS_DIR", "PLOTLY_MIMETYPE", "ROOT", "Chapter",
           "ThisInterpreterKernelManager", "execute", "find_notebooks", "offline_figure_problems", "render_html",
           "run", "title_of", "write_index"]
