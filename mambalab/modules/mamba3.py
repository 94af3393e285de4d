"""The Mamba-3 block: one input projection, RMS-normalised rank-r B and C with learned biases and a rotary
(complex) state, the exponential-trapezoidal recurrence, and an optional MIMO up/down projection.

Parameter names, shapes and initialisation follow mamba-ssm's ``Mamba3`` (``mamba_ssm.modules.mamba3``), so a
state dict saved from one loads into the other, and computes what mamba-ssm's does (tests/test_mamba3_module.py
compares them on a GPU, SISO and MIMO; mamba-ssm's kernels are GPU-only). mamba-ssm rotates adjacent pairs
(2i, 2i+1) of q and k in SISO but the pairs (i, i + n/2) in MIMO; our kernels rotate adjacent pairs, so a MIMO
block hands them q, k and their biases with the n axis permuted (:func:`~mambalab.ref.mamba3.halves_order`),
which computes mamba-ssm's MIMO function exactly. mamba-ssm's ``is_outproj_norm`` (SISO) gates and normalises
each head's output with a :class:`GatedRMSNorm` (group_size = p, norm_before_gate=True) instead of the gate
inside the scan.

With d = d_inner = expand · d_model channels cut into h = d / p heads of p = headdim channels, g = ngroups
groups of B and C (n = d_state each), r = mimo_rank (1 without MIMO) and a = the number of rotary angle
pairs, for hidden states u of shape (b, l, d_model):

    z, x, B, C, dd_dt, dd_A, trap, angle = split(in_proj(u))        see split_sizes()
    x, z  (b, l, h, p)        B, C (b, l, r, g, n): head i reads group i // (h / g)
    k = RMSNorm(B), q = RMSNorm(C)              over n; the op adds the biases B_bias, C_bias (h, r, n), init 1
    Δ = softplus(dd_dt + dt_bias)               (b, l, h) fp32, > 0
    A = min(-softplus(dd_A), -A_floor)          (b, l, h) fp32, a decay rate per token and head
    λ = sigmoid(trap)                           (b, l, h): 1/2 is the trapezoidal rule, 1 is Mamba-2's Euler
    ω = π tanh(angle)                           (b, l, a), shared by the heads: θ_t = θ_{t-1} + ω_t Δ_t
    y = mamba3_chunk_scan(q, k, x, AΔ, Δ, λ, C_bias, B_bias, ω, D, z, mimo_x, mimo_z, mimo_o)   (b, l, h, p)
    out = out_proj(y)                           (b, l, d_model)

Inside the scan, per head (v_{t,r} = x_t ⊙ W^V_r, and k, q biased and rotated by θ_t on their first 2a
entries), the state h_t (p, n) follows the exponential-trapezoidal rule (see :mod:`mambalab.ref.discretization`)

    h_t = α_t h_{t-1} + (1 - λ_t) Δ_t α_t Σ_r v_{t-1,r} k_{t-1,r}ᵀ + λ_t Δ_t Σ_r v_{t,r} k_{t,r}ᵀ
    α_t = e^{A_t Δ_t}
    y_t = Σ_r W^O_r ⊙ (h_t q_{t,r} + D v_{t,r}) ⊙ silu(z_t ⊙ W^Z_r)

MIMO (``is_mimo=True``) adds W^V = ``mimo_x`` (init 1/r), W^Z = ``mimo_z`` (init 1) and W^O = ``mimo_o``
(init 1/r), each (h, r, p): one state update then serves r input and r output channels per head, which raises
a decode step's FLOPs per byte of state moved (notebook 03). Without MIMO r = 1 and there are no W.

``rope_fraction`` f sets a = ⌊⌊f n⌋ / 2⌋ rotated pairs (f n rounded down to even, as mamba-ssm does);
f = 0 turns the rotation off (a = 0), which leaves a real-valued, decaying state: the ablation that
notebook 03 shows failing at parity. ``dt_bias``, ``D``, ``B_bias`` and ``C_bias`` stay in fp32 when the
module is cast to fp16 or bf16. The parameter count is about 6 d_model² (in_proj 4 d_model², out_proj
2 d_model², plus the B, C, Δ, A, λ and angle columns of in_proj).

Decoding token by token (:meth:`Mamba3.step`) carries, per sequence, the accumulated angles θ (b, h, a), the
state (b, h, p, n), and the previous token's k̂ (rotated, bias added) and v (b, h, p), which the trapezoidal
rule needs. One step costs O(h r p n), whatever the position. Two forms hold them:

* mambalab's :class:`~mambalab.ref.mamba3.Mamba3State` (:meth:`Mamba3.zero_state`, :meth:`forward` with
  ``return_final_state``, ``step(u, state)`` -> (out, new state)), in fp32 (fp64 in a fp64 block), k̂ as
  (b, h, r, n); in a MIMO block the n axes of the state and k̂ are in the permuted order above.
* mamba-ssm's tuple ``(angle_state, ssm_state, k_state, v_state)`` (:meth:`Mamba3.allocate_inference_cache`,
  ``step(u, angle_state, ssm_state, k_state, v_state)``, updated in place), with mamba-ssm's layouts and
  dtypes: k_state (b, r, h, n) and v_state in the block's dtype, n in mamba-ssm's order, so a state moves
  between the two libraries unchanged. ``forward(u, inference_params=p)`` keeps it in
  ``p.key_value_memory_dict[layer_idx]``, as mamba-ssm's generation loop expects.

The angle θ in a state is kept in [0, 2π), as mamba-ssm's scan leaves it: rotations by θ and θ mod 2π are
the same, and the reduced angle keeps its precision however long the sequence.

``backend`` picks the scan: ``"triton"`` (:func:`mambalab.ops.mamba3_chunk_scan` and
:func:`mambalab.ops.mamba3_step`, Triton kernels with autograd; on a CPU they run in Triton's interpreter) or
``"reference"`` (:func:`mambalab.ref.mamba3.mamba3_chunked` and ``mamba3_step_ref``, plain PyTorch, much
faster than the interpreter on a CPU and differentiable by autograd). Both compute the same function.
"""
from __future__ import annotations

