"""Fingerprints: a short hash that is equal exactly when two results have the same bits.

``fingerprint(obj)`` hashes (BLAKE2b, 8 bytes, printed as 16 hex characters) a canonical byte stream:

    tensor        "T" dtype shape, then its elements' bytes in row-major (logical) order, little-endian
    list / tuple  "L" length, then each item                     (a tuple hashes like the list)
    dict          "D" length, then each key (as text) and value, in the dict's order
    module        "M", then its named parameters (or their .grad with ``grads=True``) as an ordered dict
    None          "N"                                              (a parameter without a gradient)

What it ignores: the device (tensors are copied to the CPU), the memory layout (strides, contiguity,
storage offsets, lazy conjugate/negative views are resolved first) and ``requires_grad``. What it covers:
dtype, shape, every bit of every element (so 0.0 and -0.0 differ, and NaNs with different payloads), the
names of dict keys and parameters, and their order. Two machines that print the same fingerprint hold the
same bits; one flipped bit anywhere changes it (up to the 2⁻⁶⁴ chance of a collision).
"""
from __future__ import annotations

import hashlib
from collections.abc import Mapping

import torch

__all__ = ["DIGEST_BYTES", "fingerprint"]

DIGEST_BYTES = 8  # 16 hex characters: short enough to read aloud, a collision chance of 2⁻⁶⁴


def _canonical_bytes(t: torch.Tensor) -> bytes:
    if t.layout != torch.strided:
        raise TypeError(f"fingerprint takes dense (strided) tensors; got layout {t.layout}")
    t = t.detach().resolve_conj().resolve_neg().to("cpu").contiguous()
    if t.numel() == 0:
        return b""
    return t.reshape(-1).view(torch.uint8).numpy().tobytes()


def _feed(h, obj, grads: bool, where: str) -> None:
    if obj is None:
        h.update(b"N")
    elif isinstance(obj, torch.Tensor):
        h.update(f"T{obj.dtype}{tuple(obj.shape)}".encode())
        h.update(_canonical_bytes(obj))
    elif isinstance(obj, torch.nn.Module):
        params = [(name, p.grad if grads else p) for name, p in obj.named_parameters()]
        h.update(b"M")
        _feed(h, dict(params), False, where)
    elif isinstance(obj, Mapping):
        h.update(f"D{len(obj)}".encode())
        for key, value in obj.items():
            text = str(key).encode()
            h.update(f"K{len(text)}:".encode() + text)
            _feed(h, value, grads, f"{where}[{key!r}]")
    elif isinstance(obj, (list, tuple)):
        h.update(f"L{len(obj)}".encode())
        for i, item in enumerate(obj):
            _feed(h, item, grads, f"{where}[{i}]")
    else:
        raise TypeError(f"fingerprint takes a tensor, a list/tuple/dict of tensors or an nn.Module; "
                        f"{where} is a {type(obj).__name__}")


def fingerprint(obj, *, grads: bool = False) -> str:
    """16 hex characters that identify the exact bits of ``obj`` (see the module docstring for the format).

    Args:
        obj: a tensor; a list, tuple or dict of tensors (nested, None allowed); or an nn.Module, whose
            parameters are hashed by name, in ``named_parameters()`` order.
        grads: for a module, hash each parameter's ``.grad`` instead (None where a parameter has none).

    Raises:
        TypeError: for anything else (naming where in ``obj`` it sits), or for sparse tensors.
    """
    if grads and not isinstance(obj, torch.nn.Module):
        raise TypeError(f"grads=True needs an nn.Module (it hashes its parameters' .grad); got {type(obj).__name__}")
    h = hashlib.blake2b(digest_size=DIGEST_BYTES)
    _feed(h, obj, grads, "obj")
    return h.hexdigest()
