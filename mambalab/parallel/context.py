"""Context parallelism: one long sequence split into contiguous pieces, one per rank, for Mamba-2's SSD and its
causal convolution.

Rank r of a group of R holds positions [l_0 + … + l_{r-1}, l_0 + … + l_r) of every sequence of the batch, in
rank order along the sequence. What crosses between ranks is small and fixed in size: a state, not activations.

**The SSD** (:func:`context_parallel_ssd`). Per head, the single process runs the chunked scan
(:mod:`mambalab.kernels.ssd`): chunk c's own state S_c from a zero state, then the only sequential step,

    H_{c+1} = exp(a_c) H_c + S_c          a_c: chunk c's total log-decay, H_c: the state entering chunk c

then every chunk's outputs from its H_c. When a cut falls on a chunk edge, the state entering rank r's first
chunk is rank r-1's final state, so a ring reproduces the recurrence. Each rank runs the op's own launches on
its piece (those of :func:`mambalab.ops.ssd_chunk_scan`, in its order), and only the state passing waits:

    forward   chunk cumsum, chunk states S_c            every rank at once
              receive H_in from r-1; state passing from H_in; send the final state to r+1     the ring
              chunk scan (the outputs from each H_c)    each rank once its state passing is done
    backward  receive d final from r+1; the state sweep (G_c = dL/dH_c from the last chunk to the first,
              :mod:`mambalab.kernels.ssd.state_sweep`); send G at the first chunk, d H_in, to r-1    the ring
              the chunk-scan backward, the cumsum backward   every rank at once

What is sent: forward, rank r-1's final state to rank r; backward, its gradient from rank r to rank r-1; each
(b, h, p, n) fp32, 4 · b · h · p · n bytes each way per cut (b = 1 and mamba2-2.7b's h = 80, p = 64,
n = 128: 2.6 MB).

*Why the bits are the single process's* (cuts on chunk edges, either reduction on the CPU, "deterministic" on
a GPU). The launches are the op's, on the op's prepared inputs, and each works on one chunk at a time: the
chunk's cumsum, its state S_c, its outputs from H_c, and in the backward its gradients from G_{c+1} read that
chunk's inputs and nothing else, with tile sizes that depend on (h, p, n, q, dtype), never on b or l
(:mod:`mambalab.kernels.ssd.tiles`). The state passing keeps H in fp32 and starts from the received H_in as
fp32; the final state it hands on is that same fp32 value. So rank r's chunks see the same H_c, in the same
dtype, as the single process's chunks at those positions, and do the same operations; backwards, the same
holds for G. ``out``, the final state and the per-position gradients (dx, ddt, dB, dC, dz) equal the single
process's bit for bit, for any R whose cuts fall on chunk edges, and so equal across such R.

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

*Cost.* The forward's ring holds only the state passing (c_r steps of p·n fused multiply-adds a head): the
chunk states before it and the chunk scan after it, the forward's dot products, run on all ranks at once.
The backward's ring holds the state sweep, whose per-chunk Σ_t exp(cs_t) dY_t C_tᵀ is a dot product of the
size of a chunk state, so R sweeps run one after another; the chunk-scan backward, the largest part, runs on
all ranks at once. Memory is split R ways. Each call also all-gathers a few integers (the shapes, whether any
rank records autograd; with seq_idx, each row's first and last indices) so that a bad input raises on every
rank instead of leaving the others waiting. An associative combine of per-rank (decay, state) pairs in place of
the ring needs fewer hops but adds the states in another order, which loses the bits.

**The convolution** (:func:`context_parallel_conv1d`). pre_t = bias + Σ_k w_k x_{t-(W-1)+k} reads the W - 1
inputs before t: rank r needs rank r-1's last W - 1 inputs (a halo) before its first output, and its first
W - 1 outputs send gradient back to those inputs. Forward: each rank sends its last W - 1 inputs to the next,
(b, d, W - 1) in x's dtype, and runs the op's forward kernel (:mod:`mambalab.kernels.conv1d`) over the piece
with them in front, dropping the halo's outputs. Backward: each rank sends its first W - 1 inputs and their
output gradients, (b, d, 2 (W - 1)) fp32, to the previous rank, which runs the op's backward kernel over
[halo | piece | those] (the halo's output gradients zero): the kernel recomputes d pre at every position dx
reads and adds the taps in the single process's order, so out and dx equal the single process's bit for bit.
dweight and dbias are sums over this piece's positions in PyTorch, folded per rank (the bound above applies). All ranks exchange at
once (no ring); every piece needs at least W - 1 positions.

**Packed sequences** (``seq_idx``, each rank passing its piece; nonnegative: a padding mark -1 is refused). The
kernels hand the state entering a piece (their ``initial_states``) to the sequence numbered 0 only, from
seq_before(0) = 0 (:mod:`mambalab.kernels.ssd.packed`). Rank r > 0 numbers its piece's sequences from the one
rank r-1's piece ends in, seq_t - seq_{cut-1} (each rank's first and last indices of each row are all-gathered
after the checks): a sequence that spans the cut is numbered 0 and takes the received state; one that starts
exactly at the cut, or after it, is numbered 1 or more and starts from zero, and the state received is not used.
The state sent on is the one the kernels end the piece with, that of the sequence the piece ends in. A mask
inside the piece compares two of its indices, which a common shift leaves alone; the first chunk's comparison
with seq_before(0) = 0 is, shifted, the single process's with seq_{cut-1}. So no mask and no bit changes: cuts
on chunk edges keep the single process's bits. The convolution masks each tap as the single process does
(:func:`mambalab.ops.conv1d.causal_conv_taps`), across a cut with the sequences of the halo (forward) and of the
next piece's first W - 1 positions (backward), taken from that all-gather.

Parameters are replicated: their gradients on each rank are this rank's part; :func:`sum_over_ranks` adds
them over the group in a fixed order (or the trainer's sum over the context-parallel group does).
Works with gloo (CPU tensors) and NCCL (CUDA tensors).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from mambalab import device as _device
from mambalab import validate
from mambalab.determinism import resolve_reduction
from mambalab.kernels import ssd as _kernels
from mambalab.kernels.reduce import sum_partials
from mambalab.parallel.collectives import group_size
from mambalab.kernels.conv1d import causal_conv1d_bwd_partials, causal_conv1d_fwd
from mambalab.ops.conv1d import WIDTHS, causal_conv_taps
from mambalab.ops.conv1d import kernel_inputs as conv_kernel_inputs   # the op's own kernel inputs: its bits
from mambalab.ops.ssd import check_inputs, kernel_inputs   # the op's own checks and kernel inputs: its bits

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
    world = group_size(group)
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


def _nonnegative_seq_idx(seq_idx, x, l_axis: int) -> torch.Tensor:
    """seq_idx (b, l_r) checked as a piece of packed sequences: an integer tensor on x's device, shaped like x's
    batch and sequence axes, with no negative entry (a padding mark, -1, has no meaning across a cut). Returns it
    as int32, contiguous."""
    validate.index_tensor("seq_idx", seq_idx)
    shape = (x.shape[0], x.shape[l_axis])
    validate.shape("seq_idx", seq_idx, shape, "(b, l_r), like this rank's piece")
    if seq_idx.device != x.device:
        raise ValueError(f"seq_idx is on {seq_idx.device} but x is on {x.device}")
    if seq_idx.numel() and bool((seq_idx < 0).any()):
        raise ValueError("seq_idx must be nonnegative under context parallelism: a padding mark (-1) cannot be "
                         "told apart from a sequence across a cut; pack without padding, or pad with a last sequence")
    return seq_idx.to(torch.int32).contiguous()


def _sequence_ends(what: str, seq_idx: torch.Tensor, k: int, group) -> torch.Tensor:
    """Every rank's first k and last k sequence indices of each row, (R, b, 2k) int64 (all-gathered; the sizes
    have been agreed), after checking that seq_idx never decreases across a cut: rank r's first index of each
    row at least rank r-1's last. Raises the same ValueError on every rank."""
    world = group_size(group)
    mine = torch.cat([seq_idx[:, :k], seq_idx[:, -k:]], dim=1).to(torch.int64)     # (b, 2k)
    rows = [torch.empty_like(mine) for _ in range(world)]
    if world > 1:
        dist.all_gather(rows, mine, group=group)
    else:
        rows = [mine]
    ends = torch.stack(rows).cpu()                                                    # (R, b, 2k)
    for r in range(1, world):
        if (ends[r, :, 0] < ends[r - 1, :, -1]).any():
            raise ValueError(f"{what}: seq_idx must be nondecreasing along the whole sequence; it decreases at the "
                             f"cut between ranks {r - 1} and {r} of the context-parallel group")
    return ends


