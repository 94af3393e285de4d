"""Mamba-3's chunked scan (with gradients) and decode step on Triton kernels.

* :func:`mamba3_chunk_scan`: the exponential-trapezoidal, rotary, MIMO scan of :mod:`mambalab.ref.mamba3`
  (arguments of :func:`~mambalab.ref.mamba3.mamba3_chunked`), forward and backward. Triton does the heavy
  parts: the cumulative angle (:mod:`mambalab.kernels.mamba3.angle_cumsum`), the biased, rotated q̂ and k̂
  (:mod:`mambalab.kernels.mamba3.rotary`, both in one launch each way), MIMO's rank inputs v ⊙ W^V_r
  (:mod:`mambalab.kernels.mamba3.rank_inputs`), the scan itself, run on the SSD kernels as a rank-expanded
  SSD whose chunks give the step's own block the weight γ_t (:mod:`mambalab.kernels.mamba3.chunk_scan`: that
  block is the reference's within-step correction, so the correction costs no kernel of its own, and D is
  inside too), whose backward sums over programs through ``reduction``, and the output stage
  (:mod:`mambalab.kernels.mamba3.rank_outputs`: gate and Σ_r W^O). The step weights γ, σ are PyTorch around
  the kernels, differentiated by autograd (no atomics, no index_add).
* :func:`mamba3_step`: one decoding step, one Triton kernel (:mod:`mambalab.kernels.mamba3.step`).

Packed sequences (``cu_seqlens``, mamba-ssm's argument; :func:`_packed_scan`, beside the plain path of
:func:`mamba3_chunk_scan`): the angle cumsum restarts at each boundary, σ drops the next sequence's β at a
sequence's last step, and the SSD kernels mask with the rank-expanded seq_idx
(:mod:`mambalab.kernels.mamba3.chunk_scan`); per-sequence initial states, and final states that need a
gradient, are a few PyTorch einsums per sequence around the kernels (:func:`_sequence_states`).

Shapes (glossary b l h p g n r a; the full math is in :mod:`mambalab.ref.mamba3`):
    q, k (b, l, r, g, n); v, z (b, l, h, p); adt, dt, trap (b, l, h); q_bias, k_bias (h, r, n);
    angles (b, l, h, a); D (h,); mimo_v, mimo_z, mimo_o (h, r, p) (required when r > 1, absent when r = 1);
    state: :class:`~mambalab.ref.mamba3.Mamba3State` (angle (b, h, a), ssm (b, h, p, n), k (b, h, r, n),
    v (b, h, p)). The step takes the same tensors without their l axis.
"""
from __future__ import annotations

import torch

from mambalab import device as _device
from mambalab import validate
from mambalab.kernels import mamba3 as _kernels
from mambalab.kernels.ssd.tiles import MIN_DOT
from mambalab.ops.ssd import check_kernel_limits
from mambalab.ref.mamba3 import (Mamba3State, biased_rotated, check_inputs, wrap_angle,
                                 entering_state, step_weights)

REDUCTIONS = (None, "atomic", "deterministic")
_CHECKS = validate.SignatureCache()   # _check's outcomes by signature: a decode loop checks once
_NAMES = ("q", "k", "v", "adt", "dt", "trap", "q_bias", "k_bias", "angles", "D", "z", "mimo_v", "mimo_z",
          "mimo_o")


def _check(args, state, *, per_token, chunk_size=None, backward=False):
    """The reference's checks, plus the kernels' own: no fp64, a chunk of at least 16 positions, a device
    the kernels run on, sizes within their launch grids and 32-bit offsets (:func:`_check_limits`; with
    ``backward``, the backward's too). Returns (b, l, h, p, g, n, r, a)."""
    for name, t in zip(_NAMES, args):
        if t is not None:
            validate.tensor(name, t)
    if state is not None:
        for name, t in state._asdict().items():
            validate.tensor(f"state.{name}", t)
    sizes = check_inputs(*args, state, per_token=per_token, chunk_size=chunk_size)
    if chunk_size is not None:   # the chunked kernels' own limits
        r = sizes[6]
        if r & (r - 1):
            raise ValueError(f"the chunked kernels take a power-of-two rank r (1, 2, 4, 8, …); got r = {r} "
                             "(q.shape[-3])")
        if chunk_size * r < MIN_DOT:
            raise ValueError(f"chunk_size · r must be at least {MIN_DOT} (the kernels' dot products); got "
                             f"chunk_size = {chunk_size}, r = {r}")
        validate.chunk_count(sizes[1], chunk_size)
    _device.ensure_kernel_device(args[2].device)
    _check_limits(sizes, args[2], chunk_size, backward)
    return sizes


