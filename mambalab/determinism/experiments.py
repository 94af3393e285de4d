"""Experiments behind notebooks 04 and 05: where differing gradient bits come from, measured.

* **Float addition is not associative**: :func:`float_bits` spells out a float's sign, exponent and mantissa;
  :func:`ordered_sum` adds numbers one at a time in a given order, in a given dtype, so reordering a sum can
  be watched bit by bit; :func:`order_spread` counts the distinct results over many orders.
* **An atomic-add kernel and the order its programs land**: :func:`atomic_sum` launches
  :func:`atomic_sum_kernel` (each program sums its block and ``tl.atomic_add``\\ s the partial into one
  total) and recovers the order in which the programs' adds landed from the values ``tl.atomic_add``
  returned; :func:`fold_in_order` is its reference (a left fold of the partials in that order must give the
  total's exact bits).
* **Which gradients vary, and by how much**: :func:`ssd_gradients` runs one SSD forward+backward (mambalab's
  :func:`mambalab.ops.ssd_chunk_scan`, or mamba-ssm's ``mamba_chunk_scan_combined`` on a GPU) and returns the
  gradients; :func:`gradient_variation` repeats any such step and tabulates, per gradient, the number of
  distinct bit patterns and the largest difference from the first run.
* **mamba-ssm's SM-count-derived split**: :func:`mamba_ssm_head_split` gives the number of heads each
  program of mamba-ssm's dB/dC backward sums before its final ``sum`` (a function of the SM count).
* **The norms' weight gradients**: mamba-ssm's ``RMSNormGated`` (``ops/triton/layernorm_gated.py``) and
  ``RMSNorm`` (``ops/triton/layer_norm.py``) backwards give each program a block of rows and sum the programs'
  weight-gradient partials with a final ``sum``; the number of programs comes from ``multi_processor_count``.
  :func:`mamba_ssm_norm_split` gives that grouping; :func:`norm_inputs` and :func:`norm_gradients` run one
  norm forward+backward (mamba-ssm's Triton kernels, or mambalab's
  :func:`mambalab.modules.norm.rmsnorm_fn`), which under :func:`mambalab.determinism.emulate` reads the
  emulated SM count, on a GPU and on the CPU interpreter alike.
* **Two machines train the same model**: :func:`train_losses` trains a tiny :class:`mambalab.modules.Mamba2`
  regressor from a fixed seed and returns its loss per step, optionally under ``emulate(profile)`` and, on
  the CPU interpreter, under a seeded program-order *simulation* of a GPU's scheduling.

On a CPU, Triton's interpreter runs programs one after another in launch order, so atomics are as
deterministic there as anything else; run-to-run variation on a CPU only exists under
:func:`mambalab.determinism.shuffled_program_order`, which is a simulation and is labelled so wherever it is used.
"""
from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

__all__ = ["PER_ROW_GRADS", "SSD_GRAD_NAMES", "SUMMED_GRADS", "AtomicSumRun", "GradientVariation", "atomic_sum",
           "atomic_sum_kernel", "batch_with_row0", "fingerprint_matrix", "float_bits", "fold_in_order",
           "gradient_variation", "mamba_ssm_head_split", "mamba_ssm_norm_split", "norm_gradients", "norm_inputs",
           "order_spread", "ordered_sum", "ssd_gradients", "ssd_inputs",
           "time_ssd_fwd_bwd", "TrainRun", "train_losses", "variation_in_subprocess"]

_FORMATS = {  # dtype: (exponent bits, mantissa bits, integer view)
    torch.float64: (11, 52, torch.int64),
    torch.float32: (8, 23, torch.int32),
    torch.bfloat16: (8, 7, torch.int16),
    torch.float16: (5, 10, torch.int16),
}


# ----------------------------------------------------------------------------------- float addition