def sum_over_ranks(t: torch.Tensor, group=None) -> torch.Tensor:
    """Σ_r t_r over the group, added left to right in rank order, ((t_0 + t_1) + t_2) + …: the same bits on every
    run (an all-reduce's order is the library's). All-gathers R copies of t: meant for parameter gradients."""
    world = group_size(group)
    if world == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(parts, t.contiguous(), group=group)
    total = parts[0]
    for part in parts[1:]:
        total = total + part
    return total


# ------------------------------------------------------------------------------------------------ the SSD
class _SSDPiece(torch.autograd.Function):
    """One rank's piece: the steps of :func:`mambalab.kernels.ssd.ssd_chunk_scan_fwd` and ``ssd_chunk_scan_bwd``
    (the same launches, in the same order, as the op), with the ring's receive and send between them.

    Forward: chunk cumsum, chunk states | receive H_in from rank r-1 | state passing from H_in | send the final
    state to rank r+1 | chunk scan. Backward: receive d final from rank r+1 | the state sweep | send d H_in to
    rank r-1 | the chunk-scan backward, the cumsum backward. What sits outside the two bars runs on every rank
    at once."""

    @staticmethod
    def forward(ctx, anchor, x, dt, A, B, C, D, z, dt_bias, chunk_size, dt_softplus, dt_limit, reduction, seq_idx,
                prev, nxt, group):
        x_, dt_, A_, B_, C_, D_, z_, bias_, _ = kernel_inputs(x, dt, A, B, C, D, z, dt_bias)
        (b, _, h, p), (g, n) = x_.shape, B_.shape[2:]
        cfg = _kernels.tile_config(h, p, n, chunk_size, x_.dtype, ngroups=g)
        precision = _device.dot_precision(x_.dtype, x_.device)
        delta, cs = _kernels.chunk_cumsum_fwd(dt_, A_, bias_, dt_softplus, dt_limit, cfg)
        states = _kernels.chunk_states_fwd(x_, B_, delta, cs, cfg, precision, seq_idx=seq_idx)
        h_in = None
        if prev is not None:
            h_in = torch.empty(b, h, p, n, dtype=torch.float32, device=x_.device)
            dist.recv(h_in, src=prev, group=group)
        entering, final = _kernels.state_passing_fwd(states, cs, h_in, cfg, store_dtype=x_.dtype, seq_idx=seq_idx)
        sent = dist.isend(final, dst=nxt, group=group) if nxt is not None else None
        out = _kernels.chunk_scan_fwd(x_, B_, C_, delta, cs, entering, D_, z_, cfg, precision, seq_idx=seq_idx)
        if sent is not None:
            sent.wait()
        ctx.save_for_backward(x_, dt_, A_, B_, C_, D_, z_, bias_, delta, cs, entering, seq_idx)
        ctx.cfg, ctx.precision, ctx.dt_softplus, ctx.dt_limit, ctx.reduction = (cfg, precision, dt_softplus,
                                                                                dt_limit, reduction)
        ctx.prev, ctx.nxt, ctx.group = prev, nxt, group
        ctx.dtypes = [t.dtype if t is not None else None for t in (x, dt, A, B, C, D, z, dt_bias)]
        ctx.set_materialize_grads(False)
        return out if out.dtype == x.dtype else out.to(x.dtype), final

    @staticmethod
    def backward(ctx, dout, dfinal):
        x_, dt_, A_, B_, C_, D_, z_, bias_, delta, cs, entering, seq_idx = ctx.saved_tensors
        cfg, precision, reduction = ctx.cfg, ctx.precision, ctx.reduction
        dout = torch.zeros_like(x_) if dout is None else dout.to(x_.dtype).contiguous()
        dfinal = None if dfinal is None else dfinal.float().contiguous()
        if ctx.nxt is not None:   # the next piece's d H_in is this piece's d final (plus any use of final here)
            dnext = torch.empty(entering.shape[0], *entering.shape[2:], dtype=torch.float32, device=x_.device)
            dist.recv(dnext, src=ctx.nxt, group=ctx.group)
            dfinal = dnext if dfinal is None else dnext + dfinal
        dstates, dh_in, da = _kernels.state_sweep_bwd(dout, z_, C_, cs, entering, dfinal, ctx.prev is not None, cfg,
                                                      reduction, precision, seq_idx=seq_idx)
        sent = dist.isend(dh_in.contiguous(), dst=ctx.prev, group=ctx.group) if ctx.prev is not None else None
        dx, dz, dB, dC, dD, ddelta, dcs_row, dcs_col, dws = _kernels.chunk_scan_bwd(
            dout, x_, B_, C_, delta, cs, entering, dstates, D_, z_, cfg, reduction, precision, seq_idx=seq_idx)
        ddt, dA, dbias = _kernels.chunk_cumsum_bwd(dt_, A_, bias_, ctx.dt_softplus, ctx.dt_limit, delta, ddelta,
                                                   dcs_row, dcs_col, da, dws, cfg, reduction)
        if sent is not None:
            sent.wait()
        grads = [None if gr is None or not need else gr.to(dtype) for gr, dtype, need in
                 zip((dx, ddt, dA, dB, dC, dD, dz, dbias), ctx.dtypes, ctx.needs_input_grad[1:9])]
        return (None, *grads, None, None, None, None, None, None, None, None, None)


