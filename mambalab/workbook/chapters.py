"""The workbook's chapters as their notebooks describe themselves: the one source of the chapter table that
chapter 00 shows and the README holds.

Each notebook's metadata carries ``"mambalab": {"summary": …, "status": …}``: what the chapter teaches, in one
line, and where it has run. :func:`chapters` reads them (the title is the notebook's first heading),
:func:`markdown_table` writes the table, and ``python -m mambalab.workbook.chapters`` rewrites the README's copy between
its markers (``--check`` only says whether it is current; a test runs that check).
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS_DIR = ROOT / "notebooks"
README = ROOT / "README.md"
BEGIN = "<!-- chapter table: written by `python -m mambalab.workbook.chapters` from the notebooks' metadata -->"
END = "<!-- end of chapter table -->"


@dataclass(frozen=True)
class ChapterEntry:
    """One chapter: its number (``"01"``), notebook file name, title (its first heading, without the number),
    one-line summary and status."""

    number: str
    notebook: str
    title: str
    summary: str
    status: str


def _title(cells: list[dict], fallback: str) -> str:
    for cell in cells:
        if cell.get("cell_type") == "markdown":
            for line in "".join(cell.get("source", [])).splitlines():
                if line.startswith("#"):
                    return line.lstrip("#").strip()
    return fallback


def chapters(root: str | Path = NOTEBOOKS_DIR) -> list[ChapterEntry]:
    """Every ``NN_name.ipynb`` in ``root``, in order. A notebook without ``summary`` or ``status`` in its
    ``mambalab`` metadata is a ValueError naming it: the table must not silently lose a row."""
    entries = []
    for path in sorted(Path(root).glob("[0-9][0-9]_*.ipynb")):
        nb = json.loads(path.read_text(encoding="utf-8"))
        meta = nb.get("metadata", {}).get("mambalab", {})
        missing = [k for k in ("summary", "status") if not str(meta.get(k, "")).strip()]
        if missing:
            raise ValueError(f"{path.name}: metadata 'mambalab' lacks {' and '.join(missing)} "
                             "(the chapter table is made from it)")
        title = _title(nb.get("cells", []), path.stem).removeprefix(f"{path.name[:2]} · ")   # the number has its column
        entries.append(ChapterEntry(path.name[:2], path.name, title,
                                    meta["summary"].strip(), meta["status"].strip()))
    return entries


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def markdown_table(entries: list[ChapterEntry] | None = None) -> str:
    """The chapter table as Markdown: number, title with its summary, status."""
    entries = chapters() if entries is None else entries
    rows = ["| | chapter | status |", "|---|---|---|"]
    rows += [f"| {e.number} | **{_cell(e.title)}**: {_cell(e.summary)} | {_cell(e.status)} |" for e in entries]
    return "\n".join(rows)


def show() -> None:
    """Display the chapter table in a notebook (as Markdown, so exported pages render it too)."""
    from IPython.display import Markdown, display

    display(Markdown(markdown_table()))


def readme_with_table(text: str, table: str) -> str:
    """``text`` (the README) with the part between :data:`BEGIN` and :data:`END` replaced by ``table``."""
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise ValueError(f"README.md has no chapter table markers ({BEGIN!r} … {END!r})")
    return text[:start + len(BEGIN)] + "\n" + table + "\n" + text[end:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mambalab.workbook.chapters",
                                     description="Rewrite the README's chapter table from the notebooks' metadata.")
    parser.add_argument("--check", action="store_true", help="only say whether the README's table is current")
    args = parser.parse_args(argv)
    try:
        text = README.read_text(encoding="utf-8")
        current = readme_with_table(text, markdown_table())
    except ValueError as err:
        print(f"mambalab.workbook.chapters: error: {err}", file=sys.stderr)
        return 2
    if args.check:
        if current != text:
            print("README.md's chapter table differs from the notebooks' metadata: run python -m mambalab.workbook.chapters",
                  file=sys.stderr)
            return 1
        return 0
    if current != text:
        README.write_text(current, encoding="utf-8")
        print("README.md: chapter table rewritten")
    return 0


if __name__ == "__main__":
    sys.exit(main())