def _check_limits(sizes, v, chunk_size, backward):
    """The launch grids and 32-bit offsets of the kernels this op runs, before any launch. Every Mamba-3
    kernel puts the heads on grid axis 1 (the angle cumsum (b, h), rotary (T / BLOCK_T, h), rank inputs and
    outputs (T / BLOCK_T, h), the step (b, h, p / BLOCK_P)); the chunked scan runs the SSD kernels on
    (b, l · r, h, p) with chunks of chunk_size · r positions and a group per head, whose limits are
    :func:`mambalab.ops.ssd.check_kernel_limits`'."""
    b, l, h, p, g, n, r, a = sizes
    validate.launch_grid("the Mamba-3 kernels", (b, h), (("b (v.shape[0])", b), ("h (v.shape[-2])", h)),
                         "; split the heads across calls")
    if chunk_size is not None:
        check_kernel_limits(b, l * r, h, p, n, h, chunk_size * r, v.dtype, v.device, backward)


def _checked(args, state, *, per_token, chunk_size=None, backward=False):
    """:func:`_check`, once per signature: it reads only shapes, dtypes, devices, ``per_token``,
    ``chunk_size`` and ``backward``, so a loop calling an op with same-shaped inputs (a decoded token, a
    training step) runs it once, and any other signature is checked again (a chunk size of 16.0 or True too:
    the signature holds each value's type, :class:`mambalab.validate.SignatureCache`)."""
    fields = tuple(state) if isinstance(state, Mamba3State) else (state,)
    return _CHECKS.check((*args, *fields),
                         lambda: _check(args, state, per_token=per_token, chunk_size=chunk_size, backward=backward),
                         extra=(per_token, chunk_size, backward, type(state)))


class AngleFn(torch.autograd.Function):
    """θ = θ_{-1} + Σ_{s ≤ t} angles_s Δ_s along l: :func:`mambalab.kernels.mamba3.angle_cumsum_fwd` /
    ``angle_cumsum_bwd``.

    angles (b, l, h, a) fp32 (any strides); dt (b, l, h) fp32 contiguous; initial (b, h, a) fp32 contiguous or
    None; seq_idx (b, l) int32 contiguous or None (packed sequences: θ restarts at each, no initial) -> theta
    (b, l, h, a) fp32, contiguous.
    """

    @staticmethod
    def forward(ctx, angles, dt, initial, seq_idx=None):
        angles = angles if angles.stride(-1) == 1 else angles.contiguous()
        ctx.save_for_backward(angles, dt, seq_idx)
        ctx.has_init = initial is not None
        return _kernels.angle_cumsum_fwd(angles, dt, initial, seq_idx)

    @staticmethod
    def backward(ctx, dtheta):
        angles, dt, seq_idx = ctx.saved_tensors
        return (*_kernels.angle_cumsum_bwd(dtheta.contiguous(), angles, dt, ctx.has_init, seq_idx), None)


