"""Which SSD gradients vary between runs, batch compositions and emulated GPUs, and by how much.

:func:`ssd_gradients` runs one SSD forward+backward (mambalab's :func:`mambalab.ops.ssd_chunk_scan`, or
mamba-ssm's ``mamba_chunk_scan_combined`` on a GPU) on inputs from :func:`ssd_inputs` and returns the
gradients; :func:`gradient_variation` repeats any such step and tabulates, per gradient, the number of distinct
bit patterns and the largest difference from the first run. :func:`fingerprint_matrix` fingerprints row 0's
gradients and the batch-summed ones over emulated GPUs × batch sizes × runs (chapter 05);
:func:`time_ssd_fwd_bwd` times the step on a GPU; :func:`variation_in_subprocess` measures the variation in a
fresh process, for settings read once at import.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

__all__ = ["PER_ROW_GRADS", "SSD_GRAD_NAMES", "SUMMED_GRADS", "GradientVariation", "batch_with_row0",
           "fingerprint_matrix", "gradient_variation", "ssd_gradients", "ssd_inputs", "time_ssd_fwd_bwd",
           "variation_in_subprocess"]

SSD_GRAD_NAMES = ("x", "dt", "A", "B", "C", "D", "z", "dt_bias")


def ssd_inputs(b: int, l: int, h: int, p: int, g: int, n: int, *, dtype=torch.float32, device="cpu",
               seed: int = 0) -> dict[str, torch.Tensor]:
    """Random SSD inputs in ``mamba_chunk_scan_combined``'s layout (x, z (b, l, h, p); dt (b, l, h); A, D,
    dt_bias (h,); B, C (b, l, g, n)); x, z, B, C in ``dtype``, the rest fp32, and a cotangent ``dout``."""
    gen = torch.Generator().manual_seed(seed)
    act = lambda *s: torch.randn(*s, generator=gen).to(dtype)
    inp = {
        "x": act(b, l, h, p),
        "dt": (0.05 + 0.45 * torch.rand(b, l, h, generator=gen)).to(dtype),
        "A": -(0.5 + torch.rand(h, generator=gen)),
        "B": act(b, l, g, n),
        "C": act(b, l, g, n),
        "D": torch.randn(h, generator=gen),
        "z": act(b, l, h, p),
        "dt_bias": 0.1 * torch.randn(h, generator=gen),
        "dout": act(b, l, h, p),
    }
    return {k: v.to(device) for k, v in inp.items()}


def _mamba_ssm_chunk_scan():
    from mambalab import oracle

    return oracle.module("ops.triton.ssd_combined").mamba_chunk_scan_combined


def ssd_gradients(inputs: Mapping[str, torch.Tensor], chunk_size: int, *, impl: str = "mambalab",
                  reduction: str | None = "atomic") -> dict[str, torch.Tensor]:
    """One forward+backward of SSD on ``inputs`` (from :func:`ssd_inputs`): {name: gradient} for
    :data:`SSD_GRAD_NAMES`, from <out, dout>.

    impl: "mambalab" (:func:`mambalab.ops.ssd_chunk_scan` with ``reduction``) or "mamba_ssm"
    (``mamba_chunk_scan_combined``: needs a GPU; its own mode follows ``set_deterministic_mode``)."""
    if impl not in ("mambalab", "mamba_ssm"):
        raise ValueError(f"impl must be 'mambalab' or 'mamba_ssm'; got {impl!r}")
    leaves = {k: inputs[k].detach().requires_grad_() for k in SSD_GRAD_NAMES}   # fresh leaves, no copies
    args = [leaves[k] for k in ("x", "dt", "A", "B", "C")] + [chunk_size]
    kw = dict(D=leaves["D"], z=leaves["z"], dt_bias=leaves["dt_bias"], dt_softplus=True)
    if impl == "mambalab":
        from mambalab.ops import ssd_chunk_scan

        out = ssd_chunk_scan(*args, reduction=reduction, **kw)
    else:
        if inputs["x"].device.type != "cuda":
            raise RuntimeError("impl='mamba_ssm' needs CUDA tensors: mamba-ssm's Triton launchers call "
                               "torch.cuda.device(...) and cannot run on Triton's CPU interpreter")
        out = _mamba_ssm_chunk_scan()(*args, **kw)
    out.backward(inputs["dout"])
    return {k: v.grad for k, v in leaves.items()}


def time_ssd_fwd_bwd(inputs: Mapping[str, torch.Tensor], chunk_size: int, *, impl: str = "mambalab",
                     reduction: str | None = "deterministic", mamba_ssm_deterministic: bool | None = None,
                     warmup: int = 10, rep: int = 50) -> float:
    """Median time (ms, CUDA events via ``triton.testing.do_bench``) of one :func:`ssd_gradients` call: SSD
    forward+backward. GPU only. ``mamba_ssm_deterministic``: mamba-ssm's ``set_deterministic_mode`` while
    timing (None: leave it; an already-imported mamba-ssm keeps the autotune configurations it loaded with)."""
    import triton.testing

    if inputs["x"].device.type != "cuda":
        raise RuntimeError("time_ssd_fwd_bwd times on a GPU; the CPU interpreter's times say nothing about one")
    mode = None
    if impl == "mamba_ssm" and mamba_ssm_deterministic is not None:
        from mambalab import oracle

        mode = oracle.module("utils.determinism")
        mode.set_deterministic_mode(bool(mamba_ssm_deterministic))
    try:
        fn = lambda: ssd_gradients(inputs, chunk_size, impl=impl, reduction=reduction)
        return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))
    finally:
        if mode is not None:
            mode.set_deterministic_mode(None)


@dataclass(frozen=True)
class GradientVariation:
    """One row of :func:`gradient_variation`: a gradient's distinct bit patterns over the runs, and its largest
    elementwise difference from the first run (absolute, and relative to the first run's largest |value|)."""

    name: str
    shape: tuple[int, ...]
    runs: int
    distinct: int
    max_abs_diff: float
    max_rel_diff: float


def _bits_key(t: torch.Tensor) -> bytes:
    t = t.detach().contiguous().cpu()
    return t.view(torch.uint8).numpy().tobytes() if t.numel() else b""


def gradient_variation(step: Callable[[int], Mapping[str, torch.Tensor]], runs: int) -> list[GradientVariation]:
    """Call ``step(run)`` for run = 0 … runs-1 (each returns {name: tensor}, the same names every time) and
    tabulate, per name: distinct bit patterns, and max |t_run - t_0| over runs and elements."""
    if runs < 2:
        raise ValueError(f"runs must be at least 2 to compare runs; got {runs}")
    results = [dict(step(r)) for r in range(runs)]
    rows = []
    for name, first in results[0].items():
        patterns = {_bits_key(res[name]) for res in results}
        ref = first.detach().double().cpu()
        diff = max(float((res[name].detach().double().cpu() - ref).abs().max()) if ref.numel() else 0.0
                   for res in results)
        scale = float(ref.abs().max()) if ref.numel() else 0.0
        rows.append(GradientVariation(name, tuple(first.shape), runs, len(patterns), diff,
                                      diff / scale if scale > 0 else 0.0))
    return rows


PER_ROW_GRADS = ("x", "dt", "B", "C", "z")      # one slice per batch row
SUMMED_GRADS = ("A", "D", "dt_bias")            # summed over the batch rows


def batch_with_row0(inputs: Mapping[str, torch.Tensor], batch: int, seed: int) -> dict[str, torch.Tensor]:
    """``inputs``' row 0 followed by ``batch - 1`` fresh random rows (drawn from ``seed``); per-head tensors
    (A, D, dt_bias) kept. Row 0's gradients must not depend on what the other rows hold."""
    if batch < 1:
        raise ValueError(f"batch must be >= 1; got {batch}")
    _, l, h, p = inputs["x"].shape
    g, n = inputs["B"].shape[2:]
    others = ssd_inputs(batch - 1, l, h, p, g, n, dtype=inputs["x"].dtype, device=inputs["x"].device, seed=seed)
    return {k: (torch.cat([v[:1], others[k]]) if v.dim() > 1 else v) for k, v in inputs.items()}


def fingerprint_matrix(inputs: Mapping[str, torch.Tensor], chunk_size: int, *, profiles: Iterable[str],
                       batch_sizes: Iterable[int], runs: int, reduction: str,
                       simulate: bool) -> list[dict[str, object]]:
    """For every emulated profile × batch size × run, one SSD forward+backward of mambalab's op with
    ``reduction``, on row 0 of ``inputs`` plus batch-1 other rows (:func:`batch_with_row0`, seeded by the
    batch size). Returns one dict per call: profile, batch, run, ``row0`` (fingerprint of row 0's dx, ddt,
    dB, dC, dz) and ``summed`` (fingerprint of dA, dD, d dt_bias, which sum over the rows, so depend on
    the batch). simulate: run ``run`` under ``shuffled_program_order(run)`` (CPU interpreter only; a
    SIMULATION of a GPU's scheduling); on a GPU pass False, and the hardware orders the atomics."""
    from mambalab.determinism import emulate, fingerprint, shuffled_program_order

    rows = []
    for batch in batch_sizes:
        batch_inputs = batch_with_row0(inputs, batch, seed=1000 + batch)
        for profile in profiles:
            for run in range(runs):
                with emulate(profile), (shuffled_program_order(run) if simulate else contextlib.nullcontext()):
                    grads = ssd_gradients(batch_inputs, chunk_size, reduction=reduction)
                rows.append(dict(profile=profile, batch=batch, run=run,
                                 row0=fingerprint({k: grads[k][:1] for k in PER_ROW_GRADS}),
                                 summed=fingerprint({k: grads[k] for k in SUMMED_GRADS})))
    return rows


# ----------------------------------------------------------------------------------- a fresh process

_DTYPE_NAMES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def variation_in_subprocess(env: Mapping[str, str], *, impl: str, shape: Sequence[int], chunk_size: int,
                            runs: int, dtype: str = "fp32", device: str = "cuda", timeout: float = 600) -> dict:
    """:func:`gradient_variation` of :func:`ssd_gradients` in a fresh Python process whose environment adds
    ``env``: for variables read once, at import or at CUDA's start (``CUDA_LAUNCH_BLOCKING``,
    ``MAMBA_DETERMINISTIC``, ``TRITON_CACHE_AUTOTUNING``), which setting them in a running notebook would not
    reach. shape: (b, l, h, p, g, n). Returns {gradient name: distinct bit patterns over ``runs``}."""
    import json
    import os
    import subprocess
    import sys

    if dtype not in _DTYPE_NAMES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPE_NAMES)}; got {dtype!r}")
    spec = dict(impl=impl, shape=[int(s) for s in shape], chunk_size=int(chunk_size), runs=int(runs), dtype=dtype,
                device=device)
    child = "import sys; from mambalab.determinism.ssd_variation import _main; _main(sys.argv[1:])"
    proc = subprocess.run([sys.executable, "-c", child, json.dumps(spec)],
                          env={**os.environ, **{k: str(v) for k, v in env.items()}}, capture_output=True, text=True,
                          timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"the subprocess failed (rc={proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _main(argv: Sequence[str]) -> None:
    """The child of :func:`variation_in_subprocess`: argv[0] is the JSON spec; prints one JSON line,
    {gradient name: distinct bit patterns}."""
    import json

    spec = json.loads(argv[0])
    inputs = ssd_inputs(*spec["shape"], dtype=_DTYPE_NAMES[spec["dtype"]], device=spec["device"])
    rows = gradient_variation(lambda _r: ssd_gradients(inputs, spec["chunk_size"], impl=spec["impl"]), spec["runs"])
    print(json.dumps({r.name: r.distinct for r in rows}))
