"""The public ops: validate inputs once, pick kernels, wire autograd.

* :func:`selective_scan`: Mamba-1's selective scan, drop-in for mamba-ssm's ``selective_scan_fn``.
"""
from mambalab.ops.selective_scan import selective_scan

__all__ = ["selective_scan"]