class Mamba3ScanFn(torch.autograd.Function):
    """q̂, k̂ and the rank-expanded SSD over them: :func:`mambalab.kernels.mamba3.rotary_qk_fwd` (q̂, k̂ in one
    launch) and :func:`~mambalab.kernels.mamba3.mamba3_scan_fwd` (the within-step correction and D inside), and
    their backwards (:func:`~mambalab.kernels.mamba3.rotary_qk_bwd`: dq, dk, both biases' gradients and dθ in
    one launch).
    One Function, so that the scan's dB, dC go straight into the rotary backward as the scan wrote them: in the
    kernels' dtype (bf16 on a GPU), each program's fp32 tile rounded once, in the default deterministic mode;
    fp32 in the atomic mode. bf16 there halves the bytes the scan writes and the rotary backward reads, for
    somewhat larger gradient errors against fp64 (d dt, d angles most).

    q, k (b, l, r, g, n) contiguous in the kernels' dtype; q_bias, k_bias (h, r, n) fp32; theta (b, l, h, a)
    fp32; x (b, l·r, h, p) in the kernels' dtype; adt, sigma, gamma (b, l, h) fp32; D (h,) fp32 or None;
    initial (b, h, p, n) fp32 or None; seq_idx (b, l) int32 or None and cu_seqlens (num_seqs + 1,) int32 or None
    (packed sequences, :mod:`mambalab.kernels.mamba3.chunk_scan`) -> (y (b, l·r, h, p) in x's dtype, D x
    included, final (b, h, p, n) fp32, or (num_seqs, h, p, n) with cu_seqlens, without a gradient). The SSD's
    B = k̂ and C = q̂ are (b, l·r, h, n) in x's dtype.
    """

    @staticmethod
    def forward(ctx, q, k, q_bias, k_bias, theta, x, adt, sigma, gamma, D, initial, r, chunk_size, reduction,
                seq_idx=None, cu_seqlens=None):
        q_hat, k_hat = _kernels.rotary_qk_fwd(q, k, q_bias, k_bias, theta, x.dtype)   # one launch, (b, l, r, h, n)
        C, B = q_hat.flatten(1, 2), k_hat.flatten(1, 2)                           # q̂, k̂ (b, l·r, h, n)
        fwd = _kernels.mamba3_scan_fwd(B, C, x, adt, sigma, gamma, D, initial, r, chunk_size, seq_idx, cu_seqlens)
        ctx.save_for_backward(q, k, q_bias, k_bias, theta, B, C, x, D, fwd.delta, fwd.cs, fwd.same, fwd.entering,
                              fwd.seq_idx)
        if cu_seqlens is not None:
            ctx.mark_non_differentiable(fwd.final)   # per-sequence states: the op forms them when a gradient must flow
        ctx.tiles, ctx.r, ctx.l = fwd.tiles, r, adt.shape[1]
        ctx.has_init, ctx.reduction = initial is not None, reduction
        ctx.set_materialize_grads(False)
        return fwd.y, fwd.final

    @staticmethod
    def backward(ctx, dy, dfinal):
        q, k, q_bias, k_bias, theta, B, C, x, D, delta, cs, same, entering, seq = ctx.saved_tensors
        dy = torch.zeros_like(x) if dy is None else dy.to(x.dtype).contiguous()
        dfinal = None if dfinal is None or seq is not None else dfinal.float().contiguous()
        fwd = _kernels.Mamba3ScanForward(None, None, delta, cs, same, entering, ctx.tiles, seq)
        g = _kernels.mamba3_scan_bwd(dy, dfinal, fwd, B, C, x, D, ctx.l, ctx.r, ctx.has_init, ctx.reduction)
        ranks = lambda t: t.view(*q.shape[:3], *t.shape[2:])                    # (b, l·r, ...) -> (b, l, r, ...)
        dq, dk, dq_bias, dk_bias, dtheta = _kernels.rotary_qk_bwd(ranks(g.dC), ranks(g.dB), q, k, q_bias, k_bias,
                                                                   theta)   # dC, dB as they are
        return (dq.to(q.dtype), dk.to(k.dtype), dq_bias, dk_bias, dtheta, g.dx, g.dadt, g.dsigma, g.dgamma, g.dD,
                g.dinitial, None, None, None, None, None)


class RankInputsFn(torch.autograd.Function):
    """MIMO's rank inputs x_r = v ⊙ W^V_r: :func:`mambalab.kernels.mamba3.rank_inputs_fwd` / ``rank_inputs_bwd``
    (dv and dW^V in one pass). v (T, h, p) contiguous in the kernels' dtype; wv (h, r, p) fp32 contiguous ->
    x (T, r, h, p) in v's dtype."""

    @staticmethod
    def forward(ctx, v, wv):
        ctx.save_for_backward(v, wv)
        return _kernels.rank_inputs_fwd(v, wv)

    @staticmethod
    def backward(ctx, dx):
        v, wv = ctx.saved_tensors
        return _kernels.rank_inputs_bwd(dx.contiguous(), v, wv)


