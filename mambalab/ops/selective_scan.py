"""``selective_scan``: Mamba-1's selective scan on Triton kernels, a drop-in for mamba-ssm's
``selective_scan_fn`` (same arguments, shapes and results; a complex A is the one input of mamba-ssm's it
refuses, see :func:`selective_scan`).

The backward is deterministic by construction (no atomic adds; partials reduced in a fixed order), so its
gradients are bitwise reproducible run to run and do not depend on the GPU's SM count.
"""
from __future__ import annotations

import torch

from mambalab import device as _device
from mambalab import validate
from mambalab.kernels import selective_scan as _kernels


def _check_A(A):
    """A must be a real (d, n) tensor. A complex A is a valid input to mamba-ssm's ``selective_scan_fn`` (with
    B, C holding interleaved real and imaginary parts) that this op does not take: its kernels compute in real
    arithmetic, and none of mamba-ssm's own modules uses the complex path (Mamba's A is real and negative)."""
    if isinstance(A, torch.Tensor) and A.is_complex():
        raise TypeError(f"A must be real; complex A ({str(A.dtype).replace('torch.', '')}) is not supported: the "
                        "selective-scan kernels compute in real arithmetic (mamba-ssm's complex path, B and C "
                        "with interleaved real and imaginary parts, is used by none of its modules)")
    validate.tensor("A", A)


def _check(u, delta, A, B, C, D, z, delta_bias):
    """Validate at the boundary. Raises TypeError/ValueError naming the argument; returns (g, the check that
    delta is finite, queued on its device: :class:`mambalab.validate.Finite`, which the caller waits for just
    before the kernels launch). g is the number of B/C groups the kernels see: d when B or C is constant over
    time (shape (d, n)), else B's."""
    _check_A(A)
    for name, x in (("u", u), ("delta", delta), ("B", B), ("C", C)):
        validate.tensor(name, x)
    for name, x in (("D", D), ("z", z), ("delta_bias", delta_bias)):
        if x is not None:
            validate.tensor(name, x)
    if u.dim() != 3:
        raise ValueError(f"u must have shape (b, d, l); got {tuple(u.shape)}")
    b, d, l = u.shape
    validate.shape("delta", delta, (b, d, l), "(b, d, l), like u")
    if A.dim() != 2 or A.shape[0] != d:
        raise ValueError(f"A must have shape (d, n) = ({d}, n), real; got {tuple(A.shape)}")
    n = A.shape[1]
    groups = {}                          # the time-varying ones' groups
    for name, x in (("B", B), ("C", C)):
        if x.dim() == 2:                 # constant over time: one (n,) vector per channel
            validate.shape(name, x, (d, n), "(d, n), like A")
        elif x.dim() == 3:
            validate.shape(name, x, (b, n, l), "(b, n, l)")
            groups[name] = 1
        elif x.dim() == 4:
            validate.shape(name, x, (b, None, n, l), "(b, g, n, l)")
            groups[name] = x.shape[1]
        else:
            raise ValueError(f"{name} must have shape (b, n, l) = ({b}, {n}, {l}), grouped (b, g, n, l), or "
                             f"constant over time (d, n) = ({d}, {n}); got {tuple(x.shape)}")
    for name, gx in groups.items():
        if gx == 0 or d % gx:
            raise ValueError(f"the number of groups g = {gx} ({name}.shape[1]) must divide the channels d = {d}")
    # the kernels read B and C in one grouped layout: B's groups when both share them, else one per channel
    g = groups["B"] if len(groups) == 2 and groups["B"] == groups["C"] else d
    if D is not None:
        validate.shape("D", D, (d,), "(d,)")
    if delta_bias is not None:
        validate.shape("delta_bias", delta_bias, (d,), "(d,)")
    if z is not None:
        validate.shape("z", z, (b, d, l), "(b, d, l), like u")
    dev = validate.same_device(u=u, delta=delta, A=A, B=B, C=C, D=D, z=z, delta_bias=delta_bias)
    _device.ensure_kernel_device(dev)
    _check_limits(b, d, n, l, g)
    return g, validate.Finite("delta", delta)


