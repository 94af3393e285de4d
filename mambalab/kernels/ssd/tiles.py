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
    sweep_forward: bool = True        # Mamba-3's scan runs steps 1-3 as the forward sweep (state_sweep)
    sweep_bwd_block_p: int | None = None  # head dimensions per backward-sweep program; None: block_p
    states_block_t: int | None = None     # chunk positions per step of the chunk-states sum; None: block_t
    states_num_warps: int | None = None   # warps per chunk-states program; None: num_warps
    num_stages: int = 3                   # software-pipeline stages of the chunk-scan forward (Triton's default)
    bwd_num_stages: int = 3               # the same for the chunk-scan backward kernels
    precompute_cb: bool = False           # the chunk scan reads C Bᵀ formed once per group (chunk_cb.py)

    @property
    def backward_block_t(self) -> int:
        return self.bwd_block_t or self.block_t

    @property
    def backward_num_warps(self) -> int:
        return self.bwd_num_warps or self.num_warps

    @property
    def chunk_states_block_t(self) -> int:
        return self.states_block_t or self.block_t

    @property
    def chunk_states_num_warps(self) -> int:
        return self.states_num_warps or self.num_warps

    @property
    def sweep_backward_block_p(self) -> int:
        return self.sweep_bwd_block_p or self.block_p

    def __post_init__(self):
        for name in ("block_t", "block_p", "block_n", "block_k", "sweep_backward_block_p"):
            if getattr(self, name) < MIN_DOT:
                raise ValueError(f"{name}={getattr(self, name)} must be at least {MIN_DOT} (tl.dot)")
        if self.chunk_size < MIN_DOT or self.chunk_size & (self.chunk_size - 1):
            raise ValueError(f"chunk_size={self.chunk_size} must be a power of two >= {MIN_DOT}")
        for name in ("block_t", "backward_block_t", "chunk_states_block_t"):
            bt = getattr(self, name)
            if bt < MIN_DOT or self.chunk_size % bt or bt & (bt - 1):
                raise ValueError(f"{name}={bt} must be a power of two >= {MIN_DOT} dividing chunk_size={self.chunk_size}")
        if self.block_n % self.block_k:
            raise ValueError(f"block_k={self.block_k} must divide block_n={self.block_n}")


