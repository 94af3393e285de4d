"""generate(): greedy equals the full forward's argmax, seeded sampling repeats, filters match transformers'."""
import warnings

import pytest
import torch

from mambalab.inference import (DecodeGraph, apply_repetition_penalty, filter_min_p, filter_top_k, filter_top_p,
                                generate, stream)
from mambalab.modules.lm import LMConfig, MambaLM

from conftest import KERNEL_DEVICE, benchmark_module

CONFIGS = {
    "mamba1": dict(layer="Mamba1", d_state=8, d_model=16, n_layer=1),   # its scan runs the kernel: 1/4 the programs
    "mamba2": dict(layer="Mamba2", d_state=8, headdim=8, ngroups=2, chunk_size=4, scan="reference"),
    "mamba3": dict(layer="Mamba3", d_state=8, headdim=8, ngroups=1, chunk_size=4, scan="reference"),
    "mamba3-mimo": dict(layer="Mamba3", d_state=8, headdim=8, ngroups=1, chunk_size=4, scan="reference",
                        ssm_cfg={"is_mimo": True, "mimo_rank": 2}),
}


def tiny(name):
    torch.manual_seed(0)
    model = MambaLM(LMConfig(**{"vocab_size": 50, "d_model": 32, "n_layer": 2, **CONFIGS[name]})).eval()
    with torch.no_grad():   # larger logits than the init's, so that argmaxes are not near-ties
        model.embedding.weight.mul_(20)
    return model.to(KERNEL_DEVICE)   # Mamba-1's scan has only its kernel: on the GPU where there is one


PROMPT = torch.randint(0, 50, (2, 5), generator=torch.Generator().manual_seed(1)).to(KERNEL_DEVICE)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_decoding_is_the_argmax_of_the_full_forward(name):
    model = tiny(name)
    out = generate(model, PROMPT, max_new_tokens=6)   # greedy by default, as mamba-ssm's and transformers' are
    assert out.shape == (2, 11) and torch.equal(out[:, :5], PROMPT)
    with torch.no_grad():
        logits = model(out)                          # teacher forcing on the generated sequence
    assert torch.equal(logits[:, 4:-1].argmax(-1), out[:, 5:])


@pytest.mark.parametrize("name", ["mamba2", "mamba3"])
def test_seeded_sampling_repeats_and_top_k_1_is_greedy(name):
    model = tiny(name)
    kw = dict(max_new_tokens=5, temperature=0.8, top_p=0.9, min_p=0.05, repetition_penalty=1.2, do_sample=True)
    a = generate(model, PROMPT, generator=torch.Generator(KERNEL_DEVICE).manual_seed(3), **kw)
    b = generate(model, PROMPT, generator=torch.Generator(KERNEL_DEVICE).manual_seed(3), **kw)
    assert torch.equal(a, b)
    greedy = generate(model, PROMPT, max_new_tokens=5)
    assert torch.equal(generate(model, PROMPT, max_new_tokens=5, top_k=1, temperature=1.3, do_sample=True,
                                generator=torch.Generator(KERNEL_DEVICE).manual_seed(4)), greedy)


def test_sampling_is_explicit_and_unused_sampling_arguments_are_named():
    model = tiny("mamba2")
    torch.manual_seed(0)
    greedy = generate(model, PROMPT, max_new_tokens=8)
    # at temperature 50 the distribution is nearly flat: 16 seeded draws all equal to the argmax would be chance
    hot = generate(model, PROMPT, max_new_tokens=8, temperature=50.0, do_sample=True,
                   generator=torch.Generator(KERNEL_DEVICE).manual_seed(0))
    assert not torch.equal(hot, greedy)
    with pytest.warns(UserWarning, match=r"do_sample.*temperature=50.0, top_p=0.9"):
        ignored = generate(model, PROMPT, max_new_tokens=8, temperature=50.0, top_p=0.9)
    assert torch.equal(ignored, greedy)
    with warnings.catch_warnings():
        warnings.simplefilter("error")                # greedy's own settings warn about nothing
        generate(model, PROMPT, max_new_tokens=2, temperature=0, top_k=1)


