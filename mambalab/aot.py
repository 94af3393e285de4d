"""Ahead-of-time compilation of recorded kernel launches for a GPU architecture, on a machine without a GPU.

Why: on a CPU, mambalab's kernels run through Triton's interpreter, which executes a kernel's Python and
never compiles it. Code that Triton's compiler frontend rejects can pass every CPU test and fail on the GPU:
a module global written ``LOG2E: tl.constexpr = 1.44`` (instead of ``LOG2E = tl.constexpr(1.44)``) runs in
the interpreter and is a NameError for the compiler. The compiler itself needs no GPU: given a target such as
sm_90 it lowers a kernel to PTX and, with the ptxas it ships, to a cubin. What it needs is what a launch
would give it: each argument's type and specialisation, the constexpr values, num_warps and num_stages.

How, in two processes (Triton decides when a kernel's module is imported whether its ``@triton.jit``
functions are interpreted or compiled, so one process cannot do both):

1. :func:`record_launches`, interpreter on: calls a function (say an op's forward and backward) with every
   kernel launch *recorded instead of run*, as a :class:`Launch`. Arguments are specialised by Triton's
   own launcher code, as a GPU launch would specialise them: the type of each (``*bf16``, ``i32``, ...),
   which are divisible by 16 (16-byte aligned pointers, integers), which become constexprs (an integer
   equal to 1, None). Kernels are fed what a GPU would feed them: the device layer's rules
   (:func:`mambalab.device.compute_dtype`, :func:`mambalab.device.dot_precision`) answer as for a CUDA
   tensor, so bf16 stays bf16 (on the CPU it is widened to fp32) and fp32 dots use tf32.
   Nothing runs, so the function's results are garbage: record the launches, not the values.
2. :func:`compile_launch`, interpreter off: compiles one launch for an architecture and returns Triton's
   compiled kernel (``.asm["ptx"]``, ``.asm["cubin"]``, ``.metadata``). Its process must set
   ``TRITON_INTERPRET=0`` and import triton *before* mambalab (otherwise :mod:`mambalab.device` switches
   the interpreter on). :func:`compile_in_subprocess` starts such a process from one with the interpreter
   on, compiles a list of launches there, and returns each one's outcome (Triton's error, if any).

:func:`ptxas_usage` runs the ptxas shipped with Triton on compiled PTX for its registers and spills;
:func:`sass` also lists the machine code ptxas made.

Used by ``tests/test_aot_compile.py`` (every kernel compiles for sm_90) and by ``benchmarks/ptxas_ssd.py``
and ``benchmarks/ptxas_report.py`` (registers and spills before spending GPU time), and by
``benchmarks/sass_mamba3_step.py`` (the machine code, counted).
"""
from __future__ import annotations

import dataclasses
import importlib
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable, NamedTuple

import torch
import triton
from triton.backends.compiler import GPUTarget

from mambalab import device

__all__ = ["Compiled", "Launch", "PtxasUsage", "compile_in_subprocess", "compile_launch", "ptxas_usage",
           "record_launches", "sass"]


@dataclasses.dataclass(frozen=True)
class Launch:
    """One kernel launch as Triton's compiler needs it: everything but the argument values and the grid."""

    module: str                   # the module defining the kernel, e.g. "mambalab.kernels.reduce"
    name: str                     # the @triton.jit function's name in it, e.g. "sum_partials_kernel"
    signature: dict[str, str]     # every parameter: a Triton type ("*bf16", "i32", "fp32", "u1") or "constexpr"
    constexprs: dict[str, Any]    # the value of every "constexpr" parameter (declared, or specialised: 1, None)
    attrs: dict[str, str]         # the launcher's specialisation of the other parameters: "D" divisible by 16
    options: dict[str, Any]       # the launch's options: num_warps, num_stages, ... (Triton's defaults if absent)

    @property
    def kernel(self) -> str:
        return f"{self.module}.{self.name}"

    @property
    def divisible(self) -> list[str]:
        """The parameters marked divisible by 16."""
        return [name for name, spec in self.attrs.items() if "D" in spec]

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> Launch:
        return cls(**data)

    def key(self) -> str:
        """Equal for launches that compile to the same code."""
        return json.dumps(self.to_json(), sort_keys=True)


def _specialiser(fn, jit_kwargs: dict):
    """Triton's launcher's binder for ``fn`` (what ``JITFunction.run`` calls): (arguments, specialisation,
    options) for a launch's arguments, specialised as for a CUDA GPU (the same for every architecture)."""
    from triton.compiler import make_backend
    from triton.runtime.jit import KernelParam, create_function_from_signature

    signature = inspect.signature(fn)
    no_spec = jit_kwargs.get("do_not_specialize") or ()
    no_align = jit_kwargs.get("do_not_specialize_on_alignment") or ()
    params = [KernelParam(i, p, i in no_spec or p.name in no_spec, i in no_align or p.name in no_align)
              for i, p in enumerate(signature.parameters.values())]
    return create_function_from_signature(signature, params, make_backend(GPUTarget("cuda", 90, 32)))