def float_bits(x, dtype: torch.dtype = torch.float32) -> str:
    """``x`` in ``dtype`` as its bits, ``"sign exponent mantissa"`` (e.g. fp32 1.0 -> ``"0 01111111 000…0"``)."""
    if dtype not in _FORMATS:
        raise ValueError(f"dtype must be one of {sorted(map(str, _FORMATS))}; got {dtype}")
    e, m, int_dtype = _FORMATS[dtype]
    v = torch.as_tensor(x, dtype=dtype).reshape(1).view(int_dtype).item()
    width = 1 + e + m
    s = format(v & ((1 << width) - 1), f"0{width}b")
    return f"{s[0]} {s[1:1 + e]} {s[1 + e:]}"


def ordered_sum(values: Sequence[float] | torch.Tensor, order: Sequence[int] | None = None,
                dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """((v[o0] + v[o1]) + v[o2]) + …, each partial sum rounded to ``dtype``; a 0-d tensor of ``dtype``.

    ``order`` is a permutation of range(len(values)) (default: as given)."""
    v = torch.as_tensor(values, dtype=torch.float64).flatten().to(dtype)
    order = list(range(v.numel())) if order is None else [int(i) for i in order]
    if sorted(order) != list(range(v.numel())):
        raise ValueError(f"order must be a permutation of range({v.numel()}); got {order}")
    acc = torch.zeros((), dtype=dtype)
    for i in order:
        acc = acc + v[i]  # a 0-d add in dtype: rounded after every step, as one thread's running sum
    return acc


def order_spread(values: Sequence[float] | torch.Tensor, n_orders: int = 200, seed: int = 0,
                 dtype: torch.dtype = torch.float32) -> dict[float, int]:
    """Sum ``values`` in ``n_orders`` random orders (seeded): {result: how many orders gave it}, by result."""
    v = torch.as_tensor(values, dtype=torch.float64).flatten()
    gen = torch.Generator().manual_seed(seed)
    counts: dict[float, int] = {}
    for _ in range(n_orders):
        r = float(ordered_sum(v, torch.randperm(v.numel(), generator=gen).tolist(), dtype))
        counts[r] = counts.get(r, 0) + 1
    return dict(sorted(counts.items()))


# ----------------------------------------------------------------------------------- an atomic-add kernel

@triton.jit
def atomic_sum_kernel(
    x_ptr,          # (N,) fp32 values
    partial_ptr,    # (P,) fp32: each program's partial sum, written for the reader
    old_ptr,        # (P,) fp32: the total each program's atomic add found (what tl.atomic_add returns)
    total_ptr,      # (1,) fp32, zeroed: the sum, accumulated with atomics
    N,              # number of values
    BLOCK: tl.constexpr,   # values per program
):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    part = tl.sum(tl.load(x_ptr + offs, mask=offs < N, other=0.0), axis=0)
    old = tl.atomic_add(total_ptr, part)    # lands whenever the hardware schedules it: the order is not fixed
    tl.store(partial_ptr + pid, part)
    tl.store(old_ptr + pid, old)


@dataclass(frozen=True)
class AtomicSumRun:
    """One launch of :func:`atomic_sum_kernel`: the total, each program's partial, and the landing order
    (``order[k]`` = the program whose add landed k-th, recovered from the values the atomics returned)."""

    total: torch.Tensor
    partials: torch.Tensor
    order: list[int]


def fold_in_order(partials: torch.Tensor, order: Sequence[int]) -> torch.Tensor:
    """The reference for :func:`atomic_sum_kernel`: 0 + partials[order[0]] + partials[order[1]] + … in fp32."""
    return ordered_sum(partials.detach().cpu(), order, torch.float32)


def _landing_order(partials: torch.Tensor, olds: torch.Tensor) -> list[int]:
    """Chain the programs: the first found the total at 0, the next found 0 + first partial, and so on.
    Ties (two programs that found the same total, possible only when a partial rounds away) go to the lower
    program id; fold_in_order then still reproduces the total's bits."""
    partials, olds = partials.cpu(), olds.cpu()
    remaining = list(range(partials.numel()))
    acc = torch.zeros((), dtype=torch.float32)
    order = []
    while remaining:
        match = [i for i in remaining if olds[i].view(torch.int32) == acc.view(torch.int32)]
        if not match:
            raise RuntimeError("atomic_sum: the values returned by the atomics do not chain; "
                               "another launch wrote to the same total")
        i = match[0]
        order.append(i)
        remaining.remove(i)
        acc = acc + partials[i]
    return order


def atomic_sum(x: torch.Tensor, block: int = 4) -> AtomicSumRun:
    """Sum the fp32 vector ``x`` with :func:`atomic_sum_kernel`, ``block`` values per program.

    On a GPU the landing order is the hardware's; on the CPU interpreter it is launch order, unless the call
    sits inside :func:`mambalab.determinism.shuffled_program_order` (a seeded simulation)."""
    if not isinstance(x, torch.Tensor) or x.dim() != 1 or x.dtype != torch.float32 or x.numel() == 0:
        raise ValueError(f"x must be a non-empty 1-d fp32 tensor; got {getattr(x, 'shape', type(x))}")
    if block < 1 or block & (block - 1):
        raise ValueError(f"block must be a positive power of two; got {block}")
    from mambalab import device as _device

    _device.ensure_kernel_device(x.device)
    n_programs = triton.cdiv(x.numel(), block)
    partials = torch.empty(n_programs, device=x.device, dtype=torch.float32)
    olds = torch.empty_like(partials)
    total = torch.zeros(1, device=x.device, dtype=torch.float32)
    atomic_sum_kernel[(n_programs,)](x.contiguous(), partials, olds, total, x.numel(), BLOCK=block)
    return AtomicSumRun(total[0].cpu(), partials.cpu(), _landing_order(partials, olds))


# ----------------------------------------------------------------------------------- gradients that vary

SSD_GRAD_NAMES = ("x", "dt", "A", "B", "C", "D", "z", "dt_bias")


def ssd_inputs(b: int, l: int, h: int, p: int, g: int, n: int, *, dtype=torch.float32, device="cpu",
               seed: int = 0) -> dict[str, torch.Tensor]:
    """Random SSD inputs in ``mamba_chunk_scan_combined``'s layout (x, z (b, l, h, p); dt (b, l, h); A, D,
    dt_bias (h,); B, C (b, l, g, n)); x, z, B, C in ``dtype``, the rest fp32, and a cotangent ``dout``."""
    gen = torch.Generator().manual_seed(seed)
    act = lambda *s: torch.randn(*s, generator=gen).to(dtype)
    inp = {
        "x": act(b, l, h, p),
        "dt": (0.05 + 0.45 * torch.rand(b, l, h, generator=gen)).to(dtype),
        "A": -(0.5 + torch.rand(h, generator=gen)),
        "B": act(b, l, g, n),
        "C": act(b, l, g, n),
        "D": torch.randn(h, generator=gen),
        "z": act(b, l, h, p),
        "dt_bias": 0.1 * torch.randn(h, generator=gen),
        "dout": act(b, l, h, p),
    }
    return {k: v.to(device) for k, v in inp.items()}


def _mamba_ssm_chunk_scan():
    from mambalab import oracle

    return oracle.module("ops.triton.ssd_combined").mamba_chunk_scan_combined


def ssd_gradients(inputs: Mapping[str, torch.Tensor], chunk_size: int, *, impl: str = "mambalab",
                  reduction: str | None = "atomic") -> dict[str, torch.Tensor]:
    """One forward+backward of SSD on ``inputs`` (from :func:`ssd_inputs`): {name: gradient} for
    :data:`SSD_GRAD_NAMES`, from <out, dout>.

    impl: "mambalab" (:func:`mambalab.ops.ssd_chunk_scan` with ``reduction``) or "mamba_ssm"
    (``mamba_chunk_scan_combined``: needs a GPU; its own mode follows ``set_deterministic_mode``)."""
    if impl not in ("mambalab", "mamba_ssm"):
        raise ValueError(f"impl must be 'mambalab' or 'mamba_ssm'; got {impl!r}")
    leaves = {k: inputs[k].detach().requires_grad_() for k in SSD_GRAD_NAMES}   # fresh leaves, no copies
    args = [leaves[k] for k in ("x", "dt", "A", "B", "C")] + [chunk_size]
    kw = dict(D=leaves["D"], z=leaves["z"], dt_bias=leaves["dt_bias"], dt_softplus=True)
    if impl == "mambalab":
        from mambalab.ops import ssd_chunk_scan

        out = ssd_chunk_scan(*args, reduction=reduction, **kw)
    else:
        if inputs["x"].device.type != "cuda":
            raise RuntimeError("impl='mamba_ssm' needs CUDA tensors: mamba-ssm's Triton launchers call "
                               "torch.cuda.device(...) and cannot run on Triton's CPU interpreter")
        out = _mamba_ssm_chunk_scan()(*args, **kw)
    out.backward(inputs["dout"])
    return {k: v.grad for k, v in leaves.items()}


def time_ssd_fwd_bwd(inputs: Mapping[str, torch.Tensor], chunk_size: int, *, impl: str = "mambalab",
                     reduction: str | None = "deterministic", mamba_ssm_deterministic: bool | None = None,
                     warmup: int = 10, rep: int = 50) -> float:
    """Median time (ms, CUDA events via ``triton.testing.do_bench``) of one :func:`ssd_gradients` call: SSD
    forward+backward. GPU only. ``mamba_ssm_deterministic``: mamba-ssm's ``set_deterministic_mode`` while
    timing (None: leave it; an already-imported mamba-ssm keeps the autotune configurations it loaded with)."""
    import triton.testing

    if inputs["x"].device.type != "cuda":
        raise RuntimeError("time_ssd_fwd_bwd times on a GPU; the CPU interpreter's times say nothing about one")
    mode = None
    if impl == "mamba_ssm" and mamba_ssm_deterministic is not None:
        from mambalab import oracle

        mode = oracle.module("utils.determinism")
        mode.set_deterministic_mode(bool(mamba_ssm_deterministic))
    try:
        fn = lambda: ssd_gradients(inputs, chunk_size, impl=impl, reduction=reduction)
        return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))
    finally:
        if mode is not None:
            mode.set_deterministic_mode(None)


