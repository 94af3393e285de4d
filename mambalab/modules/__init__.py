"""nn.Module blocks built on :mod:`mambalab.ops`, with mamba-ssm's parameter names so state dicts interchange.

* :class:`Mamba1`: the Mamba-1 block (``mamba_ssm.modules.mamba_simple.Mamba``).
* :class:`Mamba2`: the Mamba-2 block (``mamba_ssm.modules.mamba2.Mamba2``), laid out by heads and groups.
* :class:`Mamba3`: the Mamba-3 block (``mamba_ssm.modules.mamba3.Mamba3``): trapezoidal, rotary state, MIMO.
* :class:`GatedRMSNorm`: rmsnorm(x ⊙ silu(z)) per group of channels (``mamba_ssm``'s ``RMSNormGated``).
* :class:`MambaLM`, :class:`LMConfig`: a small Mamba-2 language model (embedding, residual blocks, tied head).
"""
from mambalab.modules.lm import LMConfig, MambaLM
from mambalab.modules.mamba1 import Mamba1
from mambalab.modules.mamba2 import Mamba2
from mambalab.modules.mamba3 import Mamba3
from mambalab.modules.norm import GatedRMSNorm

__all__ = ["GatedRMSNorm", "LMConfig", "Mamba1", "Mamba2", "Mamba3", "MambaLM"]