def tile_config(h: int, p: int, n: int, chunk_size: int, dtype: torch.dtype = torch.float32,
                ngroups: int | None = None) -> TileConfig:
    """The documented rule, pinned per dtype (``dtype``: what the kernels read, x's; fp32 on the CPU) and read
    from the shape alone (``ngroups``: g, the groups sharing B and C; None keeps C Bᵀ in each head's programs,
    as Mamba-3's scan does, whose same-step weights were not timed with it):

    * BLOCK_T  = min(64, q)                     chunk positions at a time, so no tile is q × q for large q
    * BLOCK_H  = min(16, next_pow2(h))          heads per chunk-cumsum program (a (BLOCK_H, q) tile)
    * BLOCK_P  = min(64, next_pow2(p)), >= 16   head dimensions per program (p-blocks of chunk states/scan)
    * BLOCK_N  = next_pow2(n), >= 16            the whole state, so a chunk's state is one tile
    * BLOCK_K  = min(64, BLOCK_N)               the chunk scan walks n in steps of BLOCK_K for C Bᵀ and C Hᵀ
    * BLOCK_PN = min(1024, next_pow2(p·n))      state elements per state-passing program
    * warps: 4 a program, except bf16/fp16 forward and other backward kernels with a large state tile
      (BLOCK_P · BLOCK_N >= 64 · 64): 8. With 4 warps the bf16 forward took 0.49 rather than 0.45 ms (it
      uses 221 registers a thread there against 121 with 8, no spills either way: benchmarks/ptxas_ssd.py
      for sm_90); in fp32 (TF32 dots) 4 warps were faster (0.96 against 1.19 ms forward).
    * chunk-scan backward: min(64, q) positions a program and 4 warps for bf16/fp16; min(32, q) and 4 warps
      for fp32 (whose 64-position tiles need 2 × the shared memory and were slower).
    * fp32 only: the chunk states sum min(32, q) positions a step with 2 warps, and the chunk-scan forward
      runs its loops unpipelined (num_stages 1; Triton's default, 3, elsewhere). Kernels alone at the shape
      below (benchmarks/results/2026-12-03_h200_ssd_fp32_kernel_sweep.json; bench_ssd.py --sweep forward
      backward): chunk states 0.098 ms against 0.334 at (64 positions, 4 warps), 0.095 at (16, 2), 0.319 at
      (32, 1); chunk scan 0.499 ms against 0.577 at 3 stages, 0.578 at 2, 0.913 at 4. The fp32 chunk-scan
      backward moved by 3 % at most with its stages (2.62-2.68 ms at 1-3) and is left at the default.

    Measured on an H200 (benchmarks/results/2026-11-30_h200_ssd_tile_sweep_vs_mamba_deterministic.json; b=4, l=4096, h=32,
    p=64, n=128, q=256, deterministic mode; kernel times without the op's Python): the backward took
    1.63 ms in bf16 at (64 positions, 4 warps) against 2.77 ms at the previous rule's (32, 8), 2.11 at
    (64, 8), 1.80 at (32, 4), 2.63 at (16, 4); in fp32 3.24 ms at (32, 4), 4.69 at (32, 8), 4.89 at (64, 4).
    Register use is at or near 255 a thread in every variant, so an SM runs 8 warps either way; what
    changes is how many positions each program's dots cover. The chosen bf16 backward spills (68 B in the
    rows kernel, 828 B in the columns kernel at g = 1, benchmarks/ptxas_ssd.py, which specialises g = 1 to
    a constant as a launch does) and is still the fastest.

    * C Bᵀ (``precompute_cb``): in fp32 with at least 8 heads a group (h / g >= 8), one launch per group
      (:mod:`mambalab.kernels.ssd.chunk_cb`) forms it and the chunk scan's forward and backward read it;
      otherwise each head's programs form it themselves. At b = 4, l = 4096, h = 32, g = 1, p = 64, n = 128,
      q = 256 it took the fp32 chunk scan from 0.502 to 0.471 ms forward and from 2.70 to 2.34 ms backward,
      its own launches counted in both (benchmarks/results/2026-12-04_h200_ssd_kernel_sweep.json); for sm_90
      it takes the fp32 chunk-scan forward from 244 to 180 registers a thread and the backward's spills from
      296 and 48 B to 0 and 4 (benchmarks/ptxas_ssd.py). In bf16 it made the backward slower (2.80 ms against
      1.41; its spills grow, rows 116 B against 60, columns 1,060 against 812), so 16-bit inputs keep it off.
      It costs b · l · g · q · 4 bytes for the chunks' matrices and saves forming each one h / g - 1 times:
      with few heads a group there is little to save (at h / g = 1, only writes to add), hence the 8; only
      h / g = 32 was timed.
    * the sweeps (:mod:`mambalab.kernels.ssd.state_sweep`; one program per batch row, head and block of head
      dimensions, walking the chunks): backward BLOCK_P = min(32, BLOCK_P), the tile rule's warps; forward
      the tile rule's BLOCK_P and warps (8 for 16-bit inputs and a state of 64 × 64 or more). Mamba-3's scan takes
      the forward sweep for 16-bit inputs and chunks of at most 64 positions, one BLOCK_T block
      (``sweep_forward``): in fp32, and for longer chunks, whose blocks the sweep walks one after another, the
      split steps were faster.

    Measured on an H200 (benchmarks/results/2026-12-01_h200_ssd_state_sweep_ab.json; b=4, l=4096,
    h=32, p=64, n=128). Mamba-3 forward+backward as CUDA graphs, bf16: SISO (q = 64) 2.54 ms with the
    sweeps against 2.75 with the split steps, MIMO r = 4 (q = 64 positions) 10.15 against 10.99; with the
    forward's 4 warps 2.50 and 9.97, with the backward's 32 head dimensions 2.52 and 10.09. The kernels alone:
    backward sweep 0.107 ms (32 dims) / 0.121 (64) against 0.142 for the split steps in bf16 at q = 256,
    0.190 / 0.420 against 0.417 in fp32; forward sweep 0.27 against 0.36 ms in bf16 at q = 64 but 0.62
    against 0.38 at q = 256, and 0.92-1.20 against 0.64 in fp32 at q = 64 (so Mamba-2's forward, q = 256 by
    default, keeps the split steps). With the sweep at every q, MIMO r = 4 at chunk 32 (q = 128) took
    11.54 ms and at chunk 64 (q = 256) 12.86, against 10.77 and 11.79 with the split steps in one process.
    With Mamba-3's same-step weights (:func:`mambalab.kernels.ssd.chunk_scan._intra_weights`) the bf16
    forward sweep runs at 8 warps: MIMO r = 4 forward+backward 7.30 ms against 7.89 at 4 warps, SISO 2.02
    against 2.20 (H200, benchmarks/results/2026-12-01_h200_ssd_same_step_forms_ab.json). sm_90
    (benchmarks/ptxas_ssd.py): the backward sweep at 32 head dimensions uses 128
    registers (bf16, 8 warps) or 200 (fp32, 4 warps), no spill.

    The backward kernels take the whole head and the whole state per program (:func:`backward_block_p` =
    next_pow2(p), >= 16, and BLOCK_N), so that every sum over p or n stays inside one program; only sums
    over programs are reductions (atomic or deterministic). The rule reads the shape and the dtype, never
    the SM count, the batch size, the sequence length or an autotuner: tuning it on a GPU means changing
    this function (and recording why here), never adding an autotuner.
    """
    block_n = max(MIN_DOT, triton.next_power_of_2(n))
    block_p = max(MIN_DOT, min(64, triton.next_power_of_2(p)))
    narrow = torch.finfo(dtype).bits < 32          # bf16 / fp16 operands
    large_state = block_p * block_n >= 64 * 64
    return TileConfig(
        chunk_size=chunk_size,
        block_t=min(64, chunk_size),
        block_h=min(16, triton.next_power_of_2(h)),
        block_p=block_p,
        block_n=block_n,
        block_k=min(64, block_n),
        block_pn=min(1024, triton.next_power_of_2(p * n)),
        num_warps=8 if large_state and narrow else 4,
        bwd_block_t=min(64 if narrow else 32, chunk_size),
        bwd_num_warps=4,
        sweep_forward=narrow and chunk_size <= 64,
        sweep_bwd_block_p=min(32, block_p),
        states_block_t=None if narrow else min(32, chunk_size),
        states_num_warps=None if narrow else 2,
        num_stages=3 if narrow else 1,
        precompute_cb=not narrow and ngroups is not None and h // ngroups >= 8,
    )


def backward_block_p(p: int) -> int:
    """Head dimensions per backward program: the whole head, next_pow2(p), at least 16 (tl.dot)."""
    return max(MIN_DOT, triton.next_power_of_2(p))
