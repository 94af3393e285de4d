"""The public ops: validate inputs once, pick kernels, wire autograd.

* :func:`selective_scan`: Mamba-1's selective scan, drop-in for mamba-ssm's ``selective_scan_fn``.
* :func:`ssd_chunk_scan`: Mamba-2's chunked SSD with autograd, drop-in for mamba-ssm's
  ``mamba_chunk_scan_combined``; its backward reduces with atomics or deterministically (``reduction``).
* :func:`ssd_chunk_scan_forward`: the same forward without autograd.
* :func:`mamba3_chunk_scan`: Mamba-3's exponential-trapezoidal, rotary, MIMO scan with autograd (on the SSD
  kernels, deterministic backward by default); :func:`mamba3_step`: its decode step (one Triton kernel).
"""
from mambalab.ops.mamba3 import mamba3_chunk_scan, mamba3_step
from mambalab.ops.selective_scan import selective_scan
from mambalab.ops.ssd import ssd_chunk_scan, ssd_chunk_scan_forward

__all__ = ["mamba3_chunk_scan", "mamba3_step", "selective_scan", "ssd_chunk_scan", "ssd_chunk_scan_forward"]
