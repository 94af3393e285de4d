# Ported from state-spaces/mamba, tests/ops/triton/test_ssd.py at tag v2.3.2.post1
# (commit a14b1dff0454a3bc27d9eb31355dc01e4b2490ec), https://github.com/state-spaces/mamba
#
# Copyright 2023 Tri Dao, Albert Gu (the repository's LICENSE; this file carries no copyright line of its own)
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
# Changed from upstream: the packed (varlen) side, which upstream builds from mamba-ssm's internal kernels
# (_chunk_cumsum_fwd, _chunk_state_fwd and _state_passing_fwd with seq_idx, then chunk_state_varlen), is the
# public op that composes them, ``mamba_chunk_scan_combined(..., seq_idx=, cu_seqlens=,
# return_varlen_states=True)``, bound to mambalab.ops.ssd_chunk_scan (it needs a C, which only its output uses:
# drawn after upstream's tensors, so upstream's draws are unchanged, and the output is not compared). The
# per-sequence reference is upstream's, from mamba-ssm's own kernels (chunk_state, _chunk_cumsum_fwd,
# _state_passing_fwd) through mambalab.oracle, with one autotuning configuration each, their smallest (on a GPU
# too: all of them, 22 per dtype, cost a fresh machine a minute or more of compiling, and the reference's values
# do not depend on the tiles beyond rounding), on the CPU in Triton's interpreter (and torch.cuda.device, which
# their launchers enter, a no-op). Device: CUDA when
# available, else the CPU; on the CPU chunk_size 64, ngroups 1 and "max",
# fp32, with 3 sequences of dim 128 instead of 300 of dim 4096. Tolerances and assertions are upstream's.
"""mamba-ssm's SSD test (the varlen final states of packed sequences), run on mambalab.ops.ssd_chunk_scan."""
import contextlib
import math

import torch
import torch.nn.functional as F

import pytest

from einops import rearrange, repeat

import mambalab.ops
from mambalab import oracle

from upstream.sizes import DEVICE, ON_GPU, gpu_or_cpu

mamba_chunk_scan_combined = mambalab.ops.ssd_chunk_scan
_ssd_chunk_state = oracle.module("ops.triton.ssd_chunk_state")
_ssd_state_passing = oracle.module("ops.triton.ssd_state_passing")
chunk_state = _ssd_chunk_state.chunk_state
_chunk_cumsum_fwd = _ssd_chunk_state._chunk_cumsum_fwd
_state_passing_fwd = _ssd_state_passing._state_passing_fwd


@pytest.fixture(autouse=True)
def _mamba_ssm_kernels_on_the_cpu(monkeypatch):
    """mamba-ssm's kernels (the reference) try one autotuning configuration each, their smallest, not all of
    them (on a GPU: compile time saved; on the CPU: the interpreter cannot time them). On the CPU they run in
    Triton's interpreter, and their launchers' ``with torch.cuda.device(x.device.index)`` becomes a no-op (it
    needs CUDA)."""
    if not ON_GPU:
        monkeypatch.setattr(torch.cuda, "device", lambda index: contextlib.nullcontext())
    with oracle.single_config("mamba_ssm.ops.triton.ssd", smallest=True):
        yield


def detach_clone(*args):
    return tuple([arg.detach().clone().requires_grad_() if arg is not None else None for arg in args])


@pytest.mark.parametrize('dtype', gpu_or_cpu([torch.float32, torch.float16, torch.bfloat16], [torch.float32]))
# @pytest.mark.parametrize('dtype', [torch.bfloat16])
@pytest.mark.parametrize('ngroups', gpu_or_cpu([1, 2, 8, "max"], [1, "max"]))
# @pytest.mark.parametrize('ngroups', [1])
@pytest.mark.parametrize('chunk_size', gpu_or_cpu([64, 128], [64]))
# @pytest.mark.parametrize('chunk_size', [128])
def test_chunk_state_varlen(chunk_size, ngroups, dtype):
    device = DEVICE
    rtol, atol = (1e-2, 3e-3)
    # set seed
    torch.random.manual_seed(chunk_size + (ngroups if ngroups != "max" else 64))
    batch = gpu_or_cpu(300, 3)
    seqlens = torch.randint(1, 200, (batch,), device=device)
    # batch = 3
    # seqlens = torch.tensor([201, 56, 5], device=device)
    cu_seqlens = F.pad(seqlens.cumsum(0), (1, 0))
    total_seqlen = seqlens.sum().item()
    seq_idx = torch.cat([torch.full((s,), i, dtype=torch.int32, device=device) for i, s in enumerate(seqlens)], dim=0).unsqueeze(0)
    dim = gpu_or_cpu(4096, 128)
    # dim = 64
    headdim = 64
    # dim = 32
    dstate = 32
    assert dim % headdim == 0
    nheads = dim // headdim
    if ngroups == "max":
        ngroups = nheads
    assert nheads % ngroups == 0
    B = torch.randn(total_seqlen, ngroups, dstate, dtype=dtype, device=device) / 5
    x = torch.randn(total_seqlen, nheads, headdim, dtype=dtype, device=device)
    A = -0.1 * (torch.rand(nheads, device=device))
    dt = F.softplus(torch.randn(total_seqlen, nheads, device=device, dtype=torch.float32) - 4)
    # upstream, from mamba-ssm's internals (what mamba_chunk_scan_combined runs with these arguments):
    #   dA_cumsum, dt_rounded = _chunk_cumsum_fwd(dt.unsqueeze(0), A, chunk_size)
    #   chunk_states = _chunk_state_fwd(B.unsqueeze(0), x.unsqueeze(0), dt_rounded, dA_cumsum, seq_idx=seq_idx)
    #   chunk_states, _ = _state_passing_fwd(rearrange(chunk_states, "... p n -> ... (p n)"),
    #                                        dA_cumsum[:, :, :, -1], seq_idx=seq_idx, chunk_size=chunk_size)
    #   ... out = chunk_state_varlen(B, x, dt_rounded, dA_cumsum, cu_seqlens, chunk_states)
    C = torch.randn(total_seqlen, ngroups, dstate, dtype=dtype, device=device) / 5   # only the output reads C
    _, out = mamba_chunk_scan_combined(x.unsqueeze(0), dt.unsqueeze(0), A, B.unsqueeze(0), C.unsqueeze(0),
                                       chunk_size, seq_idx=seq_idx, cu_seqlens=cu_seqlens,
                                       return_varlen_states=True)
    out_ref = []
    for b in range(batch):
        x_s = x[cu_seqlens[b]:cu_seqlens[b + 1]].unsqueeze(0)
        B_s = B[cu_seqlens[b]:cu_seqlens[b + 1]].unsqueeze(0)
        dt_s = dt[cu_seqlens[b]:cu_seqlens[b + 1]].unsqueeze(0)
        dA_cumsum_s, dt_rounded_s = _chunk_cumsum_fwd(dt_s, A, chunk_size)
        states = chunk_state(B_s, x_s, dt_rounded_s, dA_cumsum_s)
        _, final_states = _state_passing_fwd(rearrange(states, "... p n -> ... (p n)"), dA_cumsum_s[:, :, :, -1],
                                             chunk_size=chunk_size)
        final_states = rearrange(final_states, "... (p n) -> ... p n", n=dstate)
        out_ref.append(final_states)
    out_ref = torch.cat(out_ref, dim=0)
    print(f"Max diff = {(out - out_ref).abs().max().item()}")
    assert torch.allclose(out, out_ref, rtol=rtol, atol=atol)
