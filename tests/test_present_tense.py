"""The text a reader meets speaks of the project in the present: what the code is and does, never the history of
its making (which lives in git). README.md, every notebook's cells, and every file under mambalab/ and
benchmarks/ (docstrings, comments, the measurement log) hold no "session N", "issue N", "the issue" or
"issue's"; a failure names each file and line."""
from pathlib import Path

import re

import nbformat

ROOT = Path(__file__).resolve().parents[1]
DIARY = re.compile(r"\bsessions? ?\d|\bissues? #?\d|\bthe issue\b|\bissue's|\bthe issues\b", re.IGNORECASE)
TEXT_SUFFIXES = {".py", ".md", ".sh", ".txt", ".toml", ".json", ".jsonl", ".j2", ".cfg", ".yml", ".yaml"}


def reader_facing_files() -> list[Path]:
    files = [ROOT / "README.md", *sorted((ROOT / "notebooks").glob("*.ipynb"))]
    for folder in ("mambalab", "benchmarks"):
        files += sorted(p for p in (ROOT / folder).rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES
                        and "__pycache__" not in p.parts)
    return files


def lines_of(path: Path) -> list[tuple[str, str]]:
    """(where, text) for every line a reader sees: a notebook's by cell and line, any other file's by line."""
    if path.suffix == ".ipynb":
        nb = nbformat.read(path, as_version=4)
        return [(f"cell {i} line {j}", line) for i, cell in enumerate(nb.cells)
                for j, line in enumerate(cell.source.splitlines(), 1)]
    return [(f"line {j}", line) for j, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)]


def diary_lines(path: Path) -> list[str]:
    return [f"{where}: {line.strip()[:120]}" for where, line in lines_of(path) if DIARY.search(line)]


def test_the_pattern_finds_diary_wording(tmp_path):
    sample = tmp_path / "sample.md"
    sample.write_text("fine line\nmeasured in session 12\nas the issue asks\nthe issue's shape\nsee issue 7\n"
                      "sessions 15-17 asked\nissue #4\nSession 3\nan issue of precision\n")
    assert [w for w in diary_lines(sample)] == [f"line {i}: {t}" for i, t in enumerate(
        ["measured in session 12", "as the issue asks", "the issue's shape", "see issue 7", "sessions 15-17 asked",
         "issue #4", "Session 3"], 2)]


def test_reader_facing_text_has_no_diary():
    found = [f"{path.relative_to(ROOT)}:{line}" for path in reader_facing_files() for line in diary_lines(path)]
    assert not found, (f"{len(found)} lines speak of sessions or issues (say it in a commit message instead):\n"
                       + "\n".join(found[:60]))