import functools
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from mambalab import validate
from mambalab.modules.norm import GatedRMSNorm
from mambalab.ref.mamba3 import Mamba3State, halves_order, halves_to_pairs, pairs_to_halves, zero_state
from mambalab.modules.inference_cache import states_from_cache

__all__ = ["Mamba3", "BACKENDS", "MIMO_RANKS"]

BACKENDS = ("triton", "reference")
MIMO_RANKS = (1, 2, 4, 8)
# Parameters whose precision matters more than their size: Δ's bias, the skip and the q/k biases.
FP32_PARAMETERS = ("dt_bias", "D", "B_bias", "C_bias")


def scan_functions(backend: str, reduction: str | None = None):
    """(chunk_scan, step) for ``backend``: the one place the module chooses between kernels and reference.

    chunk_scan(q, k, v, adt, dt, trap, q_bias, k_bias, angles, D, z, mimo_v, mimo_z, mimo_o, initial_state,
    return_final_state, chunk_size) -> y or (y, state); step(state, q, k, v, adt, dt, trap, q_bias, k_bias,
    angles, D, z, mimo_v, mimo_z, mimo_o) -> (y, state), per-token shapes. ``reduction`` goes to the Triton
    backward (the reference's autograd has none to choose).
    """
    if backend == "triton":
        from mambalab.ops import mamba3_chunk_scan, mamba3_step
        return functools.partial(mamba3_chunk_scan, reduction=reduction), mamba3_step
    if backend == "reference":
        from mambalab.ref.mamba3 import mamba3_chunked, mamba3_step_ref
        return mamba3_chunked, mamba3_step_ref
    raise ValueError(f"backend must be one of {BACKENDS}; got {backend!r}")


def rope_angle_count(d_state: int, rope_fraction: float) -> int:
    """a, the number of rotated pairs of q and k: ⌊f n⌋ rounded down to even, halved (mamba-ssm's rule)."""
    rotated = int(d_state * rope_fraction)
    return (rotated - rotated % 2) // 2