@dataclass(frozen=True)
class GradientVariation:
    """One row of :func:`gradient_variation`: a gradient's distinct bit patterns over the runs, and its largest
    elementwise difference from the first run (absolute, and relative to the first run's largest |value|)."""

    name: str
    shape: tuple[int, ...]
    runs: int
    distinct: int
    max_abs_diff: float
    max_rel_diff: float


def _bits_key(t: torch.Tensor) -> bytes:
    t = t.detach().contiguous().cpu()
    return t.view(torch.uint8).numpy().tobytes() if t.numel() else b""


def gradient_variation(step: Callable[[int], Mapping[str, torch.Tensor]], runs: int) -> list[GradientVariation]:
    """Call ``step(run)`` for run = 0 … runs-1 (each returns {name: tensor}, the same names every time) and
    tabulate, per name: distinct bit patterns, and max |t_run - t_0| over runs and elements."""
    if runs < 2:
        raise ValueError(f"runs must be at least 2 to compare runs; got {runs}")
    results = [dict(step(r)) for r in range(runs)]
    rows = []
    for name, first in results[0].items():
        patterns = {_bits_key(res[name]) for res in results}
        ref = first.detach().double().cpu()
        diff = max(float((res[name].detach().double().cpu() - ref).abs().max()) if ref.numel() else 0.0
                   for res in results)
        scale = float(ref.abs().max()) if ref.numel() else 0.0
        rows.append(GradientVariation(name, tuple(first.shape), runs, len(patterns), diff,
                                      diff / scale if scale > 0 else 0.0))
    return rows


