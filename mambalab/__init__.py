"""mambalab: a workbook on Mamba state-space models, from the selective scan to tensor-parallel training.

Importing this package first decides where kernels run (see :mod:`mambalab.device`): on a CUDA GPU, or on
the CPU through Triton's interpreter.

Glossary, used everywhere (references, kernels, modules, notebooks):
b batch · l sequence length · d channels (Mamba-1's d_inner) · n state size (d_state) · h heads ·
p head dimension · g groups of B/C (g divides d or h) · q chunk size · c number of chunks · r MIMO rank ·
a rotary angle pairs (Mamba-3, whose scan names C, B and x as q, k and v).
"""
from mambalab import device  # noqa: F401  (must come before anything imports triton)

__version__ = "0.1.0"
