"""A SIMULATION of GPU scheduling on the CPU: run a Triton launch's programs in a seeded shuffled order.

On a GPU, the programs of a launch run concurrently and finish in an order nobody chooses; when several of
them ``tl.atomic_add`` into the same address, the floating-point sum is formed in that order, and since
(a + b) + c ≠ a + (b + c) in floating point, its last bits change from run to run. Triton's CPU interpreter
runs programs one after another in grid order (x, then y, then z), so the same kernel on a CPU always
gives the same bits and the effect cannot be seen.

``with shuffled_program_order(seed):`` makes the interpreter run the programs of every launch in a random
order, drawn from ``seed`` and the launch's position in the block (launch k of a block gets the k-th
permutation; the same seed replays the same orders). Each program still runs exactly once and sees its
own ``tl.program_id``; only the order changes. A kernel whose result depends on that order (atomics into
a shared address) now gives different bits for different seeds, as it would on a GPU from run to run; a
kernel that writes per-program partials and sums them in a fixed order (mambalab's
``reduction="deterministic"``) gives the same bits for every seed.

This is a simulation, and is labelled so wherever it is used: the orders are uniform random permutations,
not a model of any GPU's scheduler (real GPUs run many programs at once, and their atomics are performed by
the memory system), and it changes nothing on a GPU, where the hardware's own order is used.

How: the interpreter's grid loop calls ``interpreter_builder.set_grid_dim`` once per launch, then
``set_grid_idx(x, y, z)`` before each program. Inside the block both are wrapped on that object: the first
draws a permutation of the launch's programs, the second maps the loop's k-th program to the permutation's
k-th. Like :func:`mambalab.device._vectorise_interpreter_scan`, it patches only the interpreter and checks
that triton's internals are the ones expected (else it raises, naming what is missing).
"""
from __future__ import annotations

import contextlib
import random
from typing import Iterator

from mambalab import device

__all__ = ["shuffled_program_order", "program_order_log"]


def _builder():
    if not device.interpreter_active():
        raise RuntimeError("shuffled_program_order simulates scheduling on Triton's CPU interpreter, which is "
                           "not active (a GPU is present, or TRITON_INTERPRET is unset): on a GPU the "
                           "hardware's own order is used")
    from triton.runtime import interpreter

    builder = getattr(interpreter, "interpreter_builder", None)
    for attr in ("set_grid_dim", "set_grid_idx"):
        if builder is None or not callable(getattr(builder, attr, None)):
            raise RuntimeError(f"shuffled_program_order needs triton.runtime.interpreter.interpreter_builder."
                               f"{attr}, which this Triton version lacks")
    return builder


_log: list[list[tuple[int, int, int]]] | None = None


def program_order_log() -> list[list[tuple[int, int, int]]] | None:
    """Inside ``shuffled_program_order(seed, record=True)``: the program ids each launch ran, in the order
    they ran (one list per launch). None otherwise."""
    return _log


@contextlib.contextmanager
def shuffled_program_order(seed: int, *, record: bool = False) -> Iterator[None]:
    """SIMULATION (CPU interpreter only): run the programs of every Triton launch in the block in a seeded
    shuffled order (see the module docstring).

    Args:
        seed: an int; the same seed gives the same orders for the same sequence of launches.
        record: keep the order each launch ran in, readable with :func:`program_order_log` inside the block.

    Raises:
        RuntimeError: if Triton's interpreter is not active (on a GPU the hardware's own order is used).
    """
    global _log
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int; got {seed!r}")
    builder = _builder()
    had = {attr: attr in builder.__dict__ for attr in ("set_grid_dim", "set_grid_idx")}
    outer_dim, outer_idx = builder.set_grid_dim, builder.set_grid_idx
    launches = 0
    state = {"dims": (1, 1, 1), "perm": [0]}
    old_log, _log = _log, ([] if record else _log)

    def set_grid_dim(nx, ny, nz):
        nonlocal launches
        perm = list(range(nx * ny * nz))
        random.Random(f"{seed}:{launches}").shuffle(perm)
        launches += 1
        state["dims"], state["perm"] = (nx, ny, nz), perm
        if record:
            _log.append([])
        outer_dim(nx, ny, nz)

    def set_grid_idx(x, y, z):
        _, ny, nz = state["dims"]
        k = state["perm"][(x * ny + y) * nz + z]  # the loop's k-th program runs the permutation's k-th
        x, y, z = k // (ny * nz), (k // nz) % ny, k % nz
        if record:
            _log[-1].append((x, y, z))
        outer_idx(x, y, z)

    builder.set_grid_dim, builder.set_grid_idx = set_grid_dim, set_grid_idx
    try:
        yield
    finally:
        for attr, outer in (("set_grid_dim", outer_dim), ("set_grid_idx", outer_idx)):
            if had[attr]:
                setattr(builder, attr, outer)
            else:
                builder.__dict__.pop(attr, None)
        _log = old_log