class RankOutputsFn(torch.autograd.Function):
    """out = Σ_r W^O_r ⊙ y_r ⊙ silu(z ⊙ W^Z_r) (SISO: y ⊙ silu(z)): :func:`mambalab.kernels.mamba3.rank_outputs_fwd`
    / ``rank_outputs_bwd``. y (T, r, h, p); z (T, h, p) or None; wz, wo (h, r, p) fp32 or None -> out (T, h, p)
    in y's dtype."""

    @staticmethod
    def forward(ctx, y, z, wz, wo):
        ctx.save_for_backward(y, z, wz, wo)
        return _kernels.rank_outputs_fwd(y, z, wz, wo)

    @staticmethod
    def backward(ctx, dout):
        return _kernels.rank_outputs_bwd(dout.contiguous(), *ctx.saved_tensors)   # (dy, dz, dwz, dwo)


def _packed(cu_seqlens, v, sizes, initial_state):
    """Check ``cu_seqlens`` (read back: it is small) and the per-sequence ``initial_state`` -> (seq_idx (1, l)
    int32, each step's sequence; the bounds [cu_0, …, cu_S] as ints)."""
    b, l, h, p, g, n, r, a = sizes
    bounds = validate.cu_seqlens(cu_seqlens, "v", v)
    if b != 1:
        raise ValueError(f"packed sequences (cu_seqlens) lie along l of one batch row; got b = {b} (v.shape[0])")
    if bounds[0] != 0 or bounds[-1] != l or any(e <= s for s, e in zip(bounds, bounds[1:])):
        raise ValueError(f"cu_seqlens must start at 0, increase strictly (no empty sequence) and end at l = {l}; "
                         f"got {bounds}")
    S = len(bounds) - 1
    if initial_state is not None:   # one state per sequence
        if not isinstance(initial_state, Mamba3State):
            raise TypeError(f"initial_state must be a Mamba3State; got {type(initial_state).__name__}")
        for name, t, shp, meaning in zip(initial_state._fields, initial_state,
                                         ((S, h, a), (S, h, p, n), (S, h, r, n), (S, h, p)),
                                         ("(num_seqs, h, a)", "(num_seqs, h, p, n)", "(num_seqs, h, r, n)",
                                          "(num_seqs, h, p)")):
            validate.tensor(f"initial_state.{name}", t)
            validate.shape(f"initial_state.{name}", t, shp, meaning)
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    seq = torch.arange(S, device=v.device, dtype=torch.int32)
    return torch.repeat_interleave(seq, lengths, output_size=l)[None], bounds   # (1, l)


def _sequence_states(y, final, q, k, q_bias, k_bias, theta, x, adt, dt, trap, sigma, initial_state, mimo_v, bounds,
                     r, own_final):
    """What the SSD kernels leave to PyTorch in packed mode (autograd differentiates it): each sequence's
    initial state, and the final states when a gradient must flow from them.

    Per sequence s (steps f … e), with A_t = Σ_{f ≤ t' ≤ t} A_t'Δ_t' (an fp64 cumsum) and H̃^s its entering
    state (:func:`~mambalab.ref.mamba3.entering_state` at step f):

        y_{t,r} += exp(A_t) H̃^s q̂_{t,r}                                       (initial_state)
        H^s_final = Σ_{t, r} exp(A_e - A_t) σ_t x_{t,r} k̂_{t,r}ᵀ  [+ exp(A_e) H̃^s]   (own_final; else the kernels')

    One einsum per sequence, O(l h p n) in all. y (1, l·r, h, p); final (num_seqs, h, p, n) from the kernels
    or None; q, k (1, l, r, g, n); theta (1, l, h, a); x (1, l·r, h, p); adt, dt, trap, sigma (1, l, h).
    Returns (y, final (num_seqs, h, p, n) fp32)."""
    _, L, h, p = y.shape
    acum = adt[0].double().cumsum(0)                                          # (l, h)
    q_hat = None if initial_state is None else biased_rotated(q.float(), q_bias, theta)[0]   # (l, r, h, n)
    k_hat = biased_rotated(k.float(), k_bias, theta)[0] if own_final else None
    if initial_state is not None:
        first = torch.tensor(bounds[:-1], device=dt.device)
        entering = entering_state(initial_state, dt[0, first, None], trap[0, first, None], mimo_v)   # (S, h, p, n)
    ys, finals = [], []
    for i, (s, e) in enumerate(zip(bounds, bounds[1:])):
        A = (acum[s:e] - (acum[s - 1] if s else 0)).float()                 # (e - s, h)
        if initial_state is not None:
            ys.append(torch.einsum("trhn,hpn->trhp", q_hat[s:e], entering[i]) * A.exp()[:, None, :, None])
        if final is None and not own_final:
            continue
        F_ = final[i] if not own_final else torch.einsum(
            "trhp,trhn->hpn", x[0, s * r:e * r].float().view(e - s, r, h, p)
            * ((A[-1] - A).exp() * sigma[0, s:e])[:, None, :, None], k_hat[s:e])
        if initial_state is not None:
            F_ = F_ + A[-1].exp()[:, None, None] * entering[i]
        finals.append(F_)
    if ys:
        y = y + torch.cat(ys).reshape(1, L, h, p).to(y.dtype)
    return y, (torch.stack(finals) if finals else None)


