"""Pure-PyTorch references, written to be read. Every Triton kernel in :mod:`mambalab.kernels` is tested
against one of these."""
from mambalab.ref.selective_scan import selective_scan_ref, selective_scan_step
from mambalab.ref.ssd import segsum, ssd_ref, ssd_step

__all__ = ["selective_scan_ref", "selective_scan_step", "segsum", "ssd_ref", "ssd_step"]
