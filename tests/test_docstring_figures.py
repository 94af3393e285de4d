"""A docstring or comment under mambalab/ that gives a time (ms or µs) names the file that records the figure,
on the same line: its JSON file under benchmarks/results/, or benchmarks/results/README.md (the results log) by
path where the log's entry has no JSON file. The story of how a choice was measured lives in that log and in
git; a constant keeps one line of reason.
mambalab/viz (datasheet figures) and mambalab/exercises (the chapters' answers) are outside the check."""
from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SKIPPED = ("mambalab/viz/", "mambalab/exercises/")
TIME = re.compile(r"\d\s?(?:ms|µs|us)\b")
SOURCE = re.compile(r"\.json\b|benchmarks/results/README\.md")


def prose_lines(text: str) -> dict[int, str]:
    """Line number -> text of every docstring line (any bare string statement) and every comment."""
    lines = text.splitlines()
    found = {}
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            for i in range(node.lineno, node.end_lineno + 1):
                found[i] = lines[i - 1]
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.COMMENT:
            found[tok.start[0]] = tok.string
    return found


def unsourced_figures(text: str) -> list[tuple[int, str]]:
    return [(i, line.strip()) for i, line in sorted(prose_lines(text).items())
            if TIME.search(line) and not SOURCE.search(line)]


def test_the_check_finds_unsourced_times():
    sample = '''"""Module docstring.

Forward 0.45 ms against 0.49 at 4 warps, then 0.41
at 8 (2026-11-30_h200_x.json): 10.0 µs.
benchmarks/results/README.md, 2026-12-01: 1.1 ms a call.
The results log, 2026-12-01: 1.2 ms a call, a name but not a file.
"""
LABEL = "took 3 ms"        # a string in code is not prose
x = f"{1.5:.1f} ms"


def f():
    """One line: 2.5 ms, no source."""
    return 1   # 4 us a call
'''
    assert [i for i, _ in unsourced_figures(sample)] == [3, 6, 13, 14]


def test_package_prose_names_the_source_of_every_time():
    found = []
    for path in sorted((ROOT / "mambalab").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith(SKIPPED):
            continue
        found += [f"{rel}:{i}: {line[:110]}" for i, line in unsourced_figures(path.read_text(encoding="utf-8"))]
    assert not found, (f"{len(found)} docstring or comment lines give a time without its JSON file or "
                       "benchmarks/results/README.md on the same line (one line of reason per constant; the story "
                       "goes to benchmarks/results/README.md):\n" + "\n".join(found))
