"""The fixed training step behind ``mambalab fingerprint``: same seed, same model, same bits expected.

One forward and backward of a small :class:`mambalab.modules.Mamba2` block, always the same size so that
fingerprints compare across machines (:data:`STEP_SIZE`: b=2, l=64, d_model=32, so h=4 heads of p=16, one
group, n=16, chunks of q=16), with fp32 parameters and activations. Parameters and inputs are drawn on the
CPU from ``seed`` and then moved to the device, so every machine starts from the same bits:

    u ~ N(0, 1) (b, l, d_model),   target ~ N(0, 1) (b, l, d_model)
    loss = mean((Mamba2(u) - target)²),   then loss.backward()

:func:`run_step` returns the fingerprint of every parameter's gradient (and of them all, in order), of the
output and the loss, with the environment that produced them.

Which fingerprints can agree: the SSD kernels compute in fp32 on both, but their ``tl.dot`` precision is
the device layer's rule (:func:`mambalab.device.dot_precision`: TF32 tensor cores on a GPU, exact fp32
through numpy on the CPU interpreter); ``exp``/``log`` implementations differ too, and torch's matmuls
(in_proj, out_proj) use cuBLAS on one and a CPU BLAS on the other. So a CPU fingerprint is expected to match
other CPU fingerprints, not a GPU's. Between GPUs, mambalab's deterministic kernels remove every difference
that comes from software reading the hardware (SM count, autotuning, atomics); equal fingerprints on two GPU
models then show that their arithmetic (special functions, tensor-core accumulation, cuBLAS's kernel choice
for the architecture) agreed too, and different ones that it did not, which
:func:`mambalab.determinism.emulate` cannot show.
"""
from __future__ import annotations

import contextlib
import json
import os
import platform
from importlib.metadata import PackageNotFoundError, version as _version

import torch

from mambalab import device
from mambalab.determinism import autotune
from mambalab.determinism.arch import emulate, get_profile
from mambalab.determinism.fingerprint import fingerprint
from mambalab.determinism.schedule import shuffled_program_order
from mambalab.determinism.switch import REDUCTIONS, Settings, deterministic

__all__ = ["STEP_SIZE", "format_report", "run_step", "save_step", "load_step", "first_difference"]

#: The one fixed size of the step (fingerprints only compare at the same size).
STEP_SIZE = dict(batch=2, seqlen=64, d_model=32, d_state=16, headdim=16, expand=2, ngroups=1, chunk_size=16)


def _version_of(name: str) -> str | None:
    try:
        return _version(name)
    except PackageNotFoundError:
        return None


#: Triton's environment variables that change the bits of mambalab's own kernels: TRITON_DEFAULT_FP_FUSION decides
#: whether a multiply and an add fuse into one rounding in every kernel that does not set enable_fp_fusion (none of
#: mambalab's does; triton/backends/nvidia/compiler.py), TRITON_F32_DEFAULT tl.dot's precision where a kernel passes
#: none (mambalab's pass one; mamba-ssm's do not). Two machines compared bit for bit must agree on them.
TRITON_BIT_ENV = ("TRITON_DEFAULT_FP_FUSION", "TRITON_F32_DEFAULT")


def environment() -> dict:
    """The real machine (never an emulated one), the library versions and :data:`TRITON_BIT_ENV`'s values."""
    import mambalab

    info = device.device_info()
    return {
        "device": info.describe(),
        "gpu_name": info.name if info.kind == "cuda" else None,
        "compute_capability": list(info.compute_capability) if info.compute_capability else None,
        "sm_count": info.sm_count,
        "triton_interpreter": device.interpreter_active(),
        "versions": {"python": platform.python_version(), "torch": torch.__version__, "torch_cuda": torch.version.cuda,
                     "triton": _version_of("triton"), "mamba_ssm": _version_of("mamba-ssm"),
                     "mambalab": mambalab.__version__},
        "triton_env": {name: os.environ.get(name) for name in TRITON_BIT_ENV},
    }