PER_ROW_GRADS = ("x", "dt", "B", "C", "z")      # one slice per batch row
SUMMED_GRADS = ("A", "D", "dt_bias")            # summed over the batch rows


def batch_with_row0(inputs: Mapping[str, torch.Tensor], batch: int, seed: int) -> dict[str, torch.Tensor]:
    """``inputs``' row 0 followed by ``batch - 1`` fresh random rows (drawn from ``seed``); per-head tensors
    (A, D, dt_bias) kept. Row 0's gradients must not depend on what the other rows hold."""
    if batch < 1:
        raise ValueError(f"batch must be >= 1; got {batch}")
    _, l, h, p = inputs["x"].shape
    g, n = inputs["B"].shape[2:]
    others = ssd_inputs(batch - 1, l, h, p, g, n, dtype=inputs["x"].dtype, device=inputs["x"].device, seed=seed)
    return {k: (torch.cat([v[:1], others[k]]) if v.dim() > 1 else v) for k, v in inputs.items()}


def fingerprint_matrix(inputs: Mapping[str, torch.Tensor], chunk_size: int, *, profiles: Iterable[str],
                       batch_sizes: Iterable[int], runs: int, reduction: str,
                       simulate: bool) -> list[dict[str, object]]:
    """For every emulated profile × batch size × run, one SSD forward+backward of mambalab's op with
    ``reduction``, on row 0 of ``inputs`` plus batch-1 other rows (:func:`batch_with_row0`, seeded by the
    batch size). Returns one dict per call: profile, batch, run, ``row0`` (fingerprint of row 0's dx, ddt,
    dB, dC, dz) and ``summed`` (fingerprint of dA, dD, d dt_bias, which sum over the rows, so depend on
    the batch). simulate: run ``run`` under ``shuffled_program_order(run)`` (CPU interpreter only; a
    SIMULATION of a GPU's scheduling); on a GPU pass False, and the hardware orders the atomics."""
    from mambalab.determinism import emulate, fingerprint, shuffled_program_order

    rows = []
    for batch in batch_sizes:
        batch_inputs = batch_with_row0(inputs, batch, seed=1000 + batch)
        for profile in profiles:
            for run in range(runs):
                with emulate(profile), (shuffled_program_order(run) if simulate else contextlib.nullcontext()):
                    grads = ssd_gradients(batch_inputs, chunk_size, reduction=reduction)
                rows.append(dict(profile=profile, batch=batch, run=run,
                                 row0=fingerprint({k: grads[k][:1] for k in PER_ROW_GRADS}),
                                 summed=fingerprint({k: grads[k] for k in SUMMED_GRADS})))
    return rows


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


