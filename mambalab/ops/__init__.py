"""The public ops: validate inputs once, pick kernels, wire autograd.

* :func:`selective_scan`: Mamba-1's selective scan, drop-in for mamba-ssm's ``selective_scan_fn``.
* :func:`ssd_chunk_scan`: Mamba-2's chunked SSD with autograd, drop-in for mamba-ssm's
  ``mamba_chunk_scan_combined``; its backward reduces with atomics or deterministically (``reduction``).
* :func:`ssd_chunk_scan_forward`: the same forward without autograd.
"""
from mambalab.ops.selective_scan import selective_scan
from mambalab.ops.ssd import ssd_chunk_scan, ssd_chunk_scan_forward

__all__ = ["selective_scan", "ssd_chunk_scan", "ssd_chunk_scan_forward"]
