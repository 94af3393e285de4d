# Ported from state-spaces/mamba, tests/ops/triton/test_layernorm_gated.py at tag v2.3.2.post1
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
# Changed from upstream: ``layernorm_fn`` is bound to mambalab.modules.norm.layernorm_fn (the functional form of
# mambalab.modules.GatedRMSNorm / GatedLayerNorm); ``rms_norm_ref`` is mamba-ssm's own, loaded through
# mambalab.oracle; device is CUDA when available, else the CPU; on the CPU only d = 2048 of upstream's list runs,
# on batch 2 × seqlen 64 rows instead of 16 × 1024. References, tolerances and assertions are upstream's.
"""mamba-ssm's gated LayerNorm / RMSNorm test, run on mambalab's ``layernorm_fn``."""
import math

import torch
import torch.nn.functional as F

import pytest

from einops import rearrange, repeat

from mambalab import oracle
from mambalab.modules.norm import layernorm_fn

from upstream.sizes import DEVICE, gpu_or_cpu

rms_norm_ref = oracle.module("ops.triton.layernorm_gated").rms_norm_ref


@pytest.mark.parametrize("norm_before_gate", [True, False])
# @pytest.mark.parametrize("norm_before_gate", [False])
@pytest.mark.parametrize("has_group", [False, True])
# @pytest.mark.parametrize("has_group", [False])
@pytest.mark.parametrize("is_rms_norm", [False, True])
# @pytest.mark.parametrize("is_rms_norm", [True])
@pytest.mark.parametrize("has_z", [False, True])
# @pytest.mark.parametrize("has_z", [True])
@pytest.mark.parametrize("has_bias", [False, True])
# @pytest.mark.parametrize("has_bias", [False])
# @pytest.mark.parametrize('dtype', [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize('dtype', [torch.float16])
# @pytest.mark.parametrize("wtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("wtype", [torch.float32])
@pytest.mark.parametrize('d', gpu_or_cpu([2048, 4096], [2048]))
# @pytest.mark.parametrize('d', [4096])
def test_layer_norm_gated(d, dtype, wtype, has_bias, has_z, is_rms_norm, has_group, norm_before_gate):
    if not has_z and not norm_before_gate:
        pytest.skip()
    if not norm_before_gate and not is_rms_norm:  # Reference LN isn't implemented for this case yet
        pytest.skip()
    device = DEVICE
    rtol, atol = (1e-5, 1e-5) if dtype == torch.float32 else (1e-2, 8e-3)
    group_size = None if not has_group else 64
    # set seed
    torch.random.manual_seed(0)
    batch = gpu_or_cpu(16, 2)
    seqlen = gpu_or_cpu(1024, 64)
    x = torch.randn(batch, seqlen, d, dtype=dtype, device=device, requires_grad=True)
    if has_z:
        z = torch.randn(batch, seqlen, d, dtype=dtype, device=device, requires_grad=True)
    else:
        z = None
    weight = torch.randn(d, dtype=wtype, device=device, requires_grad=True)
    if has_bias:
        bias = torch.randn(d, dtype=wtype, device=device, requires_grad=True)
    else:
        bias = None
    x_ref = x.detach().clone().requires_grad_()
    x_pt = x.detach().clone().requires_grad_()
    z_ref = z.detach().clone().requires_grad_() if z is not None else None
    z_pt = z.detach().clone().requires_grad_() if z is not None else None
    weight_ref = weight.detach().clone().requires_grad_()
    weight_pt = weight.detach().clone().requires_grad_()
    bias_ref = bias.detach().clone().requires_grad_() if bias is not None else None
    bias_pt = bias.detach().clone().requires_grad_() if bias is not None else None
    out = layernorm_fn(x, weight, bias, z=z, eps=1e-5, group_size=group_size, norm_before_gate=norm_before_gate,
                       is_rms_norm=is_rms_norm)
    if not is_rms_norm:
        if not has_group:
            out_ref = F.layer_norm(x_ref.float(), (d,), weight=weight_ref.float(), bias=bias_ref.float() if bias_ref is not None else None, eps=1e-5)
            out_pt = F.layer_norm(x_pt.to(wtype), (d,), weight=weight_pt, bias=bias_pt, eps=1e-5)
        else:
            out_ref = rearrange(F.layer_norm(rearrange(x_ref, "... (g d) -> ... g d", d=group_size).float(), (group_size,), eps=1e-5), "... g d -> ... (g d)") * weight_ref.float()
            if has_bias:
                out_ref = out_ref + bias_ref.float()
            out_pt = rearrange(F.layer_norm(rearrange(x_pt, "... (g d) -> ... g d", d=group_size), (group_size,), eps=1e-5), "... g d -> ... (g d)") * weight_pt
            if has_bias:
                out_pt = out_pt + bias_pt
        if has_z and norm_before_gate:
            out_ref = out_ref * F.silu(z_ref.float())
            out_pt = out_pt * F.silu(z_pt)
    else:
        out_ref = rms_norm_ref(x_ref, weight_ref, bias_ref, z=z_ref, eps=1e-5, group_size=group_size,
                               norm_before_gate=norm_before_gate)
        out_pt = rms_norm_ref(x_pt, weight_pt, bias_pt, z=z_pt, eps=1e-5, group_size=group_size,
                              norm_before_gate=norm_before_gate, upcast=False)
    print(f"Max diff = {(out - out_ref).abs().max().item()}")
    print(f"Max diff Pytorch = {(out_pt - out_ref).abs().max().item()}")
    assert (out - out_ref).abs().max().item() <= 2 * (out_pt - out_ref).abs().max().item() + atol

    g = torch.randn_like(out)
    out.backward(g)
    out_ref.backward(g)
    out_pt.backward(g)
    print(f"Max dx diff = {(x.grad - x_ref.grad).abs().max().item()}")
    print(f"Max dx diff Pytorch = {(x_pt.grad - x_ref.grad).abs().max().item()}")
    if has_z:
        print(f"Max dz diff = {(z.grad - z_ref.grad).abs().max().item()}")
        print(f"Max dz diff Pytorch = {(z_pt.grad - z_ref.grad).abs().max().item()}")
    print(f"Max dw diff = {(weight.grad - weight_ref.grad).abs().max().item()}")
    print(f"Max dw diff Pytorch = {(weight_pt.grad - weight_ref.grad).abs().max().item()}")
    if has_bias:
        print(f"Max db diff = {(bias.grad - bias_ref.grad).abs().max().item()}")
        print(f"Max db diff Pytorch = {(bias_pt.grad - bias_ref.grad).abs().max().item()}")
    assert (x.grad - x_ref.grad).abs().max().item() <= 2 * (x_pt.grad - x_ref.grad).abs().max().item() + atol
    if has_z:
        assert (z.grad - z_ref.grad).abs().max().item() <= 2 * (z_pt.grad - z_ref.grad).abs().max().item() + atol
    assert (weight.grad - weight_ref.grad).abs().max().item() <= 2 * (weight_pt.grad - weight_ref.grad).abs().max().item() + atol
    if has_bias:
        assert (bias.grad - bias_ref.grad).abs().max().item() <= 2 * (bias_pt.grad - bias_ref.grad).abs().max().item() + atol
