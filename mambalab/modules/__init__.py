"""nn.Module blocks built on :mod:`mambalab.ops`, with mamba-ssm's parameter names so state dicts interchange.

* :class:`Mamba1`: the Mamba-1 block (``mamba_ssm.modules.mamba_simple.Mamba``).
"""
from mambalab.modules.mamba1 import Mamba1

__all__ = ["Mamba1"]