def mamba3_chunk_scan(q, k, v, adt, dt, trap, q_bias, k_bias, angles, D=None, z=None, mimo_v=None, mimo_z=None,
                      mimo_o=None, initial_state=None, return_final_state=False, chunk_size=64, reduction=None,
                      cu_seqlens=None):
    """Mamba-3's scan with gradients: the arguments and results of :func:`mambalab.ref.mamba3.mamba3_chunked`.

    Per head (module docstring of :mod:`mambalab.ref.mamba3` for the rest):

        H_t = α_t H_{t-1} + (1 - λ_t) Δ_t α_t U_{t-1} + λ_t Δ_t U_t,   U_t = Σ_r (v_t ⊙ W^V_r) k̂_{t,r}ᵀ
        out_t = Σ_r W^O_r ⊙ ((H_t q̂_{t,r} + D v_t ⊙ W^V_r) ⊙ silu(z_t ⊙ W^Z_r))

    dt: no NaN or infinity (checked, as the SSD and selective scan check theirs).
    chunk_size: steps per chunk, an int (not a float or bool), a power of two with chunk_size · r >= 16 (the
        SSD kernels see chunks of chunk_size · r positions; mamba-ssm suggests 64 for SISO and 64 / r for MIMO).
    initial_state: a :class:`~mambalab.ref.mamba3.Mamba3State` or None. return_final_state: also return the
        state after the last step (fp32; gradients flow from its ssm, k and angle).
    reduction: how the SSD backward sums over programs: "deterministic" (per-program partials folded in a
        fixed order by :func:`mambalab.kernels.reduce.sum_partials`; None means this) or "atomic".

    Rotary layout: the pairs (2i, 2i+1) of q̂, k̂ turn (mamba-ssm's SISO layout). mamba-ssm's MIMO (``mamba3_mimo``)
    turns (i, i + n/2): to compute its function, pass q, k, q_bias, k_bias indexed by
    :func:`mambalab.ref.mamba3.halves_order` on their last axis, as :class:`mambalab.modules.Mamba3` does.

    cu_seqlens: packed sequences (mamba-ssm's ``cu_seqlens``): (num_seqs + 1,) integers, 0 = cu_0 < cu_1 < … <
        cu_S = l, with b = 1; sequence i is steps cu_i … cu_{i+1} - 1. Each runs as if alone: from a zero state
        (H, θ and the previous k, v of the trapezoid) or from its own initial_state, whose tensors then have
        num_seqs in place of b, as the final state's do (mamba-ssm's layout).

    Returns out (b, l, h, p) in v's dtype, or (out, final state). Inputs fp32/fp16/bf16: q, k, v, z are read
    in their dtype on a GPU (fp32 on the CPU interpreter), q̂, k̂ and the scan's inputs written in v's dtype;
    step sizes and their weights γ, σ, angles, biases, W's and the state are fp32. The within-step terms (a
    step's ranks on each other, weight γ_t) come from the scan's dots of q̂, k̂ in the compute dtype.
    """
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be None, 'atomic' or 'deterministic'; got {reduction!r}")
    reduction = reduction or "deterministic"
    args = (q, k, v, adt, dt, trap, q_bias, k_bias, angles, D, z, mimo_v, mimo_z, mimo_o)
    tensors = (*args, *(initial_state if isinstance(initial_state, Mamba3State) else ()))
    backward = validate.records_autograd(*tensors)
    sizes = _checked(args, initial_state if cu_seqlens is None else None, per_token=False, chunk_size=chunk_size,
                     backward=backward)
    # before anything else runs on the device (the casts, seq_idx): a NaN in dt launches nothing
    validate.finite("dt", dt)
    if cu_seqlens is not None:
        return _packed_scan(cu_seqlens, args, sizes, initial_state, return_final_state, chunk_size, reduction,
                            backward)
    dtype_in, (q, k, v, adt, dt, trap, q_bias, k_bias, angles, D, z, mimo_v, mimo_z, mimo_o), initial_state = _cast(
        args, initial_state)
    theta = AngleFn.apply(angles, dt.contiguous(),
                          None if initial_state is None else initial_state.angle.contiguous())   # (b, l, h, a)
    gamma, sigma = step_weights(dt, trap)                                     # (b, l, h)
    entering0 = entering_state(initial_state, dt, trap, mimo_v)              # (b, h, p, n) or None
    x = _scan_input(v, mimo_v, sizes)
    y, final = _scan(q, k, q_bias, k_bias, theta, x, adt, sigma, gamma, D, entering0, sizes, chunk_size, reduction)
    out = _output(y, z, mimo_v, mimo_z, mimo_o, sizes).to(dtype_in)
    if not return_final_state:
        return out
    return out, _final_state(theta[:, -1], final, k[:, -1], k_bias, v[:, -1])   # every batch row's last step


