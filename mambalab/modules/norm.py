"""Gated RMSNorm, as Mamba-2 applies it to the SSD output before the output projection.

For x, z of shape (..., d), a weight w (d,), and the d channels cut into G = d / group_size groups of
``group_size`` consecutive channels (one group when ``group_size`` is None):

    norm_before_gate=False (Mamba-2's choice):   v = x ⊙ silu(z)
                                                 y = v / rms_k(v) ⊙ w
    norm_before_gate=True:                       y = x / rms_k(x) ⊙ w ⊙ silu(z)

    rms_k(v) = sqrt(mean of v_i² over the channels i of group k + eps)     for each channel of group k

Each group is normalised on its own: a group's output depends on its own channels (and weights) only. In
Mamba-2 the groups are the ngroups groups of heads that share B and C, so a tensor-parallel rank that holds
whole groups normalises them without any communication; one RMS over all d channels would need an
all-reduce of the sums of squares.

Computes in fp32 and returns x's dtype. Parameter name and shape follow mamba-ssm's ``RMSNormGated``
(``weight`` (d,), no bias), so state dicts interchange.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["GatedRMSNorm"]


class GatedRMSNorm(nn.Module):
    """y = rmsnorm(x ⊙ silu(z)) · weight, normalised within groups of ``group_size`` channels.

    Args:
        d: channels.
        eps: added to the mean square before the square root.
        group_size: channels per group (must divide d); None means one group of d.
        norm_before_gate: gate after normalising (y = rmsnorm(x) · weight ⊙ silu(z)) instead of before.
        device, dtype: of the weight (initialised to ones).
    """

    def __init__(self, d: int, eps: float = 1e-5, group_size: int | None = None, norm_before_gate: bool = False,
                 device=None, dtype=None):
        super().__init__()
        group_size = d if group_size is None else int(group_size)
        if group_size < 1 or d % group_size:
            raise ValueError(f"group_size must divide d = {d}; got {group_size}")
        self.d = d
        self.eps = eps
        self.group_size = group_size
        self.norm_before_gate = norm_before_gate
        self.weight = nn.Parameter(torch.ones(d, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor, z: torch.Tensor | None = None) -> torch.Tensor:
        """x (..., d), z (..., d) or None (no gate) -> (..., d) in x's dtype."""
        if x.shape[-1] != self.d:
            raise ValueError(f"x must have last dimension d = {self.d}; got shape {tuple(x.shape)}")
        if z is not None and z.shape != x.shape:
            raise ValueError(f"z must have x's shape {tuple(x.shape)}; got {tuple(z.shape)}")
        dtype = x.dtype
        v = x.float()
        gate = F.silu(z.float()) if z is not None else None
        if gate is not None and not self.norm_before_gate:
            v = v * gate
        groups = v.unflatten(-1, (self.d // self.group_size, self.group_size))  # (..., G, group_size)
        rstd = torch.rsqrt(groups.square().mean(dim=-1, keepdim=True) + self.eps)  # (..., G, 1)
        y = (groups * rstd).flatten(-2) * self.weight.float()                     # (..., d)
        if gate is not None and self.norm_before_gate:
            y = y * gate
        return y.to(dtype)

    def extra_repr(self) -> str:
        return (f"{self.d}, eps={self.eps}, group_size={self.group_size}, "
                f"norm_before_gate={self.norm_before_gate}")
