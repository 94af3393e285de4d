"""The ``mambalab`` command (also ``python -m mambalab``).

    mambalab doctor [--json]       versions, device, determinism settings in force
    mambalab fingerprint [options] gradient fingerprint of a fixed Mamba-2 step, with the environment;
                                   --save FILE keeps its tensors, --compare A B finds the first difference;
                                   --model NAME: a mamba-ssm or transformers model's step, routed onto
                                   mambalab's kernels (--no-route: on its own)
    mambalab workbook [options]    execute every notebook headless into build/, render offline HTML
    mambalab train [options]       train a (tensor-parallel) Mamba-2 LM on a synthetic task; run it under
                                   torchrun for TP/DP (same flags as python -m mambalab.train)

Each subcommand only parses its arguments; the work lives in :mod:`mambalab.doctor`,
:mod:`mambalab.determinism.step` and :mod:`mambalab.workbook`.
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


def _fingerprint_compare(paths: list[str]) -> int:
    from mambalab.determinism import step

    try:
        a, b = (step.load_step(p) for p in paths)
    except ValueError as err:
        print(f"mambalab fingerprint: error: {err}", file=sys.stderr)
        return 2
    diff = step.first_difference(a, b)
    if diff is None:
        print(f"identical: {len(a['tensors'])} tensors of {paths[0]} and {paths[1]} have the same bits "
              f"(fingerprint {a['report'].get('fingerprint')})")
        return 0
    where = (f"element {list(diff['index'])}: {diff['a']!r} in {paths[0]}, {diff['b']!r} in {paths[1]}"
             if "index" in diff else diff["problem"])
    print(f"different: first difference in {diff['tensor']}, {where}")
    return 1


def _fingerprint(args: argparse.Namespace) -> int:
    from mambalab.determinism import step

    if args.compare:
        return _fingerprint_compare(args.compare)
    if args.model is None and (args.no_route or args.size):
        print("mambalab fingerprint: error: --no-route and --size apply to --model only", file=sys.stderr)
        return 2
    if args.model is not None and (args.reduction or args.simulate_schedule is not None):
        print("mambalab fingerprint: error: --reduction and --simulate-schedule apply to mambalab's own step, "
              "not to --model", file=sys.stderr)
        return 2
    with contextlib.redirect_stdout(sys.stderr):  # stdout for the report alone
        try:
            if args.model is not None:
                from mambalab.determinism import library_step

                report, tensors = library_step.run(args.model, routed=not args.no_route, size=args.size or "cpu",
                                                   seed=args.seed, emulate_profile=args.emulate,
                                                   return_tensors=True)
            else:
                report, tensors = step.run_step(seed=args.seed, reduction=args.reduction or "deterministic",
                                                emulate_profile=args.emulate, schedule_seed=args.simulate_schedule,
                                                return_tensors=True)
        except ValueError as err:
            print(f"mambalab fingerprint: error: {err}", file=sys.stderr)
            return 2
    if args.save:
        try:
            step.save_step(args.save, report, tensors)
        except OSError as err:
            print(f"mambalab fingerprint: error: cannot write {args.save}: {err.strerror or err}", file=sys.stderr)
            return 2
    print(json.dumps(report, indent=2) if args.json else step.format_report(report))
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


def _train(args: argparse.Namespace) -> int:
    from mambalab.train.cli import run_from_args

    return run_from_args(args, prog="mambalab train")


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

    from mambalab.determinism import ARCH_PROFILES

    p = sub.add_parser("fingerprint", help="fingerprint the gradients of a fixed Mamba-2 training step",
                       description="Run one fixed forward+backward step of a small Mamba-2 block from a fixed "
                                   "seed and print the fingerprint of its gradients (16 hex characters), with "
                                   "the GPU, its compute capability and SM count, library versions and the "
                                   "determinism settings. Two machines that print the same fingerprint "
                                   "computed the same bits.")
    p.add_argument("--seed", type=int, default=0, help="seed of parameters, input and target (default: 0)")
    p.add_argument("--reduction", choices=("atomic", "deterministic"),
                   help="deterministic: inside mambalab.determinism.deterministic(); atomic: the determinism "
                        "flags off and atomic reductions (default: deterministic)")
    p.add_argument("--emulate", choices=sorted(ARCH_PROFILES), metavar="GPU",
                   help="run under mambalab.determinism.emulate(GPU): one of " + ", ".join(sorted(ARCH_PROFILES)))
    p.add_argument("--simulate-schedule", type=int, metavar="SEED",
                   help="CPU interpreter only: run each launch's programs in a seeded shuffled order, a "
                        "SIMULATION of a GPU's scheduling (shows atomic reductions varying)")
    from mambalab.determinism.library_step import MODELS, SIZES

    p.add_argument("--model", choices=MODELS, metavar="MODEL",
                   help="instead of mambalab's block, one training step of a library's model as users build it "
                        "(default config), routed onto mambalab's kernels by mambalab.compat.use_mambalab_kernels: "
                        "one of " + ", ".join(MODELS))
    p.add_argument("--no-route", action="store_true",
                   help="with --model: run the library's own kernels (not routed), to see what they do")
    p.add_argument("--size", choices=sorted(SIZES),
                   help="with --model: cpu (small, for Triton's interpreter) or gpu (default: cpu)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--save", metavar="FILE",
                   help="also write the report and every gradient and the output (torch.save) to FILE, to "
                        "compare with another machine's")
    p.add_argument("--compare", nargs=2, metavar=("A", "B"),
                   help="compare two --save files instead of running: exit 0 if identical, 1 naming the first "
                        "tensor and element that differ, 2 if a file cannot be read")
    p.set_defaults(func=_fingerprint)

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

    from mambalab.train.cli import add_arguments as add_train_arguments

    p = sub.add_parser("train", help="train a (tensor-parallel) Mamba-2 LM on a synthetic task",
                       description="Train a small Mamba-2 language model on selective copying or MQAR. One "
                                   "process by default; under torchrun, --tp N splits it over N ranks and the "
                                   "remaining ranks are data parallel. Same flags as python -m mambalab.train.")
    add_train_arguments(p)
    p.set_defaults(func=_train)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
