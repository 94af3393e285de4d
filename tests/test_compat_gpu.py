"""On a GPU: mambalab's fused Mamba-2 entry point against mamba-ssm's own (its Triton SSD, its gated-norm kernel,
the causal_conv1d package's CUDA conv), and the routed library models' bits over runs and emulated GPUs.

mamba-ssm's mamba_split_conv1d_scan_combined needs the causal_conv1d package (its CUDA extension); without it
those tests skip, saying so. benchmarks/gpu_run.sh builds it from its sdist (step ``ccd-ext``)."""
from __future__ import annotations

import importlib.util

import pytest
import torch

from mambalab import oracle
from mambalab.determinism import library_step
from mambalab.ops import mamba_split_conv1d_scan_combined

from test_compat import _rel

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
needs_causal_conv1d = pytest.mark.skipif(importlib.util.find_spec("causal_conv1d") is None,
                                         reason="mamba-ssm's fused path needs the causal_conv1d package")


@needs_causal_conv1d
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 3e-3), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("rmsnorm", [True, False])
def test_fused_entry_point_matches_mamba_ssm_on_a_gpu(dtype, tol, rmsnorm):
    theirs_fn = oracle.module("ops.triton.ssd_combined").mamba_split_conv1d_scan_combined
    torch.manual_seed(0)
    b, l, h, p, g, n, width = 2, 1024, 16, 64, 2, 64, 4
    d = h * p
    dev = "cuda"
    r = lambda *s, scale=1.0: (torch.randn(*s, device=dev) * scale).to(dtype).requires_grad_()
    args = dict(zxbcdt=r(b, l, 2 * d + 2 * g * n + h), conv1d_weight=r(d + 2 * g * n, width, scale=0.5),
                conv1d_bias=r(d + 2 * g * n, scale=0.1),
                dt_bias=(torch.rand(h, device=dev) - 2).requires_grad_(),
                A=(-torch.rand(h, device=dev) - 0.5).requires_grad_(), D=torch.randn(h, device=dev).requires_grad_(),
                rmsnorm_weight=r(d) if rmsnorm else None, outproj_weight=r(512, d, scale=0.05))
    kw = dict(chunk_size=128, headdim=p, ngroups=g, norm_before_gate=False)
    mine = mamba_split_conv1d_scan_combined(**args, **kw)
    with oracle.single_config(smallest=True):
        theirs = theirs_fn(**args, **kw)
    assert _rel(mine, theirs) < tol
    grad = torch.randn_like(mine)
    leaves = [v for v in args.values() if v is not None]
    for name, a, c in zip([k for k, v in args.items() if v is not None], torch.autograd.grad(mine, leaves, grad),
                          torch.autograd.grad(theirs, leaves, grad)):
        assert _rel(a, c) < 3 * tol, name


@pytest.mark.parametrize("model", library_step.MODELS)
def test_routed_library_models_repeat_bit_for_bit_on_a_gpu(model):
    first = library_step.run(model)["fingerprint"]
    assert library_step.run(model)["fingerprint"] == first
    assert {library_step.run(model, emulate_profile=p)["fingerprint"] for p in ("rtx4090", "rtxa6000")} == {first}


@needs_causal_conv1d
@pytest.mark.parametrize("model", library_step.MODELS)
def test_routed_library_models_match_their_own_kernels_within_rounding_on_a_gpu(model):
    """Routed against the library's own default path (mamba-ssm's fused kernels, transformers' kernel path)."""
    _, mine = library_step.run(model, size="gpu", return_tensors=True)
    with oracle.single_config(smallest=True):
        _, theirs = library_step.run(model, routed=False, size="gpu", return_tensors=True)
    assert mine.keys() == theirs.keys()
    for name in mine:
        assert _rel(mine[name], theirs[name]) < 1e-2, name
