"""Context parallelism: one long sequence split into contiguous pieces, one per rank, for Mamba-2's SSD and its
causal convolution.

Rank r of a group of R holds positions [l_0 + … + l_{r-1}, l_0 + … + l_r) of every sequence of the batch, in
rank order along the sequence. What crosses between ranks is small and fixed in size: a state, not activations.

**The SSD** (:func:`context_parallel_ssd`). Per head, the single process runs the chunked scan
(:mod:`mambalab.kernels.ssd`): chunk c's own state S_c from a zero state, then the only sequential step,

    H_{c+1} = exp(a_c) H_c + S_c          a_c: chunk c's total log-decay, H_c: the state entering chunk c

then every chunk's outputs from its H_c. When a cut falls on a chunk edge, the state entering rank r's first
chunk is rank r-1's final state, so a ring reproduces the recurrence: rank r receives s_in from rank r-1, runs
``ssd_chunk_scan(…, initial_states=s_in, return_final_states=True)`` on its piece, and sends its final state to
rank r+1. The backward runs the same ring the other way: the sweep carries G_c = dL/dH_c from the last chunk
to the first (:mod:`mambalab.kernels.ssd.state_sweep`), so rank r's d initial_states, G at its first chunk, is
the gradient of rank r-1's final state, sent from r to r-1.

    forward   rank r-1 --(final state, (b, h, p, n) fp32)--> rank r
    backward  rank r-1 <--(its gradient, (b, h, p, n) fp32)-- rank r

4 · b · h · p · n bytes each way per cut (b = 1 and mamba2-2.7b's h = 80, p = 64, n = 128: 2.6 MB).

*Why the bits are the single process's* (cuts on chunk edges, either reduction on the CPU, "deterministic" on
a GPU). Each of the scan's steps works on one chunk at a time: the chunk's cumsum, its state S_c, its outputs
from H_c, and in the backward its gradients from G_{c+1} all read that chunk's inputs and nothing else, with
tile sizes that depend on (h, p, n, q, dtype), never on b or l (:mod:`mambalab.kernels.ssd.tiles`). The state passing keeps H in fp32 and starts from
initial_states loaded as fp32; the final state it hands on is that same fp32 value. So rank r's chunks see the
same H_c, in the same dtype, as the single process's chunks at those positions, and do the same operations:
``out``, the final state and the per-position gradients (dx, ddt, dB, dC, dz) equal the single process's bit
for bit, for any R whose cuts fall on chunk edges; equal across such R too. The same argument runs backwards
for G.

*What is not bitwise: the per-head parameters' gradients* (dA, dD, d dt_bias). The backward sums them over
(batch row, chunk) partials p_i, P of them, in one fixed tree (:func:`mambalab.kernels.reduce.sum_partials`).
Here each rank folds its own partials, and :func:`sum_over_ranks` adds the R folds in rank order: the same
partials, added in another order. Both orders are recursive fp32 sums of the same P terms, so each is within
γ_{P-1} Σ|p_i| of the exact sum (γ_k = k·u / (1 - k·u), u = 2^-24), and the two differ by at most
2·γ_{P-1}·Σ|p_i|. The result is deterministic (the same bits on every run for a given R), not the same bits
for every R. Bitwise equality there needs a hook in the backward: its unfolded partials, (b, c, h) for dA and
d dt_bias and (h, b·c·q/BLOCK_T, p) for dD, which the ranks all-gather in chunk order and fold once, in the
single process's tree.

*Cuts inside a chunk* are allowed: any piece lengths l_r ≥ 1 give the same function. The single process's
chunk that straddles the cut becomes two here, the tail of rank r-1's piece (padded inside its last chunk) and
the head of rank r's, and every chunk after it starts at a different position: the same sums, grouped
differently, so agreement is to the chunked algorithm's rounding, not bitwise.

*Cost.* The ring is serial: rank r starts its scan when rank r-1's is done, and the backward runs from the
last rank to the first. Memory is split R ways; time is that of one process plus R - 1 hops. Each call also
all-gathers a few integers (the shapes, and whether any rank records autograd) so that a bad input raises on
every rank instead of leaving the others waiting. The kernel-level
split (every rank computing its S_c and, after a ring of the cheap state passing alone, its outputs, all in
parallel) needs the op to take the entering state apart from its chunk states: a forward hook returning
(S, cs) without the scan, and a scan launch from given entering states.

**The convolution** (:func:`context_parallel_conv1d`). pre_t = bias + Σ_k w_k x_{t-(W-1)+k} reads the W - 1
inputs before t: rank r needs rank r-1's last W - 1 inputs (a halo) before its first output, and its first
W - 1 outputs send gradient back to those inputs. Forward: each rank sends its last W - 1 inputs to the next,
(b, d, W - 1) in x's dtype, and computes its piece with them in front. Backward: each rank sends d pre of its
first W - 1 positions, (b, d, W - 1) fp32, to the previous rank, which appends them to its own d pre and adds
every tap's contribution in tap order, as the single process does: dx equals the single process's bit for bit.
dweight and dbias are sums over positions, folded per rank (the bound above applies). All ranks exchange at
once (no ring); every piece needs at least W - 1 positions.

Parameters are replicated: their gradients on each rank are this rank's part; :func:`sum_over_ranks` adds
them over the group in a fixed order (or the trainer's all-reduce over the context-parallel group does).
Works with gloo (CPU tensors) and NCCL (CUDA tensors); packed sequences (seq_idx) are not split here.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from mambalab import validate
from mambalab.kernels.reduce import sum_partials
from mambalab.ops.conv1d import WIDTHS, causal_conv_taps
from mambalab.ops.ssd import ssd_chunk_scan

__all__ = ["context_parallel_conv1d", "context_parallel_ssd", "sum_over_ranks"]


def _ranks(group):
    """(this rank in the group, group size, global rank of the previous and next rank or None)."""
    if not dist.is_initialized():
        return 0, 1, None, None
    r, world = dist.get_rank(group), dist.get_world_size(group)
    glob = lambda i: dist.get_global_rank(group, i) if group is not None else i
    return r, world, (glob(r - 1) if r > 0 else None), (glob(r + 1) if r < world - 1 else None)


def _agree(what: str, local: list[int], error: Exception | None, device, group) -> torch.Tensor:
    """All-gather every rank's sizes (ints) and whether its own inputs passed their checks, so that a bad input
    on one rank makes every rank raise (the others would wait for it forever). Returns (R, len(local))."""
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    mine = torch.tensor([error is None, *local], dtype=torch.int64, device=device)
    rows = [torch.empty_like(mine) for _ in range(world)]
    if world > 1:
        dist.all_gather(rows, mine, group=group)
    else:
        rows = [mine]
    table = torch.stack(rows).cpu()
    if error is not None:
        raise error
    bad = [r for r in range(world) if not table[r, 0]]
    if bad:
        raise ValueError(f"{what}: the inputs of rank {bad[0]} of the context-parallel group are invalid (its "
                         "error says why)")
    return table[:, 1:]


def sum_over_ranks(t: torch.Tensor, group=None) -> torch.Tensor:
    """Σ_r t_r over the group, added left to right in rank order, ((t_0 + t_1) + t_2) + …: the same bits on every
    run (an all-reduce's order is the library's). All-gathers R copies of t: meant for parameter gradients."""
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    if world == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(parts, t.contiguous(), group=group)
    total = parts[0]
    for part in parts[1:]:
        total = total + part
    return total


# ------------------------------------------------------------------------------------------------ the SSD
class _ReceiveState(torch.autograd.Function):
    """Forward: receive the state entering this piece from the previous rank. Backward: send its gradient back."""

    @staticmethod
    def forward(ctx, anchor, shape, prev, group):
        ctx.prev, ctx.group = prev, group
        state = torch.empty(shape, dtype=torch.float32, device=anchor.device)
        dist.recv(state, src=prev, group=group)
        return state

    @staticmethod
    def backward(ctx, dstate):
        dist.send(dstate.float().contiguous(), dst=ctx.prev, group=ctx.group)
        return None, None, None, None


class _SendState(torch.autograd.Function):
    """Forward: send this piece's final state to the next rank and pass ``out`` through. Backward: receive the
    final state's gradient from the next rank (``out``'s gradient passes through)."""

    @staticmethod
    def forward(ctx, final, out, anchor, nxt, group):
        ctx.nxt, ctx.group = nxt, group
        dist.send(final.contiguous(), dst=nxt, group=group)
        ctx.shape, ctx.device = final.shape, final.device
        return out.view_as(out)

    @staticmethod
    def backward(ctx, dout):
        dfinal = torch.empty(ctx.shape, dtype=torch.float32, device=ctx.device)
        dist.recv(dfinal, src=ctx.nxt, group=ctx.group)
        return dfinal, dout, None, None, None


def _check_ssd(x, dt, A, B, C, D, z, dt_bias):
    """The shapes the ring depends on, checked on this rank; returns (b, l, h, p, g, n)."""
    for name, t in (("x", x), ("dt", dt), ("A", A), ("B", B), ("C", C), ("D", D), ("z", z), ("dt_bias", dt_bias)):
        if t is not None or name in "x dt A B C":
            validate.tensor(name, t)
    if x.dim() != 4:
        raise ValueError(f"x must have shape (b, l, h, p), this rank's piece of the sequence; got {tuple(x.shape)}")
    b, l, h, p = x.shape
    if l == 0:
        raise ValueError("x holds no positions: every rank's piece of the sequence needs at least one (x.shape[1])")
    validate.shape("dt", dt, (b, l, h), "(b, l, h), like x's first three")
    validate.shape("A", A, (h,), "(h,)")
    if B.dim() != 4:
        raise ValueError(f"B must have shape (b, l, g, n) = ({b}, {l}, g, n); got {tuple(B.shape)}")
    validate.shape("B", B, (b, l, None, None), "(b, l, g, n)")
    validate.shape("C", C, tuple(B.shape), "(b, l, g, n), like B")
    if z is not None:
        validate.shape("z", z, (b, l, h, p), "(b, l, h, p), like x")
    if dt_bias is not None:
        validate.shape("dt_bias", dt_bias, (h,), "(h,)")
    if D is not None and D.dim() == 2:
        validate.shape("D", D, (h, p), "(h, p)")
    elif D is not None:
        validate.shape("D", D, (h,), "(h,) or (h, p)")
    return b, l, h, p, B.shape[2], B.shape[3]


def context_parallel_ssd(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, dt_softplus=False,
                         dt_limit=(0.0, float("inf")), return_final_states=False, *, group=None, reduction=None):
    """Mamba-2's SSD over a sequence split along l across the ranks of ``group`` (module docstring).

    Args: those of :func:`mambalab.ops.ssd_chunk_scan`, each rank passing its own piece of the sequence:
        x, z: (b, l_r, h, p); dt: (b, l_r, h); B, C: (b, l_r, g, n); the parameters A, D, dt_bias whole (the
        same on every rank). b, h, p, g, n and chunk_size must agree across ranks; l_r ≥ 1 may differ (cuts on
        multiples of chunk_size give the single process's bits). group: the context-parallel group (ranks in
        sequence order; None: the default group). reduction: as ssd_chunk_scan's.

    Returns out (b, l_r, h, p), this rank's piece; with ``return_final_states`` also the state after this
    rank's piece, (b, h, p, n) fp32 (on the last rank, the sequence's final state). Gradients reach every
    input; those of A, D and dt_bias are this rank's part (:func:`sum_over_ranks` adds them up).

    Raises ValueError / TypeError naming the argument on every rank of the group, before any state is sent,
    when the shapes the ring needs are wrong or disagree between ranks; the op checks the rest.
    """
    r, world, prev, nxt = _ranks(group)
    error, sizes = None, [0] * 8
    try:
        sizes = [*_check_ssd(x, dt, A, B, C, D, z, dt_bias), validate.positive_int("chunk_size", chunk_size),
                 validate.records_autograd(x, dt, A, B, C, D, z, dt_bias)]
    except (TypeError, ValueError) as e:
        error = e
    table = _agree("context_parallel_ssd", sizes, error, x.device if isinstance(x, torch.Tensor) else "cpu", group)
    names = ("b (x.shape[0])", None, "h (x.shape[2])", "p (x.shape[3])", "g (B.shape[2])", "n (B.shape[3])",
             "chunk_size")
    for i, name in enumerate(names):
        if name is not None and (table[:, i] != table[0, i]).any():
            raise ValueError(f"context_parallel_ssd: {name} must be the same on every rank of the group; got "
                             f"{table[:, i].tolist()} on ranks 0 … {world - 1}")
    b, _, h, p, _, n = sizes[:6]
    grad = bool(table[:, 7].any()) and torch.is_grad_enabled()
    # every rank records the ring's graph if any rank does, so that no backward waits for a send never made
    anchor = torch.empty(0, device=x.device, requires_grad=grad)
    entering = _ReceiveState.apply(anchor, (b, h, p, n), prev, group) if prev is not None else None
    out, final = ssd_chunk_scan(x, dt, A, B, C, chunk_size, D=D, z=z, dt_bias=dt_bias, initial_states=entering,
                                dt_softplus=dt_softplus, dt_limit=dt_limit, return_final_states=True,
                                reduction=reduction)
    if nxt is not None:
        out = _SendState.apply(final, out, anchor, nxt, group)
    return (out, final) if return_final_states else out


# ------------------------------------------------------------------------------------------------ the convolution
def _silu_grad(pre: torch.Tensor) -> torch.Tensor:
    """d silu(p) / dp = s (1 + p (1 - s)), s = sigmoid(p)."""
    s = torch.sigmoid(pre)
    return s * (1 + pre * (1 - s))


def _exchange(send, to, recv_shape, dtype, frm, group):
    """Send ``send`` to rank ``to`` and receive a (recv_shape) tensor from rank ``frm`` at once (either may be
    None); returns the received tensor or None."""
    work = dist.isend(send.contiguous(), dst=to, group=group) if to is not None else None
    got = None
    if frm is not None:
        got = torch.empty(recv_shape, dtype=dtype, device=send.device)
        dist.recv(got, src=frm, group=group)
    if work is not None:
        work.wait()
    return got


class _ConvPiece(torch.autograd.Function):
    """The convolution of one piece: halo in front (forward), the next piece's d pre behind (backward)."""

    @staticmethod
    def forward(ctx, x, weight, bias, anchor, silu, prev, nxt, group):
        (b, d, l), width = x.shape, weight.shape[-1]
        halo = _exchange(x[..., l - (width - 1):], nxt, (b, d, width - 1), x.dtype, prev, group)
        x32, w32 = x.float(), weight.float()
        b32 = None if bias is None else bias.float()
        halo32 = None if halo is None else halo.float()
        pre = causal_conv_taps(x32, w32, b32, None, halo32)                   # (b, d, l) fp32
        ctx.save_for_backward(x, weight, bias, halo)
        ctx.silu, ctx.prev, ctx.nxt, ctx.group = silu, prev, nxt, group
        return (torch.nn.functional.silu(pre) if silu else pre).to(x.dtype)

    @staticmethod
    def backward(ctx, dout):
        x, weight, bias, halo = ctx.saved_tensors
        (b, d, l), width = x.shape, weight.shape[-1]
        x32, w32 = x.float(), weight.float()
        halo32 = None if halo is None else halo.float()
        dpre = dout.float()
        if ctx.silu:
            dpre = dpre * _silu_grad(causal_conv_taps(x32, w32, None if bias is None else bias.float(), None,
                                                      halo32))
        # the previous rank's last inputs feed this rank's first width - 1 outputs: their d pre goes back
        behind = _exchange(dpre[..., :width - 1], ctx.prev, (b, d, width - 1), torch.float32, ctx.nxt, ctx.group)
        ext = dpre if behind is None else torch.cat([dpre, behind], dim=-1)  # (b, d, l [+ width - 1])
        span = ext.shape[-1]
        dxp = torch.zeros(b, d, width - 1 + span, dtype=torch.float32, device=x.device)
        for k in range(width):   # tap k's input gets weight[:, k] · d pre where it was read, in tap order
            dxp[..., k:k + span] += w32[:, k, None] * ext
        dx = dxp[..., width - 1:width - 1 + l].to(x.dtype)
        xp = torch.cat([halo32 if halo32 is not None else x32.new_zeros(b, d, width - 1), x32], dim=-1)
        over_positions = lambda t: sum_partials(t.transpose(1, 2).reshape(b * l, d), dim=0)   # (b, d, l) -> (d,)
        dweight = dbias = None
        if ctx.needs_input_grad[1]:
            dweight = torch.stack([over_positions(xp[..., k:k + l] * dpre) for k in range(width)],
                                  dim=1).to(weight.dtype)
        if bias is not None and ctx.needs_input_grad[2]:
            dbias = over_positions(dpre).to(bias.dtype)
        return dx, dweight, dbias, None, None, None, None, None


