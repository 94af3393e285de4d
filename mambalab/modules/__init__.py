"""nn.Module blocks built on :mod:`mambalab.ops`, with mamba-ssm's parameter names so state dicts interchange,
and mamba-ssm's constructor and ``forward``/``step``/``allocate_inference_cache`` signatures so its callers
(its generation loop with ``InferenceParams`` included) drive them unchanged.

* :class:`Mamba1`: the Mamba-1 block (``mamba_ssm.modules.mamba_simple.Mamba``).
* :class:`Mamba2`: the Mamba-2 block (``mamba_ssm.modules.mamba2.Mamba2``), laid out by heads and groups.
* :class:`Mamba3`: the Mamba-3 block (``mamba_ssm.modules.mamba3.Mamba3``): trapezoidal, rotary state, MIMO.
* :class:`GatedRMSNorm` (alias :data:`RMSNormGated`) and :class:`GatedLayerNorm` (alias :data:`LayerNormGated`):
  norm(x) ⊙ silu(z) or norm(x ⊙ silu(z)) per group of channels (``mamba_ssm.ops.triton.layernorm_gated``).
* :class:`MambaLM`, :class:`LMConfig`: a small Mamba-2 language model (embedding, residual blocks, tied head).
"""
from mambalab.modules.lm import LMConfig, MambaLM
from mambalab.modules.mamba1 import Mamba1
from mambalab.modules.mamba2 import Mamba2
from mambalab.modules.mamba3 import Mamba3
from mambalab.modules.norm import GatedLayerNorm, GatedRMSNorm, LayerNormGated, RMSNormGated

__all__ = ["GatedLayerNorm", "GatedRMSNorm", "LMConfig", "LayerNormGated", "Mamba1", "Mamba2", "Mamba3", "MambaLM",
           "RMSNormGated"]