def record_launches(fn: Callable, *args, **kwargs) -> list[Launch]:
    """Call ``fn(*args, **kwargs)`` with every Triton kernel launch recorded instead of run, and the device
    layer answering as for a GPU; return the distinct launches in the order they were first made.

    Needs Triton's interpreter (a process where mambalab switched it on: a machine without a GPU, or
    ``TRITON_INTERPRET=1``). The launches' outputs are never written, so whatever ``fn`` computes from them
    is garbage; a kernel launched only after a data-dependent branch may be missed or replaced.
    """
    if not device.interpreter_active():
        raise RuntimeError("record_launches needs Triton's interpreter (TRITON_INTERPRET=1, set by mambalab on a "
                           "machine without a GPU): with it off, kernels would be compiled and run")
    from triton.runtime.interpreter import InterpretedFunction

    launches: dict[str, Launch] = {}
    binders: dict[Callable, Callable] = {}

    def run(self, *a, grid, warmup, **kw):
        binder = binders.get(self.fn) or binders.setdefault(self.fn, _specialiser(self.fn, self.kwargs))
        bound, specialisation, options = binder(*a, **kw)
        names = list(bound)
        if any(isinstance(v, tuple) for v in bound.values()):
            raise NotImplementedError(f"{self.fn.__name__}: tuple arguments are not recorded")
        launch = Launch(
            module=self.fn.__module__, name=self.fn.__name__,
            signature={k: ty for k, (ty, _) in zip(names, specialisation)},
            constexprs={k: bound[k] for k, (ty, _) in zip(names, specialisation) if ty == "constexpr"},
            attrs={k: spec for k, (ty, spec) in zip(names, specialisation) if ty != "constexpr" and spec},
            options=dict(options))
        launches.setdefault(launch.key(), launch)

    gpu = torch.device("cuda")
    patches = [(InterpretedFunction, "run", run),
               (device, "compute_dtype", lambda dtype, _dev, rule=device.compute_dtype: rule(dtype, gpu)),
               (device, "dot_precision", lambda dtype, _dev, rule=device.dot_precision: rule(dtype, gpu)),
               (device, "interpreted", lambda _dev: False)]
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    try:
        for owner, name, value in patches:
            setattr(owner, name, value)
        fn(*args, **kwargs)
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)
    return list(launches.values())


def compile_launch(launch: Launch, arch: int = 90):
    """Compile ``launch`` with Triton's compiler for ``sm_{arch}``; returns Triton's ``CompiledKernel``
    (``.asm["ttir"|"ttgir"|"llir"|"ptx"|"cubin"]``, ``.metadata``: shared memory, num_warps, ...).

    Raises what Triton raises (``triton.compiler.CompilationError`` for an error in the kernel's source).
    Needs the interpreter off in this process: ``TRITON_INTERPRET=0`` and triton imported before mambalab.
    """
    kernel = getattr(importlib.import_module(launch.module), launch.name)
    if not isinstance(kernel, triton.runtime.JITFunction):
        raise RuntimeError(f"{launch.kernel} is a {type(kernel).__name__}, not a JITFunction: it was imported with "
                           "Triton's interpreter on. Set TRITON_INTERPRET=0 and import triton before mambalab "
                           "(or use compile_in_subprocess)")
    target = GPUTarget("cuda", arch, 32)
    backend = triton.compiler.make_backend(target)
    index = {name: (i,) for i, name in enumerate(kernel.arg_names)}
    src = triton.compiler.ASTSource(
        fn=kernel, signature=launch.signature,
        constexprs={index[k]: v for k, v in launch.constexprs.items()},
        attrs={index[k]: backend.parse_attr(spec) for k, spec in launch.attrs.items()})
    return triton.compile(src, target=target, options=launch.options)


@dataclasses.dataclass(frozen=True)
class Compiled:
    """What :func:`compile_in_subprocess` brings back for one launch."""

    launch: Launch
    error: str | None          # Triton's exception and message, or None when it compiled
    seconds: float             # wall time of triton.compile (PTX and cubin)
    shared: int | None         # shared memory in bytes
    ptx: str | None            # the PTX, when asked for
    loops: int | None = None          # scf.for loops left in the kernel's TTGIR (unrolled ones are gone)
    async_copies: int | None = None   # loads the software pipeliner turned into asynchronous copies: a kernel
                                      # with loops and none waits on each iteration's loads in turn


# The child's script. triton comes first: with it imported, mambalab.device leaves TRITON_INTERPRET=0 alone.
_CHILD = "import sys, triton; from mambalab import aot; aot._compile_files(*sys.argv[1:])"


