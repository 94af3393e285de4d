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
head, and D (h,) a skip connection. A_log, D and dt_bias are kept in fp32 whatever the module's dtype.

Everything is laid out by heads and groups: in_proj's output rows, the conv channels and the norm's groups
are concatenations of per-head (x, z, dt) and per-group (B, C) slices, in the order :meth:`Mamba2.split_sizes`
and :meth:`Mamba2.xBC_split_sizes` name. A tensor-parallel block gives each rank whole groups (and their
heads), slices every one of those pieces the same way, and runs this forward unchanged on its shard; only
out_proj's sum over ranks needs communication (the norm is per group).

Decoding token by token (:meth:`Mamba2.step`) keeps two states per sequence, made by
:meth:`Mamba2.allocate_inference_cache`: ``conv_state`` (b, d + 2 g n, d_conv), the last d_conv conv inputs
(oldest first), and ``ssm_state`` (b, h, p, n) fp32, SSD's state. One step costs O(h p n).
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from mambalab import validate
from mambalab.modules.conv import causal_conv1d, causal_conv1d_step, new_conv_state
from mambalab.modules.norm import GatedRMSNorm
from mambalab.ops import ssd_chunk_scan
from mambalab.ref.ssd import effective_dt, ssd_ref, ssd_step

__all__ = ["Mamba2"]

# Parameters whose precision matters more than their size: the decay, the skip and Δ's bias.
FP32_PARAMETERS = ("A_log", "D", "dt_bias")
# How the SSD is computed: mambalab's Triton kernels (ops.ssd_chunk_scan), or the pure-PyTorch chunked
# reference (ref.ssd_ref, autograd through plain tensor ops). Same math; the reference is ~500x faster on a
# CPU, where the kernels run in Triton's interpreter, so multi-process CPU demos and tests use it.
SCANS = ("kernel", "reference")


