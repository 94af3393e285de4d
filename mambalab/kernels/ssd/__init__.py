"""Mamba-2's SSD (chunked scan) as Triton kernels, one file per step, each with its backward.

Semantics are mamba-ssm's ``mamba_chunk_scan_combined``; the math of each step is in its file, and each
step is checked against the matching step of :mod:`mambalab.ref.ssd`:

    chunk_cumsum   step 0: Δ = clamp(softplus?(dt + dt_bias), dt_limit), cs = within-chunk cumsum of Δ A
    chunk_states   step 1: S_c = Σ_s exp(cs_last - cs_s) Δ_s x_s B_sᵀ            (ref: chunk_states)
    state_passing  step 2: H_{c+1} = exp(cs_last,c) H_c + S_c                      (ref: state_passing)
    chunk_scan     step 3: Y = (L ∘ C Bᵀ)(Δ X) + exp(cs) C Hᵀ + D x, ⊙ silu(z)   (ref: chunk_diagonal_outputs
                           + chunk_state_outputs)
    chunk_cb       C Bᵀ of each chunk, once per group, for the chunk scan to read (TileConfig.precompute_cb)
    state_sweep    steps 1-3 as one sweep over the chunks per head with the state on chip (Mamba-3's scan,
                   16-bit), and the backward's state steps the same way (every backward)
    forward        the four launched in order: :func:`ssd_chunk_scan_fwd` (:func:`steps_1_to_3`: split or swept)
    backward       the steps' backwards in reverse order: :func:`ssd_chunk_scan_bwd`, with
                   ``reduction="atomic"`` or ``"deterministic"`` for every sum over programs
    tiles          the tile rule (shape only)
    packed         packed sequences (``seq_idx``): the masks every step applies where the sequence changes;
                   :func:`varlen_states_fwd` (in chunk_states) gives each sequence's final state

Layouts: x, z, out (b, l, h, p); dt (b, l, h); B, C (b, l, g, n); per-chunk fp32 tensors Δ and cs are
(b, h, c, q), states (b, c, h, p, n); seq_idx (b, l) int32.
"""
from mambalab.kernels.ssd.backward import REDUCTIONS, SSDGrads, ssd_chunk_scan_bwd
from mambalab.kernels.ssd.chunk_cumsum import chunk_cumsum_bwd, chunk_cumsum_fwd
from mambalab.kernels.ssd.chunk_scan import chunk_scan_bwd, chunk_scan_fwd
from mambalab.kernels.ssd.chunk_states import chunk_states_fwd, varlen_states_fwd
from mambalab.kernels.ssd.forward import SSDForward, ssd_chunk_scan_fwd, steps_1_to_3
from mambalab.kernels.ssd.state_passing import state_passing_fwd
from mambalab.kernels.ssd.state_sweep import state_sweep_bwd, state_sweep_fwd
from mambalab.kernels.ssd.tiles import TileConfig, backward_block_p, tile_config

__all__ = ["REDUCTIONS", "SSDForward", "SSDGrads", "TileConfig", "backward_block_p", "chunk_cumsum_bwd",
           "chunk_cumsum_fwd", "chunk_scan_bwd", "chunk_scan_fwd", "chunk_states_fwd",
           "ssd_chunk_scan_bwd", "ssd_chunk_scan_fwd", "state_passing_fwd", "state_sweep_bwd",
           "state_sweep_fwd", "steps_1_to_3", "tile_config", "varlen_states_fwd"]