def _check_limits(b, d, n, l, g):
    """The kernels' launch grids and 32-bit offsets, from the launchers in :mod:`mambalab.kernels.selective_scan`
    (and :func:`mambalab.kernels.reduce.sum_partials` for the backward's sums), checked before any launch.

    Grids: forward (b, d / BLOCK_D), backward (b, d / BWD_BLOCK_D); the backward's sums over the partials of dA
    ((b · blocks of l) of them, folded 32 a program on axis 1), dB and dC, dD and d delta_bias. Offsets: the
    kernels form the row offsets of u, delta, z and out in 64 bits, but count the state checkpoints' rows
    (b · (checkpoints + 1) · d of n each), B/C rows (b · g · n of l each), A (d · n) and a row's B/C offset
    (n · l) in 32-bit integers first.
    """
    cfg = _kernels.tile_config(d // g, n, l)
    cdiv = lambda a, m: -(-a // m)
    bsz, dsz, lsz = ("b (u.shape[0])", b), ("d (u.shape[1])", d), ("l (u.shape[2])", l)
    split_b = ": split the batch"
    validate.launch_grid("the selective-scan forward", (b, cdiv(d, cfg.block_d)), (bsz, dsz),
                         "; split the channels across calls")
    validate.launch_grid("the selective-scan backward", (b, cdiv(d, cfg.bwd_block_d)), (bsz, dsz),
                         "; split the channels across calls")
    blocks = b * cdiv(l, cfg.bwd_block_l)    # dA's partials: one per batch row and block of steps
    if blocks > 32:                          # sum_partials folds 32 partials a program on grid axis 1
        validate.launch_grid("the selective-scan backward's sum of dA", (1, cdiv(blocks, 32)), (bsz, lsz),
                             "; split the batch or the sequence (carrying the state)")
    if b > 32:
        validate.launch_grid("the selective-scan backward's sum of dD", (1, cdiv(b, 32)), (bsz, bsz))
    rows = b * (cdiv(l, cfg.bwd_block_l) + 1) * d
    validate.int32_offsets(f"the state checkpoints (b, {cdiv(l, cfg.bwd_block_l) + 1}, d, n) = "
                           f"({b}, {cdiv(l, cfg.bwd_block_l) + 1}, {d}, {n}) as rows of n", rows, bsz, split_b)
    validate.int32_offsets(f"A (d, n) = ({d}, {n})", d * n, dsz, ": split the channels across calls")
    validate.int32_offsets(f"B and C as (b, g, n, l) = ({b}, {g}, {n}, {l}), rows of l", b * g * n, bsz, split_b)
    validate.int32_offsets(f"one group of B or C, (n, l) = ({n}, {l})", n * l, lsz,
                           ": split the sequence and carry the state between the parts")


def _grouped(x: torch.Tensor, b: int, d: int, l: int, g: int) -> torch.Tensor:
    """B or C in the kernels' layout (b, g, n, l), from (d, n) (constant over time: g = d, the same column at
    every step), (b, n, l) or (b, g', n, l) (each group repeated over the d / g' channels it serves when the
    kernels' g differs). The values are those the caller gave, so the scan is exact; autograd sums the
    gradient of the expanded copy back over what was repeated (b and l for a constant one)."""
    n = x.shape[-2] if x.dim() > 2 else x.shape[1]
    if x.dim() == 2:                                                    # (d, n) -> (b, d, n, l)
        return x[None, :, :, None].expand(b, d, n, l)
    if x.dim() == 3:                                                    # (b, n, l) -> (b, g, n, l)
        return x.unsqueeze(1).expand(b, g, n, l)
    if x.shape[1] == g:
        return x
    gx = x.shape[1]                                                     # (b, g', n, l) -> (b, d, n, l)
    return x.unsqueeze(2).expand(b, gx, d // gx, n, l).reshape(b, d, n, l)


class SelectiveScanFn(torch.autograd.Function):
    """The kernels with autograd. B and C arrive grouped, (b, g, n, l) (:func:`_grouped`)."""

    @staticmethod
    def forward(ctx, u, delta, A, B, C, D, z, delta_bias, delta_softplus, return_last_state, delta_finite):
        dtype_out = u.dtype
        work = _device.compute_dtype(u.dtype, u.device)
        # Kernels read contiguous (b, d, l) / (b, g, n, l) rows; on the CPU interpreter they get fp32.
        prep = lambda x: None if x is None else x.to(work if x.dtype != torch.float32 else x.dtype).contiguous()
        u_, delta_, z_ = prep(u), prep(delta), prep(z)
        B_, C_ = prep(B), prep(C)
        A_, D_, bias_ = A.float().contiguous(), prep(D), prep(delta_bias)
        needs_grad = any(ctx.needs_input_grad[:8])
        delta_finite.check()   # the last moment before the launch: the wait exposes only the launch itself
        out, last_state, saved, cfg = _kernels.selective_scan_fwd(
            u_, delta_, A_, B_, C_, D_, z_, bias_, delta_softplus, save_states=needs_grad)
        ctx.save_for_backward(u_, delta_, A_, B_, C_, D_, z_, bias_, *(saved or (None, None)))
        ctx.cfg, ctx.softplus = cfg, delta_softplus
        ctx.dtypes = [x.dtype if x is not None else None for x in (u, delta, A, B, C, D, z, delta_bias)]
        ctx.mark_non_differentiable(last_state)
        out = out.to(dtype_out)
        return out, last_state

    @staticmethod
    def backward(ctx, dout, _dlast_state):
        u_, delta_, A_, B_, C_, D_, z_, bias_, states, y = ctx.saved_tensors
        dout = dout.to(u_.dtype).contiguous()
        grads = _kernels.selective_scan_bwd(dout, u_, delta_, A_, B_, C_, D_, z_, bias_, ctx.softplus,
                                            _kernels.Saved(states, y), ctx.cfg)
        ordered = [None if gr is None else gr.to(dt) for gr, dt in zip(grads, ctx.dtypes)]
        return (*ordered, None, None, None)


def selective_scan(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                   return_last_state=False):
    """Mamba-1's selective scan; the signature (argument order, defaults) and semantics of mamba-ssm's
    ``selective_scan_fn``.

    h_t = exp(Δ_t A) ⊙ h_{t-1} + Δ_t u_t B_t,   y_t = C_t · h_t + D u_t,   out_t = y_t · silu(z_t),
    with Δ = softplus(delta + delta_bias) when ``delta_softplus`` (else delta + delta_bias).

    Args:
        u: (b, d, l) input, fp32/fp16/bf16.
        delta: (b, d, l) step sizes (before bias and softplus); no NaN or infinity.
        A: (d, n) real state matrix (diagonal per channel), usually negative. A complex A, which mamba-ssm
            accepts, raises TypeError: the kernels compute in real arithmetic, and none of mamba-ssm's modules
            uses its complex path.
        B, C: (b, n, l); grouped (b, g, n, l) with g dividing d (channel i reads group i // (d / g)); or
            constant over time, (d, n) (one vector per channel, the same at every step). A constant one is
            expanded to the time-varying layout (b, d, n, l) before the kernels: exact (the same values at
            every step), at the cost of that copy; its gradient is the expanded one's summed over b and l.
            When B and C have different layouts, both are laid out with a group per channel.
        D: optional (d,) skip connection.  z: optional (b, d, l) gate.  delta_bias: optional (d,).
        delta_softplus: apply softplus to delta + delta_bias.
        return_last_state: also return the final state (b, d, n), fp32. As in mamba-ssm, it carries no gradient:
            a loss on it alone is torch's "does not require grad" error.

    Returns:
        out (b, d, l) in u's dtype, or (out, last_state). Gradients flow to every tensor argument.

    Raises:
        TypeError / ValueError naming the argument, before any launch: wrong types, dtypes, shapes or
        devices; NaN or infinity in delta; sizes beyond the kernels' launch grids (d at most 65,535: CUDA's
        cap on grid axis 1) or their 32-bit offsets.
    """
    g, delta_finite = _check(u, delta, A, B, C, D, z, delta_bias)
    b, d, l = u.shape
    out, last_state = SelectiveScanFn.apply(u, delta, A, _grouped(B, b, d, l, g), _grouped(C, b, d, l, g), D, z,
                                            delta_bias, bool(delta_softplus), bool(return_last_state), delta_finite)
    return (out, last_state) if return_last_state else out
