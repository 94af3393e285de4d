"""The chapter table has one source, the notebooks' metadata: the README's copy is current, chapter 00 shows it
from there, and a notebook that lacks its entry is an error, not a missing row."""
from pathlib import Path

import nbformat
import pytest

from mambalab.workbook import chapters

ROOT = Path(__file__).resolve().parents[1]


def test_every_chapter_has_a_summary_and_a_status():
    entries = chapters.chapters()
    names = sorted(p.name for p in (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    assert [e.notebook for e in entries] == names
    assert all(e.title and e.summary and e.status for e in entries)


def test_readme_table_is_the_notebooks_table():
    assert chapters.main(["--check"]) == 0, "run python -m mambalab.workbook.chapters to rewrite README.md's chapter table"
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    for entry in chapters.chapters():
        assert entry.status.replace("|", "\\|") in readme


def test_chapter_00_shows_the_table_from_the_package():
    nb = nbformat.read(ROOT / "notebooks" / "00_welcome.ipynb", as_version=4)
    assert any(c.cell_type == "code" and "chapters.show()" in c.source for c in nb.cells)
    # and holds no table of its own that could disagree
    assert not any(c.cell_type == "markdown" and "| status |" in c.source for c in nb.cells)


def _notebook(path: Path, meta: dict | None, title: str = "# A title") -> None:
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell(title)]
    if meta is not None:
        nb.metadata["mambalab"] = meta
    nbformat.write(nb, path)


def test_table_rows_come_from_metadata(tmp_path):
    _notebook(tmp_path / "00_a.ipynb", {"summary": "first | with a bar", "status": "runs on CPU"})
    _notebook(tmp_path / "01_b.ipynb", {"summary": "second", "status": "runs on an H200"}, title="## Second")
    (tmp_path / "scratch.ipynb").write_text("{}")
    table = chapters.markdown_table(chapters.chapters(tmp_path)).splitlines()
    assert table[2:] == ["| 00 | **A title**: first \\| with a bar | runs on CPU |",
                         "| 01 | **Second**: second | runs on an H200 |"]


def test_a_notebook_without_its_entry_is_an_error(tmp_path):
    _notebook(tmp_path / "00_a.ipynb", {"summary": "first"})
    with pytest.raises(ValueError, match="00_a.ipynb.*status"):
        chapters.chapters(tmp_path)


def test_readme_table_replaced_between_markers_only():
    text = f"intro\n{chapters.BEGIN}\nold table\n{chapters.END}\noutro\n"
    assert chapters.readme_with_table(text, "NEW") == f"intro\n{chapters.BEGIN}\nNEW\n{chapters.END}\noutro\n"
    with pytest.raises(ValueError, match="markers"):
        chapters.readme_with_table("no markers here", "NEW")
