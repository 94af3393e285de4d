# Ported from state-spaces/mamba, tests/test_generation.py at tag v2.3.2.post1
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
# Changed from upstream: ``MambaLMHeadModel`` is bound to an adapter over mambalab.modules.MambaLM (below the
# imports: mamba-ssm's constructor, forward signature and CausalLMOutput; mamba-ssm's own GenerationMixin, so
# ``model.generate`` is mamba-ssm's decoding loop driving our model); ``MambaConfig`` and ``InferenceParams``
# are mamba-ssm's own, through mambalab.oracle (on the CPU its decode() gets a stand-in for the torch.cuda.Event
# it makes and does not use). Device: CUDA when available, else the CPU; on the CPU
# d_model 64 and 2 layers instead of 1024 and 4, and cg=False (CUDA graphs need a GPU). Tolerances and
# assertions are upstream's.
"""mamba-ssm's generation tests (teacher-forced decoding against the full forward; packed prompts), run on
mambalab's MambaLM through mamba-ssm's own generation loop.

What the adapter cannot carry over: MambaConfig's ``residual_in_fp32`` and ``fused_add_norm`` (MambaLM keeps its
residual stream in the model's dtype and has no fused add-norm; both leave these tests' comparisons, which are
of the model with itself, meaningful), its initialisation (mamba-ssm's ``_init_weights``), and ``rms_norm=False``
(MambaLM's norms are RMSNorms).
"""
from collections import namedtuple

import torch
import torch.nn.functional as F

import pytest

from einops import rearrange, repeat

from mambalab import oracle
from mambalab.modules.lm import LMConfig, MambaLM

from upstream.sizes import DEVICE, gpu_or_cpu

MambaConfig = oracle.module("models.config_mamba").MambaConfig
InferenceParams = oracle.module("utils.generation").InferenceParams
GenerationMixin = oracle.module("utils.generation").GenerationMixin

# mamba-ssm's Mamba2 constructor defaults, which MambaLMHeadModel's mixers take unless ssm_cfg overrides them
MAMBA2_DEFAULTS = dict(d_state=128, d_conv=4, expand=2, headdim=64, ngroups=1, chunk_size=256)


class _NoEvent:
    """Stands in for torch.cuda.Event on the CPU: mamba-ssm's decode() makes two unconditionally and uses them only
    when timing (``enable_timing``, off here)."""

    def __init__(self, enable_timing=False):
        pass

    def record(self):
        pass


@pytest.fixture(autouse=True)
def _mamba_ssm_decode_on_the_cpu(monkeypatch):
    """On the CPU, mamba-ssm's decoding loop runs with torch.cuda.Event a stand-in (CPU-only torch cannot make
    one). On a GPU nothing changes."""
    if DEVICE == "cpu":
        monkeypatch.setattr(torch.cuda, "Event", _NoEvent)


class MambaLMHeadModel(MambaLM, GenerationMixin):
    """mamba-ssm's ``MambaLMHeadModel(config, initializer_cfg=None, device=None, dtype=None)`` as mambalab's
    MambaLM: the vocabulary padded to ``pad_vocab_size_multiple``, ``ssm_cfg["layer"]`` the mixer (mamba-ssm's
    default "Mamba1"), ssm_cfg's other entries over mamba-ssm's Mamba2 defaults; ``forward(input_ids,
    position_ids=None, inference_params=None, num_last_tokens=0, **mixer_kwargs)`` returns
    ``CausalLMOutput(logits)``, with mixer_kwargs (seq_idx, cu_seqlens) handed to MambaLM's forward."""

    def __init__(self, config, initializer_cfg=None, device=None, dtype=None):
        ssm_cfg = dict(config.ssm_cfg)
        layer = ssm_cfg.pop("layer", "Mamba1")
        sizes = {k: ssm_cfg.pop(k, v) for k, v in MAMBA2_DEFAULTS.items()} if layer == "Mamba2" else {}
        vocab_size, multiple = config.vocab_size, config.pad_vocab_size_multiple
        if vocab_size % multiple != 0:
            vocab_size += multiple - (vocab_size % multiple)
        super().__init__(LMConfig(vocab_size=vocab_size, d_model=config.d_model, n_layer=config.n_layer,
                                  layer=layer, tie_embeddings=config.tie_embeddings, ssm_cfg=ssm_cfg, **sizes),
                         device=device, dtype=dtype)

    def forward(self, input_ids, position_ids=None, inference_params=None, num_last_tokens=0, **mixer_kwargs):
        logits = super().forward(input_ids, inference_params=inference_params, **mixer_kwargs)
        if num_last_tokens > 0:
            logits = logits[:, -num_last_tokens:]
        CausalLMOutput = namedtuple("CausalLMOutput", ["logits"])
        return CausalLMOutput(logits=logits)