def norm_inputs(rows: int, d: int, *, dtype=torch.float32, device="cpu", seed: int = 0) -> dict[str, torch.Tensor]:
    """Random inputs of a norm forward+backward: x, z, dout (rows, d) in ``dtype``, weight (d,) fp32 near 1."""
    gen = torch.Generator().manual_seed(seed)
    inp = {"x": torch.randn(rows, d, generator=gen), "z": torch.randn(rows, d, generator=gen),
           "weight": 1.0 + 0.1 * torch.randn(d, generator=gen), "dout": torch.randn(rows, d, generator=gen)}
    return {k: (v if k == "weight" else v.to(dtype)).to(device) for k, v in inp.items()}


def norm_gradients(inputs: Mapping[str, torch.Tensor], *, impl: str = "mamba_ssm", kind: str = "gated",
                   group_size: int | None = None, eps: float = 1e-5) -> dict[str, torch.Tensor]:
    """One RMS-norm forward+backward on ``inputs`` (from :func:`norm_inputs`): {"weight": dw, "x": dx}.

    kind "gated": y = rmsnorm_g(x) ⊙ w ⊙ silu(z) (norm before the gate, per group of ``group_size``
    channels); "plain": y = rmsnorm(x) ⊙ w. impl "mamba_ssm": mamba-ssm's Triton kernels
    (``layernorm_gated.rmsnorm_fn``, ``layer_norm.rms_norm_fn``); they read ``multi_processor_count``, so on a
    machine without a GPU call this inside :func:`mambalab.determinism.emulate`, which answers for the
    profile and lets the kernels run on Triton's interpreter. impl "mambalab":
    :func:`mambalab.modules.norm.rmsnorm_fn` (``z=None`` for "plain")."""
    if impl not in ("mambalab", "mamba_ssm"):
        raise ValueError(f"impl must be 'mambalab' or 'mamba_ssm'; got {impl!r}")
    if kind not in NORM_KINDS:
        raise ValueError(f"kind must be one of {NORM_KINDS}; got {kind!r}")
    x = inputs["x"].detach().requires_grad_()
    w = inputs["weight"].detach().requires_grad_()
    z = inputs["z"] if kind == "gated" else None
    if impl == "mambalab":
        from mambalab.modules.norm import rmsnorm_fn

        y = rmsnorm_fn(x, w, None, z=z, eps=eps, group_size=group_size, norm_before_gate=True)
    else:
        from mambalab import oracle

        if kind == "gated":
            y = oracle.module("ops.triton.layernorm_gated").rmsnorm_fn(x, w, None, z=z, eps=eps, group_size=group_size,
                                                                        norm_before_gate=True)
        else:
            y = oracle.module("ops.triton.layer_norm").rms_norm_fn(x, w, None, eps=eps)
    y.backward(inputs["dout"])
    return {"weight": w.grad, "x": x.grad}