def context_parallel_conv1d(x, weight, bias=None, activation=None, *, group=None):
    """The causal depthwise convolution of :func:`mambalab.ops.conv1d.causal_conv1d_fn` over a sequence split along
    l across the ranks of ``group`` (module docstring: the halo exchange).

    x: (b, d, l_r), this rank's piece, l_r ≥ width - 1; weight (d, width), width 2, 3 or 4; bias (d,) or None;
    activation None, "silu" or "swish". b, d and width must agree across ranks. Returns (b, d, l_r) in x's
    dtype. Gradients reach x (bitwise the single process's), weight and bias (this rank's part).

    Raises ValueError / TypeError naming the argument on every rank of the group, before any exchange.
    """
    r, world, prev, nxt = _ranks(group)
    error, sizes = None, [0, 0, 0, 0]
    try:
        if activation not in (None, "silu", "swish"):
            raise ValueError(f"activation must be None, 'silu' or 'swish'; got {activation!r}")
        validate.tensor("x", x)
        validate.tensor("weight", weight)
        if x.dim() != 3 or weight.dim() != 2:
            raise ValueError(f"x must have shape (b, d, l) and weight (d, width); got {tuple(x.shape)} and "
                             f"{tuple(weight.shape)}")
        validate.shape("weight", weight, (x.shape[1], None), "(d, width)")
        if weight.shape[1] not in WIDTHS:
            raise ValueError(f"weight's width (weight.shape[1]) must be one of {WIDTHS}; got {weight.shape[1]}")
        if bias is not None:
            validate.tensor("bias", bias)
            validate.shape("bias", bias, (x.shape[1],), "(d,)")
        if x.shape[2] < weight.shape[1] - 1:
            raise ValueError(f"x (b, d, l) = {tuple(x.shape)}: each rank's piece needs at least width - 1 = "
                             f"{weight.shape[1] - 1} positions, the halo it exchanges with its neighbours")
        sizes = [x.shape[0], x.shape[1], weight.shape[1], validate.records_autograd(x, weight, bias)]
    except (TypeError, ValueError) as e:
        error = e
    table = _agree("context_parallel_conv1d", sizes, error, x.device if isinstance(x, torch.Tensor) else "cpu",
                   group)
    for i, name in enumerate(("b (x.shape[0])", "d (x.shape[1])", "width (weight.shape[1])")):
        if (table[:, i] != table[0, i]).any():
            raise ValueError(f"context_parallel_conv1d: {name} must be the same on every rank of the group; got "
                             f"{table[:, i].tolist()} on ranks 0 … {world - 1}")
    # every rank runs the backward's exchange if any rank records a graph (module docstring of the SSD's anchor)
    anchor = torch.empty(0, device=x.device, requires_grad=bool(table[:, 3].any()) and torch.is_grad_enabled())
    return _ConvPiece.apply(x, weight, bias, anchor, activation is not None, prev, nxt, group)
