"""Mamba-2's SSD (chunked scan) on Triton kernels.

* :func:`ssd_chunk_scan`: forward and backward (an autograd.Function), drop-in for mamba-ssm's
  ``mamba_chunk_scan_combined`` (its arguments in its order, packed sequences included: ``seq_idx``,
  ``cu_seqlens`` with ``return_varlen_states``); gradients reach x, dt, A, B, C, D, z, dt_bias and
  initial_states, from out and (when returned) from final_states. Sums over programs in the backward go
  through ``reduction``: "atomic" or "deterministic" (see :mod:`mambalab.kernels.ssd.backward`).
* :func:`ssd_chunk_scan_forward`: the forward alone; it raises NotImplementedError rather than returning
  outputs without a graph when autograd is recording.
* :func:`check_inputs`, :func:`kernel_inputs`: the op's validation and the tensors its kernels read, for
  callers that launch the kernels' steps themselves (the context-parallel ring, :mod:`mambalab.parallel.context`),
  so they accept what the op accepts and their kernels see the op's inputs, bit for bit.

Packed sequences: several sequences laid end to end along l, ``seq_idx`` (b, l) giving each position's
sequence (nondecreasing); the state restarts at every change, so each sequence's outputs are those it would
have alone (:mod:`mambalab.kernels.ssd.packed` has the masks). ``return_varlen_states`` with ``cu_seqlens``
(num_seqs + 1,) also returns each sequence's final state (b = 1).
"""
from __future__ import annotations

import math

import torch

from mambalab import device as _device
from mambalab import validate
from mambalab.determinism import resolve_reduction
from mambalab.kernels import ssd as _kernels

MIN_CHUNK_SIZE = 16  # tl.dot wants blocks of at least 16


def _check_packed(x, seq_idx, cu_seqlens, return_varlen_states):
    """mamba-ssm's packed-sequence arguments, checked before any launch (x already checked). Returns
    (seq_idx as the kernels take it, (b, l) int32 contiguous, or None; cu_seqlens, or None when no varlen states
    are asked for; the checks still to run just before the launch, a list).

    seq_idx: (b, l) int32 or int64 on x's device, nondecreasing along l but for negative entries (padding, as
    mamba-ssm's -1) (checked on the device, read back just before the launch). cu_seqlens matters only with
    ``return_varlen_states`` (as in mamba-ssm): then it is (num_seqs + 1,) int32 or int64 on x's device, 0
    first, nondecreasing (an empty sequence's state is zero), at most l last (positions after it are padding;
    read back now: it is small), b must be 1, and seq_idx must mark the sequences unless there is only one.
    """
    b, l = x.shape[0], x.shape[1]
    checks = []
    if seq_idx is not None:
        validate.index_tensor("seq_idx", seq_idx)
        validate.shape("seq_idx", seq_idx, (b, l), "(b, l), like x's first two")
        if seq_idx.device != x.device:
            raise ValueError(f"seq_idx is on {seq_idx.device} but x is on {x.device}; all inputs must be on the "
                             "same device")
        checks.append(validate.Nondecreasing("seq_idx", seq_idx))
        seq_idx = seq_idx.to(torch.int32).contiguous()
    if not return_varlen_states:
        return seq_idx, None, checks
    if cu_seqlens is None:
        raise ValueError("return_varlen_states=True needs cu_seqlens (num_seqs + 1,): where each sequence starts, "
                         "then where the last one ends")
    if b != 1:
        raise ValueError(f"return_varlen_states=True needs the sequences packed into one batch row, b = 1 "
                         f"(x.shape[0]); got b = {b}")
    bounds = validate.cu_seqlens(cu_seqlens, "x", x)
    if bounds[0] != 0 or any(e < s for s, e in zip(bounds, bounds[1:])) or bounds[-1] > l:
        raise ValueError(f"cu_seqlens must start at 0, never decrease and end at most at l = {l}; got {bounds}")
    if seq_idx is None and len(bounds) > 2:
        raise ValueError(f"cu_seqlens holds {len(bounds) - 1} sequences but seq_idx is None: pass seq_idx (1, l) "
                         "marking them, or the scan runs them as one sequence")
    return seq_idx, cu_seqlens.contiguous(), checks


