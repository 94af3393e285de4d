"""The SSD kernels' tile rule: every block size, from the shape alone.

The rule reads only (h, p, n, q): never the SM count, the batch size, the sequence length or an autotuner,
so the order of every sum (and so every bit of the results) is the same on every machine.
"""
from __future__ import annotations

from dataclasses import dataclass

import triton

MIN_DOT = 16  # tl.dot wants every block dimension >= 16 (the CPU interpreter enforces it too)


@dataclass(frozen=True)
class TileConfig:
    """Block sizes shared by the four forward steps."""

    chunk_size: int   # q: steps per chunk (the caller's choice, a power of two >= 16)
    block_t: int      # chunk positions per step: rows of Y per chunk-scan program, and the step of the
                      # loops over a chunk's positions (chunk states' sum; chunk scan's s ≤ t)
    block_h: int      # heads per program in the chunk cumsum
    block_p: int      # head dimensions per program in chunk states and chunk scan
    block_n: int      # the whole state dimension, padded (chunk states' output tile is BLOCK_P x BLOCK_N)
    block_k: int      # state dimensions per step of the chunk scan's loop over n (its dot products)
    block_pn: int     # state elements (p·n, flattened) per program in state passing
    num_warps: int
    bwd_block_t: int | None = None  # chunk positions per program of the chunk-scan backward; None: block_t
    bwd_num_warps: int | None = None  # warps per chunk-scan backward program; None: num_warps

    @property
    def backward_block_t(self) -> int:
        return self.bwd_block_t or self.block_t

    @property
    def backward_num_warps(self) -> int:
        return self.bwd_num_warps or self.num_warps

    def __post_init__(self):
        for name in ("block_t", "block_p", "block_n", "block_k"):
            if getattr(self, name) < MIN_DOT:
                raise ValueError(f"{name}={getattr(self, name)} must be at least {MIN_DOT} (tl.dot)")
        if self.chunk_size < MIN_DOT or self.chunk_size & (self.chunk_size - 1):
            raise ValueError(f"chunk_size={self.chunk_size} must be a power of two >= {MIN_DOT}")
        for name in ("block_t", "backward_block_t"):
            bt = getattr(self, name)
            if bt < MIN_DOT or self.chunk_size % bt or bt & (bt - 1):
                raise ValueError(f"{name}={bt} must be a power of two >= {MIN_DOT} dividing chunk_size={self.chunk_size}")
        if self.block_n % self.block_k:
            raise ValueError(f"block_k={self.block_k} must divide block_n={self.block_n}")


def tile_config(h: int, p: int, n: int, chunk_size: int) -> TileConfig:
    """The documented rule:

    * BLOCK_T  = min(64, q)                     chunk positions at a time, so no tile is q × q for large q
    * backward BLOCK_T = min(32, q)             the chunk-scan backward holds the whole head and state per
                                                program: at 64 positions its fp32 tiles need 289 KiB of shared
                                                memory on sm_90 (the H200 has 227), at 32 they need 152 KiB and
                                                spill a quarter as much (benchmarks/ptxas_ssd.py, fp32 and bf16)
    * BLOCK_H  = min(16, next_pow2(h))          heads per chunk-cumsum program (a (BLOCK_H, q) tile)
    * BLOCK_P  = min(64, next_pow2(p)), >= 16   head dimensions per program (p-blocks of chunk states/scan)
    * BLOCK_N  = next_pow2(n), >= 16            the whole state, so a chunk's state is one tile
    * BLOCK_K  = min(64, BLOCK_N)               the chunk scan walks n in steps of BLOCK_K for C Bᵀ and C Hᵀ
    * BLOCK_PN = min(1024, next_pow2(p·n))      state elements per state-passing program
    * 8 warps a program when a head's state tile is large (BLOCK_P · BLOCK_N >= 64 · 64), else 4. At
      p = 64, n = 128 the chunk-scan and chunk-states kernels need 255 registers a thread: with 4 warps they
      spill (656 B in the bf16 chunk-scan forward, 1 KiB in its backward), with 8 they do not, and the SM
      holds the same 8 warps either way (benchmarks/ptxas_ssd.py, sm_90).

    The backward kernels reuse these, and take the whole head and the whole state per program
    (:func:`backward_block_p` = next_pow2(p), >= 16, and BLOCK_N), so that every sum over p or n stays inside
    one program; only sums over programs are reductions (atomic or deterministic).

    Chosen from compile reports (registers, spills, shared memory for sm_90), not yet from a timed sweep:
    tuning it on a GPU means changing this function (and recording why here), never adding an autotuner.
    """
    block_n = max(MIN_DOT, triton.next_power_of_2(n))
    block_p = max(MIN_DOT, min(64, triton.next_power_of_2(p)))
    return TileConfig(
        chunk_size=chunk_size,
        block_t=min(64, chunk_size),
        block_h=min(16, triton.next_power_of_2(h)),
        block_p=block_p,
        block_n=block_n,
        block_k=min(64, block_n),
        block_pn=min(1024, triton.next_power_of_2(p * n)),
        num_warps=8 if block_p * block_n >= 64 * 64 else 4,
        bwd_block_t=min(32, chunk_size),
    )


def backward_block_p(p: int) -> int:
    """Head dimensions per backward program: the whole head, next_pow2(p), at least 16 (tl.dot)."""
    return max(MIN_DOT, triton.next_power_of_2(p))
