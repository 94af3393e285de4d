"""The decode step of Mamba-1 and Mamba-2: :func:`selective_state_update`, drop-in for mamba-ssm's function of
that name (``mamba_ssm.ops.triton.selective_state_update``): same arguments, order, defaults and result.

Checks the shapes, then runs :mod:`mambalab.kernels.state_update` (one Triton kernel; on a CPU in Triton's
interpreter, in fp32). The inputs' values are not checked for NaN: a decode step's inputs are a model's
activations, and reading them back would cost the device a wait per layer and token.
"""
from __future__ import annotations

import torch

from mambalab import device as _device
from mambalab import validate
from mambalab.kernels.state_update import state_update_fwd

__all__ = ["selective_state_update"]


def selective_state_update(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False,
                           state_batch_indices=None, *, dt_limit=None, A_is_log=False):
    """One decoding step of a diagonal SSM; ``state`` is updated in place.

    Math: :mod:`mambalab.ref.state_update` (whose
    :func:`~mambalab.ref.state_update.selective_state_update_ref` is this op's reference). Shapes, as
    mamba-ssm's: state (b, dim, n) or (b, h, dim, n); x, dt, z (b, dim) or (b, h, dim); A (dim, n) or
    (h, dim, n); B, C (b, n) or (b, g, n) with g dividing h; D, dt_bias (dim,) or (h, dim).
    ``state_batch_indices`` (b,) picks the state row of each batch row (state may then have more rows than
    b); a negative index is a padding row: zero output, no state touched. ``dt_limit`` (mambalab's, keyword
    only): Δ clamped to (low, high) after the softplus, as Mamba-2's scan does. ``A_is_log`` (mambalab's,
    keyword only): A holds the blocks' parameter A_log and the kernel uses A = -exp(A_log), in fp32 (a decode
    step then launches no kernels to form A). Inputs may broadcast with
    stride 0 (Mamba-2 passes its per-head Δ and A expanded over (dim, n)): no copy is made. Returns out, the
    shape and dtype of x. Forward only (decoding), so no input may require grad under autograd.
    """
    names = ("state", "x", "dt", "A", "B", "C", "D", "z", "dt_bias")
    given = dict(zip(names, (state, x, dt, A, B, C, D, z, dt_bias)))
    for name, t in given.items():
        if t is not None:
            validate.tensor(name, t)
    heads = state.dim() == 4
    if state.dim() not in (3, 4):
        raise ValueError(f"state must have shape (b, dim, n) or (b, h, dim, n); got {tuple(state.shape)}")
    if not heads:
        lift = {"state": 1, "x": 1, "dt": 1, "A": 0, "B": 1, "C": 1, "D": 0, "z": 1, "dt_bias": 0}
        given = {k: (t.unsqueeze(lift[k]) if t is not None else None) for k, t in given.items()}
    state, x, dt, A, B, C, D, z, dt_bias = given.values()
    rows, h, dim, n = state.shape
    b = x.shape[0]
    meaning = "(b, h, dim)" if heads else "(b, dim)"
    validate.shape("x", x, (b, h, dim), meaning)
    validate.shape("dt", dt, (b, h, dim), meaning)
    if z is not None:
        validate.shape("z", z, (b, h, dim), meaning)
    validate.shape("A", A, (h, dim, n), "(h, dim, n)" if heads else "(dim, n)")
    if B.dim() != 3 or B.shape[1] == 0 or h % B.shape[1]:
        want = f"(b, g, n) with g dividing h = {h}" if heads else "(b, n)"
        raise ValueError(f"B must have shape {want}; got {tuple(given['B'].shape if heads else B[:, 0].shape)}")
    g = B.shape[1]
    validate.shape("B", B, (b, g, n), "(b, g, n)" if heads else "(b, n)")
    validate.shape("C", C, (b, g, n), "(b, g, n)" if heads else "(b, n)")
    for name, t in (("D", D), ("dt_bias", dt_bias)):
        if t is not None:
            validate.shape(name, t, (h, dim), "(h, dim)" if heads else "(dim,)")
    if state_batch_indices is not None:
        validate.index_tensor("state_batch_indices", state_batch_indices)
        validate.shape("state_batch_indices", state_batch_indices, (b,), "(b,)")
    elif rows != b:
        raise ValueError(f"state has {rows} rows but x has batch {b}; pass state_batch_indices to pick rows")
    validate.same_device(state=state, x=x, dt=dt, A=A, B=B, C=C, D=D, z=z, dt_bias=dt_bias,
                         state_batch_indices=state_batch_indices)
    if dt_limit is not None and (len(dt_limit) != 2 or not dt_limit[0] <= dt_limit[1]):
        raise ValueError(f"dt_limit must be (low, high) with low <= high; got {dt_limit!r}")
    validate.decoding_only("selective_state_update", *given.values())
    _device.ensure_kernel_device(state.device)
    per_head = (A.stride(1) == 0 and A.stride(2) == 0 and dt.stride(2) == 0
                and (dt_bias is None or dt_bias.stride(1) == 0))
    if any(t is not None and _device.compute_dtype(t.dtype, t.device) != t.dtype for t in given.values()):
        # the interpreter computes in fp32 only: run on fp32 copies, write the state back
        cast = lambda t: None if t is None else t.to(torch.float32)
        work = state.to(torch.float32)
        out = state_update_fwd(work, *(cast(t) for t in (x, dt, A, B, C, D, z, dt_bias)), dt_softplus, dt_limit,
                               state_batch_indices, per_head, A_is_log)
        state.copy_(work)
        out = out.to(x.dtype)
    else:
        out = state_update_fwd(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, dt_limit, state_batch_indices,
                               per_head, A_is_log)
    return out if heads else out[:, 0]