class Mamba3(nn.Module):
    """Mamba-3 block (b, l, d_model) -> (b, l, d_model); see the module docstring for the math.

    Arguments in mamba-ssm's order, with its defaults:

    Args:
        d_model: width of the residual stream.
        d_state: n, the state size (columns of B and C per group and rank).
        expand: d_inner = expand · d_model channels inside the block.
        headdim: p, channels per head; nheads = d_inner / headdim.
        ngroups: g, groups of B and C (q/k heads); must divide nheads.
        rope_fraction: f in [0, 1], the fraction of the n state columns that rotate (0: a real-valued state;
            mamba-ssm takes 0.5 or 1).
        dt_min, dt_max: at initialisation softplus(dt_bias) is log-uniform in [dt_min, dt_max] ...
        dt_init_floor: ... and at least this.
        A_floor: A is clamped to at most -A_floor, so every head decays at least a little.
        is_outproj_norm: gate and normalise each head's output with a :class:`GatedRMSNorm` (``norm``) instead
            of the gate inside the scan (SISO only here).
        is_mimo: use r = mimo_rank input/output channels per state update; otherwise r = 1 (SISO).
        mimo_rank: r when is_mimo, one of 1, 2, 4, 8.
        chunk_size: q, the scan's chunk length (mamba-ssm suggests 64 for SISO, 64 / r for MIMO).
        dropout: must be 0 (no dropout is implemented; mamba-ssm's Mamba3 accepts the argument and ignores it).
        layer_idx: this block's key in ``inference_params.key_value_memory_dict`` (needed only for decoding
            with ``inference_params``).
        n_layer: accepted for mamba-ssm's signature (it ignores it too).
        device, dtype: where and in what dtype to make the parameters (FP32_PARAMETERS stay fp32 under fp16/bf16).
        **kwargs: accepted and ignored, as mamba-ssm's Mamba3 does (e.g. ``use_tilelang``, a choice of
            mamba-ssm's kernels); kept in ``ignored_kwargs``.

    mambalab's own, keyword-only:
        backend: "triton" (Triton kernels through mambalab.ops) or "reference" (pure PyTorch).
        reduction: the Triton backward's reduction ("atomic", "deterministic", or None for the default).
    """

    def __init__(self, d_model, d_state=128, expand=2, headdim=64, ngroups=1, rope_fraction=0.5, dt_min=0.001,
                 dt_max=0.1, dt_init_floor=1e-4, A_floor=1e-4, is_outproj_norm=False, is_mimo=False, mimo_rank=4,
                 chunk_size=64, dropout=0.0, layer_idx=None, n_layer=None, device=None, dtype=None, *,
                 backend="triton", reduction=None, **kwargs):
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        self.d_model = d_model
        self.d_state = d_state
        self.expand = expand
        self.d_inner = int(expand * d_model)
        if headdim < 1 or self.d_inner % headdim:
            raise ValueError(f"headdim = {headdim} must divide d_inner = expand · d_model = {self.d_inner}")
        self.headdim = headdim
        self.nheads = self.d_inner // headdim
        if ngroups < 1 or self.nheads % ngroups:
            raise ValueError(f"ngroups = {ngroups} must divide nheads = d_inner / headdim = {self.nheads}")
        self.ngroups = ngroups
        if not 0.0 <= rope_fraction <= 1.0:
            raise ValueError(f"rope_fraction must lie in [0, 1] (the fraction of d_state that rotates); "
                             f"got {rope_fraction}")
        self.rope_fraction = rope_fraction
        self.num_rope_angles = rope_angle_count(d_state, rope_fraction)
        if rope_fraction > 0 and self.num_rope_angles == 0:
            raise ValueError(f"rope_fraction = {rope_fraction} rotates no pair of d_state = {d_state} columns; "
                             f"use 0 for no rotation or at least {2 / d_state:g}")
        if mimo_rank not in MIMO_RANKS:
            raise ValueError(f"mimo_rank must be one of {MIMO_RANKS}; got {mimo_rank}")
        self.is_mimo = bool(is_mimo)
        self.mimo_rank = mimo_rank if is_mimo else 1
        if not 0 < dt_min <= dt_max:
            raise ValueError(f"need 0 < dt_min <= dt_max; got dt_min={dt_min}, dt_max={dt_max}")
        if not A_floor >= 0:
            raise ValueError(f"A_floor must be >= 0; got {A_floor}")
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be positive; got {chunk_size}")
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}; got {backend!r}")
        if dropout != 0:
            raise ValueError(f"dropout: mambalab's Mamba3 has no dropout (mamba-ssm's ignores the argument); "
                             f"pass 0, got {dropout}")
        if is_outproj_norm and is_mimo:
            raise NotImplementedError("is_outproj_norm with is_mimo: the per-rank output norm of a MIMO block is "
                                      "not implemented (SISO blocks support is_outproj_norm)")
        self.backend = backend
        self.reduction = reduction
        self.is_outproj_norm = bool(is_outproj_norm)
        self.layer_idx = layer_idx
        self.n_layer = n_layer
        self.ignored_kwargs = dict(kwargs)
        self.A_floor = A_floor
        self.chunk_size = chunk_size

        self.in_proj = nn.Linear(d_model, sum(self.split_sizes()), bias=False, **factory)

        # Δ = softplus(dt_bias) log-uniform in [dt_min, dt_max] at first; softplus⁻¹(y) = y + log(1 - e⁻ʸ).
        log_dt = torch.empty(self.nheads, device=device, dtype=torch.float32).uniform_(
            math.log(dt_min), math.log(dt_max))
        dt = log_dt.exp().clamp(min=dt_init_floor)                                   # (h,)
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))
        r, h, p, n = self.mimo_rank, self.nheads, headdim, d_state
        self.B_bias = nn.Parameter(torch.ones(h, r, n, device=device, dtype=torch.float32))   # k's bias
        self.C_bias = nn.Parameter(torch.ones(h, r, n, device=device, dtype=torch.float32))   # q's bias
        self.B_norm = GatedRMSNorm(d_state, eps=1e-5, **factory)
        self.C_norm = GatedRMSNorm(d_state, eps=1e-5, **factory)
        if self.is_mimo:
            self.mimo_x = nn.Parameter(torch.full((h, r, p), 1.0 / r, device=device))        # W^V
            self.mimo_z = nn.Parameter(torch.ones(h, r, p, device=device))                    # W^Z
            self.mimo_o = nn.Parameter(torch.full((h, r, p), 1.0 / r, device=device))        # W^O
        self.D = nn.Parameter(torch.ones(h, device=device, dtype=torch.float32))
        # Optimisers that honour it skip weight decay: decaying these towards 0 is not a regulariser.
        for name in ("dt_bias", "D"):
            getattr(self, name)._no_weight_decay = True
        if self.is_outproj_norm:
            self.norm = GatedRMSNorm(self.d_inner, eps=1e-5, group_size=headdim, norm_before_gate=True, **factory)
        self.out_proj = nn.Linear(self.d_inner, d_model, bias=False, **factory)

    # ------------------------------------------------------------------------------------------ layout
    def split_sizes(self) -> list[int]:
        """in_proj's output, in order:
        [z (d), x (d), B (r g n), C (r g n), dd_dt (h), dd_A (h), trap (h), angle (a)]."""
        bc = self.mimo_rank * self.ngroups * self.d_state
        return [self.d_inner, self.d_inner, bc, bc, self.nheads, self.nheads, self.nheads, self.num_rope_angles]

    def _apply(self, fn, *args, **kwargs):
        # .half() and .bfloat16() cast every parameter; put the fp32 ones back (same device). A float64
        # module (the tests' oracle precision) keeps them in float64.
        super()._apply(fn, *args, **kwargs)
        for name in FP32_PARAMETERS:
            param = getattr(self, name)
            if param.dtype in (torch.float16, torch.bfloat16):
                param.data = param.data.float()
        return self

    def pair_order(self, device=None) -> torch.Tensor:
        """MIMO's permutation of n (:func:`~mambalab.ref.mamba3.halves_order`: mamba-ssm's MIMO rotates the pairs
        (i, i + n/2), our kernels adjacent pairs) as an index; :meth:`scan_inputs` applies it with slices
        (:func:`~mambalab.ref.mamba3.halves_to_pairs`), whose backward is cheaper than indexing's."""
        return halves_order(self.d_state, self.num_rope_angles, device=device)

    def scan_inputs(self, projected: torch.Tensor) -> dict:
        """in_proj's output (..., sum(split_sizes)) -> the scan's keyword arguments, for a sequence
        (... = b, l) or one token (... = b). Shapes below for the sequence; a token drops l."""
        z, x, B, C, dd_dt, dd_A, trap, angle = projected.split(self.split_sizes(), dim=-1)
        r, g, n, h, p = self.mimo_rank, self.ngroups, self.d_state, self.nheads, self.headdim
        k = self.B_norm(B.unflatten(-1, (r, g, n)))                               # (b, l, r, g, n)
        q = self.C_norm(C.unflatten(-1, (r, g, n)))                               # (b, l, r, g, n)
        f = lambda t: t.to(torch.promote_types(t.dtype, torch.float32))         # fp32, or fp64 for fp64
        dt = F.softplus(f(dd_dt) + self.dt_bias)                                  # (b, l, h)
        A = (-F.softplus(f(dd_A))).clamp(max=-self.A_floor)                       # (b, l, h)
        omega = math.pi * torch.tanh(f(angle))                                    # (b, l, a)
        q_bias, k_bias, mimo = self.C_bias, self.B_bias, {}
        if self.is_mimo:
            mimo = {"mimo_v": self.mimo_x, "mimo_z": self.mimo_z, "mimo_o": self.mimo_o}
            # mamba-ssm's MIMO rotates the pairs (i, i + n/2): permute n (pair_order) so that they are adjacent
            a = self.num_rope_angles
            q, k, q_bias, k_bias = (halves_to_pairs(t, a) for t in (q, k, q_bias, k_bias))
        return dict(q=q, k=k, v=x.unflatten(-1, (h, p)), adt=A * dt, dt=dt,
                    trap=torch.sigmoid(f(trap)), q_bias=q_bias, k_bias=k_bias,
                    angles=omega.unsqueeze(-2).expand(*omega.shape[:-1], h, self.num_rope_angles),  # (b, l, h, a)
                    D=self.D, z=None if self.is_outproj_norm else z.unflatten(-1, (h, p)), **mimo)

    # ------------------------------------------------------------------------------------------ forward
    def forward(self, u: torch.Tensor, seq_idx=None, cu_seqlens=None, inference_params=None, *,
                initial_state: Mamba3State | None = None, return_final_state: bool = False):
        """u (b, l, d_model) -> out (b, l, d_model), or (out, final_state) with ``return_final_state``.

        cu_seqlens: packed variable-length sequences, as mamba-ssm's Mamba3 takes them: u (1, l, d_model) holds
            the sequences end to end, (num_seqs + 1,) integers 0 = cu_0 < … < cu_S = l mark where each starts;
            each runs as if alone, from a zero state or its own initial_state, and final states
            (return_final_state, inference_params) are per sequence: num_seqs leading in place of b.
        seq_idx: not used (mamba-ssm's Mamba3 reads only cu_seqlens): must be None.
        inference_params: mamba-ssm's ``InferenceParams``: this layer's mamba-ssm-layout state tuple lives in
            its ``key_value_memory_dict[layer_idx]``; at ``seqlen_offset == 0`` the prompt runs from a zero
            state and fills it, after that each call is one :meth:`step` (l = 1).
        initial_state: keyword-only, a :class:`~mambalab.ref.mamba3.Mamba3State` to continue from (e.g. after
            a prefill); final_state is the state after the last position, ready for :meth:`step`.
        """
        if seq_idx is not None:
            raise NotImplementedError("seq_idx: Mamba3 takes packed sequences through cu_seqlens (num_seqs + 1,), "
                                      "as mamba-ssm's Mamba3 does; pass seq_idx=None")
        if u.dim() != 3 or u.shape[-1] != self.d_model:
            raise ValueError(f"u must have shape (b, l, d_model={self.d_model}); got {tuple(u.shape)}")
        if inference_params is not None:
            if initial_state is not None or return_final_state:
                raise ValueError("inference_params keeps the state itself: pass neither initial_state nor "
                                 "return_final_state with it")
            cache = self._get_states_from_cache(inference_params, u.shape[0] if cu_seqlens is None
                                                else cu_seqlens.shape[0] - 1)   # a state per sequence
            if inference_params.seqlen_offset > 0:
                return self.step(u, *cache)[0]
            out, state = self.forward(u, cu_seqlens=cu_seqlens, return_final_state=True)
            self._write_cache(state, cache)
            return out
        chunk_scan, _ = scan_functions(self.backend, self.reduction)
        projected = self.in_proj(u)
        packed = {} if cu_seqlens is None else {"cu_seqlens": cu_seqlens}
        y = chunk_scan(**self.scan_inputs(projected), initial_state=initial_state,
                       return_final_state=return_final_state, chunk_size=self.chunk_size, **packed)
        y, state = y if return_final_state else (y, None)                        # (b, l, h, p)
        y = y.flatten(-2)                                                        # (b, l, d)
        if self.is_outproj_norm:
            y = self.norm(y, projected[..., :self.d_inner])                      # z gates after the norm
        out = self.out_proj(y.to(u.dtype))                                       # (b, l, d_model)
        return (out, state) if return_final_state else out

    # ------------------------------------------------------------------------------------------ decoding
    def zero_state(self, batch_size: int, dtype=None) -> Mamba3State:
        """mambalab's zeroed :class:`~mambalab.ref.mamba3.Mamba3State` for :meth:`step`: angle (b, h, a),
        ssm (b, h, p, n), k (b, h, r, n) and v (b, h, p), in fp32 (fp64 for a fp64 block or ``dtype``).

        Zero k and v mean "no previous token", so stepping from this state equals :meth:`forward` from the
        start."""
        weight = self.in_proj.weight
        dtype = torch.promote_types(dtype or weight.dtype, torch.float32)
        return zero_state(batch_size, self.nheads, self.headdim, self.d_state, self.mimo_rank,
                          self.num_rope_angles, dtype, weight.device)

    def allocate_inference_cache(self, batch_size: int, max_seqlen: int | None = None, device=None, dtype=None,
                                 inplace_state=None, **kwargs):
        """Zeroed ``(angle_state (b, h, a), ssm_state (b, h, p, n), k_state (b, r, h, n), v_state (b, h, p))``:
        mamba-ssm's tuple, layouts and dtypes (angle and ssm fp32, or fp64 in a fp64 block; k and v in
        ``dtype``, default the block's), for ``step(u, angle_state, ssm_state, k_state, v_state)``.

        ``max_seqlen``, ``inplace_state`` and ``kwargs`` are accepted for mamba-ssm's signature and unused:
        the state does not grow with length. For mambalab's state object use :meth:`zero_state`.
        """
        weight = self.in_proj.weight
        device = weight.device if device is None else device
        dtype = weight.dtype if dtype is None else dtype
        wide = torch.promote_types(weight.dtype, torch.float32)
        b, h, p, n, r = batch_size, self.nheads, self.headdim, self.d_state, self.mimo_rank
        return (torch.zeros(b, h, self.num_rope_angles, device=device, dtype=wide),
                torch.zeros(b, h, p, n, device=device, dtype=wide),
                torch.zeros(b, r, h, n, device=device, dtype=dtype),
                torch.zeros(b, h, p, device=device, dtype=dtype))

    def _get_states_from_cache(self, inference_params, batch_size: int, initialize_states: bool = False):
        """This layer's mamba-ssm-layout state tuple in ``inference_params.key_value_memory_dict``, made on
        first use (zeroed again with ``initialize_states``)."""
        return states_from_cache(self, inference_params, batch_size, initialize_states)

    def state_from_cache(self, cache) -> Mamba3State:
        """mamba-ssm's ``(angle_state, ssm_state, k_state, v_state)`` -> mambalab's Mamba3State (new tensors in
        the compute dtype; k to (b, h, r, n), and n permuted to the kernels' pair order in a MIMO block)."""
        angle, ssm, k, v = cache
        cd = torch.promote_types(self.in_proj.weight.dtype, torch.float32)
        k = k.transpose(1, 2)                                                   # (b, h, r, n)
        if self.is_mimo:
            ssm, k = (halves_to_pairs(t, self.num_rope_angles) for t in (ssm, k))
        return Mamba3State(angle.to(cd), ssm.to(cd), k.to(cd), v.to(cd))

    def _write_cache(self, state: Mamba3State, cache) -> None:
        """Copy a Mamba3State into mamba-ssm's tuple ``cache``, in place (its layouts and dtypes)."""
        ssm, k = state.ssm, state.k
        if self.is_mimo:
            ssm, k = (pairs_to_halves(t, self.num_rope_angles) for t in (ssm, k))
        for dst, src in zip(cache, (state.angle, ssm, k.transpose(1, 2), state.v)):
            dst.copy_(src)

    def step(self, u: torch.Tensor, *state, **kwargs):
        """Decode one token, in either of two forms.

        ``step(u, state)`` (mambalab's): u (b, 1, d_model) and a :class:`~mambalab.ref.mamba3.Mamba3State`
        (or mamba-ssm's tuple, converted) -> (out (b, 1, d_model), new Mamba3State); ``state`` is not modified.

        ``step(u, angle_state, ssm_state, k_state, v_state)`` (mamba-ssm's): u (b, d_model) or (b, 1, d_model)
        and mamba-ssm's tuple (:meth:`allocate_inference_cache`), updated in place -> (out of u's shape,
        angle_state, ssm_state, k_state, v_state). ``kwargs`` are ignored, as mamba-ssm's step ignores them.

        Stepping over a sequence from a zero state gives the outputs of :meth:`forward` on the whole sequence.
        The Triton step kernel has no backward: call it under ``torch.no_grad()`` (or use the reference backend).
        """
        if len(state) not in (1, 4):
            raise TypeError(f"step takes u and one state (a Mamba3State) or mamba-ssm's four state tensors "
                            f"(angle_state, ssm_state, k_state, v_state); got {len(state)} state arguments")
        token = u.unsqueeze(1) if len(state) == 4 and u.dim() == 2 else u
        validate.one_token("u", token, self.d_model)
        current = state[0] if len(state) == 1 else state
        if not isinstance(current, Mamba3State):
            current = self.state_from_cache(current)
        _, step = scan_functions(self.backend)
        projected = self.in_proj(token[:, 0])
        y, new = step(current, **self.scan_inputs(projected))                   # (b, h, p)
        y = y.flatten(-2)                                                       # (b, d)
        if self.is_outproj_norm:
            y = self.norm(y, projected[..., :self.d_inner])
        out = self.out_proj(y.to(u.dtype)).unsqueeze(1)                          # (b, 1, d_model)
        if len(state) == 1:
            return out, new
        self._write_cache(new, state)
        return (out.squeeze(1) if u.dim() == 2 else out), *state

    def extra_repr(self) -> str:
        return (f"d_model={self.d_model}, d_inner={self.d_inner}, d_state={self.d_state}, nheads={self.nheads}, "
                f"headdim={self.headdim}, ngroups={self.ngroups}, rope_angles={self.num_rope_angles}, "
                f"mimo_rank={self.mimo_rank}, chunk_size={self.chunk_size}, backend={self.backend!r}, "
                f"is_outproj_norm={self.is_outproj_norm}")