# ----------------------------------------------------------------------------------- two machines train

@contextlib.contextmanager
def _mamba_ssm_scan():
    """Inside, :class:`mambalab.modules.Mamba2` calls mamba-ssm's ``mamba_chunk_scan_combined`` instead of
    mambalab's SSD (same arguments; mamba-ssm takes no ``reduction``). GPU only."""
    from mambalab.modules import mamba2 as m2

    rival = _mamba_ssm_chunk_scan()
    own = m2.ssd_chunk_scan

    def scan(*args, reduction=None, **kw):
        return rival(*args, **kw)

    m2.ssd_chunk_scan = scan
    try:
        yield
    finally:
        m2.ssd_chunk_scan = own


class _Regressor(torch.nn.Module):
    """Linear in, one Mamba2 block, linear out: (b, l, d_in) -> (b, l, d_in)."""

    def __init__(self, d_in: int, d_model: int, **mamba_kw):
        super().__init__()
        from mambalab.modules import Mamba2

        self.inp = torch.nn.Linear(d_in, d_model)
        self.mixer = Mamba2(d_model, **mamba_kw)
        self.out = torch.nn.Linear(d_model, d_in)

    def forward(self, u):
        return self.out(self.mixer(self.inp(u)))


@dataclass(frozen=True)
class TrainRun:
    """What :func:`train_losses` records per step: the loss, and the parameters' fingerprint after the step."""

    losses: list[float]
    fingerprints: list[str]

    def first_divergence(self, other: "TrainRun") -> int | None:
        """The first step after which the parameters' bits differ from ``other``'s, or None if never."""
        return next((k for k, (a, b) in enumerate(zip(self.fingerprints, other.fingerprints)) if a != b), None)