def test_eos_stops_and_streaming_yields_each_token_as_chosen():
    model = tiny("mamba2")
    greedy = generate(model, PROMPT[:1], max_new_tokens=6, temperature=0)
    eos = int(greedy[0, 7])                          # the third new token
    out = generate(model, PROMPT[:1], max_new_tokens=6, temperature=0, eos_token_id=eos)
    assert out.shape[1] <= 8 and int(out[0, -1]) == eos
    seen = []
    for i, token in enumerate(stream(model, PROMPT[:1], max_new_tokens=4, temperature=0)):
        seen.append(int(token[0]))
        assert seen == greedy[0, 5:6 + i].tolist()   # yielded before the next one is computed
    calls = []
    generate(model, PROMPT[:1], max_new_tokens=3, temperature=0, callback=lambda t: calls.append(int(t[0])))
    assert calls == greedy[0, 5:8].tolist()


def test_filters_match_transformers_logits_processors():
    lp = pytest.importorskip("transformers.generation.logits_process")
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 40, generator=g) * 3
    ids = torch.randint(0, 40, (3, 6), generator=g)
    for ours, theirs in [
        (filter_top_k(logits, 5), lp.TopKLogitsWarper(5)(ids, logits.clone())),
        (filter_top_p(logits, 0.7), lp.TopPLogitsWarper(0.7)(ids, logits.clone())),
        (filter_min_p(logits, 0.1), lp.MinPLogitsWarper(0.1)(ids, logits.clone())),
        (apply_repetition_penalty(logits, ids, 1.3), lp.RepetitionPenaltyLogitsProcessor(1.3)(ids, logits.clone())),
    ]:
        torch.testing.assert_close(ours, theirs)


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    kept = filter_top_p(logits, 0.8).isfinite()[0].tolist()
    assert kept == [True, True, False, False]
    assert filter_top_p(logits, 0.81).isfinite()[0].tolist() == [True, True, True, False]


def test_bad_arguments_are_named():
    model = tiny("mamba2")
    for kw, word in [(dict(top_p=0.0), "top_p"), (dict(temperature=-1), "temperature"),
                     (dict(min_p=2.0), "min_p"), (dict(repetition_penalty=0), "repetition_penalty")]:
        with pytest.raises(ValueError, match=word):
            generate(model, PROMPT, 2, **kw)
    with pytest.raises(ValueError, match="input_ids"):
        generate(model, PROMPT.float(), 2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")
@pytest.mark.parametrize("name", ["mamba1", "mamba2", "mamba3"])
def test_cuda_graph_decoding_emits_the_eager_tokens(name):
    model = tiny(name).cuda()
    prompt = PROMPT.cuda()
    eager = generate(model, prompt, max_new_tokens=8, temperature=0)
    assert torch.equal(generate(model, prompt, max_new_tokens=8, temperature=0, cg=True), eager)
    # the graph recorded above is replayed for a new prompt and length: its states take the new prefill
    other = torch.flip(prompt, dims=[1])[:, :5]
    graph = DecodeGraph.for_model(model, prompt.shape[0])
    assert torch.equal(generate(model, other, max_new_tokens=12, temperature=0, cg=True),
                       generate(model, other, max_new_tokens=12, temperature=0))
    assert DecodeGraph.for_model(model, prompt.shape[0]) is graph and graph.graph is not None


def test_cuda_graph_refuses_a_cpu_model():
    with pytest.raises(RuntimeError, match="CUDA"):
        DecodeGraph(tiny("mamba2").cpu(), batch_size=1)


def test_generation_benchmark_runs_on_a_tiny_config():
    bench = benchmark_module("bench_generation")
    row = bench.main(["--smoke"])["rows"][0]
    assert row["mambalab_eager"]["decode_ms_per_token"] > 0 and row["batch"] == 2


def test_num_last_tokens_gives_the_last_positions_logits():
    model = tiny("mamba2")
    with torch.no_grad():
        full = model(PROMPT)
        torch.testing.assert_close(model(PROMPT, num_last_tokens=1), full[:, -1:])
        torch.testing.assert_close(model(PROMPT, num_last_tokens=3), full[:, -3:])
