# Ported from state-spaces/mamba, tests/modules/test_mamba3_varlen.py at tag v2.3.2.post1
# (commit a14b1dff0454a3bc27d9eb31355dc01e4b2490ec), https://github.com/state-spaces/mamba
#
# Copyright (c) 2026, Dao AI Lab, Goombalab.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
#
# Changed from upstream: ``Mamba3`` is bound to mambalab.modules.Mamba3; device is CUDA when available, else
# the CPU (upstream skips without CUDA; its sizes are small enough for the CPU and are kept). Tolerances and
# assertions are upstream's.
"""
Mamba-3 module-level varlen tests.

Tests that MIMO (and SISO) produce identical outputs for packed varlen sequences
vs. running each sequence independently in non-varlen mode.

Copyright (c) 2026, Dao AI Lab, Goombalab.
"""
import pytest
import torch
import torch.nn.functional as F

from mambalab.modules import Mamba3

from upstream.sizes import DEVICE


def _require_cuda():
    """Upstream skips without CUDA; mambalab's kernels also run on the CPU (Triton's interpreter), so this port
    runs there too, on DEVICE."""


# ---------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------

def _make_model(is_mimo: bool, **kwargs) -> Mamba3:
    defaults = dict(
        d_model=128,
        d_state=64,
        expand=2,
        headdim=64,
        ngroups=1,
        is_mimo=is_mimo,
        mimo_rank=2,
        chunk_size=16,
        layer_idx=0,
        device=DEVICE,
        dtype=torch.bfloat16,
    )
    defaults.update(kwargs)
    model = Mamba3(**defaults).eval()
    return model


def _pack_sequences(seqs):
    """Pack a list of (1, Li, d) tensors into (1, sum(Li), d)."""
    return torch.cat(seqs, dim=1)


def _cu_seqlens(lengths, device):
    lens = torch.tensor(lengths, dtype=torch.int32, device=device)
    # cumsum on int32 promotes to int64 on CUDA; cast back before padding
    return F.pad(torch.cumsum(lens, dim=0).to(torch.int32), (1, 0))


# ---------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("is_mimo", [False, True])
def test_mamba3_varlen_matches_nonvarlen(is_mimo):
    """Packed varlen output should match per-sequence non-varlen output."""
    _require_cuda()
    torch.manual_seed(0)

    model = _make_model(is_mimo=is_mimo)
    d_model = model.d_model
    lengths = [17, 25]  # two sequences, neither a multiple of chunk_size=16
    device = DEVICE

    # Build individual inputs
    seqs = [torch.randn(1, L, d_model, device=device, dtype=torch.bfloat16) for L in lengths]

    # Run model on each sequence independently (non-varlen reference)
    with torch.no_grad():
        outs_ref = [model(s) for s in seqs]

    # Run model on packed sequence (varlen)
    packed = _pack_sequences(seqs)
    cu_sl = _cu_seqlens(lengths, device)
    with torch.no_grad():
        out_varlen = model(packed, cu_seqlens=cu_sl)

    # Compare each slice against its reference
    atol = 5e-2  # bfloat16 + chunked cumsum accumulates some error
    offset = 0
    for i, (L, ref) in enumerate(zip(lengths, outs_ref)):
        slc = out_varlen[:, offset : offset + L]
        assert torch.allclose(slc, ref, atol=atol), (
            f"Sequence {i} (length {L}): max diff = {(slc - ref).abs().max():.4f}"
        )
        offset += L


@pytest.mark.parametrize("is_mimo", [False, True])
def test_mamba3_varlen_backward(is_mimo):
    """Backward pass through varlen mode should produce finite gradients."""
    _require_cuda()
    torch.manual_seed(1)

    model = _make_model(is_mimo=is_mimo)
    d_model = model.d_model
    lengths = [19, 29, 37]
    device = DEVICE

    packed = torch.randn(
        1, sum(lengths), d_model, device=device, dtype=torch.bfloat16, requires_grad=True
    )
    cu_sl = _cu_seqlens(lengths, device)

    out = model(packed, cu_seqlens=cu_sl)
    out.float().sum().backward()

    assert packed.grad is not None, "No gradient for input"
    assert torch.isfinite(packed.grad).all(), "Non-finite gradient for input"
    for name, param in model.named_parameters():
        if param.requires_grad:
            assert param.grad is not None, f"No gradient for param {name}"
            assert torch.isfinite(param.grad).all(), f"Non-finite gradient for param {name}"
