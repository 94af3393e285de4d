"""Mamba-3's kernels: the chunked scan as a rank-expanded SSD, and the decode step.

    angle_cumsum  the cumulative rotary angle θ = θ_{-1} + cumsum(angles ⊙ Δ) along l, restarting at packed
                  sequences' boundaries (+ backward)
    rotary        q̂ and k̂ in one launch: per-head bias and rotation by θ (cos, sin once for both), into the
                  rank-expanded layout (+ backward, one launch, dθ written once)
    rank_inputs   MIMO's rank inputs v ⊙ W^V_r in one pass (+ backward: dv and dW^V in one)
    rank_cumsum   step 0 of the rank-expanded SSD: input weights σ, γ and within-chunk log-decays (+ backward)
    chunk_scan    the SSD's steps 1-3 (and backwards) driven with those, the within-step correction in the
                  chunk's same-step block and D inside: :func:`mamba3_scan_fwd`, :func:`mamba3_scan_bwd`
    rank_outputs  the output stage fused: gate and Σ_r W^O (+ backward)
    step          one decoding step for every head in one kernel: :func:`mamba3_step_fwd`

The math is in :mod:`mambalab.ref.mamba3`; :mod:`mambalab.ops.mamba3` wires them together with the small
tensor algebra between them (the step weights).
"""
from mambalab.kernels.mamba3.angle_cumsum import angle_cumsum_bwd, angle_cumsum_fwd
from mambalab.kernels.mamba3.chunk_scan import Mamba3ScanForward, Mamba3ScanGrads, mamba3_scan_bwd, mamba3_scan_fwd
from mambalab.kernels.mamba3.rank_cumsum import rank_cumsum_bwd, rank_cumsum_fwd
from mambalab.kernels.mamba3.rank_inputs import rank_inputs_bwd, rank_inputs_fwd
from mambalab.kernels.mamba3.rank_outputs import rank_outputs_bwd, rank_outputs_fwd
from mambalab.kernels.mamba3.rotary import rotary_qk_bwd, rotary_qk_fwd
from mambalab.kernels.mamba3.step import mamba3_step_fwd, step_config

__all__ = ["Mamba3ScanForward", "Mamba3ScanGrads", "angle_cumsum_bwd", "angle_cumsum_fwd",
           "mamba3_scan_bwd", "mamba3_scan_fwd", "mamba3_step_fwd", "rank_cumsum_bwd",
           "rank_cumsum_fwd", "rank_inputs_bwd", "rank_inputs_fwd", "rank_outputs_bwd", "rank_outputs_fwd",
           "rotary_qk_bwd", "rotary_qk_fwd", "step_config"]
