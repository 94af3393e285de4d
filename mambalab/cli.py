"""The ``mambalab`` command (also ``python -m mambalab``).

    mambalab doctor [--json]       versions, device, determinism settings in force
    mambalab workbook [options]    execute every notebook headless into build/, render offline HTML

Each subcommand only parses its arguments; the work lives in :mod:`mambalab.doctor` and
:mod:`mambalab.workbook`.
"""
from __future__ import annotations

import argparse
import ast
import contextlib
import json
import sys
from pathlib import Path


def _doctor(args: argparse.Namespace) -> int:
    from mambalab import doctor

    # Keep stdout for the report alone (so --json output parses) even if an import prints something.
    with contextlib.redirect_stdout(sys.stderr):
        report = doctor.collect()
    print(json.dumps(report, indent=2) if args.json else doctor.format_report(report))
    return 0


def _parameter(text: str) -> tuple[str, object]:
    """``key=value``; the value is a Python literal if it parses as one (1, 0.5, True, None, "x"), else a string."""
    key, sep, value = text.partition("=")
    if not sep or not key.isidentifier():
        raise argparse.ArgumentTypeError(f"expected key=value with a Python name as key, got {text!r}")
    try:
        return key, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return key, value


def _workbook(args: argparse.Namespace) -> int:
    from mambalab import workbook

    notebooks = workbook.find_notebooks(args.notebooks)
    if args.only:
        notebooks = [p for p in notebooks if any(p.name.startswith(prefix) for prefix in args.only)]
    if not notebooks:
        wanted = f" starting with {', '.join(args.only)}" if args.only else ""
        print(f"no notebooks matching {workbook.CHAPTER_PATTERN}{wanted} in {args.notebooks}", file=sys.stderr)
        return 2
    out = Path(args.output_dir)
    print(f"executing {len(notebooks)} notebook(s) from {args.notebooks} into {out}/ "
          f"(a fresh kernel each, {sys.executable})", flush=True)
    chapters = workbook.run(notebooks, out, dict(args.parameter),
                            timeout=args.timeout, echo=lambda line: print(line, flush=True))
    print()
    print(f"executed notebooks: {out / 'notebooks'}/")
    print(f"HTML (works offline): {out / 'html'}/   index: {out / 'index.html'}")
    print("to work through the notebooks interactively: ./run.sh lab")
    failed = [c for c in chapters if not c.ok]
    if failed:
        print(f"\n{len(failed)} notebook(s) failed:", file=sys.stderr)
        for c in failed:
            where = f" (see {c.html or c.executed})" if (c.html or c.executed) else ""
            print(f"  {c.source.name}: {c.error}{where}", file=sys.stderr)
        return 1
    return 0


def build_parser() -> argparse.ArgumentParser:
    from mambalab import workbook

    parser = argparse.ArgumentParser(
        prog="mambalab", description="mambalab: a Jupyter workbook on Mamba state-space models.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("doctor", help="print versions, the device and the determinism settings in force",
                       description="Print versions (python, torch, triton, mamba-ssm and whether its CUDA "
                                   "extension is built), the device kernels run on, and the settings that "
                                   "affect reproducibility.")
    p.add_argument("--json", action="store_true", help="print the same as JSON")
    p.set_defaults(func=_doctor)

    p = sub.add_parser("workbook", help="execute the notebooks headless and render them as offline HTML",
                       description="Execute every notebooks/NN_*.ipynb on a fresh kernel with papermill, "
                                   "write the executed notebooks and standalone HTML pages into the output "
                                   "folder, and an index.html linking them. Exits non-zero if any fails.")
    p.add_argument("--only", action="append", metavar="PREFIX",
                   help="run only notebooks whose name starts with PREFIX, e.g. --only 01 (repeatable)")
    p.add_argument("--output-dir", default=str(workbook.BUILD_DIR), metavar="DIR",
                   help="where notebooks/, html/ and index.html go (default: %(default)s)")
    p.add_argument("--notebooks", default=str(workbook.NOTEBOOKS_DIR), metavar="DIR",
                   help="folder holding the notebooks (default: %(default)s)")
    p.add_argument("-p", "--parameter", action="append", type=_parameter, default=[], metavar="KEY=VALUE",
                   help="override a value of every notebook's parameters cell (repeatable); VALUE is read "
                        "as a Python literal when it is one, else as a string")
    p.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                   help="fail a notebook if one cell runs longer than this (default: no limit)")
    p.set_defaults(func=_workbook)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