def context_parallel_ssd(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, dt_softplus=False,
                         dt_limit=(0.0, float("inf")), return_final_states=False, *, seq_idx=None, group=None,
                         reduction=None):
    """Mamba-2's SSD over a sequence split along l across the ranks of ``group`` (module docstring).

    Args: those of :func:`mambalab.ops.ssd_chunk_scan`, each rank passing its own piece of the sequence:
        x, z: (b, l_r, h, p); dt: (b, l_r, h); B, C: (b, l_r, g, n); the parameters A, D, dt_bias whole (the
        same on every rank). b, h, p, g, n and chunk_size must agree across ranks; l_r ≥ 1 may differ (cuts on
        multiples of chunk_size give the single process's bits). seq_idx: (b, l_r) integers, this rank's piece
        of the packed sequences' indices (module docstring), nonnegative and nondecreasing across the cuts, on
        every rank or on none. group: the context-parallel group (ranks in sequence order; None: the default
        group). reduction: as ssd_chunk_scan's.

    Returns out (b, l_r, h, p), this rank's piece; with ``return_final_states`` also the state after this
    rank's piece, (b, h, p, n) fp32 (on the last rank, the sequence's final state; with seq_idx, the state of
    the sequence the piece ends in). Gradients reach every input; those of A, D and dt_bias are this rank's
    part (:func:`sum_over_ranks` adds them up).

    Raises ValueError / TypeError naming the argument on every rank of the group, before any state is sent:
    the op's checks (:func:`mambalab.ops.ssd.check_inputs`, dt's finiteness included) on each rank's piece,
    seq_idx's (negative entries, a decrease inside a piece or across a cut), and sizes that disagree between
    ranks.
    """
    rank, world, prev, nxt = _ranks(group)
    error, sizes = None, [0] * 8
    try:
        reduction = resolve_reduction(reduction)   # None: the determinism switch's mode
        records = validate.records_autograd(x, dt, A, B, C, D, z, dt_bias)
        if seq_idx is not None:
            seq_idx = _nonnegative_seq_idx(seq_idx, x, 1)
        seq_idx, checks = check_inputs(x, dt, A, B, C, chunk_size, D, z, dt_bias, None, dt_limit, seq_idx,
                                       backward=records)
        if x.shape[1] == 0:
            raise ValueError("x holds no positions (x.shape[1] = 0): every rank's piece of the sequence needs one")
        for check in checks:
            check.check()
        sizes = [*x.shape[:1], *x.shape[2:], *B.shape[2:], chunk_size, seq_idx is not None, records]
    except (TypeError, ValueError) as e:
        error = e
    table = _agree("context_parallel_ssd", sizes, error, x.device if isinstance(x, torch.Tensor) else "cpu", group)
    names = ("b (x.shape[0])", "h (x.shape[2])", "p (x.shape[3])", "g (B.shape[2])", "n (B.shape[3])", "chunk_size",
             "whether seq_idx is given")
    for i, name in enumerate(names):
        if (table[:, i] != table[0, i]).any():
            raise ValueError(f"context_parallel_ssd: {name} must be the same on every rank of the group; got "
                             f"{table[:, i].tolist()} on ranks 0 … {world - 1}")
    if seq_idx is not None:
        # The kernels give the state entering a piece (as initial_states) to the sequence numbered 0 only
        # (mambalab.kernels.ssd.packed): numbering this piece's sequences from the one the previous piece ends
        # in, that sequence carries the state on and any later one starts from zero, as in one process.
        ends = _sequence_ends("context_parallel_ssd", seq_idx, 1, group)              # (R, b, 2)
        if prev is not None:
            seq_idx = (seq_idx - ends[rank - 1, :, -1:].to(seq_idx.device, torch.int32)).contiguous()
    # every rank records the ring's graph if any rank does, so that no backward waits for a send never made
    anchor = torch.empty(0, device=x.device, requires_grad=bool(table[:, 7].any()) and torch.is_grad_enabled())
    out, final = _SSDPiece.apply(anchor, x, dt, A, B, C, D, z, dt_bias, chunk_size, bool(dt_softplus),
                                 tuple(float(v) for v in dt_limit), reduction, seq_idx, prev, nxt, group)
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