def train_losses(steps: int, *, reduction: str | None = "deterministic", impl: str = "mambalab",
                 profile: str | None = None, schedule_seed: int | None = None, batch: int = 2, seqlen: int = 32,
                 d_in: int = 4, d_model: int = 16, d_state: int = 8, headdim: int = 4, ngroups: int = 1,
                 chunk_size: int = 16, lr: float = 1e-2, seed: int = 0, device: str = "cpu") -> TrainRun:
    """Train a tiny Mamba2 regressor for ``steps`` Adam steps from ``seed``; returns each step's loss and the
    fingerprint of the parameters after it (:class:`TrainRun`).

    The task: predict each input vector from three positions back (y_t = u_{t-3}; MSE), fresh random
    sequences every step, all drawn from ``seed`` so that two calls see the same data and initial weights.

    reduction: the SSD backward's ("atomic" or "deterministic"); impl "mamba_ssm" swaps in mamba-ssm's
    ``mamba_chunk_scan_combined`` (GPU only; its mode follows ``set_deterministic_mode``).
    profile: run under :func:`mambalab.determinism.emulate` of this profile (None: the real device).
    schedule_seed: CPU interpreter only, run every launch of step k in the shuffled program order seeded by
    (schedule_seed, k): a SIMULATION of how a GPU's scheduler orders atomics differently on each machine.
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1; got {steps}")
    if impl not in ("mambalab", "mamba_ssm"):
        raise ValueError(f"impl must be 'mambalab' or 'mamba_ssm'; got {impl!r}")
    if schedule_seed is not None and device != "cpu":
        raise ValueError("schedule_seed simulates a GPU's scheduling on the CPU interpreter; on a GPU the "
                         "hardware orders the atomics itself (pass schedule_seed=None)")
    from mambalab import determinism

    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = _Regressor(d_in, d_model, d_state=d_state, headdim=headdim, ngroups=ngroups, chunk_size=chunk_size,
                       reduction=reduction).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    data = [torch.randn(batch, seqlen + 3, d_in, generator=gen) for _ in range(steps)]
    losses, prints = [], []
    with contextlib.ExitStack() as stack:
        if profile is not None:
            stack.enter_context(determinism.emulate(profile))
        if impl == "mamba_ssm":
            stack.enter_context(_mamba_ssm_scan())
        for k, seq in enumerate(data):
            seq = seq.to(device)
            u, y = seq[:, 3:], seq[:, :-3]
            with (determinism.shuffled_program_order(schedule_seed * 100_003 + k) if schedule_seed is not None
                  else contextlib.nullcontext()):
                loss = torch.nn.functional.mse_loss(model(u), y)
                opt.zero_grad(set_to_none=True)
                loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
            prints.append(determinism.fingerprint(model))
    return TrainRun(losses, prints)


# ----------------------------------------------------------------------------------- a fresh process

_DTYPE_NAMES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def variation_in_subprocess(env: Mapping[str, str], *, impl: str, shape: Sequence[int], chunk_size: int,
                            runs: int, dtype: str = "fp32", device: str = "cuda", timeout: float = 600) -> dict:
    """:func:`gradient_variation` of :func:`ssd_gradients` in a fresh Python process whose environment adds
    ``env``: for variables read once, at import or at CUDA's start (``CUDA_LAUNCH_BLOCKING``,
    ``MAMBA_DETERMINISTIC``, ``TRITON_CACHE_AUTOTUNING``), which setting them in a running notebook would not
    reach. shape: (b, l, h, p, g, n). Returns {gradient name: distinct bit patterns over ``runs``}."""
    import json
    import os
    import subprocess
    import sys

    if dtype not in _DTYPE_NAMES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPE_NAMES)}; got {dtype!r}")
    spec = dict(impl=impl, shape=[int(s) for s in shape], chunk_size=int(chunk_size), runs=int(runs), dtype=dtype,
                device=device)
    proc = subprocess.run([sys.executable, "-m", "mambalab.determinism.experiments", json.dumps(spec)],
                          env={**os.environ, **{k: str(v) for k, v in env.items()}}, capture_output=True, text=True,
                          timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"the subprocess failed (rc={proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _main(argv: Sequence[str]) -> None:
    import json

    spec = json.loads(argv[0])
    inputs = ssd_inputs(*spec["shape"], dtype=_DTYPE_NAMES[spec["dtype"]], device=spec["device"])
    rows = gradient_variation(lambda _r: ssd_gradients(inputs, spec["chunk_size"], impl=spec["impl"]), spec["runs"])
    print(json.dumps({r.name: r.distinct for r in rows}))


if __name__ == "__main__":
    import sys

    _main(sys.argv[1:])