def _packed_scan(cu_seqlens, args, sizes, initial_state, return_final_state, chunk_size, reduction, backward):
    """:func:`mamba3_chunk_scan` over packed sequences (``cu_seqlens``), on inputs it has checked. The kernels
    run every sequence from zero; PyTorch adds the initial states, and forms the final states when a gradient
    must flow from them (:func:`_sequence_states`)."""
    seq_idx, bounds = _packed(cu_seqlens, args[2], sizes, initial_state)   # (1, l)
    own_final = return_final_state and backward
    dtype_in, (q, k, v, adt, dt, trap, q_bias, k_bias, angles, D, z, mimo_v, mimo_z, mimo_o), initial_state = _cast(
        args, initial_state)
    theta = AngleFn.apply(angles, dt.contiguous(), None, seq_idx)            # (1, l, h, a), from 0 per sequence
    if initial_state is not None:
        theta = theta + initial_state.angle[seq_idx[0].long()][None]          # each sequence's θ_{-1}
    gamma, sigma = step_weights(dt, trap, seq_idx)                            # (1, l, h)
    x = _scan_input(v, mimo_v, sizes)
    y, final = _scan(q, k, q_bias, k_bias, theta, x, adt, sigma, gamma, D, None, sizes, chunk_size, reduction,
                     seq_idx, None if own_final else cu_seqlens.to(torch.int32))
    if initial_state is not None or own_final:
        y, final = _sequence_states(y, final if return_final_state and not own_final else None, q, k, q_bias,
                                    k_bias, theta, x, adt, dt, trap, sigma, initial_state, mimo_v, bounds, sizes[6],
                                    own_final)
    out = _output(y, z, mimo_v, mimo_z, mimo_o, sizes).to(dtype_in)
    if not return_final_state:
        return out
    last = cu_seqlens[1:].long() - 1                                          # every sequence's last step
    return out, _final_state(theta[0, last], final, k[0, last], k_bias, v[0, last])


def _cast(args, initial_state):
    """The activations q, k, v, z in the kernels' dtype, the rest (step sizes, angles, biases, D, W's and the
    state) in fp32 -> (v's dtype, the cast args in :data:`_NAMES`' order, the cast initial_state or None)."""
    v = args[2]
    kd = _device.compute_dtype(v.dtype, v.device)
    cast = tuple(None if t is None else t.to(kd) if name in ("q", "k", "v", "z") else t.float()
                 for name, t in zip(_NAMES, args))
    state = None if initial_state is None else Mamba3State(*(t.float() for t in initial_state))
    return v.dtype, cast, state


def _scan_input(v, mimo_v, sizes):
    """The SSD's input x (b, l·r, h, p) in the kernels' dtype: v ⊙ W^V_r (MIMO) or v itself (SISO)."""
    b, l, h, p, g, n, r, a = sizes
    v_rows = v.reshape(b * l, h, p).contiguous()                              # (T, h, p)
    if mimo_v is None:
        return v_rows.view(b, l, h, p)
    return RankInputsFn.apply(v_rows, mimo_v.contiguous()).view(b, l * r, h, p)