def test_generation():
    batch = 3
    seqlen = 20
    device = DEVICE
    dtype = torch.float16

    config = MambaConfig(
        d_model=gpu_or_cpu(1024, 64),
        n_layer=gpu_or_cpu(4, 2),
        vocab_size=50277,
        ssm_cfg=dict(layer="Mamba2"),
        rms_norm=True,
        residual_in_fp32=True,
        fused_add_norm=True,
        pad_vocab_size_multiple=16,
    )
    torch.manual_seed(2357)
    model = MambaLMHeadModel(config, device=device, dtype=dtype)
    x = torch.randint(0, 1000, (batch, seqlen), device=device, dtype=torch.long)
    out_ref = model(x).logits
    prompt_len = seqlen // 2
    out = model.generate(
        input_ids = x[:, :prompt_len], max_length=seqlen, output_scores=True, return_dict_in_generate=True,
        cg=gpu_or_cpu(True, False),  # Can turn off CUDA graph for easier debugging
        # instead of sampling, we take output tokens from x, to get logits for testing
        # For actual generation, don't pass in teacher_outputs
        teacher_outputs=x,
    )
    out_scores = torch.stack(out.scores, dim=1)
    print(f"Max diff: {(out_scores - out_ref[:, prompt_len - 1: -1]).abs().max()}")
    assert torch.allclose(out_scores, out_ref[:, prompt_len - 1: -1], rtol=1e-3, atol=1e-2)


def test_generation_varlen():
    seqlens = [170, 65, 100]
    genlen = 20
    total_seqlen = sum(seqlens)
    device = DEVICE
    dtype = torch.float16

    config = MambaConfig(
        d_model=gpu_or_cpu(1024, 64),
        n_layer=gpu_or_cpu(4, 2),
        vocab_size=50277,
        ssm_cfg=dict(layer="Mamba2"),
        rms_norm=True,
        residual_in_fp32=True,
        fused_add_norm=True,
        pad_vocab_size_multiple=16,
    )
    torch.manual_seed(2357)
    model = MambaLMHeadModel(config, device=device, dtype=dtype)
    xs = [torch.randint(0, 1000, (1, seqlen), device=device, dtype=torch.long) for seqlen in seqlens]

    # Reference 1: Forward pass with seq_idx
    x = torch.cat(xs, dim=1)
    seq_idx = torch.cat([torch.full((ids.shape[1],), i, dtype=torch.int32, device=device)
                         for i, ids in enumerate(xs)], dim=0).unsqueeze(0)
    cu_seqlens = F.pad(torch.tensor(seqlens, device=device, dtype=torch.int32).cumsum(dim=0), (1, 0))
    out_ref = model(x, seq_idx=seq_idx).logits
    # Only take the last @genlen logits of each sequence
    out_ref = torch.cat([out_ref[:, cu_seqlens[i + 1] - genlen - 1:cu_seqlens[i + 1] - 1]
                         for i in range(len(seqlens))], dim=0)

    # Reference 2: Generate the last @genlen tokens of each sequence in a for loop
    out_loop = []
    for input_ids in xs:
        out = model.generate(
            input_ids=input_ids[:, :-genlen], max_length=input_ids.shape[1], output_scores=True,
            return_dict_in_generate=True, cg=gpu_or_cpu(True, False), teacher_outputs=input_ids,
        ).scores
        out_loop.append(torch.stack(out, dim=1))
    out_loop = torch.cat(out_loop, dim=0)
    print(f"Max diff between ref1 and ref2: {(out_loop - out_ref).abs().max()}")

    # Varlen generation
    input_ids = torch.cat([ids[:, :-genlen] for ids in xs], dim=1)
    prompt_seqlens = [seqlen - genlen for seqlen in seqlens]
    cu_seqlens = F.pad(torch.tensor(prompt_seqlens, device=device, dtype=torch.int32).cumsum(dim=0), (1, 0))
    seq_idx = torch.cat([torch.full((seqlen,), i, dtype=torch.int32, device=device)
                         for i, seqlen in enumerate(prompt_seqlens)], dim=0).unsqueeze(0)
    inference_params = InferenceParams(max_seqlen=2048, max_batch_size=len(seqlens))

    scores, sequences = [], []
    # Both seq_idx and cu_seqlens must be passed in for varlen generation
    logits = model(input_ids, inference_params=inference_params, seq_idx=seq_idx, cu_seqlens=cu_seqlens).logits
    logits = rearrange(logits[0, cu_seqlens[1:] - 1], "b d -> b 1 d")
    scores.append(logits)
    # In practice we should sample. In this case we take from the teacher_output for testing
    sampled_tokens = rearrange(torch.stack([ids[0, -genlen] for ids in xs], dim=0), "b -> b 1")
    sequences.append(sampled_tokens)
    for i in range(1, genlen):
        inference_params.seqlen_offset += 1
        logits = model(sampled_tokens, inference_params=inference_params, num_last_tokens=1).logits
        scores.append(logits)
        # In practice we should sample. In this case we take from the teacher_output for testing
        sampled_tokens = rearrange(torch.stack([ids[0, -genlen + i] for ids in xs], dim=0), "b -> b 1")
        sequences.append(sampled_tokens)
    out_varlen = torch.cat(scores, dim=1)
    print(f"Max diff: {(out_varlen - out_ref).abs().max()}")
    assert (out_varlen - out_ref).abs().max() < 2 * (out_loop - out_ref).abs().max()

