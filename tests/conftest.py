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
