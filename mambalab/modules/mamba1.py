"""The Mamba-1 block: a gated, input-selective state-space layer around :func:`mambalab.ops.selective_scan`.

Parameter names, shapes and initialisation follow mamba-ssm's ``Mamba`` (``mamba_ssm.modules.mamba_simple``),
so a state dict saved from one loads into the other. For hidden states of shape (b, l, d_model):

    x, z = in_proj(hidden)                      two (b, d, l) streams, d = d_inner = expand · d_model
    x    = silu(causal depthwise conv1d(x))     each channel sees its last d_conv inputs
    Δ, B, C = split(x_proj(x))                  Δ_low (b, l, r), B and C (b, l, n): the "selective" part
    Δ    = dt_proj.weight @ Δ_low               (b, d, l), low rank r = dt_rank; its bias enters the scan
    y    = selective_scan(x, Δ, A, B, C, D, z, delta_bias=dt_proj.bias, delta_softplus=True)
    out  = out_proj(y)                          (b, l, d_model)

with A = -exp(A_log) (d, n), negative so every state decays, and D (d,) a skip connection.

Decoding token by token (:meth:`Mamba1.step`) keeps two states per sequence, made by
:meth:`Mamba1.allocate_inference_cache`: ``conv_state`` (b, d, d_conv), the last d_conv conv inputs (oldest
first), and ``ssm_state`` (b, d, n) fp32, the scan's h. One step costs O(d · n) whatever the position.

mamba-ssm's generation loop drives the block as it drives mamba-ssm's: ``forward(hidden_states,
inference_params=p)`` keeps this layer's ``(conv_state, ssm_state)`` in ``p.key_value_memory_dict[layer_idx]``
(made on first use), fills them from the prompt when ``p.seqlen_offset == 0`` and takes one :meth:`step`
per call after that. mambalab's own form is ``forward(hidden_states, cache=(conv_state, ssm_state))``.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from mambalab import device, validate
from mambalab.modules.conv import causal_conv1d, causal_conv1d_step, new_conv_state
from mambalab.ops import selective_scan
from mambalab.ops.state_update import selective_state_update
from mambalab.ref.selective_scan import selective_scan_step
from mambalab.modules.inference_cache import states_from_cache

__all__ = ["Mamba1"]


class Mamba1(nn.Module):
    """Mamba-1 block (b, l, d_model) -> (b, l, d_model); see the module docstring for the math.

    Args:
        d_model: width of the residual stream.
        d_state: n, the state size per channel.
        d_conv: width of the causal depthwise convolution.
        expand: d_inner = expand · d_model channels inside the block.
        dt_rank: r, the rank of the Δ projection; "auto" means ceil(d_model / 16).
        dt_min, dt_max: at initialisation softplus(dt_proj.bias) is log-uniform in [dt_min, dt_max] ...
        dt_init_floor: ... and at least this.
        dt_init: "random" (dt_proj.weight uniform in ±dt_scale / sqrt(r)) or "constant" (all dt_scale / sqrt(r)).
        dt_scale: scale of dt_proj.weight at initialisation.
        conv_bias: give conv1d a bias.  bias: give in_proj and out_proj biases.
        use_fast_path: accepted for mamba-ssm's signature; changes nothing here (mamba-ssm's fused
            conv-scan-projection kernel; mambalab always runs the conv, then :func:`mambalab.ops.selective_scan`).
        layer_idx: this block's key in ``inference_params.key_value_memory_dict`` (needed only for decoding
            with ``inference_params``).
        device, dtype: where and in what dtype to make the parameters (A_log and D are always fp32).
    """

    def __init__(self, d_model, d_state=16, d_conv=4, expand=2, dt_rank="auto", dt_min=0.001, dt_max=0.1,
                 dt_init="random", dt_scale=1.0, dt_init_floor=1e-4, conv_bias=True, bias=False, use_fast_path=True,
                 layer_idx=None, device=None, dtype=None):
        super().__init__()
        if dt_init not in ("random", "constant"):
            raise ValueError(f'dt_init must be "random" or "constant"; got {dt_init!r}')
        if not 0 < dt_min <= dt_max:
            raise ValueError(f"need 0 < dt_min <= dt_max; got dt_min={dt_min}, dt_max={dt_max}")
        factory = {"device": device, "dtype": dtype}
        self.use_fast_path = use_fast_path
        self.layer_idx = layer_idx
        self.d_model = d_model
        self.d_state = d_state
        self.d_conv = d_conv
        self.expand = expand
        self.d_inner = int(expand * d_model)
        self.dt_rank = math.ceil(d_model / 16) if dt_rank == "auto" else int(dt_rank)
        d, n, r = self.d_inner, d_state, self.dt_rank

        self.in_proj = nn.Linear(d_model, 2 * d, bias=bias, **factory)
        # groups=d: one filter per channel (depthwise); padding d_conv - 1 on both sides, and forward keeps
        # the first l outputs, which makes it causal.
        self.conv1d = nn.Conv1d(d, d, kernel_size=d_conv, groups=d, padding=d_conv - 1, bias=conv_bias,
                                **factory)
        self.x_proj = nn.Linear(d, r + 2 * n, bias=False, **factory)
        self.dt_proj = nn.Linear(r, d, bias=True, **factory)
        self.out_proj = nn.Linear(d, d_model, bias=bias, **factory)

        # A = -exp(A_log) = -(1, 2, ..., n) in every channel (S4D-real): states decaying at n different rates.
        A = torch.arange(1, n + 1, dtype=torch.float32, device=device).repeat(d, 1)  # (d, n)
        self.A_log = nn.Parameter(torch.log(A))
        self.D = nn.Parameter(torch.ones(d, dtype=torch.float32, device=device))
        # Optimisers that honour it skip weight decay: decaying A_log or D towards 0 is not a regulariser.
        self.A_log._no_weight_decay = True
        self.D._no_weight_decay = True

        self._init_dt(dt_init, dt_scale, dt_min, dt_max, dt_init_floor)

    @torch.no_grad()
    def _init_dt(self, dt_init, dt_scale, dt_min, dt_max, dt_init_floor):
        """dt_proj: weights that keep Δ's variance independent of r, and a bias that puts Δ = softplus(bias)
        log-uniformly in [dt_min, dt_max], so channels start with memories from ~1/dt_max to ~1/dt_min steps."""
        std = self.dt_rank ** -0.5 * dt_scale
        if dt_init == "random":
            nn.init.uniform_(self.dt_proj.weight, -std, std)
        else:
            nn.init.constant_(self.dt_proj.weight, std)
        w = self.dt_proj.bias
        log_dt = torch.empty(self.d_inner, device=w.device, dtype=torch.float32).uniform_(
            math.log(dt_min), math.log(dt_max))
        dt = log_dt.exp().clamp(min=dt_init_floor)          # (d,)
        # softplus⁻¹(y) = log(eˣ - 1) = y + log(1 - e⁻ʸ), written with expm1 to stay accurate for small y.
        self.dt_proj.bias.copy_(dt + torch.log(-torch.expm1(-dt)))
        # A framework that zeroes every Linear bias at init must leave this one alone.
        self.dt_proj.bias._no_reinit = True

    def forward(self, hidden_states: torch.Tensor, inference_params=None, *,
                cache: tuple[torch.Tensor, torch.Tensor] | None = None):
        """hidden_states (b, l, d_model) -> (b, l, d_model).

        inference_params: mamba-ssm's ``InferenceParams`` (see the module docstring): this layer's states live
        in its ``key_value_memory_dict[layer_idx]``; at ``seqlen_offset == 0`` the whole prompt runs and fills
        them, after that each call is one :meth:`step` (l = 1).
        cache: mambalab's form, keyword-only: ``(conv_state, ssm_state)`` from :meth:`allocate_inference_cache`,
        overwritten with the states after the last position (a prefill), so :meth:`step` can continue.
        """
        if hidden_states.dim() != 3 or hidden_states.shape[-1] != self.d_model:
            raise ValueError(f"hidden_states must have shape (b, l, d_model={self.d_model}); "
                             f"got {tuple(hidden_states.shape)}")
        if inference_params is not None:
            if cache is not None:
                raise ValueError("pass either inference_params or cache, not both")
            cache = self._get_states_from_cache(inference_params, hidden_states.shape[0])
            if inference_params.seqlen_offset > 0:
                return self.step(hidden_states, *cache)[0]
        n, r = self.d_state, self.dt_rank

        xz = self.in_proj(hidden_states).transpose(1, 2)         # (b, 2d, l): channels first for the conv and scan
        x, z = xz.chunk(2, dim=1)                                # (b, d, l) each
        x = causal_conv1d(self.conv1d, x, cache[0] if cache is not None else None)  # (b, d, l)

        x_dbl = self.x_proj(x.transpose(1, 2))                   # (b, l, r + 2n)
        dt, B, C = x_dbl.split([r, n, n], dim=-1)                # (b, l, r), (b, l, n), (b, l, n)
        dt = F.linear(dt, self.dt_proj.weight).transpose(1, 2)   # (b, d, l); the bias is added inside the scan
        B = B.transpose(1, 2)                                    # (b, n, l)
        C = C.transpose(1, 2)                                    # (b, n, l)
        A = -torch.exp(self.A_log.float())                       # (d, n)

        y = selective_scan(x, dt, A, B, C, self.D.float(), z=z, delta_bias=self.dt_proj.bias.float(),
                           delta_softplus=True, return_last_state=cache is not None)
        if cache is not None:
            y, last_state = y                                    # (b, d, l), (b, d, n)
            cache[1].copy_(last_state)
        return self.out_proj(y.transpose(1, 2))                  # (b, l, d_model)

    def allocate_inference_cache(self, batch_size: int, max_seqlen: int | None = None, dtype=None, **kwargs):
        """Zeroed ``(conv_state (b, d, d_conv), ssm_state (b, d, n))`` for :meth:`step`: mamba-ssm's tuple.

        conv_state is in ``dtype`` (default conv1d's weight's); ssm_state in fp32 (fp64 for a fp64 block or
        ``dtype``), where mamba-ssm uses ``dtype``: the state accumulates over the whole sequence, so it is
        kept in at least fp32. ``max_seqlen`` and ``kwargs`` are accepted for mamba-ssm's signature and
        unused: the states do not grow with length.
        """
        conv_state = new_conv_state(self.conv1d, batch_size, dtype)
        ssm_state = torch.zeros(batch_size, self.d_inner, self.d_state, device=self.conv1d.weight.device,
                                dtype=torch.promote_types(dtype or self.dt_proj.weight.dtype, torch.float32))
        return conv_state, ssm_state

    def _get_states_from_cache(self, inference_params, batch_size: int, initialize_states: bool = False):
        """This layer's ``(conv_state, ssm_state)`` in ``inference_params.key_value_memory_dict``, made on
        first use (zeroed again with ``initialize_states``)."""
        return states_from_cache(self, inference_params, batch_size, initialize_states)

    def step(self, hidden_states: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor):
        """Decode one token: hidden_states (b, 1, d_model) -> (out (b, 1, d_model), conv_state, ssm_state).

        mamba-ssm's ``Mamba.step``. The states are updated in place (and returned). Running ``step`` over a sequence from zeroed states
        gives the same outputs as :meth:`forward` on the whole sequence.
        """
        validate.one_token("hidden_states", hidden_states, self.d_model)
        dtype = hidden_states.dtype
        n, r = self.d_state, self.dt_rank

        x, z = self.in_proj(hidden_states[:, 0]).chunk(2, dim=-1)             # (b, d) each
        x = causal_conv1d_step(self.conv1d, x, conv_state)                  # (b, d)

        dt, B, C = self.x_proj(x).split([r, n, n], dim=-1)                   # (b, r), (b, n), (b, n)
        if device.inference_kernels_apply(hidden_states, *self.parameters(recurse=False)):
            # one Triton kernel: A = -exp(A_log), softplus(Δ + bias), the state's one read and write, C, D and
            # the gate; it reads A_log, D and the bias in their own dtype and widens them to fp32 itself
            dt = F.linear(dt, self.dt_proj.weight)                           # (b, d), the bias in the kernel
            y = selective_state_update(ssm_state, x, dt, self.A_log, B, C, self.D, z=z, dt_bias=self.dt_proj.bias,
                                       dt_softplus=True, A_is_log=True)
        else:
            A = -torch.exp(self.A_log.float())                               # (d, n)
            dt = F.softplus(self.dt_proj(dt).float())                        # (b, d), bias included here
            h, y = selective_scan_step(ssm_state.float(), x.float(), dt, A, B.float(), C.float(), self.D.float())
            ssm_state.copy_(h)                                               # (b, d, n)
            y = y * F.silu(z.float())                                        # (b, d)
        out = self.out_proj(y.to(dtype))                                     # (b, d_model)
        return out.unsqueeze(1), conv_state, ssm_state

    def extra_repr(self) -> str:
        return (f"d_model={self.d_model}, d_inner={self.d_inner}, d_state={self.d_state}, "
                f"d_conv={self.d_conv}, dt_rank={self.dt_rank}")