def _pre(x32, w32, b32, halo32, seq, halo_seq):
    """The convolution before its activation on this piece, (b, d, l_r) fp32, for dweight and dbias
    (:func:`mambalab.ops.conv1d.causal_conv_taps`): with packed sequences, over the halo and the piece together
    (a tap reads an input only where its sequence is the output's), the halo's own outputs dropped."""
    if halo32 is None or seq is None:
        return causal_conv_taps(x32, w32, b32, seq, halo32)
    ext = causal_conv_taps(torch.cat([halo32, x32], dim=-1), w32, b32, torch.cat([halo_seq, seq], dim=-1))
    return ext[..., halo32.shape[-1]:]


def _joined(parts):
    """The present tensors of ``parts`` joined along l (the last dimension)."""
    parts = [t for t in parts if t is not None]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)


class _ConvPiece(torch.autograd.Function):
    """The convolution of one piece, by the op's own kernels (:mod:`mambalab.kernels.conv1d`): the forward over
    [halo | piece], the backward's dx over [halo | piece | the next piece's first width - 1 positions]. With
    packed sequences (``seq`` (b, l_r) int32) the sequences of the halo (``halo_seq``, the previous piece's last
    width - 1) and of the next piece's first width - 1 positions (``next_seq``) mask the taps that cross the
    cuts, as the single process masks every tap."""

    @staticmethod
    def forward(ctx, x, weight, bias, anchor, silu, seq, halo_seq, next_seq, prev, nxt, group):
        (b, d, l), width = x.shape, weight.shape[-1]
        halo = _exchange(x[..., l - (width - 1):], nxt, (b, d, width - 1), x.dtype, prev, group)
        ext = _joined([halo, x])                                             # (b, d, [width - 1 +] l)
        seq_ext = None if seq is None else _joined([halo_seq if halo is not None else None, seq])
        out, _ = causal_conv1d_fwd(*conv_kernel_inputs(ext, weight, bias, seq_ext, None), False, silu)
        ctx.save_for_backward(x, weight, bias, halo, seq, halo_seq, next_seq)
        ctx.silu, ctx.prev, ctx.nxt, ctx.group = silu, prev, nxt, group
        return out[..., ext.shape[-1] - l:].to(x.dtype).contiguous()

    @staticmethod
    def backward(ctx, dout):
        x, weight, bias, halo, seq, halo_seq, next_seq = ctx.saved_tensors
        (b, d, l), width = x.shape, weight.shape[-1]
        # the next piece's first width - 1 inputs and output gradients: its first outputs read this piece's last
        # inputs, and the kernel recomputes their d pre as the single process does
        send = torch.cat([x[..., :width - 1].float(), dout[..., :width - 1].float()], dim=-1)
        ahead = _exchange(send, ctx.prev, (b, d, 2 * (width - 1)), torch.float32, ctx.nxt, ctx.group)
        x_ahead = g_ahead = seq_ahead = None
        if ahead is not None:
            x_ahead, g_ahead = ahead[..., :width - 1].to(x.dtype), ahead[..., width - 1:].to(dout.dtype)
            seq_ahead = next_seq
        g_halo = None if halo is None else dout.new_zeros(b, d, width - 1)   # the halo's outputs are not ours
        ext = _joined([halo, x, x_ahead])
        seq_ext = None if seq is None else _joined([halo_seq if halo is not None else None, seq, seq_ahead])
        xk, wk, bk, seq_ext, _ = conv_kernel_inputs(ext, weight, bias, seq_ext, None)
        g_ext = _joined([g_halo, dout, g_ahead]).to(xk.dtype)
        dx_ext, _, _ = causal_conv1d_bwd_partials(xk, wk, bk, seq_ext, None, g_ext, None, ctx.silu)
        start = 0 if halo is None else width - 1
        dx = dx_ext[..., start:start + l].to(x.dtype).contiguous()
        # dweight and dbias: this piece's per-position partials, folded in sum_partials' order
        x32, w32 = x.float(), weight.float()
        halo32 = None if halo is None else halo.float()
        dpre = dout.float()
        if ctx.silu:
            dpre = dpre * _silu_grad(_pre(x32, w32, None if bias is None else bias.float(), halo32, seq, halo_seq))
        seq_in = None
        if seq is not None:   # the sequences of the inputs [halo | piece]
            front = halo_seq if halo_seq is not None else seq.new_full((b, width - 1), -1)
            seq_in = torch.cat([front, seq], dim=-1)
        xp = torch.cat([halo32 if halo32 is not None else x32.new_zeros(b, d, width - 1), x32], dim=-1)

        def tap(k):   # the inputs tap k read at this piece's outputs, zero where another sequence's
            read = xp[..., k:k + l]
            return read if seq_in is None else torch.where((seq_in[:, k:k + l] == seq)[:, None], read, 0.0)

        over_positions = lambda t: sum_partials(t.transpose(1, 2).reshape(b * l, d), dim=0)   # (b, d, l) -> (d,)
        dweight = dbias = None
        if ctx.needs_input_grad[1]:
            dweight = torch.stack([over_positions(tap(k) * dpre) for k in range(width)], dim=1).to(weight.dtype)
        if bias is not None and ctx.needs_input_grad[2]:
            dbias = over_positions(dpre).to(bias.dtype)
        return dx, dweight, dbias, None, None, None, None, None, None, None, None


