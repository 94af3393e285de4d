"""Shared fixtures. Kernels run on the GPU when there is one, else on the CPU through Triton's interpreter
(importing mambalab switches it on, so it is imported first)."""
import mambalab  # noqa: F401  (before anything imports triton)
import pytest
import torch

KERNEL_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def kernel_device() -> str:
    return KERNEL_DEVICE


requires_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def make_ssd_inputs(b, l, h, p, g, n, *, D="h", z=True, bias=True, init=True, dtype=torch.float32,
                    param_dtype=None, seed=0, device="cpu"):
    """Random SSD inputs in mamba_chunk_scan_combined's layout: x, z (b, l, h, p), dt (b, l, h), A (h,),
    B, C (b, l, g, n), D (h,) or (h, p), dt_bias (h,), initial_states (b, h, p, n).

    x, B, C, z are made in ``dtype``; dt, A, D, dt_bias and initial_states in ``param_dtype`` (default
    ``dtype``). D: None, "h" for (h,) or "hp" for (h, p). dt is positive, so it means the same with and
    without softplus."""
    gen = torch.Generator().manual_seed(seed)
    pd = param_dtype or dtype
    act = lambda *s: torch.randn(*s, generator=gen, dtype=dtype)
    par = lambda *s: torch.randn(*s, generator=gen, dtype=pd)
    x = {
        "x": act(b, l, h, p),
        "dt": 0.05 + 0.45 * torch.rand(b, l, h, generator=gen, dtype=pd),
        "A": -(0.5 + torch.rand(h, generator=gen, dtype=pd)),
        "B": act(b, l, g, n),
        "C": act(b, l, g, n),
        "D": {None: None, "h": par(h), "hp": par(h, p)}[D],
        "z": act(b, l, h, p) if z else None,
        "dt_bias": 0.1 * par(h) if bias else None,
        "initial_states": par(b, h, p, n) if init else None,
    }
    return {k: (v.to(device) if v is not None else None) for k, v in x.items()}
