"""The public ops: validate inputs once, pick kernels, wire autograd.

* :func:`selective_scan`: Mamba-1's selective scan, drop-in for mamba-ssm's ``selective_scan_fn``.
* :func:`ssd_chunk_scan_forward`: Mamba-2's chunked SSD, forward only so far (no autograd yet).
"""
from mambalab.ops.selective_scan import selective_scan
from mambalab.ops.ssd import ssd_chunk_scan_forward

__all__ = ["selective_scan", "ssd_chunk_scan_forward"]