def compile_in_subprocess(launches: list[Launch], arch: int = 90, *, keep_ptx: bool = False,
                          cache_dir: str | os.PathLike | None = None) -> list[Compiled]:
    """Compile each launch for ``sm_{arch}`` in one fresh Python process with the interpreter off, from a
    process where it may be on; one :class:`Compiled` per launch, in order. A launch that fails to compile
    comes back with its error; only a crash of the process itself raises.

    The child imports the same mambalab as this process (its directory goes first on PYTHONPATH).
    ``cache_dir`` sets its TRITON_CACHE_DIR: a fresh directory makes it compile rather than reuse Triton's
    cache of earlier compilations. ``keep_ptx`` brings back each PTX (for :func:`ptxas_usage`).
    """
    import mambalab

    checkout = str(Path(mambalab.__file__).resolve().parent.parent)
    env = dict(os.environ, TRITON_INTERPRET="0",
               PYTHONPATH=os.pathsep.join(filter(None, [checkout, os.environ.get("PYTHONPATH")])))
    if cache_dir is not None:
        env["TRITON_CACHE_DIR"] = str(cache_dir)
    with tempfile.TemporaryDirectory() as tmp:
        job, result = Path(tmp) / "launches.json", Path(tmp) / "compiled.json"
        job.write_text(json.dumps({"arch": arch, "keep_ptx": keep_ptx,
                                   "launches": [launch.to_json() for launch in launches]}))
        # cwd too: `python -c` puts the working directory first on sys.path, ahead of PYTHONPATH
        child = subprocess.run([sys.executable, "-c", _CHILD, str(job), str(result)], env=env, cwd=checkout,
                               capture_output=True, text=True)
        if child.returncode or not result.exists():
            raise RuntimeError(f"the compiling process failed (exit {child.returncode}):\n{child.stderr[-4000:]}")
        outcomes = json.loads(result.read_text())
    return [Compiled(launch, **outcome) for launch, outcome in zip(launches, outcomes)]


def _compile_files(job: str, result: str) -> None:
    """The child of :func:`compile_in_subprocess`: compile the launches in ``job``, write outcomes to ``result``."""
    spec = json.loads(Path(job).read_text())
    outcomes = []
    for data in spec["launches"]:
        start = time.perf_counter()
        try:
            kernel = compile_launch(Launch.from_json(data), spec["arch"])
        except Exception as e:   # noqa: BLE001  (any failure is the launch's outcome, reported to the caller)
            outcomes.append({"error": "".join(traceback.format_exception_only(e)).strip(),
                             "seconds": time.perf_counter() - start, "shared": None, "ptx": None})
            continue
        ttgir = kernel.asm["ttgir"]
        outcomes.append({"error": None, "seconds": time.perf_counter() - start, "shared": kernel.metadata.shared,
                         "ptx": kernel.asm["ptx"] if spec["keep_ptx"] else None,
                         "loops": ttgir.count("scf.for "), "async_copies": ttgir.count("async_copy_global_to_local")})
    Path(result).write_text(json.dumps(outcomes))


class PtxasUsage(NamedTuple):
    """Registers a thread and bytes spilled to local memory, as ptxas reports them."""

    registers: int
    spilled: int

    def __str__(self) -> str:
        return f"{self.registers:4d} registers, {self.spilled:5d} bytes spilled"


def _assemble(ptx: str, arch: int, tmp: str) -> tuple[PtxasUsage, Path]:
    """Assemble ``ptx`` in the folder ``tmp`` with the ptxas that ships with Triton, verbose, for ``sm_{arch}``
    (sm_90a for 90, as Triton compiles for it): its register and spill counts, and the cubin's path."""
    from triton.backends.nvidia.compiler import get_ptxas

    suffix = "a" if arch == 90 else ""
    path, cubin = Path(tmp) / "k.ptx", Path(tmp) / "k.cubin"
    path.write_text(ptx)
    res = subprocess.run([get_ptxas(arch).path, f"-arch=sm_{arch}{suffix}", "-v", str(path), "-o", str(cubin)],
                         capture_output=True, text=True, check=True)
    regs = re.search(r"Used (\d+) registers", res.stderr)
    spill = re.search(r"(\d+) bytes spill stores", res.stderr)
    return PtxasUsage(int(regs.group(1)), int(spill.group(1))), cubin


def ptxas_usage(ptx: str, arch: int = 90) -> PtxasUsage:
    """Assemble ``ptx`` with the ptxas that ships with Triton, verbose, for ``sm_{arch}`` (sm_90a for 90, as
    Triton compiles for it) and read its register and spill counts. No GPU needed."""
    with tempfile.TemporaryDirectory() as tmp:
        return _assemble(ptx, arch, tmp)[0]


def sass(ptx: str, arch: int = 90) -> tuple[PtxasUsage, str]:
    """:func:`ptxas_usage`'s counts and the machine code (SASS) ptxas made, as the cuobjdump that ships beside
    Triton's ptxas lists it. No GPU needed."""
    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as tmp:
        usage, cubin = _assemble(ptx, arch, tmp)
        cuobjdump = Path(get_ptxas(arch).path).with_name("cuobjdump")
        listing = subprocess.run([str(cuobjdump), "-sass", str(cubin)], capture_output=True, text=True,
                                 check=True).stdout
    return usage, listing