class Mamba2(nn.Module):
    """Mamba-2 block (b, l, d_model) -> (b, l, d_model); see the module docstring for the math.

    Args:
        d_model: width of the residual stream.
        d_state: n, the state size (columns of B and C per group).
        d_conv: width of the causal depthwise convolution over x, B and C.
        expand: d_inner = expand · d_model channels inside the block.
        headdim: p, channels per head; nheads = d_inner / headdim.
        ngroups: g, groups of B and C (and of the norm); must divide nheads.
        A_init_range: at initialisation A = -exp(A_log) is -uniform(*A_init_range) per head.
        dt_min, dt_max: at initialisation softplus(dt_bias) is log-uniform in [dt_min, dt_max] ...
        dt_init_floor: ... and at least this.
        dt_limit: Δ is clamped to this range inside the scan.
        chunk_size: q, SSD's chunk length.
        conv_bias: give conv1d a bias.  bias: give in_proj and out_proj biases.
        rmsnorm: gate and normalise with :class:`GatedRMSNorm`; without it, y ⊙ silu(z) inside the scan.
        norm_before_gate: see :class:`GatedRMSNorm`.
        reduction: the SSD backward's reduction ("atomic", "deterministic", or None for the default).
        scan: "kernel" (Triton, :func:`mambalab.ops.ssd_chunk_scan`) or "reference" (pure PyTorch,
            :func:`mambalab.ref.ssd.ssd_ref`); see ``SCANS``.
        d_inner: channels inside the block; default expand · d_model. A tensor-parallel shard passes its
            own share (d_inner / TP) here, with ngroups / TP groups.
        device, dtype: where and in what dtype to make the parameters (A_log, D and dt_bias are always fp32).
    """

    def __init__(self, d_model, d_state=128, d_conv=4, expand=2, headdim=64, ngroups=1, A_init_range=(1, 16),
                 dt_min=0.001, dt_max=0.1, dt_init_floor=1e-4, dt_limit=(0.0, float("inf")), chunk_size=256,
                 conv_bias=True, bias=False, rmsnorm=True, norm_before_gate=False, reduction=None, device=None,
                 dtype=None, *, scan="kernel", d_inner=None):
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        self.d_model = d_model
        self.d_state = d_state
        self.d_conv = d_conv
        self.expand = expand
        self.d_inner = int(expand * d_model) if d_inner is None else int(d_inner)
        if self.d_inner < 1 or self.d_inner % headdim:
            raise ValueError(f"headdim = {headdim} must divide d_inner = {self.d_inner} (expand · d_model "
                             f"unless d_inner is given)")
        if scan not in SCANS:
            raise ValueError(f"scan must be one of {SCANS}; got {scan!r}")
        self.scan = scan
        self.headdim = headdim
        self.nheads = self.d_inner // headdim
        if self.nheads % ngroups:
            raise ValueError(f"ngroups = {ngroups} must divide nheads = {self.nheads}")
        self.ngroups = ngroups
        if not 0 < A_init_range[0] <= A_init_range[1]:
            raise ValueError(f"need 0 < A_init_range[0] <= A_init_range[1]; got {A_init_range}")
        if not 0 < dt_min <= dt_max:
            raise ValueError(f"need 0 < dt_min <= dt_max; got dt_min={dt_min}, dt_max={dt_max}")
        self.dt_limit = tuple(dt_limit)
        self.chunk_size = chunk_size
        self.rmsnorm = rmsnorm
        self.norm_before_gate = norm_before_gate
        self.reduction = reduction

        self.in_proj = nn.Linear(d_model, sum(self.split_sizes()), bias=bias, **factory)
        # groups=conv_dim: one filter per channel (depthwise); padding d_conv - 1 on both sides, and forward
        # keeps the first l outputs, which makes it causal.
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, kernel_size=d_conv, groups=self.conv_dim,
                                padding=d_conv - 1, bias=conv_bias, **factory)

        # Δ = softplus(dt_bias) log-uniform in [dt_min, dt_max] at first: heads start with memories from
        # ~1/dt_max to ~1/dt_min steps. softplus⁻¹(y) = y + log(1 - e⁻ʸ), with expm1 for accuracy at small y.
        log_dt = torch.empty(self.nheads, device=device, dtype=torch.float32).uniform_(
            math.log(dt_min), math.log(dt_max))
        dt = log_dt.exp().clamp(min=dt_init_floor)                                  # (h,)
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))
        A = torch.empty(self.nheads, device=device, dtype=torch.float32).uniform_(*A_init_range)
        self.A_log = nn.Parameter(torch.log(A))                                      # (h,)
        self.D = nn.Parameter(torch.ones(self.nheads, device=device, dtype=torch.float32))
        # Optimisers that honour it skip weight decay: decaying these towards 0 is not a regulariser.
        for name in FP32_PARAMETERS:
            getattr(self, name)._no_weight_decay = True
        # Init hooks that honour it (mambalab.modules.lm.reset_biases) leave dt_bias alone: zeroing it like an
        # ordinary bias would make every head's Δ softplus(0) = 0.69 and erase the spread of memories above.
        self.dt_bias._no_reinit = True

        if rmsnorm:
            self.norm = GatedRMSNorm(self.d_inner, eps=1e-5, group_size=self.d_inner // ngroups,
                                     norm_before_gate=norm_before_gate, **factory)
        self.out_proj = nn.Linear(self.d_inner, d_model, bias=bias, **factory)

    # ------------------------------------------------------------------------------------------ layout
    @property
    def conv_dim(self) -> int:
        """Channels of the convolution: x (d_inner), then B and C (ngroups · d_state each)."""
        return self.d_inner + 2 * self.ngroups * self.d_state

    def split_sizes(self) -> list[int]:
        """in_proj's output, in order: [z (d_inner), xBC (conv_dim), dt (nheads)]."""
        return [self.d_inner, self.conv_dim, self.nheads]

    def xBC_split_sizes(self) -> list[int]:
        """The conv's output, in order: [x (d_inner), B (ngroups · d_state), C (ngroups · d_state)]."""
        return [self.d_inner, self.ngroups * self.d_state, self.ngroups * self.d_state]

    def split_heads(self, x: torch.Tensor, B: torch.Tensor, C: torch.Tensor):
        """(..., d_inner), (..., g n), (..., g n) -> x (..., h, p), B (..., g, n), C (..., g, n).

        Channel c of x belongs to head c // p; column j of B or C to group j // n."""
        return (x.unflatten(-1, (self.nheads, self.headdim)),
                B.unflatten(-1, (self.ngroups, self.d_state)),
                C.unflatten(-1, (self.ngroups, self.d_state)))

    def _apply(self, fn, *args, **kwargs):
        # .to(dtype), .half(), .bfloat16() cast every parameter; put the fp32 ones back (same device).
        super()._apply(fn, *args, **kwargs)
        for name in FP32_PARAMETERS:
            p = getattr(self, name)
            if p.dtype != torch.float32:
                p.data = p.data.float()
        return self

    # ------------------------------------------------------------------------------------------ forward
    def forward(self, u: torch.Tensor, cache: tuple[torch.Tensor, torch.Tensor] | None = None):
        """u (b, l, d_model) -> (b, l, d_model).

        cache: optionally ``(conv_state, ssm_state)`` from :meth:`allocate_inference_cache`; they are
        overwritten with the states after the last position (a prefill), so :meth:`step` can continue.
        """
        if u.dim() != 3 or u.shape[-1] != self.d_model:
            raise ValueError(f"u must have shape (b, l, d_model={self.d_model}); got {tuple(u.shape)}")

        z, xBC, dt = self.in_proj(u).split(self.split_sizes(), dim=-1)     # (b, l, d), (b, l, conv_dim), (b, l, h)
        xBC = xBC.transpose(1, 2)                                           # (b, conv_dim, l): channels first
        xBC = causal_conv1d(self.conv1d, xBC, cache[0] if cache is not None else None)
        xBC = xBC.transpose(1, 2)                                           # (b, l, conv_dim)
        x, B, C = self.split_heads(*xBC.split(self.xBC_split_sizes(), dim=-1))  # (b,l,h,p), (b,l,g,n), (b,l,g,n)
        A = -torch.exp(self.A_log.float())                                  # (h,)

        gate_in_scan = None if self.rmsnorm else z.unflatten(-1, (self.nheads, self.headdim))
        common = dict(D=self.D.float(), z=gate_in_scan, dt_bias=self.dt_bias.float(), dt_softplus=True,
                      dt_limit=self.dt_limit, return_final_states=cache is not None)
        if self.scan == "kernel":
            y = ssd_chunk_scan(x, dt, A, B, C, self.chunk_size, reduction=self.reduction, **common)
        else:
            y = ssd_ref(x, dt, A, B, C, self.chunk_size, method="chunked", **common)
        if cache is not None:
            y, final_state = y                                              # (b, l, h, p), (b, h, p, n)
            cache[1].copy_(final_state)
        y = y.flatten(-2)                                                   # (b, l, d)
        if self.rmsnorm:
            y = self.norm(y, z)
        return self.out_proj(y)                                             # (b, l, d_model)

    # ------------------------------------------------------------------------------------------ decoding
    def allocate_inference_cache(self, batch_size: int, max_seqlen: int | None = None, dtype=None):
        """Zeroed ``(conv_state (b, conv_dim, d_conv), ssm_state (b, h, p, n) fp32)`` for :meth:`step`.

        ``max_seqlen`` is accepted for mamba-ssm's signature and unused: the states do not grow with length.
        """
        conv_state = new_conv_state(self.conv1d, batch_size, dtype)
        ssm_state = torch.zeros(batch_size, self.nheads, self.headdim, self.d_state, device=self.conv1d.weight.device,
                                dtype=torch.float32)
        return conv_state, ssm_state

    def step(self, u: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor):
        """Decode one token: u (b, 1, d_model) -> (out (b, 1, d_model), conv_state, ssm_state).

        The states are updated in place (and returned). Running ``step`` over a sequence from zeroed states
        gives the same outputs as :meth:`forward` on the whole sequence.
        """
        validate.one_token("u", u, self.d_model)
        dtype = u.dtype

        z, xBC, dt = self.in_proj(u[:, 0]).split(self.split_sizes(), dim=-1)  # (b, d), (b, conv_dim), (b, h)
        xBC = causal_conv1d_step(self.conv1d, xBC, conv_state)              # (b, conv_dim)
        x, B, C = self.split_heads(*xBC.split(self.xBC_split_sizes(), dim=-1))  # (b, h, p), (b, g, n), (b, g, n)

        dt = effective_dt(dt, self.dt_bias, dt_softplus=True, dt_limit=self.dt_limit)  # (b, h) fp32
        A = -torch.exp(self.A_log.float())                                     # (h,)
        state, y = ssd_step(ssm_state.float(), x.float(), dt, A, B.float(), C.float())
        ssm_state.copy_(state)                                                 # (b, h, p, n)
        y = y + self.D.float()[:, None] * x.float()                            # (b, h, p)
        y = y.flatten(-2)                                                      # (b, d)
        if self.rmsnorm:
            y = self.norm(y.to(dtype), z)
        else:
            y = (y * F.silu(z.float())).to(dtype)
        return self.out_proj(y).unsqueeze(1), conv_state, ssm_state

    def extra_repr(self) -> str:
        return (f"d_model={self.d_model}, d_inner={self.d_inner}, d_state={self.d_state}, d_conv={self.d_conv}, "
                f"nheads={self.nheads}, headdim={self.headdim}, ngroups={self.ngroups}, "
                f"chunk_size={self.chunk_size}")
