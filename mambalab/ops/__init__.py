"""The public ops: validate inputs once, pick kernels, wire autograd.

* :func:`selective_scan`: Mamba-1's selective scan, drop-in for mamba-ssm's ``selective_scan_fn``.
* :func:`ssd_chunk_scan`: Mamba-2's chunked SSD with autograd, drop-in for mamba-ssm's
  ``mamba_chunk_scan_combined``; its backward reduces with atomics or deterministically (``reduction``).
* :func:`ssd_chunk_scan_forward`: the same forward without autograd.
* :func:`mamba3_chunk_scan`: Mamba-3's exponential-trapezoidal, rotary, MIMO scan with autograd (on the SSD
  kernels, deterministic backward by default); :func:`mamba3_step`: its decode step (one Triton kernel).
* :func:`selective_state_update`: Mamba-1's and Mamba-2's decode step (one Triton kernel), drop-in for
  mamba-ssm's function of that name; :func:`causal_conv1d_update`: the conv's decode step, drop-in for the
  ``causal_conv1d`` package's.
* :func:`causal_conv1d_fn`: the causal depthwise conv over a sequence with autograd (deterministic backward),
  drop-in for the ``causal_conv1d`` package's.
* :func:`mamba_inner_fn`: Mamba-1's conv, projections, scan and out projection, drop-in for mamba-ssm's.
* :func:`mamba_split_conv1d_scan_combined`: Mamba-2's conv, SSD, gated norm and out projection, the fused entry
  point mamba-ssm's ``Mamba2`` trains through, drop-in for mamba-ssm's.
* :func:`layer_norm_fn`, :func:`rms_norm_fn`: the residual add fused with a LayerNorm or RMSNorm, with a backward
  whose bits do not depend on the GPU model; drop-ins for mamba-ssm's functions of those names.
"""
from mambalab.ops.conv1d import causal_conv1d_fn
from mambalab.ops.conv_update import causal_conv1d_update
from mambalab.ops.layer_norm import layer_norm_fn, rms_norm_fn
from mambalab.ops.mamba3 import mamba3_chunk_scan, mamba3_step
from mambalab.ops.mamba_inner import mamba_inner_fn
from mambalab.ops.selective_scan import selective_scan
from mambalab.ops.split_conv1d_scan import mamba_split_conv1d_scan_combined
from mambalab.ops.ssd import ssd_chunk_scan, ssd_chunk_scan_forward
from mambalab.ops.state_update import selective_state_update

__all__ = ["causal_conv1d_fn", "causal_conv1d_update", "mamba_inner_fn", "mamba_split_conv1d_scan_combined",
           "mamba3_chunk_scan", "mamba3_step",
           "layer_norm_fn", "rms_norm_fn", "selective_scan", "selective_state_update",
           "ssd_chunk_scan", "ssd_chunk_scan_forward"]
