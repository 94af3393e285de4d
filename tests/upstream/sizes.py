"""Device and sizes for the ports of mamba-ssm's upstream tests in this folder.

Upstream runs on CUDA with its own sizes; without a GPU our Triton kernels run in Triton's interpreter, so each
port keeps upstream's parametrisation on a GPU and, on the CPU, a small subset of upstream's own parameter
values (and smaller hard-coded sizes), picked with :func:`gpu_or_cpu`.
"""
import torch

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"


def gpu_or_cpu(gpu, cpu):
    """Upstream's value on a GPU; the reduced one the CPU interpreter can run otherwise."""
    return gpu if ON_GPU else cpu
