"""The SSD forward: the four steps launched in order, returning what a backward will need.

    step 0  chunk_cumsum   Δ, cs                 (b, h, c, q)
    step 1  chunk_states   S                     (b, c, h, p, n)
    step 2  state_passing  H (entering), final   (b, c, h, p, n), (b, h, p, n)
    step 3  chunk_scan     out                   (b, l, h, p)

Steps 1-3 can also run as one sweep with the state on chip (:mod:`mambalab.kernels.ssd.state_sweep`):
:func:`steps_1_to_3` picks. Mamba-2's forward keeps the split steps (faster at its default q = 256, and they
hand back S); Mamba-3's scan takes the sweep where the tile rule says so (``TileConfig.sweep_forward``).

Packed sequences: ``seq_idx`` (b, l) int32 reaches steps 1-3 (step 0's cumsum runs across boundaries: only
differences cs_t - cs_s within one sequence are ever used), each masking as
:mod:`mambalab.kernels.ssd.packed` says.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from mambalab import device

from mambalab.kernels.ssd.chunk_cumsum import chunk_cumsum_fwd
from mambalab.kernels.ssd.chunk_scan import chunk_scan_fwd
from mambalab.kernels.ssd.chunk_states import chunk_states_fwd
from mambalab.kernels.ssd.state_passing import state_passing_fwd
from mambalab.kernels.ssd.state_sweep import state_sweep_fwd
from mambalab.kernels.ssd.tiles import TileConfig, tile_config


class SSDForward(NamedTuple):
    """The forward's results. Everything but ``out`` and ``entering_states`` (the dots' dtype: x's) is fp32."""

    out: torch.Tensor              # (b, l, h, p) in x's dtype
    final_states: torch.Tensor     # (b, h, p, n): the state after the last step
    delta: torch.Tensor            # (b, h, c, q): Δ = clamp(softplus?(dt + dt_bias)), 0 on padding
    dA_cumsum: torch.Tensor        # (b, h, c, q): cs, the within-chunk cumsum of Δ A
    chunk_states: torch.Tensor     # (b, c, h, p, n): S, each chunk's state from zero
    entering_states: torch.Tensor  # (b, c, h, p, n) in x's dtype: H_in, the state entering each chunk
    tiles: TileConfig


def ssd_chunk_scan_fwd(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None,
                       dt_softplus=False, dt_limit=(0.0, float("inf")), cfg: TileConfig | None = None,
                       dot_precision: str | None = None, seq_idx=None) -> SSDForward:
    """Launch the SSD forward on validated, contiguous tensors (see :mod:`mambalab.ops.ssd`).

    x, z: (b, l, h, p); dt: (b, l, h); A: (h,) fp32; B, C: (b, l, g, n); D: (h,) or (h, p); dt_bias: (h,);
    initial_states: (b, h, p, n) fp32; seq_idx: (b, l) int32 (packed sequences) or None. ``cfg`` overrides the tile rule (tests only: tiles fix the order of
    additions). ``dot_precision`` is tl.dot's input_precision: by default the device layer's rule
    (:func:`mambalab.device.dot_precision`: "tf32" on a GPU, as mamba-ssm; "ieee" on the CPU interpreter).
    """
    if dot_precision is None:
        dot_precision = device.dot_precision(x.dtype, x.device)
    b, l, h, p = x.shape
    g, n = B.shape[2], B.shape[3]
    cfg = cfg or tile_config(h, p, n, chunk_size, x.dtype, ngroups=g)
    if cfg.chunk_size != chunk_size:
        raise ValueError(f"the tiles are for chunk_size={cfg.chunk_size}, not {chunk_size}")
    delta, cs = chunk_cumsum_fwd(dt, A, dt_bias, dt_softplus, dt_limit, cfg)
    out, entering, final, states = steps_1_to_3(x, B, C, delta, cs, initial_states, D, z, cfg, dot_precision,
                                                sweep=False, seq_idx=seq_idx)
    return SSDForward(out, final, delta, cs, states, entering, cfg)


def steps_1_to_3(x, B, C, delta, cs, initial, D, z, cfg: TileConfig, dot_precision: str, sweep: bool, same=None,
                 step: int = 0, seq_idx=None):
    """Steps 1-3 from step 0's Δ and cs: as one sweep (``sweep``) or as the three split launches. Returns
    (out (b, l, h, p) and entering (b, c, h, p, n) in x's dtype, final (b, h, p, n) fp32, the chunk states S
    (b, c, h, p, n) fp32, or None from the sweep, which never forms them). ``step`` > 0 positions a step with
    same-step weights ``same`` (b, h, c, q) fp32: Mamba-3's form (:func:`~mambalab.kernels.ssd.chunk_scan.
    _intra_weights`). ``seq_idx`` (b, l) int32 or None: packed sequences."""
    if step and cfg.block_t % step:
        raise ValueError(f"a step's {step} positions must not straddle a block of {cfg.block_t}")
    if sweep:
        return (*state_sweep_fwd(x, B, C, delta, cs, initial, D, z, cfg, dot_precision, same=same, step=step,
                                 seq_idx=seq_idx), None)
    states = chunk_states_fwd(x, B, delta, cs, cfg, dot_precision, seq_idx=seq_idx)
    entering, final = state_passing_fwd(states, cs, initial, cfg, store_dtype=x.dtype, seq_idx=seq_idx)
    out = chunk_scan_fwd(x, B, C, delta, cs, entering, D, z, cfg, dot_precision, same=same, step=step,
                         seq_idx=seq_idx)
    return out, entering, final, states
