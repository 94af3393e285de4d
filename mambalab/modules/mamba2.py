"""The Mamba-2 block: one input projection, a short causal convolution, SSD, and a gated group RMSNorm,
around :func:`mambalab.ops.ssd_chunk_scan`.

Parameter names, shapes and initialisation follow mamba-ssm's ``Mamba2`` (``mamba_ssm.modules.mamba2``),
so a state dict saved from one loads into the other. With d = d_inner = expand · d_model channels cut into
h = d / p heads of p = headdim channels, and g = ngroups groups of B and C (n = d_state each), for hidden
states u of shape (b, l, d_model):

    z, xBC, dt = split(in_proj(u))             (b, l, d), (b, l, d + 2 g n), (b, l, h): see split_sizes()
    xBC        = silu(causal depthwise conv1d(xBC))     x, B and C each see their last d_conv inputs
    x, B, C    = split(xBC)                    x (b, l, h, p); B, C (b, l, g, n): head i reads group i // (h / g)
    y          = ssd_chunk_scan(x, dt, A, B, C, D, dt_bias, dt_softplus=True)    (b, l, h, p)
    y          = norm(y, z) = rmsnorm(y ⊙ silu(z)) · w, one RMS per group of h / g heads     (b, l, d)
    out        = out_proj(y)                   (b, l, d_model)

with Δ = clamp(softplus(dt + dt_bias), *dt_limit) per head, A = -exp(A_log) (h,) a negative scalar decay per
head, and D (h,) a skip connection. A_log, D and dt_bias stay in fp32 when the block is cast to fp16 or bf16.

Everything is laid out by heads and groups: in_proj's output rows, the conv channels and the norm's groups
are concatenations of per-head (x, z, dt) and per-group (B, C) slices, in the order :meth:`Mamba2.split_sizes`
and :meth:`Mamba2.xBC_split_sizes` name. A tensor-parallel block gives each rank whole groups (and their
heads), slices every one of those pieces the same way, and runs this forward unchanged on its shard; only
out_proj's sum over ranks needs communication (the norm is per group).

With ``d_ssm`` < d_inner (mamba-ssm's option), only d_ssm channels go through the SSD (h = d_ssm / p heads)
and the other d_mlp = d_inner - d_ssm form a gated MLP, silu(z0) ⊙ x0, concatenated in front of the SSD's
output before out_proj; in_proj's output then starts with [z0 (d_mlp), x0 (d_mlp)]. With ``D_has_hdim`` the
skip D is (h, p), one weight per channel, instead of one per head.

Decoding token by token (:meth:`Mamba2.step`) keeps two states per sequence, made by
:meth:`Mamba2.allocate_inference_cache`: ``conv_state`` (b, d_ssm + 2 g n, d_conv), the last d_conv conv
inputs (oldest first), and ``ssm_state`` (b, h, p, n) fp32, SSD's state. One step costs O(h p n).

mamba-ssm's generation loop drives the block as it drives mamba-ssm's: ``forward(u, inference_params=p)``
keeps this layer's ``(conv_state, ssm_state)`` in ``p.key_value_memory_dict[layer_idx]`` (made on first
use), fills them from the prompt when ``p.seqlen_offset == 0`` and takes one :meth:`step` per call after
that. mambalab's own form is ``forward(u, cache=(conv_state, ssm_state))``.

Packed sequences (mamba-ssm's ``seq_idx`` and ``cu_seqlens``): several sequences laid end to end in one row,
``seq_idx`` (b, l) marking each position's sequence, reach the convolution (whose window stops at the start of
its sequence) and the SSD (whose state restarts there), so each sequence's outputs are those it has alone.
With ``cu_seqlens`` (b = 1) seq_idx defaults to the one it implies, and a prefill with ``inference_params`` or
``cache`` keeps one decoding state per sequence (num_seqs rows), as mamba-ssm's varlen prefill does.

The Triton kernels take fp32, fp16 and bf16; a float64 block (``.double()``, the tests' oracle precision)
runs the pure-PyTorch reference SSD whatever ``scan`` says.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from mambalab import device, validate
from mambalab.modules.conv import causal_conv1d, causal_conv1d_step, new_conv_state, varlen_conv_states
from mambalab.modules.norm import GatedRMSNorm
from mambalab.ops import ssd_chunk_scan
from mambalab.ops.state_update import selective_state_update
from mambalab.ref.ssd import last_positions, ssd_chunked, ssd_quadratic, ssd_recurrent, ssd_ref, ssd_step
from mambalab.modules.inference_cache import states_from_cache

__all__ = ["Mamba2"]

# Parameters whose precision matters more than their size: the decay, the skip and Δ's bias.
FP32_PARAMETERS = ("A_log", "D", "dt_bias")
# How the SSD is computed: mambalab's Triton kernels (ops.ssd_chunk_scan), or the pure-PyTorch chunked
# reference (ref.ssd_ref, autograd through plain tensor ops). Same math; the reference is ~500x faster on a
# CPU, where the kernels run in Triton's interpreter, so multi-process CPU demos and tests use it. The
# kernels take no float64: a float64 block always uses the reference.
SCANS = ("kernel", "reference")


class Mamba2(nn.Module):
    """Mamba-2 block (b, l, d_model) -> (b, l, d_model); see the module docstring for the math.

    Arguments in mamba-ssm's order, with its defaults:

    Args:
        d_model: width of the residual stream.
        d_state: n, the state size (columns of B and C per group).
        d_conv: width of the causal depthwise convolution over x, B and C.
        conv_init: if given, conv1d's weight is initialised uniform in ±conv_init (else PyTorch's default).
        expand: d_inner = expand · d_model channels inside the block.
        headdim: p, channels per head; nheads = d_ssm / headdim.
        d_ssm: channels that go through the SSD (default d_inner); the other d_inner - d_ssm form a gated MLP.
        ngroups: g, groups of B and C (and of the norm); must divide nheads.
        A_init_range: at initialisation A = -exp(A_log) is -uniform(*A_init_range) per head.
        D_has_hdim: D is (d_ssm,), one skip weight per channel, instead of (nheads,).
        rmsnorm: gate and normalise with :class:`GatedRMSNorm`; without it, y ⊙ silu(z) inside the scan.
        norm_before_gate: see :class:`GatedRMSNorm` (Mamba-2's default False: gate, then normalise).
        dt_min, dt_max: at initialisation softplus(dt_bias) is log-uniform in [dt_min, dt_max] ...
        dt_init_floor: ... and at least this.
        dt_limit: Δ is clamped to this range inside the scan.
        bias: give in_proj and out_proj biases.  conv_bias: give conv1d a bias.
        chunk_size: q, SSD's chunk length.
        use_mem_eff_path: accepted for mamba-ssm's signature; changes nothing here (mamba-ssm's fused
            conv-scan-norm-projection kernel; mambalab runs those steps one after the other).
        layer_idx: this block's key in ``inference_params.key_value_memory_dict`` (needed only for decoding
            with ``inference_params``).
        process_group: must be None: the tensor-parallel block is
            :class:`mambalab.parallel.TensorParallelMamba2`, which takes a layout instead.
        sequence_parallel: accepted for mamba-ssm's signature; as there, it matters only with a process group.
        device, dtype: where and in what dtype to make the parameters (A_log, D and dt_bias stay fp32 when
            the block is fp16 or bf16).

    mambalab's own, keyword-only:
        reduction: the SSD backward's reduction ("atomic", "deterministic", or None for the default).
        scan: "kernel" (Triton, :func:`mambalab.ops.ssd_chunk_scan`) or "reference" (pure PyTorch,
            :func:`mambalab.ref.ssd.ssd_ref`); see ``SCANS``.
        d_inner: channels inside the block; default expand · d_model. A tensor-parallel shard passes its
            own share (d_inner / TP) here, with ngroups / TP groups.
    """

    def __init__(self, d_model, d_state=128, d_conv=4, conv_init=None, expand=2, headdim=64, d_ssm=None,
                 ngroups=1, A_init_range=(1, 16), D_has_hdim=False, rmsnorm=True, norm_before_gate=False,
                 dt_min=0.001, dt_max=0.1, dt_init_floor=1e-4, dt_limit=(0.0, float("inf")), bias=False,
                 conv_bias=True, chunk_size=256, use_mem_eff_path=True, layer_idx=None, process_group=None,
                 sequence_parallel=True, device=None, dtype=None, *, reduction=None, scan="kernel", d_inner=None):
        super().__init__()
        if process_group is not None:
            raise ValueError("process_group: the plain Mamba2 block runs on one device; for tensor parallelism "
                             "use mambalab.parallel.TensorParallelMamba2 (it takes a ParallelLayout)")
        factory = {"device": device, "dtype": dtype}
        self.d_model = d_model
        self.d_state = d_state
        self.d_conv = d_conv
        self.conv_init = conv_init
        self.expand = expand
        self.d_inner = int(expand * d_model) if d_inner is None else int(d_inner)
        self.d_ssm = self.d_inner if d_ssm is None else int(d_ssm)
        if not 0 < self.d_ssm <= self.d_inner:
            raise ValueError(f"d_ssm must lie in [1, d_inner = {self.d_inner}]; got {d_ssm}")
        if self.d_ssm % headdim:
            raise ValueError(f"headdim = {headdim} must divide d_ssm = {self.d_ssm} (d_inner = expand · d_model "
                             f"unless d_inner or d_ssm is given)")
        if scan not in SCANS:
            raise ValueError(f"scan must be one of {SCANS}; got {scan!r}")
        self.scan = scan
        self.headdim = headdim
        self.nheads = self.d_ssm // headdim
        if self.nheads % ngroups:
            raise ValueError(f"ngroups = {ngroups} must divide nheads = {self.nheads}")
        self.ngroups = ngroups
        if not 0 < A_init_range[0] <= A_init_range[1]:
            raise ValueError(f"need 0 < A_init_range[0] <= A_init_range[1]; got {A_init_range}")
        if not 0 < dt_min <= dt_max:
            raise ValueError(f"need 0 < dt_min <= dt_max; got dt_min={dt_min}, dt_max={dt_max}")
        self.D_has_hdim = bool(D_has_hdim)
        self.dt_limit = tuple(dt_limit)
        self.chunk_size = chunk_size
        self.rmsnorm = rmsnorm
        self.norm_before_gate = norm_before_gate
        self.use_mem_eff_path = use_mem_eff_path
        self.layer_idx = layer_idx
        self.process_group = None
        self.sequence_parallel = sequence_parallel
        self.reduction = reduction

        self.in_proj = nn.Linear(d_model, sum(self.split_sizes()), bias=bias, **factory)
        # groups=conv_dim: one filter per channel (depthwise); padding d_conv - 1 on both sides, and forward
        # keeps the first l outputs, which makes it causal.
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, kernel_size=d_conv, groups=self.conv_dim,
                                padding=d_conv - 1, bias=conv_bias, **factory)
        if conv_init is not None:
            nn.init.uniform_(self.conv1d.weight, -conv_init, conv_init)

        # Δ = softplus(dt_bias) log-uniform in [dt_min, dt_max] at first: heads start with memories from
        # ~1/dt_max to ~1/dt_min steps. softplus⁻¹(y) = y + log(1 - e⁻ʸ), with expm1 for accuracy at small y.
        log_dt = torch.empty(self.nheads, device=device, dtype=torch.float32).uniform_(
            math.log(dt_min), math.log(dt_max))
        dt = log_dt.exp().clamp(min=dt_init_floor)                                  # (h,)
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))
        A = torch.empty(self.nheads, device=device, dtype=torch.float32).uniform_(*A_init_range)
        self.A_log = nn.Parameter(torch.log(A))                                      # (h,)
        self.D = nn.Parameter(torch.ones(self.d_ssm if self.D_has_hdim else self.nheads, device=device,
                                         dtype=torch.float32))                        # (h,) or (h p,)
        # Optimisers that honour it skip weight decay: decaying these towards 0 is not a regulariser.
        for name in FP32_PARAMETERS:
            getattr(self, name)._no_weight_decay = True
        # Init hooks that honour it (mambalab.modules.lm.reset_biases) leave dt_bias alone: zeroing it like an
        # ordinary bias would make every head's Δ softplus(0) = 0.69 and erase the spread of memories above.
        self.dt_bias._no_reinit = True

        if rmsnorm:
            self.norm = GatedRMSNorm(self.d_ssm, eps=1e-5, group_size=self.d_ssm // ngroups,
                                     norm_before_gate=norm_before_gate, **factory)
        self.out_proj = nn.Linear(self.d_inner, d_model, bias=bias, **factory)

    # ------------------------------------------------------------------------------------------ layout
    @property
    def d_mlp(self) -> int:
        """Channels of the gated MLP beside the SSD: d_inner - d_ssm (0 unless ``d_ssm`` is given)."""
        return self.d_inner - self.d_ssm

    @property
    def conv_dim(self) -> int:
        """Channels of the convolution: x (d_ssm), then B and C (ngroups · d_state each)."""
        return self.d_ssm + 2 * self.ngroups * self.d_state

    def split_sizes(self) -> list[int]:
        """in_proj's output, in order: [z0 (d_mlp), x0 (d_mlp), z (d_ssm), xBC (conv_dim), dt (nheads)]."""
        return [self.d_mlp, self.d_mlp, self.d_ssm, self.conv_dim, self.nheads]

    def xBC_split_sizes(self) -> list[int]:
        """The conv's output, in order: [x (d_ssm), B (ngroups · d_state), C (ngroups · d_state)]."""
        return [self.d_ssm, self.ngroups * self.d_state, self.ngroups * self.d_state]

    def split_heads(self, x: torch.Tensor, B: torch.Tensor, C: torch.Tensor):
        """(..., d_ssm), (..., g n), (..., g n) -> x (..., h, p), B (..., g, n), C (..., g, n).

        Channel c of x belongs to head c // p; column j of B or C to group j // n."""
        return (x.unflatten(-1, (self.nheads, self.headdim)),
                B.unflatten(-1, (self.ngroups, self.d_state)),
                C.unflatten(-1, (self.ngroups, self.d_state)))

    def _apply(self, fn, *args, **kwargs):
        # .half() and .bfloat16() cast every parameter; put the fp32 ones back (same device). A float64 block
        # (.double(), the tests' oracle precision) keeps them in float64.
        super()._apply(fn, *args, **kwargs)
        for name in FP32_PARAMETERS:
            p = getattr(self, name)
            if p.dtype in (torch.float16, torch.bfloat16):
                p.data = p.data.float()
        return self

    def _skip(self) -> torch.Tensor:
        """D as the scan takes it: (h,), or (h, p) with ``D_has_hdim``."""
        return self.D.unflatten(0, (self.nheads, self.headdim)) if self.D_has_hdim else self.D

    # ------------------------------------------------------------------------------------------ forward
    def forward(self, u: torch.Tensor, seqlen: int | None = None, seq_idx=None, cu_seqlens=None,
                inference_params=None, *, cache: tuple[torch.Tensor, torch.Tensor] | None = None):
        """u (b, l, d_model) -> (b, l, d_model); or, with ``seqlen``, u (b · seqlen, d_model) -> the same shape.

        seqlen: mamba-ssm's flattened form (rows of u are b sequences of ``seqlen`` positions, one after the
            other), which sequence-parallel callers use.
        seq_idx: (b, l) int32, nondecreasing along l but for -1 (padding): packed sequences (module
            docstring); the conv window and the SSD state restart wherever it changes.
        cu_seqlens: (num_seqs + 1,) integers, 0 first, never decreasing, at most l last (b = 1; the positions
            after it are padding, an empty sequence's state is zero): sequence i is
            positions cu_seqlens[i] … cu_seqlens[i + 1] - 1. Without seq_idx it implies it. With
            ``inference_params`` or ``cache`` the states kept are per sequence: (num_seqs, ...).
        inference_params: mamba-ssm's ``InferenceParams`` (see the module docstring): this layer's states
            live in its ``key_value_memory_dict[layer_idx]``; at ``seqlen_offset == 0`` the whole prompt runs
            and fills them, after that each call is one :meth:`step` (l = 1).
        cache: mambalab's form, keyword-only: ``(conv_state, ssm_state)`` from :meth:`allocate_inference_cache`,
            overwritten with the states after the last position (a prefill), so :meth:`step` can continue.
        """
        if seqlen is not None:
            if u.dim() != 2 or u.shape[-1] != self.d_model or seqlen < 1 or u.shape[0] % seqlen:
                raise ValueError(f"with seqlen = {seqlen}, u must have shape (b · seqlen, d_model={self.d_model}); "
                                 f"got {tuple(u.shape)}")
            return self.forward(u.unflatten(0, (-1, seqlen)), seq_idx=seq_idx, cu_seqlens=cu_seqlens,
                                inference_params=inference_params, cache=cache).flatten(0, 1)
        if u.dim() != 3 or u.shape[-1] != self.d_model:
            raise ValueError(f"u must have shape (b, l, d_model={self.d_model}); got {tuple(u.shape)}")
        if inference_params is not None:
            if cache is not None:
                raise ValueError("pass either inference_params or cache, not both")
            rows = cu_seqlens.shape[0] - 1 if isinstance(cu_seqlens, torch.Tensor) else u.shape[0]
            cache = self._get_states_from_cache(inference_params, rows)
            if inference_params.seqlen_offset > 0:   # one token per sequence: (num_seqs, 1, d_model)
                return self.step(u, *cache)[0]
        seq_idx = self._packed(u, seq_idx, cu_seqlens)

        z0, x0, z, xBC, dt = self.in_proj(u).split(self.split_sizes(), dim=-1)  # (b, l, ·) each, see split_sizes
        xBC = xBC.transpose(1, 2)                                           # (b, conv_dim, l): channels first
        if cache is not None and cu_seqlens is not None:                    # one window per sequence
            cache[0].copy_(varlen_conv_states(xBC, cu_seqlens, self.d_conv))
            xBC = self._conv(xBC, seq_idx=seq_idx)
        else:
            xBC = self._conv(xBC, cache[0] if cache is not None else None, seq_idx=seq_idx)
        xBC = xBC.transpose(1, 2)                                           # (b, l, conv_dim)
        x, B, C = self.split_heads(*xBC.split(self.xBC_split_sizes(), dim=-1))  # (b,l,h,p), (b,l,g,n), (b,l,g,n)
        A = -torch.exp(self.A_log.float())                                  # (h,)

        gate_in_scan = None if self.rmsnorm else z.unflatten(-1, (self.nheads, self.headdim))
        y = self._scan(x, dt, A, B, C, gate_in_scan, return_final_states=cache is not None, seq_idx=seq_idx,
                       cu_seqlens=cu_seqlens)
        if cache is not None:
            y, final_state = y                                 # (b, l, h, p), (b or num_seqs, h, p, n)
            cache[1].copy_(final_state)
        y = y.flatten(-2)                                                   # (b, l, d_ssm)
        if self.rmsnorm:
            y = self.norm(y, z)
        if self.d_mlp > 0:
            y = torch.cat([F.silu(z0) * x0, y], dim=-1)                     # (b, l, d_inner)
        return self.out_proj(y)                                             # (b, l, d_model)

    def _packed(self, u, seq_idx, cu_seqlens):
        """The packed-sequence arguments, checked: returns seq_idx (b, l) int32, or None; derived from cu_seqlens
        when only that is given."""
        b, l = u.shape[0], u.shape[1]
        if seq_idx is not None:
            validate.index_tensor("seq_idx", seq_idx)
            validate.shape("seq_idx", seq_idx, (b, l), "(b, l), like u's first two")
            seq_idx = seq_idx.to(device=u.device, dtype=torch.int32)
        if cu_seqlens is None:
            return seq_idx
        validate.index_tensor("cu_seqlens", cu_seqlens)
        if b != 1:
            raise ValueError(f"cu_seqlens needs the sequences packed into one row, b = 1 (u.shape[0]); got b = {b}")
        bounds = cu_seqlens.tolist() if cu_seqlens.dim() == 1 else None
        if (bounds is None or len(bounds) < 2 or bounds[0] != 0 or bounds[-1] > l
                or any(e < s for s, e in zip(bounds, bounds[1:]))):
            raise ValueError(f"cu_seqlens must be (num_seqs + 1,) from 0, never decreasing, to at most l = {l}; "
                             f"got {bounds if bounds is not None else tuple(cu_seqlens.shape)}")
        if seq_idx is None:   # positions after the last sequence are padding: -1, as mamba-ssm marks them
            lengths = torch.tensor([e - s for s, e in zip(bounds, bounds[1:])] + [l - bounds[-1]], device=u.device)
            ids = torch.arange(-1, len(bounds) - 1, device=u.device, dtype=torch.int32).roll(-1)   # 0 … k-1, -1
            seq_idx = torch.repeat_interleave(ids, lengths)[None]                 # (1, l)
        return seq_idx

    def _conv(self, xBC, conv_state=None, seq_idx=None):
        """The causal conv and its SiLU over xBC (b, conv_dim, l) -> (b, conv_dim, l); ``conv_state`` (b,
        conv_dim, d_conv), when given, is overwritten with the last d_conv inputs."""
        return causal_conv1d(self.conv1d, xBC, conv_state, seq_idx=seq_idx)

    def _scan(self, x, dt, A, B, C, z, return_final_states: bool, seq_idx=None, cu_seqlens=None):
        """SSD over the sequence with this block's D, dt_bias, dt_limit and chunk size: the kernel op, or the
        fp32 reference for ``scan="reference"``; float64 inputs (which the kernels do not take) run the
        reference forms in float64. With ``cu_seqlens`` and ``return_final_states`` the state returned is
        each sequence's final state (num_seqs, h, p, n)."""
        b, l, h, p = x.shape
        if l == 0:  # an empty sequence: empty output, and the state stays the initial (zero) state
            y = x.new_zeros(b, 0, h, p)
            state = torch.zeros(b, h, p, self.d_state, device=x.device, dtype=torch.promote_types(x.dtype, torch.float32))
            return (y, state) if return_final_states else y
        varlen = cu_seqlens is not None and return_final_states
        if x.dtype == torch.float64:
            return self._scan_float64(x, dt, B, C, z, return_final_states, seq_idx, cu_seqlens if varlen else None)
        common = dict(chunk_size=self.chunk_size, D=self._skip().float(), z=z, dt_bias=self.dt_bias.float(),
                      dt_softplus=True, dt_limit=self.dt_limit, return_final_states=return_final_states and not varlen,
                      seq_idx=seq_idx, cu_seqlens=cu_seqlens, return_varlen_states=varlen)
        if self.scan == "kernel":
            return ssd_chunk_scan(x, dt, A, B, C, reduction=self.reduction, **common)
        method = "chunked" if seq_idx is None else "recurrent" if varlen else "quadratic"
        return ssd_ref(x, dt, A, B, C, method=method, **common)

    def _scan_float64(self, x, dt, B, C, z, return_final_states: bool, seq_idx=None, cu_seqlens=None):
        """The SSD of :meth:`_scan` in float64 throughout: y = ssd_chunked(x, Δ, A, B, C) + D x, gated by
        silu(z) when z is given, with Δ = clamp(softplus(dt + dt_bias), *dt_limit); with ``seq_idx`` the
        quadratic form (the recurrent one for ``cu_seqlens``'s per-sequence states)."""
        f64 = torch.float64
        delta = F.softplus(dt.to(f64) + self.dt_bias.to(f64)).clamp(*self.dt_limit)      # (b, l, h)
        args = (x, delta, -torch.exp(self.A_log.to(f64)), B.to(f64), C.to(f64))
        if cu_seqlens is not None:
            y, _, final = ssd_recurrent(*args, seq_idx=seq_idx, states_at=last_positions(cu_seqlens))
            final = final[:, 0]                                                           # (num_seqs, h, p, n)
        elif seq_idx is not None:
            y, final = ssd_quadratic(*args, seq_idx=seq_idx)
        else:
            y, final = ssd_chunked(*args, self.chunk_size)
        D = self._skip().to(f64)
        y = y + x * (D if self.D_has_hdim else D[:, None])                                # (b, l, h, p)
        if z is not None:
            y = y * F.silu(z.to(f64))
        return (y, final) if return_final_states else y

    # ------------------------------------------------------------------------------------------ decoding
    def allocate_inference_cache(self, batch_size: int, max_seqlen: int | None = None, dtype=None, **kwargs):
        """Zeroed ``(conv_state (b, conv_dim, d_conv), ssm_state (b, h, p, n))`` for :meth:`step`: mamba-ssm's
        tuple.

        conv_state is in ``dtype`` (default conv1d's weight's); ssm_state in fp32 (fp64 for a fp64 block or
        ``dtype``), where mamba-ssm uses ``dtype``: the state accumulates over the whole sequence, so it is
        kept in at least fp32. ``max_seqlen`` and ``kwargs`` are accepted for mamba-ssm's signature and
        unused: the states do not grow with length.
        """
        conv_state = new_conv_state(self.conv1d, batch_size, dtype)
        ssm_state = torch.zeros(batch_size, self.nheads, self.headdim, self.d_state, device=self.conv1d.weight.device,
                                dtype=torch.promote_types(dtype or self.in_proj.weight.dtype, torch.float32))
        return conv_state, ssm_state

    def _get_states_from_cache(self, inference_params, batch_size: int, initialize_states: bool = False):
        """This layer's ``(conv_state, ssm_state)`` in ``inference_params.key_value_memory_dict``, made on
        first use (zeroed again with ``initialize_states``)."""
        return states_from_cache(self, inference_params, batch_size, initialize_states)

    def step(self, hidden_states: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor):
        """Decode one token: hidden_states (b, 1, d_model) -> (out (b, 1, d_model), conv_state, ssm_state).

        mamba-ssm's ``Mamba2.step``. The states are updated in place (and returned). Running ``step`` over a
        sequence from zeroed states gives the same outputs as :meth:`forward` on the whole sequence.
        """
        validate.one_token("hidden_states", hidden_states, self.d_model)
        dtype = hidden_states.dtype
        cd = torch.promote_types(dtype, torch.float32)                        # fp32, or fp64 for a fp64 block

        z0, x0, z, xBC, dt = self.in_proj(hidden_states[:, 0]).split(self.split_sizes(), dim=-1)  # (b, ·) each
        xBC = causal_conv1d_step(self.conv1d, xBC, conv_state)              # (b, conv_dim)
        x, B, C = self.split_heads(*xBC.split(self.xBC_split_sizes(), dim=-1))  # (b, h, p), (b, g, n), (b, g, n)

        if self.scan == "kernel" and device.inference_kernels_apply(hidden_states, *self.parameters(recurse=False)):
            # one Triton kernel: A = -exp(A_log), Δ, the state's one read and write, C, D (and the gate without
            # the norm); it reads A_log, D and dt_bias in their own dtype and widens them to fp32 itself (no
            # kernels a step to prepare them)
            b, h, p, n = ssm_state.shape
            D = self._skip()
            y = selective_state_update(
                ssm_state, x, dt[..., None].expand(b, h, p), self.A_log[:, None, None].expand(h, p, n), B, C,
                D if self.D_has_hdim else D[:, None].expand(h, p),
                z=None if self.rmsnorm else z.unflatten(-1, (h, p)),
                dt_bias=self.dt_bias[:, None].expand(h, p), dt_softplus=True,
                dt_limit=None if self.dt_limit == (0.0, float("inf")) else self.dt_limit, A_is_log=True).flatten(-2)
            if self.rmsnorm:
                y = self.norm(y, z)
            if self.d_mlp > 0:
                y = torch.cat([F.silu(z0) * x0, y.to(dtype)], dim=-1)              # (b, d_inner)
            return self.out_proj(y.to(dtype)).unsqueeze(1), conv_state, ssm_state
        # Δ = clamp(softplus(dt + dt_bias), *dt_limit), as the scan forms it
        A = -torch.exp(self.A_log.to(cd))                                      # (h,)
        D = self._skip().to(cd)
        dt = F.softplus(dt.to(cd) + self.dt_bias.to(cd)).clamp(*self.dt_limit)  # (b, h)
        state, y = ssd_step(ssm_state.to(cd), x.to(cd), dt, A, B.to(cd), C.to(cd))
        ssm_state.copy_(state)                                                 # (b, h, p, n)
        y = y + (D if self.D_has_hdim else D[:, None]) * x.to(cd)              # (b, h, p)
        y = y.flatten(-2)                                                      # (b, d_ssm)
        if self.rmsnorm:
            y = self.norm(y.to(dtype), z)
        else:
            y = (y * F.silu(z.to(cd))).to(dtype)
        if self.d_mlp > 0:
            y = torch.cat([F.silu(z0) * x0, y], dim=-1)                        # (b, d_inner)
        return self.out_proj(y).unsqueeze(1), conv_state, ssm_state

    def extra_repr(self) -> str:
        return (f"d_model={self.d_model}, d_inner={self.d_inner}, d_ssm={self.d_ssm}, d_state={self.d_state}, "
                f"d_conv={self.d_conv}, nheads={self.nheads}, headdim={self.headdim}, ngroups={self.ngroups}, "
                f"chunk_size={self.chunk_size}")