def _step(seed: int, reduction: str, dev: torch.device) -> tuple[dict, dict]:
    from mambalab.modules import Mamba2

    s = STEP_SIZE
    torch.manual_seed(seed)  # Mamba2's and nn.Linear's initialisation draw from the global CPU generator
    model = Mamba2(s["d_model"], d_state=s["d_state"], headdim=s["headdim"], expand=s["expand"],
                   ngroups=s["ngroups"], chunk_size=s["chunk_size"], reduction=reduction).to(dev)
    gen = torch.Generator().manual_seed(seed + 1)
    u = torch.randn(s["batch"], s["seqlen"], s["d_model"], generator=gen).to(dev)        # (b, l, d_model)
    target = torch.randn(s["batch"], s["seqlen"], s["d_model"], generator=gen).to(dev)   # (b, l, d_model)
    out = model(u)
    loss = (out - target).square().mean()
    loss.backward()
    loss = float(loss.detach())
    tensors = {f"grad/{name}": p.grad.detach().cpu().clone() for name, p in model.named_parameters()}
    tensors["output"] = out.detach().cpu().clone()
    return tensors, {
        "fingerprint": fingerprint(model, grads=True),
        "parameters": {name: fingerprint(p.grad) for name, p in model.named_parameters()},
        "output": fingerprint(out),
        "loss": loss,
        "loss_hex": loss.hex(),
    }


def run_step(seed: int = 0, reduction: str = "deterministic", emulate_profile: str | None = None,
             schedule_seed: int | None = None, return_tensors: bool = False):
    """Run the fixed step; return its fingerprints (``fingerprint``: all the gradients, in order; also each
    parameter's gradient, the output and the loss) with the environment and the settings, JSON-friendly.

    Args:
        seed: draws parameters, input and target (on the CPU, so every machine starts from the same bits).
        reduction: "deterministic" runs inside :func:`mambalab.determinism.deterministic` (every switch
            setting on); "atomic" inside ``deterministic(False)`` (the determinism flags off, atomics).
        emulate_profile: a key of :data:`mambalab.determinism.ARCH_PROFILES` to run under ``emulate()``.
        schedule_seed: CPU interpreter only: run under ``shuffled_program_order(schedule_seed)`` (a
            SIMULATION of a GPU's program order).
        return_tensors: return ``(report, tensors)``, tensors being every gradient (``grad/NAME``) and the
            output on the CPU, for :func:`save_step`.

    Raises:
        ValueError/TypeError naming the argument, before anything runs.
    """
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative int; got {seed!r}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}; got {reduction!r}")
    profile = get_profile(emulate_profile) if emulate_profile is not None else None
    if schedule_seed is not None and not device.interpreter_active():
        raise ValueError("schedule_seed simulates program order on the CPU interpreter; on a GPU the hardware's "
                         "own order is used (leave it out)")
    env = environment()
    dev = device.DEVICE
    with contextlib.ExitStack() as stack:
        stack.enter_context(deterministic(reduction == "deterministic"))
        if profile is not None:
            stack.enter_context(emulate(profile))
        if schedule_seed is not None:
            stack.enter_context(shuffled_program_order(schedule_seed))
        settings = Settings.capture().as_dict()
        settings["autotune"] = autotune.policy()
        tensors, result = _step(seed, reduction, dev)
    report = {
        **result,
        "seed": seed,
        "reduction": reduction,
        "emulated": profile.describe() if profile is not None else None,
        "emulated_profile": profile.key if profile is not None else None,
        "schedule_simulation_seed": schedule_seed,
        "size": dict(STEP_SIZE),
        "kernel_dtype": "float32",
        "dot_precision": device.dot_precision(torch.float32, dev),
        "device": str(dev),
        "environment": env,
        "settings": settings,
    }
    return (report, tensors) if return_tensors else report