def _scan(q, k, q_bias, k_bias, theta, x, adt, sigma, gamma, D, entering, sizes, chunk_size, reduction,
          seq_idx=None, cu_seqlens=None):
    """:class:`Mamba3ScanFn` on contiguous inputs -> (y (b, l·r, h, p), final). The within-step correction is
    inside the scan (the same step's block of the chunk takes γ_t: see kernels.mamba3.chunk_scan), and
    D x = D v ⊙ W^V_r too; what is left is the output stage, the gate and Σ_r W^O (:func:`_output`)."""
    c = lambda t: None if t is None else t.contiguous()
    return Mamba3ScanFn.apply(c(q), c(k), c(q_bias), c(k_bias), theta, x, c(adt), c(sigma), c(gamma), c(D),
                              c(entering), sizes[6], chunk_size, reduction, seq_idx, cu_seqlens)


def _output(y, z, mimo_v, mimo_z, mimo_o, sizes):
    """y (b, l·r, h, p) -> out (b, l, h, p): the gate and Σ_r W^O (:class:`RankOutputsFn`), or y itself for
    SISO without a gate."""
    b, l, h, p, g, n, r, a = sizes
    if mimo_v is None and z is None:
        return y.view(b, l, h, p)
    c = lambda t: None if t is None else t.contiguous()
    return RankOutputsFn.apply(y.view(b * l, r, h, p), None if z is None else z.reshape(b * l, h, p).contiguous(),
                               c(mimo_z), c(mimo_o)).view(b, l, h, p)


def _final_state(theta_last, final, k_last, k_bias, v_last):
    """The state after each row's (or sequence's) last step: theta_last (·, h, a), final (·, h, p, n),
    k_last (·, r, g, n), v_last (·, h, p) -> :class:`~mambalab.ref.mamba3.Mamba3State` in fp32."""
    k_hat = biased_rotated(k_last.float(), k_bias, theta_last).transpose(1, 2)   # (·, h, r, n)
    return Mamba3State(wrap_angle(theta_last), final, k_hat, v_last.float())


def mamba3_step(state, q, k, v, adt, dt, trap, q_bias, k_bias, angles, D=None, z=None, mimo_v=None, mimo_z=None,
                mimo_o=None):
    """One decoding step of Mamba-3 (one Triton kernel): the arguments and results of
    :func:`mambalab.ref.mamba3.mamba3_step_ref`.

    state: :class:`~mambalab.ref.mamba3.Mamba3State`; q, k (b, r, g, n); v, z (b, h, p); adt, dt, trap (b, h);
    q_bias, k_bias (h, r, n); angles (b, h, a); D (h,); mimo_* (h, r, p) -> (out (b, h, p) in v's dtype, new
    state in fp32); dt holds no NaN or infinity (checked). Forward only: raises NotImplementedError when
    autograd would need a graph.
    """
    args = (q, k, v, adt, dt, trap, q_bias, k_bias, angles, D, z, mimo_v, mimo_z, mimo_o)
    if not isinstance(state, Mamba3State):
        raise TypeError(f"state must be a Mamba3State (angle, ssm, k, v); got {type(state).__name__} "
                        "(mambalab.ref.mamba3.zero_state makes an empty one)")
    _checked(args, state, per_token=True)
    dt_finite = validate.Finite("dt", dt)   # queued here, waited for just before the launch
    validate.decoding_only("mamba3_step", *args, *state, hint=", or use mamba3_chunk_scan for gradients")
    kd = _device.compute_dtype(v.dtype, v.device)
    # activations in the kernels' dtype; step sizes, angles, biases and the state in fp32
    activations = {"q", "k", "v", "z", "mimo_v", "mimo_z", "mimo_o"}
    prep = lambda name, t: None if t is None else t.to(kd if name in activations else torch.float32).contiguous()
    f32 = lambda t: t.float().contiguous()
    dt_finite.check()
    out, angle, ssm, k_new, v_new = _kernels.mamba3_step_fwd(
        f32(state.angle), f32(state.ssm), f32(state.k), f32(state.v), *(prep(*na) for na in zip(_NAMES, args)))
    return out.to(v.dtype), Mamba3State(angle, ssm, k_new, v_new)
