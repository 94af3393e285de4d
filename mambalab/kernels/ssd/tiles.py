"""The SSD kernels' tile rule: every block size, from the shape and the dtype alone.

The rule reads only (h, p, n, q) and the dtype: never the SM count, the batch size, the sequence length or an
autotuner, so the order of every sum (and so every bit of the results) is the same on every machine.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

MIN_DOT = 16  # tl.dot wants every block dimension >= 16 (the CPU interpreter enforces it too)


@dataclass(frozen=True)
class TileConfig:
    """Block sizes, warps and switches of the SSD kernels, one field per choice (:func:`tile_config` fills
    them all)."""

    chunk_size: int         # q: steps per chunk (the caller's choice, a power of two >= 16)
    block_t: int            # chunk positions per step: rows of Y per chunk-scan program, the step of its loop
                            # over s ≤ t, and the blocks of chunk_cb and the sweeps
    block_h: int            # heads per program in the chunk cumsum
    block_p: int            # head dimensions per program in chunk states and chunk scan
    block_n: int            # the whole state dimension, padded (chunk states' output tile is BLOCK_P x BLOCK_N)
    block_k: int            # state dimensions per step of the chunk scan's loop over n (its dot products)
    block_pn: int           # state elements (p·n, flattened) per program in state passing
    num_warps: int          # warps per program of every kernel without its own field below
    bwd_block_t: int        # chunk positions per program of the chunk-scan backward
    bwd_num_warps: int      # warps per chunk-scan backward program
    states_block_t: int     # chunk positions per step of the chunk-states sum
    states_num_warps: int   # warps per chunk-states program
    sweep_bwd_block_p: int  # head dimensions per backward-sweep program
    sweep_forward: bool = True        # Mamba-3's scan runs steps 1-3 as the forward sweep (state_sweep)
    num_stages: int = 3               # software-pipeline stages of the chunk-scan forward (Triton's default)
    bwd_num_stages: int = 3           # the same for the chunk-scan backward kernels
    precompute_cb: bool = False       # the chunk scan reads C Bᵀ formed once per group (chunk_cb.py)

    def __post_init__(self):
        for name in ("block_t", "block_p", "block_n", "block_k", "sweep_bwd_block_p"):
            if getattr(self, name) < MIN_DOT:
                raise ValueError(f"{name}={getattr(self, name)} must be at least {MIN_DOT} (tl.dot)")
        if self.chunk_size < MIN_DOT or self.chunk_size & (self.chunk_size - 1):
            raise ValueError(f"chunk_size={self.chunk_size} must be a power of two >= {MIN_DOT}")
        for name in ("block_t", "bwd_block_t", "states_block_t"):
            bt = getattr(self, name)
            if bt < MIN_DOT or self.chunk_size % bt or bt & (bt - 1):
                raise ValueError(f"{name}={bt} must be a power of two >= {MIN_DOT} dividing chunk_size={self.chunk_size}")
        if self.block_n % self.block_k:
            raise ValueError(f"block_k={self.block_k} must divide block_n={self.block_n}")


def tile_config(h: int, p: int, n: int, chunk_size: int, dtype: torch.dtype = torch.float32,
                ngroups: int | None = None) -> TileConfig:
    """The tile rule, pinned per dtype (``dtype``: what the kernels read, x's; fp32 on the CPU) and read from
    the shape alone (``ngroups``: g, the groups sharing B and C; None keeps C Bᵀ in each head's programs, as
    Mamba-3's scan does). Each tuned choice's figure is from an H200 at b4 l4096 h32 p64 n128 q256:

    * BLOCK_T  = min(64, q)                     chunk positions at a time, so no tile is q × q for large q
    * BLOCK_H  = min(16, next_pow2(h))          heads per chunk-cumsum program (a (BLOCK_H, q) tile)
    * BLOCK_P  = min(64, next_pow2(p)), >= 16   head dimensions per program (p-blocks of chunk states/scan)
    * BLOCK_N  = next_pow2(n), >= 16            the whole state, so a chunk's state is one tile
    * BLOCK_K  = min(64, BLOCK_N)               the chunk scan walks n in steps of BLOCK_K for C Bᵀ and C Hᵀ
    * BLOCK_PN = min(1024, next_pow2(p·n))      state elements per state-passing program
    * warps: 4 a program; 8 for bf16/fp16 with a state tile BLOCK_P · BLOCK_N >= 64 · 64
      (bf16 forward 0.45 ms against 0.49 at 4 warps: benchmarks/results/README.md, 2026-11-30).
    * chunk-scan backward: min(64, q) positions for bf16/fp16, min(32, q) for fp32, 4 warps
      (the sweep's fastest, bf16 1.63 ms, fp32 3.24: 2026-11-30_h200_ssd_tile_sweep_vs_mamba_deterministic.json).
    * chunk states: BLOCK_T and the forward's warps for bf16/fp16; min(32, q) positions a step and 2 warps
      for fp32, whose chunk-scan forward runs unpipelined (num_stages 1)
      (states 0.098 ms against 0.334, forward 0.499 against 0.577: 2026-12-03_h200_ssd_fp32_kernel_sweep.json).
    * C Bᵀ (``precompute_cb``) formed once per group by :mod:`mambalab.kernels.ssd.chunk_cb` for fp32 with
      h / g >= 8, read by the chunk scan's forward and backward; otherwise each head's programs form it. It
      costs b · l · g · q · 4 bytes and saves forming each matrix h / g - 1 times
      (h / g = 32, backward: fp32 2.34 ms against 2.70, bf16 2.80 against 1.41: 2026-12-04_h200_ssd_kernel_sweep.json).
    * the sweeps (:mod:`mambalab.kernels.ssd.state_sweep`; one program per batch row, head and block of head
      dimensions, walking the chunks): backward BLOCK_P = min(32, BLOCK_P); forward the rule's BLOCK_P; both
      the rule's warps. Mamba-3's scan takes the forward sweep for bf16/fp16 and chunks of at most 64
      positions, one BLOCK_T block (``sweep_forward``), and the split steps otherwise
      (Mamba-3 SISO at q 64: 2.54 ms against 2.75 with the split steps: 2026-12-01_h200_ssd_state_sweep_ab.json).

    The backward kernels take the whole head and the whole state per program (:func:`backward_block_p` =
    next_pow2(p), >= 16, and BLOCK_N), so that every sum over p or n stays inside one program; only sums
    over programs are reductions (atomic or deterministic). Tuning the rule on a GPU means changing this
    function, with its figure and JSON file under benchmarks/results/, never adding an autotuner.
    """
    block_t = min(64, chunk_size)
    block_n = max(MIN_DOT, triton.next_power_of_2(n))
    block_p = max(MIN_DOT, min(64, triton.next_power_of_2(p)))
    narrow = torch.finfo(dtype).bits < 32          # bf16 / fp16 operands
    num_warps = 8 if narrow and block_p * block_n >= 64 * 64 else 4
    return TileConfig(
        chunk_size=chunk_size,
        block_t=block_t,
        block_h=min(16, triton.next_power_of_2(h)),
        block_p=block_p,
        block_n=block_n,
        block_k=min(64, block_n),
        block_pn=min(1024, triton.next_power_of_2(p * n)),
        num_warps=num_warps,
        bwd_block_t=min(64 if narrow else 32, chunk_size),
        bwd_num_warps=4,
        states_block_t=block_t if narrow else min(32, chunk_size),
        states_num_warps=num_warps if narrow else 2,
        sweep_bwd_block_p=min(32, block_p),
        sweep_forward=narrow and chunk_size <= 64,
        num_stages=3 if narrow else 1,
        precompute_cb=not narrow and ngroups is not None and h // ngroups >= 8,
    )


def backward_block_p(p: int) -> int:
    """Head dimensions per backward program: the whole head, next_pow2(p), at least 16 (tl.dot)."""
    return max(MIN_DOT, triton.next_power_of_2(p))