def format_report(report: dict) -> str:
    """The human-readable form of :func:`run_step`'s dict."""
    env, v = report["environment"], report["environment"]["versions"]
    lines = [
        f"gradient fingerprint: {report['fingerprint']}",
        f"output fingerprint:   {report['output']}",
        f"loss:                 {report['loss']!r} ({report['loss_hex']})",
        "per-parameter gradient fingerprints:",
        *(f"  {name:<20} {fp}" for name, fp in report["parameters"].items()),
        "step:",
    ]
    if "model" in report:   # a library model's step (mambalab.determinism.library_step)
        lines += [f"  {report['model']}, seed {report['seed']}, on "
                  f"{'mambalab kernels (use_mambalab_kernels)' if report['routed'] else 'its own kernels'}, "
                  f"on {report['device']}",
                  "  shape " + ", ".join(f"{k}={val}" for k, val in report["shape"].items())]
    else:
        lines += [f"  seed {report['seed']}, reduction {report['reduction']}, kernels in {report['kernel_dtype']} "
                  f"(tl.dot precision {report['dot_precision']}) on {report['device']}",
                  "  size " + ", ".join(f"{k}={val}" for k, val in report["size"].items())]
    lines.append(f"  emulated GPU: {report['emulated'] or 'none'}")
    if report.get("schedule_simulation_seed") is not None:
        lines.append(f"  program order: SIMULATED GPU scheduling, seed {report['schedule_simulation_seed']} "
                     "(CPU interpreter, shuffled program order)")
    lines += [
        "environment:",
        f"  device: {env['device']}",
        f"  compute capability: {'.'.join(map(str, env['compute_capability'])) if env['compute_capability'] else '-'}",
        f"  SM count: {env['sm_count'] if env['sm_count'] is not None else '-'}",
        "  versions: " + ", ".join(f"{k} {val}" for k, val in v.items() if val is not None),
        "  Triton's bit-changing settings: " + ", ".join(f"{k}={'unset' if val is None else val}"
                                                          for k, val in env.get("triton_env", {}).items()),
        "determinism settings in force:",
        *(f"  {k}: {'-' if val is None else val}" for k, val in report["settings"].items()),
    ]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------- saved fingerprints
def save_step(path, report: dict, tensors: dict[str, torch.Tensor]) -> None:
    """Write ``{"report": report, "tensors": {name: tensor}}`` with ``torch.save`` (tensors on the CPU, in a
    fixed order: every parameter's gradient in ``named_parameters()`` order as ``grad/NAME``, then ``output``)."""
    # the report as JSON text: plain data that torch.load(weights_only=True) reads back
    torch.save({"report": json.dumps(report), "tensors": {k: v.detach().cpu() for k, v in tensors.items()}}, path)


def load_step(path) -> dict:
    """A file :func:`save_step` wrote; ValueError naming the file if it is missing, unreadable or not one."""
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise ValueError(f"{path}: no such file") from None
    except Exception as e:   # a truncated or foreign file: torch says RuntimeError, EOFError, UnpicklingError …
        raise ValueError(f"{path}: not a saved fingerprint ({type(e).__name__})") from None
    if not isinstance(data, dict) or not isinstance(data.get("tensors"), dict) or "report" not in data:
        raise ValueError(f"{path}: not a saved fingerprint (expected the report and the tensors of "
                         f"mambalab fingerprint --save)")
    return {"report": json.loads(data["report"]), "tensors": data["tensors"]}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The elements' raw bits as integers (so -0.0 differs from 0.0, and NaN payloads count)."""
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.contiguous().reshape(-1).view(ints)


def first_difference(a: dict, b: dict) -> dict | None:
    """None if the two saved steps hold the same tensors bit for bit; else the first difference, in ``a``'s
    tensor order: ``{"tensor": name, "index": (i, j, …), "a": value, "b": value}``, or ``{"tensor": name,
    "problem": text}`` for a tensor that is missing or has another dtype or shape."""
    ta, tb = a["tensors"], b["tensors"]
    for name in list(ta) + [n for n in tb if n not in ta]:
        if name not in ta or name not in tb:
            return {"tensor": name, "problem": f"only in {'the first' if name in ta else 'the second'} file"}
        x, y = ta[name], tb[name]
        if x.dtype != y.dtype or x.shape != y.shape:
            return {"tensor": name, "problem": f"{x.dtype} {tuple(x.shape)} vs {y.dtype} {tuple(y.shape)}"}
        differ = (_bits(x) != _bits(y)).nonzero()
        if len(differ):
            flat = int(differ[0])
            index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), x.shape)) if x.dim() else ()
            return {"tensor": name, "index": index, "a": x.reshape(-1)[flat].item(), "b": y.reshape(-1)[flat].item()}
    return None
