"""mamba-ssm's SM-count-derived splits: how its backward kernels group additions, as a function of the GPU.

:func:`mamba_ssm_head_split` gives the number of heads each program of mamba-ssm's dB/dC backward sums before its
final ``sum``; :func:`mamba_ssm_norm_split` gives the grouping of rows in its norms' weight-gradient backward.
Both follow ``multi_processor_count``, so the bits of those gradients depend on the GPU model. These are
arithmetic on the launchers' grids (no kernel runs); chapter 04 sets them beside the launchers' source.
"""
from __future__ import annotations

import math

import triton

__all__ = ["NORM_KINDS", "mamba_ssm_head_split", "mamba_ssm_norm_split"]


def mamba_ssm_head_split(b: int, c: int, h: int, g: int, sm_count: int) -> tuple[int, int]:
    """(heads per program, number of splits) of mamba-ssm's dB/dC backward, mamba-ssm 2.3.2. Three launchers split
    the same way: ``_chunk_state_bwd_db`` (dB's own split, ``ops/triton/ssd_chunk_state.py``), ``_chunk_scan_bwd_dC``
    (dC's, ``ops/triton/ssd_chunk_scan.py``) and ``_chunk_scan_bwd_dcb`` (``ssd_chunk_scan.py``: dCB, the gradient
    of the chunk's C Bᵀ, which ``_mamba_chunk_scan_combined_bwd`` in ``ssd_combined.py`` turns into further terms
    of both dB and dC through ``_bmm_chunk_bwd``). Each aims at about one wave of programs, so each program sums

        heads_per_program = clamp(ceil(b · c · h / sm_count), 1, h / g)

    heads of its group, writes that partial, and ``sum`` adds the ceil((h / g) / heads_per_program) partials.
    The grouping of the additions, and so the bits of dB and dC, depends on the SM count."""
    for name, v in (("b", b), ("c", c), ("h", h), ("g", g), ("sm_count", sm_count)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int; got {v!r}")
    if h % g:
        raise ValueError(f"g = {g} must divide h = {h}")
    per_group = h // g
    per_program = max(min(math.ceil(b * c * h / sm_count), per_group), 1)
    return per_program, math.ceil(per_group / per_program)


NORM_KINDS = ("gated", "plain")


def mamba_ssm_norm_split(rows: int, d: int, sm_count: int, *, kind: str = "gated", group_size: int | None = None,
                         element_size: int = 4) -> tuple[int, int]:
    """(programs, rows per program) of mamba-ssm 2.3.2's norm backward for a (rows, d) input: each program
    sums the weight gradient dw_j = Σ_m dy_mj x̂_mj over its rows into a partial, and ``_dw.sum(0)`` adds the
    partials. Both counts follow the SM count, so the grouping of the additions, and so dw's bits, depend on the
    GPU, in mamba-ssm's deterministic mode too (the norms have no other mode).

    Program i takes rows [i · rows_per_program, min((i + 1) · rows_per_program, rows)) (the kernels'
    ``row_start`` and ``row_end``), so programs · rows_per_program may exceed ``rows``: the last programs then get
    fewer rows or none, and write a zero partial. At 256 rows, d = 1024, fp32, an A6000 (84 SMs) launches 84
    programs of 4 rows, of which 64 cover the rows and 20 get none.

    kind "gated" (``layernorm_gated._layer_norm_bwd``, Mamba-2's ``RMSNormGated``), with G = d / group_size
    groups and warps = clamp(next_pow2(group_size) / 256, 1, 8)::

        programs = nrow_groups = ceil(sm_count · ceil(4 / warps) / G)       (per group)

    kind "plain" (``layer_norm._layer_norm_bwd``, the blocks' ``RMSNorm``): programs = sm_count. In both,
    rows per program = ceil(rows / programs). ``element_size``: bytes per element of x (4 for fp32)."""
    if kind not in NORM_KINDS:
        raise ValueError(f"kind must be one of {NORM_KINDS}; got {kind!r}")
    for name, v in (("rows", rows), ("d", d), ("sm_count", sm_count), ("element_size", element_size)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int; got {v!r}")
    if kind == "plain":
        blocks = sm_count
    else:
        group_size = d if group_size is None else group_size
        if not isinstance(group_size, int) or group_size < 1 or d % group_size:
            raise ValueError(f"group_size must be a positive divisor of d = {d}; got {group_size!r}")
        block_n = min(65536 // element_size, triton.next_power_of_2(group_size))
        warps = min(max(block_n // 256, 1), 8)
        blocks = math.ceil(sm_count * math.ceil(4 / warps) / (d // group_size))
    return blocks, math.ceil(rows / blocks)
