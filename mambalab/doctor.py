"""What this environment runs mambalab with: versions, the device, and the settings that decide whether
results are reproducible. ``mambalab doctor`` prints it; tests and notebooks call :func:`collect`.

The state reported is the one in force *after* ``import mambalab``, which switches Triton's interpreter
on when no GPU is visible (see :mod:`mambalab.device`).
"""
from __future__ import annotations

import os
import platform
import sys
from importlib.metadata import PackageNotFoundError, version as _version

import torch

from mambalab import device, oracle

#: Environment variables that change what the kernels and libraries compute, or how reproducibly.
#: TRITON_F32_DEFAULT is ``tl.dot``'s input precision for fp32 operands where a kernel names none ("tf32",
#: "tf32x3", "ieee"), and TRITON_DEFAULT_FP_FUSION whether a multiply and an add may fuse into one rounding:
#: both read by triton 3.6's ``knobs.language_knobs`` and both able to change a Triton kernel's bits (mamba-ssm's
#: kernels name no precision; mambalab's pass ``input_precision`` explicitly).
ENV_VARS = ("CUBLAS_WORKSPACE_CONFIG", "MAMBA_DETERMINISTIC", "TRITON_CACHE_AUTOTUNING", "TRITON_DEFAULT_FP_FUSION",
            "TRITON_F32_DEFAULT", "TRITON_INTERPRET")


def _package_version(name: str) -> str | None:
    try:
        return _version(name)
    except PackageNotFoundError:
        return None


def _mamba_cuda_extension() -> tuple[bool | None, str | None]:
    """(available, error): None when mamba-ssm is not installed or fails to import."""
    if oracle.version() is None:
        return None, "mamba-ssm is not installed"
    try:
        return oracle.cuda_extension_available(), None
    except Exception as err:  # report it, whatever it is: doctor is where people look when imports break
        return None, f"{type(err).__name__}: {err}"


def collect() -> dict:
    """Everything ``mambalab doctor`` reports, as a JSON-serialisable dict.

    Imports mamba_ssm (a few seconds) to find out whether its CUDA extension is built.
    """
    import mambalab

    info = device.device_info()
    cuda_ext, cuda_ext_error = _mamba_cuda_extension()
    return {
        "versions": {
            "python": platform.python_version(),
            "python_executable": sys.executable,
            "mambalab": mambalab.__version__,
            "torch": torch.__version__,
            "torch_cuda": torch.version.cuda,
            "triton": _package_version("triton"),
            "mamba_ssm": oracle.version(),
        },
        "mamba_ssm_cuda_extension": cuda_ext,
        "mamba_ssm_error": cuda_ext_error,
        "device": {
            "kind": info.kind,
            "name": info.name,
            "compute_capability": list(info.compute_capability) if info.compute_capability else None,
            "sm_count": info.sm_count,
            "gpu_count": torch.cuda.device_count() if torch.cuda.is_available() else 0,
            "description": info.describe(),
        },
        "triton_interpreter": device.interpreter_active(),
        "determinism": {
            "torch_deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
            "cuda_matmul_allow_tf32": torch.backends.cuda.matmul.allow_tf32,
            "cudnn_allow_tf32": torch.backends.cudnn.allow_tf32,
            "cudnn_deterministic": torch.backends.cudnn.deterministic,
        },
        "env": {name: os.environ.get(name) for name in ENV_VARS},
    }


def _fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, (list, tuple)):
        return ".".join(map(str, value))
    return str(value)


def format_report(report: dict) -> str:
    """The human-readable form of :func:`collect`'s dict: one ``name: value`` line each, by section."""
    v, dev = report["versions"], report["device"]
    ext = report["mamba_ssm_cuda_extension"]
    ext_text = {True: "built", False: "missing (mambalab.oracle stands in; CUDA-only ops raise)",
                None: f"unknown ({report['mamba_ssm_error']})"}[ext]
    sections = {
        "versions": [
            ("python", f"{v['python']} ({v['python_executable']})"),
            ("mambalab", v["mambalab"]),
            ("torch", v["torch"] + (f" (CUDA {v['torch_cuda']})" if v["torch_cuda"] else " (no CUDA)")),
            ("triton", v["triton"]),
            ("mamba-ssm", v["mamba_ssm"]),
            ("mamba-ssm CUDA extension", ext_text),
        ],
        "device": [
            ("device", dev["description"]),
            ("name", dev["name"]),
            ("compute capability", dev["compute_capability"]),
            ("SM count", dev["sm_count"]),
            ("GPUs visible", dev["gpu_count"]),
            ("Triton interpreter", report["triton_interpreter"]),
        ],
        "determinism": [
            ("torch deterministic algorithms", report["determinism"]["torch_deterministic_algorithms"]),
            ("torch.backends.cuda.matmul.allow_tf32", report["determinism"]["cuda_matmul_allow_tf32"]),
            ("torch.backends.cudnn.allow_tf32", report["determinism"]["cudnn_allow_tf32"]),
            ("torch.backends.cudnn.deterministic", report["determinism"]["cudnn_deterministic"]),
        ],
        "environment": [(name, value) for name, value in report["env"].items()],
    }
    width = max(len(name) for rows in sections.values() for name, _ in rows)
    lines = []
    for title, rows in sections.items():
        lines.append(f"{title}:")
        lines.extend(f"  {name:<{width}}  {_fmt(value)}" for name, value in rows)
    return "\n".join(lines)
