"""Shared benchmark plumbing: timing on the GPU, bit-pattern counting, and the environment record written
beside every result (machine and versions), so a JSON file says where its numbers came from."""
from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
from datetime import datetime, timezone
from pathlib import Path

import torch


def time_ms(fn, warmup: int = 5, rep: int = 30) -> float:
    """Median time of ``fn()`` in ms on the GPU (CUDA events via triton.testing.do_bench)."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def graph_ms(fn, warmup: int = 3) -> float:
    """Median time of ``fn()`` in ms with the host out of the way: run ``warmup`` times on a side stream
    (compiling, allocating), captured once in a CUDA graph, then the graph's replay timed by :func:`time_ms`.
    What the GPU takes for ``fn``'s kernels back to back, as a decoding loop or a training step captured in a
    graph would see it; ``fn`` must not synchronise with the host."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return time_ms(graph.replay, warmup=10, rep=100)


def add_precompile_arguments(parser) -> None:
    """``--precompile-rival N`` (the user's) and ``--compile-part i/N`` (what :func:`precompile_in_parallel`
    passes to each of its processes)."""
    import argparse

    parser.add_argument("--precompile-rival", type=int, default=0, metavar="N",
                        help="compile mamba-ssm's autotuned configurations in N processes before timing anything")
    parser.add_argument("--compile-part", help=argparse.SUPPRESS)


def precompile_in_parallel(script: str, argv: list[str], parts: int, extra_parts: tuple[str, ...] = ()) -> None:
    """Run ``script argv --compile-part i/parts`` for i < parts, all at once, and wait for them: each process
    compiles its slice of the rival's autotuned configurations (:func:`keep_config_slice`) into Triton's
    on-disk cache, so that the measuring process afterwards finds them compiled. Its autotuner still times
    every configuration and picks as shipped: only the compiling is spread over processes. Run it before
    timing anything (those processes run kernels on the GPU too). ``extra_parts``: more ``--compile-part``
    values, one process each, run beside those (what they compile is the script's to say)."""
    import subprocess
    import sys

    procs = [subprocess.Popen([sys.executable, script, *argv, "--compile-part", part])
             for part in [f"{i}/{parts}" for i in range(parts)] + list(extra_parts)]
    for proc in procs:
        proc.wait()


def keep_config_slice(module_prefix: str, part: str) -> None:
    """In this process, keep slice i of N (``part`` = "i/N") of the configurations of every Triton autotuner
    defined in the already imported modules whose names start with ``module_prefix``."""
    from mambalab import oracle

    i, parts = map(int, part.split("/"))
    for tuner in oracle.autotuners(module_prefix):
        if len(tuner.configs) > 1:
            tuner.configs = tuner.configs[i::parts] or [tuner.configs[i % len(tuner.configs)]]


def profile_table(fn, steps: int = 3, rows: int = 30) -> list[dict]:
    """Where ``fn``'s time goes: torch.profiler over ``steps`` calls (after one warm-up call), one row per
    operator or kernel name, sorted by the device time it took itself (CPU time without a GPU): its name,
    how many calls, and the totals per call of ``fn`` in ms. Kernel launches appear under their Triton or
    CUDA kernel names, PyTorch's own work under its aten operator and kernel names."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            fn()
        if cuda:
            torch.cuda.synchronize()
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    events = sorted(prof.key_averages(), key=lambda e: getattr(e, key), reverse=True)
    return [{"name": e.key, "calls_per_step": e.count / steps,
             "self_ms_per_step": getattr(e, key) / 1e3 / steps,
             "cpu_ms_per_step": e.cpu_time_total / 1e3 / steps}
            for e in events[:rows] if getattr(e, key) > 0]


def call_sites(fn, names: tuple[str, ...], steps: int = 1, depth: int = 6) -> list[dict]:
    """Where the operators ``names`` (``aten::fill_``) are called from in ``fn``: torch.profiler with Python stacks
    over ``steps`` calls (after one warm-up call), one row per operator and call site, largest first: the calls
    and the device time (CPU time without a GPU) a call of ``fn``, and the site, innermost first: up to ``depth``
    enclosing Python frames outside torch itself and, in a backward, the autograd node that ran it
    (``autograd::engine::evaluate_function: SplitWithSizesBackward0``)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities, with_stack=True) as prof:
        for _ in range(steps):
            fn()
        if cuda:
            torch.cuda.synchronize()
    rows = {}
    for e in prof.events():
        if e.name not in names:
            continue
        site, parent = [], e.cpu_parent
        while parent is not None and len(site) < depth:
            if parent.name in names:   # a fill inside a listed copy counts once, as the copy
                break
            if parent.name.startswith("autograd::engine") or (".py(" in parent.name and "torch/" not in parent.name):
                site.append(parent.name)
            parent = parent.cpu_parent
        else:
            row = rows.setdefault((e.name, tuple(site)), {"name": e.name, "site": site, "calls_per_step": 0.0,
                                                         "ms_per_step": 0.0})
            row["calls_per_step"] += 1 / steps
            row["ms_per_step"] += (e.device_time_total if cuda else e.cpu_time_total) / 1e3 / steps
    return sorted(rows.values(), key=lambda r: r["ms_per_step"], reverse=True)


def bits(t: torch.Tensor) -> str:
    """A hash of a tensor's exact bits (mambalab's fingerprint)."""
    from mambalab.determinism import fingerprint

    return fingerprint(t)


def distinct_patterns(runs: list[dict[str, torch.Tensor]]) -> dict[str, int]:
    """For repeated runs of named results, how many distinct bit patterns each name had."""
    return {k: len({bits(r[k]) for r in runs}) for k in runs[0]}


def commit() -> str | None:
    """The commit measured: ``MAMBALAB_COMMIT`` when set (the device tool sends the working tree without .git, so
    the command names it: ``MAMBALAB_COMMIT=$(git rev-parse --short HEAD)`` written out here), else git's HEAD
    where there is a checkout, else None."""
    if os.environ.get("MAMBALAB_COMMIT"):
        return os.environ["MAMBALAB_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=Path(__file__).resolve().parent).stdout.strip() or None
    except (OSError, subprocess.CalledProcessError):
        return None


def environment() -> dict:
    import triton

    from mambalab import device, oracle

    info = device.device_info()
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "device": info.name,
        "compute_capability": info.compute_capability,
        "sm_count": info.sm_count,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "mamba_ssm": oracle.version(),
        "python": platform.python_version(),
        "commit": commit(),
    }


def write(path: str | Path, payload: dict, quiet: bool = False) -> None:
    """``payload`` as JSON at ``path`` (its folder made); says so unless ``quiet`` (a partial write)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2) + "\n")
    if not quiet:
        print(f"wrote {path}")


def median(xs):
    return statistics.median(xs)