def context_parallel_conv1d(x, weight, bias=None, activation=None, *, seq_idx=None, group=None):
    """The causal depthwise convolution of :func:`mambalab.ops.conv1d.causal_conv1d_fn` over a sequence split along
    l across the ranks of ``group`` (module docstring: the halo exchange).

    x: (b, d, l_r), this rank's piece, l_r ≥ width - 1; weight (d, width), width 2, 3 or 4; bias (d,) or None;
    activation None, "silu" or "swish"; seq_idx (b, l_r) integers or None, this piece of the packed sequences'
    indices (nonnegative, nondecreasing across the cuts; on every rank or on none): a tap reads only inputs of
    its output's sequence, across a cut too. b, d and width must agree across ranks. Returns (b, d, l_r) in x's
    dtype. Gradients reach x (bitwise the single process's), weight and bias (this rank's part).

    Raises ValueError / TypeError naming the argument on every rank of the group, before any exchange.
    """
    rank, world, prev, nxt = _ranks(group)
    error, sizes = None, [0, 0, 0, 0, 0]
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
        if seq_idx is not None:
            seq_idx = _nonnegative_seq_idx(seq_idx, x, 2)
            validate.Nondecreasing("seq_idx", seq_idx).check()
        sizes = [x.shape[0], x.shape[1], weight.shape[1], seq_idx is not None,
                 validate.records_autograd(x, weight, bias)]
    except (TypeError, ValueError) as e:
        error = e
    table = _agree("context_parallel_conv1d", sizes, error, x.device if isinstance(x, torch.Tensor) else "cpu",
                   group)
    for i, name in enumerate(("b (x.shape[0])", "d (x.shape[1])", "width (weight.shape[1])",
                              "whether seq_idx is given")):
        if (table[:, i] != table[0, i]).any():
            raise ValueError(f"context_parallel_conv1d: {name} must be the same on every rank of the group; got "
                             f"{table[:, i].tolist()} on ranks 0 … {world - 1}")
    halo_seq = next_seq = None
    if seq_idx is not None:   # the sequences of the halo and of the next piece's first width - 1 positions
        k = weight.shape[1] - 1
        ends = _sequence_ends("context_parallel_conv1d", seq_idx, k, group).to(torch.int32)   # (R, b, 2k)
        halo_seq = ends[rank - 1, :, k:].to(x.device) if prev is not None else None
        next_seq = ends[rank + 1, :, :k].to(x.device) if nxt is not None else None
    # every rank runs the backward's exchange if any rank records a graph (module docstring of the SSD's anchor)
    anchor = torch.empty(0, device=x.device, requires_grad=bool(table[:, 4].any()) and torch.is_grad_enabled())
    return _ConvPiece.apply(x, weight, bias, anchor, activation is not None, seq_idx, halo_seq, next_seq, prev, nxt,
                            group)