def check_kernel_limits(b, l, h, p, n, g, chunk_size, dtype, device, backward, num_seqs=0):
    """The kernels' launch grids and 32-bit offsets (read from the launchers in :mod:`mambalab.kernels.ssd` and
    :func:`mambalab.kernels.reduce.sum_partials`), checked before any launch; ``backward``: the backward's too.

    Grids, with c chunks of q and the tile rule's blocks: chunk cumsum (b, c, h / BLOCK_H), chunk states
    (b, c, h · p / BLOCK_P), state passing (b, h, p · n / BLOCK_PN), chunk scan (b, c, h · q / BLOCK_T ·
    p / BLOCK_P); backward: the sweep (b, h · p / BLOCK_P'), the chunk scan's (b, c, h · q / BLOCK_T') and the
    sums over its programs, 32 partials a program on grid axis 1 (dA and d dt_bias: b · c; dD: b · c · q /
    BLOCK_T'; dB, dC: h / g). Offsets: the kernels count positions (b · l), chunk rows (b · h · c of q),
    state rows (b · c · h · p of n) and dD's partials (h · b · c · q / BLOCK_T') in 32-bit integers before
    widening. ``num_seqs`` > 0: the per-sequence final states too, (num_seqs, h · p / BLOCK_P).
    """
    cfg = _kernels.tile_config(h, p, n, chunk_size, _device.compute_dtype(dtype, device), ngroups=g)
    cdiv = lambda a, m: -(-a // m)
    c = cdiv(l, chunk_size)
    bsz, hsz = ("b (x.shape[0])", b), ("h (x.shape[2])", h)
    csz = ("the chunk count", c)
    split_h = "; split the heads across calls"
    grid = validate.launch_grid
    grid("the SSD chunk cumsum", (b, c, cdiv(h, cfg.block_h)), (bsz, csz, hsz), split_h)
    grid("the SSD chunk states", (b, c, h * cdiv(p, cfg.block_p)), (bsz, csz, hsz), split_h)
    grid("the SSD state passing", (b, h, cdiv(p * n, cfg.block_pn)), (bsz, hsz, ("p · n", p * n)), split_h)
    grid("the SSD chunk scan", (b, c, h * (chunk_size // cfg.block_t) * cdiv(p, cfg.block_p)), (bsz, csz, hsz),
         split_h)
    if num_seqs:
        grid("the SSD varlen states", (num_seqs, h * cdiv(p, cfg.block_p)), (("num_seqs", num_seqs), hsz),
             split_h)
    count = validate.int32_offsets
    split_b = ": split the batch"
    count(f"the positions (b, l) = ({b}, {l})", b * l, bsz, split_b)
    count(f"the chunk rows of Δ (b, h, c) = ({b}, {h}, {c})", b * h * c, bsz, split_b)
    count(f"the chunk states as rows of n, (b, c, h, p) = ({b}, {c}, {h}, {p})", b * c * h * p, bsz, split_b)
    if not backward:
        return
    bt = cfg.bwd_block_t
    grid("the SSD backward sweep", (b, h * cdiv(p, cfg.sweep_bwd_block_p)), (bsz, hsz), split_h)
    grid("the SSD chunk-scan backward", (b, c, h * (chunk_size // bt)), (bsz, csz, hsz), split_h)
    for what, partials in (("dA and d dt_bias", b * c), ("dD", b * c * (chunk_size // bt))):
        if partials > 32:
            grid(f"the SSD backward's sum of {what}", (1, cdiv(partials, 32)), (bsz, bsz),
                 ": split the batch")
    if h // g > 32:
        grid("the SSD backward's sum of dB and dC", (1, cdiv(h // g, 32)), (hsz, ("h / g", h // g)))
    count(f"dD's partials (h, b · c · q / {bt}) = ({h}, {b * c * (chunk_size // bt)})",
          h * b * c * (chunk_size // bt), bsz, split_b)


def _check(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, dt_limit, seq_idx=None, cu_seqlens=None,
           return_varlen_states=False, *, backward):
    """Validate at the boundary. Raises TypeError/ValueError naming the argument; returns (seq_idx and cu_seqlens
    as the kernels take them, see :func:`_check_packed`; the checks queued on the device, that dt is finite
    (:class:`mambalab.validate.Finite`) and seq_idx nondecreasing, for the caller to run just before the kernels
    launch). ``backward``: check the backward's limits too."""
    for name, t in (("x", x), ("dt", dt), ("A", A), ("B", B), ("C", C)):
        validate.tensor(name, t)
    for name, t in (("D", D), ("z", z), ("dt_bias", dt_bias), ("initial_states", initial_states)):
        if t is not None:
            validate.tensor(name, t)
    if x.dim() != 4:
        raise ValueError(f"x must have shape (b, l, h, p); got {tuple(x.shape)}")
    b, l, h, p = x.shape
    validate.shape("dt", dt, (b, l, h), "(b, l, h), like x's first three")
    validate.shape("A", A, (h,), "(h,)")
    if B.dim() != 4:
        raise ValueError(f"B must have shape (b, l, g, n) = ({b}, {l}, g, n); got {tuple(B.shape)}")
    g, n = B.shape[2], B.shape[3]
    validate.shape("B", B, (b, l, g, n), "(b, l, g, n)")
    validate.shape("C", C, (b, l, g, n), "(b, l, g, n), like B")
    if g == 0 or h % g:
        raise ValueError(f"the number of groups g = {g} (B.shape[2]) must divide the heads h = {h} (x.shape[2])")
    if D is not None and D.dim() == 2:
        validate.shape("D", D, (h, p), "(h, p)")
    elif D is not None:
        validate.shape("D", D, (h,), "(h,) or (h, p)")
    if z is not None:
        validate.shape("z", z, (b, l, h, p), "(b, l, h, p), like x")
    if dt_bias is not None:
        validate.shape("dt_bias", dt_bias, (h,), "(h,)")
    if initial_states is not None:
        validate.shape("initial_states", initial_states, (b, h, p, n), "(b, h, p, n)")
    validate.positive_int("chunk_size", chunk_size, power_of_two=True)
    if chunk_size < MIN_CHUNK_SIZE:
        raise ValueError(f"chunk_size must be at least {MIN_CHUNK_SIZE} (the kernels' dot products); "
                         f"got {chunk_size}")
    validate.chunk_count(l, chunk_size)
    try:
        lo, hi = (float(v) for v in dt_limit)
    except (TypeError, ValueError):
        raise ValueError(f"dt_limit must be a pair of numbers (min, max); got {dt_limit!r}") from None
    if math.isnan(lo) or math.isnan(hi) or lo > hi:
        raise ValueError(f"dt_limit must be (min, max) with min <= max; got {dt_limit!r}")
    dev = validate.same_device(x=x, dt=dt, A=A, B=B, C=C, D=D, z=z, dt_bias=dt_bias,
                               initial_states=initial_states)
    _device.ensure_kernel_device(dev)
    seq_idx, cu_seqlens, checks = _check_packed(x, seq_idx, cu_seqlens, return_varlen_states)
    check_kernel_limits(b, l, h, p, n, g, chunk_size, x.dtype, dev, backward,
                        num_seqs=cu_seqlens.shape[0] - 1 if cu_seqlens is not None else 0)
    kdtype = _device.compute_dtype(x.dtype, dev)   # the dtype _prepare gives the kernels
    validate.copies_fit("the SSD chunk scan", dev, [("x", x, kdtype), ("z", z, kdtype), ("B", B, kdtype),
                                                    ("C", C, kdtype), ("dt", dt, _device.compute_dtype(dt.dtype, dev))],
                        outputs=x.numel() * torch.empty((), dtype=kdtype).element_size(),   # out
                        hint="; split the batch or the sequence")
    return seq_idx, cu_seqlens, [validate.Finite("dt", dt), *checks]


def _varlen_states(res, x_, B_, init_, seq_idx, cu_seqlens):
    """Each packed sequence's final state from the forward's results, (num_seqs, h, p, n) fp32.

    The states entering the chunks are passed again in fp32 when the forward kept them in x's dtype (bf16,
    fp16) for its dots: each sequence's final state starts from one of them, and a bf16 copy would round it
    at 2^-8 (upstream's test_chunk_state_varlen, atol 3e-3, saw 7.8e-3 with such a copy:
    benchmarks/results/README.md, 2026-12-03)."""
    entering = res.entering_states
    if entering.dtype != torch.float32 and res.chunk_states is not None:
        entering, _ = _kernels.state_passing_fwd(res.chunk_states, res.dA_cumsum, init_, res.tiles,
                                                 store_dtype=torch.float32, seq_idx=seq_idx)
    return _kernels.varlen_states_fwd(x_, B_, res.delta, res.dA_cumsum, entering, seq_idx, cu_seqlens,
                                      res.tiles, _device.dot_precision(x_.dtype, x_.device))


def _results(out, final, varlen, return_final_states):
    """mamba-ssm's return order: out, then final_states if asked for, then varlen_states if asked for."""
    results = (out,) + ((final,) if return_final_states else ()) + ((varlen,) if varlen is not None else ())
    return results if len(results) > 1 else out


def ssd_chunk_scan_forward(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None,
                           seq_idx=None, cu_seqlens=None, dt_softplus=False, dt_limit=(0.0, float("inf")),
                           return_final_states=False, return_varlen_states=False):
    """Mamba-2's SSD, forward only; the arguments and results of mamba-ssm's ``mamba_chunk_scan_combined``.

    Per head, with Δ_t = clamp(softplus(dt_t + dt_bias), *dt_limit) (softplus only with ``dt_softplus``):

        s_t = exp(Δ_t A) s_{t-1} + Δ_t x_t B_tᵀ,    y_t = s_t C_t + D x_t,    out_t = y_t ⊙ silu(z_t)

    computed by the chunked SSD algorithm (see :mod:`mambalab.kernels.ssd`).

    Args:
        x: (b, l, h, p) inputs, fp32/fp16/bf16.  dt: (b, l, h) step sizes before bias/softplus (no NaN).
        A: (h,) decay rates (negative).  B, C: (b, l, g, n), g dividing h (head i reads group i // (h // g)).
        chunk_size: q, a power of two >= 16; any l works (the last chunk is padded inside).
        D: optional (h,) or (h, p) skip.  z: optional (b, l, h, p) gate.  dt_bias: optional (h,).
        initial_states: optional (b, h, p, n) state before the first step (with seq_idx: before the first
            step of the sequence numbered 0, as in mamba-ssm).
        seq_idx: optional (b, l) int32 (or int64), nondecreasing along l: the sequence of each position of
            sequences packed end to end; the state restarts from zero wherever it changes.
        cu_seqlens: (num_seqs + 1,) integers, 0 first, strictly increasing: sequence i's positions are
            cu_seqlens[i] … cu_seqlens[i + 1] - 1. Read only with ``return_varlen_states``.
        return_varlen_states: also return each sequence's final state, the state after its last position,
            (num_seqs, h, p, n) fp32 (needs cu_seqlens, b = 1, and seq_idx unless num_seqs = 1).
        dt_softplus: apply softplus to dt + dt_bias.  dt_limit: (min, max) clamp of Δ.
        return_final_states: also return the state after the last step, (b, h, p, n) fp32.

    The arguments are mamba-ssm's, in its order and with its defaults, so positional calls bind alike.

    Returns:
        out (b, l, h, p) in x's dtype; or a tuple, mamba-ssm's order: (out, final_states),
        (out, varlen_states) or (out, final_states, varlen_states).

    Raises:
        TypeError / ValueError naming the argument, before any launch: wrong types, dtypes, shapes, devices or
            values (NaN or infinity in dt); sizes beyond the kernels' launch grids (h at most 65,535 heads:
            CUDA's cap on grid axes 1 and 2; fewer for large p or q) or their 32-bit offsets; expanded or
            strided inputs whose contiguous copies, with the output, exceed the device's available memory.
        NotImplementedError: if an input requires grad while autograd is recording (this entry point is forward
            only; :func:`ssd_chunk_scan` has the backward).
    """
    seq_idx, cu_seqlens, checks = _check(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, dt_limit,
                                         seq_idx, cu_seqlens, return_varlen_states, backward=False)
    tensors = (x, dt, A, B, C, D, z, dt_bias, initial_states)
    if validate.records_autograd(*tensors):
        raise NotImplementedError(
            "ssd_chunk_scan_forward records no autograd graph, and an input requires grad: use "
            "mambalab.ops.ssd_chunk_scan for gradients, or call this under torch.no_grad().")
    x_, dt_, A_, B_, C_, D_, z_, bias_, init_ = _prepare(x, dt, A, B, C, D, z, dt_bias, initial_states)
    for check in checks:   # the last moment before the launch
        check.check()
    res = _kernels.ssd_chunk_scan_fwd(x_, dt_, A_, B_, C_, chunk_size, D_, z_, bias_, init_,
                                      bool(dt_softplus), tuple(float(v) for v in dt_limit), seq_idx=seq_idx)
    out = res.out if res.out.dtype == x.dtype else res.out.to(x.dtype)
    varlen = _varlen_states(res, x_, B_, init_, seq_idx, cu_seqlens) if cu_seqlens is not None else None
    return _results(out, res.final_states, varlen, return_final_states)


def _prepare(x, dt, A, B, C, D, z, dt_bias, initial_states):
    """The kernels' inputs: contiguous rows; on the CPU interpreter, fp32 (its bf16/fp16 arithmetic is wrong)."""
    def prep(t):
        if t is None:
            return None
        return (t if t.dtype == torch.float32 else t.to(_device.compute_dtype(t.dtype, t.device))).contiguous()

    x_, z_ = prep(x), prep(z)
    B_, C_ = B.to(x_.dtype).contiguous(), C.to(x_.dtype).contiguous()   # the dot products read them in x's dtype
    dt_, D_, bias_ = prep(dt), prep(D), prep(dt_bias)
    A_ = A.float().contiguous()
    init_ = initial_states.float().contiguous() if initial_states is not None else None
    return x_, dt_, A_, B_, C_, D_, z_, bias_, init_


def check_inputs(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None,
                 dt_limit=(0.0, float("inf")), seq_idx=None, *, backward: bool):
    """The checks :func:`ssd_chunk_scan` makes at its boundary, for a caller that launches the kernels' steps itself.

    Arguments as :func:`ssd_chunk_scan`'s (``backward``: check the backward's limits too). Raises TypeError /
    ValueError naming the argument, before any launch. Returns (seq_idx as the kernels take it, (b, l) int32
    contiguous, or None; the checks still to run just before the first launch, that dt is finite and seq_idx
    nondecreasing, each with a ``check()`` method: they read a value back from the device).
    """
    seq_idx, _, checks = _check(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, dt_limit, seq_idx,
                                backward=backward)
    return seq_idx, checks


def kernel_inputs(x, dt, A, B, C, D=None, z=None, dt_bias=None, initial_states=None):
    """The tensors the kernels read, made from inputs that passed :func:`check_inputs`: (x, dt, A, B, C, D, z,
    dt_bias, initial_states) contiguous, in the kernels' dtypes (B and C in x's, A and initial_states fp32; on
    the CPU interpreter fp32 throughout), None where the input is None. The op makes its own the same way."""
    return _prepare(x, dt, A, B, C, D, z, dt_bias, initial_states)


class SSDChunkScanFn(torch.autograd.Function):
    """Forward: :func:`mambalab.kernels.ssd.ssd_chunk_scan_fwd`, saving Δ, cs and the entering states, and with
    ``cu_seqlens`` the per-sequence final states (no gradient flows from those; mamba-ssm's backward refuses
    them altogether). Backward: :func:`mambalab.kernels.ssd.ssd_chunk_scan_bwd` from d out and d final_states."""

    @staticmethod
    def forward(ctx, x, dt, A, B, C, D, z, dt_bias, initial_states, chunk_size, dt_softplus, dt_limit, reduction,
                checks, seq_idx, cu_seqlens):
        x_, dt_, A_, B_, C_, D_, z_, bias_, init_ = _prepare(x, dt, A, B, C, D, z, dt_bias, initial_states)
        for check in checks:   # the last moment before the launch
            check.check()
        res = _kernels.ssd_chunk_scan_fwd(x_, dt_, A_, B_, C_, chunk_size, D_, z_, bias_, init_, dt_softplus,
                                          dt_limit, seq_idx=seq_idx)
        varlen = _varlen_states(res, x_, B_, init_, seq_idx, cu_seqlens) if cu_seqlens is not None else None
        if varlen is not None:
            ctx.mark_non_differentiable(varlen)
        # the backward needs Δ, cs and the entering states; not the chunk states (step 1's own output)
        ctx.save_for_backward(x_, dt_, A_, B_, C_, D_, z_, bias_, res.delta, res.dA_cumsum, res.entering_states,
                              seq_idx)
        ctx.tiles, ctx.has_init = res.tiles, initial_states is not None
        ctx.dt_softplus, ctx.dt_limit, ctx.reduction = dt_softplus, dt_limit, reduction
        ctx.dtypes = [t.dtype if t is not None else None for t in (x, dt, A, B, C, D, z, dt_bias, initial_states)]
        ctx.set_materialize_grads(False)
        out = res.out if res.out.dtype == x.dtype else res.out.to(x.dtype)
        return out, res.final_states, varlen

    @staticmethod
    def backward(ctx, dout, dfinal, dvarlen):
        x_, dt_, A_, B_, C_, D_, z_, bias_, delta, cs, entering, seq_idx = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(x_)
        dout = dout.to(x_.dtype).contiguous()
        dfinal = dfinal.float().contiguous() if dfinal is not None else None
        fwd = _kernels.SSDForward(None, None, delta, cs, None, entering, ctx.tiles)
        g = _kernels.ssd_chunk_scan_bwd(dout, dfinal, fwd, x_, dt_, A_, B_, C_, D_, z_, bias_, ctx.has_init,
                                        ctx.dt_softplus, ctx.dt_limit, ctx.reduction, seq_idx=seq_idx)
        grads = (g.dx, g.ddt, g.dA, g.dB, g.dC, g.dD, g.dz, g.ddt_bias, g.dinitial_states)
        grads = [None if gr is None or not need else gr.to(dt)
                 for gr, dt, need in zip(grads, ctx.dtypes, ctx.needs_input_grad)]
        return (*grads, None, None, None, None, None, None, None)


def ssd_chunk_scan(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None, seq_idx=None,
                   cu_seqlens=None, dt_softplus=False, dt_limit=(0.0, float("inf")), return_final_states=False,
                   return_varlen_states=False, *, reduction=None):
    """Mamba-2's SSD with gradients; the arguments and results of mamba-ssm's ``mamba_chunk_scan_combined``.

    Per head, with Δ_t = clamp(softplus(dt_t + dt_bias), *dt_limit) (softplus only with ``dt_softplus``):

        s_t = exp(Δ_t A) s_{t-1} + Δ_t x_t B_tᵀ,    y_t = s_t C_t + D x_t,    out_t = y_t ⊙ silu(z_t)

    Arguments as :func:`ssd_chunk_scan_forward` (mamba-ssm's, in its order, with its defaults), plus, keyword
    only,

        reduction: how the backward sums over programs (dA, ddt_bias, dD over batch rows and chunks; dB, dC
            over the heads of a group): "atomic" (tl.atomic_add, as mamba-ssm; on a GPU the last bits vary
            from run to run) or "deterministic" (per-program partials folded by
            :func:`mambalab.kernels.reduce.sum_partials` in an order fixed by the shape: the same bits on
            every run and machine, and per-row gradients independent of the batch). None: the determinism
            switch decides (:func:`mambalab.determinism.resolve_reduction`; "deterministic" unless switched off).

    Returns out (b, l, h, p) in x's dtype, or a tuple in mamba-ssm's order: (out, final_states (b, h, p, n)
    fp32), (out, varlen_states (num_seqs, h, p, n) fp32) or (out, final_states, varlen_states). Gradients flow
    from out and final_states; varlen_states carry none (mamba-ssm's backward refuses them).
    """
    reduction = resolve_reduction(reduction)   # None: the determinism switch's mode (default "deterministic")
    tensors = (x, dt, A, B, C, D, z, dt_bias, initial_states)
    backward = validate.records_autograd(*tensors)
    seq_idx, cu_seqlens, checks = _check(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, dt_limit,
                                         seq_idx, cu_seqlens, return_varlen_states, backward=backward)
    out, final, varlen = SSDChunkScanFn.apply(x, dt, A, B, C, D, z, dt_bias, initial_states, chunk_size,
                                              bool(dt_softplus), tuple(float(v) for v in dt_limit), reduction, checks,
                                              seq_idx, cu_seqlens)
    return _results(out, final, varlen, return_final_states)
