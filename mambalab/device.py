"""Where mambalab's kernels run: the one place that decides.

On a machine with a CUDA GPU, Triton kernels are compiled and run natively. Without one, they run on the
CPU through Triton's interpreter, which must be switched on (``TRITON_INTERPRET=1``) *before* triton is
imported; importing :mod:`mambalab` does that for you when no GPU is visible.

What the interpreter does differently (measured with triton 3.6):

* it runs the program instances of a grid one after another, in order (so atomics never race);
* bf16 arithmetic and bf16 ``tl.dot`` are silently wrong, so kernels must compute in fp32 on the CPU;
* ``tl.atomic_add`` on bf16 is unsupported;
* ``@triton.jit`` functions must live in files (not notebook cells);
* ``triton.runtime.driver.active.get_active_torch_device()`` fails without a GPU.

Kernels never ask "am I on a CPU?" themselves: they call :func:`compute_dtype`, :func:`interpreted` and
:func:`interpreter_active` from here.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import torch

from mambalab.validate import records_autograd

__all__ = [
    "DEVICE",
    "DeviceInfo",
    "compute_dtype",
    "device_info",
    "gpu_available",
    "interpreter_active",
    "interpreted",
    "ensure_kernel_device",
    "inference_kernels_apply",
]


def gpu_available() -> bool:
    """True when torch sees a CUDA device."""
    return torch.cuda.is_available()


def _switch_on_interpreter_if_needed() -> None:
    if gpu_available() or os.environ.get("TRITON_INTERPRET") == "1":
        return
    if "triton" in sys.modules:
        # Too late to switch: triton read its settings at import. Kernels would fail on CPU tensors
        # with an obscure driver error, so say what to do instead (raised when a kernel is launched).
        return
    os.environ["TRITON_INTERPRET"] = "1"


def _along(axis: int, k: int) -> tuple:
    """The index of position k along ``axis``, the axis kept (length 1)."""
    return (slice(None),) * axis + (slice(k, k + 1),)


def _fold_along(ops, datas: list, dtypes: list, axis: int, each=None) -> list:
    """Triton's interpreter's combine step (``ops.combine_fn``, a user-defined ``@triton.jit`` function) folded
    over ``datas``' ``axis`` in order, position 0 first, on whole slices across the other axes at once: the final
    accumulators, numpy arrays with the axis kept (length 1) in each input's dtype. ``each(k, acc)`` sees the
    accumulators after position k (a scan keeps them all)."""
    import numpy as np
    import triton.language as tl

    acc = [x[_along(axis, 0)] for x in datas]
    if each is not None:
        each(0, acc)
    for k in range(1, datas[0].shape[axis]):
        left = [ops.to_tensor(a, dt) for a, dt in zip(acc, dtypes)]
        right = [ops.to_tensor(x[_along(axis, k)], dt) for x, dt in zip(datas, dtypes)]
        ret = ops.combine_fn.fn(*left, *right)
        ret = ret if isinstance(ret, tuple) else (ret,)
        acc = [np.broadcast_to(r.handle.data if isinstance(r, tl.core.tensor) else r, a.shape).astype(a.dtype)
               for r, a in zip(ret, acc)]
        if each is not None:
            each(k, acc)
    return acc


def _vectorise_interpreter_scan() -> None:
    """Make the interpreter's ``tl.associative_scan`` step along the scanned axis, not element by element.

    Triton 3.6's interpreter runs a user-defined scan one element at a time in Python (tens of
    microseconds per element), which makes the selective scan unusably slow on a CPU. This replacement
    applies the same combine function in the same sequential order, to whole slices across the other
    axes at once, so the results are identical and ~100x faster. It patches only the interpreter (never
    compiled GPU code), and leaves triton untouched if its internals are not the ones expected.
    """
    try:
        import numpy as np
        from triton.runtime import interpreter as interp
    except Exception:  # pragma: no cover - triton missing or reorganised
        return
    scan_ops = getattr(interp, "ScanOps", None)
    if scan_ops is None or not hasattr(scan_ops, "generic_scan") or not hasattr(scan_ops, "to_tensor"):
        return

    def generic_scan(self, input):
        datas = [arg.handle.data for arg in input]
        dtypes = [arg.dtype for arg in input]
        outs = [np.empty_like(x) for x in datas]

        def keep(k, acc):
            for o, a in zip(outs, acc):
                o[_along(self.axis, k)] = a

        _fold_along(self, datas, dtypes, self.axis, keep)
        return [self.to_tensor(o, dt) for o, dt in zip(outs, dtypes)]

    scan_ops.generic_scan = generic_scan


def _vectorise_interpreter_reduce() -> None:
    """Make the interpreter's ``tl.reduce`` with a user-defined combine step along the reduced axis, not element
    by element.

    Triton 3.6's interpreter reduces with any combine but its own sum, min, max and argmin/argmax one element at a
    time in Python; ``tl.flip`` is such a reduction (an xor over a reshaped tile), and the selective scan's backward
    flips tiles in its loop over n. This replacement applies the same combine function in the same sequential
    order along the axis, to whole slices across the other axes at once, and stores each result in the input's
    dtype as the original does, so the results are identical. It patches only the interpreter (never compiled GPU
    code), and leaves triton untouched if its internals are not the ones expected.
    """
    try:
        from triton.runtime import interpreter as interp
    except Exception:  # pragma: no cover - triton missing or reorganised
        return
    reduce_ops = getattr(interp, "ReduceOps", None)
    if reduce_ops is None or not all(hasattr(reduce_ops, name) for name in ("generic_reduce", "unravel", "to_tensor")):
        return

    def generic_reduce(self, input):
        original_axis = self.axis
        input, axis = self.unravel(input, self.axis)   # axis None: the input flattened, axis 0
        dtypes = [arg.dtype for arg in input]
        acc = _fold_along(self, [arg.handle.data for arg in input], dtypes, axis)   # the axis kept, of length 1
        out = []
        for data, dt in zip(acc, dtypes):
            if original_axis is None:
                data = data if self.keep_dims else data.item()
            elif not self.keep_dims:
                data = data.squeeze(axis)
            out.append(self.to_tensor(data, dt))
        return out

    generic_reduce.__wrapped__ = reduce_ops.generic_reduce
    reduce_ops.generic_reduce = generic_reduce


def _patch_triton_language_once_a_launch() -> None:
    """Patch ``triton.language`` for a ``@triton.jit`` function called inside a kernel once a launch, not at every
    call.

    Triton 3.6's interpreter swaps triton.language's functions for interpreted ones when a launch starts, and again
    at every call of a jit function inside the kernel (``tl.sum``, ``tl.cumsum``, ``tl.flip`` and ``tl.sigmoid`` are
    such functions): each time it walks every member of triton.language, its tensor class and its math module,
    about a tenth of the selective scan's time on the CPU. A call's patch stays in force until the launch ends
    (nothing undoes it before), so a second call of the same function in the same launch would only set the same
    attributes again; it runs the function straight away instead. It patches only the interpreter (never compiled
    GPU code), and leaves triton untouched if its internals are not the ones expected.
    """
    try:
        from triton.runtime import interpreter as interp
    except Exception:  # pragma: no cover - triton missing or reorganised
        return
    executor, function = getattr(interp, "GridExecutor", None), getattr(interp, "InterpretedFunction", None)
    if executor is None or function is None or not hasattr(function, "rewrite") or not hasattr(interp, "_patch_lang"):
        return
    launch, call = executor.__call__, function.__call__
    patched: set = set()   # the jit functions whose patch is in force in the launch running now

    def run_launch(self, *args, **kwargs):
        patched.clear()
        try:
            return launch(self, *args, **kwargs)
        finally:
            patched.clear()

    def call_in_kernel(self, *args, **kwargs):
        if self.fn not in patched:
            patched.add(self.fn)
            return call(self, *args, **kwargs)
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise interp.InterpreterError(repr(e)) from e

    run_launch.__wrapped__, call_in_kernel.__wrapped__ = launch, call
    executor.__call__, function.__call__ = run_launch, call_in_kernel


def _build_interpreter_dtypes_once() -> None:
    """Remember the interpreter's numpy dtype for each Triton type instead of deriving it again.

    Triton 3.6's interpreter maps a Triton type to a numpy dtype (``_get_np_dtype``) on every operand of every
    operation, building a 19-entry table each time: about a sixth of a selective-scan test's time on the CPU. The
    mapping depends on the type alone, which its class and name identify (a block's name holds its shape and
    element type, a pointer's its element type; every pointer maps to uint64), so each type's answer is computed
    once by triton's own function and reused. It patches only the interpreter, and leaves triton untouched if its
    internals are not the ones expected.
    """
    try:
        from triton.runtime import interpreter as interp
    except Exception:  # pragma: no cover - triton missing or reorganised
        return
    derive = getattr(interp, "_get_np_dtype", None)
    if derive is None:
        return
    known: dict = {}

    def _get_np_dtype(tt_dtype):
        key = (type(tt_dtype), getattr(tt_dtype, "name", None))
        answer = known.get(key)
        if answer is None:
            known[key] = answer = derive(tt_dtype)
        return answer

    _get_np_dtype.__wrapped__ = derive
    interp._get_np_dtype = _get_np_dtype


_switch_on_interpreter_if_needed()
if os.environ.get("TRITON_INTERPRET") == "1":
    _vectorise_interpreter_scan()
    _vectorise_interpreter_reduce()
    _patch_triton_language_once_a_launch()
    _build_interpreter_dtypes_once()

#: The device that notebooks and examples put their tensors on.
DEVICE = torch.device("cuda" if gpu_available() else "cpu")


def interpreter_active() -> bool:
    """True when Triton kernels run through the CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def compute_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype a kernel should be fed on ``device`` for inputs of ``dtype``.

    On a GPU the inputs' own dtype (kernels accumulate in fp32 inside). On the CPU interpreter, fp32:
    its bf16/fp16 arithmetic is wrong.
    """
    if device.type == "cuda":
        return dtype
    return torch.float32


def interpreted(device: torch.device) -> bool:
    """Whether a kernel launched on ``device`` runs in Triton's interpreter (a CPU tensor). A launcher may then
    take larger tiles where the tile changes only how many programs the interpreter walks one after another,
    never the order of a sum (so never a result's bits): the interpreter's cost is per program and per
    operation, not per element. :func:`mambalab.aot.record_launches` answers False, as a GPU would."""
    return device.type == "cpu"


def dot_precision(dtype: torch.dtype, device: torch.device) -> str:
    """tl.dot's ``input_precision`` for operands of ``dtype`` on ``device``: the one rule every kernel uses.

    * On a GPU, "tf32" (Triton's default, and what mamba-ssm's kernels run with): fp32 operands go through
      the tensor cores at about 1e-3 relative error per product; bf16/fp16 operands are unaffected by it.
      IEEE fp32 ("ieee") there means FMA-based dots whose (p, n)-sized fp32 tiles spill heavily and take
      minutes to compile (benchmarks/ptxas_ssd.py shows it), so it is not offered.
    * On the CPU interpreter, "ieee": it computes in fp32 anyway, and the tests compare at fp32 tolerances.
    """
    return "tf32" if device.type == "cuda" else "ieee"


def inference_kernels_apply(x: torch.Tensor, *others: torch.Tensor | None) -> bool:
    """Whether a block runs its inference-only kernels (the decode steps, the gated norm's forward) on ``x``:
    on a GPU (on the CPU the PyTorch ops they replace are faster than Triton's interpreter; the kernels' own
    tests run them there), not in float64, and with nothing for autograd to record (they have no backward).
    ``others``: the parameters and inputs that would need gradients, None allowed."""
    return x.is_cuda and x.dtype != torch.float64 and not records_autograd(x, *others)


def ensure_kernel_device(device: torch.device) -> None:
    """Raise a clear error if Triton kernels cannot run on ``device`` in this process."""
    if device.type == "cuda":
        return
    if device.type != "cpu":
        raise ValueError(f"mambalab kernels run on CUDA or CPU tensors, got device {device}")
    if not interpreter_active():
        raise RuntimeError(
            "Triton kernels on CPU tensors need Triton's interpreter, but triton was imported before "
            "mambalab with TRITON_INTERPRET unset. Import mambalab first, or set TRITON_INTERPRET=1 "
            "in the environment before starting Python."
        )


@dataclass(frozen=True)
class DeviceInfo:
    """What the kernels will run on."""

    kind: str  # "cuda" or "cpu"
    name: str
    compute_capability: tuple[int, int] | None
    sm_count: int | None
    interpreter: bool

    def describe(self) -> str:
        if self.kind == "cuda":
            cc = ".".join(map(str, self.compute_capability or ()))
            return f"{self.name} (sm_{cc.replace('.', '')}, {self.sm_count} SMs), Triton compiled natively"
        return f"CPU ({self.name}), Triton kernels through the interpreter (TRITON_INTERPRET=1)"


def device_info(index: int | None = None) -> DeviceInfo:
    """Describe the device kernels run on (the current CUDA device, or the CPU)."""
    if gpu_available():
        index = torch.cuda.current_device() if index is None else index
        props = torch.cuda.get_device_properties(index)
        return DeviceInfo("cuda", props.name, (props.major, props.minor), props.multi_processor_count,
                          interpreter_active())
    import platform

    return DeviceInfo("cpu", platform.processor() or platform.machine(), None, None, interpreter_active())