def test_generation_varlen_with_padding():
    seqlens = [170, 65, 100]
    non_padded_seqlen = sum(seqlens)
    padded_seqlen = 512
    seqlens.append(padded_seqlen - non_padded_seqlen)
    genlen = 20
    total_seqlen = sum(seqlens)
    assert total_seqlen == padded_seqlen
    device = DEVICE
    dtype = torch.float16

    config = MambaConfig(
        d_model=gpu_or_cpu(1024, 64),
        n_layer=gpu_or_cpu(4, 2),
        vocab_size=50277,
        ssm_cfg=dict(layer="Mamba2"),
        rms_norm=True,
        residual_in_fp32=True,
        fused_add_norm=True,
        pad_vocab_size_multiple=16,
    )
    torch.manual_seed(2357)
    model = MambaLMHeadModel(config, device=device, dtype=dtype)
    xs = [torch.randint(0, 1000, (1, seqlen), device=device, dtype=torch.long) for seqlen in seqlens]

    # Reference 1: Forward pass with seq_idx
    x = torch.cat(xs[:-1], dim=1)
    seq_idx = torch.cat([torch.full((ids.shape[1],), i, dtype=torch.int32, device=device)
                         for i, ids in enumerate(xs[:-1])], dim=0).unsqueeze(0)
    cu_seqlens = F.pad(torch.tensor(seqlens[:-1], device=device, dtype=torch.int32).cumsum(dim=0), (1, 0))

    out_ref = model(x, seq_idx=seq_idx).logits
    # Only take the last @genlen logits of each sequence
    out_ref = torch.cat([out_ref[:, cu_seqlens[i + 1] - genlen - 1:cu_seqlens[i + 1] - 1]
                         for i in range(len(seqlens) - 1)], dim=0)

    # Reference 2: Generate the last @genlen tokens of each sequence in a for loop
    out_loop = []
    for input_ids in xs[:-1]:
        out = model.generate(
            input_ids=input_ids[:, :-genlen], max_length=input_ids.shape[1], output_scores=True,
            return_dict_in_generate=True, cg=gpu_or_cpu(True, False), teacher_outputs=input_ids,
        ).scores
        out_loop.append(torch.stack(out, dim=1))
    out_loop = torch.cat(out_loop, dim=0)
    print(f"Max diff between ref1 and ref2: {(out_loop - out_ref).abs().max()}")

    # Varlen generation
    input_ids = torch.cat([ids[:, :-genlen] for ids in xs], dim=1)
    prompt_seqlens = [seqlen - genlen for seqlen in seqlens]
    cu_seqlens = F.pad(torch.tensor(prompt_seqlens, device=device, dtype=torch.int32).cumsum(dim=0), (1, 0))
    seq_idx = torch.cat([torch.full((seqlen,), i, dtype=torch.int32, device=device)
                         for i, seqlen in enumerate(prompt_seqlens)], dim=0).unsqueeze(0)
    inference_params = InferenceParams(max_seqlen=2048, max_batch_size=len(seqlens))

    # Account for padding
    offset = genlen * len(seqlens)
    seq_idx[non_padded_seqlen - offset : padded_seqlen - offset] = -1
    cu_seqlens[-1] = cu_seqlens[-2]

    scores, sequences = [], []
    # Both seq_idx and cu_seqlens must be passed in for varlen generation
    logits = model(input_ids, inference_params=inference_params, seq_idx=seq_idx, cu_seqlens=cu_seqlens).logits
    logits = rearrange(logits[0, cu_seqlens[1:] - 1], "b d -> b 1 d")
    scores.append(logits)
    # In practice we should sample. In this case we take from the teacher_output for testing
    sampled_tokens = rearrange(torch.stack([ids[0, -genlen] for ids in xs], dim=0), "b -> b 1")
    sequences.append(sampled_tokens)
    for i in range(1, genlen):
        inference_params.seqlen_offset += 1
        logits = model(sampled_tokens, inference_params=inference_params, num_last_tokens=1).logits
        scores.append(logits)
        # In practice we should sample. In this case we take from the teacher_output for testing
        sampled_tokens = rearrange(torch.stack([ids[0, -genlen + i] for ids in xs], dim=0), "b -> b 1")
        sequences.append(sampled_tokens)
    out_varlen = torch.cat(scores, dim=1)

    print(f"Max diff: {(out_varlen[:-1] - out_ref).abs().max()}")
    assert (out_varlen[:-1] - out_ref).abs().max() < 2 * (out_loop - out_ref).abs().max()
