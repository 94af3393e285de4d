"""Triton kernels only. Each file: docstring (math, shapes) -> @triton.jit kernel(s) -> a launcher that takes
already-validated tensors. References live in :mod:`mambalab.ref`, autograd wiring and validation in
:mod:`mambalab.ops`."""
