"""The exercise checkers of chapter 07 accept reference solutions worked out by hand (the state's and the KV
cache's shapes multiplied out, a top-p filter written from its definition) and reject wrong answers without
raising."""
import mambalab  # noqa: F401  (before triton)
import pytest
import torch

from mambalab.exercises import ch07


@pytest.mark.parametrize("checker", [ch07.mamba2_layer_state_bytes, ch07.kv_cache_bytes, ch07.top_p_filter])
def test_a_blank_answer_reads_not_attempted_and_a_malformed_one_does_not_raise(checker, capsys):
    assert checker(None) is False and checker(...) is False
    assert "not attempted" in capsys.readouterr().out
    assert checker("not an answer") is False
    assert "✗" in capsys.readouterr().out


def test_mamba2_layer_state_bytes():
    # mamba2-2.7b: d_inner 5120, conv channels 5120 + 2·1·128 = 5376 over a window of 4, bf16;
    # 5120 / 64 = 80 heads of a (64, 128) fp32 state
    conv = 5376 * 4 * 2
    ssm = 80 * 64 * 128 * 4
    assert ch07.mamba2_layer_state_bytes(conv + ssm)
    assert not ch07.mamba2_layer_state_bytes(conv + ssm // 2)          # the state in bf16
    assert not ch07.mamba2_layer_state_bytes(ssm)                      # the conv state forgotten
    assert ch07.mamba2_layer_state_bytes(4 * (conv + ssm), batch=4)
    small = dict(vocab_size=32, d_model=32, n_layer=2, d_state=16, headdim=8, ngroups=4, expand=2, d_conv=4,
                 chunk_size=16)
    assert ch07.mamba2_layer_state_bytes((64 + 2 * 4 * 16) * 4 * 4 + 8 * 8 * 16 * 4, config=small, element_size=4)


def test_kv_cache_bytes(capsys):
    want = 2 * 64 * 65536 * 2560 * 2                                   # K and V, 64 layers, bf16
    assert want == 42_949_672_960
    assert ch07.kv_cache_bytes(want)
    assert not ch07.kv_cache_bytes(want // 2)                          # K alone
    assert "0.5×" in capsys.readouterr().out
    assert ch07.kv_cache_bytes(2 * 64 * 1024 * 2560 * 2, seqlen=1024)


def top_p_by_definition(logits, p):
    """Row by row: add tokens in order of decreasing probability until their mass reaches p."""
    out = torch.full_like(logits, float("-inf"))
    for row in range(logits.shape[0]):
        probs = logits[row].softmax(-1)
        mass = 0.0
        for i in probs.argsort(descending=True).tolist():
            out[row, i] = logits[row, i]
            mass += probs[i].item()
            if mass >= p:
                break
    return out


def test_top_p_filter_accepts_the_definition_and_rejects_near_misses(capsys):
    assert ch07.top_p_filter(top_p_by_definition)

    def one_too_few(logits, p):           # drops the token that makes the mass reach p
        sorted_logits, order = logits.sort(descending=True, dim=-1)
        drop = sorted_logits.softmax(-1).cumsum(-1) >= p
        return logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))

    assert not ch07.top_p_filter(one_too_few)
    assert not ch07.top_p_filter(lambda logits, p: logits)                      # keeps everything
    assert not ch07.top_p_filter(lambda logits, p: top_p_by_definition(logits, p).clamp(max=0))  # changes values
    assert not ch07.top_p_filter(lambda logits, p: 1 / 0)
    assert "ZeroDivisionError" in capsys.readouterr().out
