"""The inference chapter's helpers: cache sizes by formula agree with the allocated tensors, the corpus is
deterministic, the tokenizer round-trips, training lowers the loss, and each figure has its title and axes."""
import mambalab  # noqa: F401  (before triton)
import pytest
import torch

from mambalab.modules.lm import LMConfig, MambaLM
from mambalab.inference import memory
from mambalab.train import text as chartext
from mambalab.viz import inference_plots as ip

SMALL = LMConfig(vocab_size=40, d_model=32, n_layer=3, d_state=8, headdim=8, ngroups=2, chunk_size=16,
                 scan="reference")


def test_state_formula_counts_what_allocate_inference_cache_allocates():
    for dtype in (torch.float32, torch.bfloat16):
        model = MambaLM(SMALL).to(dtype)
        cache = model.allocate_inference_cache(batch_size=2, max_seqlen=4096, dtype=dtype)
        allocated = sum(t.numel() * t.element_size() for states in cache.values() for t in states)
        formula = memory.mamba2_state_bytes(SMALL, batch=2, conv_element_size=torch.finfo(dtype).bits // 8)
        assert allocated == formula["total"] == SMALL.n_layer * formula["per_layer"]
        # by hand: conv (b, d_inner + 2 g n, d_conv), ssm (b, h, p, n) fp32
        assert formula["conv"] == 2 * (64 + 2 * 2 * 8) * 4 * (torch.finfo(dtype).bits // 8)
        assert formula["ssm"] == 2 * 8 * 8 * 8 * 4


def test_measured_caches_match_the_formulas_and_only_the_kv_cache_grows():
    rows = memory.measure_cache_bytes(SMALL, [1024, 4096], batch=1, dtype=torch.bfloat16)
    state = memory.mamba2_state_bytes(SMALL)["total"]
    for row in rows:
        assert row["mamba2_bytes"] == state and row["how"] == "tensor bytes"
        assert row["kv_bytes"] == memory.kv_cache_bytes(row["seqlen"], SMALL.d_model, SMALL.n_layer) \
            == 2 * SMALL.n_layer * row["seqlen"] * SMALL.d_model * 2
    fig = ip.memory_figure(rows, state, memory.kv_cache_bytes(1, SMALL.d_model, SMALL.n_layer), title="t")
    assert len(fig.data) == 4 and fig.layout.xaxis.title.text and "MiB" in fig.layout.yaxis.title.text
    assert fig.data[1].y[1] == pytest.approx(4 * fig.data[1].y[0])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="max_memory_allocated needs a CUDA GPU")
def test_measured_on_a_gpu_with_max_memory_allocated():
    rows = memory.measure_cache_bytes(SMALL, [65536], dtype=torch.bfloat16, device="cuda")
    assert rows[0]["how"] == "torch.cuda.max_memory_allocated"
    assert rows[0]["kv_bytes"] >= memory.kv_cache_bytes(65536, SMALL.d_model, SMALL.n_layer)
    assert rows[0]["mamba2_bytes"] >= memory.mamba2_state_bytes(SMALL)["total"]


def test_corpus_is_deterministic_printable_and_the_tokenizer_round_trips():
    text = chartext.docstring_corpus(("json", "textwrap"))
    assert text == chartext.docstring_corpus(("json", "textwrap")) and len(text) > 1000
    assert all(ch == "\n" or " " <= ch <= "~" for ch in text)
    assert chartext.docstring_corpus(("json", "no_such_module_here")) == chartext.docstring_corpus(("json",))
    tok = chartext.CharTokenizer(text)
    assert tok.decode(tok.encode(text[:500])) == text[:500]
    with pytest.raises(ValueError, match="alphabet"):
        tok.encode("é")


def test_training_lowers_the_loss_and_sampling_figure_draws():
    text = chartext.docstring_corpus(("json",))
    tok = chartext.CharTokenizer(text)
    torch.manual_seed(0)
    model = MambaLM(LMConfig(**{**SMALL.to_dict(), "vocab_size": tok.vocab_size, "n_layer": 1}))
    losses = chartext.train_char_model(model, tok.encode(text), steps=30, batch_size=4, seq_len=32, lr=1e-2, warmup=5)
    assert len(losses) == 30 and sum(losses[-5:]) / 5 < losses[0] - 0.5
    a = ip.sampling_figure(model, tok, "Return the ", 0.8, 0.9, new_chars=20, seed=1)
    b = ip.sampling_figure(model, tok, "Return the ", 0.8, 0.9, new_chars=20, seed=1)
    assert a.layout.annotations[0].text == b.layout.annotations[0].text           # seeded
    assert "0.80" in a.layout.title.text and a.layout.yaxis.title.text == "probability"
    kept = sum(c != "#bbbbbb" for c in a.data[1].marker.color)
    narrow = ip.sampling_figure(model, tok, "Return the ", 0.8, 0.05, new_chars=5)
    assert sum(c != "#bbbbbb" for c in narrow.data[1].marker.color) <= kept


@pytest.mark.parametrize("layer", ["Mamba2", "Mamba3"])
def test_training_under_bf16_autocast_keeps_an_fp32_stream(layer):
    """The chapter's GPU setting (amp=True), on the CPU: under bf16 autocast the embedding's stream is fp32 and
    each mixer's output bf16; with more than one layer every residual add meets both, and training runs.
    (Mamba-1's mixer meets the same adds; its Triton scan in bf16 costs a minute in the CPU interpreter.)"""
    text = chartext.docstring_corpus(("json",))
    tok = chartext.CharTokenizer(text)
    torch.manual_seed(0)
    model = MambaLM(LMConfig(**{**SMALL.to_dict(), "vocab_size": tok.vocab_size, "n_layer": 2, "layer": layer}))
    losses = chartext.train_char_model(model, tok.encode(text), steps=2, batch_size=2, seq_len=16, warmup=1,
                                       amp=True)
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters() if p.requires_grad)


def test_speed_figures_have_titles_and_axes():
    fig = ip.decode_speed_figure({"eager": 1.0, "CUDA graph": 0.2}, note="n")
    assert fig.layout.yaxis.title.text == "time per token (ms)" and fig.layout.title.text
    fig = ip.mimo_decode_figure({1: {16: 5.0, 64: 9.0}, 4: {16: 6.0, 64: 10.0}}, note="n")
    assert len(fig.data) == 2 and fig.layout.xaxis.title.text and "µs" in fig.layout.yaxis.title.text


def test_decode_ms_per_token_runs_on_the_cpu():
    model = MambaLM(SMALL).eval()
    prompt = torch.zeros(1, 4, dtype=torch.long)
    assert ip.decode_ms_per_token(model, prompt, 24, cg=False, repeats=2) > 0
    with pytest.raises(ValueError, match="new_tokens"):
        ip.decode_ms_per_token(model, prompt, 1, cg=False)
