"""The norms' weight gradients, run once: mamba-ssm's RMS norms against mambalab's.

mamba-ssm's ``RMSNormGated`` (``ops/triton/layernorm_gated.py``) and ``RMSNorm`` (``ops/triton/layer_norm.py``)
backwards give each program a block of rows and sum the programs' weight-gradient partials with a final
``sum``; the number of programs comes from ``multi_processor_count``
(:func:`mambalab.determinism.mamba_ssm_splits.mamba_ssm_norm_split` gives that grouping).
:func:`norm_inputs` and :func:`norm_gradients` run one norm forward+backward (mamba-ssm's Triton kernels, or
mambalab's :func:`mambalab.modules.norm.rmsnorm_fn`), which under :func:`mambalab.determinism.emulate` reads the
emulated SM count, on a GPU and on the CPU interpreter alike.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch

from mambalab.determinism.mamba_ssm_splits import NORM_KINDS

__all__ = ["norm_gradients", "norm_inputs"]


def norm_inputs(rows: int, d: int, *, dtype=torch.float32, device="cpu", seed: int = 0) -> dict[str, torch.Tensor]:
    """Random inputs of a norm forward+backward: x, z, dout (rows, d) in ``dtype``, weight (d,) fp32 near 1."""
    gen = torch.Generator().manual_seed(seed)
    inp = {"x": torch.randn(rows, d, generator=gen), "z": torch.randn(rows, d, generator=gen),
           "weight": 1.0 + 0.1 * torch.randn(d, generator=gen), "dout": torch.randn(rows, d, generator=gen)}
    return {k: (v if k == "weight" else v.to(dtype)).to(device) for k, v in inp.items()}


def norm_gradients(inputs: Mapping[str, torch.Tensor], *, impl: str = "mamba_ssm", kind: str = "gated",
                   group_size: int | None = None, eps: float = 1e-5) -> dict[str, torch.Tensor]:
    """One RMS-norm forward+backward on ``inputs`` (from :func:`norm_inputs`): {"weight": dw, "x": dx}.

    kind "gated": y = rmsnorm_g(x) ⊙ w ⊙ silu(z) (norm before the gate, per group of ``group_size``
    channels); "plain": y = rmsnorm(x) ⊙ w. impl "mamba_ssm": mamba-ssm's Triton kernels
    (``layernorm_gated.rmsnorm_fn``, ``layer_norm.rms_norm_fn``); they read ``multi_processor_count``, so on a
    machine without a GPU call this inside :func:`mambalab.determinism.emulate`, which answers for the
    profile and lets the kernels run on Triton's interpreter. impl "mambalab":
    :func:`mambalab.modules.norm.rmsnorm_fn` (``z=None`` for "plain")."""
    if impl not in ("mambalab", "mamba_ssm"):
        raise ValueError(f"impl must be 'mambalab' or 'mamba_ssm'; got {impl!r}")
    if kind not in NORM_KINDS:
        raise ValueError(f"kind must be one of {NORM_KINDS}; got {kind!r}")
    x = inputs["x"].detach().requires_grad_()
    w = inputs["weight"].detach().requires_grad_()
    z = inputs["z"] if kind == "gated" else None
    if impl == "mambalab":
        from mambalab.modules.norm import rmsnorm_fn

        y = rmsnorm_fn(x, w, None, z=z, eps=eps, group_size=group_size, norm_before_gate=True)
    else:
        from mambalab import oracle

        if kind == "gated":
            y = oracle.module("ops.triton.layernorm_gated").rmsnorm_fn(x, w, None, z=z, eps=eps, group_size=group_size,
                                                                        norm_before_gate=True)
        else:
            y = oracle.module("ops.triton.layer_norm").rms_norm_fn(x, w, None, eps=eps)
    y.backward(inputs["dout"])
    return {"weight": w.grad, "x": x.grad}
